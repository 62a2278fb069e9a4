//! The UCI handwritten digits (`data/digits.csv`, see its README), built
//! into the guest: 1797 images of 8×8 pixels, split once into training and
//! validation sets with a fixed seed.

/// Pixels per image.
pub const PIXELS: usize = 64;
/// Digits 0–9.
pub const CLASSES: usize = 10;

const CSV: &str = include_str!("../data/digits.csv");

/// Images scaled to [0, 1], and their labels.
#[derive(Debug)]
pub struct Set {
    pub images: Vec<[f32; PIXELS]>,
    pub labels: Vec<u8>,
}

impl Set {
    pub fn len(&self) -> usize {
        self.labels.len()
    }
}

/// The training and validation sets: `validation` of every 1000 images are
/// held out, chosen by `seed`.
pub fn load(seed: u64, validation_per_mille: usize) -> Result<(Set, Set), String> {
    let mut rows = Vec::with_capacity(1797);
    for (n, line) in CSV.lines().enumerate() {
        let values: Vec<u8> = line
            .split(',')
            .map(|v| v.trim().parse::<u8>())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("digits.csv line {}: {e}", n + 1))?;
        if values.len() != PIXELS + 1 || values[PIXELS] as usize >= CLASSES {
            return Err(format!(
                "digits.csv line {}: not 64 pixels and a digit",
                n + 1
            ));
        }
        let mut image = [0.0; PIXELS];
        for (p, v) in image.iter_mut().zip(&values) {
            *p = f32::from(*v) / 16.0;
        }
        rows.push((image, values[PIXELS]));
    }
    let order = permutation(rows.len(), seed);
    let held_out = rows.len() * validation_per_mille / 1000;
    let mut train = Set {
        images: Vec::new(),
        labels: Vec::new(),
    };
    let mut validation = Set {
        images: Vec::new(),
        labels: Vec::new(),
    };
    for (k, i) in order.into_iter().enumerate() {
        let set = if k < held_out {
            &mut validation
        } else {
            &mut train
        };
        set.images.push(rows[i].0);
        set.labels.push(rows[i].1);
    }
    Ok((train, validation))
}

/// A permutation of `0..n` from `seed` (Fisher–Yates on xorshift): the same
/// on every rank and in every run.
pub fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = Rng::new(seed);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (rng.next() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// xorshift64*: small, seedable, the same everywhere.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1).
    pub fn symmetric(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}
