//! The `kvwire` command line: benchmarks, trace replay, device listing.
//! Each subcommand lives in its own module file next to this one.

mod bench;
mod ceiling;
mod devices;
mod pattern;
mod replay;
mod serve;
mod units;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kvwire", version, about = "Move paged KV caches between inference engines")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once at start-up
enum Command {
    /// perftest/nixlbench-style bandwidth, latency and post-cost benchmark.
    Bench(bench::BenchArgs),
    /// Internal: the target side of `bench`, started as a child process.
    #[command(hide = true)]
    BenchTarget(bench::TargetArgs),
    /// Disaggregated prefill → decode replay of a request trace (the main job).
    Replay(replay::ReplayArgs),
    /// Internal: the decode side of `replay`, started as a child process.
    #[command(hide = true)]
    ReplayDecode(replay::DecodeArgs),
    /// Serve transfers as agent NAME, published in etcd, until killed (with --pull: also a decode engine).
    Serve(serve::ServeArgs),
    /// List RDMA devices, ports, MTUs, link layers and GID tables.
    Devices(devices::DevicesArgs),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Bench(a) => bench::run(a),
        Command::BenchTarget(a) => bench::run_target(a),
        Command::Replay(a) => replay::run(a),
        Command::ReplayDecode(a) => replay::run_decode(a),
        Command::Serve(a) => serve::run(a),
        Command::Devices(a) => devices::run(&a),
    }
}
