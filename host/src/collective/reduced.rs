//! The result of an all-reduce combined across nodes, as the ranks of
//! this node take it.

use std::sync::{Arc, Mutex};

use super::{Delivered, Values};

/// The result of an all-reduce combined across nodes, for the ranks of
/// this node. The ranks whose values were lent share it (they lower it
/// into their guests' memory); each other rank takes a copy of it but the
/// last, which takes the buffer itself (with one rank a node, the result
/// reaches it uncopied).
#[derive(Debug)]
pub(crate) struct Reduced(Mutex<Taking>);

#[derive(Debug)]
struct Taking {
    /// `None` once the last rank took it, or once it is shared.
    values: Option<Values>,
    /// The f32 result once a lending rank took it: `None` once the last
    /// rank did.
    shared: Option<Arc<Vec<f32>>>,
    /// The ranks still to take it.
    left: usize,
}

impl Reduced {
    /// `values` for `ranks` ranks.
    pub fn new(values: Values, ranks: usize) -> Self {
        Self(Mutex::new(Taking {
            values: Some(values),
            shared: None,
            left: ranks,
        }))
    }

    /// One rank's result: shared if it lent its values (`lent`), else a
    /// buffer of its own. The copies are made one at a time, under the
    /// lock: they share the memory bandwidth anyway.
    pub(super) fn take(&self, lent: bool) -> Delivered {
        let mut taking = self.0.lock().unwrap_or_else(|p| p.into_inner());
        taking.left = taking.left.saturating_sub(1);
        let last = taking.left == 0;
        if lent
            && matches!(taking.values, Some(Values::F32(_)))
            && let Some(Values::F32(result)) = taking.values.take()
        {
            taking.shared = Some(Arc::new(result));
        }
        if let Some(result) = &taking.shared {
            let result = if last {
                taking.shared.take().unwrap_or_default()
            } else {
                Arc::clone(result)
            };
            return match lent {
                true => Delivered::Shared(result),
                // A rank that brought a host tensor beside lending ones.
                false => Delivered::Values(Values::F32(
                    Arc::try_unwrap(result).unwrap_or_else(|shared| shared.to_vec()),
                )),
            };
        }
        let values = if last {
            taking.values.take()
        } else {
            taking.values.clone()
        };
        // Only as many ranks as it was made for take it.
        Delivered::Values(values.unwrap_or_else(|| Values::F32(Vec::new())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank of the node gets the result across nodes; the last one
    /// takes the very buffer.
    #[test]
    fn a_result_across_nodes_reaches_every_rank_and_the_last_uncopied() {
        let buffer = vec![1.5f32; 1000];
        let address = buffer.as_ptr();
        let reduced = Reduced::new(Values::F32(buffer), 3);
        let values = Values::F32(vec![1.5; 1000]);
        let owned = |d: Delivered| match d {
            Delivered::Values(v) => v,
            other => panic!("{other:?}"),
        };
        assert_eq!(owned(reduced.take(false)), values);
        assert_eq!(owned(reduced.take(false)), values);
        match owned(reduced.take(false)) {
            Values::F32(last) => {
                assert_eq!(last.as_ptr(), address, "moved, not copied");
                assert_eq!(last, vec![1.5; 1000]);
            }
            other => panic!("{other:?}"),
        }
    }

    /// Ranks that lent their values share the result uncopied; a rank
    /// beside them that did not gets a buffer of its own.
    #[test]
    fn ranks_that_lent_share_a_result_across_nodes() {
        let buffer = vec![2.5f32; 1000];
        let address = buffer.as_ptr();
        let reduced = Reduced::new(Values::F32(buffer), 3);
        let shared = |d: Delivered| match d {
            Delivered::Shared(v) => v,
            other => panic!("{other:?}"),
        };
        let first = shared(reduced.take(true));
        assert_eq!(first.as_ptr(), address, "shared, not copied");
        match reduced.take(false) {
            Delivered::Values(Values::F32(own)) => {
                assert_eq!(own, vec![2.5; 1000]);
                assert_ne!(own.as_ptr(), address, "a copy of its own");
            }
            other => panic!("{other:?}"),
        }
        let last = shared(reduced.take(true));
        assert!(Arc::ptr_eq(&first, &last));
        drop(first);
        // The last taker holds the only reference: freed once it lowered it.
        assert_eq!(Arc::strong_count(&last), 1);
    }
}
