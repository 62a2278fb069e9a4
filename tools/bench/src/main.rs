//! trainhost's benchmark suite. Every measure runs with its baseline in the
//! same invocation, and the ratio between the two is what counts: absolute
//! times on a shared machine move from run to run, ratios much less.
//!
//! Run it with `scripts/bench.sh` (which installs the S3 server and the AWS
//! CLI and builds in release mode); `--write BENCHMARKS.md` regenerates the
//! results file.

mod common;
mod goals;
mod groups;
mod load;
mod results;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;

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
    let want = |group: &str| args.only.is_empty() || args.only.iter().any(|o| group.contains(o));
    let reps = if args.quick { 1 } else { 3 };
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    let started = Instant::now();
    let cache = tempfile::tempdir()?;
    if want("report") {
        rows.extend(report::report(args.quick)?);
    }
    if want("persist") {
        rows.extend(persist::persist_local(args.quick, reps)?);
    }
    if want("blocked") {
        rows.extend(blocked::blocked(args.quick, reps)?);
    }
    if want("restart") {
        rows.extend(restart::restart(reps, cache.path())?);
    }
    let bin = match &args.trainhost {
        Some(b) => b.clone(),
        None => std::env::current_exe()?.with_file_name("trainhost"),
    };
    if want("cli") {
        if bin.exists() {
            rows.extend(cli::cli(&bin, if args.quick { 2 } else { 7 })?);
        } else {
            skipped.push(format!(
                "cli: no trainhost binary at {} (build it with `cargo build --release -p trainhost`)",
                bin.display()
            ));
        }
    }
    if want("sgd") {
        rows.extend(sgd::sgd(args.quick, reps)?);
    }
    if want("burn") {
        rows.extend(burn::burn(args.quick, reps)?);
    }
    if want("tensors") {
        rows.extend(tensors::tensors(args.quick, reps)?);
    }
    if want("python") {
        if !bin.exists() {
            skipped.push(format!(
                "python: no trainhost binary at {} (build it with `cargo build --release -p trainhost`)",
                bin.display()
            ));
        } else {
            match python::python(&bin, args.quick, reps) {
                Ok(r) => rows.extend(r),
                Err(e) => skipped.push(format!("python: {e:#}")),
            }
        }
    }
    if want("s3") {
        match s3::s3(args.quick, reps) {
            Ok(r) => rows.extend(r),
            Err(e) => skipped.push(format!("s3: {e:#}")),
        }
    }
    if want("collective") {
        rows.extend(collective::collective(args.quick, reps)?);
    }
    if want("nodes") {
        let baseline = std::env::current_exe()?.with_file_name("mpi-allreduce");
        if baseline.exists() && bin.exists() {
            let programs = nodes::Programs {
                trainhost: &bin,
                baseline: &baseline,
            };
            match nodes::nodes(&programs, args.quick, reps) {
                Ok(r) => rows.extend(r),
                Err(e) => skipped.push(format!("nodes: {e:#}")),
            }
        } else {
            skipped.push(format!(
                "nodes: no mpi-allreduce beside this program or no trainhost at {} (build both with `--features trainhost-bench/mpi`, as scripts/bench.sh does)",
                bin.display()
            ));
        }
    }
    if want("ranks") {
        rows.extend(ranks::ranks(args.quick, cache.path())?);
    }
    let table = results::markdown(&rows);
    println!("{table}");
    for s in &skipped {
        println!("skipped {s}");
    }
    if let Some(path) = &args.write {
        let command = std::env::args().skip(1).collect::<Vec<_>>().join(" ");
        results::write_results(path, &table, &skipped, &command, started.elapsed())?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
