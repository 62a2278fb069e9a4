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
//! With `--storage URL` (and `--storage-option key=value`) the runs live in
//! an object store instead of a local directory (an S3 server on loopback,
//! such as moto); each complete run then gets a name of its own.
//!
//! ```text
//! cargo run --release -p trainhost-crash-campaign -- run --guest linear_regression.wasm --kills 200
//! cargo build --release -p trainhost --features mpi
//! cargo run --release -p trainhost-crash-campaign -- run --guest linear_regression.wasm \
//!     --nodes 2 --workers 4 --sharded --trainhost target/release/trainhost --kills 50
//! ```

mod host;
mod store;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use clap::{Parser, Subcommand};

use host::{HostArgs, kill, start};
use store::Store;

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

#[derive(clap::Args, Clone, Debug)]
pub struct Campaign {
    /// The linear-regression example component.
    #[arg(long)]
    pub guest: PathBuf,
    /// How many times to kill the host.
    #[arg(long, default_value_t = 20)]
    pub kills: u32,
    /// Seed of the kill instants.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Epochs of the run (each commits a checkpoint).
    #[arg(long, default_value_t = 400)]
    pub epochs: u32,
    /// Ranks.
    #[arg(long, default_value_t = 2)]
    pub workers: u32,
    /// MiB of padding per rank in every checkpoint, so that kills land in
    /// uploads, commits and retention deletes, not only in compute.
    #[arg(long, default_value_t = 2)]
    pub padding_mb: u32,
    /// Where the run is stored (default: a new temporary directory).
    #[arg(long, conflicts_with = "storage")]
    pub dir: Option<PathBuf>,
    /// An object store URL to keep the runs in instead of a directory
    /// (`s3://bucket/prefix`); see --storage-option.
    #[arg(long)]
    pub storage: Option<String>,
    /// `key=value` options for --storage (`aws_endpoint=http://...`), as
    /// `trainhost run` takes them.
    #[arg(long = "storage-option", value_parser = key_value)]
    pub storage_options: Vec<(String, String)>,
    /// The guest hands its checkpoint directories over
    /// (`report-handing-over`) instead of having them copied.
    #[arg(long)]
    pub hand_over: bool,
    /// Every rank saves its own shard of each checkpoint (the example's
    /// distributed checkpointing) instead of rank 0 saving it all.
    #[arg(long)]
    pub sharded: bool,
    /// Nodes of the run: more than one starts it under `mpiexec`, one
    /// process a node, and each kill takes one node.
    #[arg(long, default_value_t = 1)]
    pub nodes: u32,
    /// The trainhost command line built with the `mpi` feature, for
    /// `--nodes` above 1.
    #[arg(long)]
    pub trainhost: Option<PathBuf>,
    /// The guest also panics once an attempt has run this many epochs (the
    /// example's `fail_every`), and runs restart after every failure, so
    /// that kills land in restarts too: while the failure is recorded and
    /// the next attempt's checkpoint is restored. 0: never.
    #[arg(long, default_value_t = 0)]
    pub fail_every: u32,
}

fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{s:?} is not key=value"))
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Mode::Run(c) => campaign(&c),
        Mode::Host(h) => host::host(&h),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// A tiny deterministic generator for the kill instants.
#[derive(Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

fn campaign(c: &Campaign) -> anyhow::Result<()> {
    // Results and, for local runs, the runs themselves.
    let work = match &c.dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("trainhost-campaign-{}", std::process::id())),
    };
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let store = match &c.storage {
        Some(url) => Store::Remote {
            url: url.clone(),
            options: c.storage_options.clone(),
        },
        None => Store::Local(work.canonicalize()?),
    };
    let result = work.join("result.json");
    let mut rng = Rng(c.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);

    // How long start-up and each epoch take, to spread the kills over the
    // work a run has left.
    let started = Instant::now();
    let mut probe = start(c, &store, "probe", &result)?;
    probe
        .lines
        .recv()
        .context("the probe run printed nothing")?;
    let startup = started.elapsed();
    ensure!(probe.child.wait()?.success(), "an uninterrupted run failed");
    let full = started.elapsed();
    store.remove("probe")?;
    let per_epoch = full.saturating_sub(startup) / c.epochs;
    println!(
        "an uninterrupted run of {} epochs takes {full:?} ({startup:?} to start, {per_epoch:?} an epoch)",
        c.epochs
    );

    let mut newest: Option<(u64, i64)> = None;
    let (mut kills, mut runs, mut resumes_checked) = (0u32, 0u32, 0u32);
    // Restarts after the guest's own failures, over the complete runs.
    let mut restarts = 0u64;
    // Each complete run gets a name of its own.
    let name = |runs: u32| format!("campaign-{runs}");
    while kills < c.kills {
        let run = name(runs);
        let done = newest.map_or(0, |(_, epoch)| (epoch + 1) as u32);
        if done >= c.epochs {
            // Nothing left to interrupt: let it finish, check it, and start
            // a new run.
            let mut host = start(c, &store, &run, &result)?;
            ensure!(
                host.child.wait()?.success(),
                "a resumed run failed to finish"
            );
            restarts += store.check_complete(&run, &result, c.epochs)?;
            store.remove(&run)?;
            newest = None;
            runs += 1;
            continue;
        }
        let mut host = start(c, &store, &run, &result)?;
        let expected = newest;
        // Half again the work left: a resumed run also restores its
        // checkpoint, and a window no longer than the work would stall a
        // campaign near the end of a run, killing every restart before it
        // can report.
        let span = (startup + per_epoch * (c.epochs - done)) * 3 / 2;
        std::thread::sleep(Duration::from_micros(rng.below(span.as_micros() as u64)));
        if host.child.try_wait()?.is_some() {
            // It finished before the kill.
            restarts += store.check_complete(&run, &result, c.epochs)?;
            store.remove(&run)?;
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
        let now = store
            .inspect(&run)
            .with_context(|| format!("after kill {kills}"))?;
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
    let run = name(runs);
    let mut host = start(c, &store, &run, &result)?;
    ensure!(host.child.wait()?.success(), "the final run failed");
    restarts += store.check_complete(&run, &result, c.epochs)?;
    runs += 1;
    if c.fail_every > 0 {
        ensure!(
            restarts > 0,
            "--fail-every {} made no run restart",
            c.fail_every
        );
        println!("the complete runs restarted {restarts} times after the guest's failures");
    }
    println!(
        "campaign passed: {kills} kills over {runs} runs, {resumes_checked} resumes checked against the newest committed checkpoint; every run finished with all epochs; nothing committed was lost"
    );
    if c.dir.is_none() {
        let _ = std::fs::remove_dir_all(&work);
    }
    Ok(())
}
