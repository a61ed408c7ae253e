//! Peak windows: the largest value over the last `peak_window`.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Sliding-window maximum: a deque of (time, value) with decreasing values,
/// so push and query are amortised O(1) and memory stays bounded by the
/// number of samples in the window.
#[derive(Debug, Default, Clone)]
pub(crate) struct WindowMax {
    q: VecDeque<(Instant, u64)>,
}

impl WindowMax {
    pub(crate) fn push(&mut self, at: Instant, v: u64, window: Duration) {
        while self.q.back().is_some_and(|(_, b)| *b <= v) {
            self.q.pop_back();
        }
        self.q.push_back((at, v));
        self.expire(at, window);
    }

    pub(crate) fn expire(&mut self, now: Instant, window: Duration) {
        while self
            .q
            .front()
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) > window)
        {
            self.q.pop_front();
        }
    }

    pub(crate) fn max(&self) -> Option<u64> {
        self.q.front().map(|(_, v)| *v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_max_slides() {
        let t0 = Instant::now();
        let w = Duration::from_secs(10);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut m = WindowMax::default();
        assert_eq!(m.max(), None);
        m.push(at(0), 5, w);
        m.push(at(1), 9, w);
        m.push(at(2), 3, w);
        assert_eq!(m.max(), Some(9));
        m.push(at(11), 4, w); // 9 (t=1) is exactly 10 s old: still in
        assert_eq!(m.max(), Some(9));
        m.push(at(12), 2, w); // 9 left the window; 4 (t=11) is the max
        assert_eq!(m.max(), Some(4));
        m.expire(at(30), w);
        assert_eq!(m.max(), None);
        assert!(m.q.len() <= 2);
    }

    #[test]
    fn window_stays_small_for_rising_and_falling_series() {
        let t0 = Instant::now();
        let w = Duration::from_secs(1);
        let mut m = WindowMax::default();
        for i in 0..10_000u64 {
            m.push(t0 + Duration::from_millis(i), i % 100, w);
        }
        assert!(m.q.len() <= 1001, "{}", m.q.len());
        assert_eq!(m.max(), Some(99));
    }
}
