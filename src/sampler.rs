//! The sampling loop. One dedicated thread owns the [`GpuSource`]. Every
//! `memory_sample_interval` it reads each GPU's memory (cheap: ~7 µs per
//! GPU), and every `sample_interval` it also reads the process lists and
//! /proc. Each tick builds a fresh immutable [`Snapshot`] and publishes it
//! by swapping an `Arc`; scrapes only ever read the published snapshot.
//! Peaks over `peak_window` are kept here, so they do not depend on who
//! scrapes or how often.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwapOption;

use crate::gpu::{GpuError, GpuSource, RawProcess};
use crate::metrics::Published;
use crate::model::{
    DeviceInfo, DeviceSample, DriverInfo, DurationHistogram, ErrorKey, MemoryInfo, ProcessSample,
    Snapshot,
};

/// Bucket bounds (seconds) of the tick histograms: a tick costs
/// microseconds per GPU and ~20 µs per process and query.
pub const SAMPLE_DURATION_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// How many sample intervals may pass without a tick before `/healthz`
/// reports the sampler as stuck.
pub const HEALTH_MISSED_TICKS: u32 = 3;

/// Timing of the loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// Full samples: memory, processes, /proc.
    pub sample_interval: Duration,
    /// Memory-only samples in between; `>= sample_interval` means none.
    pub memory_sample_interval: Duration,
    /// Peaks are the maximum over this much history.
    pub peak_window: Duration,
}

impl Timing {
    pub fn every(sample_interval: Duration) -> Timing {
        Timing {
            sample_interval,
            memory_sample_interval: sample_interval,
            peak_window: sample_interval,
        }
    }
}

/// State shared between the sampler thread and the HTTP handlers.
#[derive(Debug)]
pub struct Shared {
    published: ArcSwapOption<Published>,
    /// Unix time in ms when the last tick finished; 0 before the first.
    last_tick_ms: AtomicU64,
    alive: AtomicBool,
    interval: Duration,
}

impl Shared {
    pub fn new(interval: Duration) -> Self {
        Shared {
            published: ArcSwapOption::empty(),
            last_tick_ms: AtomicU64::new(0),
            alive: AtomicBool::new(false),
            interval,
        }
    }

    /// The latest published snapshot (with its encoding cache), `None`
    /// before the first tick.
    pub fn latest(&self) -> Option<Arc<Published>> {
        self.published.load_full()
    }

    pub fn publish(&self, s: Snapshot) {
        self.last_tick_ms
            .store(unix_ms(s.taken_at), Ordering::Release);
        self.published.store(Some(Arc::new(Published::new(s))));
    }

    /// Ready once NVML is initialised and one snapshot is published.
    pub fn ready(&self) -> bool {
        self.published.load().is_some()
    }

    /// Healthy while the sampler thread is alive and has finished a tick
    /// within [`HEALTH_MISSED_TICKS`] sample intervals of `now`.
    pub fn healthy(&self, now: SystemTime) -> Result<(), String> {
        if !self.alive.load(Ordering::Acquire) {
            return Err("sampler thread is not running".into());
        }
        let last = self.last_tick_ms.load(Ordering::Acquire);
        if last == 0 {
            return Err("no sample taken yet".into());
        }
        let age = unix_ms(now).saturating_sub(last);
        let limit = self.interval.as_millis() as u64 * u64::from(HEALTH_MISSED_TICKS);
        if age > limit {
            return Err(format!(
                "last sample finished {age} ms ago, more than {HEALTH_MISSED_TICKS} intervals ({limit} ms)"
            ));
        }
        Ok(())
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What the sampler learns about a pid from /proc. Implementations cache by
/// (pid, start time), so a tick reads one small file per known process.
pub trait ProcessLookup {
    /// `/proc/<pid>/comm`, "" when the process is gone or hidden.
    fn comm(&mut self, pid: u32) -> Arc<str>;
    /// Called once per full tick with the pids still on some GPU, so the
    /// cache can drop the rest.
    fn retain(&mut self, live: &dyn Fn(u32) -> bool);
}

/// Sliding-window maximum: a deque of (time, value) with decreasing values,
/// so push and query are amortised O(1) and memory stays bounded by the
/// number of samples in the window.
#[derive(Debug, Default, Clone)]
pub struct WindowMax {
    q: VecDeque<(Instant, u64)>,
}

impl WindowMax {
    pub fn push(&mut self, at: Instant, v: u64, window: Duration) {
        while self.q.back().is_some_and(|(_, b)| *b <= v) {
            self.q.pop_back();
        }
        self.q.push_back((at, v));
        self.expire(at, window);
    }

    pub fn expire(&mut self, now: Instant, window: Duration) {
        while self
            .q
            .front()
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) > window)
        {
            self.q.pop_front();
        }
    }

    pub fn max(&self) -> Option<u64> {
        self.q.front().map(|(_, v)| *v)
    }
}

struct DeviceState {
    info: Arc<DeviceInfo>,
    memory: Option<MemoryInfo>,
    used_peak: WindowMax,
    processes: Arc<[ProcessSample]>,
    process_peaks: HashMap<u32, WindowMax>,
}

/// Builds snapshots from a [`GpuSource`]. Owns all cumulative state (error
/// counters, tick histograms, peak windows), so each snapshot is complete.
pub struct Sampler<G: GpuSource, P: ProcessLookup> {
    gpu: G,
    procs: P,
    timing: Timing,
    driver: Arc<DriverInfo>,
    devices: Vec<DeviceState>,
    errors: Arc<BTreeMap<ErrorKey, u64>>,
    durations: Arc<DurationHistogram>,
    nvml_durations: Arc<DurationHistogram>,
    memory_samples: u64,
    scratch: Vec<RawProcess>,
}

impl<G: GpuSource, P: ProcessLookup> Sampler<G, P> {
    pub fn new(gpu: G, procs: P, timing: Timing) -> Self {
        let driver = Arc::new(gpu.driver_info());
        let devices = gpu
            .devices()
            .iter()
            .cloned()
            .map(|info| DeviceState {
                info: Arc::new(info),
                memory: None,
                used_peak: WindowMax::default(),
                processes: Arc::from(Vec::new()),
                process_peaks: HashMap::new(),
            })
            .collect();
        Sampler {
            gpu,
            procs,
            timing,
            driver,
            devices,
            errors: Arc::new(BTreeMap::new()),
            durations: Arc::new(DurationHistogram::new(SAMPLE_DURATION_BUCKETS)),
            nvml_durations: Arc::new(DurationHistogram::new(SAMPLE_DURATION_BUCKETS)),
            memory_samples: 0,
            scratch: Vec::new(),
        }
    }

    fn count_error(errors: &mut Arc<BTreeMap<ErrorKey, u64>>, e: GpuError) {
        tracing::debug!(operation = e.operation, error = %e.error, "NVML call failed");
        *Arc::make_mut(errors)
            .entry((e.operation, e.error))
            .or_insert(0) += 1;
    }

    /// Read one GPU's memory and feed its peak window. Returns the time
    /// spent in NVML.
    fn read_memory(&mut self, i: usize, now: Instant) -> Duration {
        let t = Instant::now();
        let result = self.gpu.memory(i);
        let spent = t.elapsed();
        let window = self.timing.peak_window;
        let dev = &mut self.devices[i];
        match result {
            Ok(m) => {
                dev.used_peak.push(now, m.used, window);
                dev.memory = Some(m);
            }
            Err(e) => {
                dev.memory = None;
                dev.used_peak.expire(now, window);
                Self::count_error(&mut self.errors, e);
            }
        }
        spent
    }

    /// A memory-only sample of every GPU (processes keep their last list).
    pub fn tick_memory(&mut self) -> Snapshot {
        let now = Instant::now();
        for i in 0..self.devices.len() {
            self.read_memory(i, now);
        }
        self.memory_samples += 1;
        self.snapshot()
    }

    /// A full sample: memory, processes and /proc for every GPU.
    pub fn tick(&mut self) -> Snapshot {
        let started = Instant::now();
        let window = self.timing.peak_window;
        let mut in_nvml = Duration::ZERO;
        for i in 0..self.devices.len() {
            in_nvml += self.read_memory(i, started);
            if self.devices[i].memory.is_none() {
                self.devices[i].processes = Arc::from(Vec::new());
                self.devices[i].process_peaks.clear();
                continue;
            }
            self.scratch.clear();
            let t = Instant::now();
            let listed = self.gpu.processes(i, &mut self.scratch);
            in_nvml += t.elapsed();
            if let Err(e) = listed {
                Self::count_error(&mut self.errors, e);
                let dev = &mut self.devices[i];
                dev.memory = None;
                dev.processes = Arc::from(Vec::new());
                dev.process_peaks.clear();
                continue;
            }
            self.scratch.sort_unstable_by_key(|p| p.pid);
            let dev = &mut self.devices[i];
            let mut list = Vec::with_capacity(self.scratch.len());
            for p in &self.scratch {
                let peak = p.used_bytes.and_then(|b| {
                    let w = dev.process_peaks.entry(p.pid).or_default();
                    w.push(started, b, window);
                    w.max()
                });
                list.push(ProcessSample {
                    pid: p.pid,
                    used_bytes: p.used_bytes,
                    process: self.procs.comm(p.pid),
                    used_peak_bytes: peak,
                });
            }
            let scratch = &self.scratch;
            dev.process_peaks
                .retain(|pid, _| scratch.binary_search_by_key(pid, |p| p.pid).is_ok());
            dev.processes = Arc::from(list);
        }
        let devices = &self.devices;
        self.procs.retain(&|pid| {
            devices
                .iter()
                .any(|d| d.processes.binary_search_by_key(&pid, |p| p.pid).is_ok())
        });
        Arc::make_mut(&mut self.durations).observe(started.elapsed().as_secs_f64());
        Arc::make_mut(&mut self.nvml_durations).observe(in_nvml.as_secs_f64());
        self.snapshot()
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            taken_at: SystemTime::now(),
            driver: Arc::clone(&self.driver),
            devices: self
                .devices
                .iter()
                .map(|d| DeviceSample {
                    info: Arc::clone(&d.info),
                    memory: d.memory,
                    used_peak_bytes: d.memory.and(d.used_peak.max()),
                    processes: Arc::clone(&d.processes),
                })
                .collect(),
            nvml_errors: Arc::clone(&self.errors),
            sample_duration: Arc::clone(&self.durations),
            sample_nvml_duration: Arc::clone(&self.nvml_durations),
            memory_samples: self.memory_samples,
        }
    }
}

/// /proc lookups cached by (pid, start time): a pid reused by a new process
/// gets fresh data; a known process costs one read of `/proc/<pid>/stat`.
pub struct ProcCache {
    root: crate::procfs::ProcRoot,
    entries: HashMap<u32, (Option<u64>, Arc<str>)>,
    empty: Arc<str>,
}

impl ProcCache {
    pub fn new(root: crate::procfs::ProcRoot) -> Self {
        ProcCache {
            root,
            entries: HashMap::new(),
            empty: Arc::from(""),
        }
    }
}

impl ProcessLookup for ProcCache {
    fn comm(&mut self, pid: u32) -> Arc<str> {
        let start = self.root.start_time(pid);
        if start.is_none() {
            // Gone or hidden (no hostPID): nothing to cache.
            self.entries.remove(&pid);
            return Arc::clone(&self.empty);
        }
        if let Some((s, comm)) = self.entries.get(&pid)
            && *s == start
        {
            return Arc::clone(comm);
        }
        let comm: Arc<str> = self.root.comm(pid).map(Arc::from).unwrap_or_default();
        self.entries.insert(pid, (start, Arc::clone(&comm)));
        comm
    }

    fn retain(&mut self, live: &dyn Fn(u32) -> bool) {
        self.entries.retain(|pid, _| live(*pid));
    }
}

/// Clears the `alive` flag however the thread ends (return or panic).
struct AliveGuard(Arc<Shared>);
impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.alive.store(false, Ordering::Release);
    }
}

/// Why the sampler could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError<E: std::fmt::Display> {
    #[error("{0}")]
    Open(E),
    #[error("cannot start the sampler thread: {0}")]
    Thread(String),
}

/// Start the sampler thread. `open` runs on that thread (NVML handles stay
/// on the thread that made them); its error is returned here, so the caller
/// can exit with a clear message before serving anything. The first
/// snapshot is published before this returns. The thread stops when `stop`
/// receives a message or its sender is dropped.
pub fn spawn<G, P, E, F>(
    open: F,
    procs: P,
    timing: Timing,
    shared: Arc<Shared>,
    stop: Receiver<()>,
) -> Result<JoinHandle<()>, StartError<E>>
where
    G: GpuSource + 'static,
    P: ProcessLookup + Send + 'static,
    E: std::fmt::Display + Send + 'static,
    F: FnOnce() -> Result<G, E> + Send + 'static,
{
    let (ready_tx, ready_rx) = sync_channel::<Result<(), E>>(1);
    let thread_shared = Arc::clone(&shared);
    let handle = std::thread::Builder::new()
        .name("sampler".into())
        .spawn(move || {
            let gpu = match open() {
                Ok(g) => g,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            thread_shared.alive.store(true, Ordering::Release);
            let _guard = AliveGuard(Arc::clone(&thread_shared));
            let mut sampler = Sampler::new(gpu, procs, timing);
            thread_shared.publish(sampler.tick());
            let _ = ready_tx.send(Ok(()));
            run_loop(sampler, &thread_shared, &stop);
        })
        .map_err(|e| StartError::Thread(e.to_string()))?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(handle),
        Ok(Err(e)) => {
            let _ = handle.join();
            Err(StartError::Open(e))
        }
        Err(_) => {
            let _ = handle.join();
            Err(StartError::Thread(
                "the sampler thread ended before NVML was opened".into(),
            ))
        }
    }
}

/// Next deadline after `prev`; when the loop fell behind, restart from now
/// instead of bursting to catch up.
fn advance(prev: Instant, step: Duration, now: Instant) -> Instant {
    let next = prev + step;
    if next <= now { now + step } else { next }
}

fn run_loop<G: GpuSource, P: ProcessLookup>(
    mut sampler: Sampler<G, P>,
    shared: &Shared,
    stop: &Receiver<()>,
) {
    let t = sampler.timing;
    let fast = t.memory_sample_interval < t.sample_interval;
    let start = Instant::now();
    let mut next_full = start + t.sample_interval;
    let mut next_mem = start + t.memory_sample_interval;
    loop {
        let due = if fast {
            next_full.min(next_mem)
        } else {
            next_full
        };
        let wait = due.saturating_duration_since(Instant::now());
        match stop.recv_timeout(wait) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
        let now = Instant::now();
        if now >= next_full {
            shared.publish(sampler.tick());
            let now = Instant::now();
            next_full = advance(next_full, t.sample_interval, now);
            next_mem = now + t.memory_sample_interval;
        } else {
            shared.publish(sampler.tick_memory());
            next_mem = advance(next_mem, t.memory_sample_interval, Instant::now());
        }
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

    #[test]
    fn deadlines_skip_when_behind() {
        let t0 = Instant::now();
        let s = Duration::from_millis(100);
        assert_eq!(advance(t0, s, t0), t0 + s);
        let late = t0 + Duration::from_millis(350);
        assert_eq!(advance(t0, s, late), late + s);
    }
}
