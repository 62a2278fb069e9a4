//! Competing work the suite starts itself, as on a busy training machine:
//! a CPU-bound thread on every core, and optionally a writer dirtying the
//! page cache as another process saving files would.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

/// Runs until dropped.
pub(crate) struct Load {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    _dir: Option<tempfile::TempDir>,
}

/// What the writer rewrites, over and over, without flushing.
const WRITTEN: usize = 256 << 20;

impl Load {
    /// With `cpu`, a busy thread per core; with `writer`, a thread
    /// rewriting a 256 MiB file in a loop, leaving its pages dirty for the
    /// kernel to write back.
    pub(crate) fn start(cpu: bool, writer: bool) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let busy = if cpu { cores } else { 0 };
        let mut threads: Vec<JoinHandle<()>> = (0..busy)
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut x = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        x = std::hint::black_box(
                            x.wrapping_mul(6364136223846793005).wrapping_add(1),
                        );
                    }
                })
            })
            .collect();
        let dir = writer.then(|| tempfile::tempdir().expect("a temporary directory"));
        if let Some(dir) = &dir {
            let path = dir.path().join("load.bin");
            let stop = Arc::clone(&stop);
            threads.push(std::thread::spawn(move || {
                let chunk = vec![0x5au8; 1 << 20];
                while !stop.load(Ordering::Relaxed) {
                    let Ok(mut f) = std::fs::File::create(&path) else {
                        return;
                    };
                    for _ in 0..WRITTEN / chunk.len() {
                        if stop.load(Ordering::Relaxed) || f.write_all(&chunk).is_err() {
                            return;
                        }
                    }
                }
            }));
        }
        Self {
            stop,
            threads,
            _dir: dir,
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
