//! report: collective, merged, byte-identical, checksummed (R5-R12, R25).

use serde_json::json;
use sha2::{Digest, Sha256};
use trainhost::{Checkpoint, MetricValue};

use crate::util::*;

#[test]
fn one_rank_reports_files_that_are_stored_byte_identical() {
    let run = run(
        1,
        json!([
            {"write": "ckpt/weights.bin", "bytes": 3_000_000, "seed": 7},
            {"write": "ckpt/nested/deeper/notes.txt", "text": "epoch 0"},
            {"write": "ckpt/empty", "text": ""},
            {"report": {"loss": 0.5, "epoch": 0}, "checkpoint": "ckpt"},
        ]),
    );
    run.assert_ok();
    let dir = run.dir().join("checkpoint_000000");
    assert_eq!(
        files(&dir),
        ["empty", "nested/deeper/notes.txt", "weights.bin"]
    );
    assert_eq!(
        std::fs::read(dir.join("weights.bin")).unwrap(),
        pseudo_random(3_000_000, 7)
    );
    assert_eq!(
        std::fs::read(dir.join("nested/deeper/notes.txt")).unwrap(),
        b"epoch 0"
    );
    assert_eq!(std::fs::read(dir.join("empty")).unwrap(), b"");
}

#[test]
fn the_manifest_lists_sizes_checksums_metrics_and_ranks() {
    let run = run(
        2,
        json!([
            {"write": "ckpt/model-rank={rank}.bin", "bytes": 1000, "seed": 1},
            {"report": {"loss": 0.25, "eval": {"acc": 0.9}}, "checkpoint": "ckpt"},
        ]),
    );
    run.assert_ok();
    let dir = run.dir().join("checkpoint_000000");
    let manifest: trainhost::Manifest =
        serde_json::from_slice(&std::fs::read(dir.join(".trainhost/manifest.json")).unwrap())
            .unwrap();
    assert_eq!(manifest.checkpoint_index, 0);
    assert_eq!(manifest.report_index, 0);
    assert_eq!(manifest.ranks, [0, 1]);
    assert_eq!(manifest.world_size, 2);
    assert_eq!(
        manifest.metrics.get("loss"),
        Some(&MetricValue::Float(0.25))
    );
    // Nested metrics flatten with '/' (R5).
    assert_eq!(
        manifest.metrics.get("eval/acc"),
        Some(&MetricValue::Float(0.9))
    );
    assert_eq!(manifest.files.len(), 2);
    for f in &manifest.files {
        let bytes = std::fs::read(dir.join(&f.path)).unwrap();
        assert_eq!(f.size, bytes.len() as u64);
        assert_eq!(f.sha256, hex(&Sha256::digest(&bytes)));
    }
    assert_eq!(manifest.files[1].path, "model-rank=1.bin");
    assert_eq!(manifest.files[1].ranks, [1]);
    Checkpoint::open(dir.to_str().unwrap())
        .unwrap()
        .verify()
        .unwrap();
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn four_ranks_shards_merge_into_one_checkpoint() {
    let run = run(
        4,
        json!([
            {"write": "ckpt/model-rank={rank}.bin", "bytes": 200_000, "seed": 3},
            {"write": "ckpt/shared/config.json", "text": "{\"same\": true}"},
            {"report": {"step": 1}, "checkpoint": "ckpt", "ranks": [0, 1, 2, 3]},
        ]),
    );
    run.assert_ok();
    let dir = run.dir().join("checkpoint_000000");
    assert_eq!(
        files(&dir),
        [
            "model-rank=0.bin",
            "model-rank=1.bin",
            "model-rank=2.bin",
            "model-rank=3.bin",
            "shared/config.json",
        ]
    );
    let manifest = Checkpoint::open(dir.to_str().unwrap())
        .unwrap()
        .manifest()
        .clone();
    let shared = manifest
        .files
        .iter()
        .find(|f| f.path == "shared/config.json")
        .unwrap();
    assert_eq!(
        shared.ranks,
        [0, 1, 2, 3],
        "identical files from several ranks are accepted"
    );
}

#[test]
fn only_the_ranks_that_pass_a_directory_contribute() {
    let run = run(
        3,
        json!([
            {"write": "ckpt/part-{rank}", "text": "rank {rank}"},
            {"report": {"loss": 1}, "checkpoint": "ckpt", "ranks": [1]},
            {"report": {"loss": 1}, "ranks": [0, 2]},
            {"report": {"loss": 2}},
        ]),
    );
    run.assert_ok();
    assert_eq!(checkpoint_dirs(&run.dir()), ["checkpoint_000000"]);
    assert_eq!(files(&run.dir().join("checkpoint_000000")), ["part-1"]);
    assert_eq!(run.result.metrics_history.len(), 2);
    assert_eq!(run.result.metrics_history[0].checkpoint, Some(0));
    assert_eq!(run.result.metrics_history[1].checkpoint, None);
}

#[test]
fn differing_bytes_under_one_name_are_a_collision_naming_path_and_ranks() {
    let run = run(
        3,
        json!([
            {"write": "ckpt/model.bin", "text": "weights of rank {rank}"},
            {"report": {"loss": 1}, "checkpoint": "ckpt"},
            {"write": "ckpt/model.bin", "text": "agreed"},
            {"report": {"loss": 2}, "checkpoint": "ckpt"},
        ]),
    );
    run.assert_ok();
    for rank in 0..3 {
        let out = run.stdout(rank);
        assert!(
            out[0].starts_with("report refused: checkpoint collision"),
            "{out:?}"
        );
        assert!(out[0].contains("\"model.bin\""), "{out:?}");
        assert!(
            out[0].contains("ranks [0]")
                && out[0].contains("ranks [1]")
                && out[0].contains("ranks [2]"),
            "{out:?}"
        );
        assert_eq!(out[1], "report ok");
    }
    // Nothing was persisted for the refused report; the next one is
    // checkpoint 0 and holds the agreed bytes.
    assert_eq!(checkpoint_dirs(&run.dir()), ["checkpoint_000000"]);
    assert_eq!(
        std::fs::read(run.dir().join("checkpoint_000000/model.bin")).unwrap(),
        b"agreed"
    );
}

#[test]
fn same_size_different_bytes_is_also_a_collision() {
    let run = run(
        2,
        json!([
            {"write": "ckpt/x", "text": "r{rank}"},
            {"report": {}, "checkpoint": "ckpt"},
        ]),
    );
    run.assert_ok();
    assert!(run.stdout(1)[0].contains("sha256"), "{:?}", run.stdout(1));
    assert!(checkpoint_dirs(&run.dir()).is_empty());
}

#[test]
fn the_guest_may_reuse_its_directory_after_report_returns() {
    let run = run(
        1,
        json!([
            {"write": "ckpt/state", "text": "first"},
            {"report": {"i": 0}, "checkpoint": "ckpt"},
            {"remove": "ckpt"},
            {"write": "ckpt/state", "text": "second"},
            {"report": {"i": 1}, "checkpoint": "ckpt"},
        ]),
    );
    run.assert_ok();
    assert_eq!(
        std::fs::read(run.dir().join("checkpoint_000000/state")).unwrap(),
        b"first"
    );
    assert_eq!(
        std::fs::read(run.dir().join("checkpoint_000001/state")).unwrap(),
        b"second"
    );
}

#[test]
fn every_report_is_in_the_history_in_order_with_rank_zeros_metrics() {
    let run = run(
        2,
        json!([
            {"report": {"loss": 3, "who": "r{rank}"}},
            {"write": "c/f", "text": "x", "ranks": [0]},
            {"report": {"loss": 2}, "checkpoint": "c", "ranks": [0]},
            {"report": {"loss": 2}, "ranks": [1]},
            {"report": {"loss": 1, "done": true}},
        ]),
    );
    run.assert_ok();
    let history = &run.result.metrics_history;
    let indexes: Vec<u64> = history.iter().map(|r| r.report_index).collect();
    assert_eq!(indexes, [0, 1, 2]);
    assert_eq!(
        history[0].metrics.get("who"),
        Some(&MetricValue::Text("r0".into()))
    );
    assert_eq!(
        history[2].metrics.get("done"),
        Some(&MetricValue::Boolean(true))
    );
    // The same history is in storage, one JSON object a line.
    let stored = std::fs::read_to_string(run.dir().join("metrics.jsonl")).unwrap();
    assert_eq!(stored.lines().count(), 3);
    let line: serde_json::Value = serde_json::from_str(stored.lines().nth(1).unwrap()).unwrap();
    assert_eq!(line["checkpoint"], 0);
}

#[test]
fn the_result_holds_checkpoints_metrics_history_and_path() {
    let run = run(
        2,
        json!([
            {"write": "ckpt/e", "text": "0", "ranks": [0]},
            {"report": {"loss": 2.0}, "checkpoint": "ckpt", "ranks": [0]},
            {"report": {"loss": 2.0}, "ranks": [1]},
            {"write": "ckpt/e", "text": "1", "ranks": [0]},
            {"report": {"loss": 1.0}, "checkpoint": "ckpt", "ranks": [0]},
            {"report": {"loss": 1.0}, "ranks": [1]},
            {"report": {"loss": 0.5}},
        ]),
    );
    run.assert_ok();
    let r = &run.result;
    assert_eq!(r.run_name, "t");
    assert_eq!(
        r.path,
        run.storage
            .path()
            .canonicalize()
            .unwrap()
            .join("t")
            .display()
            .to_string()
    );
    assert_eq!(r.failures, 0);
    assert!(r.error.is_none());
    assert_eq!(
        r.metrics.as_ref().unwrap().get("loss"),
        Some(&MetricValue::Float(0.5))
    );
    assert_eq!(r.metrics_history.len(), 3);
    let latest = r.checkpoint.as_ref().unwrap();
    assert_eq!(latest.index(), 1);
    let order: Vec<u64> = r.best_checkpoints.iter().map(|(c, _)| c.index()).collect();
    assert_eq!(
        order,
        [1, 0],
        "without a score attribute the newest ranks best"
    );
    assert_eq!(
        r.best_checkpoints[1].1.get("loss"),
        Some(&MetricValue::Float(2.0))
    );

    // R26: open as a directory, copy to a directory of our choosing.
    let dir = latest.as_directory().unwrap();
    assert_eq!(std::fs::read(dir.path().join("e")).unwrap(), b"1");
    let dest = run.storage.path().join("copy/here");
    latest.to_directory(&dest).unwrap();
    assert_eq!(files(&dest), ["e"]);
    assert!(
        latest.to_directory(&dest).is_err(),
        "a non-empty destination is refused"
    );

    let json = r.to_json();
    assert_eq!(json["checkpoint"]["index"], 1);
    assert_eq!(json["best_checkpoints"].as_array().unwrap().len(), 2);
    assert_eq!(json["metrics"]["loss"], 0.5);
}

#[test]
fn bad_metric_names_are_refused_and_do_not_count_as_a_report() {
    let run = run(
        2,
        json!([
            {"report": {"": 1}, "ranks": [1]},
            {"report": {"loss": 1}},
        ]),
    );
    run.assert_ok();
    assert!(
        run.stdout(1)[0].starts_with("report refused: metrics refused: a metric has an empty name"),
        "{:?}",
        run.stdout(1)
    );
    assert_eq!(run.result.metrics_history.len(), 1);
}

#[test]
fn the_context_reaches_every_rank_and_the_config_arrives_unchanged() {
    let run = run(3, json!([{"print_context": true}]));
    run.assert_ok();
    for rank in 0..3 {
        let line = &run.stdout(rank)[0];
        assert!(
            line.starts_with(&format!(
                "context: rank={rank} size=3 local_rank={rank} local_size=3 node=0 run=t config="
            )),
            "{line}"
        );
        let config: serde_json::Value =
            serde_json::from_str(line.split_once("config=").unwrap().1).unwrap();
        assert_eq!(config, json!({"steps": [{"print_context": true}]}));
    }
}

#[test]
fn memory_storage_works_for_embedders() {
    let (builder, storage, lines) = scripted(
        1,
        json!([
            {"write": "c/a", "text": "in memory"},
            {"report": {"x": 1}, "checkpoint": "c"},
        ]),
    );
    let builder = builder.run_config(trainhost::RunConfig {
        name: Some("m".into()),
        storage_path: "memory://".into(),
        ..Default::default()
    });
    let run = finish(builder, storage, lines);
    run.assert_ok();
    assert_eq!(run.result.path, "memory:///m");
    let c = run.result.checkpoint.as_ref().unwrap();
    c.verify().unwrap();
    let dir = c.as_directory().unwrap();
    assert_eq!(std::fs::read(dir.path().join("a")).unwrap(), b"in memory");
}

#[test]
fn relative_paths_mean_the_same_directory_to_the_guest_and_the_host() {
    let run = run(
        1,
        json!([
            {"write_cwd": "rel/ckpt/state", "text": "written relative"},
            {"report": {}, "checkpoint": "rel/ckpt"},
            {"report": {}, "checkpoint": "/scratch/rel/ckpt"},
        ]),
    );
    run.assert_ok();
    for dir in ["checkpoint_000000", "checkpoint_000001"] {
        assert_eq!(
            std::fs::read(run.dir().join(dir).join("state")).unwrap(),
            b"written relative"
        );
    }
}
