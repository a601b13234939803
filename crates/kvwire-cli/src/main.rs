//! The `kvwire` command line: benchmarks, trace replay, device listing.
//! Each subcommand lives in its own module file next to this one.

mod bench;
mod ceiling;
mod child;
mod devices;
mod dial;
mod failure;
mod memcheck;
mod pattern;
mod replay;
mod serve;
mod units;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use kvwire::transport::{TransportKind, options};

#[derive(Parser)]
#[command(name = "kvwire", version, about = "Move paged KV caches between inference engines")]
struct Cli {
    /// On failure, print every cause on its own line and a backtrace (with RUST_BACKTRACE=1).
    #[arg(short, long, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once at start-up
enum Command {
    /// perftest/nixlbench-style bandwidth, latency and post-cost benchmark.
    Bench(bench::BenchArgs),
    /// Disaggregated prefill → decode replay of a request trace (the main job).
    Replay(replay::ReplayArgs),
    /// Serve transfers as agent NAME, published in etcd, until killed (with --pull: also a decode engine).
    Serve(serve::ServeArgs),
    /// List RDMA devices, ports, MTUs, link layers and GID tables.
    Devices(devices::DevicesArgs),
}

/// The helper processes `bench` and `replay` start: a parser of their own,
/// so that the user-facing one never suggests them for a typo.
#[derive(Parser)]
#[command(name = "kvwire")]
struct InternalCli {
    #[arg(short, long)]
    verbose: bool,
    #[command(subcommand)]
    command: Internal,
}

#[derive(Subcommand)]
enum Internal {
    /// The target side of `bench`, started as a child process.
    BenchTarget(bench::TargetArgs),
    /// The decode side of `replay`, started as a child process.
    ReplayDecode(replay::DecodeArgs),
}

/// Names of the [`Internal`] subcommands.
const INTERNAL: [&str; 2] = ["bench-target", "replay-decode"];

/// Every backend's `key=value` options with units and defaults.
fn options_help() -> String {
    let mut out =
        String::from("Transport options (--option key=value, repeatable; a backend refuses keys it does not know):\n");
    for kind in [TransportKind::Shm, TransportKind::Tcp, TransportKind::Verbs] {
        let specs = options::specs(kind);
        if specs.is_empty() {
            out.push_str(&format!("\n  {kind}: no options\n"));
            continue;
        }
        out.push_str(&format!("\n  {kind}:\n"));
        for s in specs {
            out.push_str(&format!("    {:<15} {} (default: {})\n      {}\n", s.key, s.value, s.default, s.help));
        }
    }
    out
}

/// Colour log lines only on a terminal, and never with `NO_COLOR` set
/// (<https://no-color.org>): a file or pipe gets plain text.
fn colour_stderr() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .with_ansi(colour_stderr())
        .init();
    let first = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    if first.is_some_and(|f| INTERNAL.contains(&f.as_str())) {
        let cli = InternalCli::parse();
        failure::set_verbose(cli.verbose);
        let result = match cli.command {
            Internal::BenchTarget(a) => bench::run_target(a),
            Internal::ReplayDecode(a) => replay::run_decode(a),
        };
        return match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                failure::report(&e);
                ExitCode::FAILURE
            }
        };
    }
    // `--help` of the commands that take `--option` lists every backend's
    // options, from the table the backends parse them with.
    let mut cmd = Cli::command();
    for name in ["bench", "replay", "serve"] {
        cmd = cmd.mut_subcommand(name, |c| c.after_long_help(options_help()));
    }
    let cli = match Cli::from_arg_matches(&cmd.get_matches()) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    failure::set_verbose(cli.verbose);
    tracing::debug!("kvwire {} started", env!("CARGO_PKG_VERSION"));
    let result = match cli.command {
        Command::Bench(a) => bench::run(a),
        Command::Replay(a) => replay::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Devices(a) => devices::run(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            failure::report(&e);
            ExitCode::FAILURE
        }
    }
}
