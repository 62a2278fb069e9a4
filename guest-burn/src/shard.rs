//! One rank's share of a burn dataset.

use std::marker::PhantomData;

use burn::data::dataset::Dataset;

/// The items of a dataset that fall to one rank: rank `r` of `n` sees
/// items `r`, `r + n`, `r + 2n`, ... Together the ranks see every item
/// once; their shares differ in length by at most one.
///
/// Deal out a dataset already shuffled the same way on every rank (the
/// same seed), so that the shares change from epoch to epoch but never
/// overlap.
pub struct Shard<D, I> {
    inner: D,
    rank: usize,
    ranks: usize,
    item: PhantomData<fn() -> I>,
}

impl<D: Dataset<I>, I> Shard<D, I> {
    /// This rank's share of `dataset` (`trainhost_guest::world_rank()` of
    /// `world_size()`).
    pub fn of_this_rank(dataset: D) -> Self {
        Self::new(
            dataset,
            trainhost_guest::world_rank() as usize,
            trainhost_guest::world_size() as usize,
        )
    }

    /// Rank `rank`'s share of `dataset` among `ranks` ranks.
    ///
    /// # Panics
    /// If `rank` is not below `ranks`.
    pub fn new(dataset: D, rank: usize, ranks: usize) -> Self {
        assert!(rank < ranks, "rank {rank} of {ranks} ranks");
        Self {
            inner: dataset,
            rank,
            ranks,
            item: PhantomData,
        }
    }
}

impl<D, I> std::fmt::Debug for Shard<D, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard")
            .field("rank", &self.rank)
            .field("ranks", &self.ranks)
            .finish_non_exhaustive()
    }
}

impl<D: Dataset<I>, I> Dataset<I> for Shard<D, I> {
    fn get(&self, index: usize) -> Option<I> {
        let at = index.checked_mul(self.ranks)?.checked_add(self.rank)?;
        self.inner.get(at)
    }

    fn len(&self) -> usize {
        self.inner
            .len()
            .saturating_sub(self.rank)
            .div_ceil(self.ranks)
    }
}

#[cfg(test)]
mod tests {
    use burn::data::dataset::InMemDataset;

    use super::*;

    #[test]
    fn the_ranks_shares_cover_every_item_once() {
        for ranks in 1..5 {
            let mut seen = Vec::new();
            for rank in 0..ranks {
                let shard = Shard::new(
                    InMemDataset::new((0..10).collect::<Vec<u32>>()),
                    rank,
                    ranks,
                );
                let mine: Vec<u32> = (0..shard.len()).map(|i| shard.get(i).unwrap()).collect();
                assert!(shard.get(shard.len()).is_none());
                assert!(mine.len().abs_diff(10 / ranks) <= 1);
                seen.extend(mine);
            }
            seen.sort();
            assert_eq!(seen, (0..10).collect::<Vec<_>>(), "{ranks} ranks");
        }
    }
}
