//! Host tensor kernels: the guest's calls of them against the same maths
//! called natively, and against the same model computed in the guest.

use std::sync::Arc;

use anyhow::Result;
use serde_json::{Value, json};
use trainhost::bench::tensor::{self as k, Activation, Tensor};
use trainhost_test_artifacts::DIGITS_MLP;

use crate::common::{Paired, Row, Sampling, local_run, metric, run_guest, step_ns};
use crate::goals;

/// The digits example's model and batch, and a larger one where the
/// matrix products dominate; steps of one sample, native and kernels
/// (about a second of native work), and of the pure guest.
const MLP: [(u32, u32, &str, [u32; 2]); 2] = [
    (
        64,
        32,
        "the example's step: MLP 64→64→10, batch 32",
        [20_000, 2_000],
    ),
    (
        512,
        512,
        "a larger step: MLP 64→512→10, batch 512",
        [400, 10],
    ),
];

pub(crate) fn tensors(quick: bool) -> Result<Vec<Row>> {
    // A pass of the group takes a few seconds, and two of its goals
    // (1.1 × and 1.05 × native) are within a few percent of what it
    // measures: as many samples as any row.
    let reps = Sampling::Standard.per_pass(quick);
    let mut rows = mlp(quick, reps)?;
    rows.extend(gemm(quick, reps)?);
    rows.extend(calls_and_all_reduce(quick, reps)?);
    Ok(rows)
}

fn mlp(quick: bool, reps: usize) -> Result<Vec<Row>> {
    let (set, _) = digits_burn::load(0, 200).map_err(anyhow::Error::msg)?;
    let threads = k::threads_per_rank(1);
    let storage = tempfile::tempdir()?;
    let example = |config: Value| step_ns(DIGITS_MLP, config, storage.path());
    let mut rows = Vec::new();
    for (hidden, batch, what, [steps, guest_steps]) in MLP {
        let (steps, guest_steps) = match quick {
            true => (steps / 20, guest_steps.div_ceil(20)),
            false => (steps, guest_steps),
        };
        let (mut vs_native, mut vs_guest) = (Paired::default(), Paired::default());
        for _ in 0..reps {
            let native = NativeMlp::new(hidden, batch)?.time(&set, steps, threads)?;
            let config = |kernels, steps| json!({"kernels": kernels, "hidden": hidden, "batch_size": batch, "bench_steps": steps});
            let kernels = example(config(true, steps))?;
            let in_guest = example(config(false, guest_steps))?;
            vs_native.push(native, kernels);
            vs_guest.push(in_guest, kernels);
        }
        rows.push(vs_native.row(
            "tensors",
            format!("training step on host kernels, {what} (default interruption; {steps} steps a sample)"),
            format!("the same kernel calls made natively (trainhost's kernels, gemm crate, {threads} thread(s))"),
            format!("≤ {} × native", goals::KERNEL_STEP_VS_NATIVE),
            |n, o| Some(o <= goals::KERNEL_STEP_VS_NATIVE * n),
        ));
        rows.push(vs_guest.row(
            "tensors",
            format!("the same step on host kernels, {what}"),
            "the same model computed in the guest (its `kernels: false` path, default interruption)".into(),
            goals::comparison("what the kernels save"),
            |_, _| None,
        ));
    }
    Ok(rows)
}

/// The step of the digits example's `host.rs` made natively: the same
/// kernels in the same order on the same shapes.
struct NativeMlp {
    batch: usize,
    params: Vec<Tensor>,
    velocity: Vec<Tensor>,
    grads: Vec<Tensor>,
    x: Tensor,
    h: Tensor,
    z: Tensor,
    dz: Tensor,
    dh: Tensor,
}

impl NativeMlp {
    fn new(hidden: u32, batch: u32) -> Result<Self> {
        let shapes: [&[u32]; 4] = [&[64, hidden], &[hidden], &[hidden, 10], &[10]];
        let make = |f: &dyn Fn(&[u32]) -> Result<Tensor, k::TensorError>| {
            shapes.iter().map(|s| f(s)).collect::<Result<Vec<_>, _>>()
        };
        Ok(Self {
            batch: batch as usize,
            params: make(&|s| Tensor::uniform(s, -0.1, 0.1, 1))?,
            velocity: make(&|s| Tensor::zeros(s))?,
            grads: make(&|s| Tensor::zeros(s))?,
            x: Tensor::zeros(&[batch, 64])?,
            h: Tensor::zeros(&[batch, hidden])?,
            z: Tensor::zeros(&[batch, 10])?,
            dz: Tensor::zeros(&[batch, 10])?,
            dh: Tensor::zeros(&[batch, hidden])?,
        })
    }

    /// Nanoseconds per step over `steps` steps on the first images of
    /// `set`, after one untimed step.
    fn time(&mut self, set: &digits_burn::Set, steps: u32, threads: usize) -> Result<f64> {
        // The images in one tensor, as the example keeps them in the host.
        let pixels: Vec<f32> = set.images.iter().flatten().copied().collect();
        let images = Tensor::from_vec(&[set.len() as u32, 64], pixels)?;
        let batch: Vec<usize> = (0..self.batch.min(set.len())).collect();
        self.step(set, &images, &batch, threads)?;
        let started = std::time::Instant::now();
        for _ in 0..steps {
            self.step(set, &images, &batch, threads)?;
        }
        Ok(started.elapsed().as_nanos() as f64 / f64::from(steps.max(1)))
    }

    fn step(
        &mut self,
        set: &digits_burn::Set,
        images: &Tensor,
        batch: &[usize],
        threads: usize,
    ) -> Result<()> {
        let never = || false;
        let rows: Vec<u32> = batch.iter().map(|&i| i as u32).collect();
        let labels: Vec<u32> = batch.iter().map(|&i| u32::from(set.labels[i])).collect();
        let [w1, b1, w2, b2] = &self.params[..] else {
            unreachable!("four tensors")
        };
        let (x, h, z, dz, dh) = (
            &mut self.x,
            &mut self.h,
            &mut self.z,
            &mut self.dz,
            &mut self.dh,
        );
        let relu = Some(Activation::Relu);
        k::gather_rows(x, images, &rows)?;
        k::dense(h, x, w1, Some(b1), relu, threads, &never)?;
        k::dense(z, h, w2, Some(b2), None, threads, &never)?;
        std::hint::black_box(k::softmax_cross_entropy(z, &labels, dz, 1.0)?);
        let [gw1, gb1, gw2, gb2] = &mut self.grads[..] else {
            unreachable!("four tensors")
        };
        let grads = k::DenseGrads {
            w: gw2,
            bias: Some(gb2),
            x: Some((dh, relu)),
        };
        k::dense_backward(dz, h, w2, 0.0, grads, threads, &never)?;
        let grads = k::DenseGrads {
            w: gw1,
            bias: Some(gb1),
            x: None,
        };
        k::dense_backward(dh, x, w1, 0.0, grads, threads, &never)?;
        let mut params: Vec<&mut Tensor> = self.params.iter_mut().collect();
        let mut velocity: Vec<&mut Tensor> = self.velocity.iter_mut().collect();
        let grads: Vec<&Tensor> = self.grads.iter().collect();
        let scale = 1.0 / batch.len() as f32;
        k::sgd_momentum_list(&mut params, &mut velocity, &grads, scale, 0.1, 0.9)?;
        Ok(())
    }
}

/// GEMMs of n³ in the guest against the gemm crate called natively with
/// the same threads.
fn gemm(quick: bool, reps: usize) -> Result<Vec<Row>> {
    let threads = k::threads_per_rank(1);
    let storage = tempfile::tempdir()?;
    let mut rows = Vec::new();
    for (n, calls) in [(256u32, 400u32), (1024, 20)] {
        let calls = if quick { calls / 10 } else { calls };
        let mut paired = Paired::default();
        for _ in 0..reps {
            let native = native_gemm(n as usize, calls, threads);
            let result = run_guest(
                json!({"mode": "gemm", "n": n, "calls": calls}),
                1,
                local_run(storage.path()),
                Arc::default(),
            )?;
            paired.push(native, metric(&result, "gemm_ns")?);
        }
        rows.push(paired.row(
            "tensors",
            format!("GEMM {n}×{n}×{n} through `tensors.gemm` (median of {calls} calls)"),
            format!("the gemm crate called natively, {threads} thread(s)"),
            format!("≤ {} × the crate", goals::GEMM_VS_CRATE),
            |b, o| Some(o <= goals::GEMM_VS_CRATE * b),
        ));
    }
    Ok(rows)
}

/// The median time of `calls` native GEMMs `c = a · b` of n × n.
fn native_gemm(n: usize, calls: u32, threads: usize) -> f64 {
    let a = vec![0.5f32; n * n];
    let b = vec![0.25f32; n * n];
    let mut c = vec![0f32; n * n];
    let parallelism = match threads {
        1 => gemm::Parallelism::None,
        t => gemm::Parallelism::Rayon(t),
    };
    let mut once = || {
        // SAFETY: three n × n row-major matrices, c apart from a and b.
        unsafe {
            gemm::gemm(
                n,
                n,
                n,
                c.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr(),
                1,
                n as isize,
                b.as_ptr(),
                1,
                n as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
        }
    };
    once();
    let mut times: Vec<f64> = (0..calls.max(1))
        .map(|_| {
            let started = std::time::Instant::now();
            once();
            started.elapsed().as_nanos() as f64
        })
        .collect();
    times.sort_by(f64::total_cmp);
    std::hint::black_box(&c);
    times[times.len() / 2]
}

/// One small kernel call against a trivial import, and the all-reduce of
/// a tensor against that of a list of as many values.
fn calls_and_all_reduce(quick: bool, reps: usize) -> Result<Vec<Row>> {
    let storage = tempfile::tempdir()?;
    let calls = if quick { 20_000 } else { 200_000 };
    let mut small = Paired::default();
    for _ in 0..reps {
        let result = run_guest(
            json!({"mode": "kernel_call", "calls": calls}),
            1,
            local_run(storage.path()),
            Arc::default(),
        )?;
        small.push(metric(&result, "call_ns")?, metric(&result, "kernel_ns")?);
    }
    let mut rows = vec![small.row(
        "tensors",
        format!("one small kernel call (`scale` of one value; {calls} calls)"),
        "a trivial host call (`world-rank`)".into(),
        goals::comparison("the boundary crossing a kernel adds"),
        |_, _| None,
    )];
    for (floats, calls) in [(1u64 << 18, 50u32), (1 << 24, 6)] {
        let mut paired = Paired::default();
        for _ in 0..reps {
            let result = run_guest(
                json!({"mode": "tensor_all_reduce", "floats": floats, "calls": calls}),
                2,
                local_run(storage.path()),
                Arc::default(),
            )?;
            paired.push(metric(&result, "list_ns")?, metric(&result, "tensor_ns")?);
        }
        rows.push(paired.row(
            "tensors",
            format!(
                "all-reduce (sum) of a host tensor of {} MiB f32, 2 ranks (median of {calls})",
                (floats * 4) >> 20
            ),
            "the list all-reduce of as many f32 (values through the guest)".into(),
            goals::comparison("what keeping the values in the host saves"),
            |_, _| None,
        ));
    }
    Ok(rows)
}
