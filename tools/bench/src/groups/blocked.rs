//! How long a guest waits in `report` with a checkpoint.

use std::sync::Arc;

use anyhow::Result;
use serde_json::json;
use trainhost::{CheckpointConfig, RunConfig};

use crate::common::{
    Row, Unit, checkpoint_sizes, layout, local_run, median, metric, run_guest, size_name, sync,
};
use crate::goals;

pub(crate) fn blocked(quick: bool, reps: usize) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &total in checkpoint_sizes(quick) {
        let config = json!({"mode": "checkpoint", "files": layout(total), "reports": 3});
        // Per mode (blocking, background): first, changed, unchanged.
        let mut samples = [[vec![], vec![], vec![]], [vec![], vec![], vec![]]];
        // Small checkpoints are at the mercy of the disk's state: more samples.
        let reps = if total <= 64 << 20 {
            reps * 2 + 1
        } else {
            reps
        };
        for (mode, background) in (0..reps).flat_map(|_| [(0, false), (1, true)]) {
            let storage = tempfile::tempdir()?;
            sync();
            let result = run_guest(
                config.clone(),
                1,
                RunConfig {
                    persist_in_background: background,
                    checkpoint_config: CheckpointConfig {
                        num_to_keep: Some(1),
                        ..Default::default()
                    },
                    ..local_run(storage.path())
                },
                Arc::default(),
            )?;
            for (i, name) in ["first_ns", "changed_ns", "unchanged_ns"]
                .iter()
                .enumerate()
            {
                samples[mode][i].push(metric(&result, name)?);
            }
        }
        let [blocking, background] = samples.map(|m| {
            let [a, b, c] = m.map(median);
            (a, b, c)
        });
        let name = size_name(total);
        rows.push(Row {
            group: "blocked",
            measure: format!("guest blocked in `report` with a new {name} checkpoint"),
            baseline_name: "--wait-for-upload".into(),
            baseline: blocking.0,
            ours: background.0,
            unit: Unit::Nanos,
            goal: blocked_goal(total),
            met: (total == 64 << 20).then_some(background.0 <= goals::BLOCKED_64MIB_NS),
            spread: None,
        });
        rows.push(Row {
            group: "blocked",
            measure: format!("guest blocked in `report`, {name} checkpoint, every file changed"),
            baseline_name: "--wait-for-upload".into(),
            baseline: blocking.1,
            ours: background.1,
            unit: Unit::Nanos,
            goal: blocked_goal(total),
            met: (total == 64 << 20).then_some(background.1 <= goals::BLOCKED_64MIB_NS),
            spread: None,
        });
        rows.push(Row {
            group: "blocked",
            measure: format!("persist an unchanged {name} checkpoint (incremental: linked)"),
            baseline_name: "persisting it new (--wait-for-upload)".into(),
            baseline: blocking.0,
            ours: blocking.2,
            unit: Unit::Nanos,
            goal: goals::comparison("locally every file is still read and hashed"),
            met: None,
            spread: None,
        });
    }
    Ok(rows)
}

/// The goal of a blocked-in-report row: stated for 64 MiB only.
fn blocked_goal(total: u64) -> String {
    if total == 64 << 20 {
        format!("≤ {} ms blocked", goals::BLOCKED_64MIB_NS / 1e6)
    } else {
        goals::comparison("the 5 ms goal is for 64 MiB")
    }
}
