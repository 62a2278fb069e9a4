//! The crash-consistency campaign.
//!
//! Runs the linear-regression example as a separate process (this binary,
//! re-executed in `host` mode, runs it through the trainhost library), kills
//! it with SIGKILL at a random instant, starts it again under the same run
//! name, and after every kill checks the storage: every committed
//! checkpoint verifies against its manifest, the newest committed
//! checkpoint never goes backwards, and the restarted run resumes from
//! exactly the newest committed checkpoint. Finally it lets the run finish
//! and checks that every epoch was reported and the last checkpoint holds
//! the last epoch.
//!
//! With `--nodes N` the run spans N nodes: `mpiexec -n N` starts the
//! trainhost command line (built with the `mpi` feature, `--trainhost`),
//! and each kill takes one node's process, chosen at random. The campaign
//! then also checks that the job ends on every node within seconds, the
//! nodes' processes all gone.
//!
//! ```text
//! cargo run --release -p trainhost-crash-campaign -- run --guest linear_regression.wasm --kills 200
//! cargo build --release -p trainhost --features mpi
//! cargo run --release -p trainhost-crash-campaign -- run --guest linear_regression.wasm \
//!     --nodes 2 --workers 4 --sharded --trainhost target/release/trainhost --kills 50
//! ```

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use clap::{Parser, Subcommand};
use trainhost::{
    CheckpointConfig, MetricValue, OutputSink, RunConfig, ScalingConfig, Stream, Trainer,
};

#[derive(Parser)]
#[command(
    about = "Kill a trainhost run at random instants and check that nothing committed is lost"
)]
struct Cli {
    #[command(subcommand)]
    command: Mode,
}

#[derive(Subcommand)]
enum Mode {
    /// Run the campaign.
    Run(Campaign),
    /// Run the example once as the host (the campaign starts and kills
    /// this); not for direct use.
    Host(HostArgs),
}

#[derive(clap::Args, Clone)]
struct Campaign {
    /// The linear-regression example component.
    #[arg(long)]
    guest: PathBuf,
    /// How many times to kill the host.
    #[arg(long, default_value_t = 20)]
    kills: u32,
    /// Seed of the kill instants.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Epochs of the run (each commits a checkpoint).
    #[arg(long, default_value_t = 400)]
    epochs: u32,
    /// Ranks.
    #[arg(long, default_value_t = 2)]
    workers: u32,
    /// MiB of padding per rank in every checkpoint, so that kills land in
    /// uploads, commits and retention deletes, not only in compute.
    #[arg(long, default_value_t = 2)]
    padding_mb: u32,
    /// Where the run is stored (default: a new temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// The guest hands its checkpoint directories over
    /// (`report-handing-over`) instead of having them copied.
    #[arg(long)]
    hand_over: bool,
    /// Every rank saves its own shard of each checkpoint (the example's
    /// distributed checkpointing) instead of rank 0 saving it all.
    #[arg(long)]
    sharded: bool,
    /// Nodes of the run: more than one starts it under `mpiexec`, one
    /// process a node, and each kill takes one node.
    #[arg(long, default_value_t = 1)]
    nodes: u32,
    /// The trainhost command line built with the `mpi` feature, for
    /// `--nodes` above 1.
    #[arg(long)]
    trainhost: Option<PathBuf>,
}

#[derive(clap::Args)]
struct HostArgs {
    #[arg(long)]
    guest: PathBuf,
    #[arg(long)]
    storage: PathBuf,
    #[arg(long)]
    config: String,
    #[arg(long)]
    workers: u32,
}

const RUN: &str = "campaign";
const KEEP: usize = 3;

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Mode::Run(c) => campaign(&c),
        Mode::Host(h) => host(&h),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Prints rank 0's lines on stdout, where the campaign reads them.
struct Rank0;

impl OutputSink for Rank0 {
    fn line(&self, rank: u32, _: Stream, line: &str) {
        if rank == 0 {
            println!("{line}");
        }
    }
}

fn host(args: &HostArgs) -> anyhow::Result<()> {
    let result = Trainer::builder(args.guest.as_path())
        .train_loop_config(serde_json::from_str(&args.config)?)
        .scaling_config(ScalingConfig {
            num_workers: args.workers,
        })
        .run_config(RunConfig {
            name: Some(RUN.into()),
            storage_path: args.storage.display().to_string(),
            checkpoint_config: CheckpointConfig {
                num_to_keep: Some(KEEP),
                ..Default::default()
            },
            ..Default::default()
        })
        .output(Arc::new(Rank0))
        .build()?
        .fit()?;
    if let Some(e) = result.error {
        bail!("the run failed: {e}");
    }
    Ok(())
}

/// A tiny deterministic generator for the kill instants.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

struct Host {
    child: Child,
    /// Rank 0's output lines.
    lines: mpsc::Receiver<String>,
    /// Marks the processes of this start (an environment variable's
    /// value), to find each node's process.
    token: String,
}

fn start(c: &Campaign, storage: &Path) -> anyhow::Result<Host> {
    let config = serde_json::json!({
        "num_epochs": c.epochs,
        "padding_mb": c.padding_mb,
        "hand_over": c.hand_over,
        "sharded": c.sharded,
    })
    .to_string();
    let token = format!("{}-{:?}", std::process::id(), Instant::now());
    let mut command = if c.nodes > 1 {
        let trainhost = c
            .trainhost
            .as_ref()
            .context("--nodes needs --trainhost: the command line built with `--features mpi`")?;
        let mut command = Command::new("mpiexec");
        command
            .args(["-n", &c.nodes.to_string()])
            .arg(trainhost)
            .arg("run")
            .arg(&c.guest)
            .arg("--storage")
            .arg(storage)
            .args(["--name", RUN, "--num-to-keep", &KEEP.to_string()]);
        command
    } else {
        let mut command = Command::new(std::env::current_exe()?);
        command
            .arg("host")
            .arg("--guest")
            .arg(&c.guest)
            .arg("--storage")
            .arg(storage);
        command
    };
    let mut child = command
        .args(["--config", &config, "--workers", &c.workers.to_string()])
        .env("RUST_LOG", "error")
        .env(TOKEN, &token)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start the host")?;
    let stdout = child.stdout.take().context("no stdout")?;
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // The command line prefixes each rank's lines.
            let line = match line.strip_prefix("[rank ") {
                Some(rest) => match rest.strip_prefix("0] ") {
                    Some(rank0) => rank0.to_owned(),
                    None => continue,
                },
                None => line,
            };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Ok(Host {
        child,
        lines,
        token,
    })
}

/// The environment variable that marks a start's processes.
const TOKEN: &str = "TRAINHOST_CAMPAIGN_START";

/// The trainhost processes of `host`'s start, by node (MPI rank), read
/// from /proc: each carries the start's token in its environment.
fn node_processes(host: &Host) -> Vec<(u32, u32)> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        let vars: Vec<&[u8]> = environ.split(|b| *b == 0).collect();
        let value = |name: &str| {
            vars.iter().find_map(|v| {
                v.strip_prefix(name.as_bytes())
                    .and_then(|rest| rest.strip_prefix(b"="))
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            })
        };
        if value(TOKEN).as_deref() != Some(host.token.as_str()) {
            continue;
        }
        let Ok(exe) = std::fs::read_link(entry.path().join("exe")) else {
            continue;
        };
        if exe.file_name().is_none_or(|n| n != "trainhost") {
            continue;
        }
        if let Some(node) = value("PMI_RANK").and_then(|r| r.parse().ok()) {
            found.push((node, pid));
        }
    }
    found.sort_unstable();
    found
}

/// Kill the start: its one process, or one node's process chosen by
/// `rng`; then check that the whole job ends within `JOB_END`.
fn kill(c: &Campaign, host: &mut Host, rng: &mut Rng) -> anyhow::Result<()> {
    if c.nodes <= 1 {
        host.child.kill()?;
        host.child.wait()?;
        return Ok(());
    }
    let nodes = node_processes(host);
    let Some(&(node, pid)) = nodes.get(rng.below(nodes.len() as u64) as usize) else {
        // Not started yet, or ending: kill the launcher itself.
        host.child.kill()?;
        host.child.wait()?;
        return Ok(());
    };
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()?;
    let deadline = Instant::now() + JOB_END;
    while host.child.try_wait()?.is_none() {
        if Instant::now() > deadline {
            host.child.kill()?;
            bail!("node {node}'s process was killed, but the job had not ended {JOB_END:?} later");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let left = node_processes(host);
    ensure!(
        left.is_empty(),
        "the launcher ended after node {node} was killed, but node processes live on: {left:?}"
    );
    Ok(())
}

/// How soon the job must end on every node once one node's process died.
const JOB_END: Duration = Duration::from_secs(30);

/// What storage holds after a kill: the committed checkpoints, each
/// verified, and the newest one's index and epoch.
fn inspect(run_dir: &Path) -> anyhow::Result<Option<(u64, i64)>> {
    if !run_dir.join("trainhost-run.json").exists() {
        return Ok(None);
    }
    let committed = trainhost::committed_checkpoints(&run_dir.display().to_string())?;
    for c in &committed {
        c.verify()
            .with_context(|| format!("committed checkpoint {} does not verify", c.location()))?;
    }
    Ok(committed.iter().max_by_key(|c| c.index()).map(|c| {
        let epoch = match c.metrics().get("epoch") {
            Some(MetricValue::Integer(e)) => *e,
            _ => -1,
        };
        (c.index(), epoch)
    }))
}

fn campaign(c: &Campaign) -> anyhow::Result<()> {
    let temp;
    let storage = match &c.dir {
        Some(d) => d.clone(),
        None => {
            temp = std::env::temp_dir().join(format!("trainhost-campaign-{}", std::process::id()));
            temp.clone()
        }
    };
    let _ = std::fs::remove_dir_all(&storage);
    std::fs::create_dir_all(&storage)?;
    let run_dir = storage.canonicalize()?.join(RUN);
    let mut rng = Rng(c.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);

    // How long start-up and each epoch take, to spread the kills over the
    // work a run has left.
    let probe_dir = storage.join("probe");
    let started = Instant::now();
    let probe = start(c, &probe_dir)?;
    probe
        .lines
        .recv()
        .context("the probe run printed nothing")?;
    let startup = started.elapsed();
    let mut probe = probe;
    ensure!(probe.child.wait()?.success(), "an uninterrupted run failed");
    let full = started.elapsed();
    std::fs::remove_dir_all(&probe_dir)?;
    let per_epoch = full.saturating_sub(startup) / c.epochs;
    println!(
        "an uninterrupted run of {} epochs takes {full:?} ({startup:?} to start, {per_epoch:?} an epoch)",
        c.epochs
    );

    let mut newest: Option<(u64, i64)> = None;
    let (mut kills, mut runs, mut resumes_checked) = (0u32, 0u32, 0u32);
    while kills < c.kills {
        let done = newest.map_or(0, |(_, epoch)| (epoch + 1) as u32);
        if done >= c.epochs {
            // Nothing left to interrupt: let it finish, check it, and start
            // a new run.
            let mut host = start(c, &storage)?;
            ensure!(
                host.child.wait()?.success(),
                "a resumed run failed to finish"
            );
            check_complete(&run_dir, c.epochs)?;
            std::fs::remove_dir_all(&run_dir)?;
            newest = None;
            runs += 1;
            continue;
        }
        let mut host = start(c, &storage)?;
        let expected = newest;
        // Half again the work left: a resumed run also restores its
        // checkpoint, and a window no longer than the work would stall a
        // campaign near the end of a run, killing every restart before it
        // can report.
        let span = (startup + per_epoch * (c.epochs - done)) * 3 / 2;
        std::thread::sleep(Duration::from_micros(rng.below(span.as_micros() as u64)));
        if host.child.try_wait()?.is_some() {
            // It finished before the kill.
            check_complete(&run_dir, c.epochs)?;
            std::fs::remove_dir_all(&run_dir)?;
            newest = None;
            runs += 1;
            continue;
        }
        kill(c, &mut host, &mut rng)?;
        kills += 1;
        // Which checkpoint the run said it resumed from (its output up to
        // the kill).
        let resumed: Option<i64> = host.lines.iter().find_map(|line| {
            line.strip_prefix("resuming from ")
                .and_then(|rest| rest.rsplit(' ').next())
                .and_then(|e| e.parse().ok())
        });
        if let (Some((_, epoch)), Some(seen)) = (expected, resumed) {
            ensure!(
                seen == epoch,
                "kill {kills}: the run resumed after epoch {seen}, but the newest committed checkpoint holds epoch {epoch}"
            );
            resumes_checked += 1;
        }
        let now = inspect(&run_dir).with_context(|| format!("after kill {kills}"))?;
        if let (Some((before, _)), Some((after, _))) = (newest, now) {
            ensure!(
                after >= before,
                "kill {kills}: newest committed checkpoint went from {before} back to {after}"
            );
        }
        ensure!(
            !(newest.is_some() && now.is_none()),
            "kill {kills}: every committed checkpoint disappeared"
        );
        newest = now;
        if kills % 20 == 0 || kills == 1 {
            println!(
                "kill {kills}/{}: newest committed checkpoint {newest:?}",
                c.kills
            );
        }
    }

    // Let it finish.
    let mut host = start(c, &storage)?;
    ensure!(host.child.wait()?.success(), "the final run failed");
    check_complete(&run_dir, c.epochs)?;
    runs += 1;
    println!(
        "campaign passed: {kills} kills over {runs} runs, {resumes_checked} resumes checked against the newest committed checkpoint; every run finished with all epochs; nothing committed was lost"
    );
    if c.dir.is_none() {
        let _ = std::fs::remove_dir_all(&storage);
    }
    Ok(())
}

/// The run finished: every epoch was reported, and the latest checkpoint
/// holds the last epoch and verifies.
fn check_complete(run_dir: &Path, epochs: u32) -> anyhow::Result<()> {
    let history = std::fs::read_to_string(run_dir.join("metrics.jsonl"))?;
    let mut seen = vec![false; epochs as usize];
    for line in history.lines() {
        let record: serde_json::Value = serde_json::from_str(line)?;
        if let Some(e) = record["metrics"]["epoch"].as_u64() {
            seen[e as usize] = true;
        }
    }
    if let Some(missing) = seen.iter().position(|s| !s) {
        bail!("epoch {missing} was never reported");
    }
    let newest = inspect(run_dir)?.context("no committed checkpoint at the end")?;
    ensure!(
        newest.1 == i64::from(epochs) - 1,
        "the last checkpoint holds epoch {}, not {}",
        newest.1,
        epochs - 1
    );
    Ok(())
}
