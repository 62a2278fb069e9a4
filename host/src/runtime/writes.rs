//! The guest's writes to files, as far as snapshots need to see them
//! (`persist::lend`): WASI's `open-at` is wrapped so that opening a file a
//! snapshot holds lent gives the guest its own copy first, and so that the
//! files a rank holds open for writing are known when it reports; it and
//! the calls that change names wait while a snapshot is still linking.

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
const FILESYSTEM_TYPES: &str = "wasi:filesystem/types@0.2.12";

/// A rank's store data, as the wrapped `open-at` needs it.
pub(crate) trait WatchesWrites: WasiView + 'static {
    /// The rank's handle on its attempt, which knows the lent files.
    fn attempt(&self) -> &RankHandle;
    fn open_for_writing(&mut self) -> &mut OpenForWriting;
}

/// The files a rank opened for writing and may still hold open: a weak
/// reference to each, which dies with the guest's last handle on it.
#[derive(Default)]
pub(crate) struct OpenForWriting {
    files: Vec<Weak<std::fs::File>>,
    /// The length at which closed files are dropped from `files`: twice
    /// what was left the last time, so that the dropping costs a constant
    /// per open however many files the guest keeps open.
    prune_at: usize,
}

impl OpenForWriting {
    fn track(&mut self, file: &Arc<std::fs::File>) {
        if self.files.len() >= self.prune_at {
            self.files.retain(|f| f.strong_count() > 0);
            self.prune_at = (2 * self.files.len()).max(64);
        }
        self.files.push(Arc::downgrade(file));
    }

    /// The files still open, by inode.
    pub fn inodes(&mut self) -> HashSet<Inode> {
        self.files.retain(|f| f.strong_count() > 0);
        self.files
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

/// Replace wasmtime-wasi's `open-at` in `linker` (which has WASI in it
/// already) by one that protects lent files and tracks writers, and its
/// calls that change names (`unlink-file-at`, `rename-at`,
/// `remove-directory-at`) by ones that first wait for a snapshot still
/// linking (`Lent::settled`); each then calls wasmtime-wasi's own.
pub(crate) fn wrap_filesystem<T: WatchesWrites>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let result = wrap(linker);
    linker.allow_shadowing(false);
    result
}

fn wrap<T: WatchesWrites>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
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
    let state = store.data_mut();
    let mut fs = state.filesystem();
    let opened =
        match HostDescriptor::open_at(&mut fs, fd, path_flags, path, open_flags, flags).await {
            Ok(opened) => opened,
            Err(e) => return Ok((Err(types::Host::convert_error_code(&mut fs, e)?),)),
        };
    if writes
        && let Ok(Descriptor::File(file)) = fs.table.get(&opened)
        && file.open_mode.contains(OpenMode::WRITE)
    {
        let file = Arc::clone(&file.file);
        state.open_for_writing().track(&file);
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
