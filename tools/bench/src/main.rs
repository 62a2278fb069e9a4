//! trainhost's benchmark suite. Every measure runs with its baseline in the
//! same invocation, and the ratio between the two is what counts: absolute
//! times on a shared machine move from run to run, ratios much less.
//!
//! Run it with `scripts/bench.sh` (which installs the S3 server and the AWS
//! CLI and builds in release mode); `--write BENCHMARKS.md` regenerates the
//! results file.

mod common;
mod compare;
mod goals;
mod groups;
mod load;
mod results;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Result;
use clap::Parser;

use common::Row;
use groups::{
    blocked, burn, cli, collective, nodes, persist, python, ranks, report, restart, s3, sgd,
    tensors,
};

#[derive(Parser, Debug)]
#[command(about = "Run trainhost's benchmarks, each against a baseline in the same run")]
struct Args {
    /// Smaller sizes and fewer repetitions (a smoke run; the figures are
    /// noisier).
    #[arg(long)]
    quick: bool,
    /// How many times to run the suite: each measure runs once per pass
    /// (a few more than once), and the table puts the passes' samples
    /// together, so a row's range covers how the machine moved over the
    /// whole run, not only over one group's minute. Default: 3, or 1 with
    /// --quick.
    #[arg(long, value_name = "N")]
    passes: Option<usize>,
    /// Write the results as Markdown to this file (e.g. BENCHMARKS.md).
    #[arg(long, value_name = "FILE")]
    write: Option<PathBuf>,
    /// Run only the groups whose names contain one of these words
    /// (report, persist, blocked, restart, cli, sgd, burn, tensors,
    /// python, s3, ranks, collective, nodes).
    #[arg(long, value_name = "GROUP")]
    only: Vec<String>,
    /// The `trainhost` binary for the CLI measures. Default: next to this
    /// program.
    #[arg(long, value_name = "FILE")]
    trainhost: Option<PathBuf>,
    /// Compare results files instead of running: which ratios of NEW (the
    /// last file) fall outside the range OLD states, and which verdicts
    /// changed (e.g. --compare BENCHMARKS.md mine.md after a run with
    /// --write mine.md). With several OLD files, oldest first, a row's
    /// range is the union of theirs: how far it moved over those runs
    /// (earlier versions of BENCHMARKS.md: `git log -- BENCHMARKS.md`,
    /// `git show COMMIT:BENCHMARKS.md`); verdicts are compared with the
    /// last.
    #[arg(long, num_args = 2.., value_names = ["OLD", "NEW"])]
    compare: Vec<PathBuf>,
    /// Internal: run N ranks once and print wall time and peak memory.
    #[arg(long, hide = true, value_name = "N")]
    child_ranks: Option<u32>,
    /// Internal: the compile cache for --child-ranks.
    #[arg(long, hide = true)]
    child_cache: Option<PathBuf>,
    /// Internal: rewrite this file until killed (the competing writer of
    /// the restart measures).
    #[arg(long, hide = true, value_name = "FILE")]
    child_writer: Option<PathBuf>,
}

/// As the `trainhost` command line runs.
#[global_allocator]
static ALLOCATOR: trainhost::HugePageAllocator = trainhost::HugePageAllocator;

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(file) = &args.child_writer {
        return load::write_forever(file);
    }
    if let Some(n) = args.child_ranks {
        return ranks::child_ranks(n, args.child_cache.as_deref());
    }
    if let [old @ .., new] = &args.compare[..]
        && !old.is_empty()
    {
        print!("{}", compare::compare(old, new)?);
        return Ok(());
    }
    let passes = args.passes.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    let mut rows: Vec<Row> = Vec::new();
    let mut skipped: Vec<String> = Vec::new();
    let started = Instant::now();
    let cache = tempfile::tempdir()?;
    let mut round_trips = Vec::new();
    for pass in 1..=passes {
        round_trips.extend(load::core_round_trip_ns());
        eprintln!("pass {pass} of {passes}");
        let mut pass_skipped = Vec::new();
        for row in run_pass(&args, cache.path(), &mut pass_skipped)? {
            match rows.iter_mut().find(|r| r.same_line(&row)) {
                Some(line) => line.absorb(row),
                None => rows.push(row),
            }
        }
        for s in pass_skipped {
            if !skipped.contains(&s) {
                skipped.push(s);
            }
        }
    }
    round_trips.extend(load::core_round_trip_ns());
    let table = results::markdown(&rows);
    println!("{table}");
    if let Some(line) = results::round_trip_line(&round_trips) {
        println!("{line}");
    }
    for s in &skipped {
        println!("skipped {s}");
    }
    if let Some(path) = &args.write {
        let command = std::env::args().skip(1).collect::<Vec<_>>().join(" ");
        results::write_results(
            path,
            &table,
            &skipped,
            &command,
            started.elapsed(),
            &round_trips,
        )?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Whether `--only` lets `group` run.
fn want(args: &Args, group: &str) -> bool {
    args.only.is_empty() || args.only.iter().any(|o| group.contains(o))
}

/// One pass over the groups `--only` names, each measure sampled as its
/// [`Sampling`](common::Sampling) says; a group that cannot run here is
/// named in `skipped`.
fn run_pass(args: &Args, cache: &Path, skipped: &mut Vec<String>) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    timed(args, "report", || {
        rows.extend(report::report(args.quick)?);
        Ok(())
    })?;
    timed(args, "persist", || {
        rows.extend(persist::persist_local(args.quick)?);
        Ok(())
    })?;
    timed(args, "blocked", || {
        rows.extend(blocked::blocked(args.quick)?);
        Ok(())
    })?;
    timed(args, "restart", || {
        rows.extend(restart::restart(args.quick, cache)?);
        Ok(())
    })?;
    let bin = match &args.trainhost {
        Some(b) => b.clone(),
        None => std::env::current_exe()?.with_file_name("trainhost"),
    };
    timed(args, "cli", || {
        if bin.exists() {
            rows.extend(cli::cli(&bin, args.quick)?);
        } else {
            skipped.push(format!(
                "cli: no trainhost binary at {} (build it with `cargo build --release -p trainhost`)",
                bin.display()
            ));
        }
        Ok(())
    })?;
    timed(args, "sgd", || {
        rows.extend(sgd::sgd(args.quick)?);
        Ok(())
    })?;
    timed(args, "burn", || {
        rows.extend(burn::burn(args.quick)?);
        Ok(())
    })?;
    timed(args, "tensors", || {
        rows.extend(tensors::tensors(args.quick)?);
        Ok(())
    })?;
    timed(args, "python", || {
        if !bin.exists() {
            skipped.push(format!(
                "python: no trainhost binary at {} (build it with `cargo build --release -p trainhost`)",
                bin.display()
            ));
        } else {
            match python::python(&bin, args.quick) {
                Ok(r) => rows.extend(r),
                Err(e) => skipped.push(format!("python: {e:#}")),
            }
        }
        Ok(())
    })?;
    timed(args, "s3", || {
        match s3::s3(args.quick) {
            Ok(r) => rows.extend(r),
            Err(e) => skipped.push(format!("s3: {e:#}")),
        }
        Ok(())
    })?;
    timed(args, "collective", || {
        rows.extend(collective::collective(args.quick)?);
        Ok(())
    })?;
    timed(args, "nodes", || {
        let baseline = std::env::current_exe()?.with_file_name("mpi-allreduce");
        if baseline.exists() && bin.exists() {
            let programs = nodes::Programs {
                trainhost: &bin,
                baseline: &baseline,
            };
            match nodes::nodes(&programs, args.quick) {
                Ok(r) => rows.extend(r),
                Err(e) => skipped.push(format!("nodes: {e:#}")),
            }
        } else {
            skipped.push(format!(
                "nodes: no mpi-allreduce beside this program or no trainhost at {} (build both with `--features trainhost-bench/mpi`, as scripts/bench.sh does)",
                bin.display()
            ));
        }
        Ok(())
    })?;
    timed(args, "ranks", || {
        rows.extend(ranks::ranks(args.quick, cache)?);
        Ok(())
    })?;
    Ok(rows)
}

/// Run `group` if `--only` lets it, and say how long it took: a pass takes
/// minutes.
fn timed(args: &Args, group: &str, run: impl FnOnce() -> Result<()>) -> Result<()> {
    if !want(args, group) {
        return Ok(());
    }
    let started = Instant::now();
    run()?;
    eprintln!("  {group}: {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}
