//! A small seeded generator for initial weights: the same values on every
//! host and in every run, whatever the platform.

/// SplitMix64: one multiply-xorshift chain per value, statistically sound
/// for initialisation and trivially the same everywhere.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Fill `out` with values uniform in `[low, high)`.
pub(super) fn fill_uniform(out: &mut [f32], low: f32, high: f32, seed: u64) {
    let mut rng = SplitMix(seed);
    if low >= high {
        out.fill(low);
        return;
    }
    let (width, top) = (high - low, high.next_down());
    for v in out {
        // 24 random bits: [0, 1) in steps of an f32's precision. Rounding
        // may land on `high` itself, which the range leaves out.
        let unit = (rng.next() >> 40) as f32 / (1u64 << 24) as f32;
        *v = (low + unit * width).min(top);
    }
}
