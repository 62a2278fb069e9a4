//! Persisting a checkpoint to local storage against `cp -r`.

use std::process::Command;
use std::time::Instant;

use anyhow::Result;
use trainhost::StorageOptions;

use crate::common::{
    Row, Unit, checkpoint_sizes, describe, layout, median, size_name, sync, time_command,
};
use crate::goals;

pub(crate) fn persist_local(quick: bool, reps: usize) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &total in checkpoint_sizes(quick) {
        let layout = layout(total);
        let work = tempfile::tempdir()?;
        let src = work.path().join("src");
        trainhost_bench_kernel::write_layout(&src, &layout, 1)?;
        let (mut cp, mut cp_sync, mut cp_hash, mut ours) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        // A small checkpoint is written in tens of milliseconds, where
        // scheduling noise is large: take more samples.
        let reps = if total <= 64 << 20 { reps * 3 } else { reps };
        for i in 0..reps {
            let dst = work.path().join(format!("cp-{i}"));
            // Start both from a clean page cache state: the previous
            // repetition's dirty pages would otherwise be written back
            // during the next measure.
            sync();
            let (wall, _) = time_command(Command::new("cp").arg("-r").arg(&src).arg(&dst))?;
            cp.push(wall.as_nanos() as f64);
            // A committed checkpoint is on disk (R11); a copy is not until
            // its dirty pages are written back.
            let started = Instant::now();
            sync();
            cp_sync.push((wall + started.elapsed()).as_nanos() as f64);
            // The same work by two tools: copy, then checksum every copy.
            let hash = format!(
                "find {0} -type f -exec sha256sum {{}} + > /dev/null",
                dst.display()
            );
            let (hashed, _) = time_command(Command::new("sh").arg("-c").arg(&hash))?;
            cp_hash.push((wall + hashed).as_nanos() as f64);
            std::fs::remove_dir_all(&dst)?;
            let storage = work.path().join("storage");
            sync();
            let started = Instant::now();
            trainhost::bench::persist_directory(
                &src,
                storage.to_str().unwrap(),
                &format!("ours-{i}"),
                &StorageOptions::default(),
            )?;
            ours.push(started.elapsed().as_nanos() as f64);
            std::fs::remove_dir_all(&storage)?;
        }
        let (cp, cp_sync, cp_hash, ours) =
            (median(cp), median(cp_sync), median(cp_hash), median(ours));
        rows.push(Row {
            group: "persist",
            measure: format!(
                "persist a {} checkpoint to local storage ({}), with SHA-256 of every file",
                size_name(total),
                describe(&layout)
            ),
            baseline_name: "`cp -r` of the same files, left in the page cache".into(),
            baseline: cp,
            ours,
            unit: Unit::Nanos,
            goal: goals::comparison("the goal is against `cp -r` + `sync`, below"),
            met: None,
        });
        rows.push(Row {
            group: "persist",
            measure: format!(
                "persist a {} checkpoint to local storage, as above",
                size_name(total)
            ),
            baseline_name: "`cp -r`, then `sync` (the copy on disk, as a commit is)".into(),
            baseline: cp_sync,
            ours,
            unit: Unit::Nanos,
            goal: format!("≤ {} × `cp -r` + `sync`", goals::PERSIST_VS_CP_SYNC),
            met: Some(ours <= goals::PERSIST_VS_CP_SYNC * cp_sync),
        });
        rows.push(Row {
            group: "persist",
            measure: format!(
                "persist a {} checkpoint to local storage, as above",
                size_name(total)
            ),
            baseline_name: "`cp -r`, then `sha256sum` of every copy (the same work, two tools)"
                .into(),
            baseline: cp_hash,
            ours,
            unit: Unit::Nanos,
            goal: goals::comparison("the cost of hashing"),
            met: None,
        });
    }
    Ok(rows)
}
