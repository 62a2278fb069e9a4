//! `trainhost run`: the flags of a run, mapped onto the library's
//! settings, and the signals that ask a run to stop.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use trainhost::{
    CheckpointConfig, FailureConfig, Interruption, MaxFailures, Preemption, ResourceLimits,
    RunConfig, ScalingConfig, StorageOptions, SyncConfig, Trainer,
};

use crate::args::{StorageFlags, parse_duration, parse_size};

/// `--interrupt`'s values.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum InterruptAt {
    /// Wherever the rank is (checks in the guest's loops).
    Anywhere,
    /// Only in calls to the host (report, get-checkpoint, ...).
    HostCalls,
}

#[derive(Args, Debug)]
pub struct RunArgs {
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

    /// Where runs are stored: a directory (created if missing),
    /// file:///abs/path, an object store (s3://BUCKET/PREFIX,
    /// gs://BUCKET/PREFIX, az://CONTAINER/PREFIX; see --storage-option), or
    /// memory:// (kept only while the command runs).
    #[arg(short, long, value_name = "URL|DIR", default_value = trainhost::DEFAULT_STORAGE)]
    storage: String,

    /// The run's name, its directory in storage. Default: the guest's file
    /// name, the start time and a random suffix (a new run every time). An
    /// existing name continues that run; while another process runs it,
    /// a start is refused, naming that process.
    #[arg(short, long)]
    name: Option<String>,

    /// A committed checkpoint (directory or URL, of any run) to hand to the
    /// ranks through get-checkpoint until this run commits its own.
    #[arg(long, value_name = "URL|DIR")]
    resume_from: Option<String>,

    /// Write the run's result (checkpoints, metrics, history, error) to
    /// this file as JSON. In a run over several hosts, node 0 writes it.
    #[arg(long, value_name = "FILE")]
    result_json: Option<PathBuf>,

    /// How long ranks wait for each other in report or a collective
    /// (barrier, all-reduce, ...) before the run fails naming the missing
    /// ranks, e.g. 90s, 30m, 2h.
    #[arg(long, value_name = "DURATION", default_value = "30m", value_parser = parse_duration)]
    report_timeout: Duration,

    /// Keep only the N best checkpoints (by --score-attribute, else the
    /// most recent). The latest is always kept too. Default: keep all.
    #[arg(
        long,
        value_name = "N",
        value_parser = CheckpointConfig::parse_num_to_keep,
        allow_negative_numbers = true,
        help_heading = "Retention"
    )]
    num_to_keep: Option<usize>,

    /// The metric that ranks checkpoints for --num-to-keep. Tune's
    /// shorthand max-METRIC / min-METRIC also sets the order.
    #[arg(long, value_name = "METRIC", help_heading = "Retention")]
    score_attribute: Option<String>,

    /// Whether a higher (max, the default) or lower (min) score is better.
    #[arg(long, value_name = "max|min", help_heading = "Retention")]
    score_order: Option<trainhost::ScoreOrder>,

    /// Also keep every N-th checkpoint permanently, whatever its score.
    #[arg(long, value_name = "N", help_heading = "Retention")]
    keep_every: Option<u64>,

    /// Failures to survive by restarting every rank from the latest
    /// committed checkpoint: 0 fails at the first, -1 never gives up.
    /// Counted over the run's life, resumed runs included.
    #[arg(
        long,
        value_name = "N",
        default_value = "0",
        allow_negative_numbers = true,
        help_heading = "Failures"
    )]
    max_failures: MaxFailures,

    /// On SIGTERM or Ctrl-C, how long ranks have to report a final
    /// checkpoint before they are stopped (a second signal stops them at
    /// once, a third exits without waiting for them). A run stopped early
    /// then exits with status 75 and can be resumed; one whose ranks
    /// finished without being told exits 0.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration, help_heading = "Failures")]
    grace_period: Duration,

    /// If a run of this name exists, delete it and start over instead of
    /// continuing it. Also needed to reuse a name whose directory holds
    /// checkpoints but no run state (an interrupted --fresh).
    #[arg(long)]
    fresh: bool,

    #[command(flatten)]
    storage_flags: StorageFlags,

    /// How long this host's claim on a run in an object store lasts unless
    /// renewed (every quarter of it): a host that dies holds its run this
    /// long at most, and a host paused for longer loses the run to the next
    /// one started. Local storage needs none: its lock goes with the process.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration, help_heading = "Storage")]
    storage_lease: Duration,

    /// Mirror the run directory to --sync-to with this command (Ray Tune's
    /// custom syncer), with {source} and {target} placeholders, e.g.
    /// "aws s3 sync {source} {target}". It runs after reports (at most once
    /// per --sync-period) and when the run ends; when the local run is
    /// missing at start it runs the other way round to restore it. Local
    /// storage only.
    #[arg(
        long,
        value_name = "COMMAND",
        requires = "sync_to",
        help_heading = "Sync"
    )]
    sync_command: Option<String>,

    /// Where --sync-command mirrors runs; the run goes to TARGET/NAME.
    #[arg(
        long,
        value_name = "TARGET",
        requires = "sync_command",
        help_heading = "Sync"
    )]
    sync_to: Option<String>,

    /// At most one sync per period while the run goes on.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_duration, help_heading = "Sync")]
    sync_period: Duration,

    /// Linear memory each rank may use, e.g. 512MiB, 2GiB (default: wasm32's
    /// 4 GiB). Exceeding it fails the rank. A collective whose result would
    /// be larger is refused on every rank before the host allocates it.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, help_heading = "Limits")]
    max_memory: Option<u64>,

    /// Fail a rank that neither reports nor prints for this long while not
    /// waiting for other ranks, e.g. 10m (default: no limit).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, help_heading = "Limits")]
    stall_timeout: Option<Duration>,

    /// Fail an attempt that runs longer than this, e.g. 12h (default: no
    /// limit).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, help_heading = "Limits")]
    attempt_timeout: Option<Duration>,

    /// Output each rank may write per second (stdout and stderr, averaged
    /// over a few seconds; rank 0's reported metrics count too, as the
    /// run's history keeps them); more fails the rank. 0 for no limit.
    #[arg(long, value_name = "SIZE", default_value = "1MiB", value_parser = parse_size, help_heading = "Limits")]
    max_output_rate: u64,

    /// Cut longer output lines to this size (marked as cut).
    #[arg(long, value_name = "SIZE", default_value = "64KiB", value_parser = parse_size, help_heading = "Limits")]
    max_line: u64,

    /// Refuse a report whose checkpoint (all ranks' files) is larger, e.g.
    /// 100GiB (default: no limit). The guest sees the error.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, help_heading = "Limits")]
    max_checkpoint_size: Option<u64>,

    /// Disk each rank's scratch directory may use, e.g. 20GiB (default: no
    /// limit): its files' allocated blocks, each file, directory or link
    /// counted as at least 4KiB, and deleted files it still holds open.
    /// Measured every second or so; a rank holding more fails.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, help_heading = "Limits")]
    max_scratch: Option<u64>,

    /// Keep compiled guests here and reuse them: a warm start skips
    /// compiling. Entries are keyed by the guest's bytes, the wasmtime
    /// version and engine settings; a stale one is recompiled. Default:
    /// $TRAINHOST_CACHE_DIR, else $XDG_CACHE_HOME/trainhost, else
    /// ~/.cache/trainhost. It holds native code: keep it private.
    #[arg(long, value_name = "DIR", help_heading = "Performance")]
    cache_dir: Option<PathBuf>,

    /// Make report wait until its checkpoint is uploaded and committed.
    /// Default: report returns once the files are copied to a local
    /// snapshot (on local storage: to their place in storage), and the
    /// upload and commit go on while the ranks train (a storage failure
    /// then fails the run at the next report or at the end).
    #[arg(long, help_heading = "Performance")]
    wait_for_upload: bool,

    /// Do not write the TensorBoard event file
    /// (<STORAGE>/<NAME>/events.out.tfevents.trainhost, rank 0's numeric
    /// metrics against the report index, rewritten with metrics.jsonl).
    /// Default: written; `tensorboard --logdir <STORAGE>` shows every run.
    #[arg(long)]
    no_tensorboard: bool,

    /// Where a running rank can be stopped (when another rank fails, a
    /// limit is hit, or preemption's grace runs out). `anywhere` checks on
    /// every loop iteration of the guest, which makes tight numeric loops
    /// up to ~5x slower than native; `host-calls` stops a rank only when it
    /// calls report or another trainhost import, so guest code runs at
    /// native speed, but a rank that stops calling the host cannot be
    /// stopped. Use `host-calls` for guests you trust to report regularly;
    /// it cannot be combined with --stall-timeout, --attempt-timeout or
    /// --max-scratch.
    #[arg(
        long,
        value_enum,
        value_name = "WHERE",
        default_value = "anywhere",
        help_heading = "Performance"
    )]
    interrupt: InterruptAt,

    /// Compile the guest on every run; read and write no compile cache.
    #[arg(long, conflicts_with = "cache_dir", help_heading = "Performance")]
    no_cache: bool,

    /// No progress bars and no informational logs (warnings and errors
    /// still show; RUST_LOG overrides).
    #[arg(short, long)]
    pub quiet: bool,
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

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let config = read_config(args.config.as_deref())?;
    let mut builder = Trainer::builder(args.guest.as_path())
        .train_loop_config(config)
        .scaling_config(ScalingConfig {
            num_workers: args.workers,
        })
        .run_config(RunConfig {
            name: args.name,
            storage_path: args.storage,
            checkpoint_config: CheckpointConfig {
                num_to_keep: args.num_to_keep,
                checkpoint_score_attribute: args.score_attribute,
                checkpoint_score_order: args.score_order,
                keep_every: args.keep_every,
            },
            failure_config: FailureConfig {
                max_failures: args.max_failures,
            },
            report_timeout: args.report_timeout,
            preemption_grace: args.grace_period,
            fresh: args.fresh,
            storage_options: StorageOptions {
                lease_timeout: args.storage_lease,
                ..args.storage_flags.options(!args.quiet)
            },
            limits: ResourceLimits {
                max_memory: args.max_memory,
                stall_timeout: args.stall_timeout,
                attempt_timeout: args.attempt_timeout,
                max_output_rate: (args.max_output_rate > 0).then_some(args.max_output_rate),
                max_line_bytes: usize::try_from(args.max_line).unwrap_or(usize::MAX),
                max_checkpoint_bytes: args.max_checkpoint_size,
                max_scratch_bytes: args.max_scratch,
            },
            persist_in_background: !args.wait_for_upload,
            tensorboard: !args.no_tensorboard,
            interruption: match args.interrupt {
                InterruptAt::Anywhere => Interruption::Anywhere,
                InterruptAt::HostCalls => Interruption::AtHostCalls,
            },
            sync: args
                .sync_command
                .zip(args.sync_to)
                .map(|(command, target)| SyncConfig {
                    command,
                    target,
                    period: args.sync_period,
                }),
        });
    if let Some(location) = args.resume_from {
        builder = builder.resume_from_checkpoint(location);
    }
    if !args.no_cache
        && let Some(dir) = args.cache_dir.or_else(trainhost::default_cache_dir)
    {
        builder = builder.compile_cache(dir);
    }
    let preemption = Preemption::new();
    forward_signals(preemption.clone())?;
    let result = builder.preemption(preemption).build()?.fit()?;
    // Node 0 holds the run's result; other nodes would write a thin one
    // over it where the path is shared.
    if let Some(path) = args.result_json.as_ref().filter(|_| result.node.0 == 0) {
        let json = serde_json::to_vec_pretty(&result.to_json())?;
        std::fs::write(path, json)
            .with_context(|| format!("cannot write --result-json {}", path.display()))?;
    }
    say!();
    say!("run {} at {}", result.run_name, result.path);
    let (node, nodes) = result.node;
    if node == 0 {
        say!(
            "  {} reports, {} checkpoints retained",
            result.metrics_history.len(),
            result.best_checkpoints.len()
        );
    } else {
        say!(
            "  node {node} of {nodes}: its ranks are done; node 0 lists the run's reports and checkpoints"
        );
    }
    if let Some(metrics) = &result.metrics {
        say!("  last metrics: {metrics}");
    }
    if let Some(c) = &result.checkpoint {
        say!("  latest checkpoint: {}", c.location());
    }
    if result.failures > 0 {
        say!("  failures: {}", result.failures);
        for f in &result.failure_history {
            say!("    {}", f.to_string().lines().next().unwrap_or_default());
        }
    }
    match &result.error {
        Some(e) => {
            say!("error: the run failed: {e}");
            Ok(ExitCode::from(1))
        }
        None if result.preempted => {
            say!(
                "stopped early on request; resume with: trainhost run ... --name {}",
                result.run_name
            );
            Ok(ExitCode::from(EXIT_RESUMABLE))
        }
        None => Ok(ExitCode::SUCCESS),
    }
}

/// Exit status of a run stopped early that can be resumed (EX_TEMPFAIL).
const EXIT_RESUMABLE: u8 = 75;

/// The first SIGTERM or SIGINT asks the run to checkpoint and stop; the
/// second stops the ranks at once; the third exits the process (a rank
/// run with `--interrupt host-calls` that no longer calls the host cannot
/// be stopped otherwise). Committed checkpoints are never at risk: a
/// checkpoint is committed by one atomic write of its manifest.
fn forward_signals(preemption: Preemption) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])
        .context("cannot install the SIGTERM/SIGINT handlers")?;
    std::thread::Builder::new()
        .name("trainhost-signals".into())
        .spawn(move || {
            let mut seen = 0;
            for signal in signals.forever() {
                seen += 1;
                if seen >= 3 {
                    say!(
                        "third signal ({signal}): exiting without waiting for the ranks; committed checkpoints are kept"
                    );
                    std::process::exit(128 + signal);
                }
                if preemption.is_requested() {
                    say!("second signal ({signal}): stopping the ranks now");
                    preemption.force();
                } else {
                    say!("signal {signal}: asking the ranks to checkpoint and stop");
                    preemption.request();
                }
            }
        })
        .context("cannot start the signal thread")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
