//! The `collective-bits` imports, written by hand: generated bindings lift
//! every list into a host vector, and these lend the guest's list to the
//! exchange where it lies (`collective::Lent`, R33). The call is the
//! `collective` interface's f32 all-reduce in every other way.

use std::sync::Arc;

use wasmtime::StoreContextMut;
use wasmtime::component::{Linker, WasmList};

use super::bindings::trainhost::train::collective::{CollectiveError, ReduceOp};
use super::collective::op;
use super::rank::RankState;
use crate::collective::{Call, Delivered, Lent, Values};

/// The interface's name at this host's version of the package; wasmtime
/// links a guest that imports it at an earlier 0.1.x version (0.1.8 on)
/// to it too.
fn interface() -> String {
    let version = super::wit_package().rsplit_once('@').map_or("", |(_, v)| v);
    format!("trainhost:train/collective-bits@{version}")
}

type Answer = wasmtime::Result<(Result<Arc<Vec<f32>>, CollectiveError>,)>;

/// Define the interface's functions in `linker`.
pub(super) fn add_to_linker(linker: &mut Linker<RankState>) -> wasmtime::Result<()> {
    linker.instance(&interface())?.func_wrap_async(
        "all-reduce-f32",
        |store: StoreContextMut<'_, RankState>, (bits, o): (WasmList<u32>, ReduceOp)| {
            Box::new(all_reduce_f32(store, bits, o))
        },
    )
}

/// `collective-bits.all-reduce-f32`: the values lent while the call waits,
/// and the result lowered from the buffer the lending ranks share.
async fn all_reduce_f32(
    mut store: StoreContextMut<'_, RankState>,
    bits: WasmList<u32>,
    o: ReduceOp,
) -> Answer {
    let bits = bits.as_le_slice(&store);
    // SAFETY: f32 and u32 have the same size and alignment, and every bit
    // pattern is an f32.
    let values = unsafe { std::slice::from_raw_parts(bits.as_ptr().cast::<f32>(), bits.len()) };
    // SAFETY: the guest's memory stays where it is and unwritten while the
    // guest waits in this call: its store is borrowed by this call, which
    // drops `lending` before it returns (or when it is dropped itself).
    let (lent, lending) = unsafe { Lent::new(values) };
    let call = Call::AllReduce {
        values: Values::F32Lent(lent),
        op: op(o),
    };
    let result = store
        .data_mut()
        .collective(call, |d| match d {
            Delivered::Shared(result) => Some(result),
            // Combined across nodes, in a buffer of its own.
            Delivered::Values(Values::F32(result)) => Some(Arc::new(result)),
            _ => None,
        })
        .await;
    drop(lending);
    Ok((result?,))
}
