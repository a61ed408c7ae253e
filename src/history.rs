//! A bounded in-memory history of each GPU's used memory (the page's
//! sparklines and `/api/v1/history`), and the forecasts made from it: when
//! each GPU's memory, and each PyTorch process's reserved memory under its
//! limit, would be full at the growth of the present regime.
//!
//! One point per GPU per second of wall time, the largest `used` of every
//! snapshot published in that second (fast memory samples included, so a
//! spike between two full samples shows, as with the peaks). At most
//! [`HISTORY_SECONDS`] points per GPU (10 minutes): 600 × 16 bytes, under
//! 10 KiB per GPU, whatever the sample intervals. A GPU that does not
//! answer adds no point (a gap, never a fake 0). PyTorch processes with a
//! memory limit (`set_per_process_memory_fraction`) get a ring of their
//! reserved bytes the same way, from the full samples that carry them,
//! dropped when the process (or its limit) leaves the snapshot.
//!
//! Forecasts come from [`trend::regime`]: the regime the series is in now
//! (a change point ends the steady minutes before a ramp, a step, a ramp
//! that stopped) and its growth, from the seconds that are over (not the
//! one still filling). They are worked out once per GPU (and process) per
//! new second and kept: a publish between two seconds only moves the
//! cached line to its own time, so the cost per sample at 10 Hz is a
//! tenth of one search (`cargo bench --bench forecast`).
//!
//! Fed by [`crate::publish::Shared::publish`]: the history is of what was
//! published, so it does not depend on who reads it or how often.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::model::{
    DeviceInfo, Forecast, Forecasts, ProcessSample, Snapshot, TorchForecast, Workload,
    WorkloadLimits,
};
use crate::trend::regime::{Finder, Regime};

/// Points kept per GPU: 10 minutes at one point per second.
pub(crate) const HISTORY_SECONDS: usize = 600;
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

/// One series, oldest first, with its forecast kept until a second ends.
#[derive(Debug, Default)]
struct Series {
    points: VecDeque<Point>,
    finder: Finder,
    /// The regime of the closed seconds, `None` inside when not growing;
    /// `None` outside when a second closed since it was found.
    regime: Option<Option<Regime>>,
    /// The closed seconds as (t, bytes), the finder's input (kept to
    /// reuse its allocation).
    closed: Vec<(u64, u64)>,
}

impl Series {
    /// Take `value` as a figure of second `second`.
    fn add(&mut self, second: u64, value: u64) {
        match self.points.back_mut() {
            Some(last) if last.t == second => {
                last.used = last.used.max(value);
                return;
            }
            // The clock went back: keep the points in order.
            Some(last) if last.t > second => self.points.clear(),
            _ => {}
        }
        self.points.push_back(Point {
            t: second,
            used: value,
        });
        let oldest = second.saturating_sub(HISTORY_SECONDS as u64 - 1);
        while self.points.len() > HISTORY_SECONDS
            || self.points.front().is_some_and(|p| p.t < oldest)
        {
            self.points.pop_front();
        }
        // A second closed (or the series restarted): find the regime anew.
        self.regime = None;
    }

    fn clear(&mut self) {
        self.points.clear();
        self.regime = None;
    }

    /// The growing regime of the closed seconds (before `second`), found
    /// once per closed second.
    fn regime(&mut self, second: u64) -> Option<Regime> {
        if let Some(r) = self.regime {
            return r;
        }
        self.closed.clear();
        self.closed.extend(
            self.points
                .iter()
                .filter(|p| p.t < second)
                .map(|p| (p.t, p.used)),
        );
        let r = self.finder.growth(&self.closed);
        self.regime = Some(r);
        r
    }

    /// When `value` (now, at `now` in Unix seconds) reaches `capacity` at
    /// the present regime's growth, from the top of the regime (its line
    /// plus its largest excursion above it) moved to `now`.
    fn forecast(&mut self, now: f64, value: u64, capacity: u64) -> Option<Forecast> {
        let r = self.regime(now as u64)?;
        // A second's figure is its largest, reached at its end when growing.
        let top = r.level + r.slope * (now - (r.last_x + 1) as f64);
        let top = top.max(value as f64);
        let full_in = ((capacity as f64 - top) / r.slope).max(0.0);
        (full_in <= FORECAST_MAX_SECONDS).then_some(Forecast {
            full_in_seconds: full_in,
            growth_bytes_per_second: r.slope,
            window_seconds: r.span,
        })
    }
}

/// The series of one GPU.
#[derive(Debug, Default)]
struct Ring {
    /// The UUID of the GPU the points are of: a different GPU at this
    /// index (NVML re-opened, the layout changed) starts afresh.
    uuid: String,
    /// The identity the UUID was last checked against: while a sample
    /// carries the very same one, the UUID is not compared again.
    info: Option<Arc<DeviceInfo>>,
    used: Series,
    /// The processes of the last snapshot whose torch figures were taken
    /// (memory-only samples share their full sample's list).
    processes: Option<Arc<[ProcessSample]>>,
}

/// Per GPU (by position in the snapshot), the last [`HISTORY_SECONDS`];
/// per PyTorch process with a memory limit, the same of its reserved bytes.
#[derive(Debug, Default)]
pub struct History {
    gpus: Vec<Ring>,
    /// By (GPU position, pid).
    torch: BTreeMap<(usize, u32), Series>,
    /// Per workload with a hard limit on a GPU, its used bytes, by
    /// (workload, GPU UUID).
    workloads: HashMap<(Workload, Arc<str>), Series>,
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
        self.torch.retain(|k, _| k.0 < s.devices.len());
        for (i, (ring, d)) in self.gpus.iter_mut().zip(&s.devices).enumerate() {
            let checked = ring.info.as_ref().is_some_and(|i| Arc::ptr_eq(i, &d.info));
            if !checked && d.info.is_known() {
                if ring.uuid != d.info.uuid {
                    ring.uuid.clone_from(&d.info.uuid);
                    ring.used.clear();
                    ring.processes = None;
                    self.torch.retain(|k, _| k.0 != i);
                }
                ring.info = Some(Arc::clone(&d.info));
            }
            if let Some(m) = d.memory {
                ring.used.add(second, m.used);
            }
            if ring
                .processes
                .as_ref()
                .is_some_and(|p| Arc::ptr_eq(p, &d.processes))
            {
                continue;
            }
            ring.processes = Some(Arc::clone(&d.processes));
            record_torch(&mut self.torch, i, second, &d.processes);
        }
    }

    /// The points of GPU `index` in `(until - seconds, until]`, oldest first.
    pub fn points(&self, index: usize, until: u64, seconds: u64) -> Vec<Point> {
        let from = until.saturating_sub(seconds);
        self.gpus
            .get(index)
            .map(|r| {
                r.used
                    .points
                    .iter()
                    .filter(|p| p.t > from && p.t <= until)
                    .copied()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// When GPU `index` would run out of memory, `used` bytes being in use
    /// and `free` left at `now` (Unix seconds): at the growth of the
    /// present regime of its history ([`crate::trend::regime`]). `None`
    /// unless it grows now, or when it would take over
    /// [`FORECAST_MAX_SECONDS`].
    pub fn forecast(&mut self, index: usize, now: f64, used: u64, free: u64) -> Option<Forecast> {
        let ring = self.gpus.get_mut(index)?;
        ring.used.forecast(now, used, used.saturating_add(free))
    }

    /// Add the used bytes of each workload of `rows` that has a hard
    /// limit, at the time of `s`, and say when each reaches its lowest
    /// hard limit at its present growth (`limit_in`). A workload that left
    /// (or lost its limit) is forgotten.
    pub fn limits(&mut self, s: &Snapshot, rows: &mut [WorkloadLimits]) {
        let second = unix_seconds(s.taken_at);
        let now = unix_seconds_f64(s.taken_at);
        let mut live = HashSet::new();
        for w in rows.iter_mut() {
            let Some(hard) = w.hard() else { continue };
            let key = (w.workload.clone(), Arc::clone(&w.uuid));
            let series = self.workloads.entry(key.clone()).or_default();
            series.add(second, w.used);
            w.limit_in = series.forecast(now, w.used, hard);
            live.insert(key);
        }
        self.workloads.retain(|k, _| live.contains(k));
    }

    /// The forecasts of every GPU of `s` (which was recorded), and of each
    /// of its PyTorch processes with a memory limit.
    pub fn forecasts(&mut self, s: &Snapshot) -> Forecasts {
        let now = unix_seconds_f64(s.taken_at);
        let gpus = (0..s.devices.len())
            .map(|i| {
                let m = s.devices[i].memory?;
                self.forecast(i, now, m.used, m.free)
            })
            .collect();
        let mut torch = Vec::new();
        for (&(gpu, pid), series) in &mut self.torch {
            let Some(p) = s.devices.get(gpu).and_then(|d| {
                let at = d.processes.binary_search_by_key(&pid, |p| p.pid).ok()?;
                d.processes.get(at)
            }) else {
                continue;
            };
            let Some((reserved, limit)) = p
                .torch
                .as_deref()
                .and_then(|t| Some((t.reserved, t.limit?)))
            else {
                continue;
            };
            if let Some(forecast) = series.forecast(now, reserved, limit) {
                torch.push(TorchForecast { gpu, pid, forecast });
            }
        }
        Forecasts { gpus, torch }
    }
}

/// Add the reserved bytes of GPU `gpu`'s PyTorch processes that have a
/// memory limit; forget the processes no longer on that GPU. A process
/// whose document was not read this time (skipped while being replaced,
/// say) keeps its series: a gap, not a fresh start.
fn record_torch(
    torch: &mut BTreeMap<(usize, u32), Series>,
    gpu: usize,
    second: u64,
    processes: &[ProcessSample],
) {
    torch
        .retain(|&(g, pid), _| g != gpu || processes.binary_search_by_key(&pid, |p| p.pid).is_ok());
    for p in processes {
        if let Some(t) = p.torch.as_deref().filter(|t| t.limit.is_some()) {
            torch
                .entry((gpu, p.pid))
                .or_default()
                .add(second, t.reserved);
        }
    }
}

/// Unix time in whole seconds (0 before 1970).
pub(crate) fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn unix_seconds_f64(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The table of histories the forecast is held to, shared with the
/// end-to-end test.
#[cfg(test)]
#[path = "../tests/e2e/forecast/table.rs"]
pub(crate) mod table;

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::table;
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
        assert_eq!(h.gpus[0].used.points.len(), HISTORY_SECONDS);
        // Old points leave by time too, not only by count.
        h.record(&snap(5_000_000, &[Some(1)]));
        assert_eq!(h.gpus[0].used.points.len(), 1);
    }

    /// One row of the table played at 10 Hz, a forecast asked at every
    /// sample (as publishing does): what it said at each time.
    fn play(row: &table::Row) -> Vec<(f64, u64, Option<Forecast>)> {
        let mut h = History::new();
        let mut out = Vec::new();
        let origin = 1_700_000_000_000i64;
        let mut ms: i64 = 0;
        while ms as f64 <= row.seconds * 1000.0 {
            let t = ms as f64 / 1000.0;
            let used = row.used(t);
            let mut s = snap((origin + ms) as u64, &[Some(used)]);
            if let Some(m) = s.devices[0].memory.as_mut() {
                m.total = row.total;
                m.reserved = Some(table::RESERVED);
                m.free = row.capacity().saturating_sub(used);
            }
            h.record(&s);
            out.push((t, used, h.forecasts(&s).gpu(0)));
            ms += 100;
        }
        out
    }

    /// What `play` said at each time: (seconds, used bytes, forecast).
    type Said = [(f64, u64, Option<Forecast>)];

    /// With FORECAST_TRACE set, each time the forecast appears or goes.
    fn trace(row: &table::Row, said: &Said) {
        if std::env::var_os("FORECAST_TRACE").is_none() {
            return;
        }
        let mut prev = None;
        for s in said {
            let on = s.2.is_some();
            if prev != Some(on) {
                eprintln!(
                    "{}: {:.1} s: {}",
                    row.name,
                    s.0,
                    if on {
                        format!("{:?}", s.2)
                    } else {
                        "none".into()
                    }
                );
                prev = Some(on);
            }
        }
    }

    /// A ramp from `start`: nothing while steady, each read within the
    /// tolerance, the first forecast within `first_within` seconds.
    fn check_ramp(
        row: &table::Row,
        said: &Said,
        start: f64,
        first_within: Option<f64>,
        failures: &mut Vec<String>,
    ) {
        let at = |t: f64| said.iter().find(|s| s.0 >= t - 1e-9);
        // Nothing while steady.
        if let Some(s) = said.iter().find(|s| s.0 < start && s.2.is_some()) {
            failures.push(format!(
                "{}: a forecast at {:.1} s, before the growth: {:?}",
                row.name, s.0, s.2
            ));
        }
        let full = row.full_at().unwrap_or(f64::NAN);
        for (q, t, _) in row.reads() {
            let truth = full - t;
            let got = at(t).and_then(|s| s.2).map(|f| f.full_in_seconds);
            if std::env::var_os("FORECAST_TRACE").is_some() {
                eprintln!("{} {q}: {:?}", row.name, at(t).and_then(|s| s.2));
            }
            let error = got.map(|g| (g - truth) / truth);
            println!(
                "| {} | {:.0} % | {truth:.1} | {} | {} |",
                row.name,
                q * 100.0,
                got.map_or("none".into(), |g| format!("{g:.1}")),
                error.map_or("-".into(), |e| format!("{:+.1} %", e * 100.0)),
            );
            if !error.is_some_and(|e| e.abs() <= table::TOLERANCE) {
                failures.push(format!(
                    "{}: at {:.0} %: {got:?} against {truth:.1}",
                    row.name,
                    q * 100.0
                ));
            }
        }
        if let Some(w) = first_within {
            let first = said
                .iter()
                .find(|s| s.0 >= start && s.2.is_some())
                .map(|s| s.0 - start);
            println!(
                "| {} | first forecast | - | {} s after the start | - |",
                row.name,
                first.map_or("none".into(), |f| format!("{f:.1}"))
            );
            if !first.is_some_and(|f| f <= w) {
                failures.push(format!(
                    "{}: first forecast {first:?} s after the start",
                    row.name
                ));
            }
        }
    }

    /// No forecast at any time.
    fn check_never(row: &table::Row, said: &Said, failures: &mut Vec<String>) {
        let any = said.iter().find(|s| s.2.is_some());
        println!(
            "| {} | any time | - | {} | - |",
            row.name,
            any.map_or("none (as it should)".into(), |s| format!(
                "{:.1} at {:.1} s",
                s.2.map_or(0.0, |f| f.full_in_seconds),
                s.0
            )),
        );
        if let Some(s) = any {
            failures.push(format!(
                "{}: a forecast at {:.1} s: {:?}",
                row.name, s.0, s.2
            ));
        }
    }

    /// A forecast during the ramp from `start` to `stop`, none from
    /// `stop + within` on.
    fn check_stops(
        row: &table::Row,
        said: &Said,
        (start, stop, within): (f64, f64, f64),
        failures: &mut Vec<String>,
    ) {
        let during = said
            .iter()
            .filter(|s| s.0 >= start && s.0 < stop)
            .any(|s| s.2.is_some());
        let last = said
            .iter()
            .filter(|s| s.2.is_some())
            .map(|s| s.0)
            .fold(f64::NAN, f64::max);
        println!(
            "| {} | after the stop | - | last forecast {:.1} s after the stop | - |",
            row.name,
            last - stop
        );
        if !during || last >= stop + within {
            failures.push(format!(
                "{}: forecast during the ramp {during}, last at {last:.1}",
                row.name
            ));
        }
    }

    /// The table of histories (tests/e2e/forecast/table.rs): every ramp
    /// read at 25, 50 and 75 % of the way within 15 % of the truth; no
    /// forecast for steps, a sawtooth without a leak or noise; a ramp that
    /// stops loses its forecast within 5 s. Prints the table
    /// (`cargo test --lib history::tests::table -- --nocapture`).
    #[test]
    fn table() {
        let mut failures = Vec::new();
        println!("| row | read at | truth s | forecast s | error |");
        println!("|---|---|---|---|---|");
        for row in table::rows() {
            let said = play(&row);
            trace(&row, &said);
            match row.expect {
                table::Expect::Ramp {
                    start,
                    first_within,
                    ..
                } => check_ramp(&row, &said, start, first_within, &mut failures),
                table::Expect::Never => check_never(&row, &said, &mut failures),
                table::Expect::Stops {
                    start,
                    stop,
                    within,
                } => check_stops(&row, &said, (start, stop, within), &mut failures),
            }
        }
        assert!(failures.is_empty(), "{failures:#?}");
    }

    #[test]
    fn forecast_edges() {
        // No history, under a minimum of points, and a GPU that would
        // fill in more than a day.
        assert_eq!(History::new().forecast(0, 10.0, 1, 1), None, "no history");
        let mut h = History::new();
        for t in 0..5u64 {
            h.record(&snap(1_000_000 + t * 1000, &[Some(t << 30)]));
        }
        assert_eq!(
            h.forecast(0, 1_004.5, 4 << 30, 1 << 40),
            None,
            "5 s of history"
        );
        let mut h = History::new();
        for t in 0..600u64 {
            h.record(&snap(1_000_000 + t * 1000, &[Some((10 << 30) + t)]));
        }
        assert_eq!(
            h.forecast(0, 1_599.5, 10 << 30, 1 << 40),
            None,
            "full in years"
        );
    }

    /// The torch limit forecast: reserved bytes of a process with a
    /// limit, steady for 5 minutes, then growing 64 MiB/s.
    #[test]
    fn torch_limit_forecast_follows_the_present_growth() {
        use crate::model::{ProcIdentity, ProcessSample, TorchStats};
        const MIB: u64 = 1 << 20;
        let limit = 60 << 30;
        let reserved = |t: u64| {
            if t < 300 {
                10 << 30
            } else {
                (10 << 30) + (t - 300) * 64 * MIB
            }
        };
        let mut h = History::new();
        let mut last = None;
        for t in 0..700u64 {
            let mut s = snap(1_000_000 + t * 1000, &[Some(40 << 30)]);
            let p = |pid: u32, limit: Option<u64>| ProcessSample {
                pid,
                used_bytes: Some(reserved(t)),
                ident: Arc::new(ProcIdentity::default()),
                gpu_instance_id: None,
                compute_instance_id: None,
                used_peak_bytes: None,
                torch: Some(Arc::new(TorchStats {
                    reserved: reserved(t),
                    limit,
                    ..TorchStats::default()
                })),
                readings: Default::default(),
            };
            s.devices[0].processes = Arc::new([p(7, Some(limit)), p(9, None)]);
            h.record(&s);
            last = Some((t, h.forecasts(&s)));
        }
        let (t, f) = last.expect("played");
        let truth = (limit - reserved(t)) as f64 / (64 * MIB) as f64;
        let got = f
            .torch(0, 7)
            .expect("a forecast for the process with a limit");
        assert!(
            ((got.full_in_seconds - truth) / truth).abs() < 0.02,
            "{got:?} vs {truth}"
        );
        assert_eq!(got.growth_bytes_per_second.round(), (64 * MIB) as f64);
        assert!(
            got.window_seconds < 400,
            "the steady minutes are not in it: {got:?}"
        );
        assert_eq!(f.torch(0, 9), None, "no limit, no forecast");
        // A sample without the process's torch figures (its document
        // skipped) leaves a gap, not a fresh start.
        let mut s = snap(1_000_000 + 700_000, &[Some(40 << 30)]);
        let mut p = ProcessSample {
            pid: 7,
            used_bytes: Some(1),
            ident: Arc::new(ProcIdentity::default()),
            gpu_instance_id: None,
            compute_instance_id: None,
            used_peak_bytes: None,
            torch: None,
            readings: Default::default(),
        };
        s.devices[0].processes = Arc::new([p.clone()]);
        h.record(&s);
        p.torch = Some(Arc::new(TorchStats {
            reserved: reserved(701),
            limit: Some(limit),
            ..TorchStats::default()
        }));
        let mut s = snap(1_000_000 + 702_000, &[Some(40 << 30)]);
        s.devices[0].processes = Arc::new([p]);
        h.record(&s);
        assert!(
            h.forecasts(&s).torch(0, 7).is_some(),
            "kept through the gap"
        );
        assert_eq!(f.torch.len(), 1);
        // The process gone: its series too.
        let s = snap(1_000_000 + 703_000, &[Some(40 << 30)]);
        h.record(&s);
        assert!(h.forecasts(&s).torch.is_empty());
        assert!(h.torch.is_empty());
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
