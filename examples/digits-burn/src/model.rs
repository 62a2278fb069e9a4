//! The classifier: 64 pixels → `hidden` ReLU units → 10 digits, trained
//! with softmax cross-entropy.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};

use crate::data::{CLASSES, PIXELS, Set};

#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    hidden: Linear<B>,
    out: Linear<B>,
    relu: Relu,
}

impl<B: Backend> Mlp<B> {
    /// A fresh model, its weights drawn from `B`'s generator (seed it
    /// first to get the same model on every rank).
    pub fn new(hidden: usize, device: &B::Device) -> Self {
        Self {
            hidden: LinearConfig::new(PIXELS, hidden).init(device),
            out: LinearConfig::new(hidden, CLASSES).init(device),
            relu: Relu::new(),
        }
    }

    /// Logits, `[batch, 10]`.
    pub fn forward(&self, images: Tensor<B, 2>) -> Tensor<B, 2> {
        self.out
            .forward(self.relu.forward(self.hidden.forward(images)))
    }

    /// The mean cross-entropy of the images at `indexes` of `set`, and
    /// how many of them are classified right.
    pub fn loss(&self, set: &Set, indexes: &[usize], device: &B::Device) -> (Tensor<B, 1>, usize) {
        let (images, labels) = batch::<B>(set, indexes, device);
        let logits = self.forward(images);
        let correct = logits
            .clone()
            .argmax(1)
            .squeeze_dim::<1>(1)
            .equal(labels.clone())
            .int()
            .sum()
            .into_scalar();
        let loss = CrossEntropyLossConfig::new()
            .init(device)
            .forward(logits, labels);
        (loss, correct.elem::<i64>() as usize)
    }
}

/// The images and labels at `indexes` of `set`, as tensors.
fn batch<B: Backend>(
    set: &Set,
    indexes: &[usize],
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 1, Int>) {
    let pixels: Vec<f32> = indexes.iter().flat_map(|&i| set.images[i]).collect();
    let labels: Vec<i64> = indexes.iter().map(|&i| i64::from(set.labels[i])).collect();
    (
        Tensor::from_data(TensorData::new(pixels, [indexes.len(), PIXELS]), device),
        Tensor::from_data(TensorData::new(labels, [indexes.len()]), device),
    )
}
