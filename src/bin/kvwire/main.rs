//! The `kvwire` command line: benchmarks, trace replay, device listing.
//! Each subcommand lives in its own module file next to this one.

mod devices;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kvwire", version, about = "Move paged KV caches between inference engines")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List RDMA devices, ports, MTUs, link layers and GID tables.
    Devices(devices::DevicesArgs),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Devices(a) => devices::run(&a),
    }
}
