//! Recorded programs (`tensors.program`): a training step's kernel calls,
//! recorded once and run again with one call into the host. A small
//! model's step is dominated by crossings (lending and checking the
//! handles, lifting the lists; from Python the interpreter and the
//! bindings too), not by its maths, and a program pays one a step.
//!
//! Recording a kernel runs the kernel's own argument checks
//! (`crate::tensor::check`) and the aliasing check of a direct call. A
//! tensor's shape never changes, so those checks hold for every later run
//! as long as the tensors are there: a run checks only that (by each
//! slot's drop count, `rank::Drops`) and what its rows change, then calls each
//! kernel exactly as the guest's own call would, so the values are the
//! same bit for bit.

use std::sync::Arc;

use smallvec::SmallVec;
use wasmtime::component::Resource;

use super::bindings::trainhost::train::collective::ReduceOp;
use super::bindings::trainhost::train::tensors::{
    Activation, AdamStep, HostProgram, ProgramError, TensorError,
};
use super::collective::op;
use super::kernel_calls::{Answer, Few, activation, adam_step, aliased, refused};
use super::limits::LimitHit;
use super::rank::RankState;
use super::recording::{Kernel, MAX_KERNELS, Named, Program};
use crate::tensor::{Tensor, check};

/// The tensors of a recording call as its check receives them: those it
/// writes, then those it reads.
type Args<'a> = &'a [&'a Tensor];

impl RankState {
    /// Record a call of the kernel `name` into `program`: `written` and
    /// `read` are the tensors it writes and reads, and `make` checks them
    /// as the kernel does and gives the kernel to record.
    fn record(
        &mut self,
        program: &Resource<Program>,
        name: &str,
        written: &[&Resource<Tensor>],
        read: &[&Resource<Tensor>],
        make: impl FnOnce(Args, Args) -> Result<Kernel, crate::tensor::TensorError>,
    ) -> Answer<()> {
        self.check_running()?;
        let name = format!("program.{name}");
        let reps = written.iter().map(|t| t.rep()).collect();
        if let Some(e) = aliased(&name, reps, read.iter().map(|t| t.rep())) {
            return Ok(Err(e));
        }
        let tensors = |ts: &[&Resource<Tensor>]| {
            ts.iter()
                .map(|t| self.table.get(t))
                .collect::<Result<Few<_>, _>>()
        };
        let made = make(&tensors(written)?, &tensors(read)?);
        let kernel = match made {
            Ok(k) => k,
            Err(e) => return Ok(Err(named(&name, refused(e)))),
        };
        let at = self.table.get(program)?.kernels.len();
        if at >= MAX_KERNELS {
            return Ok(Err(TensorError::Invalid(format!(
                "{name}: a program holds at most {MAX_KERNELS} kernels; record another step in a program of its own"
            ))));
        }
        let named: SmallVec<[Named; 16]> = written
            .iter()
            .chain(read)
            .map(|t| Named {
                rep: t.rep(),
                drops: self.drops.of(t.rep()),
                kernel: at as u32,
            })
            .collect();
        let bytes = kernel.bytes() + (named.len() * size_of::<Named>()) as u64;
        if let Err(m) = self.memory.take("a program's kernel", bytes) {
            return Ok(Err(TensorError::OutOfMemory(m)));
        }
        let p = self.table.get_mut(program)?;
        Arc::make_mut(&mut p.kernels).push(kernel);
        p.names.extend(named);
        p.bytes += bytes;
        Ok(Ok(()))
    }
}

impl HostProgram for RankState {
    fn new(&mut self) -> wasmtime::Result<Resource<Program>> {
        self.check_running()?;
        // The constructor has no error to return: a program that does not
        // fit stops the rank, as linear memory grown past the limit does.
        if let Err(m) = self.memory.take_entries("a program", 1, 0) {
            return Err(wasmtime::Error::new(LimitHit(m)));
        }
        Ok(self.table.push(Program::default())?)
    }

    fn gather_rows(
        &mut self,
        p: Resource<Program>,
        out: Resource<Tensor>,
        source: Resource<Tensor>,
    ) -> Answer<()> {
        let (o, s) = (out.rep(), source.rep());
        self.record(&p, "gather-rows", &[&out], &[&source], |w, r| {
            let (rows, bound) = check::gather_shapes(w[0], r[0])?;
            Ok(Kernel::GatherRows {
                out: o,
                source: s,
                rows,
                bound,
            })
        })
    }

    fn gemm(
        &mut self,
        p: Resource<Program>,
        c: Resource<Tensor>,
        alpha: f32,
        a: Resource<Tensor>,
        trans_a: bool,
        b: Resource<Tensor>,
        trans_b: bool,
        beta: f32,
    ) -> Answer<()> {
        let kernel = Kernel::Gemm {
            c: c.rep(),
            alpha,
            a: a.rep(),
            trans_a,
            b: b.rep(),
            trans_b,
            beta,
        };
        self.record(&p, "gemm", &[&c], &[&a, &b], |w, r| {
            check::gemm(w[0], r[0], trans_a, r[1], trans_b).map(|()| kernel)
        })
    }

    fn axpy(
        &mut self,
        p: Resource<Program>,
        y: Resource<Tensor>,
        alpha: f32,
        x: Resource<Tensor>,
    ) -> Answer<()> {
        let kernel = Kernel::Axpy {
            y: y.rep(),
            alpha,
            x: x.rep(),
        };
        self.record(&p, "axpy", &[&y], &[&x], |w, r| {
            check::axpy(w[0], r[0]).map(|()| kernel)
        })
    }

    fn scale(&mut self, p: Resource<Program>, x: Resource<Tensor>, alpha: f32) -> Answer<()> {
        let kernel = Kernel::Scale { x: x.rep(), alpha };
        self.record(&p, "scale", &[&x], &[], |_, _| Ok(kernel))
    }

    fn add_row(
        &mut self,
        p: Resource<Program>,
        x: Resource<Tensor>,
        row: Resource<Tensor>,
    ) -> Answer<()> {
        let kernel = Kernel::AddRow {
            x: x.rep(),
            row: row.rep(),
        };
        self.record(&p, "add-row", &[&x], &[&row], |w, r| {
            check::add_row(w[0], r[0]).map(|()| kernel)
        })
    }

    fn sum_rows(
        &mut self,
        p: Resource<Program>,
        out: Resource<Tensor>,
        x: Resource<Tensor>,
        beta: f32,
    ) -> Answer<()> {
        let kernel = Kernel::SumRows {
            out: out.rep(),
            x: x.rep(),
            beta,
        };
        self.record(&p, "sum-rows", &[&out], &[&x], |w, r| {
            check::sum_rows(w[0], r[0]).map(|()| kernel)
        })
    }

    fn activate(&mut self, p: Resource<Program>, x: Resource<Tensor>, f: Activation) -> Answer<()> {
        let kernel = Kernel::Activate {
            x: x.rep(),
            f: activation(f),
        };
        self.record(&p, "activate", &[&x], &[], |_, _| Ok(kernel))
    }

    fn activate_backward(
        &mut self,
        p: Resource<Program>,
        grad: Resource<Tensor>,
        output: Resource<Tensor>,
        f: Activation,
    ) -> Answer<()> {
        let kernel = Kernel::ActivateBackward {
            grad: grad.rep(),
            output: output.rep(),
            f: activation(f),
        };
        self.record(&p, "activate-backward", &[&grad], &[&output], |w, r| {
            check::activate_backward(w[0], r[0]).map(|()| kernel)
        })
    }

    fn dense(
        &mut self,
        p: Resource<Program>,
        out: Resource<Tensor>,
        x: Resource<Tensor>,
        w: Resource<Tensor>,
        bias: Option<Resource<Tensor>>,
        f: Option<Activation>,
    ) -> Answer<()> {
        let kernel = Kernel::Dense {
            out: out.rep(),
            x: x.rep(),
            w: w.rep(),
            bias: bias.as_ref().map(Resource::rep),
            f: f.map(activation),
        };
        let read: Few<&Resource<Tensor>> = [&x, &w].into_iter().chain(&bias).collect();
        self.record(&p, "dense", &[&out], &read, |w, r| {
            check::dense(w[0], r[0], r[1], r.get(2).copied()).map(|()| kernel)
        })
    }

    fn dense_backward(
        &mut self,
        p: Resource<Program>,
        grad: Resource<Tensor>,
        x: Resource<Tensor>,
        w: Resource<Tensor>,
        beta: f32,
        grad_w: Resource<Tensor>,
        grad_bias: Option<Resource<Tensor>>,
        grad_x: Option<Resource<Tensor>>,
        x_f: Option<Activation>,
    ) -> Answer<()> {
        let kernel = Kernel::DenseBackward {
            grad: grad.rep(),
            x: x.rep(),
            w: w.rep(),
            beta,
            grad_w: grad_w.rep(),
            grad_bias: grad_bias.as_ref().map(Resource::rep),
            grad_x: grad_x.as_ref().map(Resource::rep),
            x_f: x_f.map(activation),
        };
        let written: Few<&Resource<Tensor>> = [&grad_w]
            .into_iter()
            .chain(&grad_bias)
            .chain(&grad_x)
            .collect();
        let (has_bias, has_x) = (grad_bias.is_some(), grad_x.is_some());
        self.record(&p, "dense-backward", &written, &[&grad, &x, &w], |w, r| {
            let gb = has_bias.then(|| w[1]);
            let gx = has_x.then(|| w[w.len() - 1]);
            check::dense_backward(r[0], r[1], r[2], w[0], gb, gx).map(|()| kernel)
        })
    }

    fn softmax_cross_entropy(
        &mut self,
        p: Resource<Program>,
        logits: Resource<Tensor>,
        labels: Vec<u32>,
        grad: Resource<Tensor>,
        grad_scale: f32,
    ) -> Answer<()> {
        let (l, g) = (logits.rep(), grad.rep());
        self.record(&p, "softmax-cross-entropy", &[&grad], &[&logits], |w, r| {
            let (rows, classes) = check::softmax_shapes(r[0], w[0])?;
            check::labels_below(&labels, classes)?;
            Ok(Kernel::SoftmaxCrossEntropy {
                logits: l,
                labels,
                grad: g,
                grad_scale,
                rows,
            })
        })
    }

    fn sgd_momentum_list(
        &mut self,
        p: Resource<Program>,
        params: Vec<Resource<Tensor>>,
        velocity: Vec<Resource<Tensor>>,
        grads: Vec<Resource<Tensor>>,
        grad_scale: f32,
        lr: f32,
        momentum: f32,
    ) -> Answer<()> {
        let reps = |ts: &[Resource<Tensor>]| ts.iter().map(Resource::rep).collect::<Vec<_>>();
        let kernel = Kernel::SgdMomentumList {
            params: reps(&params),
            velocity: reps(&velocity),
            grads: reps(&grads),
            grad_scale,
            lr,
            momentum,
        };
        let n = params.len();
        let written: Vec<&Resource<Tensor>> = params.iter().chain(&velocity).collect();
        let read: Vec<&Resource<Tensor>> = grads.iter().collect();
        self.record(&p, "sgd-momentum-list", &written, &read, |w, r| {
            // The velocities are whatever follows the parameters: lists of
            // different lengths are refused by the check.
            let (params, velocity) = w.split_at(n);
            check::sgd_momentum_list(params, velocity, r).map(|()| kernel)
        })
    }

    fn adam(
        &mut self,
        p: Resource<Program>,
        param: Resource<Tensor>,
        m: Resource<Tensor>,
        v: Resource<Tensor>,
        grad: Resource<Tensor>,
        hyper: AdamStep,
    ) -> Answer<()> {
        let hyper = adam_step(hyper);
        let kernel = Kernel::Adam {
            param: param.rep(),
            m: m.rep(),
            v: v.rep(),
            grad: grad.rep(),
            hyper,
        };
        self.record(&p, "adam", &[&param, &m, &v], &[&grad], |w, r| {
            check::adam(w[0], w[1], w[2], r[0], hyper).map(|()| kernel)
        })
    }

    fn all_reduce_list(
        &mut self,
        p: Resource<Program>,
        ts: Vec<Resource<Tensor>>,
        o: ReduceOp,
    ) -> Answer<()> {
        let kernel = Kernel::AllReduceList {
            ts: ts.iter().map(Resource::rep).collect(),
            op: op(o),
        };
        // Each tensor counts as written, so one listed twice is refused
        // here, where refusing concerns this rank alone.
        let written: Vec<&Resource<Tensor>> = ts.iter().collect();
        self.record(&p, "all-reduce-list", &written, &[], |_, _| Ok(kernel))
    }

    async fn run(
        &mut self,
        p: Resource<Program>,
        rows: Vec<u32>,
    ) -> wasmtime::Result<Result<Vec<(f64, u32)>, ProgramError>> {
        self.run_program(&p, &rows).await
    }

    fn drop(&mut self, p: Resource<Program>) -> wasmtime::Result<()> {
        let program = self.table.delete(p)?;
        self.memory.give_back_entries(1, program.bytes);
        Ok(())
    }
}

/// `e` with its message said by `who`: in place of the kernel's name
/// where the message begins with it.
pub(super) fn named(who: &str, e: TensorError) -> TensorError {
    let kernel = who
        .rsplit(['.', '('])
        .next()
        .unwrap_or(who)
        .trim_end_matches(')');
    let say = |m: String| match m.strip_prefix(kernel).and_then(|m| m.strip_prefix(": ")) {
        Some(rest) => format!("{who}: {rest}"),
        None => format!("{who}: {m}"),
    };
    match e {
        TensorError::Shape(m) => TensorError::Shape(say(m)),
        TensorError::OutOfMemory(m) => TensorError::OutOfMemory(say(m)),
        TensorError::Invalid(m) => TensorError::Invalid(say(m)),
    }
}
