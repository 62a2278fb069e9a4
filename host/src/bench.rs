//! Entry points for the benchmark suite (`tools/bench`, the `bench`
//! feature): the host's own code paths, run on their own so they can be
//! timed against a baseline. Not part of the public API.

use std::path::Path;

use crate::config::{Location, StorageOptions};
use crate::error::Error;
use crate::persist::{capture, merge, persist};
use crate::runtime::CompileCache;
use crate::storage::Storage;

/// The kernels of the `tensors` interface, to time the guest's calls of
/// them against the same maths called natively.
pub mod tensor {
    pub use crate::tensor::{
        Activation, DenseGrads, Tensor, TensorError, dense, dense_backward, gather_rows, gemm,
        sgd_momentum_list, softmax_cross_entropy, threads_per_rank,
    };
}

/// On an object store, a file unchanged since the previous checkpoint is
/// copied by the server when it has at least this many bytes, and sent
/// again when smaller (local storage links every unchanged file).
pub const COPY_AT_LEAST: u64 = crate::persist::COPY_AT_LEAST;

/// On an object store, a file of at most this many bytes goes up in one
/// request, signed with the digest its manifest records; a larger one goes
/// in parts, each signed over plain HTTP with its own digest, computed in
/// the pass that hashes the file.
pub const SINGLE_REQUEST_AT_MOST: u64 = crate::storage::SINGLE_REQUEST_AT_MOST;

/// How durable [`persist_directory`] leaves the files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// As a commit does before writing the manifest: every file and the
    /// directories naming them flushed to disk.
    OnDisk,
    /// Local files left in the page cache, for a comparison with a copy
    /// that is not flushed either. (Object stores are durable anyway.)
    PageCache,
}

/// Persist the files below `dir` to `<storage>/<name>` as a commit
/// persists a checkpoint's files (streamed, hashed, several at a time, then
/// made durable as `durability` says), without a manifest. Returns the
/// number of files and bytes.
pub fn persist_directory(
    dir: &Path,
    storage: &str,
    name: &str,
    options: &StorageOptions,
    durability: Durability,
) -> Result<(usize, u64), Error> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            operation: "start the async runtime",
            source,
        })?;
    let handle = cap_std::fs::Dir::open_ambient_dir(dir, cap_std::ambient_authority()).map_err(
        |source| Error::Io {
            path: dir.to_path_buf(),
            operation: "open the directory",
            source,
        },
    )?;
    let shown = dir.display().to_string();
    let captured = capture(0, handle, &shown).map_err(|e| Error::InvalidConfig(e.to_string()))?;
    let plan = merge(vec![captured])
        .map_err(|_| Error::InvalidConfig("one capture cannot collide with itself".into()))?;
    let mut dest = Storage::open(&Location::parse(storage)?, options)?.child(name);
    if durability == Durability::PageCache {
        dest = dest.without_flush();
    }
    let (entries, _) = rt.block_on(async {
        let persisted = persist(&dest, &plan, None).await?;
        if durability == Durability::OnDisk {
            let files = persisted.0.iter().map(|e| e.path.clone()).collect();
            dest.sync_uploads(files).await?;
        }
        Ok::<_, Error>(persisted)
    })?;
    Ok((entries.len(), entries.iter().map(|e| e.size).sum()))
}

/// Compile `guest` with the host's engine settings, through the compile
/// cache in `cache` if given. Returns whether the cache had it.
pub fn compile(guest: &[u8], cache: Option<&Path>) -> Result<bool, Error> {
    let cache = cache.map(CompileCache::new);
    let (_, outcome) = crate::runtime::GuestComponent::compile(
        guest,
        "<bench>",
        crate::config::Interruption::default(),
        cache.as_ref(),
    )?;
    Ok(outcome == Some(crate::runtime::CacheOutcome::Hit))
}

/// Seconds per all-reduce (f32, sum) of `floats` values on each of `ranks`
/// threads, the exchange alone: the ranks' values lent and combined into
/// their shared result as a collective call through `collective-bits`
/// combines them once every rank has arrived (split across the threads
/// from 16 or 256 KiB, R33), without the guest, the canonical ABI's
/// lowering of the result or the meeting. The median of `rounds` rounds.
pub fn all_reduce_exchange(ranks: usize, floats: usize, rounds: u32) -> f64 {
    use crate::collective::{Call, Delivered, Lent, Op, Values, meet};
    use std::sync::Arc;
    let buffers: Vec<Vec<f32>> = (0..ranks).map(|r| vec![r as f32; floats]).collect();
    let mut times = Vec::with_capacity(rounds as usize);
    for _ in 0..rounds {
        // SAFETY: `buffers` outlive the lendings, dropped below, and are
        // not written meanwhile.
        let (lent, lendings): (Vec<Lent>, Vec<_>) =
            buffers.iter().map(|b| unsafe { Lent::new(b) }).unzip();
        let calls = lent
            .into_iter()
            .map(|l| Call::AllReduce {
                values: Values::F32Lent(l),
                op: Op::Sum,
            })
            .collect();
        let started = std::time::Instant::now();
        let exchange = Arc::new(meet(calls, None).expect("matching calls"));
        // Each rank a task of an executor with a thread per rank, as ranks
        // run when they do not outnumber the cores.
        let idle = crate::executor::IdleWait::new(ranks);
        let results: Vec<std::sync::Mutex<Option<Arc<Vec<f32>>>>> =
            (0..ranks).map(|_| Default::default()).collect();
        let tasks = (0..ranks).map(|r| {
            let (exchange, results) = (Arc::clone(&exchange), &results);
            let task: crate::executor::TaskFuture<'_> = Box::pin(async move {
                match exchange.deliver(r, true).await {
                    Some(Delivered::Shared(v)) => {
                        *results[r].lock().expect("no panic") = Some(v);
                    }
                    _ => unreachable!("an all-reduce of lent f32 delivers a shared result"),
                }
            });
            (r, task)
        });
        crate::executor::run(ranks, tasks, &idle, |_, m| panic!("{m}"));
        times.push(started.elapsed().as_secs_f64());
        // As the ranks' calls end: the result freed once lowered.
        drop((exchange, results, lendings));
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}
