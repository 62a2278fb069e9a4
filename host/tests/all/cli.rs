//! The `trainhost` command, end to end.

use std::process::{Command, Output};

use crate::util::*;

fn trainhost(args: &[&str], cwd: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_trainhost"))
        .args(args)
        .current_dir(cwd)
        .env("RUST_LOG", "warn")
        .env("TRAINHOST_CACHE_DIR", cwd.join("compile-cache"))
        .output()
        .unwrap()
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn run_the_example_then_list_its_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let out = trainhost(
        &[
            "run",
            LINEAR_REGRESSION,
            "--workers",
            "2",
            "--config",
            r#"{"num_epochs": 3}"#,
            "--name",
            "demo",
            "--result-json",
            "result.json",
        ],
        tmp.path(),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("[rank 0] epoch 0: loss"), "{stdout}");
    assert!(
        stderr.contains("3 reports, 3 checkpoints retained"),
        "{stderr}"
    );
    // Default storage is ./trainhost_results.
    let run_dir = tmp.path().join("trainhost_results/demo");
    assert_eq!(
        checkpoint_dirs(&run_dir),
        [
            "checkpoint_000000",
            "checkpoint_000001",
            "checkpoint_000002"
        ]
    );

    let result: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tmp.path().join("result.json")).unwrap()).unwrap();
    assert_eq!(result["run_name"], "demo");
    assert_eq!(result["checkpoint"]["index"], 2);
    assert_eq!(result["metrics_history"].as_array().unwrap().len(), 3);
    assert!(result["error"].is_null());

    let out = trainhost(&["checkpoints", "demo"], tmp.path());
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let rows: Vec<&str> = stdout.lines().collect();
    assert_eq!(rows.len(), 5, "{stdout}");
    // Without a score attribute, newest first; the latest marked.
    assert!(
        rows[2].starts_with("* checkpoint_000002") && rows[2].contains("epoch=2 loss="),
        "{stdout}"
    );
    assert!(rows[4].starts_with("  checkpoint_000000"), "{stdout}");

    let out = trainhost(
        &["checkpoints", "trainhost_results/demo", "--json"],
        tmp.path(),
    );
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list.as_array().unwrap().len(), 3);
    assert_eq!(list[0]["metrics"]["epoch"], 2);
    assert_eq!(list[0]["latest"], true);
    assert_eq!(list[1]["latest"], false);
}

#[test]
fn a_failed_run_exits_non_zero_and_says_why() {
    let tmp = tempfile::tempdir().unwrap();
    let config = r#"{"steps": [{"panic": "deliberate"}]}"#;
    let out = trainhost(
        &["run", TEST_GUEST, "--config", config, "--name", "f"],
        tmp.path(),
    );
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("error: the run failed: rank 0 trapped"),
        "{stderr}"
    );
    assert!(stderr.contains("deliberate"), "{stderr}");
    // The trap's evidence once, with the run's error; the log line at the
    // failure gives its headline.
    assert_eq!(stderr.matches("wasm backtrace").count(), 1, "{stderr}");
    assert_eq!(
        stderr.matches("last lines of its stderr").count(),
        1,
        "{stderr}"
    );
}

#[test]
fn bad_input_gets_one_clear_error_each() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("cfg.json"), "{not json").unwrap();
    std::fs::write(tmp.path().join("text.wasm"), "hello").unwrap();
    std::fs::write(tmp.path().join("module.wasm"), b"\0asm\x01\0\0\0").unwrap();
    // The version the host implements is wit/'s package line.
    let wit = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../wit/trainhost.wit"))
        .unwrap();
    let package = wit
        .lines()
        .find_map(|l| l.strip_prefix("package ")?.strip_suffix(';'))
        .expect("wit/trainhost.wit names its package");
    let other_wit = format!(
        "was built against trainhost:train@0.9.0, but this host implements {package} (compatible with 0.1.x)"
    );
    let cases: &[(&[&str], &str)] = &[
        (
            &["run", TEST_GUEST, "--config", "{nope"],
            "--config is not valid JSON",
        ),
        (
            &["run", TEST_GUEST, "--config", "@cfg.json"],
            "--config file cfg.json is not valid JSON",
        ),
        (
            &["run", TEST_GUEST, "--config", "@missing.json"],
            "cannot read --config file missing.json",
        ),
        (
            &["run", "missing.wasm"],
            "guest missing.wasm: cannot be read",
        ),
        (&["run", "text.wasm"], "is not WebAssembly"),
        (
            &["run", "module.wasm"],
            "is a core WebAssembly module, not a component",
        ),
        (&["run", TEST_GUEST, "--workers", "0"], "num_workers is 0"),
        (
            &[
                "run",
                TEST_GUEST,
                "--interrupt",
                "host-calls",
                "--stall-timeout",
                "1m",
            ],
            "stall_timeout needs interruption Anywhere",
        ),
        (&["run", TEST_GUEST, "--name", "a/b"], "run name \"a/b\""),
        (
            &["run", TEST_GUEST, "--storage", "nosuch://bucket"],
            "storage URL \"nosuch://bucket\" is not supported",
        ),
        (
            &["run", TEST_GUEST, "--resume-from", "nowhere"],
            "is not a committed checkpoint",
        ),
        (
            &["run", TEST_GUEST, "--report-timeout", "soon"],
            "invalid value 'soon'",
        ),
        (&["checkpoints", "nothing-here"], "holds no trainhost run"),
        (
            &["run", trainhost_test_artifacts::NOT_A_TRAINER],
            "is a WASI command (a `bin` crate with `fn main`), not a training loop",
        ),
        (&["run", trainhost_test_artifacts::OTHER_WIT], &other_wit),
        (
            &["run", TEST_GUEST, "--storage", "cfg.json"],
            "cfg.json is a file, not a directory",
        ),
        (
            &["run", TEST_GUEST, "--score-order", "min"],
            "checkpoint_score_order is set without checkpoint_score_attribute",
        ),
        (
            &["run", TEST_GUEST, "--keep-every", "3"],
            "keep_every needs num_to_keep",
        ),
        (
            &["run", TEST_GUEST, "--num-to-keep", "0"],
            "must be at least 1, got 0",
        ),
        (
            &["run", TEST_GUEST, "--num-to-keep", "-2"],
            "must be at least 1, got -2",
        ),
        (
            &["run", TEST_GUEST, "--score-order", "up"],
            "score order must be max or min",
        ),
        (
            &["run", TEST_GUEST, "--max-failures", "-5"],
            "max_failures is -5",
        ),
        (&["run", TEST_GUEST, "--keep-every", "0"], "keep_every is 0"),
        (
            &["run", TEST_GUEST, "--max-scratch", "0"],
            "(max_scratch_bytes, --max-scratch) is 0, which no file fits in",
        ),
        (
            &[
                "run",
                TEST_GUEST,
                "--score-attribute",
                "max-auc",
                "--score-order",
                "min",
            ],
            "implies order Max",
        ),
    ];
    for (args, expected) in cases {
        let out = trainhost(args, tmp.path());
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(expected),
            "{args:?}: expected {expected:?} in {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn help_explains_every_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let out = trainhost(&["run", "--help"], tmp.path());
    let (stdout, _) = text(&out);
    for flag in [
        "--workers",
        "--config",
        "--storage",
        "--name",
        "--resume-from",
        "--result-json",
        "--report-timeout",
        "--num-to-keep",
        "--score-attribute",
        "--score-order",
        "--keep-every",
        "--max-failures",
        "--grace-period",
        "--fresh",
        "--storage-option",
        "--storage-retries",
        "--storage-retry-timeout",
        "--storage-timeout",
        "--sync-command",
        "--sync-to",
        "--sync-period",
        "--quiet",
        "--wait-for-upload",
        "--interrupt",
        "--cache-dir",
        "--no-cache",
    ] {
        assert!(stdout.contains(flag), "{flag} missing from:\n{stdout}");
    }
    assert!(stdout.contains("@FILE"), "{stdout}");
    for scheme in ["s3://", "gs://", "az://", "file://"] {
        assert!(stdout.contains(scheme), "{scheme} missing from:\n{stdout}");
    }
    let out = trainhost(&["checkpoints", "--help"], tmp.path());
    let (stdout, _) = text(&out);
    assert!(stdout.contains("--json"));
    assert!(stdout.contains("s3://"), "{stdout}");
}

#[test]
fn retention_flags_keep_the_best_and_the_listing_ranks_them() {
    let tmp = tempfile::tempdir().unwrap();
    let mut steps = Vec::new();
    for (i, loss) in [2, 4, 1, 3].iter().enumerate() {
        steps.push(serde_json::json!({"write": "c/i", "text": i.to_string()}));
        steps.push(serde_json::json!({"report": {"loss": loss}, "checkpoint": "c"}));
    }
    let config = serde_json::json!({ "steps": steps }).to_string();
    let out = trainhost(
        &[
            "run",
            TEST_GUEST,
            "--config",
            &config,
            "--name",
            "keep",
            "--num-to-keep",
            "2",
            "--score-attribute",
            "loss",
            "--score-order",
            "min",
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", text(&out).1);
    let out = trainhost(&["checkpoints", "keep"], tmp.path());
    let (stdout, _) = text(&out);
    let names: Vec<&str> = stdout
        .lines()
        .skip(2)
        .map(|l| {
            l.split_whitespace()
                .find(|w| w.starts_with("checkpoint_"))
                .unwrap()
        })
        .collect();
    assert_eq!(
        names,
        [
            "checkpoint_000002",
            "checkpoint_000000",
            "checkpoint_000003"
        ],
        "{stdout}"
    );
    assert!(
        stdout
            .lines()
            .nth(4)
            .unwrap()
            .starts_with("* checkpoint_000003"),
        "{stdout}"
    );
}

#[test]
fn max_failures_restarts_through_the_cli() {
    let tmp = tempfile::tempdir().unwrap();
    let config = serde_json::json!({"steps": [
        {"write": "c/attempt", "text": "{next_attempt}"},
        {"report": {}, "checkpoint": "c"},
        {"panic": "first attempt dies", "when_attempt": [0]},
    ]})
    .to_string();
    let out = trainhost(
        &[
            "run",
            TEST_GUEST,
            "--config",
            &config,
            "--name",
            "f",
            "--max-failures",
            "1",
        ],
        tmp.path(),
    );
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("failures: 1"), "{stderr}");
    // The listed failure is one line: it must say what happened.
    assert!(
        stderr.lines().any(|l| {
            l.trim_start()
                .starts_with("rank 0 trapped: panicked at tests/guests/src/lib.rs")
                && l.ends_with(": first attempt dies")
        }),
        "{stderr}"
    );
    // The trap's evidence once, with the restart's log line.
    let restart = stderr
        .lines()
        .position(|l| l.contains("restarting every rank"))
        .expect(&stderr);
    assert_eq!(stderr.matches("wasm backtrace").count(), 1, "{stderr}");
    assert!(
        stderr
            .lines()
            .nth(restart + 1)
            .unwrap()
            .contains("wasm backtrace"),
        "{stderr}"
    );
}

#[test]
fn the_compile_cache_is_filled_once_then_used() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let run = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_trainhost"))
            .args([
                "run",
                LINEAR_REGRESSION,
                "-c",
                r#"{"num_epochs": 1}"#,
                "--fresh",
                "-n",
                "c",
            ])
            .args(extra)
            .current_dir(tmp.path())
            .env("RUST_LOG", "trainhost=debug")
            .env_remove("TRAINHOST_CACHE_DIR")
            .env("HOME", tmp.path().join("home"))
            .env_remove("XDG_CACHE_HOME")
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        stderr
    };
    let entries = |dir: &std::path::Path| std::fs::read_dir(dir).map_or(0, |d| d.count());
    let cache_arg = cache.to_str().unwrap();
    assert!(run(&["--cache-dir", cache_arg]).contains("cache=Some(Miss)"));
    assert_eq!(entries(&cache), 1);
    assert!(run(&["--cache-dir", cache_arg]).contains("cache=Some(Hit)"));
    // --no-cache neither reads nor writes one.
    assert!(run(&["--no-cache"]).contains("cache=None"));
    assert_eq!(entries(&tmp.path().join("home/.cache/trainhost")), 0);
    // Without either flag: the default under $HOME.
    assert!(run(&[]).contains("cache=Some(Miss)"));
    assert_eq!(entries(&tmp.path().join("home/.cache/trainhost")), 1);
}

#[test]
fn a_damaged_checkpoint_is_reported_once_not_once_per_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let args = [
        "run",
        LINEAR_REGRESSION,
        "--workers",
        "4",
        "--config",
        r#"{"num_epochs": 2}"#,
        "--name",
        "rot",
    ];
    let out = trainhost(&args, tmp.path());
    assert!(out.status.success(), "{}", text(&out).1);
    let newest = tmp
        .path()
        .join("trainhost_results/rot/checkpoint_000001/model.safetensors");
    std::fs::write(newest, "bit rot").unwrap();

    let out = trainhost(&args, tmp.path());
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(
        stderr
            .matches("checkpoint checkpoint_000001 of the run is damaged")
            .count(),
        1,
        "{stderr}"
    );
    assert!(stdout.contains("resuming from"), "{stdout}");
}

/// The README's guest is `examples/quickstart`, shown verbatim, and its run
/// command works as printed.
#[test]
fn the_readmes_guest_is_the_quickstart_example_and_runs_as_printed() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let section = &readme[readme.find("## Writing a guest").unwrap()..];
    let code_start = section.find("```rust\n").unwrap() + "```rust\n".len();
    let code = &section[code_start..][..section[code_start..].find("```").unwrap()];
    let example = std::fs::read_to_string(root.join("examples/quickstart/src/lib.rs")).unwrap();
    assert_eq!(
        code, example,
        "README.md's guest and examples/quickstart differ"
    );

    let command = section
        .lines()
        .find(|l| l.starts_with("trainhost run "))
        .unwrap();
    // The printed command, word by word ('...' quoted), with the path of
    // the guest the tests built.
    let mut words: Vec<String> = Vec::new();
    for (i, part) in command.split('\'').enumerate() {
        if i % 2 == 1 {
            words.push(part.to_owned());
        } else {
            words.extend(part.split_whitespace().map(str::to_owned));
        }
    }
    assert_eq!(words[..2], ["trainhost", "run"]);
    words[2] = QUICKSTART.to_owned();
    let tmp = tempfile::tempdir().unwrap();
    let args: Vec<&str> = words[1..].iter().map(String::as_str).collect();
    let out = trainhost(&args, tmp.path());
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("5 reports, 5 checkpoints retained"),
        "{stderr}"
    );
}

/// `trainhost run ... 2>&1 | head -4`: once the reader is gone, every
/// write to stderr fails. A rank's failure logged then must still stop the
/// other ranks (one is asleep for an hour) and end the process with the
/// run's status, not a panic or a hang.
#[test]
fn a_closed_stderr_neither_panics_nor_hangs_the_host() {
    use std::io::{BufRead, BufReader};
    let tmp = tempfile::tempdir().unwrap();
    let config = serde_json::json!({"steps": [
        {"panic": "boom", "ranks": [0]},
        {"sleep_ms": 3_600_000, "ranks": [1]},
    ]})
    .to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_trainhost"))
        .args(["run", TEST_GUEST, "--workers", "2", "--config", &config])
        .current_dir(tmp.path())
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("boom") {
        line.clear();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "the panic is shown"
        );
    }
    drop(stderr); // like `head` exiting
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > std::time::Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("the host hung with its stderr closed");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(
        status.code(),
        Some(1),
        "the failed run's status, not a panic's 101"
    );
}

#[test]
fn metrics_prints_the_history_as_a_table_csv_and_json() {
    let tmp = tempfile::tempdir().unwrap();
    let config = serde_json::json!({"steps": [
        {"report": {"loss": 1.5, "phase": "warm, up"}},
        {"write": "c/f", "text": "x"},
        {"report": {"loss": 0.25, "epoch": 1}, "checkpoint": "c"},
    ]})
    .to_string();
    let out = trainhost(
        &["run", TEST_GUEST, "--config", &config, "--name", "m"],
        tmp.path(),
    );
    assert!(out.status.success(), "{:?}", text(&out));

    let out = trainhost(&["metrics", "m"], tmp.path());
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows[0],
        ["report", "checkpoint", "time", "loss", "phase", "epoch"]
    );
    assert_eq!(rows.len(), 3, "{stdout}");
    assert_eq!(rows[1][0], "0");
    assert_eq!(rows[1][2..], ["1.5", "warm,", "up"][..], "{stdout}");
    assert_eq!(rows[2][..2], ["1", "0"], "{stdout}");
    assert_eq!(rows[2][3..], ["0.25", "1"], "{stdout}");

    let out = trainhost(&["metrics", "trainhost_results/m", "--csv"], tmp.path());
    let (stdout, _) = text(&out);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[0], "report,checkpoint,time,loss,phase,epoch");
    assert!(
        lines[1].starts_with("0,,") && lines[1].ends_with(",1.5,\"warm, up\","),
        "{stdout}"
    );
    assert!(
        lines[2].starts_with("1,0,") && lines[2].ends_with(",0.25,,1"),
        "{stdout}"
    );

    let out = trainhost(&["metrics", "m", "--json", "--metric", "loss"], tmp.path());
    let (stdout, _) = text(&out);
    let json: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(json[1]["metrics"], serde_json::json!({"loss": 0.25}));
    assert_eq!(json[1]["checkpoint"], 0);

    let out = trainhost(&["metrics", "m", "--metric", "accuracy"], tmp.path());
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("no report of")
            && stderr.contains("has a metric \"accuracy\"; it has: loss, phase, epoch"),
        "{stderr}"
    );
    let out = trainhost(&["metrics", "nothing"], tmp.path());
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("holds no trainhost run"), "{stderr}");
}

#[test]
fn metrics_plots_the_chosen_metrics_into_png_and_svg() {
    let tmp = tempfile::tempdir().unwrap();
    let config = serde_json::json!({"steps": [
        {"report": {"loss": 1.5, "accuracy": 0.5, "phase": "a"}},
        {"write": "c/f", "text": "x"},
        {"report": {"loss": 0.75, "accuracy": 0.75}, "checkpoint": "c"},
        {"report": {"loss": 0.5, "accuracy": 0.9}},
    ]})
    .to_string();
    let out = trainhost(
        &["run", TEST_GUEST, "--config", &config, "--name", "p"],
        tmp.path(),
    );
    assert!(out.status.success(), "{:?}", text(&out));

    // Every numeric metric: two panels of 240 pixels under a 40-pixel title.
    let out = trainhost(&["metrics", "p", "--plot", "p.png"], tmp.path());
    assert!(out.status.success(), "{:?}", text(&out));
    let png = std::fs::read(tmp.path().join("p.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let (width, height) = (
        u32::from_be_bytes(png[16..20].try_into().unwrap()),
        u32::from_be_bytes(png[20..24].try_into().unwrap()),
    );
    assert_eq!((width, height), (960, 2 * 240 + 40));

    let out = trainhost(
        &["metrics", "p", "--metric", "loss", "--plot", "p.svg"],
        tmp.path(),
    );
    assert!(out.status.success(), "{:?}", text(&out));
    let svg = std::fs::read_to_string(tmp.path().join("p.svg")).unwrap();
    // Each text element's content is on a line of its own.
    let texts: Vec<&str> = svg.lines().map(str::trim).collect();
    assert!(
        texts.contains(&"loss") && !texts.contains(&"accuracy"),
        "{svg}"
    );
    // One checkpoint marked on the line, and one in the legend.
    assert_eq!(svg.matches("<circle").count(), 2, "{svg}");

    for (args, error) in [
        (
            &["metrics", "p", "--plot", "p.pdf"][..],
            "name a .png or .svg file",
        ),
        (
            &["metrics", "p", "--metric", "phase", "--plot", "p.png"][..],
            "none of phase has a finite numeric value to plot",
        ),
    ] {
        let out = trainhost(args, tmp.path());
        let (_, stderr) = text(&out);
        assert!(
            !out.status.success() && stderr.contains(error),
            "{args:?}: {stderr}"
        );
    }
}
