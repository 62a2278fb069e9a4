//! Ownership of a run in a local directory: an exclusive `flock` on the
//! run's owner file, which names the holder for whoever is refused.
//!
//! The file is never deleted: a process waiting on the old file while a
//! new one is created would lock a different file than the next start.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::Path;

use rustix::fs::{FlockOperation, flock};

use super::Holder;
use crate::error::Error;
use crate::record::layout::OWNER;

/// The lock; released when dropped, or by the OS when the process ends.
pub(super) struct Lock {
    _file: File,
}

impl Lock {
    pub fn acquire(dir: &Path, me: &Holder, run: &str) -> Result<Self, Error> {
        let path = dir.join(OWNER);
        let io = |operation: &'static str| {
            let path = path.clone();
            move |source: std::io::Error| Error::Io {
                path,
                operation,
                source,
            }
        };
        std::fs::create_dir_all(dir).map_err(io("create the run directory"))?;
        // Not truncated: until locked, what it says is the owner's.
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io("open the run's owner file"))?;
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                let holder = read_holder(&mut file)
                    .map(|h| h.to_string())
                    .unwrap_or_else(|| "another process, starting it".to_owned());
                return Err(super::in_use_at(run, holder));
            }
            Err(e) => return Err(io("lock the run's owner file")(e.into())),
        }
        let json = serde_json::to_vec_pretty(me).expect("a holder serializes");
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(&json))
            .map_err(io("write the run's owner file"))?;
        Ok(Self { _file: file })
    }
}

/// The holder named in the locked `file`. A holder writes its name right
/// after taking the lock, so a start racing it waits a moment for it.
fn read_holder(file: &mut File) -> Option<Holder> {
    for _ in 0..40 {
        let mut said = String::new();
        if file.rewind().is_ok()
            && file.read_to_string(&mut said).is_ok()
            && let Ok(holder) = serde_json::from_str(&said)
        {
            return Some(holder);
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    None
}
