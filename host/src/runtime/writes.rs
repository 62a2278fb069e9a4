//! The guest's opens and writes of files, as far as the host must see
//! them: WASI's `open-at` is wrapped so that opening a file a snapshot
//! holds lent (`persist::lend`) gives the guest its own copy first, so
//! that the files a rank holds open for writing are known when it
//! reports, and so that a rank cannot hold more files open than its share
//! of the process's ([`OpenFiles`]); it and the calls that change names
//! wait while a snapshot is still linking.

use std::any::Any;
use std::collections::HashSet;
use std::sync::{Arc, Weak};

use cap_std::fs::Dir;
use wasmtime::StoreContextMut;
use wasmtime::component::{Linker, Resource};
use wasmtime_wasi::filesystem::{Descriptor, WasiFilesystemCtxView, WasiFilesystemView};
use wasmtime_wasi::p2::FsResult;
use wasmtime_wasi::p2::bindings::filesystem::types::{
    self, DescriptorFlags, ErrorCode, HostDescriptor, OpenFlags, PathFlags,
};
use wasmtime_wasi::{OpenMode, WasiView};

use crate::attempt::{Inode, RankHandle};

/// The WASI interface whose `open-at` is wrapped, at the version
/// wasmtime-wasi defines it (a guest importing an older 0.2 version is
/// linked to it too). A test in `persistence.rs` fails if the wrapper is
/// not the one guests call.
pub(crate) const FILESYSTEM_TYPES: &str = "wasi:filesystem/types@0.2.12";

/// A rank's store data, as the wrapped `open-at` needs it.
pub(crate) trait WatchesWrites: WasiView + 'static {
    /// The rank's handle on its attempt, which knows the lent files.
    fn attempt(&self) -> &RankHandle;
    fn open_for_writing(&mut self) -> &mut OpenForWriting;
    fn open_files(&mut self) -> &mut OpenFiles;
}

/// Files a rank opened and may still hold open: a weak reference to
/// each, which dies with the guest's last handle on it.
struct Held<F: ?Sized> {
    files: Vec<Weak<F>>,
    /// The length at which closed files are dropped from `files`: twice
    /// what was left the last time, so that the dropping costs a constant
    /// per open however many files the guest keeps open.
    prune_at: usize,
}

impl<F: ?Sized> Default for Held<F> {
    fn default() -> Self {
        Self {
            files: Vec::new(),
            prune_at: 0,
        }
    }
}

impl<F: ?Sized> Held<F> {
    fn track(&mut self, file: Weak<F>) {
        if self.files.len() >= self.prune_at {
            self.prune();
            self.prune_at = (2 * self.files.len()).max(64);
        }
        self.files.push(file);
    }

    fn prune(&mut self) {
        self.files.retain(|f| f.strong_count() > 0);
    }
}

/// The files a rank opened for writing and may still hold open.
#[derive(Default)]
pub(crate) struct OpenForWriting(Held<std::fs::File>);

impl OpenForWriting {
    /// The files still open, by inode.
    pub fn inodes(&mut self) -> HashSet<Inode> {
        self.0.prune();
        self.0
            .files
            .iter()
            .filter_map(Weak::upgrade)
            .filter_map(|f| f.metadata().ok())
            .map(|m| {
                use std::os::unix::fs::MetadataExt;
                (m.dev(), m.ino())
            })
            .collect()
    }
}

/// The files, directories and directory listings (`listing.rs`) a rank
/// opened and still holds, and how many it may: each holds a descriptor of the process, and the process has a
/// limited number (`ulimit -n`) that the host needs too, to commit
/// checkpoints. A rank over its share is refused the next open (WASI's
/// `quota` error, the closest to the system's "too many open files"), with
/// a warning that says why; without it, one rank holding files open made
/// the host's own opens fail, and every rank's report with them.
pub(crate) struct OpenFiles {
    /// What the rank's open files and directories and its directory
    /// listings (`listing.rs`) each hold a descriptor in.
    held: Held<dyn Any + Send + Sync>,
    /// The most the rank may hold at once.
    limit: usize,
    rank: u32,
    warned: bool,
}

impl OpenFiles {
    /// For rank `rank`, one of `ranks` in this process.
    pub fn new(rank: u32, ranks: u32) -> Self {
        Self {
            held: Held::default(),
            limit: open_files_per_rank(process_open_files(), ranks),
            rank,
            warned: false,
        }
    }

    /// Count something the rank opened that holds a descriptor while
    /// `held` lives.
    pub fn hold(&mut self, held: Weak<dyn Any + Send + Sync>) {
        self.held.track(held);
    }

    /// Whether the rank may open one more file, directory or listing.
    /// Holding `limit`, each open over it prunes the closed ones: at most
    /// `limit` weak references a refused open.
    pub fn may_open(&mut self) -> bool {
        if self.held.files.len() < self.limit {
            return true;
        }
        self.held.prune();
        let may = self.held.files.len() < self.limit;
        if !may && !self.warned {
            self.warned = true;
            tracing::warn!(
                "rank {} holds {} open files, directories and directory listings, the most a rank may hold at once (its share of the process's open-file limit, {}; raise it with `ulimit -n`): its further opens fail with `quota` until it closes some",
                self.rank,
                self.limit,
                process_open_files(),
            );
        }
        may
    }
}

/// The process's open-file limit: the soft `RLIMIT_NOFILE`, an unlimited
/// one taken as 2^30.
fn process_open_files() -> u64 {
    rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX)
        .min(1 << 30)
}

/// Each of `ranks` ranks' share of `process` open files: what is left
/// after a quarter (at least 256) kept for the host's own (storage, its
/// checkpoint files, MPI, the runtime), and at least 16.
fn open_files_per_rank(process: u64, ranks: u32) -> usize {
    let reserve = (process / 4).max(256);
    let share = process.saturating_sub(reserve) / u64::from(ranks.max(1));
    share.max(16) as usize
}

/// Replace wasmtime-wasi's `open-at` in `linker` (which has WASI in it
/// already) by one that protects lent files, tracks writers and keeps the
/// rank within its share of open files ([`OpenFiles`]), and its
/// calls that change names (`unlink-file-at`, `rename-at`,
/// `remove-directory-at`) by ones that first wait for a snapshot still
/// linking (`Lent::settled`); each then calls wasmtime-wasi's own. The
/// linker must allow shadowing.
pub(crate) fn wrap_filesystem<T: WatchesWrites>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    let mut types = linker.instance(FILESYSTEM_TYPES)?;
    types.func_wrap_async(
        "[method]descriptor.open-at",
        |store: StoreContextMut<'_, T>,
         (fd, path_flags, path, open_flags, flags): (
            Resource<Descriptor>,
            PathFlags,
            String,
            OpenFlags,
            DescriptorFlags,
        )| Box::new(open_at(store, fd, path_flags, path, open_flags, flags)),
    )?;
    types.func_wrap_async(
        "[method]descriptor.unlink-file-at",
        |mut store: StoreContextMut<'_, T>, (fd, path): (Resource<Descriptor>, String)| {
            Box::new(async move {
                settled(&store).await;
                let mut fs = store.data_mut().filesystem();
                let done = HostDescriptor::unlink_file_at(&mut fs, fd, path).await;
                answer(&mut fs, done)
            })
        },
    )?;
    types.func_wrap_async(
        "[method]descriptor.remove-directory-at",
        |mut store: StoreContextMut<'_, T>, (fd, path): (Resource<Descriptor>, String)| {
            Box::new(async move {
                settled(&store).await;
                let mut fs = store.data_mut().filesystem();
                let done = HostDescriptor::remove_directory_at(&mut fs, fd, path).await;
                answer(&mut fs, done)
            })
        },
    )?;
    types.func_wrap_async(
        "[method]descriptor.rename-at",
        |mut store: StoreContextMut<'_, T>,
         (fd, old_path, new_fd, new_path): (
            Resource<Descriptor>,
            String,
            Resource<Descriptor>,
            String,
        )| {
            Box::new(async move {
                settled(&store).await;
                let mut fs = store.data_mut().filesystem();
                let done = HostDescriptor::rename_at(&mut fs, fd, old_path, new_fd, new_path).await;
                answer(&mut fs, done)
            })
        },
    )?;
    Ok(())
}

/// Wait until no snapshot is linking the ranks' files (see
/// `persist::lend`): a call that could change what it is about to link
/// waits for it. No snapshot can begin between this wait and the call: one
/// begins only once every rank of the host is in `report`. A stopping rank
/// is dropped while it waits.
fn settled<T: WatchesWrites>(
    store: &StoreContextMut<'_, T>,
) -> impl Future<Output = ()> + Send + 'static {
    let attempt = store.data().attempt().clone();
    async move { attempt.settled().await }
}

/// What wasmtime-wasi's `done` is to the guest: its error code, or a trap.
fn answer<V>(
    fs: &mut WasiFilesystemCtxView<'_>,
    done: FsResult<V>,
) -> wasmtime::Result<(Result<V, ErrorCode>,)> {
    match done {
        Ok(value) => Ok((Ok(value),)),
        Err(e) => Ok((Err(types::Host::convert_error_code(fs, e)?),)),
    }
}

async fn open_at<T: WatchesWrites>(
    mut store: StoreContextMut<'_, T>,
    fd: Resource<Descriptor>,
    path_flags: PathFlags,
    path: String,
    open_flags: OpenFlags,
    flags: DescriptorFlags,
) -> wasmtime::Result<(Result<Resource<Descriptor>, ErrorCode>,)> {
    let truncate = open_flags.contains(OpenFlags::TRUNCATE);
    let writes = truncate || flags.contains(DescriptorFlags::WRITE);
    if writes {
        settled(&store).await;
        let protected = match protection(store.data_mut(), &fd, &path, path_flags, truncate) {
            Ok(None) => Ok(()),
            // The copy can be as large as a checkpoint: it runs off the
            // threads that run the ranks, as wasmtime-wasi's own file I/O
            // does, so other ranks go on and a stopping rank is dropped
            // while it waits.
            Ok(Some(copy)) => tokio::task::spawn_blocking(copy)
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e))),
            Err(e) => Err(e),
        };
        if let Err(e) = protected {
            return Ok((Err(ErrorCode::from(&e)),));
        }
    }
    if !store.data_mut().open_files().may_open() {
        return Ok((Err(ErrorCode::Quota),));
    }
    let state = store.data_mut();
    let mut fs = state.filesystem();
    let opened =
        match HostDescriptor::open_at(&mut fs, fd, path_flags, path, open_flags, flags).await {
            Ok(opened) => opened,
            Err(e) => return Ok((Err(types::Host::convert_error_code(&mut fs, e)?),)),
        };
    let (held, writer) = match fs.table.get(&opened) {
        Ok(Descriptor::File(file)) => (
            Some(Arc::clone(&file.file)),
            writes && file.open_mode.contains(OpenMode::WRITE),
        ),
        Ok(Descriptor::Dir(dir)) => (Some(Arc::clone(&dir.dir)), false),
        Err(_) => (None, false),
    };
    if let Some(file) = held {
        if writer {
            state.open_for_writing().0.track(Arc::downgrade(&file));
        }
        state
            .open_files()
            .hold(Arc::downgrade(&file) as Weak<dyn Any + Send + Sync>);
    }
    Ok((Ok(opened),))
}

/// If anything is lent, what gives the guest its own copy of `path`
/// (below the directory `fd`) before it is opened for writing, should it
/// be a lent file (see `persist::lend`). Anything wrong with `fd` is left
/// for wasmtime-wasi's `open-at` to report, and so are read-only
/// directories (it refuses the write).
fn protection<T: WatchesWrites>(
    state: &mut T,
    fd: &Resource<Descriptor>,
    path: &str,
    path_flags: PathFlags,
    truncate: bool,
) -> std::io::Result<Option<impl FnOnce() -> std::io::Result<()> + Send + 'static>> {
    if !state.attempt().may_have_lent() {
        return Ok(None);
    }
    let dir = match state.ctx().table.get(fd) {
        Ok(Descriptor::Dir(dir)) if !dir.perms.write_not_permitted() => {
            Dir::from_std_file(dir.dir.try_clone()?)
        }
        _ => return Ok(None),
    };
    let follow = path_flags.contains(PathFlags::SYMLINK_FOLLOW);
    let (attempt, path) = (state.attempt().clone(), path.to_owned());
    Ok(Some(move || {
        attempt.before_write(&dir, &path, follow, truncate)
    }))
}

#[cfg(test)]
mod tests {
    use super::open_files_per_rank;

    #[test]
    fn ranks_share_what_the_host_keeps_back_of_the_process_open_files() {
        // A quarter stays the host's, at least 256; each rank gets at
        // least 16.
        assert_eq!(open_files_per_rank(20_000, 2), 7_500);
        assert_eq!(open_files_per_rank(512, 2), 128);
        assert_eq!(open_files_per_rank(1024, 64), 16);
        assert_eq!(open_files_per_rank(100, 1), 16);
        assert_eq!(open_files_per_rank(1 << 30, 0), 805_306_368);
    }
}
