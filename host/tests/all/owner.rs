//! One owner per run (R27): a second start on a live run is refused naming
//! the owner, a killed owner does not block its run, and an owner paused
//! past its lease is fenced off when it wakes up.

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use futures::StreamExt;
use object_store::ObjectStore;
use serde_json::json;
use trainhost::{Error, RunConfig, StorageOptions, TrainResult, Trainer};

use crate::servers::{self, Backend};
use crate::util::*;

/// Commits, then takes its time, then commits again: long enough for a
/// second start to find the run in use.
fn slow_steps() -> serde_json::Value {
    json!([
        {"write": "c/w", "text": "first"},
        {"report": {"step": 0}, "checkpoint": "c"},
        {"sleep_ms": 1500},
        {"write": "c/w", "text": "second"},
        {"report": {"step": 1}, "checkpoint": "c"},
    ])
}

fn fit(
    url: &str,
    options: &StorageOptions,
    steps: serde_json::Value,
) -> Result<TrainResult, Error> {
    Trainer::builder(TEST_GUEST)
        .train_loop_config(json!({ "steps": steps }))
        .run_config(RunConfig {
            name: Some("shared".into()),
            storage_path: url.to_owned(),
            storage_options: options.clone(),
            ..Default::default()
        })
        .output(Arc::new(Lines::default()))
        .build()
        .unwrap()
        .fit()
}

/// Two starts of one run at the same instant: exactly one runs it to the
/// end, the other is refused naming it, and the run is the winner's alone.
fn two_starts_at_once(url: &str, options: &StorageOptions) {
    let barrier = Arc::new(Barrier::new(2));
    let starts: Vec<_> = (0..2)
        .map(|_| {
            let (barrier, url, options) = (Arc::clone(&barrier), url.to_owned(), options.clone());
            std::thread::spawn(move || {
                barrier.wait();
                fit(&url, &options, slow_steps())
            })
        })
        .collect();
    let outcomes: Vec<_> = starts.into_iter().map(|s| s.join().unwrap()).collect();
    let (ran, refused): (Vec<_>, Vec<_>) = outcomes.into_iter().partition(Result::is_ok);
    assert_eq!((ran.len(), refused.len()), (1, 1), "exactly one runs");
    let e = refused.into_iter().next().unwrap().err().unwrap();
    assert!(matches!(e, Error::RunInUse { .. }), "{e}");
    let message = e.to_string();
    let me = format!("process {} on ", std::process::id());
    assert!(message.contains(&me), "names the owner: {message}");
    assert!(message.contains("--name"), "says what to do: {message}");
    let result = ran.into_iter().next().unwrap().unwrap();
    assert!(result.error.is_none(), "{:?}", result.error);
    assert_eq!(
        result.metrics_history.len(),
        2,
        "the winner's run, untouched"
    );
    let listed = trainhost::committed_checkpoints_with(&format!("{url}/shared"), options).unwrap();
    assert_eq!(listed.len(), 2);
    for c in &listed {
        c.verify().unwrap();
    }
}

#[test]
fn two_starts_at_once_on_local_storage_one_runs_and_the_other_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    two_starts_at_once(tmp.path().to_str().unwrap(), &StorageOptions::default());
    // The lock went with the run: the next start resumes it.
    let again = fit(
        tmp.path().to_str().unwrap(),
        &StorageOptions::default(),
        slow_steps(),
    )
    .unwrap();
    assert!(again.error.is_none(), "{:?}", again.error);
}

#[test]
fn two_starts_at_once_on_s3_one_runs_and_the_other_is_refused() {
    let Some(moto) = servers::moto() else { return };
    let backend = servers::s3(moto.port, moto.port, "owner-race");
    two_starts_at_once(&backend.url, &backend.options);
    // Released at the end: the next start takes the run at once.
    let again = fit(&backend.url, &backend.options, slow_steps()).unwrap();
    assert!(again.error.is_none(), "{:?}", again.error);
}

/// Every object of the bucket and its ETag.
fn objects(backend: &Backend, bucket: &str) -> BTreeMap<String, String> {
    let store = object_store::aws::AmazonS3Builder::new()
        .with_bucket_name(bucket)
        .with_endpoint(&backend.options.options[0].1)
        .with_allow_http(true)
        .with_region("us-east-1")
        .with_access_key_id("test")
        .with_secret_access_key("test")
        .build()
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut out = BTreeMap::new();
        let mut listing = store.list(None);
        while let Some(meta) = listing.next().await {
            let meta = meta.unwrap();
            out.insert(meta.location.to_string(), meta.e_tag.unwrap_or_default());
        }
        out
    })
}

/// The CLI's arguments for the run `name` on `backend`.
fn cli_args(
    backend: &Backend,
    name: &str,
    steps: &serde_json::Value,
    extra: &[&str],
) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "run".into(),
        TEST_GUEST.into(),
        "--config".into(),
        json!({ "steps": steps }).to_string(),
        "--name".into(),
        name.into(),
        "--storage".into(),
        backend.url.clone(),
    ];
    for (k, v) in &backend.options.options {
        args.push("--storage-option".into());
        args.push(format!("{k}={v}"));
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// Attempt 0 commits, says so, then sleeps; a rerun (which restores the
/// attempt number) goes straight through.
fn held_steps() -> serde_json::Value {
    json!([
        {"write": "c/attempt", "text": "{next_attempt}"},
        {"report": {"step": 0}, "checkpoint": "c"},
        {"print": "committed in attempt {attempt}"},
        {"sleep_ms": 4000, "when_attempt": [0]},
        {"report": {"step": 1}, "checkpoint": "c"},
    ])
}

#[test]
fn a_killed_owner_of_an_s3_run_does_not_block_it() {
    let Some(moto) = servers::moto() else { return };
    let backend = servers::s3(moto.port, moto.port, "owner-killed");
    let tmp = tempfile::tempdir().unwrap();
    let args = cli_args(&backend, "killed", &held_steps(), &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut holder = HostProcess::spawn(&args, tmp.path());
    holder.wait_for(|l| l.contains("committed in attempt 0"));
    holder.child.kill().unwrap(); // SIGKILL: its lease stays behind
    holder.child.wait().unwrap();
    // Its process is gone from this host: the run is taken at once, not
    // after the lease's 30 s.
    let started = std::time::Instant::now();
    let rerun = run_bounded(&args, tmp.path(), Duration::from_secs(60));
    assert_eq!(rerun.status, Some(0), "{}", rerun.stderr);
    assert!(
        rerun.stderr.contains("took the run over from process"),
        "{}",
        rerun.stderr
    );
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn an_owner_paused_past_its_lease_is_fenced_off_when_it_wakes_up() {
    let Some(moto) = servers::moto() else { return };
    let bucket = "owner-paused";
    let backend = servers::s3(moto.port, moto.port, bucket);
    let tmp = tempfile::tempdir().unwrap();
    let args = cli_args(
        &backend,
        "paused",
        &held_steps(),
        &["--storage-lease", "6s"],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut paused = HostProcess::spawn(&args, tmp.path());
    paused.wait_for(|l| l.contains("committed in attempt 0"));
    paused.signal("-STOP");
    // While it lives, the run is refused to others.
    let refused = run_bounded(&args, tmp.path(), Duration::from_secs(60));
    assert_eq!(refused.status, Some(2), "{}", refused.stderr);
    assert!(
        refused
            .stderr
            .contains(&format!("in use by process {}", paused.child.id())),
        "{}",
        refused.stderr
    );
    // Listing it needs no ownership.
    let mut listing = vec!["checkpoints", "paused", "--storage", &backend.url];
    let options: Vec<String> = backend
        .options
        .options
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for o in &options {
        listing.extend(["--storage-option", o.as_str()]);
    }
    let listed = run_bounded(&listing, tmp.path(), Duration::from_secs(60));
    assert_eq!(listed.status, Some(0), "{}", listed.stderr);
    // Paused past its lease: the run is taken over and finished.
    std::thread::sleep(Duration::from_millis(6500));
    let next = run_bounded(&args, tmp.path(), Duration::from_secs(60));
    assert_eq!(next.status, Some(0), "{}", next.stderr);
    assert!(
        next.stderr.contains("whose lease had expired"),
        "{}",
        next.stderr
    );
    let finished = objects(&backend, bucket);
    // It wakes up, finds itself fenced off, and fails without writing.
    paused.signal("-CONT");
    let status = paused.child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(paused.child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("no longer owns the run"), "{stderr}");
    assert!(
        stderr.contains("took the run over (generation 2)"),
        "{stderr}"
    );
    assert_eq!(
        objects(&backend, bucket),
        finished,
        "nothing of the new owner's touched"
    );
    let listed =
        trainhost::committed_checkpoints_with(&format!("{}/paused", backend.url), &backend.options)
            .unwrap();
    for c in &listed {
        c.verify().unwrap();
    }
}
