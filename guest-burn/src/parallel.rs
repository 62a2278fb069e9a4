//! Data-parallel training, the way DDP and Horovod do it: every rank holds
//! the same model, computes the gradient of its share of the batch, and
//! the ranks average their gradients before every optimizer step, so that
//! every rank takes the same step.

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use trainhost_guest::collective::{self, Op};

use crate::Error;

/// Seed `B`'s random number generator on `device`. Call it with the same
/// seed on every rank before building the model: burn's initializers then
/// draw the same initial parameters everywhere. (Burn draws a parameter's
/// values at its first use, not when the module is built; the same program
/// on every rank uses them in the same order, so they still agree.)
pub fn seed<B: Backend>(device: &B::Device, seed: u64) {
    B::seed(device, seed);
}

/// Average `grads`, the gradients of `model`'s parameters on this rank,
/// over every rank: one all-reduce (mean) of all of them at once. The
/// result is bit-identical on every rank (trainhost combines the ranks'
/// values in rank order), so equal parameters stay equal after the step.
///
/// Every rank must call it for the same model, in the same round of its
/// collective calls; parameters without a gradient (frozen) must be the
/// same on every rank. With one rank the gradients come back unchanged.
pub fn all_reduce_gradients<B, M>(
    grads: GradientsParams,
    model: &M,
) -> Result<GradientsParams, Error>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    reduce_gradients(grads, model, |values| {
        collective::all_reduce(values, Op::Mean).map_err(Error::from)
    })
}

/// Replace the gradients of `model`'s parameters in `grads` by what
/// `reduce` makes of them, all in one `f32` buffer in the module's order.
/// The buffer is a `Vec` so that the all-reduce can replace it with its
/// result instead of copying the result into it.
fn reduce_gradients<B, M>(
    grads: GradientsParams,
    model: &M,
    reduce: impl FnOnce(&mut Vec<f32>) -> Result<(), Error>,
) -> Result<GradientsParams, Error>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let mut flat = Flatten::<B::InnerBackend>::taking(grads);
    model.visit(&mut flat);
    let Flatten {
        mut grads,
        mut values,
        taken,
        error,
        ..
    } = flat;
    if let Some(e) = error {
        return Err(e);
    }
    if values.is_empty() {
        return Ok(grads);
    }
    reduce(&mut values)?;
    let mut scatter = Scatter::<B::InnerBackend> {
        grads: &mut grads,
        values: &values,
        taken: taken.into_iter().peekable(),
    };
    model.visit(&mut scatter);
    Ok(grads)
}

/// A digest of `model`'s parameters (FNV-1a over their `f32` bits in the
/// module's order): equal on two ranks when their parameters are
/// bit-identical.
pub fn parameters_digest<B: Backend, M: Module<B>>(model: &M) -> Result<u64, Error> {
    let mut digest = Digest {
        hash: 0xcbf2_9ce4_8422_2325,
        error: None,
    };
    model.visit(&mut digest);
    match digest.error {
        Some(e) => Err(e),
        None => Ok(digest.hash),
    }
}

/// Fail unless every rank holds bit-identical parameters: an all-gather
/// of [`parameters_digest`]. A data-parallel loop calls it now and then
/// (every epoch, say) to catch ranks that drifted apart.
pub fn check_in_sync<B: Backend, M: Module<B>>(model: &M) -> Result<(), Error> {
    let digest = parameters_digest(model)?;
    let digests = collective::all_gather(&digest.to_le_bytes())?;
    let differ: Vec<usize> = digests
        .iter()
        .enumerate()
        .filter(|(_, d)| *d != &digests[0])
        .map(|(rank, _)| rank)
        .collect();
    if differ.is_empty() {
        Ok(())
    } else {
        Err(Error::OutOfSync(format!(
            "the parameters of ranks {differ:?} differ from rank 0's: the ranks did not start from the same model (seed every rank alike) or took different steps"
        )))
    }
}

/// A gradient taken out: its parameter, shape and device.
struct Taken<IB: Backend> {
    id: ParamId,
    shape: Vec<usize>,
    device: IB::Device,
}

/// Takes the gradient of each parameter out of a [`GradientsParams`], in
/// the module's order, into one `f32` buffer.
struct Flatten<IB: Backend> {
    grads: GradientsParams,
    values: Vec<f32>,
    /// What was taken, in order.
    taken: Vec<Taken<IB>>,
    error: Option<Error>,
}

impl<IB: Backend> Flatten<IB> {
    fn taking(grads: GradientsParams) -> Self {
        Self {
            grads,
            values: Vec::new(),
            taken: Vec::new(),
            error: None,
        }
    }
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Flatten<B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.error.is_some() {
            return;
        }
        let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) else {
            return;
        };
        let device = grad.device();
        let data = grad.into_data();
        let shape = data.shape.to_vec();
        match data.convert::<f32>().into_vec::<f32>() {
            Ok(v) => {
                self.values.extend_from_slice(&v);
                self.taken.push(Taken {
                    id: param.id,
                    shape,
                    device,
                });
            }
            Err(e) => self.error = Some(Error::Tensor(format!("{e:?}"))),
        }
    }
}

/// Puts the averaged values back, in the order [`Flatten`] took them.
struct Scatter<'a, IB: Backend> {
    grads: &'a mut GradientsParams,
    values: &'a [f32],
    taken: std::iter::Peekable<std::vec::IntoIter<Taken<IB>>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scatter<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.taken.peek().is_none_or(|t| t.id != param.id) {
            return;
        }
        let Taken { id, shape, device } = self.taken.next().expect("peeked");
        let n: usize = shape.iter().product();
        let (mine, rest) = self.values.split_at(n);
        self.values = rest;
        let grad =
            Tensor::<B::InnerBackend, D>::from_data(TensorData::new(mine.to_vec(), shape), &device);
        self.grads.register::<B::InnerBackend, D>(id, grad);
    }
}

/// FNV-1a over the bits of every float parameter.
struct Digest {
    hash: u64,
    error: Option<Error>,
}

impl<B: Backend> ModuleVisitor<B> for Digest {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.error.is_some() {
            return;
        }
        match param.val().into_data().convert::<f32>().into_vec::<f32>() {
            Ok(values) => {
                for v in values {
                    self.hash = (self.hash ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3);
                }
            }
            Err(e) => self.error = Some(Error::Tensor(format!("{e:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::Tensor;

    use super::*;

    type B = Autodiff<NdArray>;

    fn model(seed_with: u64) -> Linear<B> {
        let device = Default::default();
        crate::seeded_init(&device, seed_with, |device| {
            (LinearConfig::new(3, 2).init(device), ())
        })
        .0
    }

    fn gradients(model: &Linear<B>) -> GradientsParams {
        let x = Tensor::<B, 2>::ones([4, 3], &Default::default());
        GradientsParams::from_grads(model.forward(x).sum().backward(), model)
    }

    fn flat(grads: &GradientsParams, model: &Linear<B>) -> Vec<f32> {
        let mut values = Vec::new();
        let mut weight = grads
            .get::<NdArray, 2>(model.weight.id)
            .unwrap()
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        values.append(&mut weight);
        let bias = model.bias.as_ref().unwrap();
        values.extend(
            grads
                .get::<NdArray, 1>(bias.id)
                .unwrap()
                .into_data()
                .to_vec::<f32>()
                .unwrap(),
        );
        values
    }

    #[test]
    fn every_gradient_goes_through_the_reduction_once_and_comes_back_in_place() {
        let model = model(1);
        let grads = gradients(&model);
        let before = flat(&grads, &model);
        let mut seen = 0;
        let halved = reduce_gradients(grads, &model, |values| {
            seen = values.len();
            values.iter_mut().for_each(|v| *v /= 2.0);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, 3 * 2 + 2, "weight and bias, once each");
        let after = flat(&halved, &model);
        let want: Vec<f32> = before.iter().map(|v| v / 2.0).collect();
        assert_eq!(after, want);
        assert_eq!(halved.len(), 2);
    }

    #[test]
    fn the_digest_tells_models_apart_by_their_bits() {
        assert_eq!(
            parameters_digest(&model(7)).unwrap(),
            parameters_digest(&model(7)).unwrap()
        );
        assert_ne!(
            parameters_digest(&model(7)).unwrap(),
            parameters_digest(&model(8)).unwrap()
        );
    }
}
