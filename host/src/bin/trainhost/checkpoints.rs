//! `trainhost checkpoints`: a run's retained checkpoints, best first.

use std::process::ExitCode;

use clap::Args;

use crate::args::{StorageFlags, run_location};

#[derive(Args, Debug)]
pub struct CheckpointsArgs {
    /// The run: its name under --storage, or its directory or URL.
    run: String,

    /// Where runs are stored, when RUN is a name: a directory,
    /// file:///abs/path, or an object store (s3://BUCKET/PREFIX,
    /// gs://BUCKET/PREFIX, az://CONTAINER/PREFIX).
    #[arg(short, long, value_name = "URL|DIR", default_value = trainhost::DEFAULT_STORAGE)]
    storage: String,

    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,

    #[command(flatten)]
    storage_flags: StorageFlags,
}

pub fn checkpoints(args: CheckpointsArgs) -> anyhow::Result<ExitCode> {
    let location = run_location(&args.run, &args.storage)?;
    let list =
        trainhost::committed_checkpoints_with(&location, &args.storage_flags.options(false))?;
    let latest = list.iter().map(trainhost::Checkpoint::index).max();
    if args.json {
        let json: Vec<_> = list
            .iter()
            .map(|c| {
                serde_json::json!({
                    "index": c.index(),
                    "latest": Some(c.index()) == latest,
                    "path": c.location(),
                    "metrics": c.metrics(),
                    "files": c.manifest().files.len(),
                    "bytes": c.manifest().total_bytes(),
                    "committed_at": c.manifest().committed_at,
                })
            })
            .collect();
        show!("{}", serde_json::to_string_pretty(&json)?);
        return Ok(ExitCode::SUCCESS);
    }
    if list.is_empty() {
        show!("{location}: no committed checkpoints");
        return Ok(ExitCode::SUCCESS);
    }
    show!("best first; * marks the latest");
    show!(
        "  {:<18} {:>6} {:>12}  {:<20}  metrics",
        "checkpoint",
        "files",
        "bytes",
        "committed"
    );
    for c in &list {
        let name = c.location().rsplit('/').next().unwrap_or_default();
        let mark = if Some(c.index()) == latest { '*' } else { ' ' };
        show!(
            "{mark} {:<18} {:>6} {:>12}  {:<20}  {}",
            name,
            c.manifest().files.len(),
            c.manifest().total_bytes(),
            c.manifest().committed_at,
            c.metrics()
        );
    }
    Ok(ExitCode::SUCCESS)
}
