//! Entry points for the fuzz targets in `fuzz/` (the `fuzzing` feature):
//! each feeds untrusted bytes to one of the parsers that read storage or
//! guest input, and checks the invariant it promises. Not part of the
//! public API.

#[cfg(unix)]
use std::os::unix::fs::MetadataExt;
#[cfg(unix)]
use std::path::PathBuf;
#[cfg(unix)]
use std::sync::OnceLock;

use crate::metrics::{MetricValue, Metrics};
use crate::record::Manifest;
#[cfg(unix)]
use crate::runtime::sandbox::{SCRATCH_GUEST_PATH, Sandbox};

/// A manifest from storage: parsing never panics; one that parses has only
/// safe relative paths (or is refused when opened) and survives a round
/// trip.
pub fn manifest(data: &[u8]) {
    let Ok(m) = Manifest::from_json(data) else {
        return;
    };
    let json = serde_json::to_vec(&m).expect("a parsed manifest serializes");
    let again = Manifest::from_json(&json).expect("a serialized manifest parses");
    assert_eq!(again.files, m.files);
    for f in &m.files {
        // Either safe, or refused by the check every reader applies.
        let _ = crate::record::manifest::check_relative_path(&f.path);
    }
}

/// The run state and the metrics history from storage: never panic.
pub fn run_state(data: &[u8]) {
    crate::record::parse_run_state(data);
    let _ = crate::record::parse_history(data);
}

/// Metrics as a guest sends them (`name\0value\0...`, value by first byte:
/// i integer, f float bits, t text, b bool): conversion never panics, and
/// accepted metrics survive a JSON round trip.
pub fn metrics(data: &[u8]) {
    let mut pairs = Vec::new();
    let mut parts = data.split(|b| *b == 0);
    while let (Some(name), Some(value)) = (parts.next(), parts.next()) {
        let name = String::from_utf8_lossy(name).into_owned();
        let value = match value.split_first() {
            Some((b'i', rest)) => MetricValue::Integer(i64::from_le_bytes(pad8(rest))),
            Some((b'f', rest)) => {
                MetricValue::Float(f64::from_bits(u64::from_le_bytes(pad8(rest))))
            }
            Some((b'b', rest)) => MetricValue::Boolean(rest.first().is_some_and(|b| b & 1 == 1)),
            _ => MetricValue::Text(String::from_utf8_lossy(value).into_owned()),
        };
        pairs.push((name, value));
    }
    let Ok(m) = Metrics::from_pairs(pairs) else {
        return;
    };
    let json = serde_json::to_string(&m).expect("metrics serialize");
    let back: Metrics = serde_json::from_str(&json).expect("serialized metrics parse");
    assert_eq!(back.len(), m.len());
    for ((a, x), (b, y)) in m.iter().zip(back.iter()) {
        assert_eq!(a, b);
        match (x, y) {
            (MetricValue::Float(p), MetricValue::Float(q)) if p.is_nan() => assert!(q.is_nan()),
            _ => assert_eq!(x, y, "{json}"),
        }
    }
    // Arbitrary JSON as a stored metrics object never panics either.
    let _ = serde_json::from_slice::<Metrics>(data);
}

fn pad8(bytes: &[u8]) -> [u8; 8] {
    let mut out = [0u8; 8];
    let n = bytes.len().min(8);
    out[..n].copy_from_slice(&bytes[..n]);
    out
}

/// A sandbox over a fixed tree with links that try to lead out, and the
/// inodes of every directory inside it (symbolic links and inodes make it
/// Unix only).
#[cfg(unix)]
struct Tree {
    _root: tempfile::TempDir,
    sandbox: Sandbox,
    inside: Vec<u64>,
}

#[cfg(unix)]
fn tree() -> &'static Tree {
    static TREE: OnceLock<Tree> = OnceLock::new();
    TREE.get_or_init(|| {
        let root = tempfile::tempdir().expect("a temporary directory");
        let scratch: PathBuf = root.path().join("scratch");
        let outside = root.path().join("outside");
        for d in ["a/b/c", "ckpt/sub", "x y"] {
            std::fs::create_dir_all(scratch.join(d)).expect("create");
        }
        std::fs::create_dir_all(outside.join("deeper")).expect("create");
        std::fs::write(scratch.join("file"), b"f").expect("write");
        let link = |target: &str, name: &str| {
            let _ = std::os::unix::fs::symlink(target, scratch.join(name));
        };
        link("../outside", "up");
        link(outside.to_str().expect("utf-8"), "abs");
        link("a/b", "in");
        link("/", "root");
        link("a/../../outside", "sneaky");
        let mut inside = Vec::new();
        for d in ["", "a", "a/b", "a/b/c", "ckpt", "ckpt/sub", "x y"] {
            inside.push(std::fs::metadata(scratch.join(d)).expect("stat").ino());
        }
        let mut sandbox = Sandbox::new(SCRATCH_GUEST_PATH);
        sandbox.mount(SCRATCH_GUEST_PATH, &scratch).expect("mount");
        Tree {
            _root: root,
            sandbox,
            inside,
        }
    })
}

/// A guest's checkpoint path: resolving never panics, and a directory it
/// opens is always one inside the sandbox.
#[cfg(unix)]
pub fn guest_path(data: &[u8]) {
    let path = String::from_utf8_lossy(data);
    let t = tree();
    if let Ok(dir) = t.sandbox.open_dir(&path) {
        let file = dir.into_std_file();
        let ino = file.metadata().expect("stat an open directory").ino();
        assert!(
            t.inside.contains(&ino),
            "{path:?} opened a directory outside the sandbox"
        );
    }
}
