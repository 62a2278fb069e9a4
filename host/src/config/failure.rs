//! How many failures a run survives (Ray's `FailureConfig`, R20).

use std::fmt;

use crate::error::Error;

/// How many failures a run survives (Ray's `FailureConfig`).
///
/// ```
/// use trainhost::{FailureConfig, MaxFailures};
/// // Restart every rank from the latest checkpoint up to 3 times.
/// let failures = FailureConfig { max_failures: MaxFailures::Limited(3) };
/// // Ray's -1, as the command line writes it:
/// let forever = FailureConfig { max_failures: "-1".parse()? };
/// assert_eq!(forever.max_failures, MaxFailures::Unlimited);
/// # let _ = failures;
/// # Ok::<(), trainhost::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FailureConfig {
    /// Default [`MaxFailures::Limited`]`(0)`: the first failure fails the
    /// run.
    pub max_failures: MaxFailures,
}

/// How many failures a run restarts after, over its whole life (resumed
/// runs included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxFailures {
    /// Restart all ranks from the latest committed checkpoint up to N
    /// times; the failure after that fails the run. `Limited(0)` (the
    /// default) fails the run at the first failure.
    Limited(u32),
    /// Restart after every failure (Ray's `max_failures=-1`).
    Unlimited,
}

impl Default for MaxFailures {
    fn default() -> Self {
        Self::Limited(0)
    }
}

impl MaxFailures {
    /// Whether a run that has failed `failures` times in all may restart.
    pub(crate) fn allows(self, failures: usize) -> bool {
        match self {
            Self::Limited(n) => failures <= n as usize,
            Self::Unlimited => true,
        }
    }
}

/// `N`, or `no limit`.
impl fmt::Display for MaxFailures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Limited(n) => write!(f, "{n}"),
            Self::Unlimited => f.write_str("no limit"),
        }
    }
}

/// Ray's spelling: `N >= 0`, or `-1` for no limit.
impl std::str::FromStr for MaxFailures {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let n: i64 = s.trim().parse().map_err(|_| {
            Error::InvalidConfig(format!(
                "max_failures {s:?} is not a whole number; use 0 to fail at once, N to survive N failures, or -1 for no limit"
            ))
        })?;
        match n {
            -1 => Ok(Self::Unlimited),
            n => u32::try_from(n).map(Self::Limited).map_err(|_| {
                Error::InvalidConfig(format!(
                    "max_failures is {n}; use 0 to fail at once, N to survive N failures, or -1 for no limit"
                ))
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rays_spelling_parses_and_out_of_range_values_are_named() {
        assert_eq!("-1".parse::<MaxFailures>().unwrap(), MaxFailures::Unlimited);
        assert_eq!("3".parse::<MaxFailures>().unwrap(), MaxFailures::Limited(3));
        let err = "-5".parse::<MaxFailures>().unwrap_err().to_string();
        assert!(err.contains("max_failures is -5"), "{err}");
        assert!("many".parse::<MaxFailures>().is_err());
    }

    #[test]
    fn a_limit_of_n_allows_n_restarts() {
        assert!(!MaxFailures::Limited(0).allows(1));
        assert!(MaxFailures::Limited(2).allows(2));
        assert!(!MaxFailures::Limited(2).allows(3));
        assert!(MaxFailures::Unlimited.allows(usize::MAX));
    }
}
