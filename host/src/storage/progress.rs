//! Progress of checkpoint transfers on a terminal: one bar per checkpoint
//! uploaded or restored, with bytes, rate and time left.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Transfers smaller than this finish before a bar would be readable.
const MIN_BYTES: u64 = 16 * 1024 * 1024;

/// Counts the bytes of one transfer; draws a bar when enabled, large
/// enough, and stderr is a terminal. Cheap to clone and to count into.
#[derive(Clone, Debug, Default)]
pub(crate) struct Meter(Option<ProgressBar>);

impl Meter {
    /// A meter for `total` bytes described by `what` ("↑ checkpoint_000003").
    pub fn start(enabled: bool, total: u64, what: String) -> Self {
        if !enabled || total < MIN_BYTES {
            return Self(None);
        }
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        if bar.is_hidden() {
            return Self(None);
        }
        bar.set_style(
            ProgressStyle::with_template(
                "{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
            )
            .expect("the template is valid")
            .progress_chars("=> "),
        );
        bar.set_message(what);
        bar.enable_steady_tick(Duration::from_millis(200));
        Self(Some(bar))
    }

    /// Count `n` more bytes.
    pub fn inc(&self, n: u64) {
        if let Some(bar) = &self.0 {
            bar.inc(n);
        }
    }

    /// Count `n` bytes fewer: they will be sent again (an upload started
    /// over).
    pub fn dec(&self, n: u64) {
        if let Some(bar) = &self.0 {
            bar.dec(n);
        }
    }

    /// Remove the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.0 {
            bar.finish_and_clear();
        }
    }
}
