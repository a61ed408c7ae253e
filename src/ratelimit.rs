//! The one rate limit for log lines: a condition that can repeat every tick
//! or every request (a flapping API server, a socket we may not use, a
//! process whose fds we cannot read) is logged once per key, or at most
//! every so often, with the number of occurrences left out in between.
//!
//! The pod watcher warns at most once a minute per kind of error; the
//! pod-resources client once a minute, then backing off to once an hour
//! while `List` keeps failing; the HTTP accept loop at most every 10 s; the
//! torch bridge and the /proc lookups once. Written by hand: it is a map
//! and two durations, and a token-bucket crate (`governor`) answers "may
//! this pass", not "how many were left out since the last line" nor "wait
//! longer each time", which these warnings report and do.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// Decides, per key, whether an occurrence is logged. `K` is what makes two
/// occurrences "the same" (a kind of error, a reason, `()` for one
/// condition).
#[derive(Debug)]
pub(crate) struct LogLimiter<K> {
    policy: Policy,
    keys: HashMap<K, Slot>,
}

#[derive(Debug, Clone, Copy)]
enum Policy {
    /// Logged the first time only.
    Once,
    /// Logged at once, then after `min`, doubling each time up to `max`.
    Every { min: Duration, max: Duration },
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    /// When it was last logged; `None` after [`LogLimiter::reset`].
    logged: Option<Instant>,
    /// The wait before the next line.
    wait: Duration,
    /// Occurrences not logged since the last line.
    suppressed: u64,
}

impl<K: Hash + Eq> LogLimiter<K> {
    /// Each key is logged the first time it occurs, never again.
    pub(crate) fn once() -> Self {
        Self::with(Policy::Once)
    }

    /// Each key is logged at most once per `interval`.
    pub(crate) fn every(interval: Duration) -> Self {
        Self::backing_off(interval, interval)
    }

    /// Each key is logged at once, then after `min`, and each following
    /// wait is twice the last, up to `max`, until [`LogLimiter::reset`].
    pub(crate) fn backing_off(min: Duration, max: Duration) -> Self {
        Self::with(Policy::Every { min, max })
    }

    fn with(policy: Policy) -> Self {
        LogLimiter {
            policy,
            keys: HashMap::new(),
        }
    }

    /// An occurrence of `key` now: `Some(suppressed)` when it is to be
    /// logged (with the occurrences not logged since the last line),
    /// `None` when it is left out.
    pub(crate) fn check(&mut self, key: K) -> Option<u64> {
        self.check_at(key, Instant::now())
    }

    /// [`LogLimiter::check`] at `now` (tests pass their own clock).
    pub(crate) fn check_at(&mut self, key: K, now: Instant) -> Option<u64> {
        let first_wait = match self.policy {
            Policy::Once => Duration::ZERO,
            Policy::Every { min, .. } => min,
        };
        let slot = self.keys.entry(key).or_insert(Slot {
            logged: None,
            wait: first_wait,
            suppressed: 0,
        });
        let due = match (slot.logged, self.policy) {
            (None, _) => true,
            (Some(_), Policy::Once) => false,
            (Some(at), Policy::Every { max, .. }) => {
                let due = now.saturating_duration_since(at) >= slot.wait;
                if due {
                    slot.wait = (slot.wait * 2).min(max);
                }
                due
            }
        };
        if !due {
            slot.suppressed += 1;
            return None;
        }
        slot.logged = Some(now);
        Some(std::mem::take(&mut slot.suppressed))
    }

    /// The condition of `key` cleared (the call succeeded again): its next
    /// occurrence is logged at once and the backoff starts over. Occurrences
    /// not logged yet are still reported with that line.
    pub(crate) fn reset(&mut self, key: &K) {
        let min = match self.policy {
            Policy::Once => return,
            Policy::Every { min, .. } => min,
        };
        if let Some(slot) = self.keys.get_mut(key) {
            slot.logged = None;
            slot.wait = min;
        }
    }

    /// Every key starts afresh (a re-opened library may answer otherwise),
    /// suppressed counts included.
    pub(crate) fn clear(&mut self) {
        self.keys.clear();
    }

    /// Keys seen since the start or the last [`LogLimiter::clear`].
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Occurrences of a key at these seconds → whether each is logged, and
    /// with how many left out before it.
    fn check<K: Hash + Eq + Copy + std::fmt::Debug>(
        mut limiter: LogLimiter<K>,
        steps: &[(u64, K, Option<u64>)],
    ) {
        let t0 = Instant::now();
        for &(at, key, want) in steps {
            let got = limiter.check_at(key, t0 + Duration::from_secs(at));
            assert_eq!(got, want, "{key:?} at {at} s");
        }
    }

    #[test]
    fn once_per_key() {
        check(
            LogLimiter::once(),
            &[
                (0, "malformed", Some(0)),
                (0, "malformed", None),
                (1, "oversized", Some(0)),
                (3600, "malformed", None),
                (7200, "oversized", None),
            ],
        );
    }

    /// The pod watcher's warnings: once a minute per kind, with the count
    /// left out in between.
    #[test]
    fn every_interval_per_key() {
        check(
            LogLimiter::every(Duration::from_secs(60)),
            &[
                (0, "list", Some(0)),
                (1, "list", None),
                (2, "watch", Some(0)),
                (59, "list", None),
                (60, "list", Some(2)),
                (61, "watch", None),
                (119, "list", None),
                (120, "list", Some(1)),
                (180, "list", Some(0)),
                (500, "watch", Some(1)),
            ],
        );
    }

    /// The pod-resources client: at once, then 1 min, 2 min, 4 min … up
    /// to the hour.
    #[test]
    fn backing_off_doubles_to_max() {
        let mut steps = vec![(0, (), Some(0)), (30, (), None), (59, (), None)];
        let mut at = 0;
        for wait in [60, 120, 240, 480, 960, 1920, 3600, 3600] {
            at += wait;
            steps.push((at - 1, (), None));
            steps.push((at, (), Some(1)));
        }
        steps[4].2 = Some(3);
        check(
            LogLimiter::backing_off(Duration::from_secs(60), Duration::from_secs(3600)),
            &steps,
        );
    }

    /// A success in between: the next failure is logged at once, with the
    /// ones left out before it, and the waits start from the minimum again.
    #[test]
    fn reset_starts_over() {
        let mut l = LogLimiter::backing_off(Duration::from_secs(60), Duration::from_secs(3600));
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        assert_eq!(l.check_at((), at(0)), Some(0));
        assert_eq!(l.check_at((), at(60)), Some(0));
        assert_eq!(l.check_at((), at(70)), None, "now waits 120 s");
        l.reset(&());
        assert_eq!(l.check_at((), at(80)), Some(1));
        assert_eq!(l.check_at((), at(139)), None);
        assert_eq!(l.check_at((), at(140)), Some(1), "60 s again");
        let mut once = LogLimiter::once();
        assert_eq!(once.check_at(1, at(0)), Some(0));
        once.reset(&1);
        assert_eq!(once.check_at(1, at(1)), None, "once is once");
        assert_eq!(once.check_at(2, at(1)), Some(0));
        assert_eq!(once.len(), 2);
        once.clear();
        assert_eq!(once.len(), 0);
        assert_eq!(once.check_at(1, at(2)), Some(0), "cleared: logged again");
    }

    /// A clock that goes backwards (an injected one) leaves the line out
    /// rather than panicking.
    #[test]
    fn earlier_instant_is_not_due() {
        let mut l = LogLimiter::every(Duration::from_secs(10));
        let t0 = Instant::now() + Duration::from_secs(100);
        assert_eq!(l.check_at((), t0), Some(0));
        assert_eq!(l.check_at((), t0 - Duration::from_secs(50)), None);
    }
}
