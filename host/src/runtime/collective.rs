//! The `collective` imports: the guest's calls turned into the attempt's
//! collective calls, and their results and errors back into WIT types.

use super::bindings::trainhost::train::collective::{self, CollectiveError, ReduceOp};
use super::rank::{RankState, StoppedByHost};
use crate::collective::{Call, CollectiveError as Failed, Delivered, Op, Values};

type Answer<T> = wasmtime::Result<Result<T, CollectiveError>>;

impl RankState {
    /// Make `call` and take its result apart with `take`. A rank told once
    /// that the run is stopping is stopped by its next call (R31): a guest
    /// that ignores the error cannot keep calling.
    pub(super) async fn collective<T>(
        &mut self,
        call: Call,
        take: impl FnOnce(Delivered) -> Option<T>,
    ) -> Answer<T> {
        if self.told_to_stop {
            return Err(wasmtime::Error::new(StoppedByHost));
        }
        let result = match self.attempt.collective(call).await {
            Ok(delivered) => match take(delivered) {
                Some(result) => Ok(result),
                // The attempt answers each call with its own kind of result.
                None => {
                    return Err(wasmtime::Error::msg(
                        "host error: a collective call got the result of another kind of call",
                    ));
                }
            },
            Err(e) => Err(e),
        };
        self.answer(result)
    }

    /// A collective call of a run of one rank with nothing to exchange
    /// (see [`crate::attempt::RankHandle::collective_alone`]), answered
    /// as [`Self::collective`] answers.
    pub(super) fn collective_alone(&mut self) -> Answer<()> {
        if self.told_to_stop {
            return Err(wasmtime::Error::new(StoppedByHost));
        }
        let result = self.attempt.collective_alone();
        self.answer(result)
    }

    /// A collective's result or error as the guest gets it; a rank whose
    /// call failed the run or was aborted is told to stop.
    fn answer<T>(&mut self, result: Result<T, Failed>) -> Answer<T> {
        match result {
            Ok(result) => Ok(Ok(result)),
            Err(Failed::Invalid(message)) => Ok(Err(CollectiveError::Invalid(message))),
            Err(Failed::Mismatch(message)) => {
                self.told_to_stop = true;
                Ok(Err(CollectiveError::Mismatch(message)))
            }
            Err(Failed::Aborted(message)) => {
                self.told_to_stop = true;
                Ok(Err(CollectiveError::Aborted(message)))
            }
        }
    }
}

pub(super) fn op(op: ReduceOp) -> Op {
    match op {
        ReduceOp::Sum => Op::Sum,
        ReduceOp::Mean => Op::Mean,
        ReduceOp::Min => Op::Min,
        ReduceOp::Max => Op::Max,
    }
}

impl collective::Host for RankState {
    async fn barrier(&mut self) -> Answer<()> {
        self.collective(Call::Barrier, |d| {
            matches!(d, Delivered::Done).then_some(())
        })
        .await
    }

    async fn broadcast(&mut self, data: Vec<u8>, root: u32) -> Answer<Vec<u8>> {
        self.collective(Call::Broadcast { data, root }, |d| match d {
            Delivered::Bytes(b) => Some(b),
            _ => None,
        })
        .await
    }

    async fn all_reduce_f32(&mut self, data: Vec<f32>, o: ReduceOp) -> Answer<Vec<f32>> {
        let call = Call::AllReduce {
            values: Values::F32(data),
            op: op(o),
        };
        self.collective(call, |d| match d {
            Delivered::Values(Values::F32(v)) => Some(v),
            _ => None,
        })
        .await
    }

    async fn all_reduce_f64(&mut self, data: Vec<f64>, o: ReduceOp) -> Answer<Vec<f64>> {
        let call = Call::AllReduce {
            values: Values::F64(data),
            op: op(o),
        };
        self.collective(call, |d| match d {
            Delivered::Values(Values::F64(v)) => Some(v),
            _ => None,
        })
        .await
    }

    async fn all_reduce_s64(&mut self, data: Vec<i64>, o: ReduceOp) -> Answer<Vec<i64>> {
        let call = Call::AllReduce {
            values: Values::S64(data),
            op: op(o),
        };
        self.collective(call, |d| match d {
            Delivered::Values(Values::S64(v)) => Some(v),
            _ => None,
        })
        .await
    }

    async fn all_gather(&mut self, data: Vec<u8>) -> Answer<Vec<Vec<u8>>> {
        self.collective(Call::AllGather { data }, |d| match d {
            Delivered::Pieces(p) => Some(p),
            _ => None,
        })
        .await
    }
}
