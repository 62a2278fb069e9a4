//! A guest's directory listings (WASI's `read-directory`), read from the
//! system as the guest asks for their entries.
//!
//! wasmtime-wasi's own `read-directory` reads the whole directory, each
//! entry's name and type, into host memory when the listing is opened. A
//! guest that fills a directory with many files and opens many listings
//! of it would hold the host's memory, outside `--max-memory` and without
//! any bound but wasmtime's number of handles: 200 listings of a
//! directory of 8000 names of 200 bytes held 366 MiB. Here a listing holds a descriptor of the
//! directory, counted among the rank's open files (its share of the
//! process's, R57), and at most one read's entries (4 KiB), counted
//! against its memory limit; it reads on as the guest asks for entries.

use std::any::Any;
use std::ffi::CString;
use std::mem::MaybeUninit;
use std::sync::{Arc, Weak};

use rustix::fd::OwnedFd;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, RawDir};
use wasmtime::StoreContextMut;
use wasmtime::component::{Linker, Resource, ResourceType};
use wasmtime_wasi::filesystem::Descriptor;
use wasmtime_wasi::p2::bindings::filesystem::types::{DescriptorType, DirectoryEntry, ErrorCode};

use super::limits::MemoryLimiter;
use super::writes::{FILESYSTEM_TYPES, WatchesWrites};

/// Bytes read from the system at a time. A read holds at most this many
/// bytes of names, and at most one entry per 24 bytes (the shortest
/// record the system returns).
const READ_BYTES: usize = 4096;

/// The most entries one read returns.
const READ_ENTRIES: usize = READ_BYTES / 24;

/// What an open listing may hold between calls, the names of one read
/// and their places (at most 4096 + 170 × 8 bytes): counted against the
/// rank's memory limit while the listing is open, as tensors are, so that
/// listings left open cannot hold the host's memory past it. Reading
/// ahead is what makes listing cheap: going back to the entry after the
/// one returned (a seek) made each call cost as much as a whole read on
/// ext4, whose directories are hash trees (listing 5000 entries 40 times
/// took twice as long as reading them all at once).
const LISTING_BYTES: u64 = 8 << 10;

/// A rank's store data, as its listings need it.
pub(crate) trait Lists: WatchesWrites {
    fn memory(&mut self) -> &mut MemoryLimiter;
}

/// An open listing of a directory, as the guest's `directory-entry-stream`.
pub(crate) struct Listing {
    /// The listing's own descriptor of the directory: opened anew, so
    /// that its position is its own. Shared only with the rank's count of
    /// open files, which holds it weakly.
    dir: Arc<OwnedFd>,
    /// The entries of the last read not yet given to the guest: their
    /// names end to end, and where each name ends with its type.
    names: Vec<u8>,
    read: Vec<(u32, FileType)>,
    /// The next entry of `read` to give.
    next: usize,
}

impl Listing {
    fn new(dir: Arc<OwnedFd>) -> Self {
        Self {
            dir,
            names: Vec::new(),
            read: Vec::new(),
            next: 0,
        }
    }

    /// The next entry, without `.` and `..`, or `None` at the end. An
    /// entry whose name is not UTF-8 is an `illegal-byte-sequence` error,
    /// and the next call goes on past it, as wasmtime-wasi's listing does.
    fn next_entry(&mut self) -> Result<Option<DirectoryEntry>, ErrorCode> {
        if self.next == self.read.len() {
            self.read_more()?;
            if self.read.is_empty() {
                return Ok(None);
            }
        }
        let start = match self.next {
            0 => 0,
            n => self.read[n - 1].0 as usize,
        };
        let (end, file_type) = self.read[self.next];
        self.next += 1;
        let name = &self.names[start..end as usize];
        let type_ = self.descriptor_type(name, file_type)?;
        let name = std::str::from_utf8(name).map_err(|_| ErrorCode::IllegalByteSequence)?;
        Ok(Some(DirectoryEntry {
            type_,
            name: name.to_owned(),
        }))
    }

    /// Replace what is left of the last read (nothing) by the entries of
    /// the next read from the system; none at the end of the directory.
    fn read_more(&mut self) -> Result<(), ErrorCode> {
        // Allocated once, at the most a read holds (`LISTING_BYTES`).
        if self.names.capacity() == 0 {
            self.names.reserve_exact(READ_BYTES);
            self.read.reserve_exact(READ_ENTRIES);
        }
        self.names.clear();
        self.read.clear();
        self.next = 0;
        let mut buf = [MaybeUninit::<u8>::uninit(); READ_BYTES];
        let mut raw = RawDir::new(&*self.dir, &mut buf);
        // One read, or more while they hold only `.` and `..`.
        while let Some(entry) = raw.next() {
            let entry = entry.map_err(errno)?;
            let name = entry.file_name().to_bytes();
            if name != b"." && name != b".." {
                self.names.extend_from_slice(name);
                let end = u32::try_from(self.names.len()).map_err(|_| ErrorCode::Overflow)?;
                self.read.push((end, entry.file_type()));
            }
            if raw.is_buffer_empty() && !self.read.is_empty() {
                break;
            }
        }
        Ok(())
    }

    /// The type of the entry `name`: as the directory records it, or, on
    /// file systems that do not, as the entry's own metadata says (not
    /// following a symbolic link).
    fn descriptor_type(
        &self,
        name: &[u8],
        file_type: FileType,
    ) -> Result<DescriptorType, ErrorCode> {
        let file_type = match file_type {
            FileType::Unknown => {
                let name = CString::new(name).map_err(|_| ErrorCode::IllegalByteSequence)?;
                let stat = rustix::fs::statat(&*self.dir, &name, AtFlags::SYMLINK_NOFOLLOW)
                    .map_err(errno)?;
                FileType::from_raw_mode(stat.st_mode)
            }
            known => known,
        };
        Ok(match file_type {
            FileType::RegularFile => DescriptorType::RegularFile,
            FileType::Directory => DescriptorType::Directory,
            FileType::Symlink => DescriptorType::SymbolicLink,
            FileType::Fifo => DescriptorType::Fifo,
            FileType::Socket => DescriptorType::Socket,
            FileType::CharacterDevice => DescriptorType::CharacterDevice,
            FileType::BlockDevice => DescriptorType::BlockDevice,
            FileType::Unknown => DescriptorType::Unknown,
        })
    }
}

fn errno(e: rustix::io::Errno) -> ErrorCode {
    ErrorCode::from(std::io::Error::from(e))
}

/// Replace wasmtime-wasi's directory listings in `linker` (which has WASI
/// in it already) by [`Listing`]s: the `directory-entry-stream` resource,
/// the `read-directory` that opens one and the `read-directory-entry`
/// that reads it. All three go together, as the resource's type is what
/// the other two hand over. The linker must allow shadowing.
pub(crate) fn wrap_listings<T: Lists>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    let mut types = linker.instance(FILESYSTEM_TYPES)?;
    types.resource(
        "directory-entry-stream",
        ResourceType::host::<Listing>(),
        |mut store: StoreContextMut<'_, T>, rep| {
            let state = store.data_mut();
            state
                .ctx()
                .table
                .delete(Resource::<Listing>::new_own(rep))?;
            state.memory().give_back(LISTING_BYTES);
            Ok(())
        },
    )?;
    types.func_wrap(
        "[method]descriptor.read-directory",
        |mut store: StoreContextMut<'_, T>, (fd,): (Resource<Descriptor>,)| {
            let opened = open(store.data_mut(), &fd)?;
            Ok((opened,))
        },
    )?;
    types.func_wrap(
        "[method]directory-entry-stream.read-directory-entry",
        |mut store: StoreContextMut<'_, T>, (listing,): (Resource<Listing>,)| {
            let listing = store.data_mut().ctx().table.get_mut(&listing)?;
            Ok((listing.next_entry(),))
        },
    )?;
    Ok(())
}

/// Open a listing of the directory `fd`, if the rank may hold one more
/// open file (`quota` otherwise, as for `open-at`) and its memory limit
/// has room for the listing's [`LISTING_BYTES`] (`insufficient-memory`
/// otherwise).
fn open<T: Lists>(
    state: &mut T,
    fd: &Resource<Descriptor>,
) -> wasmtime::Result<Result<Resource<Listing>, ErrorCode>> {
    let dir = match state.ctx().table.get(fd)? {
        Descriptor::Dir(dir) => Arc::clone(&dir.dir),
        Descriptor::File(_) => return Ok(Err(ErrorCode::NotDirectory)),
    };
    if !state.open_files().may_open() {
        return Ok(Err(ErrorCode::Quota));
    }
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let dir = match rustix::fs::openat(&*dir, c".", flags, Mode::empty()) {
        Ok(own) => Arc::new(own),
        Err(e) => return Ok(Err(errno(e))),
    };
    if state
        .memory()
        .take("a directory listing", LISTING_BYTES)
        .is_err()
    {
        return Ok(Err(ErrorCode::InsufficientMemory));
    }
    state
        .open_files()
        .hold(Arc::downgrade(&dir) as Weak<dyn Any + Send + Sync>);
    Ok(Ok(state.ctx().table.push(Listing::new(dir))?))
}
