//! Replays the fuzz corpora in `fuzz/corpus/` (seeds, and every input a
//! fuzzer found worth keeping, regressions included) through the fuzz
//! entry points, so each change is checked against them without a fuzzer.

use std::path::Path;

fn replay(target: &str, run: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        if std::panic::catch_unwind(|| run(&data)).is_err() {
            panic!("{target}: input {} fails", path.display());
        }
        count += 1;
    }
    assert!(count > 0, "no corpus for {target} in {}", dir.display());
}

#[test]
fn manifest_corpus() {
    replay("manifest", trainhost::fuzzing::manifest);
}

#[test]
fn run_state_corpus() {
    replay("run_state", trainhost::fuzzing::run_state);
}

#[test]
fn metrics_corpus() {
    replay("metrics", trainhost::fuzzing::metrics);
}

#[test]
fn guest_path_corpus() {
    replay("guest_path", trainhost::fuzzing::guest_path);
}
