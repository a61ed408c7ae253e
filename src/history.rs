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

use crate::model::{Forecast, Snapshot};
use crate::trend;

/// Points kept per GPU: 10 minutes at one point per second.
pub(crate) const HISTORY_SECONDS: usize = 600;
/// A forecast needs at least this many seconds of history ...
pub(crate) const FORECAST_MIN_SECONDS: u64 = 60;
/// ... with at least this many points in them (a GPU that answers).
pub(crate) const FORECAST_MIN_POINTS: usize = 30;
/// Forecasts further out than this are not made: a GPU that would fill in
/// days is not "growing" in any sense the page should shout about.
pub(crate) const FORECAST_MAX_SECONDS: f64 = 86_400.0;

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

    /// When GPU `index` would run out of memory, `free` bytes being left
    /// now (second `now`), at the rate of its history (the last 10
    /// minutes): the least-squares slope of used bytes over time.
    ///
    /// `None` unless it is growing: at least [`FORECAST_MIN_SECONDS`] of
    /// history with [`FORECAST_MIN_POINTS`] points, a slope above 0 over
    /// the whole window *and* over each of its halves (so a single step,
    /// a model loading and then staying flat, does not read as growth for
    /// the next 10 minutes), and full within [`FORECAST_MAX_SECONDS`].
    pub fn forecast(&self, index: usize, now: u64, free: u64) -> Option<Forecast> {
        let ring = self.gpus.get(index)?;
        let from = now.saturating_sub(HISTORY_SECONDS as u64);
        let points: Vec<(u64, u64)> = ring
            .points
            .iter()
            .filter(|p| p.t > from && p.t <= now)
            .map(|p| (p.t, p.used))
            .collect();
        let (first, last) = (points.first()?.0, points.last()?.0);
        let span = last - first;
        if span < FORECAST_MIN_SECONDS || points.len() < FORECAST_MIN_POINTS {
            return None;
        }
        let middle = first + span / 2;
        let split = points.partition_point(|p| p.0 <= middle);
        let (older, newer) = points.split_at(split);
        let rising = |p: &[(u64, u64)]| trend::slope(p).is_some_and(trend::Slope::rising);
        if !rising(older) || !rising(newer) {
            return None;
        }
        let rate = trend::slope(&points)?.value();
        if rate <= 0.0 {
            return None;
        }
        let full_in = free as f64 / rate;
        (full_in <= FORECAST_MAX_SECONDS).then_some(Forecast {
            full_in_seconds: full_in,
            growth_bytes_per_second: rate,
            window_seconds: span,
        })
    }

    /// [`Self::forecast`] for every GPU of `s` (which was recorded).
    pub fn forecasts(&self, s: &Snapshot) -> Vec<Option<Forecast>> {
        let now = unix_seconds(s.taken_at);
        s.devices
            .iter()
            .enumerate()
            .map(|(i, d)| self.forecast(i, now, d.memory?.free))
            .collect()
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
                    reserved: Some(0),
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

    /// Forecasts from a used-memory series, one point per second.
    #[test]
    fn forecasts() {
        const GIB: u64 = 1 << 30;
        let total = 1u64 << 40;
        let run = |used: &dyn Fn(u64) -> u64, seconds: u64| {
            let mut h = History::new();
            for t in 0..seconds {
                h.record(&snap(1_000_000 + t * 1000, &[Some(used(t))]));
            }
            let now = 1_000 + seconds - 1;
            h.forecast(0, now, total - used(seconds - 1))
        };
        // 1 GiB a second for 5 minutes: the rest of the TiB in 724 s.
        let f = run(&|t| 100 * GIB + t * GIB, 300).expect("growing");
        assert_eq!(f.growth_bytes_per_second, GIB as f64);
        assert_eq!(f.full_in_seconds, (total - 399 * GIB) as f64 / GIB as f64);
        assert_eq!(f.window_seconds, 299);
        // Only the last 10 minutes count.
        let f = run(&|t| if t < 400 { 0 } else { (t - 400) * GIB }, 1_000).expect("growing");
        assert_eq!(
            (f.growth_bytes_per_second, f.window_seconds),
            (GIB as f64, 599)
        );
        type Used<'a> = &'a dyn Fn(u64) -> u64;
        let cases: [(&str, Used, u64); 6] = [
            ("flat", &|_| 40 * GIB, 600),
            ("shrinking", &|t| 500 * GIB - t * GIB / 2, 600),
            (
                "a single step (a model loaded), then flat",
                &|t| if t < 200 { GIB } else { 80 * GIB },
                600,
            ),
            (
                "a step just now",
                &|t| if t < 590 { GIB } else { 80 * GIB },
                600,
            ),
            ("under a minute of history", &|t| t * GIB, 50),
            (
                "growing, but full in more than a day",
                &|t| 10 * GIB + t,
                600,
            ),
        ];
        for (name, used, seconds) in cases {
            assert_eq!(run(used, seconds), None, "{name}");
        }
        assert_eq!(History::new().forecast(0, 10, 1), None, "no history");
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
