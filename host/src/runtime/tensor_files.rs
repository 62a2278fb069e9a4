//! `tensors.save` and `tensors.load`: safetensors files written and read
//! by the host, through the rank's sandbox (the same directory handles
//! that keep its checkpoint paths inside), so that a model's values go
//! between its tensors and the file without crossing into the guest.

use std::io::{BufReader, BufWriter};

use cap_std::fs::Dir;
use wasmtime::component::{Resource, ResourceTableError};

use super::bindings::trainhost::train::tensors::TensorError;
use super::kernel_calls::{Answer, refused};
use super::rank::RankState;
use crate::tensor::file::{Header, write};
use crate::tensor::{Tensor, TensorError as Refused};

/// Buffer of the writes and reads: large enough that a file of large
/// tensors costs what the file system costs.
const BUFFER: usize = 1 << 20;

/// `e`, with the guest's path in front of its message.
fn about(path: &str, e: Refused) -> TensorError {
    match refused(e) {
        TensorError::Shape(m) => TensorError::Shape(format!("{path:?}: {m}")),
        TensorError::Invalid(m) => TensorError::Invalid(format!("{path:?}: {m}")),
        other => other,
    }
}

fn io(path: &str, doing: &str, e: std::io::Error) -> TensorError {
    TensorError::Invalid(match e.kind() {
        std::io::ErrorKind::NotFound => format!("{path:?} does not exist"),
        _ => format!("{doing} {path:?}: {e}"),
    })
}

impl RankState {
    /// Write `tensors` to the guest's `path`: aside first, then renamed
    /// over it, so that the file is whole or absent (and a file being
    /// replaced stays readable until then).
    pub(super) fn save_tensors(
        &mut self,
        path: &str,
        tensors: &[(String, Resource<Tensor>)],
    ) -> Answer<()> {
        self.check_running()?;
        let (dir, name) = match self.sandbox.file_in(path, true) {
            Ok(found) => found,
            Err(e) => return Ok(Err(TensorError::Invalid(e.to_string()))),
        };
        let named = tensors
            .iter()
            .map(|(n, t)| Ok((n.as_str(), self.table.get(t)?)))
            .collect::<Result<Vec<_>, ResourceTableError>>()?;
        let aside = format!(".{name}.partial");
        let written = write_aside(&dir, &aside, &named, path).and_then(|()| {
            dir.rename(&aside, &dir, &name)
                .map_err(|e| io(path, "cannot write", e))
        });
        if written.is_err() {
            // Nothing half-written stays behind in the guest's directory.
            let _ = dir.remove_file(&aside);
        }
        Ok(written)
    }

    /// Every tensor of the guest's file `path`, new in this rank's table,
    /// admitted against its memory limit before any is read.
    pub(super) fn load_tensors(&mut self, path: &str) -> Answer<Vec<(String, Resource<Tensor>)>> {
        self.check_running()?;
        let (dir, name) = match self.sandbox.file_in(path, false) {
            Ok(found) => found,
            Err(e) => return Ok(Err(TensorError::Invalid(e.to_string()))),
        };
        let opened = dir.open(&name).and_then(|f| {
            let len = f.metadata()?.len();
            Ok((f, len))
        });
        let (file, len) = match opened {
            Ok(f) => f,
            Err(e) => return Ok(Err(io(path, "cannot read", e))),
        };
        let mut input = BufReader::with_capacity(BUFFER, file);
        let header = match Header::read(&mut input, len) {
            Ok(h) => h,
            Err(e) => return Ok(Err(about(path, e))),
        };
        let (count, bytes) = (header.count() as u64, header.bytes());
        if let Err(m) = self.memory.take_entries("tensors", count, bytes) {
            return Ok(Err(TensorError::OutOfMemory(format!("{path:?}: {m}"))));
        }
        let tensors = match header.read_tensors(&mut input) {
            Ok(t) => t,
            Err(e) => {
                self.memory.give_back_entries(count, bytes);
                return Ok(Err(about(path, e)));
            }
        };
        let loaded = tensors
            .into_iter()
            .map(|(n, t)| Ok((n, self.table.push(t)?)))
            .collect::<Result<Vec<_>, ResourceTableError>>()?;
        Ok(Ok(loaded))
    }
}

fn write_aside(
    dir: &Dir,
    aside: &str,
    tensors: &[(&str, &Tensor)],
    path: &str,
) -> Result<(), TensorError> {
    let file = dir.create(aside).map_err(|e| io(path, "cannot write", e))?;
    let mut out = BufWriter::with_capacity(BUFFER, file);
    write(&mut out, tensors).map_err(|e| about(path, e))
}
