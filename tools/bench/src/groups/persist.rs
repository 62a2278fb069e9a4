//! Persisting a checkpoint to local storage against `cp -r`, each side
//! with the same durability: both flushed to disk, or both left in the
//! page cache.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::Result;
use trainhost::StorageOptions;
use trainhost::bench::Durability;

use crate::common::{
    Paired, Row, Sampling, checkpoint_sizes, describe, layout, size_name, small_files_layout, sync,
    time_command,
};
use crate::goals;

pub(crate) fn persist_local(quick: bool) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let mut layouts: Vec<(u64, Vec<(u32, u64)>)> = checkpoint_sizes(quick)
        .iter()
        .map(|&total| (total, layout(total)))
        .collect();
    layouts.insert(1, (64 << 20, small_files_layout(64 << 20, 1000)));
    for (total, layout) in layouts {
        let work = tempfile::tempdir()?;
        let src = work.path().join("src");
        trainhost_bench_kernel::write_layout(&src, &layout, 1)?;
        let (mut on_disk, mut in_cache, mut hashed) =
            (Paired::default(), Paired::default(), Paired::default());
        let reps = Sampling::of_checkpoint(total).per_pass(quick);
        for i in 0..reps {
            let m = measure(&src, work.path(), i)?;
            on_disk.push(m.cp + m.sync, m.ours_on_disk);
            in_cache.push(m.cp, m.ours_in_cache);
            hashed.push(m.cp + m.sha256sum, m.ours_in_cache);
        }
        let what = format!(
            "persist a {} checkpoint ({})",
            size_name(total),
            describe(&layout)
        );
        let row = |pairs: &Paired, measure, baseline_name: &str, goal, met: bool| {
            pairs.row(
                "persist",
                measure,
                baseline_name.into(),
                goal,
                move |b, o| met.then_some(o <= goals::PERSIST_VS_CP_SYNC * b),
            )
        };
        rows.push(row(
            &on_disk,
            format!(
                "{what} to local storage as a commit does: SHA-256, write, `fdatasync` of every file and directory (on disk)"
            ),
            "`cp -r`, then `sync` (on disk)",
            format!("≤ {} × `cp -r` + `sync`", goals::PERSIST_VS_CP_SYNC),
            true,
        ));
        rows.push(row(
            &in_cache,
            format!("{what}: SHA-256 and write, left in the page cache"),
            "`cp -r` (left in the page cache)",
            goals::comparison("the goal is for data on disk, above"),
            false,
        ));
        rows.push(row(
            &hashed,
            format!("{what}: SHA-256 and write, left in the page cache"),
            "`cp -r`, then `sha256sum` of every copy (the same work by two tools, in the page cache)",
            goals::comparison("the cost of hashing"),
            false,
        ));
    }
    Ok(rows)
}

/// One repetition: nanoseconds of each side.
struct Measured {
    cp: f64,
    sync: f64,
    sha256sum: f64,
    ours_on_disk: f64,
    ours_in_cache: f64,
}

fn measure(src: &Path, work: &Path, i: usize) -> Result<Measured> {
    let dst = work.join(format!("cp-{i}"));
    // Every measure starts with no dirty pages: the previous one's would
    // otherwise be written back during it (and `sync` would flush them).
    sync();
    let (cp, _) = time_command(Command::new("cp").arg("-r").arg(src).arg(&dst))?;
    let started = Instant::now();
    sync();
    let sync_took = started.elapsed();
    let hash = format!(
        "find {0} -type f -exec sha256sum {{}} + > /dev/null",
        dst.display()
    );
    let (sha256sum, _) = time_command(Command::new("sh").arg("-c").arg(&hash))?;
    std::fs::remove_dir_all(&dst)?;
    let ours = |durability| -> Result<f64> {
        let storage = work.join("storage");
        sync();
        let started = Instant::now();
        trainhost::bench::persist_directory(
            src,
            storage.to_str().expect("temporary paths are UTF-8"),
            &format!("ours-{i}"),
            &StorageOptions::default(),
            durability,
        )?;
        let took = started.elapsed().as_nanos() as f64;
        std::fs::remove_dir_all(&storage)?;
        Ok(took)
    };
    Ok(Measured {
        cp: cp.as_nanos() as f64,
        sync: sync_took.as_nanos() as f64,
        sha256sum: sha256sum.as_nanos() as f64,
        ours_on_disk: ours(Durability::OnDisk)?,
        ours_in_cache: ours(Durability::PageCache)?,
    })
}
