//! Rate-limited warnings of the pod watcher, so a flapping API server or a
//! stream of bad lines does not flood the log.

use std::collections::HashMap;
use std::fmt::Display;
use std::time::{Duration, Instant};

/// A repeated warning of the same kind is logged at most this often.
const WARN_INTERVAL: Duration = Duration::from_secs(60);

/// Logs each kind of warning at most once per [`WARN_INTERVAL`], with the
/// number suppressed in between, so a flapping API server or a stream of
/// bad lines does not flood the log.
#[derive(Debug, Default)]
pub(super) struct Warnings {
    last: HashMap<&'static str, (Instant, u64)>,
}

impl Warnings {
    pub(super) fn warn(&mut self, kind: &'static str, e: &dyn Display) {
        let now = Instant::now();
        match self.last.get_mut(kind) {
            Some((at, suppressed)) if now.duration_since(*at) < WARN_INTERVAL => {
                *suppressed += 1;
            }
            slot => {
                let suppressed = slot.map_or(0, |(_, n)| *n);
                tracing::warn!(kind, error = %e, suppressed, "kubernetes pod watcher");
                self.last.insert(kind, (now, 0));
            }
        }
    }
}
