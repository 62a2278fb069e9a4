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

/// How long a cache line takes to go from one core to another and back:
/// two threads on the first two cores hand a flag back and forth. Every
/// round of ranks on more than one thread waits for such handovers (the
/// gate, the queues, the wake-ups), and this machine's figure has moved
/// between runs by a factor of two or more with where the hypervisor
/// placed its cores; the results name it so that runs can be compared.
/// `None` with one core.
pub(crate) fn core_round_trip_ns() -> Option<f64> {
    use std::sync::atomic::AtomicU32;
    const TRIPS: u32 = 200_000;
    if std::thread::available_parallelism().map_or(1, usize::from) < 2 {
        return None;
    }
    let flag = AtomicU32::new(0);
    // Set by a side that could not be pinned: two spinning threads that
    // may share a core would hand over once per time slice.
    let unpinned = AtomicBool::new(false);
    let pin = |core: usize| {
        // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes
        // inside it, and sched_setaffinity reads it.
        let pinned = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(core, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) == 0
        };
        if !pinned {
            unpinned.store(true, Ordering::Relaxed);
        }
    };
    // Wait until `flag` is `value`; false if a side is not pinned.
    let await_flag = |value: u32| {
        while flag.load(Ordering::Acquire) != value {
            if unpinned.load(Ordering::Relaxed) {
                return false;
            }
            std::hint::spin_loop();
        }
        true
    };
    // Both sides on threads of their own: a pinned thread's affinity would
    // pass to every thread it starts.
    let took = std::thread::scope(|scope| {
        scope.spawn(|| {
            pin(1);
            for _ in 0..TRIPS {
                if !await_flag(1) {
                    return;
                }
                flag.store(0, Ordering::Release);
            }
        });
        scope
            .spawn(|| {
                pin(0);
                let started = std::time::Instant::now();
                for _ in 0..TRIPS {
                    flag.store(1, Ordering::Release);
                    if !await_flag(0) {
                        return None;
                    }
                }
                Some(started.elapsed())
            })
            .join()
            .ok()
            .flatten()
    });
    took.map(|t| t.as_nanos() as f64 / f64::from(TRIPS))
}
