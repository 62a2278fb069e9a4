//! The `trainhost` command line: a thin layer over the library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use trainhost::{RunConfig, ScalingConfig, Trainer};

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
    Run(RunArgs),
    /// List a run's committed checkpoints with their metrics.
    Checkpoints(CheckpointsArgs),
}

#[derive(Args, Debug)]
struct RunArgs {
    /// The guest: a WebAssembly component built for wasm32-wasip2 against
    /// the trainhost-guest SDK (or wit/trainhost.wit).
    guest: PathBuf,

    /// Number of ranks to run (Ray's num_workers).
    #[arg(short, long, default_value_t = 1, value_name = "N")]
    workers: u32,

    /// The loop's config: inline JSON, or @FILE to read it from a file.
    /// Every rank receives it unchanged.
    #[arg(short, long, value_name = "JSON|@FILE")]
    config: Option<String>,

    /// Where runs are stored: a directory, file:///abs/path, or memory://
    /// (kept only while the command runs).
    #[arg(short, long, value_name = "URL|DIR", default_value = trainhost::DEFAULT_STORAGE)]
    storage: String,

    /// The run's name, its directory in storage. Default: the guest's file
    /// name and the start time. An existing name continues that run.
    #[arg(short, long)]
    name: Option<String>,

    /// A committed checkpoint (directory or URL, of any run) to hand to the
    /// ranks through get-checkpoint until this run commits its own.
    #[arg(long, value_name = "URL|DIR")]
    resume_from: Option<String>,

    /// Write the run's result (checkpoints, metrics, history, error) to
    /// this file as JSON.
    #[arg(long, value_name = "FILE")]
    result_json: Option<PathBuf>,

    /// How long ranks wait for each other in report before the run fails
    /// naming the missing ranks, e.g. 90s, 30m, 2h.
    #[arg(long, value_name = "DURATION", default_value = "30m", value_parser = parse_duration)]
    report_timeout: Duration,
}

#[derive(Args, Debug)]
struct CheckpointsArgs {
    /// The run: its name under --storage, or its directory or URL.
    run: String,

    /// Where runs are stored, when RUN is a name.
    #[arg(short, long, value_name = "URL|DIR", default_value = trainhost::DEFAULT_STORAGE)]
    storage: String,

    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (write e.g. 90s, 30m, 2h)"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let outcome = match cli.command {
        Command::Run(args) => run(args),
        Command::Checkpoints(args) => checkpoints(args),
    };
    match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn read_config(arg: Option<&str>) -> anyhow::Result<serde_json::Value> {
    let Some(arg) = arg else {
        return Ok(serde_json::json!({}));
    };
    let (text, origin) = match arg.strip_prefix('@') {
        Some(path) => (
            std::fs::read_to_string(path)
                .with_context(|| format!("cannot read --config file {path}"))?,
            format!("--config file {path}"),
        ),
        None => (arg.to_owned(), "--config".to_owned()),
    };
    serde_json::from_str(&text).with_context(|| format!("{origin} is not valid JSON"))
}

fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let config = read_config(args.config.as_deref())?;
    let mut builder = Trainer::builder(args.guest.as_path())
        .train_loop_config(config)
        .scaling_config(ScalingConfig {
            num_workers: args.workers,
        })
        .run_config(RunConfig {
            name: args.name,
            storage_path: args.storage,
            report_timeout: args.report_timeout,
        });
    if let Some(location) = args.resume_from {
        builder = builder.resume_from_checkpoint(location);
    }
    let result = builder.build()?.fit()?;
    if let Some(path) = &args.result_json {
        let json = serde_json::to_vec_pretty(&result.to_json())?;
        std::fs::write(path, json)
            .with_context(|| format!("cannot write --result-json {}", path.display()))?;
    }
    eprintln!();
    eprintln!("run {} at {}", result.run_name, result.path);
    eprintln!(
        "  {} reports, {} checkpoints retained",
        result.metrics_history.len(),
        result.best_checkpoints.len()
    );
    if let Some(metrics) = &result.metrics {
        eprintln!("  last metrics: {metrics}");
    }
    if let Some(c) = &result.checkpoint {
        eprintln!("  latest checkpoint: {}", c.location());
    }
    match &result.error {
        None => Ok(ExitCode::SUCCESS),
        Some(e) => {
            eprintln!("error: the run failed: {e}");
            Ok(ExitCode::from(1))
        }
    }
}

fn checkpoints(args: CheckpointsArgs) -> anyhow::Result<ExitCode> {
    let location = if args.run.contains('/') || args.run.contains("://") {
        args.run.clone()
    } else {
        format!("{}/{}", args.storage.trim_end_matches('/'), args.run)
    };
    let list = trainhost::committed_checkpoints(&location)?;
    if args.json {
        let json: Vec<_> = list
            .iter()
            .map(|c| {
                serde_json::json!({
                    "index": c.index(),
                    "path": c.location(),
                    "metrics": c.metrics(),
                    "files": c.manifest().files.len(),
                    "bytes": c.manifest().total_bytes(),
                    "committed_at": c.manifest().committed_at,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&json)?);
        return Ok(ExitCode::SUCCESS);
    }
    if list.is_empty() {
        println!("{location}: no committed checkpoints");
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<18} {:>6} {:>12}  {:<20}  metrics",
        "checkpoint", "files", "bytes", "committed"
    );
    for c in &list {
        let name = c.location().rsplit('/').next().unwrap_or_default();
        println!(
            "{:<18} {:>6} {:>12}  {:<20}  {}",
            name,
            c.manifest().files.len(),
            c.manifest().total_bytes(),
            c.manifest().committed_at,
            c.metrics()
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn config_accepts_inline_json_and_files_and_names_bad_input() {
        assert_eq!(read_config(Some(r#"{"a":1}"#)).unwrap()["a"], 1);
        let err = format!("{:#}", read_config(Some("{nope")).unwrap_err());
        assert!(err.contains("--config is not valid JSON"), "{err}");
        let err = format!(
            "{:#}",
            read_config(Some("@/no/such/file.json")).unwrap_err()
        );
        assert!(
            err.contains("cannot read --config file /no/such/file.json"),
            "{err}"
        );
    }
}
