//! The example's checkpoints: the weights (`model.safetensors`: `w1`,
//! `b1`, `w2`, `b2`), the momentum (`optimizer.safetensors`, the same
//! names) and `state.json`, written and read by the guest's own code (or,
//! with `kernels`, the tensors by the host: the same files).

use std::collections::HashMap;
use std::error::Error;
use std::fs;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use trainhost_guest::Checkpoint;

use crate::model::Layout;

/// What a checkpoint says besides the tensors.
#[derive(Serialize, Deserialize)]
pub struct State {
    pub epoch: u32,
    pub hidden: usize,
    pub world_size: u32,
}

/// Write the model and the optimizer's momentum (with `tensors`) and
/// `state` into `dir`.
pub fn save(
    dir: &Path,
    state: &State,
    tensors: impl FnOnce(&Path) -> Result<(), Box<dyn Error>>,
) -> Result<Checkpoint, Box<dyn Error>> {
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir)?;
    tensors(dir)?;
    fs::write(dir.join("state.json"), serde_json::to_vec(state)?)?;
    Ok(Checkpoint::from_directory(dir))
}

pub fn write_tensors(path: &Path, layout: &Layout, flat: &[f32]) -> Result<(), Box<dyn Error>> {
    let bytes: Vec<u8> = flat.iter().flat_map(|v| v.to_le_bytes()).collect();
    let views = layout
        .tensors()
        .into_iter()
        .map(|(name, offset, shape)| {
            let n: usize = shape.iter().product();
            let view = TensorView::new(Dtype::F32, shape, &bytes[offset * 4..(offset + n) * 4])?;
            Ok((name.to_owned(), view))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    fs::write(
        path,
        safetensors::serialize(views, None::<HashMap<String, String>>)?,
    )?;
    Ok(())
}

/// The state of a checkpoint `save` wrote, checked against the config.
pub fn read_state(dir: &Path, layout: &Layout) -> Result<State, Box<dyn Error>> {
    let state: State = serde_json::from_slice(&fs::read(dir.join("state.json"))?)?;
    if state.hidden != layout.hidden {
        return Err(format!(
            "the checkpoint has {} hidden units and the config asks for {}; resume with \"hidden\": {}",
            state.hidden, layout.hidden, state.hidden
        )
        .into());
    }
    Ok(state)
}

pub fn read_tensors(path: &Path, layout: &Layout) -> Result<Vec<f32>, Box<dyn Error>> {
    let bytes = fs::read(path)?;
    let tensors = SafeTensors::deserialize(&bytes)?;
    let mut flat = vec![0.0f32; layout.len()];
    for (name, offset, shape) in layout.tensors() {
        let view = tensors.tensor(name)?;
        if view.dtype() != Dtype::F32 || view.shape() != shape.as_slice() {
            return Err(format!(
                "{}: tensor {name} is not f32 of shape {shape:?}",
                path.display()
            )
            .into());
        }
        for (v, c) in flat[offset..].iter_mut().zip(view.data().chunks_exact(4)) {
            *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
    Ok(flat)
}
