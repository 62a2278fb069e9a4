//! Embedding trainhost in your own program.
//!
//! Runs a guest (the linear-regression example, or any trainhost guest) as
//! two ranks, watches their output through a custom sink, prints the
//! retained checkpoints best first, and restores the latest one into a
//! directory of our choosing.
//!
//! ```text
//! cargo run -p trainhost-embed -- GUEST.wasm [STORAGE] [RESTORE_DIR]
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context, bail};
use trainhost::{OutputSink, RunConfig, ScalingConfig, Stream, Trainer};

/// Counts the ranks' output lines and forwards them, prefixed, to stdout.
#[derive(Default)]
struct CountingSink {
    lines: AtomicUsize,
}

impl OutputSink for CountingSink {
    fn line(&self, rank: u32, stream: Stream, line: &str) {
        self.lines.fetch_add(1, Ordering::Relaxed);
        let tag = match stream {
            Stream::Stdout => "out",
            Stream::Stderr => "err",
        };
        println!("guest[{rank}:{tag}] {line}");
    }
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let guest = args
        .next()
        .context("usage: embed GUEST.wasm [STORAGE] [RESTORE_DIR]")?;
    let storage = args
        .next()
        .unwrap_or_else(|| trainhost::DEFAULT_STORAGE.into());
    let restore_dir = args.next().unwrap_or_else(|| "./restored".into());

    let sink = Arc::new(CountingSink::default());
    let result = Trainer::builder(guest.as_str())
        .train_loop_config(serde_json::json!({"num_epochs": 4, "checkpoint_freq": 2}))
        .scaling_config(ScalingConfig { num_workers: 2 })
        .run_config(RunConfig {
            name: Some("embed-demo".into()),
            storage_path: storage,
            ..RunConfig::default()
        })
        .output(sink.clone())
        .build()?
        .fit()?;

    if let Some(error) = &result.error {
        bail!("the run failed: {error}");
    }
    println!(
        "run {} at {}: {} reports, {} guest lines",
        result.run_name,
        result.path,
        result.metrics_history.len(),
        sink.lines.load(Ordering::Relaxed)
    );
    for (checkpoint, metrics) in &result.best_checkpoints {
        println!("checkpoint {} {metrics}", checkpoint.index());
    }
    let latest = result
        .checkpoint
        .context("the run committed no checkpoint")?;
    let dir = latest.to_directory(&restore_dir)?;
    let mut names: Vec<String> = std::fs::read_dir(&dir)?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()?;
    names.sort();
    println!(
        "restored checkpoint {} into {}: {}",
        latest.index(),
        dir.display(),
        names.join(" ")
    );
    Ok(())
}
