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
use crate::kube::PodIndex;
use crate::metrics::Published;
use crate::model::{
    DeviceInfo, DeviceSample, DriverInfo, DurationHistogram, ErrorKey, KubeState, MemoryInfo,
    MigSample, OtherProcesses, ProcIdentity, ProcessSample, Snapshot, TorchCounters, TorchStats,
};
use crate::procfs::{ProcRoot, UserNames};
use crate::torch_bridge::TorchReader;

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

/// Which processes get series of their own (cardinality knobs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Selection {
    /// Per-process series at all.
    pub enabled: bool,
    /// Processes using less are summed into the `pid="other"` series.
    pub min_bytes: u64,
    /// Keep at most this many processes per GPU (largest first); 0: all.
    pub top_n: usize,
}

impl Default for Selection {
    fn default() -> Self {
        Selection {
            enabled: true,
            min_bytes: 0,
            top_n: 0,
        }
    }
}

/// Indices (into `procs`, which is sorted by pid) of the processes that get
/// their own series, still in pid order, and the sum of the rest. A process
/// without a memory figure has nothing to sum and is always listed.
pub fn select(procs: &[RawProcess], sel: &Selection) -> (Vec<usize>, Option<OtherProcesses>) {
    let mut other = OtherProcesses::default();
    let mut keep: Vec<usize> = Vec::with_capacity(procs.len());
    let mut ranked: Vec<(u64, u32, usize)> = Vec::with_capacity(procs.len());
    for (i, p) in procs.iter().enumerate() {
        match p.used_bytes {
            None if sel.enabled => keep.push(i),
            None => other.count += 1,
            Some(b) if sel.enabled && b >= sel.min_bytes => ranked.push((b, p.pid, i)),
            Some(b) => {
                other.count += 1;
                other.used_bytes += b;
            }
        }
    }
    if sel.top_n > 0 && ranked.len() > sel.top_n {
        ranked.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        for &(b, _, _) in &ranked[sel.top_n..] {
            other.count += 1;
            other.used_bytes += b;
        }
        ranked.truncate(sel.top_n);
    }
    keep.extend(ranked.iter().map(|r| r.2));
    keep.sort_unstable();
    (keep, (other.count > 0).then_some(other))
}

/// State shared between the sampler thread and the HTTP handlers.
#[derive(Debug)]
pub struct Shared {
    published: ArcSwapOption<Published>,
    /// Unix time in ms when the last tick finished; 0 before the first.
    last_tick_ms: AtomicU64,
    alive: AtomicBool,
    /// The full sample interval in ms (changes on config reload).
    interval_ms: AtomicU64,
    /// NVML initialisation attempts before it answered (1 = at once).
    nvml_init_attempts: AtomicU64,
}

impl Shared {
    pub fn new(interval: Duration) -> Self {
        Shared {
            published: ArcSwapOption::empty(),
            last_tick_ms: AtomicU64::new(0),
            alive: AtomicBool::new(false),
            interval_ms: AtomicU64::new(interval.as_millis() as u64),
            nvml_init_attempts: AtomicU64::new(0),
        }
    }

    /// The sampler thread is alive and not stuck (also while it waits for
    /// NVML to come up).
    fn beat(&self) {
        self.last_tick_ms
            .store(unix_ms(SystemTime::now()), Ordering::Release);
    }

    fn set_interval(&self, d: Duration) {
        self.interval_ms
            .store(d.as_millis() as u64, Ordering::Release);
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

    /// Ready once NVML is initialised and a snapshot is published in which
    /// at least one GPU answers (or the host has none).
    pub fn ready(&self) -> Result<(), &'static str> {
        match &*self.published.load() {
            None => Err("NVML is not initialised yet"),
            Some(p)
                if !p.snapshot.devices.is_empty() && p.snapshot.devices.iter().all(|d| !d.up()) =>
            {
                Err("no GPU answered the last sample")
            }
            Some(_) => Ok(()),
        }
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
        let limit = self.interval_ms.load(Ordering::Acquire) * u64::from(HEALTH_MISSED_TICKS);
        if age > limit {
            return Err(format!(
                "the sampler has not finished a tick for {age} ms, more than {HEALTH_MISSED_TICKS} sample intervals ({limit} ms): an NVML call may hang"
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

/// What the sampler learns about a pid from /proc (and the pod watcher).
/// Implementations cache by (pid, start time), so a tick reads one small
/// file per known process.
pub trait ProcessLookup {
    /// Name, owner, container and pod of `pid`; all empty when the process
    /// is gone or not visible (no host PID namespace).
    fn identify(&mut self, pid: u32) -> Arc<ProcIdentity>;
    /// Called at the start of each full sample: a pid listed on several
    /// GPUs is checked against /proc once per sample, not once per GPU.
    fn begin_tick(&mut self) {}
    /// Called once per full tick with the pids still on some GPU, so the
    /// cache can drop the rest.
    fn retain(&mut self, live: &dyn Fn(u32) -> bool);
    /// Lookups of pids that were not visible in /proc, so far.
    fn failures(&self) -> u64 {
        0
    }
    /// The pod watcher's state, when one feeds this lookup.
    fn kubernetes(&self) -> Option<KubeState> {
        None
    }
    /// PyTorch allocator figures `pid` itself published (torch bridge) for
    /// the device named by `uuids` (its MIG instance's UUID first, then the
    /// GPU's). Called after `identify(pid)` in the same tick; a process's
    /// document is read at most once per tick, and `retain` ends the tick.
    fn torch(&mut self, _pid: u32, _uuids: &[&str]) -> Option<TorchStats> {
        None
    }
    /// Torch bridge documents accepted and dropped, when the bridge is on.
    fn torch_counters(&self) -> Option<TorchCounters> {
        None
    }
}

/// A lookup that knows nothing (used to build per-device state only).
struct NoLookup;

impl ProcessLookup for NoLookup {
    fn identify(&mut self, _pid: u32) -> Arc<ProcIdentity> {
        Arc::new(ProcIdentity::default())
    }
    fn retain(&mut self, _live: &dyn Fn(u32) -> bool) {}
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
    other: Option<OtherProcesses>,
    process_peaks: HashMap<u32, WindowMax>,
    mig: Arc<[MigSample]>,
}

/// Builds snapshots from a [`GpuSource`]. Owns all cumulative state (error
/// counters, tick histograms, peak windows), so each snapshot is complete.
pub struct Sampler<G: GpuSource, P: ProcessLookup> {
    gpu: G,
    procs: P,
    timing: Timing,
    selection: Selection,
    driver: Arc<DriverInfo>,
    devices: Vec<DeviceState>,
    errors: Arc<BTreeMap<ErrorKey, u64>>,
    durations: Arc<DurationHistogram>,
    nvml_durations: Arc<DurationHistogram>,
    memory_samples: u64,
    reinit_attempts: u64,
    scratch: Vec<RawProcess>,
}

impl<G: GpuSource, P: ProcessLookup> Sampler<G, P> {
    pub fn new(gpu: G, procs: P, timing: Timing) -> Self {
        let driver = Arc::new(gpu.driver_info());
        let devices = gpu
            .devices()
            .iter()
            .cloned()
            .enumerate()
            .map(|(i, info)| DeviceState {
                info: Arc::new(info),
                memory: None,
                used_peak: WindowMax::default(),
                processes: Arc::from(Vec::new()),
                other: None,
                process_peaks: HashMap::new(),
                mig: gpu
                    .mig_devices(i)
                    .iter()
                    .map(|m| MigSample {
                        info: Arc::new(m.clone()),
                        memory: None,
                    })
                    .collect(),
            })
            .collect();
        Sampler {
            gpu,
            procs,
            timing,
            selection: Selection::default(),
            driver,
            devices,
            errors: Arc::new(BTreeMap::new()),
            durations: Arc::new(DurationHistogram::new(SAMPLE_DURATION_BUCKETS)),
            nvml_durations: Arc::new(DurationHistogram::new(SAMPLE_DURATION_BUCKETS)),
            memory_samples: 0,
            reinit_attempts: 0,
            scratch: Vec::new(),
        }
    }

    /// Swap in a freshly opened GPU source (after every GPU failed), keeping
    /// counters and histograms; per-device state starts over.
    pub fn replace_gpu(&mut self, gpu: G) {
        let fresh = Sampler::new(gpu, NoLookup, self.timing);
        self.gpu = fresh.gpu;
        self.driver = fresh.driver;
        self.devices = fresh.devices;
    }

    /// Which processes get their own series.
    pub fn with_selection(mut self, selection: Selection) -> Self {
        self.selection = selection;
        self
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
        self.procs.begin_tick();
        let window = self.timing.peak_window;
        let mut in_nvml = Duration::ZERO;
        for i in 0..self.devices.len() {
            in_nvml += self.read_memory(i, started);
            if self.devices[i].memory.is_none() {
                let dev = &mut self.devices[i];
                dev.processes = Arc::from(Vec::new());
                dev.other = None;
                dev.process_peaks.clear();
                continue;
            }
            self.scratch.clear();
            let t = Instant::now();
            let listed = self.gpu.processes(i, &mut self.scratch);
            let mut mig = Vec::with_capacity(self.devices[i].mig.len());
            for (k, m) in self.devices[i].mig.iter().enumerate() {
                let memory = match self.gpu.mig_memory(i, k) {
                    Ok(mem) => Some(mem),
                    Err(e) => {
                        Self::count_error(&mut self.errors, e);
                        None
                    }
                };
                mig.push(MigSample {
                    info: Arc::clone(&m.info),
                    memory,
                });
            }
            in_nvml += t.elapsed();
            self.devices[i].mig = Arc::from(mig);
            if let Err(e) = listed {
                Self::count_error(&mut self.errors, e);
                let dev = &mut self.devices[i];
                dev.memory = None;
                dev.processes = Arc::from(Vec::new());
                dev.other = None;
                dev.process_peaks.clear();
                continue;
            }
            self.scratch.sort_unstable_by_key(|p| p.pid);
            let dev = &mut self.devices[i];
            // Peaks follow every listed process, exported or not, so a
            // process that climbs into the top N arrives with its history.
            for p in &self.scratch {
                if let Some(b) = p.used_bytes {
                    dev.process_peaks
                        .entry(p.pid)
                        .or_default()
                        .push(started, b, window);
                }
            }
            let scratch = &self.scratch;
            dev.process_peaks
                .retain(|pid, _| scratch.binary_search_by_key(pid, |p| p.pid).is_ok());
            let (keep, other) = select(&self.scratch, &self.selection);
            let mut list = Vec::with_capacity(keep.len());
            for k in keep {
                let p = &self.scratch[k];
                let ident = self.procs.identify(p.pid);
                // The process's MIG instance, whose UUID torch reports.
                let mig = p.gpu_instance_id.and_then(|gi| {
                    dev.mig.iter().find(|m| {
                        m.info.gpu_instance_id == gi
                            && p.compute_instance_id
                                .is_none_or(|ci| ci == m.info.compute_instance_id)
                    })
                });
                let torch = match mig {
                    Some(m) => self
                        .procs
                        .torch(p.pid, &[m.info.mig_uuid.as_str(), dev.info.uuid.as_str()]),
                    None => self.procs.torch(p.pid, &[dev.info.uuid.as_str()]),
                };
                list.push(ProcessSample {
                    pid: p.pid,
                    used_bytes: p.used_bytes,
                    ident,
                    gpu_instance_id: p.gpu_instance_id,
                    compute_instance_id: p.compute_instance_id,
                    used_peak_bytes: p
                        .used_bytes
                        .and_then(|_| dev.process_peaks.get(&p.pid))
                        .and_then(WindowMax::max),
                    torch,
                });
            }
            dev.processes = Arc::from(list);
            dev.other = other;
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
                    other: d.other,
                    mig: Arc::clone(&d.mig),
                })
                .collect(),
            nvml_errors: Arc::clone(&self.errors),
            sample_duration: Arc::clone(&self.durations),
            sample_nvml_duration: Arc::clone(&self.nvml_durations),
            memory_samples: self.memory_samples,
            process_lookup_failures: self.procs.failures(),
            nvml_reinit_attempts: self.reinit_attempts,
            kubernetes: self.procs.kubernetes(),
            torch: self.procs.torch_counters(),
        }
    }
}

/// /proc lookups cached by (pid, start time): a pid reused by a new process
/// gets fresh data; a known process costs one read of `/proc/<pid>/stat`.
/// Pod names come from the pod watcher's cache (never the API itself) and
/// are retried each tick until the watcher knows the pod.
pub struct ProcCache {
    root: ProcRoot,
    users: UserNames,
    pods: Option<Arc<PodIndex>>,
    /// Include the command line, redacted and cut to this many characters.
    cmdline_max: Option<usize>,
    entries: HashMap<u32, (u64, Arc<ProcIdentity>)>,
    /// Pids whose start time was checked in this full sample.
    checked: std::collections::HashSet<u32>,
    unknown: Arc<ProcIdentity>,
    failures: u64,
    warned_hidden: bool,
    /// PyTorch allocator figures from `/proc/<pid>/fd` (torch bridge).
    torch: Option<TorchReader>,
}

impl ProcCache {
    pub fn new(root: ProcRoot) -> Self {
        ProcCache {
            root,
            users: UserNames::new("/etc/passwd"),
            pods: None,
            cmdline_max: None,
            entries: HashMap::new(),
            checked: std::collections::HashSet::new(),
            unknown: Arc::new(ProcIdentity::default()),
            failures: 0,
            warned_hidden: false,
            torch: None,
        }
    }

    /// Read the PyTorch allocator figures processes publish with the
    /// `gpumem_bridge` Python package (`processes.torch_bridge`).
    pub fn with_torch_bridge(mut self) -> Self {
        self.torch = Some(TorchReader::new(self.root.clone()));
        self
    }

    /// Map uids to names with this passwd file (e.g. the host's).
    pub fn with_users(mut self, users: UserNames) -> Self {
        self.users = users;
        self
    }

    /// Resolve pod UIDs and container ids through this pod index.
    pub fn with_pods(mut self, pods: Arc<PodIndex>) -> Self {
        self.pods = Some(pods);
        self
    }

    /// Add the (redacted, truncated) command line to identities.
    pub fn with_cmdline(mut self, max_len: usize) -> Self {
        self.cmdline_max = Some(max_len);
        self
    }

    fn read(&self, pid: u32) -> ProcIdentity {
        let s = |v: String| -> Arc<str> { Arc::from(v) };
        let cg = self
            .root
            .cgroup(pid)
            .map(|c| crate::procfs::parse_cgroup(&c))
            .unwrap_or_default();
        ProcIdentity {
            comm: s(self.root.comm(pid).unwrap_or_default()),
            user: s(self
                .root
                .uid(pid)
                .map(|u| self.users.name(u))
                .unwrap_or_default()),
            container_id: s(cg.container_id.unwrap_or_default()),
            pod_uid: s(cg.pod_uid.unwrap_or_default()),
            cmdline: self.cmdline_max.map(|max| {
                let args = self.root.cmdline(pid).unwrap_or_default();
                s(crate::procfs::redact_cmdline(&args, max))
            }),
            namespace: Arc::from(""),
            pod: Arc::from(""),
            container: Arc::from(""),
        }
    }

    /// Fill namespace/pod/container from the pod index, if it knows them.
    fn resolve_pod(&self, ident: &mut ProcIdentity) -> bool {
        let Some(pods) = &self.pods else {
            return false;
        };
        let uid = (!ident.pod_uid.is_empty()).then_some(&*ident.pod_uid);
        let cid = (!ident.container_id.is_empty()).then_some(&*ident.container_id);
        if uid.is_none() && cid.is_none() {
            return false;
        }
        match pods.lookup(uid, cid) {
            Some(r) => {
                ident.namespace = Arc::from(r.namespace);
                ident.pod = Arc::from(r.pod);
                ident.container = Arc::from(r.container);
                true
            }
            None => false,
        }
    }
}

impl ProcessLookup for ProcCache {
    fn begin_tick(&mut self) {
        self.checked.clear();
    }

    fn identify(&mut self, pid: u32) -> Arc<ProcIdentity> {
        // Already checked in this sample (the pid is on another GPU too)
        // and resolved: no second read of /proc.
        if self.checked.contains(&pid)
            && let Some((_, ident)) = self.entries.get(&pid)
            && (self.pods.is_none() || !ident.pod.is_empty())
        {
            return Arc::clone(ident);
        }
        let Some(start) = self.root.start_time(pid) else {
            // Gone, or hidden because we do not share the host's PID
            // namespace: the bytes are still exported by pid.
            self.entries.remove(&pid);
            self.failures += 1;
            if !self.warned_hidden {
                self.warned_hidden = true;
                tracing::warn!(
                    pid,
                    procfs = %self.root.path().display(),
                    "a pid reported by NVML is not visible in /proc: process names, users and pods cannot be resolved (run with hostPID: true, or point path.procfs at the host's /proc); memory is still exported by pid. Counted in gpumem_exporter_process_lookup_failures_total; this is logged once"
                );
            }
            return Arc::clone(&self.unknown);
        };
        self.checked.insert(pid);
        if let Some((s, ident)) = self.entries.get(&pid)
            && *s == start
        {
            if !ident.pod.is_empty()
                || self.pods.is_none()
                || (ident.pod_uid.is_empty() && ident.container_id.is_empty())
            {
                return Arc::clone(ident);
            }
            // Known process, pod not resolved yet: try the index again.
            let mut updated = ProcIdentity::clone(ident);
            if self.resolve_pod(&mut updated) {
                let updated = Arc::new(updated);
                self.entries.insert(pid, (start, Arc::clone(&updated)));
                return updated;
            }
            return Arc::clone(ident);
        }
        let mut ident = self.read(pid);
        self.resolve_pod(&mut ident);
        let ident = Arc::new(ident);
        self.entries.insert(pid, (start, Arc::clone(&ident)));
        ident
    }

    fn retain(&mut self, live: &dyn Fn(u32) -> bool) {
        self.entries.retain(|pid, _| live(*pid));
        if let Some(t) = &mut self.torch {
            t.end_tick(live);
        }
    }

    fn failures(&self) -> u64 {
        self.failures
    }

    fn torch(&mut self, pid: u32, uuids: &[&str]) -> Option<TorchStats> {
        // Only a process identify() just found in /proc, at that start time.
        let start = self.entries.get(&pid)?.0;
        self.torch.as_mut()?.stats(pid, start, uuids)
    }

    fn torch_counters(&self) -> Option<TorchCounters> {
        self.torch.as_ref().map(TorchReader::counters)
    }

    fn kubernetes(&self) -> Option<KubeState> {
        self.pods.as_ref().map(|p| {
            let st = p.stats();
            KubeState {
                pods: p.pods() as u64,
                synced: st.synced,
                lists_total: st.lists_total,
                watch_restarts_total: st.watch_restarts_total,
                errors_total: st.errors_total,
            }
        })
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

/// How opening the GPU source failed: a library that cannot be loaded at
/// all will not fix itself (fatal); a driver that is not loaded yet after a
/// reboot, or a permission that udev has not granted yet, may (retry).
#[derive(Debug)]
pub enum OpenFailure<E> {
    Fatal(E),
    Retry(E),
}

/// Messages to the sampler thread.
#[derive(Debug, Clone, Copy)]
pub enum Control {
    Stop,
    /// New intervals and selection from a reloaded config (SIGHUP).
    Reconfigure(Timing, Selection),
}

/// Exponential backoff between NVML (re)initialisation attempts.
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    pub const INITIAL: Duration = Duration::from_secs(1);
    pub const MAX: Duration = Duration::from_secs(30);

    pub fn new() -> Self {
        Backoff {
            next: Self::INITIAL,
            max: Self::MAX,
        }
    }

    /// The wait before the next attempt (1s, 2s, 4s, … 30s).
    pub fn step(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }

    pub fn reset(&mut self) {
        self.next = Self::INITIAL;
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

/// After this many full samples in which every GPU failed, NVML is opened
/// afresh (with backoff): device handles can go stale after a GPU reset.
pub const REINIT_AFTER_FAILED_SAMPLES: u32 = 3;

/// Wait up to `total`, beating the heartbeat every `beat` so `/healthz`
/// knows the thread is alive. Returns a control message if one arrives.
fn wait_alive(
    shared: &Shared,
    control: &Receiver<Control>,
    total: Duration,
    beat: Duration,
) -> Option<Control> {
    let until = Instant::now() + total;
    loop {
        shared.beat();
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        match control.recv_timeout(left.min(beat)) {
            Ok(c) => return Some(c),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return Some(Control::Stop),
        }
    }
}

/// Start the sampler thread. `open` runs on that thread (NVML handles stay
/// on the thread that made them). A fatal open error is returned here, so
/// the caller can exit with a clear message before serving anything. A
/// retryable one is logged once; the thread keeps retrying with backoff
/// while the server answers `/readyz` 503 and `/healthz` 200, and starts
/// sampling by itself once NVML answers. Returns once the first snapshot is
/// published or retrying has begun. The thread stops on [`Control::Stop`]
/// or when the sender is dropped.
pub fn spawn<G, P, E, F>(
    open: F,
    procs: P,
    timing: Timing,
    selection: Selection,
    shared: Arc<Shared>,
    control: Receiver<Control>,
) -> Result<JoinHandle<()>, StartError<E>>
where
    G: GpuSource + 'static,
    P: ProcessLookup + Send + 'static,
    E: std::fmt::Display + Send + 'static,
    F: Fn() -> Result<G, OpenFailure<E>> + Send + 'static,
{
    let (ready_tx, ready_rx) = sync_channel::<Result<(), E>>(1);
    let thread_shared = Arc::clone(&shared);
    let handle = std::thread::Builder::new()
        .name("sampler".into())
        .spawn(move || {
            let shared = thread_shared;
            shared.alive.store(true, Ordering::Release);
            let _guard = AliveGuard(Arc::clone(&shared));
            let mut backoff = Backoff::new();
            let mut attempts: u64 = 0;
            let gpu = loop {
                attempts += 1;
                match open() {
                    Ok(g) => break g,
                    Err(OpenFailure::Fatal(e)) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                    Err(OpenFailure::Retry(e)) => {
                        if attempts == 1 {
                            tracing::error!(
                                "{e}; the exporter stays up (/readyz answers 503) and retries with backoff until NVML answers"
                            );
                            let _ = ready_tx.send(Ok(()));
                        } else {
                            tracing::debug!(attempt = attempts, "NVML still not available: {e}");
                        }
                        shared.nvml_init_attempts.store(attempts, Ordering::Relaxed);
                        let wait = backoff.step();
                        if let Some(Control::Stop) =
                            wait_alive(&shared, &control, wait, timing.sample_interval)
                        {
                            return;
                        }
                    }
                }
            };
            if attempts > 1 {
                tracing::info!(attempts, "NVML answered; sampling starts");
            }
            let mut sampler = Sampler::new(gpu, procs, timing).with_selection(selection);
            shared.publish(sampler.tick());
            let _ = ready_tx.send(Ok(()));
            run_loop(sampler, &shared, &control, &open);
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

fn run_loop<G, P, E, F>(
    mut sampler: Sampler<G, P>,
    shared: &Shared,
    control: &Receiver<Control>,
    open: &F,
) where
    G: GpuSource,
    P: ProcessLookup,
    E: std::fmt::Display,
    F: Fn() -> Result<G, OpenFailure<E>>,
{
    let start = Instant::now();
    let mut t = sampler.timing;
    let mut next_full = start + t.sample_interval;
    let mut next_mem = start + t.memory_sample_interval;
    let mut failed_samples: u32 = 0;
    let mut reinit_backoff = Backoff::new();
    let mut next_reinit = start;
    loop {
        let fast = t.memory_sample_interval < t.sample_interval;
        let due = if fast {
            next_full.min(next_mem)
        } else {
            next_full
        };
        let wait = due.saturating_duration_since(Instant::now());
        match control.recv_timeout(wait) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(Control::Stop) | Err(RecvTimeoutError::Disconnected) => return,
            Ok(Control::Reconfigure(timing, selection)) => {
                sampler.timing = timing;
                sampler.selection = selection;
                shared.set_interval(timing.sample_interval);
                t = timing;
                let now = Instant::now();
                next_full = now + t.sample_interval;
                next_mem = now + t.memory_sample_interval;
                tracing::info!(
                    sample_interval = %crate::config::HumanDuration(t.sample_interval),
                    memory_sample_interval = %crate::config::HumanDuration(t.memory_sample_interval),
                    peak_window = %crate::config::HumanDuration(t.peak_window),
                    "sampler reconfigured"
                );
                continue;
            }
        }
        let now = Instant::now();
        if now < next_full {
            shared.publish(sampler.tick_memory());
            next_mem = advance(next_mem, t.memory_sample_interval, Instant::now());
            continue;
        }
        let snapshot = sampler.tick();
        let all_down = !snapshot.devices.is_empty() && snapshot.devices.iter().all(|d| !d.up());
        shared.publish(snapshot);
        let now = Instant::now();
        next_full = advance(next_full, t.sample_interval, now);
        next_mem = now + t.memory_sample_interval;
        if !all_down {
            failed_samples = 0;
            reinit_backoff.reset();
            continue;
        }
        failed_samples = failed_samples.saturating_add(1);
        if failed_samples >= REINIT_AFTER_FAILED_SAMPLES && now >= next_reinit {
            sampler.reinit_attempts += 1;
            match open() {
                Ok(g) => {
                    tracing::warn!(
                        "every GPU failed {failed_samples} samples in a row; NVML re-opened"
                    );
                    sampler.replace_gpu(g);
                    failed_samples = 0;
                }
                Err(OpenFailure::Fatal(e)) | Err(OpenFailure::Retry(e)) => {
                    tracing::debug!("re-opening NVML failed: {e}");
                }
            }
            next_reinit = now + reinit_backoff.step();
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

    fn raw(pid: u32, used: Option<u64>) -> RawProcess {
        RawProcess {
            pid,
            used_bytes: used,
            gpu_instance_id: None,
            compute_instance_id: None,
        }
    }

    #[test]
    fn selection_keeps_totals() {
        let procs = [
            raw(1, Some(100)),
            raw(2, Some(5)),
            raw(3, None),
            raw(4, Some(50)),
            raw(5, Some(70)),
        ];
        let total: u64 = procs.iter().filter_map(|p| p.used_bytes).sum();
        let cases = [
            (Selection::default(), vec![0, 1, 2, 3, 4], None),
            (
                Selection {
                    top_n: 2,
                    ..Default::default()
                },
                vec![0, 2, 4],
                Some(OtherProcesses {
                    count: 2,
                    used_bytes: 55,
                }),
            ),
            (
                Selection {
                    min_bytes: 60,
                    ..Default::default()
                },
                vec![0, 2, 4],
                Some(OtherProcesses {
                    count: 2,
                    used_bytes: 55,
                }),
            ),
            (
                Selection {
                    min_bytes: 60,
                    top_n: 1,
                    ..Default::default()
                },
                vec![0, 2],
                Some(OtherProcesses {
                    count: 3,
                    used_bytes: 125,
                }),
            ),
            (
                Selection {
                    enabled: false,
                    ..Default::default()
                },
                vec![],
                Some(OtherProcesses {
                    count: 5,
                    used_bytes: 225,
                }),
            ),
        ];
        for (sel, want_keep, want_other) in cases {
            let (keep, other) = select(&procs, &sel);
            assert_eq!(keep, want_keep, "{sel:?}");
            assert_eq!(other, want_other, "{sel:?}");
            let kept: u64 = keep.iter().filter_map(|&i| procs[i].used_bytes).sum();
            assert_eq!(kept + other.map_or(0, |o| o.used_bytes), total, "{sel:?}");
        }
    }

    /// A pid on several GPUs is read from /proc once per full sample, and
    /// checked again (start time) in the next one.
    #[test]
    fn proc_cache_reads_a_pid_once_per_sample() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("42");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("comm"), "trainer\n").unwrap();
        std::fs::write(
            dir.join("stat"),
            "42 (trainer) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 777\n",
        )
        .unwrap();
        std::fs::write(dir.join("status"), "Uid:\t0\t0\t0\t0\n").unwrap();
        let mut cache = ProcCache::new(ProcRoot::new(root.path()));
        cache.begin_tick();
        assert_eq!(&*cache.identify(42).comm, "trainer");
        // Gone from /proc mid-sample: the second GPU's lookup is not a read.
        std::fs::remove_file(dir.join("stat")).unwrap();
        assert_eq!(&*cache.identify(42).comm, "trainer");
        assert_eq!(cache.failures(), 0);
        // The next sample checks the start time again and finds it gone.
        cache.begin_tick();
        assert_eq!(&*cache.identify(42).comm, "");
        assert_eq!(cache.failures(), 1);
    }

    #[test]
    fn backoff_doubles_to_the_cap() {
        let mut b = Backoff::new();
        let steps: Vec<u64> = (0..7).map(|_| b.step().as_secs()).collect();
        assert_eq!(steps, vec![1, 2, 4, 8, 16, 30, 30]);
        b.reset();
        assert_eq!(b.step().as_secs(), 1);
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
