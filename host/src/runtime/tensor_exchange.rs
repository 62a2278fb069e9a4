//! The collectives on host tensors (`tensors.all-reduce`,
//! `all-reduce-list`, `broadcast`): the values go from the tensors to the
//! attempt's exchange and back without crossing into the guest, matched
//! with the list collectives of `collective.rs` (an all-reduce of a tensor
//! is an all-reduce of as many f32).

use wasmtime::component::Resource;

use super::bindings::trainhost::train::collective::CollectiveError;
use super::kernel_calls::Few;
use super::rank::RankState;
use crate::collective::{self, Call, Delivered, Op, Values};
use crate::tensor::Tensor;

type Answer = wasmtime::Result<Result<(), CollectiveError>>;

/// The result of an all-reduce of tensors.
enum Combined {
    /// Their own buffers, combined in place.
    Each(Vec<Vec<f32>>),
    /// One buffer of all their values: one tensor's own, or a result
    /// combined across nodes.
    Joined(Vec<f32>),
}

impl RankState {
    /// One all-reduce of the values of `ts`, one after the other. The
    /// tensors' buffers are moved to the exchange, combined where they are
    /// and moved back (R33): nothing is gathered or copied back. With one
    /// rank they are not moved at all ([`Self::all_reduce_alone`]). An
    /// all-reduce combined across nodes comes back in one buffer, which is
    /// copied into the tensors. On an error every tensor holds zeros.
    pub(super) async fn all_reduce_tensors(&mut self, ts: &[Resource<Tensor>], op: Op) -> Answer {
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
            return self.all_reduce_alone(ts, op);
        }
        let values = match ts {
            [one] => Values::F32(self.table.get_mut(one)?.take_values()),
            _ => Values::F32Parts(
                ts.iter()
                    .map(|t| Ok(self.table.get_mut(t)?.take_values()))
                    .collect::<wasmtime::Result<_>>()?,
            ),
        };
        let call = Call::AllReduce { values, op };
        let answer = self
            .collective(call, |d| match d {
                Delivered::Values(Values::F32Parts(parts)) => Some(Combined::Each(parts)),
                Delivered::Values(Values::F32(joined)) => Some(Combined::Joined(joined)),
                _ => None,
            })
            .await;
        match answer {
            Ok(Ok(combined)) => {
                self.put_combined(ts, combined)?;
                Ok(Ok(()))
            }
            other => {
                self.zero(ts)?;
                other.map(|r| r.map(drop))
            }
        }
    }

    /// [`Self::all_reduce_tensors`] in a run of one rank. The values are
    /// their own result (R29) and stay in their tensors untouched, and no
    /// round is made ([`Self::collective_alone`]), as MPI does nothing for
    /// a communicator of one: a round cost the digits example's step about
    /// 0.35 µs, and moving the buffers to it and back 0.2 µs more. The
    /// result's size is checked as a round checks it (R32), which only
    /// more than 4 GiB of tensors can fail (tensors count against the
    /// memory limit).
    fn all_reduce_alone(&mut self, ts: &[Resource<Tensor>], op: Op) -> Answer {
        let mut answer = self.collective_alone();
        if let Ok(Ok(())) = answer {
            let count = ts
                .iter()
                .map(|t| Ok(self.table.get(t)?.value_count()))
                .sum::<wasmtime::Result<usize>>()?;
            let like = Values::F32(Vec::new());
            let max_memory = self.shared.limits.max_memory;
            if let Some(message) = collective::all_reduce_too_large(op, count, &like, max_memory) {
                answer = Ok(Err(CollectiveError::Invalid(message)));
            }
        }
        if !matches!(answer, Ok(Ok(()))) {
            self.zero(ts)?;
        }
        answer
    }

    /// Give `ts` the result of their all-reduce.
    fn put_combined(
        &mut self,
        ts: &[Resource<Tensor>],
        combined: Combined,
    ) -> wasmtime::Result<()> {
        match combined {
            Combined::Each(parts) => {
                for (t, part) in ts.iter().zip(parts) {
                    self.table.get_mut(t)?.put_values(part)?;
                }
            }
            Combined::Joined(joined) => match ts {
                [one] => self.table.get_mut(one)?.put_values(joined)?,
                _ => {
                    // The tensors gave their buffers up for the call.
                    let mut rest = &joined[..];
                    for t in ts {
                        let tensor = self.table.get_mut(t)?;
                        let (mine, after) = rest.split_at(tensor.value_count().min(rest.len()));
                        tensor.put_values(mine.to_vec())?;
                        rest = after;
                    }
                }
            },
        }
        Ok(())
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
