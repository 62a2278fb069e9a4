//! Tests of moving files in and out of storage (`transfer.rs`).

use super::*;

/// More files at once than there are buffers, in parts and in single
/// requests of several buffers: uploads in parts wait for buffers
/// while keeping their own parts going, single requests wait for all
/// of theirs at once, and every upload completes with the right bytes
/// and digest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_uploads_share_the_buffers_and_complete() {
    let store = Arc::new(object_store::memory::InMemory::new());
    let storage = Storage::from_store(store, "memory://").child("run");
    let dir = tempfile::tempdir().unwrap();
    // Three buffers each in one request; five parts each.
    let single = 2 * PART_SIZE + 12_345;
    let parts = SINGLE_REQUEST_AT_MOST as usize + 12_345;
    let sizes = [single, parts, single, single, parts, single, single, parts];
    let files: Vec<(String, usize, String)> = sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let bytes: Vec<u8> = (0..size)
                .map(|b| (b as u8).wrapping_mul(i as u8 + 1))
                .collect();
            let name = format!("f{i}.bin");
            std::fs::write(dir.path().join(&name), &bytes).unwrap();
            (name, size, hex::encode(Sha256::digest(&bytes)))
        })
        .collect();
    let meter = Meter::default();
    let uploads = files.iter().map(|(name, size, _)| {
        let file = std::fs::File::open(dir.path().join(name)).unwrap();
        storage.upload_file(name, file, *size as u64, None, &meter)
    });
    let digests = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        futures::future::try_join_all(uploads),
    )
    .await
    .expect("the uploads do not wait on each other forever")
    .unwrap();
    for ((name, size, sha256), digest) in files.iter().zip(digests) {
        assert_eq!(&digest, sha256, "{name}");
        let (stored, stored_digest) = storage.digest(name).await.unwrap();
        assert_eq!((stored, stored_digest), (*size as u64, digest), "{name}");
    }
}

/// A file that is not the size it was listed with is refused, whether
/// it shrank or grew, in one request of several buffers too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_of_another_size_than_listed_is_refused() {
    let store = Arc::new(object_store::memory::InMemory::new());
    let storage = Storage::from_store(store, "memory://").child("run");
    let dir = tempfile::tempdir().unwrap();
    let size = 2 * PART_SIZE;
    let path = dir.path().join("f.bin");
    std::fs::write(&path, vec![7u8; size]).unwrap();
    let meter = Meter::default();
    for listed in [size - 1, size + 1, PART_SIZE + 1] {
        let file = std::fs::File::open(&path).unwrap();
        let e = storage
            .upload_file("f.bin", file, listed as u64, None, &meter)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("f.bin"), "{listed}: {e}");
    }
    let file = std::fs::File::open(&path).unwrap();
    storage
        .upload_file("f.bin", file, size as u64, None, &meter)
        .await
        .unwrap();
}
