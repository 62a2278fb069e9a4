//! A guest whose behaviour is a script in the run's config, so that each
//! integration test states what the ranks do next to what it checks.
//!
//! The config is `{"steps": [STEP, ...]}`; every step may carry
//! `"ranks": [..]` to run on those ranks only. Strings may contain `{rank}`,
//! replaced by the rank's index. Relative paths are below the scratch dir.
//! Steps:
//! - `{"write": PATH, "text": TEXT}` / `{"write": PATH, "bytes": N, "seed": S}`
//! - `{"write_cwd": PATH, "text": TEXT}`: PATH as given, relative to the
//!   working directory
//! - `{"mkdir": PATH}`, `{"remove": PATH}`
//! - `{"symlink": LINK, "target": TARGET}`; a refused link prints
//!   `symlink refused: ...` and goes on
//! - `{"report": {"name": value, ..}, "checkpoint": PATH}` (checkpoint passed
//!   as written, without joining the scratch dir, so escapes reach the host
//!   verbatim); a refused report prints `report refused: ...` and goes on;
//!   with `"hand_over": true` the directory is handed over
//!   (`report-handing-over`)
//! - `{"count_entries": PATH}`: prints `entries: N` (the directory's
//!   entries) or `entries: missing`
//! - `{"print_checkpoint": true}`: prints `checkpoint: PATH` and one line
//!   `file: NAME SIZE FNV` per file, or `checkpoint: none`
//! - `{"print_context": true}`: prints rank, sizes, run name and config
//! - `{"panic": MSG}`, `{"fail": MSG}`, `{"spin": true}` (loops forever)
//! - `{"print": TEXT}` (stdout), `{"eprint": TEXT}` (stderr)
//! - `{"spin_ms": N}` (computes for N ms without calling trainhost),
//!   `{"sleep_ms": N}`, `{"alloc_mb": N}`, `{"flood": BYTES}` (stdout)
//! - `{"report_flood": N, "text_bytes": B, "every_ms": M}`: N reports
//!   without checkpoint, each `i` and a text `note` of B bytes, M ms apart
//!   (default 0)
//! - `{"hardlink": LINK, "target": TARGET}`: prints `hardlink made` or
//!   `hardlink refused: ...`
//! - `{"sparse": PATH, "size": N}`: a sparse file of N bytes
//! - `{"nest": DIR, "depth": N}`: N nested directories, a file at the bottom
//! - `{"many": DIR, "count": N}`: N tiny files in 100 directories
//! - `{"open_many": PATH, "count": N}`: opens PATH (created empty) N times
//!   and keeps every handle to the end of the run; prints `opened K` and,
//!   if an open failed, `open failed after K: ERROR` before it
//! - `{"until_preempted": true}`: report `i` = 0, 1, .. until preemption is
//!   requested, then report a checkpoint holding `final` and return
//!
//! - the collective steps listed in `collective.rs`, the file steps in
//!   `files.rs`, the listing steps in `listings.rs`, the tensor steps in
//!   `tensors.rs` and the program steps in `programs.rs`
//!
//! A step with `"when_attempt": [..]` runs only when the restored
//! checkpoint's `attempt` file holds one of those numbers (0 without one);
//! `{attempt}` and `{next_attempt}` stand for that number and the next. In
//! report metrics the strings "NaN", "inf" and "-inf" stand for floats.

mod collective;
mod files;
mod listings;
mod programs;
mod tensors;

use std::fs;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{Map, Value};
use trainhost_guest::{Checkpoint, MetricValue, Metrics};

#[derive(Deserialize)]
struct Script {
    #[serde(default)]
    steps: Vec<Map<String, Value>>,
}

/// What the placeholders in the script's strings stand for.
struct Vars {
    rank: u32,
    /// The number in the restored checkpoint's `attempt` file, or 0.
    attempt: u64,
}

fn train(script: Script) -> Result<(), String> {
    let rank = trainhost_guest::world_rank();
    let attempt = trainhost_guest::get_checkpoint()
        .and_then(|c| fs::read_to_string(c.path().join("attempt")).ok())
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0);
    let vars = Vars { rank, attempt };
    for step in &script.steps {
        if let Some(ranks) = step.get("ranks") {
            let ranks: Vec<u32> =
                serde_json::from_value(ranks.clone()).map_err(|e| e.to_string())?;
            if !ranks.contains(&rank) {
                continue;
            }
        }
        if let Some(attempts) = step.get("when_attempt") {
            let attempts: Vec<u64> =
                serde_json::from_value(attempts.clone()).map_err(|e| e.to_string())?;
            if !attempts.contains(&attempt) {
                continue;
            }
        }
        run_step(step, &vars)?;
    }
    Ok(())
}

fn text(step: &Map<String, Value>, key: &str, vars: &Vars) -> Option<String> {
    step.get(key).and_then(Value::as_str).map(|s| {
        s.replace("{rank}", &vars.rank.to_string())
            .replace("{next_attempt}", &(vars.attempt + 1).to_string())
            .replace("{attempt}", &vars.attempt.to_string())
    })
}

pub(crate) fn scratch_path(p: &str) -> PathBuf {
    let p = Path::new(p);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        trainhost_guest::scratch_dir().join(p)
    }
}

fn run_step(step: &Map<String, Value>, vars: &Vars) -> Result<(), String> {
    let rank = vars.rank;
    let io = |e: std::io::Error| e.to_string();
    if collective::run(step, rank, |key| text(step, key, vars))?
        || files::run(
            |key| text(step, key, vars),
            |key| step.get(key).and_then(Value::as_u64),
        )?
        || listings::run(step, |key| text(step, key, vars))?
        || tensors::run(step, rank)?
        || programs::run(step)?
    {
        return Ok(());
    }
    if let Some(path) = text(step, "write", vars) {
        let path = scratch_path(&path);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(io)?;
        }
        let data = match (text(step, "text", vars), step.get("bytes")) {
            (Some(t), _) => t.into_bytes(),
            (None, Some(n)) => {
                let n = n.as_u64().ok_or("bytes must be a number")? as usize;
                let seed = step.get("seed").and_then(Value::as_u64).unwrap_or(1);
                pseudo_random(n, seed)
            }
            (None, None) => return Err("write needs text or bytes".into()),
        };
        fs::write(&path, data).map_err(io)?;
    } else if let Some(path) = text(step, "write_cwd", vars) {
        // Relative to the working directory, without joining anything.
        let text = text(step, "text", vars).unwrap_or_default();
        if let Some(parent) = Path::new(&path).parent() {
            fs::create_dir_all(parent).map_err(io)?;
        }
        fs::write(&path, text).map_err(io)?;
    } else if let Some(path) = text(step, "mkdir", vars) {
        fs::create_dir_all(scratch_path(&path)).map_err(io)?;
    } else if let Some(path) = text(step, "remove", vars) {
        let path = scratch_path(&path);
        if path.is_dir() {
            fs::remove_dir_all(path).map_err(io)?;
        } else {
            fs::remove_file(path).map_err(io)?;
        }
    } else if let Some(link) = text(step, "symlink", vars) {
        let target = text(step, "target", vars).ok_or("symlink needs target")?;
        if let Err(e) = symlink(&target, &link) {
            println!("symlink refused: {e}");
        }
    } else if let Some(metrics) = step.get("report") {
        let metrics = serde_json::to_string(metrics).map_err(|e| e.to_string())?;
        let metrics: Value = serde_json::from_str(&metrics.replace("{rank}", &rank.to_string()))
            .map_err(|e| e.to_string())?;
        let metrics =
            with_special_floats(Metrics::from_serialize(&metrics).map_err(|e| e.to_string())?);
        let hand_over = step.get("hand_over") == Some(&Value::Bool(true));
        let checkpoint = text(step, "checkpoint", vars)
            .map(Checkpoint::from_directory)
            .map(|c| if hand_over { c.hand_over() } else { c });
        match trainhost_guest::report(metrics, checkpoint) {
            Ok(()) => println!("report ok"),
            Err(e) => println!("report refused: {e}"),
        }
    } else if let Some(link) = text(step, "hardlink", vars) {
        let target = text(step, "target", vars).ok_or("hardlink needs target")?;
        match fs::hard_link(scratch_path(&target), scratch_path(&link)) {
            Ok(()) => println!("hardlink made"),
            Err(e) => println!("hardlink refused: {e}"),
        }
    } else if let Some(path) = text(step, "sparse", vars) {
        let size = step
            .get("size")
            .and_then(Value::as_u64)
            .ok_or("sparse needs size")?;
        let path = scratch_path(&path);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(io)?;
        }
        fs::File::create(&path)
            .and_then(|f| f.set_len(size))
            .map_err(io)?;
    } else if let Some(path) = text(step, "nest", vars) {
        let depth = step
            .get("depth")
            .and_then(Value::as_u64)
            .ok_or("nest needs depth")?;
        let mut dir = scratch_path(&path);
        for _ in 0..depth {
            dir.push("d");
        }
        fs::create_dir_all(&dir).map_err(io)?;
        fs::write(dir.join("bottom"), "deep").map_err(io)?;
    } else if let Some(path) = text(step, "many", vars) {
        let count = step
            .get("count")
            .and_then(Value::as_u64)
            .ok_or("many needs count")?;
        let dir = scratch_path(&path);
        for i in 0..count {
            let sub = dir.join(format!("{:03}", i % 100));
            if i < 100 {
                fs::create_dir_all(&sub).map_err(io)?;
            }
            fs::write(sub.join(format!("f{i}")), i.to_string()).map_err(io)?;
        }
    } else if let Some(path) = text(step, "open_many", vars) {
        let count = step
            .get("count")
            .and_then(Value::as_u64)
            .ok_or("open_many needs count")?;
        let path = scratch_path(&path);
        fs::write(&path, "").map_err(io)?;
        let mut kept = Vec::new();
        for i in 0..count {
            match fs::File::open(&path) {
                Ok(file) => kept.push(file),
                Err(e) => {
                    println!("open failed after {i}: {e}");
                    break;
                }
            }
        }
        println!("opened {}", kept.len());
        // Held, not closed, to the end of the run.
        std::mem::forget(kept);
    } else if let Some(mb) = step.get("alloc_mb").and_then(Value::as_u64) {
        // Touch every page so the memory is really used.
        let block = vec![1u8; (mb as usize) << 20];
        println!("allocated {} MiB", std::hint::black_box(block).len() >> 20);
    } else if let Some(n) = step.get("flood").and_then(Value::as_u64) {
        let line = "x".repeat(1023);
        for _ in 0..n / 1024 {
            println!("{line}");
        }
    } else if let Some(n) = step.get("report_flood").and_then(Value::as_u64) {
        let bytes = step.get("text_bytes").and_then(Value::as_u64).unwrap_or(0);
        let every = std::time::Duration::from_millis(
            step.get("every_ms").and_then(Value::as_u64).unwrap_or(0),
        );
        let note = "n".repeat(bytes as usize);
        for i in 0..n {
            let metrics = Metrics::new()
                .with("i", i as i64)
                .with("note", note.as_str());
            trainhost_guest::report(metrics, None).map_err(|e| e.to_string())?;
            std::thread::sleep(every);
        }
    } else if let Some(ms) = step.get("spin_ms").and_then(Value::as_u64) {
        let until = std::time::Instant::now() + std::time::Duration::from_millis(ms);
        let mut x: u64 = 1;
        while std::time::Instant::now() < until {
            for _ in 0..10_000 {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        }
    } else if let Some(ms) = step.get("sleep_ms").and_then(Value::as_u64) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    } else if step.contains_key("until_preempted") {
        until_preempted()?;
    } else if let Some(dir) = text(step, "count_entries", vars) {
        match fs::read_dir(scratch_path(&dir)) {
            Ok(entries) => println!("entries: {}", entries.count()),
            Err(_) => println!("entries: missing"),
        }
    } else if step.contains_key("print_checkpoint") {
        print_checkpoint()?;
    } else if step.contains_key("print_context") {
        println!(
            "context: rank={} size={} local_rank={} local_size={} node={} run={} config={}",
            trainhost_guest::world_rank(),
            trainhost_guest::world_size(),
            trainhost_guest::local_rank(),
            trainhost_guest::local_world_size(),
            trainhost_guest::node_rank(),
            trainhost_guest::run_name(),
            trainhost_guest::config_json(),
        );
    } else if let Some(msg) = text(step, "panic", vars) {
        panic!("{msg}");
    } else if let Some(msg) = text(step, "fail", vars) {
        return Err(msg);
    } else if step.contains_key("spin") {
        let mut x: u64 = 1;
        loop {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    } else if let Some(t) = text(step, "print", vars) {
        println!("{t}");
    } else if let Some(t) = text(step, "eprint", vars) {
        eprintln!("{t}");
    } else {
        return Err(format!("unknown step {step:?}"));
    }
    Ok(())
}

/// JSON has no NaN or infinity: the strings "NaN", "inf" and "-inf" stand
/// for them in the script's metrics.
fn with_special_floats(metrics: Metrics) -> Metrics {
    metrics
        .into_iter()
        .map(|(name, value)| {
            let value = match value {
                MetricValue::Text(t) if t == "NaN" => MetricValue::Float(f64::NAN),
                MetricValue::Text(t) if t == "inf" => MetricValue::Float(f64::INFINITY),
                MetricValue::Text(t) if t == "-inf" => MetricValue::Float(f64::NEG_INFINITY),
                other => other,
            };
            (name, value)
        })
        .collect()
}

/// Report `{"i": n}` every few milliseconds until preemption is requested,
/// then report a final checkpoint holding `final` = n and return.
fn until_preempted() -> Result<(), String> {
    let dir = trainhost_guest::scratch_dir().join("final");
    for i in 0u64.. {
        trainhost_guest::report(Metrics::new().with("i", i as i64), None)
            .map_err(|e| e.to_string())?;
        if trainhost_guest::preemption_requested() {
            fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            fs::write(dir.join("final"), i.to_string()).map_err(|e| e.to_string())?;
            let checkpoint =
                (trainhost_guest::world_rank() == 0).then(|| Checkpoint::from_directory(&dir));
            trainhost_guest::report(
                Metrics::new().with("i", i as i64).with("final", true),
                checkpoint,
            )
            .map_err(|e| e.to_string())?;
            println!("preempted at {i}");
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    Ok(())
}

/// Create a symbolic link at `link` (relative to the scratch dir) through
/// the WASI filesystem API: std has no stable symlink call for WASI.
fn symlink(target: &str, link: &str) -> Result<(), String> {
    let scratch = trainhost_guest::scratch_dir();
    let scratch = scratch.to_str().ok_or("scratch dir is not UTF-8")?;
    let (dir, _) = wasip2::filesystem::preopens::get_directories()
        .into_iter()
        .find(|(_, name)| name == scratch)
        .ok_or("the scratch dir is not preopened")?;
    dir.symlink_at(target, link)
        .map_err(|e| format!("symlink {link} -> {target}: {e:?}"))
}

fn print_checkpoint() -> Result<(), String> {
    let Some(checkpoint) = trainhost_guest::get_checkpoint() else {
        println!("checkpoint: none");
        return Ok(());
    };
    println!("checkpoint: {}", checkpoint.path().display());
    let mut files = Vec::new();
    collect(checkpoint.path(), checkpoint.path(), &mut files)?;
    files.sort();
    for (name, data) in files {
        println!("file: {name} {} {:016x}", data.len(), fnv(&data));
    }
    Ok(())
}

fn collect(root: &Path, dir: &Path, out: &mut Vec<(String, Vec<u8>)>) -> Result<(), String> {
    for entry in fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let entry = entry.map_err(|e| e.to_string())?;
        let path = entry.path();
        if path.is_dir() {
            collect(root, &path, out)?;
        } else {
            let name = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            out.push((name, fs::read(&path).map_err(|e| e.to_string())?));
        }
    }
    Ok(())
}

/// The same generator as the tests use, so they can predict file contents.
fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

trainhost_guest::entry!(train);
