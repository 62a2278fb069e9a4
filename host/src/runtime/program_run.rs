//! A recorded program's run (`program.run`): the checks that its rows fit
//! and that every tensor is still there, then each kernel called as the
//! guest's own call would call it (`kernel_calls.rs`).

use std::sync::Arc;

use smallvec::SmallVec;
use wasmtime::component::Resource;

use super::bindings::trainhost::train::tensors::{ProgramError, TensorError};
use super::kernel_calls::Few;
use super::program::named;
use super::rank::RankState;
use super::recording::{Kernel, Program};
use crate::tensor::{Tensor, check};

/// A borrowed handle of the tensor in slot `rep`, as a guest's call
/// passes it.
fn handle(rep: u32) -> Resource<Tensor> {
    Resource::new_borrow(rep)
}

fn handles(reps: &[u32]) -> Few<Resource<Tensor>> {
    reps.iter().map(|&r| handle(r)).collect()
}

impl RankState {
    /// `program.run`: the checks, then each kernel in turn.
    pub(super) async fn run_program(
        &mut self,
        p: &Resource<Program>,
        rows: &[u32],
    ) -> wasmtime::Result<Result<Vec<(f64, u32)>, ProgramError>> {
        self.check_running()?;
        let program = self.table.get(p)?;
        if let Err(e) = self.check_run(program, rows) {
            return Ok(Err(ProgramError::Refused(e)));
        }
        let (kernels, runs) = (Arc::clone(&program.kernels), program.runs);
        self.table.get_mut(p)?.runs = runs.saturating_add(1);
        let mut losses = Vec::new();
        for (i, kernel) in kernels.iter().enumerate() {
            match self.run_kernel(kernel, rows, runs, &mut losses).await? {
                Ok(()) => {}
                // The checks at recording and above leave a kernel nothing
                // to refuse; should one, the message says which.
                Err(ProgramError::Refused(e)) => {
                    return Ok(Err(ProgramError::Refused(at_kernel(i, kernel, e))));
                }
                Err(e) => return Ok(Err(e)),
            }
        }
        Ok(Ok(losses))
    }

    /// Check a run of `program` with `rows` before any kernel runs: every
    /// tensor still there, and the rows as many as each kernel that takes
    /// them expects, each below its bound.
    fn check_run(&self, program: &Program, rows: &[u32]) -> Result<(), TensorError> {
        if let Some(gone) = program
            .names
            .iter()
            .find(|n| self.drops.of(n.rep) != n.drops)
        {
            let k = &program.kernels[gone.kernel as usize];
            return Err(TensorError::Invalid(format!(
                "program.run: a tensor that kernel {} ({}) names was dropped since it was recorded; record the program again with the tensors it should use",
                gone.kernel,
                k.name()
            )));
        }
        for (i, k) in program.kernels.iter().enumerate() {
            let (want, bound, of) = match k {
                Kernel::GatherRows { rows, bound, .. } => (*rows, *bound, "rows in the source"),
                Kernel::SoftmaxCrossEntropy { labels, rows, .. } => (*rows, labels.len(), "labels"),
                _ => continue,
            };
            let name = k.name();
            if rows.len() != want {
                return Err(TensorError::Shape(format!(
                    "program.run: kernel {i} ({name}) takes {want} rows, and the run was given {}",
                    rows.len()
                )));
            }
            if let Some(r) = check::first_not_below(rows, bound) {
                return Err(TensorError::Invalid(format!(
                    "program.run: rows[{r}] is {}, past the {bound} {of} of kernel {i} ({name})",
                    rows[r]
                )));
            }
        }
        Ok(())
    }

    /// Run one recorded kernel as the guest's own call would; a loss
    /// goes to `losses`.
    async fn run_kernel(
        &mut self,
        kernel: &Kernel,
        rows: &[u32],
        runs: u32,
        losses: &mut Vec<(f64, u32)>,
    ) -> wasmtime::Result<Result<(), ProgramError>> {
        let h = handle;
        let refused = |r: Result<(), TensorError>| r.map_err(ProgramError::Refused);
        Ok(match *kernel {
            Kernel::GatherRows { out, source, .. } => {
                refused(self.call_gather_rows(&h(out), &h(source), rows)?)
            }
            Kernel::Gemm {
                c,
                alpha,
                a,
                trans_a,
                b,
                trans_b,
                beta,
            } => refused(self.call_gemm(&h(c), alpha, &h(a), trans_a, &h(b), trans_b, beta)?),
            Kernel::Axpy { y, alpha, x } => refused(self.call_axpy(&h(y), alpha, &h(x))?),
            Kernel::Scale { x, alpha } => refused(self.call_scale(&h(x), alpha)?),
            Kernel::AddRow { x, row } => refused(self.call_add_row(&h(x), &h(row))?),
            Kernel::SumRows { out, x, beta } => {
                refused(self.call_sum_rows(&h(out), &h(x), beta)?)
            }
            Kernel::Activate { x, f } => refused(self.call_activate(&h(x), f)?),
            Kernel::ActivateBackward { grad, output, f } => {
                refused(self.call_activate_backward(&h(grad), &h(output), f)?)
            }
            Kernel::Dense { out, x, w, bias, f } => {
                refused(self.call_dense(&h(out), &h(x), &h(w), bias.map(h).as_ref(), f)?)
            }
            Kernel::DenseBackward {
                grad,
                x,
                w,
                beta,
                grad_w,
                grad_bias,
                grad_x,
                x_f,
            } => refused(self.call_dense_backward(
                &h(grad),
                &h(x),
                &h(w),
                beta,
                &h(grad_w),
                grad_bias.map(h).as_ref(),
                grad_x.map(h).as_ref(),
                x_f,
            )?),
            Kernel::SoftmaxCrossEntropy {
                logits,
                ref labels,
                grad,
                grad_scale,
                ..
            } => {
                let labels: SmallVec<[u32; 256]> =
                    rows.iter().map(|&r| labels[r as usize]).collect();
                match self.call_softmax_cross_entropy(&h(logits), &labels, &h(grad), grad_scale)? {
                    Ok(loss) => {
                        losses.push(loss);
                        Ok(())
                    }
                    Err(e) => Err(ProgramError::Refused(e)),
                }
            }
            Kernel::SgdMomentumList {
                ref params,
                ref velocity,
                ref grads,
                grad_scale,
                lr,
                momentum,
            } => refused(self.call_sgd_momentum_list(
                &handles(params),
                &handles(velocity),
                &handles(grads),
                grad_scale,
                lr,
                momentum,
            )?),
            Kernel::Adam {
                param,
                m,
                v,
                grad,
                hyper,
            } => {
                let hyper = crate::tensor::AdamStep {
                    step: hyper.step.saturating_add(runs),
                    ..hyper
                };
                refused(self.call_adam(&h(param), &h(m), &h(v), &h(grad), hyper)?)
            }
            Kernel::AllReduceList { ref ts, op } => self
                .all_reduce_tensors(&handles(ts), op)
                .await?
                .map_err(ProgramError::Collective),
        })
    }
}

/// A kernel's refusal during a run, naming the kernel.
fn at_kernel(i: usize, kernel: &Kernel, e: TensorError) -> TensorError {
    named(&format!("program.run: kernel {i} ({})", kernel.name()), e)
}
