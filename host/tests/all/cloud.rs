//! One storage conformance suite (put, list, commit, retention, restore,
//! resume) run on every backend: memory, local, and real S3, GCS and Azure
//! servers on loopback; the lifecycle scenarios end to end on S3 and
//! Azure; and a server taken away in the middle of an upload (R24).

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use trainhost::{
    CheckpointConfig, FailureConfig, FailureKind, MaxFailures, RunConfig, ScalingConfig,
    ScoreOrder, StorageOptions, Trainer,
};

use crate::servers::{self, Backend, Proxy};
use crate::util::*;

/// Larger than one request (32 MiB): goes up as a concurrent multipart
/// upload.
const BIG: usize = 40_000_000;

fn script() -> serde_json::Value {
    json!([
        {"print_checkpoint": true},
        {"write": "ckpt/big.bin", "bytes": BIG, "seed": 9, "ranks": [0]},
        {"write": "ckpt/shard-{rank}", "text": "rank {rank}"},
        {"report": {"loss": 1}, "checkpoint": "ckpt"},
        {"remove": "ckpt/big.bin", "ranks": [0]},
        {"report": {"loss": 3}, "checkpoint": "ckpt"},
        {"report": {"loss": 4}, "checkpoint": "ckpt"},
        {"report": {"loss": 2}, "checkpoint": "ckpt"},
    ])
}

fn fit(backend: &Backend, steps: serde_json::Value, lines: Arc<Lines>) -> trainhost::TrainResult {
    Trainer::builder(TEST_GUEST)
        .train_loop_config(json!({ "steps": steps }))
        .scaling_config(ScalingConfig { num_workers: 2 })
        .run_config(RunConfig {
            name: Some("suite".into()),
            storage_path: backend.url.clone(),
            storage_options: backend.options.clone(),
            checkpoint_config: CheckpointConfig {
                num_to_keep: Some(2),
                checkpoint_score_attribute: Some("loss".into()),
                checkpoint_score_order: Some(ScoreOrder::Min),
                keep_every: None,
            },
            ..Default::default()
        })
        .output(lines)
        .build()
        .unwrap()
        .fit()
        .unwrap()
}

fn indexes(list: &[trainhost::Checkpoint]) -> Vec<u64> {
    list.iter().map(trainhost::Checkpoint::index).collect()
}

/// The suite. `persistent`: whether a second `fit` sees the first's data
/// (not so for `memory://`, a new store each time).
fn conformance(backend: &Backend, persistent: bool) {
    let lines = Arc::new(Lines::default());
    let first = fit(backend, script(), lines.clone());
    assert!(first.error.is_none(), "{}: {:?}", backend.url, first.error);
    assert!(first.path.ends_with("/suite"), "{}", first.path);
    let best: Vec<u64> = first
        .best_checkpoints
        .iter()
        .map(|(c, _)| c.index())
        .collect();
    assert_eq!(
        best,
        [0, 3],
        "{}: retention keeps the two lowest losses",
        backend.url
    );

    // Restore: the multipart file and the shards come back byte for byte.
    let big = &first.best_checkpoints[0].0;
    big.verify().unwrap();
    let dest = tempfile::tempdir().unwrap();
    let restored = big.to_directory(dest.path().join("r")).unwrap();
    assert_eq!(files(&restored), ["big.bin", "shard-0", "shard-1"]);
    assert!(
        std::fs::read(restored.join("big.bin")).unwrap() == pseudo_random(BIG, 9),
        "{}: big.bin differs",
        backend.url
    );
    assert_eq!(std::fs::read(restored.join("shard-1")).unwrap(), b"rank 1");
    let dir = big.as_directory().unwrap();
    assert_eq!(
        std::fs::metadata(dir.path().join("big.bin")).unwrap().len(),
        BIG as u64
    );

    if !persistent {
        return;
    }
    // Opening by location works for stores that outlive the run.
    let opened = trainhost::Checkpoint::open_with(big.location(), &backend.options).unwrap();
    assert_eq!(opened.manifest(), big.manifest());
    // Listing reads back what retention left.
    let run = format!("{}/suite", backend.url);
    let listed = trainhost::committed_checkpoints_with(&run, &backend.options).unwrap();
    assert_eq!(indexes(&listed), [0, 3], "{}", backend.url);

    // Resume by name: the latest committed checkpoint comes back and the
    // numbering goes on.
    let lines = Arc::new(Lines::default());
    let second = fit(backend, script(), lines.clone());
    assert!(
        second.error.is_none(),
        "{}: {:?}",
        backend.url,
        second.error
    );
    let printed: Vec<String> = lines
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.0 == 0)
        .map(|l| l.2.clone())
        .collect();
    assert_eq!(
        printed[0], "checkpoint: /checkpoints/checkpoint_000003",
        "{}",
        backend.url
    );
    assert_eq!(second.metrics_history.len(), 8);
    let listed = trainhost::committed_checkpoints_with(&run, &backend.options).unwrap();
    assert_eq!(
        indexes(&listed),
        [4, 0, 7],
        "{}: best two plus the latest",
        backend.url
    );
}

#[test]
fn conformance_on_memory() {
    conformance(
        &Backend {
            url: "memory:///bucket".into(),
            options: StorageOptions::default(),
        },
        false,
    );
}

#[test]
fn conformance_on_local_directories() {
    let dir = tempfile::tempdir().unwrap();
    conformance(
        &Backend {
            url: dir.path().display().to_string(),
            options: StorageOptions::default(),
        },
        true,
    );
    let url = format!("file://{}/via-url", dir.path().display());
    conformance(
        &Backend {
            url,
            options: StorageOptions::default(),
        },
        true,
    );
}

#[test]
fn conformance_on_s3() {
    let Some(moto) = servers::moto() else { return };
    conformance(&servers::s3(moto.port, moto.port, "conformance"), true);
}

#[test]
fn conformance_on_s3_over_https() {
    // Over HTTPS the payloads go unsigned by default (TLS guards them):
    // multipart uploads and restores must work that way too.
    let Some(moto) = servers::moto_tls() else {
        return;
    };
    conformance(&servers::s3_tls(&moto, "conformance-tls"), true);
}

#[test]
fn conformance_on_gcs() {
    let Some(moto) = servers::moto() else { return };
    conformance(&servers::gcs(&moto, "conformance"), true);
}

#[test]
fn conformance_on_azure() {
    let Some(azurite) = servers::azurite() else {
        return;
    };
    conformance(
        &servers::azure(azurite.port, azurite.port, "conformance"),
        true,
    );
}

/// Ray's restoration scenario with the example, on `backend`.
fn example_crash_and_restore(backend: &Backend) {
    let lines = Arc::new(Lines::default());
    let result = Trainer::builder(LINEAR_REGRESSION)
        .train_loop_config(json!({"num_epochs": 4, "fail_at_epoch": 1}))
        .scaling_config(ScalingConfig { num_workers: 2 })
        .run_config(RunConfig {
            name: Some("example".into()),
            storage_path: backend.url.clone(),
            storage_options: backend.options.clone(),
            failure_config: FailureConfig {
                max_failures: MaxFailures::Limited(1),
            },
            ..Default::default()
        })
        .output(lines.clone())
        .build()
        .unwrap()
        .fit()
        .unwrap();
    assert!(
        result.error.is_none(),
        "{}: {:?}",
        backend.url,
        result.error
    );
    assert_eq!(result.failures, 1);
    assert_eq!(result.metrics_history.len(), 4);
    assert!(
        lines
            .texts()
            .iter()
            .any(|l| l == "resuming from /checkpoints/checkpoint_000000 after epoch 0"),
        "{}",
        backend.url
    );
}

#[test]
fn the_example_survives_a_crash_on_s3_and_azure() {
    if let Some(moto) = servers::moto() {
        example_crash_and_restore(&servers::s3(moto.port, moto.port, "example"));
    }
    if let Some(azurite) = servers::azurite() {
        example_crash_and_restore(&servers::azure(azurite.port, azurite.port, "example"));
    }
}

/// Commit one small checkpoint, then lose the server halfway through a
/// 48 MB upload: the run fails naming the storage and the operation, the
/// committed checkpoint is intact, and once the server is back the run
/// resumes by name.
fn outage(through_proxy: impl Fn(u16) -> Backend, direct: Backend, proxy: &Proxy) {
    let steps = json!([
        {"print_checkpoint": true},
        {"write": "small/w", "text": "committed before the outage"},
        {"report": {"step": 0}, "checkpoint": "small"},
        {"write": "big/weights.bin", "bytes": 48_000_000, "seed": 4},
        {"report": {"step": 1}, "checkpoint": "big"},
    ]);
    let backend = through_proxy(proxy.port);
    let run_with = |backend: &Backend| {
        let lines = Arc::new(Lines::default());
        let result = Trainer::builder(TEST_GUEST)
            .train_loop_config(json!({ "steps": steps }))
            .run_config(RunConfig {
                name: Some("outage".into()),
                storage_path: backend.url.clone(),
                storage_options: backend.options.clone(),
                ..Default::default()
            })
            .output(lines.clone())
            .build()
            .unwrap()
            .fit()
            .unwrap();
        (result, lines)
    };
    let (result, _) = run_with(&backend);
    assert!(
        proxy.is_down(),
        "the proxy's budget should have run out during the big upload"
    );
    let e = result
        .error
        .clone()
        .expect("losing the server fails the run");
    assert_eq!(e.kind, FailureKind::Storage);
    assert!(
        e.message
            .contains(&format!("storage {}/outage", backend.url)),
        "{e}"
    );
    assert!(
        e.message.contains("upload") || e.message.contains("write"),
        "names the operation: {e}"
    );

    // Nothing committed was lost: read through a direct connection.
    let run = format!("{}/outage", direct.url);
    let listed = trainhost::committed_checkpoints_with(&run, &direct.options).unwrap();
    assert_eq!(indexes(&listed), [0]);
    listed[0].verify().unwrap();

    proxy.restore();
    let (result, lines) = run_with(&backend);
    assert!(result.error.is_none(), "{:?}", result.error);
    let first = lines.0.lock().unwrap()[0].2.clone();
    assert_eq!(first, "checkpoint: /checkpoints/checkpoint_000000");
    let listed = trainhost::committed_checkpoints_with(&run, &direct.options).unwrap();
    assert_eq!(
        indexes(&listed),
        [2, 1, 0],
        "the run went on numbering after the failed upload"
    );
    for c in &listed {
        c.verify().unwrap();
    }
}

/// Enough for the probe, the run state, the small checkpoint and the
/// history, far from enough for the big upload.
const BUDGET: i64 = 4 * 1024 * 1024;

#[test]
fn s3_going_away_mid_upload_fails_cleanly_and_the_run_resumes() {
    let Some(moto) = servers::moto() else { return };
    let direct = servers::s3(moto.port, moto.port, "outage");
    let proxy = Proxy::start(moto.port, BUDGET);
    outage(|port| servers::s3_existing(port, "outage"), direct, &proxy);
}

#[test]
fn azure_going_away_mid_upload_fails_cleanly_and_the_run_resumes() {
    let Some(azurite) = servers::azurite() else {
        return;
    };
    let direct = servers::azure(azurite.port, azurite.port, "outage");
    let proxy = Proxy::start(azurite.port, BUDGET);
    outage(
        |port| servers::azure_existing(port, "outage"),
        direct,
        &proxy,
    );
}

#[test]
fn storage_options_are_for_object_stores_only() {
    let (builder, storage, _) = scripted(1, json!([]));
    let err = builder
        .run_config(RunConfig {
            storage_path: storage.path().display().to_string(),
            storage_options: StorageOptions {
                options: vec![("aws_region".into(), "x".into())],
                ..Default::default()
            },
            ..Default::default()
        })
        .build()
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("storage options apply to object stores"),
        "{err}"
    );
    let _ = Duration::ZERO;
}

/// `trainhost ARGS` with no cloud credentials in its environment; returns
/// its exit code and stderr.
fn cli_without_credentials(args: &[&str]) -> (Option<i32>, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_trainhost"));
    cmd.args(args).env("RUST_LOG", "warn");
    for (key, _) in std::env::vars() {
        if key.starts_with("AWS_") || key.starts_with("GOOGLE_") || key.starts_with("AZURE_") {
            cmd.env_remove(key);
        }
    }
    // No application default credentials either.
    let home = tempfile::tempdir().unwrap();
    cmd.env("HOME", home.path()).current_dir(home.path());
    let out = cmd.output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn cloud_storage_mistakes_get_one_clear_error_each_before_training() {
    let closed = servers::free_port();
    let endpoint = format!("aws_endpoint=http://127.0.0.1:{closed}");
    let mut cases: Vec<(Vec<String>, String)> = vec![
        (
            vec!["--storage".into(), "s3://".into()],
            "names no bucket or container; write s3://BUCKET/PREFIX".into(),
        ),
        (
            vec!["--storage".into(), "s3://bad host/x".into()],
            "is not a valid URL".into(),
        ),
        (
            vec!["--storage".into(), "ftp://host/x".into()],
            "is not supported".into(),
        ),
        (
            vec![
                "--storage".into(),
                "s3://b/x".into(),
                "--storage-option".into(),
                "nonsense=1".into(),
            ],
            "storage option \"nonsense\" is not valid for s3://b/x".into(),
        ),
        (
            vec!["--storage".into(), "s3://b/x".into()],
            "no credentials found; set AWS_ACCESS_KEY_ID".into(),
        ),
        (
            vec!["--storage".into(), "gs://b/x".into()],
            "no credentials found; set GOOGLE_APPLICATION_CREDENTIALS".into(),
        ),
        (
            vec![
                "--storage".into(),
                "az://c/x".into(),
                "--storage-option".into(),
                "azure_storage_account_name=acct".into(),
            ],
            "no credentials found; set AZURE_STORAGE_ACCOUNT_KEY".into(),
        ),
        (
            [
                "--storage",
                "s3://b/x",
                "--storage-option",
                &endpoint,
                "--storage-option",
                "aws_access_key_id=k",
                "--storage-option",
                "aws_secret_access_key=s",
                "--storage-option",
                "aws_allow_http=true",
                "--storage-retry-timeout",
                "1s",
            ]
            .map(String::from)
            .to_vec(),
            "checking the storage before starting".into(),
        ),
    ];
    let moto = servers::moto();
    if let Some(moto) = &moto {
        let no_bucket = servers::s3_existing(moto.port, "no-such-bucket");
        let mut args = vec!["--storage".to_owned(), no_bucket.url.clone()];
        for (k, v) in &no_bucket.options.options {
            args.push("--storage-option".into());
            args.push(format!("{k}={v}"));
        }
        cases.push((args, "NoSuchBucket".into()));
    }
    for (extra, expected) in cases {
        let mut args = vec!["run", TEST_GUEST, "--name", "x"];
        args.extend(extra.iter().map(String::as_str));
        let (code, stderr) = cli_without_credentials(&args);
        assert_eq!(code, Some(2), "{extra:?}: {stderr}");
        assert!(
            stderr.contains(&expected),
            "{extra:?}: expected {expected:?} in {stderr}"
        );
        assert_eq!(
            stderr.lines().filter(|l| l.starts_with("error:")).count(),
            1,
            "{stderr}"
        );
        assert!(
            !stderr.contains("panicked") && !stderr.contains("[rank"),
            "{extra:?}: {stderr}"
        );
    }
}

/// Copies the run directory as `aws s3 sync` would, with local tools.
const COPY_SYNC: &str = "mkdir -p {target} && cp -R {source}/. {target}/";

#[test]
fn a_sync_command_mirrors_the_run_and_restores_it_when_the_local_copy_is_gone() {
    let tmp = tempfile::tempdir().unwrap();
    let mirror = tmp.path().join("mirror");
    let config = serde_json::json!({"steps": [
        {"print_checkpoint": true},
        {"write": "c/w", "text": "state"},
        {"report": {"step": 1}, "checkpoint": "c"},
    ]})
    .to_string();
    let args = |period: &str| {
        vec![
            "run".to_owned(),
            TEST_GUEST.to_owned(),
            "--config".into(),
            config.clone(),
            "--name".into(),
            "synced".into(),
            "--sync-command".into(),
            COPY_SYNC.into(),
            "--sync-to".into(),
            mirror.display().to_string(),
            "--sync-period".into(),
            period.into(),
        ]
    };
    let run = |period: &str| {
        let a = args(period);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_trainhost"))
            .args(&a)
            .current_dir(tmp.path())
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (status, _, stderr) = run("1s");
    assert!(status.success(), "{stderr}");
    let local = tmp.path().join("trainhost_results/synced");
    let mirrored = mirror.join("synced");
    assert_eq!(
        files(&mirrored.join("checkpoint_000000")),
        files(&local.join("checkpoint_000000"))
    );
    assert!(
        mirrored
            .join("checkpoint_000000/.trainhost/manifest.json")
            .exists()
    );
    trainhost::Checkpoint::open(mirrored.join("checkpoint_000000").to_str().unwrap())
        .unwrap()
        .verify()
        .unwrap();

    // The machine is gone; a new one restores from the mirror and resumes.
    std::fs::remove_dir_all(tmp.path().join("trainhost_results")).unwrap();
    let (status, stdout, stderr) = run("1s");
    assert!(status.success(), "{stderr}");
    assert!(
        stdout.contains("[rank 0] checkpoint: /checkpoints/checkpoint_000000"),
        "{stdout}"
    );
    assert!(
        local.join("checkpoint_000001").exists(),
        "numbering continued after the restore"
    );
}

#[test]
fn a_failing_sync_command_is_reported_with_its_output() {
    let tmp = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_trainhost"))
        .args([
            "run",
            TEST_GUEST,
            "--name",
            "s",
            "--sync-command",
            "echo quota exceeded >&2; exit 4 # {source} {target}",
            "--sync-to",
            "/nowhere",
        ])
        .current_dir(tmp.path())
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("error: the run failed: sync command"),
        "{stderr}"
    );
    assert!(
        stderr.contains("quota exceeded") && stderr.contains("exit status: 4"),
        "{stderr}"
    );

    for (command, expected) in [
        ("aws s3 sync {source}", "needs the placeholder {target}"),
        ("cp {src} {target}", "unknown placeholder {src}"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_trainhost"))
            .args([
                "run",
                TEST_GUEST,
                "--sync-command",
                command,
                "--sync-to",
                "/x",
            ])
            .current_dir(tmp.path())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(expected), "{stderr}");
    }
}

/// On an object store, a file unchanged since the previous checkpoint is
/// copied by the server, not sent again: counted at a proxy in front of S3.
#[test]
fn s3_copies_unchanged_files_server_side() {
    let Some(moto) = servers::moto() else { return };
    servers::s3(moto.port, moto.port, "incremental");
    let proxy = Proxy::start(moto.port, i64::MAX);
    let backend = servers::s3_existing(proxy.port, "incremental");
    let steps = json!([
        {"write": "ck/frozen.bin", "bytes": BIG, "seed": 3},
        {"write": "ck/step", "text": "0"},
        {"report": {"epoch": 0}, "checkpoint": "ck"},
        {"write": "ck/step", "text": "1"},
        {"report": {"epoch": 1}, "checkpoint": "ck"},
        {"write": "ck/step", "text": "2"},
        {"report": {"epoch": 2}, "checkpoint": "ck"},
    ]);
    let result = Trainer::builder(TEST_GUEST)
        .train_loop_config(json!({ "steps": steps }))
        .run_config(RunConfig {
            name: Some("inc".into()),
            storage_path: backend.url.clone(),
            storage_options: backend.options.clone(),
            ..Default::default()
        })
        .build()
        .unwrap()
        .fit()
        .unwrap();
    assert!(result.error.is_none(), "{:?}", result.error);
    let sent = proxy.sent();
    assert!(
        sent < (BIG as u64) * 3 / 2,
        "{sent} bytes went to the server for three checkpoints sharing one {BIG}-byte file"
    );
    let listed =
        trainhost::committed_checkpoints_with(&format!("{}/inc", backend.url), &backend.options)
            .unwrap();
    assert_eq!(indexes(&listed), [2, 1, 0]);
    for c in &listed {
        c.verify().unwrap();
    }
}

/// With the upload in the background, losing the server fails the run
/// while the loop is still busy: a rank that never reports again is
/// stopped, not left training on with nothing saved.
#[test]
fn a_background_upload_failure_stops_a_busy_loop() {
    let Some(moto) = servers::moto() else { return };
    let direct = servers::s3(moto.port, moto.port, "busy");
    let proxy = Proxy::start(moto.port, BUDGET);
    let backend = servers::s3_existing(proxy.port, "busy");
    let steps = json!([
        {"write": "small/w", "text": "committed before the outage"},
        {"report": {"step": 0}, "checkpoint": "small"},
        {"write": "big/weights.bin", "bytes": 48_000_000, "seed": 4},
        {"report": {"step": 1}, "checkpoint": "big"},
        {"spin": true},
    ]);
    let result = Trainer::builder(TEST_GUEST)
        .train_loop_config(json!({ "steps": steps }))
        .run_config(RunConfig {
            name: Some("busy".into()),
            storage_path: backend.url.clone(),
            storage_options: StorageOptions {
                max_retries: 1,
                retry_timeout: Duration::from_secs(5),
                ..backend.options.clone()
            },
            ..Default::default()
        })
        .build()
        .unwrap()
        .fit()
        .unwrap();
    assert!(proxy.is_down());
    let e = result.error.expect("the failed upload fails the run");
    assert_eq!(e.kind, FailureKind::Storage, "{e}");
    let listed =
        trainhost::committed_checkpoints_with(&format!("{}/busy", direct.url), &direct.options)
            .unwrap();
    assert_eq!(indexes(&listed), [0]);
    listed[0].verify().unwrap();
}
