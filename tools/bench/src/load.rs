//! Competing work the suite starts itself, as on a busy training machine:
//! a CPU-bound thread on every core, and optionally another process
//! dirtying the page cache as a program saving files would.

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use anyhow::{Context, Result};

/// Runs until dropped.
pub(crate) struct Load {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    writer: Option<Child>,
    _dir: Option<tempfile::TempDir>,
}

/// What the writer rewrites, over and over, without flushing.
const WRITTEN: usize = 256 << 20;

impl Load {
    /// With `cpu`, a busy thread per core; with `writer`, another process
    /// (this program again) rewriting a 256 MiB file in a loop, leaving
    /// its pages dirty for the kernel to write back.
    pub(crate) fn start(cpu: bool, writer: bool) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let busy = if cpu { cores } else { 0 };
        let threads: Vec<JoinHandle<()>> = (0..busy)
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
        let dir = writer.then(tempfile::tempdir).transpose()?;
        let writer = match &dir {
            Some(dir) => Some(
                Command::new(std::env::current_exe()?)
                    .arg("--child-writer")
                    .arg(dir.path().join("load.bin"))
                    .stdin(Stdio::null())
                    .spawn()
                    .context("start the competing writer process")?,
            ),
            None => None,
        };
        Ok(Self {
            stop,
            threads,
            writer,
            _dir: dir,
        })
    }
}

/// The writer process: rewrite `path` until killed.
pub(crate) fn write_forever(path: &Path) -> Result<()> {
    let chunk = vec![0x5au8; 1 << 20];
    loop {
        let mut f =
            std::fs::File::create(path).with_context(|| format!("create {}", path.display()))?;
        for _ in 0..WRITTEN / chunk.len() {
            f.write_all(&chunk)?;
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        if let Some(mut writer) = self.writer.take() {
            let _ = writer.kill();
            let _ = writer.wait();
        }
    }
}
