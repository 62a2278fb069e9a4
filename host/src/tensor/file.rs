//! Tensors in safetensors files (the format of Hugging Face's
//! `safetensors` crate, which parses and checks the header here): f32,
//! little-endian, of rank 1 or 2.
//!
//! Reading is two steps, so that the caller can admit the bytes against a
//! memory limit between them: [`Header::read`] parses and checks the
//! header, [`Header::read_tensors`] reads the values. Values stream
//! through a small buffer both ways: a file never sits whole in memory
//! beside its tensors.

use std::io::{Read, Write};

use safetensors::Dtype;
use safetensors::tensor::{Metadata, TensorInfo};

use super::{Tensor, TensorError};

/// The largest header read: the `safetensors` crate's own limit.
const MAX_HEADER: u64 = 100_000_000;
/// Values converted at a time on their way to or from a file.
const CHUNK_VALUES: usize = 16 * 1024;

/// Write `tensors` under their names as one safetensors file into `out`.
/// Tensors are laid out by name, as the `safetensors` crate lays out
/// tensors of one dtype, so the same tensors give the same bytes.
pub(crate) fn write(out: &mut impl Write, tensors: &[(&str, &Tensor)]) -> Result<(), TensorError> {
    let mut sorted: Vec<&(&str, &Tensor)> = tensors.iter().collect();
    sorted.sort_by_key(|(name, _)| *name);
    if let Some(name) = sorted.iter().find(|(name, _)| name.is_empty()) {
        return Err(TensorError::Invalid(format!(
            "tensor names must not be empty (after {:?})",
            name.0
        )));
    }
    if let Some(pair) = sorted.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(TensorError::Invalid(format!(
            "the name {:?} is given to two tensors; names must be distinct",
            pair[0].0
        )));
    }
    let mut offset = 0;
    let infos = sorted
        .iter()
        .map(|(name, t)| {
            let len = t.data.len() * 4;
            let info = TensorInfo {
                dtype: Dtype::F32,
                shape: t.shape.clone(),
                data_offsets: (offset, offset + len),
            };
            offset += len;
            (name.to_string(), info)
        })
        .collect();
    let metadata = Metadata::new(None, infos).map_err(|e| TensorError::Invalid(e.to_string()))?;
    let mut header = serde_json::to_vec(&metadata)
        .map_err(|e| TensorError::Invalid(format!("cannot write the header: {e}")))?;
    // The values start 8-byte aligned, as the format asks.
    header.resize(header.len().next_multiple_of(8), b' ');
    let io = |e: std::io::Error| TensorError::Invalid(e.to_string());
    out.write_all(&(header.len() as u64).to_le_bytes())
        .map_err(io)?;
    out.write_all(&header).map_err(io)?;
    let mut bytes = Vec::with_capacity(CHUNK_VALUES * 4);
    for (_, t) in sorted {
        for chunk in t.data.chunks(CHUNK_VALUES) {
            bytes.clear();
            bytes.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
            out.write_all(&bytes).map_err(io)?;
        }
    }
    out.flush().map_err(io)
}

/// The tensors a safetensors file holds, checked against its length.
#[derive(Debug)]
pub(crate) struct Header {
    /// Name and shape of each tensor, in the order of their values.
    entries: Vec<(String, Vec<usize>)>,
}

impl Header {
    /// Read the header of a file of `file_len` bytes from the start of
    /// `input`; the error says what is wrong with the file.
    pub fn read(input: &mut impl Read, file_len: u64) -> Result<Self, TensorError> {
        let bad = |why: String| TensorError::Invalid(format!("not a safetensors file: {why}"));
        let mut len = [0u8; 8];
        input
            .read_exact(&mut len)
            .map_err(|_| bad(format!("{file_len} bytes hold no header")))?;
        let len = u64::from_le_bytes(len);
        if len > MAX_HEADER || len > file_len.saturating_sub(8) {
            return Err(bad(format!(
                "its header would take {len} bytes of a file of {file_len}"
            )));
        }
        let mut header = vec![0u8; len as usize];
        input
            .read_exact(&mut header)
            .map_err(|e| bad(e.to_string()))?;
        let metadata: Metadata =
            serde_json::from_slice(&header).map_err(|e| bad(format!("its header: {e}")))?;
        if 8 + len + metadata.data_len() as u64 != file_len {
            return Err(bad(format!(
                "its header describes {} bytes of values, but the file has {}",
                metadata.data_len(),
                file_len.saturating_sub(8 + len)
            )));
        }
        let mut entries = Vec::new();
        for name in metadata.offset_keys() {
            let info = metadata.info(&name).expect("offset_keys names its tensors");
            if info.dtype != Dtype::F32 {
                return Err(TensorError::Shape(format!(
                    "tensor {name:?} is {:?}; tensors are f32",
                    info.dtype
                )));
            }
            // The header's sizes are checked against the file, so each
            // dimension fits a u32 when the shape is one of ours.
            let shape: Vec<u32> = info
                .shape
                .iter()
                .map(|&d| u32::try_from(d))
                .collect::<Result<_, _>>()
                .map_err(|_| {
                    TensorError::Shape(format!("tensor {name:?} has shape {:?}", info.shape))
                })?;
            let shape = super::check_shape(&shape)
                .map_err(|e| TensorError::Shape(format!("tensor {name:?}: {e}")))?;
            entries.push((name, shape));
        }
        Ok(Self { entries })
    }

    /// How many tensors the file holds.
    pub fn count(&self) -> usize {
        self.entries.len()
    }

    /// The bytes the tensors will take in memory.
    pub fn bytes(&self) -> u64 {
        let values: usize = self
            .entries
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        values as u64 * 4
    }

    /// Read the values that follow the header from `input`.
    pub fn read_tensors(self, input: &mut impl Read) -> Result<Vec<(String, Tensor)>, TensorError> {
        let mut bytes = vec![0u8; CHUNK_VALUES * 4];
        let mut tensors = Vec::with_capacity(self.entries.len());
        for (name, shape) in self.entries {
            let n: usize = shape.iter().product();
            let mut data = Vec::with_capacity(n);
            while data.len() < n {
                let take = (n - data.len()).min(CHUNK_VALUES) * 4;
                input.read_exact(&mut bytes[..take]).map_err(|e| {
                    TensorError::Invalid(format!("reading the values of {name:?}: {e}"))
                })?;
                data.extend(
                    bytes[..take]
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                );
            }
            tensors.push((name, Tensor { shape, data }));
        }
        Ok(tensors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_of(tensors: &[(&str, &Tensor)]) -> Vec<u8> {
        let mut out = Vec::new();
        write(&mut out, tensors).unwrap();
        out
    }

    fn read_back(bytes: &[u8]) -> Result<Vec<(String, Tensor)>, TensorError> {
        let mut input = bytes;
        let header = Header::read(&mut input, bytes.len() as u64)?;
        header.read_tensors(&mut input)
    }

    #[test]
    fn tensors_come_back_as_written_and_the_crate_reads_them_too() {
        let w = Tensor::uniform(&[40_000, 3], -1.0, 1.0, 1).unwrap();
        let b = Tensor::from_vec(&[3], vec![1.0, -0.0, f32::MIN_POSITIVE]).unwrap();
        let bytes = file_of(&[("w", &w), ("b", &b)]);
        let back = read_back(&bytes).unwrap();
        // By name, as the crate orders tensors of one dtype.
        assert_eq!(
            back,
            vec![("b".to_string(), b.clone()), ("w".into(), w.clone())]
        );
        let theirs = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let view = theirs.tensor("w").unwrap();
        assert_eq!(view.shape(), [40_000, 3]);
        assert_eq!(&view.data()[..4], &w.values()[0].to_le_bytes());
        // And the crate's own file reads back here.
        let ours = safetensors::serialize([("w", view)], None).unwrap();
        assert_eq!(read_back(&ours).unwrap(), vec![("w".into(), w)]);
    }

    #[test]
    fn names_must_be_distinct_and_not_empty() {
        let t = Tensor::zeros(&[2]).unwrap();
        let e = write(&mut Vec::new(), &[("a", &t), ("a", &t)]).unwrap_err();
        assert!(
            e.to_string().contains("\"a\" is given to two tensors"),
            "{e}"
        );
        let e = write(&mut Vec::new(), &[("", &t)]).unwrap_err();
        assert!(e.to_string().contains("must not be empty"), "{e}");
    }

    #[test]
    fn files_that_are_not_ours_are_refused_with_their_reason() {
        let t = Tensor::zeros(&[4, 2]).unwrap();
        let good = file_of(&[("t", &t)]);
        let cut = &good[..good.len() - 4];
        let e = read_back(cut).unwrap_err();
        assert!(
            e.to_string().contains("describes 32 bytes of values"),
            "{e}"
        );
        let e = read_back(b"short").unwrap_err();
        assert!(e.to_string().contains("5 bytes hold no header"), "{e}");
        let mut huge = good.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = read_back(&huge).unwrap_err();
        assert!(e.to_string().contains("header would take"), "{e}");
        let data = [0u8; 16];
        let f64s = safetensors::tensor::TensorView::new(Dtype::F64, vec![2], &data).unwrap();
        let e = read_back(&safetensors::serialize([("d", f64s)], None).unwrap()).unwrap_err();
        assert!(e.to_string().contains("tensor \"d\" is F64"), "{e}");
        let data = [0u8; 32];
        let cube = safetensors::tensor::TensorView::new(Dtype::F32, vec![2, 2, 2], &data).unwrap();
        let e = read_back(&safetensors::serialize([("c", cube)], None).unwrap()).unwrap_err();
        assert!(e.to_string().contains("1 or 2 dimensions"), "{e}");
    }
}
