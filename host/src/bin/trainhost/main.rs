//! The `trainhost` command line: a thin layer over the library. Each
//! subcommand maps its flags onto the library's settings (`run.rs`,
//! `checkpoints.rs`); the library checks them.

/// `eprintln!` that writes the line whole (`out::line`) and does not panic
/// when stderr is closed (`trainhost run ... 2>&1 | head`): what cannot be
/// shown is dropped and the run goes on.
macro_rules! say {
    () => {
        crate::out::line(std::io::stderr(), format_args!(""))
    };
    ($($arg:tt)*) => {
        crate::out::line(std::io::stderr(), format_args!($($arg)*))
    };
}

/// `println!` that writes the line whole and does not panic when stdout is
/// closed (`trainhost checkpoints RUN | head -3`).
macro_rules! show {
    ($($arg:tt)*) => {
        crate::out::line(std::io::stdout(), format_args!($($arg)*))
    };
}

mod args;
mod checkpoints;
mod metrics;
mod out;
mod plot;
mod run;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Run training loops compiled to WebAssembly components as sandboxed
/// ranks, with checkpoints persisted, verified and restored by the host.
#[derive(Parser, Debug)]
#[command(name = "trainhost", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a guest component as N ranks and persist what it reports.
    ///
    /// Each rank gets a private scratch directory (its /scratch and
    /// $TMPDIR), the run's config, and the trainhost imports. Reported
    /// checkpoints are committed to <STORAGE>/<NAME>/checkpoint_NNNNNN.
    /// Running again with the same --storage and --name continues the run.
    Run(Box<run::RunArgs>),
    /// List a run's retained checkpoints, best first, with their metrics;
    /// the latest is marked with `*`.
    Checkpoints(checkpoints::CheckpointsArgs),
    /// Print a run's metrics history (metrics.jsonl): every report with
    /// its index, its checkpoint and its metrics, as a table, JSON or CSV.
    Metrics(metrics::MetricsArgs),
}

/// Large host buffers (collective payloads, copies of guest data) on huge
/// pages: see `HugePageAllocator`.
#[global_allocator]
static ALLOCATOR: trainhost::HugePageAllocator = trainhost::HugePageAllocator;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let quiet = matches!(&cli.command, Command::Run(args) if args.quiet);
    let default_level = if quiet { "warn" } else { "info" };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        // Its report of a failed write is an eprintln!, which panics when
        // stderr is closed: a log line that cannot be shown is dropped.
        .log_internal_errors(false)
        .init();
    let outcome = match cli.command {
        Command::Run(args) => run::run(*args),
        Command::Checkpoints(args) => checkpoints::checkpoints(args),
        Command::Metrics(args) => metrics::metrics(args),
    };
    match outcome {
        Ok(code) => code,
        Err(e) => {
            say!("error: {}", error_chain(&e));
            ExitCode::from(2)
        }
    }
}

/// The error and its causes, `: `-separated, leaving out a cause whose
/// text an outer message already carries (object_store's messages include
/// their sources).
fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
