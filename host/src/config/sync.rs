//! Mirroring a local run directory with the user's own command (Ray
//! Tune's custom syncer): the settings, checked.

use std::time::Duration;

use crate::error::Error;

/// Mirror the run directory to a target with an external command (Ray
/// Tune's custom syncer).
///
/// ```
/// use std::time::Duration;
/// let sync = trainhost::SyncConfig {
///     command: "aws s3 sync {source} {target}".into(),
///     target: "s3://bucket/runs".into(),
///     period: Duration::from_secs(300),
/// };
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncConfig {
    /// The command, with `{source}` and `{target}` placeholders.
    pub command: String,
    /// Where runs are mirrored; the run's directory is `<target>/<run>`.
    pub target: String,
    /// At most one sync per period while the run goes on (default 5
    /// minutes); the run always syncs once more at the end.
    pub period: Duration,
}

/// The default [`SyncConfig::period`], as Ray Tune's.
pub const DEFAULT_SYNC_PERIOD: Duration = Duration::from_secs(300);

impl SyncConfig {
    /// Refuse commands without both placeholders, or with unknown ones.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        let bad = |m: String| {
            Err(Error::InvalidConfig(format!(
                "sync command {:?}: {m}",
                self.command
            )))
        };
        if self.target.is_empty() {
            return bad("the sync target is empty".into());
        }
        let mut rest = self.command.as_str();
        while let Some(open) = rest.find('{') {
            let after = &rest[open + 1..];
            let Some(close) = after.find('}') else {
                return bad("has a '{' without '}'".into());
            };
            let name = &after[..close];
            if name != "source" && name != "target" {
                return bad(format!(
                    "unknown placeholder {{{name}}}; use {{source}} and {{target}}"
                ));
            }
            rest = &after[close + 1..];
        }
        for needed in ["{source}", "{target}"] {
            if !self.command.contains(needed) {
                return bad(format!("needs the placeholder {needed}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
impl SyncConfig {
    /// `command` syncing to `/remote` (for tests).
    pub(crate) fn for_test(command: &str) -> Self {
        Self {
            command: command.into(),
            target: "/remote".into(),
            period: DEFAULT_SYNC_PERIOD,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(command: &str) -> SyncConfig {
        SyncConfig::for_test(command)
    }

    #[test]
    fn placeholders_are_checked() {
        assert!(config("aws s3 sync {source} {target}").validate().is_ok());
        for (bad, why) in [
            ("aws s3 sync {source}", "needs the placeholder {target}"),
            ("cp {src} {target}", "unknown placeholder {src}"),
            (
                "cp {source {target}",
                "unknown placeholder {source {target}",
            ),
            ("cp {source} {target", "'{' without '}'"),
        ] {
            let err = config(bad).validate().unwrap_err().to_string();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }
}
