//! The collectives on host tensors (`tensors.all-reduce`,
//! `all-reduce-list`, `broadcast`): the values go from the tensors to the
//! attempt's exchange and back without crossing into the guest, matched
//! with the list collectives of `collective.rs` (an all-reduce of a tensor
//! is an all-reduce of as many f32).

use wasmtime::component::Resource;

use super::bindings::trainhost::train::collective::{CollectiveError, ReduceOp};
use super::rank::RankState;
use super::tensors::Few;
use crate::collective::{self, Call, Delivered, Values};
use crate::tensor::Tensor;

type Answer = wasmtime::Result<Result<(), CollectiveError>>;

impl RankState {
    /// One all-reduce of the values of `ts`, one after the other. One
    /// tensor's values are moved to the exchange and come back combined in
    /// the same buffer (R33); several are gathered into one buffer first,
    /// and the combined values copied back into the tensors' own buffers
    /// (no allocation per tensor and call). With one rank they stay where
    /// they are ([`Self::all_reduce_alone`]). On an error every tensor
    /// holds zeros.
    pub(super) async fn all_reduce_tensors(
        &mut self,
        ts: &[Resource<Tensor>],
        o: ReduceOp,
    ) -> Answer {
        let mut reps: Few<u32> = ts.iter().map(Resource::rep).collect();
        reps.sort_unstable();
        if reps.windows(2).any(|w| w[0] == w[1]) {
            // Its values would be taken twice; refusing it on this rank
            // alone would leave the others waiting in the call, so the
            // rank stops and the run fails.
            return Err(wasmtime::Error::msg(
                "tensors.all-reduce-list: the same tensor is in the list twice; list each tensor once",
            ));
        }
        if self.info.world_size == 1 {
            return self.all_reduce_alone(ts, o).await;
        }
        let values = match ts {
            [one] => self.table.get_mut(one)?.take_values(),
            _ => {
                let mut all = Vec::with_capacity(self.value_count(ts)?);
                for t in ts {
                    all.extend_from_slice(self.table.get(t)?.values());
                }
                all
            }
        };
        let call = Call::AllReduce {
            values: Values::F32(values),
            op: super::collective::op(o),
        };
        let answer = self
            .collective(call, |d| match d {
                Delivered::Values(Values::F32(v)) => Some(v),
                _ => None,
            })
            .await;
        match answer {
            Ok(Ok(combined)) => {
                if let [one] = ts {
                    self.table.get_mut(one)?.put_values(combined)?;
                } else {
                    let mut rest = &combined[..];
                    for t in ts {
                        let tensor = self.table.get_mut(t)?;
                        let n = tensor.value_count();
                        tensor.assign(&rest[..n])?;
                        rest = &rest[n..];
                    }
                }
                Ok(Ok(()))
            }
            other => {
                self.zero(ts)?;
                other.map(|r| r.map(drop))
            }
        }
    }

    /// [`Self::all_reduce_tensors`] in a run of one rank. The values are
    /// their own result (R29) and stay in their tensors: nothing is gathered
    /// or copied back, as MPI does nothing for a communicator of one. The
    /// round is still made, without values, so that a stopping run aborts
    /// the call (R31); the result's size is then checked as the round
    /// checks it with values (R32), which only more than 4 GiB of tensors
    /// can fail (tensors count against the memory limit).
    async fn all_reduce_alone(&mut self, ts: &[Resource<Tensor>], o: ReduceOp) -> Answer {
        let op = super::collective::op(o);
        let call = Call::AllReduce {
            values: Values::F32(Vec::new()),
            op,
        };
        let mut answer = self
            .collective(call, |d| matches!(d, Delivered::Values(_)).then_some(()))
            .await;
        if let Ok(Ok(())) = answer {
            let count = self.value_count(ts)?;
            let call = collective::all_reduce_text(op, count, "f32");
            let bytes = count as u64 * 4;
            if let Some(message) =
                collective::too_large(&call, bytes, self.shared.limits.max_memory)
            {
                answer = Ok(Err(CollectiveError::Invalid(message)));
            }
        }
        if !matches!(answer, Ok(Ok(()))) {
            self.zero(ts)?;
        }
        answer
    }

    /// How many values the tensors `ts` hold together.
    fn value_count(&self, ts: &[Resource<Tensor>]) -> wasmtime::Result<usize> {
        ts.iter()
            .map(|t| Ok(self.table.get(t)?.value_count()))
            .sum()
    }

    /// Every tensor of a failed all-reduce holds zeros.
    fn zero(&mut self, ts: &[Resource<Tensor>]) -> wasmtime::Result<()> {
        for t in ts {
            self.table.get_mut(t)?.refill_zeros();
        }
        Ok(())
    }

    /// Replace the values of `t` with those of rank `root`'s tensor. Only
    /// the root sends its values; a rank whose tensor is not of their
    /// size stops, failing the run (the others have taken the values).
    pub(super) async fn broadcast_tensor(&mut self, t: &Resource<Tensor>, root: u32) -> Answer {
        let data = if self.info.world_rank == root {
            let values = self.table.get(t)?.values();
            values.iter().flat_map(|v| v.to_le_bytes()).collect()
        } else {
            Vec::new()
        };
        let answer = self
            .collective(Call::Broadcast { data, root }, |d| match d {
                Delivered::Bytes(b) => Some(b),
                _ => None,
            })
            .await;
        let bytes = match answer {
            Ok(Ok(bytes)) => bytes,
            other => return other.map(|r| r.map(drop)),
        };
        if self.info.world_rank == root {
            return Ok(Ok(()));
        }
        let tensor = self.table.get_mut(t)?;
        if bytes.len() as u64 != tensor.bytes() {
            self.told_to_stop = true;
            return Err(wasmtime::Error::msg(format!(
                "tensors.broadcast: rank {root} sent {} values, but this rank's tensor of shape {:?} holds {}; broadcast into a tensor of the root's size on every rank",
                bytes.len() / 4,
                tensor.shape(),
                tensor.bytes() / 4
            )));
        }
        let values = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        tensor.put_values(values)?;
        Ok(Ok(()))
    }
}
