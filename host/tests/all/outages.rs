//! Storage outages (R24): one shorter than the retry timeout costs time,
//! not the run; a longer one fails the run naming the operation that
//! failed, and nothing committed is lost. The S3 server sits behind a
//! loopback proxy that goes away in the middle of a 48 MB upload (every
//! connection reset, new ones refused) and comes back.

use std::time::Duration;

use serde_json::json;
use trainhost::{FailureKind, RunConfig, StorageOptions, Trainer};

use crate::servers::{self, Backend, Proxy};
use crate::util::*;

/// Enough for the probe, the run state, the small checkpoint and the
/// history, far from enough for the big upload.
const BUDGET: i64 = 4 * 1024 * 1024;

fn steps() -> serde_json::Value {
    json!([
        {"write": "small/w", "text": "committed before the outage"},
        {"report": {"step": 0}, "checkpoint": "small"},
        {"write": "big/weights.bin", "bytes": 48_000_000, "seed": 4},
        {"report": {"step": 1}, "checkpoint": "big"},
    ])
}

fn fit(backend: &Backend) -> trainhost::TrainResult {
    Trainer::builder(TEST_GUEST)
        .train_loop_config(json!({ "steps": steps() }))
        .run_config(RunConfig {
            name: Some("run".into()),
            storage_path: backend.url.clone(),
            storage_options: backend.options.clone(),
            ..Default::default()
        })
        .output(std::sync::Arc::new(Lines::default()))
        .build()
        .unwrap()
        .fit()
        .unwrap()
}

/// The committed checkpoints of the run, read around the proxy.
fn committed(direct: &Backend) -> Vec<u64> {
    let run = format!("{}/run", direct.url);
    let listed = trainhost::committed_checkpoints_with(&run, &direct.options).unwrap();
    for c in &listed {
        c.verify().unwrap();
    }
    let mut indexes: Vec<u64> = listed.iter().map(|c| c.index()).collect();
    indexes.sort();
    indexes
}

/// An outage of `outage` in the middle of the big upload to `bucket`, with
/// the default retries as a user gets them and `options` changed as said:
/// the run ends well, with both checkpoints committed and no upload left
/// incomplete in the store (`what` names the case in messages).
fn survives(outage: Duration, bucket: &str, options: impl Fn(&mut StorageOptions), what: &str) {
    let Some(moto) = servers::moto() else { return };
    let direct = servers::s3(moto.port, moto.port, bucket);
    let proxy = Proxy::start_with_outage(moto.port, BUDGET, Some(outage));
    let mut backend = servers::s3_existing(proxy.port, bucket);
    let defaults = StorageOptions::default();
    backend.options.max_retries = defaults.max_retries;
    backend.options.retry_timeout = defaults.retry_timeout;
    options(&mut backend.options);
    let result = fit(&backend);
    assert_eq!(proxy.cuts(), 1, "{what}: the storage went away once");
    assert!(result.error.is_none(), "{what}: {:?}", result.error);
    assert_eq!(committed(&direct), [0, 1], "{what}");
    assert_eq!(
        servers::incomplete_uploads(moto.port, bucket),
        0,
        "{what}: an upload the lease lapsed under was aborted once the lease was renewed"
    );
}

#[test]
fn outages_of_2_and_10_seconds_cost_time_not_the_run() {
    for (outage, bucket) in [(2, "outage-2s"), (10, "outage-10s")] {
        survives(
            Duration::from_secs(outage),
            bucket,
            |_| {},
            &format!("{outage} s"),
        );
    }
}

#[test]
fn an_outage_longer_than_the_leases_margin_makes_the_upload_again() {
    // A lease of 4 s counts this host the run's owner for 2 s after each
    // renewal, so an outage of 3 s in the middle of the big upload lapses
    // ownership under it: the upload is dropped, and made again from the
    // start once the lease is renewed after the outage.
    survives(
        Duration::from_secs(3),
        "outage-lapse",
        |o| o.lease_timeout = Duration::from_secs(4),
        "a 3 s outage under a 4 s lease",
    );
}

#[test]
fn an_outage_past_the_retry_timeout_fails_naming_the_upload_not_its_clean_up() {
    let Some(moto) = servers::moto() else { return };
    let direct = servers::s3(moto.port, moto.port, "outage-long");
    let proxy = Proxy::start_with_outage(moto.port, BUDGET, Some(Duration::from_secs(60)));
    let mut backend = servers::s3_existing(proxy.port, "outage-long");
    backend.options.max_retries = StorageOptions::default().max_retries;
    backend.options.retry_timeout = Duration::from_secs(3);
    let result = fit(&backend);
    let e = result
        .error
        .expect("an outage past the retry timeout fails the run");
    assert_eq!(e.kind, FailureKind::Storage);
    assert!(
        e.message.contains("upload weights.bin") && e.message.contains("Connection refused"),
        "names the operation and its cause: {e}"
    );
    assert!(
        !e.message.contains("DELETE") && !e.message.contains("NoSuchUpload"),
        "the failed clean-up of the upload is not the cause: {e}"
    );
    assert_eq!(committed(&direct), [0], "nothing committed was lost");
}
