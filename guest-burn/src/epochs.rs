//! Reporting every epoch and checkpointing at a chosen frequency: what
//! Ray's `RayTrainReportCallback` does at the end of each epoch, with
//! Ray's recipe for a custom frequency built in.

use burn::lr_scheduler::LrScheduler;
use burn::module::AutodiffModule;
use burn::optim::Optimizer;
use burn::tensor::backend::AutodiffBackend;
use trainhost_guest::{Checkpoint, Metrics};

use crate::Error;
use crate::checkpoint;

/// Whether the training loop goes on after [`Epochs::end`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// The run is preempted and this epoch's checkpoint is committed:
    /// return from the loop (the run resumes from it later).
    Stop,
}

/// A loop of `total` epochs that reports after each and checkpoints every
/// `n`th and the last.
///
/// For data-parallel loops, where every rank holds the same model: rank 0
/// saves the checkpoint, every rank reports (a report is collective).
#[derive(Clone, Copy, Debug)]
pub struct Epochs {
    total: usize,
    every: usize,
}

impl Epochs {
    /// `total` epochs, each checkpointed.
    pub fn new(total: usize) -> Self {
        Self { total, every: 1 }
    }

    /// Checkpoint after every `n`th epoch (epochs `n-1`, `2n-1`, ...) and
    /// after the last; `0` checkpoints only after the last.
    pub fn checkpoint_every(self, n: usize) -> Self {
        Self { every: n, ..self }
    }

    /// The number of epochs.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Whether epoch `epoch` (from 0) ends with a checkpoint.
    pub fn is_due(&self, epoch: usize) -> bool {
        epoch + 1 == self.total || (self.every > 0 && (epoch + 1).is_multiple_of(self.every))
    }

    /// End epoch `epoch`: report `metrics` (with `epoch` added) and, when
    /// due, a checkpoint of `model` and `optimizer`. When the run is
    /// preempted, a checkpoint is reported even if not due, and the loop
    /// should stop ([`Flow::Stop`]).
    pub fn end<B, M, O>(
        &self,
        epoch: usize,
        metrics: Metrics,
        model: &M,
        optimizer: &O,
    ) -> Result<Flow, Error>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        self.end_with(epoch, metrics, || checkpoint::save(model, optimizer, epoch))
    }

    /// [`Epochs::end`], saving the scheduler's state too.
    pub fn end_with_scheduler<B, M, O, S>(
        &self,
        epoch: usize,
        metrics: Metrics,
        model: &M,
        optimizer: &O,
        scheduler: &S,
    ) -> Result<Flow, Error>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
        S: LrScheduler,
    {
        self.end_with(epoch, metrics, || {
            checkpoint::save_with_scheduler(model, optimizer, scheduler, epoch)
        })
    }

    fn end_with(
        &self,
        epoch: usize,
        mut metrics: Metrics,
        save: impl Fn() -> Result<Checkpoint, Error>,
    ) -> Result<Flow, Error> {
        metrics.insert("epoch", i64::try_from(epoch).unwrap_or(i64::MAX));
        let saved = || -> Result<Option<Checkpoint>, Error> {
            if trainhost_guest::world_rank() == 0 {
                save().map(Some)
            } else {
                Ok(None)
            }
        };
        let due = self.is_due(epoch);
        trainhost_guest::report(metrics.clone(), if due { saved()? } else { None })?;
        // Preemption turns true on every rank after the same report, so
        // every rank makes the extra report below or none does.
        if !trainhost_guest::preemption_requested() {
            return Ok(Flow::Continue);
        }
        if !due {
            trainhost_guest::report(metrics, saved()?)?;
        }
        Ok(Flow::Stop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoints_fall_every_nth_epoch_and_on_the_last() {
        let epochs = Epochs::new(10).checkpoint_every(3);
        let due: Vec<usize> = (0..10).filter(|&e| epochs.is_due(e)).collect();
        assert_eq!(due, [2, 5, 8, 9]);
        let last_only = Epochs::new(4).checkpoint_every(0);
        assert_eq!((0..4).filter(|&e| last_only.is_due(e)).count(), 1);
        assert!((0..3).all(|e| Epochs::new(3).is_due(e)));
    }
}
