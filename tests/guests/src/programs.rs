//! The script's recorded-program steps (`tensors.program`):
//! - `{"program_step": "program" | "direct"}`: three training steps of a
//!   two-layer network on a data set in the host, made of every kernel a
//!   program records (gathered rows, `gemm`, `add-row`, `activate`, the
//!   loss, `dense-backward`, `activate-backward`, `sum-rows`, `axpy`,
//!   `scale`, an all-reduce of the gradients, SGD with momentum, Adam),
//!   as a program run three times or as the same calls made directly;
//!   prints `program_step: FNV LOSSES` (every tensor's values after the
//!   steps, and each step's loss and correct count)
//! - `{"program_refusals": true}`: calls a program refuses when recorded
//!   and runs it refuses, each printed as `program error: ...`, then
//!   `program unchanged: true|false` (whether the refused runs left every
//!   tensor as it was)
//! - `{"program_full": true}`: records kernels until one is refused;
//!   prints `program_full: N recorded` and the error
//! - `{"program_gemm": N}`: a program of one `gemm` of `[N, 2N] × [2N, N]`,
//!   run once; prints `program_gemm: done`
//! - `{"program_labels_mb": N}`: records losses with labels of N MiB each
//!   until one is refused (at most 65); prints `program_labels: K
//!   recorded` and the error, then, the program dropped,
//!   `program_labels: recorded again`
//! - `{"program_empty": C}`: makes C programs and keeps them; prints
//!   `program_empty: C made`

use serde_json::{Map, Value};
use trainhost_guest::collective::Op;
use trainhost_guest::program::{LayerGrads, Program, ProgramError};
use trainhost_guest::tensor::{self, Activation, AdamStep, DenseGrads, Tensor, TensorError};

/// Run `step` if it is a program one; `Ok(false)` if it is not.
pub fn run(step: &Map<String, Value>) -> Result<bool, String> {
    let outcome: Result<(), Box<dyn std::error::Error>> =
        if let Some(how) = step.get("program_step").and_then(Value::as_str) {
            three_steps(how == "program").map(|(values, losses)| {
                let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
                println!("program_step: {:016x} {losses:?}", crate::fnv(&bytes));
            })
        } else if step.contains_key("program_refusals") {
            refusals().map_err(Into::into)
        } else if step.contains_key("program_full") {
            full().map_err(Into::into)
        } else if let Some(mb) = step.get("program_labels_mb").and_then(Value::as_u64) {
            labels(mb as usize).map_err(Into::into)
        } else if let Some(count) = step.get("program_empty").and_then(Value::as_u64) {
            let held: Vec<Program> = (0..count).map(|_| Program::new()).collect();
            println!("program_empty: {} made", held.len());
            Ok(())
        } else if let Some(n) = step.get("program_gemm").and_then(Value::as_u64) {
            let n = n as u32;
            (|| -> Result<(), Box<dyn std::error::Error>> {
                let (a, b, c) = (
                    Tensor::zeros(&[n, 2 * n])?,
                    Tensor::zeros(&[2 * n, n])?,
                    Tensor::zeros(&[n, n])?,
                );
                let mut p = Program::new();
                p.gemm(&c, 1.0, &a, false, &b, false, 0.0)?;
                p.run(&[])?;
                println!("program_gemm: done");
                Ok(())
            })()
        } else {
            return Ok(false);
        };
    if let Err(e) = outcome {
        println!("program error: {e}");
    }
    Ok(true)
}

/// The network's tensors: `relu(x · w1 + b1) · w2 + b2`, Adam on `w2`,
/// SGD with momentum on the rest.
struct Net {
    data: Tensor,
    labels: Vec<u32>,
    x: Tensor,
    h: Tensor,
    z: Tensor,
    dz: Tensor,
    dh: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    gw1: Tensor,
    gb1: Tensor,
    gw2: Tensor,
    gb2: Tensor,
    v: [Tensor; 3],
    m2: Tensor,
    v2: Tensor,
    /// A running sum of `gw1`, with `axpy`, and scaled: kernels a step
    /// needs less often, recorded all the same.
    sum: Tensor,
}

const ROWS: u32 = 6;
const SGD: (f32, f32, f32) = (0.5, 0.1, 0.9);

impl Net {
    fn new() -> Result<Self, TensorError> {
        let t = |shape: &[u32], seed| Tensor::uniform(shape, -1.0, 1.0, seed);
        let z = |shape: &[u32]| Tensor::zeros(shape);
        Ok(Self {
            data: t(&[20, 5], 1)?,
            labels: (0..20).map(|i| (i * 7 % 3) as u32).collect(),
            x: z(&[ROWS, 5])?,
            h: z(&[ROWS, 4])?,
            z: z(&[ROWS, 3])?,
            dz: z(&[ROWS, 3])?,
            dh: z(&[ROWS, 4])?,
            w1: t(&[5, 4], 2)?,
            b1: t(&[4], 3)?,
            w2: t(&[4, 3], 4)?,
            b2: t(&[3], 5)?,
            gw1: z(&[5, 4])?,
            gb1: z(&[4])?,
            gw2: z(&[4, 3])?,
            gb2: z(&[3])?,
            v: [z(&[5, 4])?, z(&[4])?, z(&[3])?],
            m2: z(&[4, 3])?,
            v2: z(&[4, 3])?,
            sum: z(&[5, 4])?,
        })
    }

    fn values(&self) -> Vec<f32> {
        let all = [
            &self.x, &self.h, &self.z, &self.dz, &self.dh, &self.w1, &self.b1, &self.w2, &self.b2,
            &self.gw1, &self.gb1, &self.gw2, &self.gb2, &self.m2, &self.v2, &self.sum,
        ];
        all.into_iter()
            .chain(&self.v)
            .flat_map(Tensor::to_vec)
            .collect()
    }

    /// One step made directly, kernel by kernel.
    fn step(&mut self, rows: &[u32]) -> Result<(f64, u32), Box<dyn std::error::Error>> {
        let relu = Activation::Relu;
        self.x.gather_rows(&self.data, rows)?;
        self.h.gemm(1.0, &self.x, false, &self.w1, false, 0.0)?;
        self.h.add_row(&self.b1)?;
        self.h.activate(relu);
        self.z.dense(&self.h, &self.w2, Some(&self.b2), None)?;
        let labels: Vec<u32> = rows.iter().map(|&r| self.labels[r as usize]).collect();
        let loss = self.z.softmax_cross_entropy(&labels, &mut self.dz, 1.0)?;
        let grads = DenseGrads {
            w: &mut self.gw2,
            bias: Some(&mut self.gb2),
            x: None,
        };
        tensor::dense_backward(&self.dz, &self.h, &self.w2, 0.0, grads)?;
        self.dh.gemm(1.0, &self.dz, false, &self.w2, true, 0.0)?;
        self.dh.activate_backward(&self.h, relu)?;
        self.gw1.gemm(1.0, &self.x, true, &self.dh, false, 0.0)?;
        self.gb1.sum_rows(&self.dh, 0.0)?;
        let mut grads = [&mut self.gw1, &mut self.gb1, &mut self.gw2, &mut self.gb2];
        tensor::all_reduce(&mut grads, Op::Sum)?;
        self.sum.axpy(1.0, &self.gw1)?;
        self.sum.scale(0.5);
        let [v1, v2, v3] = &mut self.v;
        let (scale, lr, momentum) = SGD;
        tensor::sgd_momentum(
            &mut [&mut self.w1, &mut self.b1, &mut self.b2],
            &mut [v1, v2, v3],
            &[&self.gw1, &self.gb1, &self.gb2],
            scale,
            lr,
            momentum,
        )?;
        Ok(loss)
    }

    /// The same step, recorded.
    fn record(&self) -> Result<Program, TensorError> {
        let relu = Activation::Relu;
        let mut p = Program::new();
        p.gather_rows(&self.x, &self.data)?;
        p.gemm(&self.h, 1.0, &self.x, false, &self.w1, false, 0.0)?;
        p.add_row(&self.h, &self.b1)?;
        p.activate(&self.h, relu)?;
        p.dense(&self.z, &self.h, &self.w2, Some(&self.b2), None)?;
        p.softmax_cross_entropy(&self.z, &self.labels, &self.dz, 1.0)?;
        let grads = LayerGrads {
            w: &self.gw2,
            bias: Some(&self.gb2),
            x: None,
        };
        p.dense_backward(&self.dz, &self.h, &self.w2, 0.0, grads)?;
        p.gemm(&self.dh, 1.0, &self.dz, false, &self.w2, true, 0.0)?;
        p.activate_backward(&self.dh, &self.h, relu)?;
        p.gemm(&self.gw1, 1.0, &self.x, true, &self.dh, false, 0.0)?;
        p.sum_rows(&self.gb1, &self.dh, 0.0)?;
        p.all_reduce(&[&self.gw1, &self.gb1, &self.gw2, &self.gb2], Op::Sum)?;
        p.axpy(&self.sum, 1.0, &self.gw1)?;
        p.scale(&self.sum, 0.5)?;
        let (scale, lr, momentum) = SGD;
        let v: Vec<&Tensor> = self.v.iter().collect();
        p.sgd_momentum(
            &[&self.w1, &self.b1, &self.b2],
            &v,
            &[&self.gw1, &self.gb1, &self.gb2],
            scale,
            lr,
            momentum,
        )?;
        p.adam(&self.w2, &self.m2, &self.v2, &self.gw2, adam(1))?;
        Ok(p)
    }
}

fn adam(step: u32) -> AdamStep {
    AdamStep::new(0.01, step)
}

/// The batches of the three steps.
const BATCHES: [[u32; ROWS as usize]; 3] = [
    [0, 1, 2, 3, 4, 5],
    [19, 3, 3, 8, 0, 11],
    [7, 7, 7, 2, 9, 13],
];

/// Every tensor's values after some steps, and each step's loss.
type After = (Vec<f32>, Vec<(f64, u32)>);

/// Three steps, recorded or direct.
fn three_steps(recorded: bool) -> Result<After, Box<dyn std::error::Error>> {
    let mut net = Net::new()?;
    let mut losses = Vec::new();
    if recorded {
        let mut p = net.record()?;
        for rows in &BATCHES {
            losses.extend(p.run(rows)?);
        }
    } else {
        for (i, rows) in BATCHES.iter().enumerate() {
            losses.push(net.step(rows)?);
            // Adam's step counts from 1, one more each step.
            let (w2, m2, v2) = (&mut net.w2, &mut net.m2, &mut net.v2);
            w2.adam(m2, v2, &net.gw2, adam(i as u32 + 1))?;
        }
    }
    Ok((net.values(), losses))
}

/// Print a refusal, or that there was none.
fn refused<T>(what: Result<T, impl std::fmt::Display>) {
    match what {
        Ok(_) => println!("program error: none"),
        Err(e) => println!("program error: {e}"),
    }
}

fn refusals() -> Result<(), TensorError> {
    let net = Net::new()?;
    let mut p = Program::new();
    // Recorded: shapes that do not fit, a tensor written and read, one
    // listed twice in an all-reduce, a label past the classes, lists of
    // different lengths.
    refused(p.gemm(&net.h, 1.0, &net.x, false, &net.w2, false, 0.0));
    refused(p.dense(&net.h, &net.h, &net.w1, None, None));
    refused(p.all_reduce(&[&net.gw1, &net.gw1], Op::Sum));
    refused(p.softmax_cross_entropy(&net.z, &[0, 1, 3], &net.dz, 1.0));
    refused(p.sgd_momentum(
        &[&net.w1],
        &[&net.v[0], &net.v[1]],
        &[&net.gw1],
        1.0,
        0.1,
        0.9,
    ));
    refused(p.gather_rows(&net.h, &net.data));
    // Run: rows of another count, a row past the data, past the labels.
    let before = net.values();
    p.gather_rows(&net.x, &net.data)?;
    p.dense(&net.h, &net.x, &net.w1, Some(&net.b1), None)?;
    refused(p.run(&[0, 1, 2]));
    refused(p.run(&[0, 1, 2, 3, 4, 20]));
    let mut q = Program::new();
    q.softmax_cross_entropy(&net.z, &net.labels[..10], &net.dz, 1.0)?;
    refused(q.run(&[0, 1, 2, 3, 4, 10]));
    println!("program unchanged: {}", net.values() == before);
    // A tensor dropped since: refused, even with a new tensor in its place.
    let gone = Tensor::zeros(&[ROWS, 4])?;
    let mut r = Program::new();
    r.activate(&gone, Activation::Tanh)?;
    drop(gone);
    let _in_its_place = Tensor::zeros(&[ROWS, 4])?;
    refused(r.run(&[]));
    // The error's kind reaches the caller.
    match r.run(&[]) {
        Err(ProgramError::Refused(TensorError::Invalid(_))) => println!("program refused: invalid"),
        other => println!("program refused: {other:?}"),
    }
    Ok(())
}

fn full() -> Result<(), TensorError> {
    let t = Tensor::zeros(&[1])?;
    let mut p = Program::new();
    let mut n = 0;
    loop {
        if let Err(e) = p.scale(&t, 1.0) {
            println!("program_full: {n} recorded");
            println!("program error: {e}");
            return Ok(());
        }
        n += 1;
    }
}

fn labels(mb: usize) -> Result<(), TensorError> {
    let labels = vec![0u32; mb << 18];
    let (logits, grad) = (Tensor::zeros(&[1, 2])?, Tensor::zeros(&[1, 2])?);
    let mut p = Program::new();
    // At most 64 (384 MiB at 6 MiB), should the host not count them.
    let mut n = 0;
    let refused = loop {
        match p.softmax_cross_entropy(&logits, &labels, &grad, 1.0) {
            Ok(()) if n < 64 => n += 1,
            Ok(()) => break None,
            Err(e) => break Some(e),
        }
    };
    println!("program_labels: {n} recorded");
    match refused {
        Some(e) => println!("program error: {e}"),
        None => println!("program error: none"),
    }
    drop(p);
    Program::new().softmax_cross_entropy(&logits, &labels, &grad, 1.0)?;
    println!("program_labels: recorded again");
    Ok(())
}
