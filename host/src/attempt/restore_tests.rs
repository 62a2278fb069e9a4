//! Tests of restoring checkpoints for a host's ranks (`restore.rs`).

use super::*;
use crate::config::Retention;
use crate::metrics::Metrics;
use crate::storage::Storage;

/// A run in memory with one committed checkpoint holding `w`, and an
/// empty restore cache for it.
struct Fixture {
    rt: tokio::runtime::Runtime,
    ledger: Arc<Ledger>,
    storage: Storage,
    root: tempfile::TempDir,
    cache: Arc<RestoreCache>,
}

fn committed() -> Fixture {
    let store = Arc::new(object_store::memory::InMemory::new());
    committed_in(Storage::from_store(store, "memory://t"))
}

fn committed_in(storage: Storage) -> Fixture {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let storage = storage.child("run");
    let ledger = crate::ledger::open_for_test(&rt, &storage, Retention::default(), false).unwrap();
    let work = tempfile::tempdir().unwrap();
    std::fs::write(work.path().join("w"), "weights").unwrap();
    let dir =
        cap_std::fs::Dir::open_ambient_dir(work.path(), cap_std::ambient_authority()).unwrap();
    let plan = crate::persist::merge(vec![crate::persist::capture(0, dir, "ck").unwrap()]).unwrap();
    let uploaded = rt.block_on(ledger.upload(0, &plan, true)).unwrap();
    rt.block_on(ledger.commit_uploaded(0, 0, &Metrics::new(), &[0], 1, uploaded))
        .unwrap();
    let root = tempfile::tempdir().unwrap();
    let cache = Arc::new(RestoreCache::new(root.path().to_path_buf(), "/restored"));
    Fixture {
        rt,
        ledger: Arc::new(ledger),
        storage,
        root,
        cache,
    }
}

/// Storage that failed during a restore is asked again by the next
/// attempt: only damage is remembered for the run.
#[test]
fn a_restore_that_failed_is_tried_again_by_the_next_attempt() {
    let Fixture {
        rt,
        ledger,
        storage,
        root,
        cache,
    } = committed();
    let dir = storage.child("checkpoint_000000");
    let bytes = rt.block_on(dir.get("w")).unwrap().unwrap();
    rt.block_on(dir.delete("w")).unwrap();
    let first = Restorer::new(Arc::clone(&cache), Arc::clone(&ledger), None);
    let e = rt.block_on(first.resolve()).unwrap_err();
    assert!(matches!(e, RestoreError::Failed(_)), "{e}");

    rt.block_on(dir.put("w", bytes)).unwrap();
    let next = Restorer::new(Arc::clone(&cache), ledger, None);
    let path = rt.block_on(next.resolve()).unwrap();
    assert_eq!(path.as_deref(), Some("/restored/checkpoint_000000"));
    let restored = root.path().join("checkpoint_000000/w");
    assert_eq!(std::fs::read_to_string(restored).unwrap(), "weights");
}

/// The copy started ahead of an attempt is the one its ranks are
/// handed.
#[test]
fn the_ranks_are_handed_the_copy_started_ahead() {
    let Fixture {
        rt,
        ledger,
        root,
        cache,
        ..
    } = committed();
    let _ahead = cache.prefetch(Arc::clone(&ledger), None, rt.handle());
    let restored = root.path().join("checkpoint_000000/w");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !restored.exists() {
        assert!(std::time::Instant::now() < deadline, "no copy was made");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let key = "checkpoint_000000";
    let cell = Arc::clone(cache.entries.lock().unwrap().get(key).unwrap());
    let path = rt
        .block_on(Restorer::new(Arc::clone(&cache), ledger, None).resolve())
        .unwrap();
    assert_eq!(path.as_deref(), Some("/restored/checkpoint_000000"));
    // Handed the prefetch's result, not a second copy.
    assert!(Arc::ptr_eq(
        &cell,
        cache.entries.lock().unwrap().get(key).unwrap()
    ));
    assert!(cell.initialized());
}

/// A copy started ahead stops when it is dropped, even while storage
/// holds it, and restores nothing more: the ranks of the next attempt
/// then copy the checkpoint themselves.
#[test]
fn dropping_a_copy_started_ahead_stops_it() {
    let store = Arc::new(crate::storage::held::Held::reads());
    let Fixture {
        rt,
        ledger,
        root,
        cache,
        ..
    } = committed_in(Storage::from_store(store.clone(), "held://t"));
    store.hold_reads_of.send_replace(Some("w".into()));
    let ahead = cache.prefetch(Arc::clone(&ledger), None, rt.handle());
    let mut held = store.reads_held.subscribe();
    rt.block_on(held.wait_for(|n| *n > 0)).unwrap();

    let (dropped, done) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(ahead);
        dropped.send(()).unwrap();
    });
    done.recv_timeout(std::time::Duration::from_secs(30))
        .expect("dropping the copy waited for storage");
    assert!(!root.path().join("checkpoint_000000").exists());

    store.hold_reads_of.send_replace(None);
    let path = rt
        .block_on(Restorer::new(Arc::clone(&cache), ledger, None).resolve())
        .unwrap();
    assert_eq!(path.as_deref(), Some("/restored/checkpoint_000000"));
    let restored = root.path().join("checkpoint_000000/w");
    assert_eq!(std::fs::read_to_string(restored).unwrap(), "weights");
}

/// On local storage the restored files are the stored ones, linked
/// (nothing is copied), and still verified: a stored file changed
/// behind its manifest's back fails the restore as damage.
#[test]
fn a_checkpoint_in_local_storage_is_restored_as_links_and_verified() {
    use std::os::unix::fs::MetadataExt;
    let stored_root = tempfile::tempdir().unwrap();
    let local = Storage::open(
        &crate::config::Location::Local(stored_root.path().to_owned()),
        &crate::config::StorageOptions::default(),
    )
    .unwrap();
    let Fixture {
        rt, ledger, root, ..
    } = committed_in(local);
    let restorer = |root: &tempfile::TempDir| {
        let cache = Arc::new(RestoreCache::new(root.path().to_owned(), "/restored"));
        Restorer::new(cache, Arc::clone(&ledger), None)
    };
    let path = rt.block_on(restorer(&root).resolve()).unwrap();
    assert_eq!(path.as_deref(), Some("/restored/checkpoint_000000"));
    let stored = stored_root.path().join("run/checkpoint_000000/w");
    let restored = root.path().join("checkpoint_000000/w");
    assert_eq!(std::fs::read_to_string(&restored).unwrap(), "weights");
    assert_eq!(
        std::fs::metadata(&restored).unwrap().ino(),
        std::fs::metadata(&stored).unwrap().ino(),
        "restored by a link to the stored file"
    );

    std::fs::write(&stored, "weightz").unwrap();
    let again = tempfile::tempdir().unwrap();
    let e = rt.block_on(restorer(&again).resolve()).unwrap_err();
    assert!(matches!(e, RestoreError::NoneVerifies { .. }), "{e}");
}
