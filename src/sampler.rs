//! The sampling loop. One dedicated thread owns the [`GpuSource`]: every
//! `sample_interval` it reads each GPU, builds a fresh immutable
//! [`Snapshot`] and publishes it by swapping an `Arc`. Scrapes only ever read
//! the published snapshot.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwapOption;

use crate::gpu::{GpuError, GpuSource, RawProcess};
use crate::model::{
    DeviceInfo, DeviceSample, DriverInfo, DurationHistogram, ErrorKey, ProcessSample, Snapshot,
};

/// Bucket bounds (seconds) of `gpumem_exporter_sample_duration_seconds`:
/// a tick costs microseconds per GPU and ~20 µs per process and query.
pub const SAMPLE_DURATION_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// How many sample intervals may pass without a tick before `/healthz`
/// reports the sampler as stuck.
pub const HEALTH_MISSED_TICKS: u32 = 3;

/// State shared between the sampler thread and the HTTP handlers.
#[derive(Debug)]
pub struct Shared {
    snapshot: ArcSwapOption<Snapshot>,
    /// Unix time in ms when the last tick finished; 0 before the first.
    last_tick_ms: AtomicU64,
    alive: AtomicBool,
    interval: Duration,
}

impl Shared {
    pub fn new(interval: Duration) -> Self {
        Shared {
            snapshot: ArcSwapOption::empty(),
            last_tick_ms: AtomicU64::new(0),
            alive: AtomicBool::new(false),
            interval,
        }
    }

    /// The latest published snapshot, `None` before the first tick.
    pub fn latest(&self) -> Option<Arc<Snapshot>> {
        self.snapshot.load_full()
    }

    pub fn publish(&self, s: Snapshot) {
        self.last_tick_ms
            .store(unix_ms(s.taken_at), Ordering::Release);
        self.snapshot.store(Some(Arc::new(s)));
    }

    /// Ready once NVML is initialised and one snapshot is published.
    pub fn ready(&self) -> bool {
        self.snapshot.load().is_some()
    }

    /// Healthy while the sampler thread is alive and has finished a tick
    /// within [`HEALTH_MISSED_TICKS`] intervals of `now`.
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

/// Reads `/proc/<pid>/comm`; empty when the process is gone or hidden.
pub trait ProcessNames {
    fn comm(&mut self, pid: u32) -> String;
}

/// Builds snapshots from a [`GpuSource`]. Owns all cumulative state
/// (error counters, the duration histogram), so each snapshot is complete.
pub struct Sampler<G: GpuSource, N: ProcessNames> {
    gpu: G,
    names: N,
    driver: Arc<DriverInfo>,
    infos: Vec<Arc<DeviceInfo>>,
    errors: Arc<BTreeMap<ErrorKey, u64>>,
    durations: Arc<DurationHistogram>,
    scratch: Vec<RawProcess>,
}

impl<G: GpuSource, N: ProcessNames> Sampler<G, N> {
    pub fn new(gpu: G, names: N) -> Self {
        let driver = Arc::new(gpu.driver_info());
        let infos = gpu.devices().iter().cloned().map(Arc::new).collect();
        Sampler {
            gpu,
            names,
            driver,
            infos,
            errors: Arc::new(BTreeMap::new()),
            durations: Arc::new(DurationHistogram::new(SAMPLE_DURATION_BUCKETS)),
            scratch: Vec::new(),
        }
    }

    fn count_error(&mut self, e: GpuError) {
        tracing::debug!(operation = e.operation, error = %e.error, "NVML call failed");
        *Arc::make_mut(&mut self.errors)
            .entry((e.operation, e.error))
            .or_insert(0) += 1;
    }

    /// Read every GPU once and return the new snapshot.
    pub fn tick(&mut self) -> Snapshot {
        let started = Instant::now();
        let mut devices = Vec::with_capacity(self.infos.len());
        for (i, info) in self.infos.clone().into_iter().enumerate() {
            let memory = match self.gpu.memory(i) {
                Ok(m) => Some(m),
                Err(e) => {
                    self.count_error(e);
                    None
                }
            };
            let mut processes = Vec::new();
            let mut up = memory.is_some();
            if up {
                self.scratch.clear();
                let mut raw = std::mem::take(&mut self.scratch);
                match self.gpu.processes(i, &mut raw) {
                    Ok(()) => {
                        raw.sort_unstable_by_key(|p| p.pid);
                        processes = raw
                            .iter()
                            .map(|p| ProcessSample {
                                pid: p.pid,
                                used_bytes: p.used_bytes,
                                process: self.names.comm(p.pid),
                            })
                            .collect();
                    }
                    Err(e) => {
                        self.count_error(e);
                        up = false;
                    }
                }
                self.scratch = raw;
            }
            devices.push(DeviceSample {
                info,
                memory: if up { memory } else { None },
                processes,
            });
        }
        Arc::make_mut(&mut self.durations).observe(started.elapsed().as_secs_f64());
        Snapshot {
            taken_at: SystemTime::now(),
            driver: Arc::clone(&self.driver),
            devices,
            nvml_errors: Arc::clone(&self.errors),
            sample_duration: Arc::clone(&self.durations),
        }
    }
}

impl ProcessNames for crate::procfs::ProcRoot {
    fn comm(&mut self, pid: u32) -> String {
        crate::procfs::ProcRoot::comm(self, pid).unwrap_or_default()
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
/// can exit with a clear message before serving anything. The thread stops
/// when `stop` receives a message or its sender is dropped.
pub fn spawn<G, N, E, F>(
    open: F,
    names: N,
    shared: Arc<Shared>,
    stop: Receiver<()>,
) -> Result<JoinHandle<()>, StartError<E>>
where
    G: GpuSource + 'static,
    N: ProcessNames + Send + 'static,
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
            // Publish the first snapshot before reporting success, so the
            // first scrape after startup already has data.
            let mut sampler = Sampler::new(gpu, names);
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

fn run_loop<G: GpuSource, N: ProcessNames>(
    mut sampler: Sampler<G, N>,
    shared: &Shared,
    stop: &Receiver<()>,
) {
    let interval = shared.interval;
    let mut next = Instant::now();
    loop {
        next += interval;
        let now = Instant::now();
        if next < now {
            // A slow tick: skip the missed slots instead of bursting.
            next = now + interval;
        }
        match stop.recv_timeout(next - now) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
        shared.publish(sampler.tick());
    }
}
