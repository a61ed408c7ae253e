//! A bounded in-memory history of each GPU's used memory: the page's
//! sparklines and `/api/v1/history`.
//!
//! One point per GPU per second of wall time, the largest `used` of every
//! snapshot published in that second (fast memory samples included, so a
//! spike between two full samples shows, as with the peaks). At most
//! [`HISTORY_SECONDS`] points per GPU (10 minutes): 600 × 16 bytes, under
//! 10 KiB per GPU, whatever the sample intervals. A GPU that does not
//! answer adds no point (a gap, never a fake 0).
//!
//! Fed by [`crate::publish::Shared::publish`]: the history is of what was
//! published, so it does not depend on who reads it or how often.

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::model::Snapshot;

/// Points kept per GPU: 10 minutes at one point per second.
pub(crate) const HISTORY_SECONDS: usize = 600;

/// The largest `used` bytes of one GPU in one second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Point {
    /// Unix time in seconds (the second the samples fell in).
    pub t: u64,
    pub used: u64,
}

/// The points of one GPU, oldest first.
#[derive(Debug, Default)]
struct Ring {
    /// The UUID of the GPU the points are of: a different GPU at this
    /// index (NVML re-opened, the layout changed) starts afresh.
    uuid: String,
    points: VecDeque<Point>,
}

/// Per GPU (by position in the snapshot), the last [`HISTORY_SECONDS`].
#[derive(Debug, Default)]
pub struct History {
    gpus: Vec<Ring>,
}

impl History {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add the memory figures of `s`.
    pub fn record(&mut self, s: &Snapshot) {
        let second = unix_seconds(s.taken_at);
        self.gpus.truncate(s.devices.len());
        self.gpus.resize_with(s.devices.len(), Ring::default);
        for (ring, d) in self.gpus.iter_mut().zip(&s.devices) {
            if d.info.is_known() && ring.uuid != d.info.uuid {
                ring.uuid.clone_from(&d.info.uuid);
                ring.points.clear();
            }
            let Some(m) = d.memory else { continue };
            match ring.points.back_mut() {
                Some(last) if last.t == second => last.used = last.used.max(m.used),
                // The clock went back: keep the points in order.
                Some(last) if last.t > second => {
                    ring.points.clear();
                    ring.points.push_back(Point {
                        t: second,
                        used: m.used,
                    });
                }
                _ => ring.points.push_back(Point {
                    t: second,
                    used: m.used,
                }),
            }
            let oldest = second.saturating_sub(HISTORY_SECONDS as u64 - 1);
            while ring.points.len() > HISTORY_SECONDS
                || ring.points.front().is_some_and(|p| p.t < oldest)
            {
                ring.points.pop_front();
            }
        }
    }

    /// The points of GPU `index` in `(until - seconds, until]`, oldest first.
    pub fn points(&self, index: usize, until: u64, seconds: u64) -> Vec<Point> {
        let from = until.saturating_sub(seconds);
        self.gpus
            .get(index)
            .map(|r| {
                r.points
                    .iter()
                    .filter(|p| p.t > from && p.t <= until)
                    .copied()
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// Unix time in whole seconds (0 before 1970).
pub(crate) fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::model::{DeviceInfo, DeviceSample, MemoryInfo};

    fn snap(at_ms: u64, used: &[Option<u64>]) -> Snapshot {
        let mut s = Snapshot::empty(UNIX_EPOCH + Duration::from_millis(at_ms));
        s.devices = used
            .iter()
            .enumerate()
            .map(|(i, u)| DeviceSample {
                info: Arc::new(DeviceInfo {
                    uuid: format!("GPU-{i}"),
                    ..DeviceInfo::unknown(i)
                }),
                memory: u.map(|used| MemoryInfo {
                    total: 1 << 40,
                    reserved: 0,
                    used,
                    free: (1 << 40) - used,
                }),
                used_peak_bytes: None,
                processes: Arc::new([]),
                other: None,
                mig: Arc::new([]),
                readings: Default::default(),
            })
            .collect();
        s
    }

    #[test]
    fn one_point_per_second_the_largest() {
        let mut h = History::new();
        for (ms, u) in [(1_000, 5), (1_100, 9), (1_900, 7), (2_000, 3)] {
            h.record(&snap(ms, &[Some(u), None]));
        }
        let p = h.points(0, 2, 600);
        assert_eq!(p, vec![Point { t: 1, used: 9 }, Point { t: 2, used: 3 }]);
        assert!(h.points(1, 2, 600).is_empty(), "a GPU that never answered");
        assert!(h.points(7, 2, 600).is_empty(), "no such GPU");
        assert_eq!(h.points(0, 2, 1), vec![Point { t: 2, used: 3 }]);
        assert_eq!(h.points(0, 1, 600), vec![Point { t: 1, used: 9 }]);
    }

    #[test]
    fn bounded_to_ten_minutes() {
        let mut h = History::new();
        for s in 0..2_000u64 {
            h.record(&snap(s * 1000, &[Some(s)]));
        }
        let p = h.points(0, 1_999, u64::MAX);
        assert_eq!(p.len(), HISTORY_SECONDS);
        assert_eq!(p.first().map(|p| p.t), Some(1_400));
        assert_eq!(h.gpus[0].points.len(), HISTORY_SECONDS);
        // Old points leave by time too, not only by count.
        h.record(&snap(5_000_000, &[Some(1)]));
        assert_eq!(h.gpus[0].points.len(), 1);
    }

    #[test]
    fn another_gpu_or_a_clock_step_back_starts_afresh() {
        let mut h = History::new();
        h.record(&snap(10_000, &[Some(1), Some(2)]));
        h.record(&snap(11_000, &[Some(1)]));
        assert_eq!(h.gpus.len(), 1);
        let mut other = snap(12_000, &[Some(4)]);
        other.devices[0].info = Arc::new(DeviceInfo {
            uuid: "GPU-other".into(),
            ..DeviceInfo::unknown(0)
        });
        h.record(&other);
        assert_eq!(h.points(0, 12, 600), vec![Point { t: 12, used: 4 }]);
        h.record(&snap(5_000, &[Some(6)]));
        assert_eq!(h.points(0, 12, 600), vec![Point { t: 5, used: 6 }]);
    }
}
