//! The one exponential backoff: NVML (re)initialisation waits 1 s, 2 s, 4 s
//! … 30 s; the pod watcher adds jitter so the exporters of a cluster do not
//! reconnect to the API server in step.
//!
//! Written by hand: it is twenty lines, and the crates that offer it
//! (`backoff`, `backon`) bring an async runtime integration we do not need.

use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Exponential backoff from `min` to `max`, doubling at each step; with
/// [`Backoff::jittered`] each delay is uniform in `[d/2, d]` ("equal
/// jitter").
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
    jitter: bool,
}

impl Backoff {
    /// Delays `min`, `2·min`, `4·min` … capped at `max`.
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        Backoff {
            min,
            max,
            next: min,
            jitter: false,
        }
    }

    /// The same steps, each delay drawn uniformly from its upper half.
    pub(crate) fn jittered(min: Duration, max: Duration) -> Self {
        Backoff {
            jitter: true,
            ..Backoff::new(min, max)
        }
    }

    /// The wait before the next attempt.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).min(self.max);
        if !self.jitter {
            return d;
        }
        let half = d / 2;
        half + half.mul_f64(random_unit())
    }

    /// Back to `min` after a success.
    pub(crate) fn reset(&mut self) {
        self.next = self.min;
    }
}

/// A uniform number in [0, 1) from std's randomly seeded hasher: jitter
/// needs spread between exporters, not cryptographic quality.
fn random_unit() -> f64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        let steps: Vec<u64> = (0..7).map(|_| b.next_delay().as_secs()).collect();
        assert_eq!(steps, vec![1, 2, 4, 8, 16, 30, 30]);
        b.reset();
        assert_eq!(b.next_delay().as_secs(), 1);
    }

    #[test]
    fn jitter_stays_in_the_upper_half_and_resets() {
        let mut b = Backoff::jittered(Duration::from_millis(200), Duration::from_secs(30));
        let mut ceiling = Duration::from_millis(200);
        for _ in 0..12 {
            let d = b.next_delay();
            assert!(d >= ceiling / 2 && d <= ceiling, "{d:?} vs {ceiling:?}");
            ceiling = (ceiling * 2).min(Duration::from_secs(30));
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(200));
    }
}
