//! One tick: read every GPU (memory; on a full tick also processes and MIG
//! instances), feed the peak windows, select the processes that get series,
//! ask attribution who they are, and build a fresh [`Snapshot`].

mod collect;

use super::peaks::WindowMax;
use super::select::select;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::attribute::ProcessLookup;
use crate::config::{Collectors, Selection, Timing};
use crate::gpu::{
    DRIVER_GONE, GpuError, GpuSource, MIG_LAYOUT_CHANGED, ProcessUtilizationSample, RawProcess,
};
use crate::model::{
    DeviceInfo, DeviceSample, DriverInfo, DurationHistogram, ErrorKey, Health, MemoryInfo, MigInfo,
    MigSample, OtherProcesses, PowerThermal, ProcessSample, Snapshot, Utilization,
};

/// Bucket bounds (seconds) of the tick histograms: a tick costs
/// microseconds per GPU and ~20 µs per process and query.
pub const SAMPLE_DURATION_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

struct DeviceState {
    info: Arc<DeviceInfo>,
    memory: Option<MemoryInfo>,
    used_peak: WindowMax,
    processes: Arc<[ProcessSample]>,
    other: Option<OtherProcesses>,
    process_peaks: HashMap<u32, WindowMax>,
    mig: Arc<[MigSample]>,
    /// When the MIG layout was last read; `None`: not yet.
    mig_read_at: Option<Instant>,
    utilization: Option<Utilization>,
    power: Option<PowerThermal>,
    health: Option<Health>,
    /// Newest process utilisation sample seen (NVML µs), asked after.
    putil_since: u64,
    /// Xid watch: `None` not tried yet, then whether the GPU delivers them.
    xid_watched: Option<bool>,
    /// Critical Xid events seen, by Xid.
    xid_errors: Arc<BTreeMap<u64, u64>>,
    /// The slow reads (energy, ECC mode), refreshed every
    /// [`collect::SLOW_READ_INTERVAL`]: when, and what they answered.
    slow_read_at: Option<Instant>,
    energy_mj: Option<u64>,
    ecc_enabled: Option<bool>,
    /// Failed identity reads in a row (the first one is logged).
    identify_failures: u32,
}

impl DeviceState {
    fn unknown(index: usize) -> Self {
        DeviceState {
            info: Arc::new(DeviceInfo::unknown(index)),
            memory: None,
            used_peak: WindowMax::default(),
            processes: Arc::from(Vec::new()),
            other: None,
            process_peaks: HashMap::new(),
            mig: Arc::from(Vec::new()),
            mig_read_at: None,
            identify_failures: 0,
            utilization: None,
            power: None,
            health: None,
            putil_since: 0,
            xid_watched: None,
            xid_errors: Arc::new(BTreeMap::new()),
            slow_read_at: None,
            energy_mj: None,
            ecc_enabled: None,
        }
    }

    /// No answer in this sample: no memory, no processes, no MIG memory.
    fn mark_down(&mut self) {
        self.memory = None;
        self.processes = Arc::from(Vec::new());
        self.other = None;
        self.process_peaks.clear();
        self.utilization = None;
        self.power = None;
        self.health = None;
        if self.mig.iter().any(|m| m.memory.is_some()) {
            self.mig = self
                .mig
                .iter()
                .map(|m| MigSample {
                    info: Arc::clone(&m.info),
                    memory: None,
                })
                .collect();
        }
    }
}

/// The NVML error counters, and whether one of them says the driver is
/// gone for this NVML instance ([`DRIVER_GONE`]).
struct Errors {
    counts: Arc<BTreeMap<ErrorKey, u64>>,
    driver_gone: Option<GpuError>,
}

impl Errors {
    fn count(&mut self, e: GpuError) {
        tracing::debug!(operation = e.operation, error = %e.error, "NVML call failed");
        *Arc::make_mut(&mut self.counts)
            .entry((e.operation, e.error))
            .or_insert(0) += 1;
        if self.driver_gone.is_none() && DRIVER_GONE.contains(&e.error) {
            self.driver_gone = Some(e);
        }
    }
}

/// Builds snapshots from a [`GpuSource`]. Owns all cumulative state (error
/// counters, tick histograms, peak windows), so each snapshot is complete.
///
/// Per device, a full tick walks this state machine:
/// - identity unknown (NVML enumerated the GPU but its handle or identity
///   did not answer): retried every full tick; the GPU is down meanwhile;
/// - known: memory read every tick; on a full tick also the processes, the
///   MIG layout when `mig_rescan_interval` has passed or a MIG call says it
///   changed (a process on an instance the layout does not have, a stale
///   instance handle), and each instance's memory;
/// - a driver-gone error (see [`DRIVER_GONE`]) on any call: every GPU is
///   down and [`Sampler::driver_gone`] tells the thread to re-open NVML,
///   after which [`Sampler::replace_gpu`] starts discovery over.
pub struct Sampler<G: GpuSource, P: ProcessLookup> {
    gpu: G,
    procs: P,
    timing: Timing,
    selection: Selection,
    driver: Arc<DriverInfo>,
    devices: Vec<DeviceState>,
    errors: Errors,
    durations: Arc<DurationHistogram>,
    nvml_durations: Arc<DurationHistogram>,
    memory_samples: u64,
    reinit_attempts: u64,
    scratch: Vec<RawProcess>,
    collectors: Collectors,
    /// (GPU, operation) pairs already logged as not supported.
    unsupported_logged: HashSet<(usize, &'static str)>,
    failed: Vec<GpuError>,
    putil: Vec<ProcessUtilizationSample>,
    xids: Vec<(usize, u64)>,
}

impl<G: GpuSource, P: ProcessLookup> Sampler<G, P> {
    /// The timing in force.
    pub fn timing(&self) -> Timing {
        self.timing
    }

    /// A reloaded config's timing and selection.
    pub fn reconfigure(&mut self, timing: Timing, selection: Selection, collectors: Collectors) {
        self.timing = timing;
        self.selection = selection;
        self.collectors = collectors;
    }

    /// Count an attempt to open NVML afresh.
    pub fn count_reinit(&mut self) {
        self.reinit_attempts += 1;
    }

    /// The GPU source, to change a fake's answers between ticks.
    pub fn gpu_mut(&mut self) -> &mut G {
        &mut self.gpu
    }

    /// GPUs as NVML enumerated them; identities are read by the first tick.
    pub fn new(gpu: G, procs: P, timing: Timing) -> Self {
        Sampler {
            driver: Arc::new(gpu.driver_info()),
            devices: (0..gpu.device_count()).map(DeviceState::unknown).collect(),
            gpu,
            procs,
            timing,
            selection: Selection::default(),
            errors: Errors {
                counts: Arc::new(BTreeMap::new()),
                driver_gone: None,
            },
            durations: Arc::new(DurationHistogram::new(SAMPLE_DURATION_BUCKETS)),
            nvml_durations: Arc::new(DurationHistogram::new(SAMPLE_DURATION_BUCKETS)),
            memory_samples: 0,
            reinit_attempts: 0,
            scratch: Vec::new(),
            collectors: Collectors::default(),
            unsupported_logged: HashSet::new(),
            failed: Vec::new(),
            putil: Vec::new(),
            xids: Vec::new(),
        }
    }

    /// The error that said the driver is gone for this NVML instance (RM
    /// version mismatch, driver not loaded, uninitialised), if one did.
    pub fn driver_gone(&self) -> Option<&GpuError> {
        self.errors.driver_gone.as_ref()
    }

    /// Let go of the GPU source (so NVML can be loaded afresh); every GPU
    /// is down until [`Sampler::replace_gpu`].
    pub fn close_gpu(&mut self) {
        self.gpu.close();
        self.devices.iter_mut().for_each(DeviceState::mark_down);
    }

    /// Swap in a freshly opened GPU source, keeping counters and
    /// histograms. The device list is enumerated again (the count may have
    /// changed) and every identity is read again at the next tick, so series
    /// follow the new index ↔ UUID pairs.
    pub fn replace_gpu(&mut self, gpu: G) {
        self.driver = Arc::new(gpu.driver_info());
        self.devices = (0..gpu.device_count()).map(DeviceState::unknown).collect();
        self.gpu = gpu;
        self.errors.driver_gone = None;
        self.unsupported_logged.clear();
    }

    /// Which processes get their own series.
    pub fn with_selection(mut self, selection: Selection) -> Self {
        self.selection = selection;
        self
    }

    /// Which collectors run.
    pub fn with_collectors(mut self, collectors: Collectors) -> Self {
        self.collectors = collectors;
        self
    }

    /// Read one GPU's memory and feed its peak window. Returns the time
    /// spent in NVML.
    fn read_memory(&mut self, i: usize, now: Instant) -> Duration {
        let window = self.timing.peak_window;
        if self.errors.driver_gone.is_some() || !self.devices[i].info.is_known() {
            let dev = &mut self.devices[i];
            dev.mark_down();
            dev.used_peak.expire(now, window);
            return Duration::ZERO;
        }
        let t = Instant::now();
        let result = self.gpu.memory(i);
        let spent = t.elapsed();
        let dev = &mut self.devices[i];
        match result {
            Ok(m) => {
                dev.used_peak.push(now, m.used, window);
                dev.memory = Some(m);
            }
            Err(e) => {
                dev.memory = None;
                dev.used_peak.expire(now, window);
                self.errors.count(e);
            }
        }
        spent
    }

    /// Read a GPU's identity and MIG layout; on success the GPU is known
    /// from now on. Failures are counted, and the first of a run is logged.
    fn discover(&mut self, i: usize, now: Instant) {
        let found = self
            .gpu
            .identify(i)
            .and_then(|info| Ok((info, self.gpu.mig_layout(i)?)));
        let dev = &mut self.devices[i];
        match found {
            Ok((info, layout)) => {
                if dev.identify_failures > 0 {
                    tracing::info!(
                        gpu = i,
                        uuid = %info.uuid,
                        failures = dev.identify_failures,
                        "GPU answered; its series start now"
                    );
                }
                dev.info = Arc::new(info);
                dev.mig = layout_samples(layout);
                dev.mig_read_at = Some(now);
                dev.identify_failures = 0;
            }
            Err(e) => {
                if dev.identify_failures == 0 {
                    tracing::warn!(
                        gpu = i,
                        operation = e.operation,
                        error = e.error,
                        "GPU identity cannot be read; it is exported as gpu_up 0 and retried at each full sample"
                    );
                }
                dev.identify_failures = dev.identify_failures.saturating_add(1);
                self.errors.count(e);
            }
        }
    }

    /// Read GPU `i`'s MIG layout again; a changed layout replaces the
    /// instance list (instances that vanished leave no series).
    fn rescan_mig(&mut self, i: usize, now: Instant) {
        let result = self.gpu.mig_layout(i);
        let dev = &mut self.devices[i];
        dev.mig_read_at = Some(now);
        match result {
            Ok(layout) => {
                let same = layout.len() == dev.mig.len()
                    && layout
                        .iter()
                        .zip(dev.mig.iter())
                        .all(|(a, b)| *a == *b.info);
                if !same {
                    tracing::info!(
                        gpu = i,
                        before = dev.mig.len(),
                        after = layout.len(),
                        "MIG layout changed"
                    );
                    dev.mig = layout_samples(layout);
                }
            }
            Err(e) => self.errors.count(e),
        }
    }

    /// Each MIG instance's memory. Returns whether a failure says the
    /// layout changed under the handles.
    fn read_mig_memory(&mut self, i: usize) -> bool {
        let mut changed = false;
        let mut mig = Vec::with_capacity(self.devices[i].mig.len());
        for k in 0..self.devices[i].mig.len() {
            let memory = match self.gpu.mig_memory(i, k) {
                Ok(mem) => Some(mem),
                Err(e) => {
                    changed |= MIG_LAYOUT_CHANGED.contains(&e.error);
                    self.errors.count(e);
                    None
                }
            };
            mig.push(MigSample {
                info: Arc::clone(&self.devices[i].mig[k].info),
                memory,
            });
        }
        self.devices[i].mig = Arc::from(mig);
        changed
    }

    /// A listed process runs on a MIG instance the layout does not have.
    fn unknown_instance(&self, i: usize) -> bool {
        let mig = &self.devices[i].mig;
        self.scratch.iter().any(|p| {
            p.gpu_instance_id.is_some_and(|gi| {
                !mig.iter().any(|m| {
                    m.info.gpu_instance_id == gi
                        && p.compute_instance_id
                            .is_none_or(|ci| ci == m.info.compute_instance_id)
                })
            })
        })
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

    /// A full sample: identities still unknown, memory, MIG layout when due,
    /// processes and /proc for every GPU.
    pub fn tick(&mut self) -> Snapshot {
        let started = Instant::now();
        self.procs.begin_tick();
        let window = self.timing.peak_window;
        let rescan_every = self.timing.mig_rescan_interval;
        let mut in_nvml = Duration::ZERO;
        for i in 0..self.devices.len() {
            if self.errors.driver_gone.is_none() && !self.devices[i].info.is_known() {
                let t = Instant::now();
                self.discover(i, started);
                in_nvml += t.elapsed();
            }
            in_nvml += self.read_memory(i, started);
            if self.devices[i].memory.is_none() {
                self.devices[i].mark_down();
                continue;
            }
            self.scratch.clear();
            let t = Instant::now();
            if self.devices[i]
                .mig_read_at
                .is_none_or(|at| at != started && started.duration_since(at) >= rescan_every)
            {
                self.rescan_mig(i, started);
            }
            self.read_collectors(i, started);
            let listed = if self.collectors.processes {
                self.gpu.processes(i, &mut self.scratch)
            } else {
                Ok(())
            };
            let putil = (self.collectors.processes && self.collectors.process_utilization)
                .then(|| self.read_process_utilization(i))
                .flatten();
            let rescanned = |s: &Self| s.devices[i].mig_read_at == Some(started);
            if listed.is_ok() && !rescanned(self) && self.unknown_instance(i) {
                self.rescan_mig(i, started);
            }
            if self.read_mig_memory(i) && !rescanned(self) {
                self.rescan_mig(i, started);
                self.read_mig_memory(i);
            }
            in_nvml += t.elapsed();
            if let Err(e) = listed {
                self.errors.count(e);
                self.devices[i].mark_down();
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
                    utilization: putil
                        .as_ref()
                        .map(|u| u.get(&p.pid).copied().unwrap_or_default()),
                });
            }
            dev.processes = Arc::from(list);
            dev.other = other;
        }
        if self.collectors.health && self.errors.driver_gone.is_none() {
            let t = Instant::now();
            self.read_xid();
            in_nvml += t.elapsed();
        }
        if self.errors.driver_gone.is_some() {
            // Calls made before the error in this tick answered from a
            // driver that is now gone: nothing of this tick is trusted.
            self.devices.iter_mut().for_each(DeviceState::mark_down);
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

    /// The state as it stands, without calling NVML (every GPU is down
    /// while the source is closed).
    pub fn snapshot(&self) -> Snapshot {
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
                    utilization: d.utilization,
                    power: d.power,
                    health: d.health.clone(),
                })
                .collect(),
            nvml_errors: Arc::clone(&self.errors.counts),
            sample_duration: Arc::clone(&self.durations),
            sample_nvml_duration: Arc::clone(&self.nvml_durations),
            memory_samples: self.memory_samples,
            process_lookup_failures: self.procs.failures(),
            nvml_reinit_attempts: self.reinit_attempts,
            kubernetes: self.procs.kubernetes(),
            torch: self.procs.torch_counters(),
            // Filled in by `publish::Shared::publish`.
            pod_resources: None,
            exporter: Default::default(),
        }
    }
}

/// A MIG layout as samples without memory (read in the same tick).
fn layout_samples(layout: Vec<MigInfo>) -> Arc<[MigSample]> {
    layout
        .into_iter()
        .map(|m| MigSample {
            info: Arc::new(m),
            memory: None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::fake::{FakeDevice, FakeGpu, memory, process};
    use crate::model::ProcIdentity;

    const GIB: u64 = 1 << 30;

    /// A lookup that records what the sampler asks and names pid `n` "pn".
    #[derive(Default)]
    struct Recorder {
        identified: Vec<u32>,
        torch_asked: Vec<(u32, Vec<String>)>,
        live_after_tick: Vec<u32>,
    }

    impl ProcessLookup for Recorder {
        fn identify(&mut self, pid: u32) -> Arc<ProcIdentity> {
            self.identified.push(pid);
            Arc::new(ProcIdentity {
                comm: Arc::from(format!("p{pid}")),
                ..ProcIdentity::default()
            })
        }
        fn retain(&mut self, live: &dyn Fn(u32) -> bool) {
            self.live_after_tick = (0..100).filter(|p| live(*p)).collect();
        }
        fn torch(&mut self, pid: u32, uuids: &[&str]) -> Option<crate::model::TorchStats> {
            self.torch_asked
                .push((pid, uuids.iter().map(|u| u.to_string()).collect()));
            None
        }
    }

    fn timing() -> Timing {
        Timing {
            sample_interval: Duration::from_secs(1),
            memory_sample_interval: Duration::from_millis(100),
            peak_window: Duration::from_secs(30),
            mig_rescan_interval: Duration::from_secs(10),
        }
    }

    fn lost(operation: &'static str) -> GpuError {
        GpuError {
            operation,
            error: "gpu_lost",
        }
    }

    #[test]
    fn a_full_tick_lists_selects_and_names_processes() {
        let mut d0 = FakeDevice::new(0, 80 * GIB, 10 * GIB);
        // pid 10 listed twice (compute and graphics): one entry.
        d0.processes = Ok(vec![
            process(30, GIB),
            process(10, 5 * GIB),
            process(20, 3 * GIB),
            process(10, 5 * GIB),
        ]);
        let gpu = FakeGpu::new(vec![d0, FakeDevice::new(1, 80 * GIB, 0)]);
        let selection = Selection {
            enabled: true,
            min_bytes: 0,
            top_n: 2,
        };
        let mut s = Sampler::new(gpu, Recorder::default(), timing()).with_selection(selection);
        let snap = s.tick();
        assert_eq!(snap.devices.len(), 2);
        let d = &snap.devices[0];
        assert!(d.up());
        assert_eq!(d.memory.map(|m| m.used), Some(10 * GIB));
        let listed: Vec<(u32, &str, Option<u64>)> = d
            .processes
            .iter()
            .map(|p| (p.pid, &*p.ident.comm, p.used_bytes))
            .collect();
        assert_eq!(
            listed,
            vec![(10, "p10", Some(5 * GIB)), (20, "p20", Some(3 * GIB))]
        );
        assert_eq!(
            d.other,
            Some(OtherProcesses {
                count: 1,
                used_bytes: GIB
            })
        );
        assert!(snap.devices[1].processes.is_empty());
        assert_eq!(snap.devices[1].other, None);
        // Only processes with a series are looked up, and kept in the cache.
        assert_eq!(s.procs.identified, vec![10, 20]);
        assert_eq!(s.procs.live_after_tick, vec![10, 20]);
        assert_eq!(snap.sample_duration.count, 1);
    }

    #[test]
    fn a_gpu_that_fails_is_down_and_counted_while_the_others_report() {
        let mut d1 = FakeDevice::new(1, 80 * GIB, GIB);
        d1.memory = Err(lost("memory_info"));
        let gpu = FakeGpu::new(vec![FakeDevice::new(0, 80 * GIB, GIB), d1]);
        let mut s = Sampler::new(gpu, Recorder::default(), timing());
        s.tick();
        let snap = s.tick();
        assert!(snap.devices[0].up());
        assert!(!snap.devices[1].up());
        assert_eq!(snap.devices[1].used_peak_bytes, None, "no fake peak");
        assert_eq!(snap.nvml_errors.get(&("memory_info", "gpu_lost")), Some(&2));
        // Its processes are not queried while its memory fails.
        assert_eq!(s.gpu_mut().process_calls, 2, "GPU 0 only, twice");
        // It answers again: up, with no restart.
        s.gpu_mut().devices[1].memory = Ok(memory(80 * GIB, 2 * GIB));
        assert!(s.tick().devices[1].up());
    }

    #[test]
    fn a_failed_process_query_leaves_the_gpu_down_for_that_sample() {
        let mut d0 = FakeDevice::new(0, 80 * GIB, GIB);
        d0.processes = Err(lost("running_compute_processes"));
        let mut s = Sampler::new(FakeGpu::new(vec![d0]), Recorder::default(), timing());
        let snap = s.tick();
        assert!(!snap.devices[0].up());
        assert!(snap.devices[0].processes.is_empty());
        assert_eq!(
            snap.nvml_errors
                .get(&("running_compute_processes", "gpu_lost")),
            Some(&1)
        );
    }

    #[test]
    fn peaks_include_memory_ticks_between_full_ticks() {
        let gpu = FakeGpu::new(vec![FakeDevice::new(0, 80 * GIB, 10 * GIB)]);
        let mut s = Sampler::new(gpu, Recorder::default(), timing());
        s.tick();
        s.gpu_mut().devices[0].memory = Ok(memory(80 * GIB, 40 * GIB));
        s.tick_memory();
        s.gpu_mut().devices[0].memory = Ok(memory(80 * GIB, 12 * GIB));
        let snap = s.tick_memory();
        let d = &snap.devices[0];
        assert_eq!(d.memory.map(|m| m.used), Some(12 * GIB));
        assert_eq!(d.used_peak_bytes, Some(40 * GIB));
        assert_eq!(snap.memory_samples, 2);
        assert_eq!(
            snap.sample_duration.count, 1,
            "memory ticks are not full ones"
        );
    }

    #[test]
    fn mig_instances_are_read_and_torch_is_asked_for_the_instance_first() {
        let mig = |uuid: &str, gi: u32| MigInfo {
            mig_uuid: uuid.into(),
            name: "MIG 3g.40gb".into(),
            gpu_instance_id: gi,
            compute_instance_id: 0,
        };
        let mut d0 = FakeDevice::new(0, 80 * GIB, 3 * GIB);
        d0.mig = vec![
            (mig("MIG-a", 1), Ok(memory(40 * GIB, 2 * GIB))),
            (mig("MIG-b", 2), Err(lost("mig_memory_info"))),
        ];
        d0.processes = Ok(vec![
            RawProcess {
                pid: 7,
                used_bytes: Some(GIB),
                gpu_instance_id: Some(1),
                compute_instance_id: Some(0),
            },
            process(8, GIB),
        ]);
        let mut s = Sampler::new(FakeGpu::new(vec![d0]), Recorder::default(), timing());
        let snap = s.tick();
        let d = &snap.devices[0];
        assert_eq!(d.mig.len(), 2);
        assert_eq!(d.mig[0].memory.map(|m| m.used), Some(2 * GIB));
        assert_eq!(d.mig[1].memory, None);
        assert_eq!(
            snap.nvml_errors.get(&("mig_memory_info", "gpu_lost")),
            Some(&1)
        );
        assert_eq!(
            s.procs.torch_asked,
            vec![
                (7, vec!["MIG-a".to_string(), "GPU-fake-0000".to_string()]),
                (8, vec!["GPU-fake-0000".to_string()]),
            ]
        );
    }

    fn mig(uuid: &str, gi: u32) -> MigInfo {
        MigInfo {
            mig_uuid: uuid.into(),
            name: "MIG 1g.18gb".into(),
            gpu_instance_id: gi,
            compute_instance_id: 0,
        }
    }

    fn on_instance(pid: u32, gi: u32) -> RawProcess {
        RawProcess {
            pid,
            used_bytes: Some(GIB),
            gpu_instance_id: Some(gi),
            compute_instance_id: Some(0),
        }
    }

    fn up_uuids(snap: &Snapshot) -> Vec<(String, String, bool)> {
        snap.devices
            .iter()
            .map(|d| (d.info.gpu.clone(), d.info.uuid.clone(), d.up()))
            .collect()
    }

    #[test]
    fn healthy_then_lost_then_back_keeps_its_identity() {
        let gpu = FakeGpu::new(vec![FakeDevice::new(0, 80 * GIB, GIB)]);
        let mut s = Sampler::new(gpu, Recorder::default(), timing());
        assert!(s.tick().devices[0].up());
        s.gpu_mut().devices[0].memory = Err(lost("memory_info"));
        let snap = s.tick();
        assert_eq!(
            up_uuids(&snap),
            vec![("0".into(), "GPU-fake-0000".into(), false)],
            "a lost GPU keeps its uuid on gpu_up 0"
        );
        s.gpu_mut().devices[0].memory = Ok(memory(80 * GIB, 3 * GIB));
        let snap = s.tick();
        assert_eq!(snap.devices[0].memory.map(|m| m.used), Some(3 * GIB));
        assert_eq!(s.gpu_mut().identify_calls, 1, "identity is read once");
        assert!(s.driver_gone().is_none());
    }

    #[test]
    fn an_unknown_identity_is_retried_each_full_tick_until_known() {
        let mut d2 = FakeDevice::new(2, 80 * GIB, 7 * GIB);
        d2.identity_error = Some(lost("device_uuid"));
        let gpu = FakeGpu::new(vec![
            FakeDevice::new(0, 80 * GIB, GIB),
            FakeDevice::new(1, 80 * GIB, 2 * GIB),
            d2,
        ]);
        let mut s = Sampler::new(gpu, Recorder::default(), timing());
        let snap = s.tick();
        assert_eq!(
            up_uuids(&snap),
            vec![
                ("0".into(), "GPU-fake-0000".into(), true),
                ("1".into(), "GPU-fake-0001".into(), true),
                ("2".into(), String::new(), false),
            ]
        );
        assert!(!snap.devices[2].info.is_known());
        // Memory ticks do not retry identities, full ticks do.
        s.tick_memory();
        assert_eq!(s.gpu_mut().identify_calls, 3);
        let snap = s.tick();
        assert_eq!(s.gpu_mut().identify_calls, 4);
        assert_eq!(snap.nvml_errors.get(&("device_uuid", "gpu_lost")), Some(&2));
        assert_eq!(
            snap.nvml_errors.get(&("memory_info", "gpu_lost")),
            None,
            "no memory call on a GPU without identity"
        );
        s.gpu_mut().devices[2].identity_error = None;
        let snap = s.tick();
        assert_eq!(snap.devices[2].info.uuid, "GPU-fake-0002");
        assert_eq!(snap.devices[2].memory.map(|m| m.used), Some(7 * GIB));
        assert_eq!(s.gpu_mut().identify_calls, 5);
    }

    #[test]
    fn mig_layouts_are_followed_two_three_then_off() {
        let mut d0 = FakeDevice::new(0, 80 * GIB, 3 * GIB);
        d0.mig = vec![
            (mig("MIG-a", 1), Ok(memory(18 * GIB, GIB))),
            (mig("MIG-b", 2), Ok(memory(18 * GIB, 0))),
        ];
        d0.processes = Ok(vec![on_instance(7, 1)]);
        let mut s = Sampler::new(FakeGpu::new(vec![d0]), Recorder::default(), timing());
        let snap = s.tick();
        let uuids = |snap: &Snapshot| -> Vec<String> {
            snap.devices[0]
                .mig
                .iter()
                .map(|m| m.info.mig_uuid.clone())
                .collect()
        };
        assert_eq!(uuids(&snap), vec!["MIG-a", "MIG-b"]);
        assert_eq!(s.gpu_mut().mig_layout_calls, 1);
        // A third instance with a process on it: the process names an
        // instance the layout lacks, so the layout is read in that tick.
        let d = &mut s.gpu_mut().devices[0];
        d.mig.push((mig("MIG-c", 3), Ok(memory(18 * GIB, 2 * GIB))));
        d.processes = Ok(vec![on_instance(7, 1), on_instance(8, 3)]);
        let snap = s.tick();
        assert_eq!(uuids(&snap), vec!["MIG-a", "MIG-b", "MIG-c"]);
        assert_eq!(snap.devices[0].mig[2].memory.map(|m| m.used), Some(2 * GIB));
        let pids: Vec<(u32, Option<u32>)> = snap.devices[0]
            .processes
            .iter()
            .map(|p| (p.pid, p.gpu_instance_id))
            .collect();
        assert_eq!(pids, vec![(7, Some(1)), (8, Some(3))]);
        assert_eq!(
            s.procs.torch_asked.last(),
            Some(&(8, vec!["MIG-c".to_string(), "GPU-fake-0000".to_string()])),
            "torch is asked for the new instance"
        );
        assert_eq!(s.gpu_mut().mig_layout_calls, 2);
        // A steady layout is not read again before mig_rescan_interval.
        s.tick();
        assert_eq!(s.gpu_mut().mig_layout_calls, 2);
        // MIG turned off: the stale instance handles fail, the layout is
        // read again at once, and no instance is left.
        let d = &mut s.gpu_mut().devices[0];
        d.mig.clear();
        d.processes = Ok(vec![process(9, GIB)]);
        let snap = s.tick();
        assert!(snap.devices[0].mig.is_empty());
        assert!(snap.devices[0].up());
        assert_eq!(
            snap.nvml_errors.get(&("mig_memory_info", "invalid_arg")),
            Some(&3),
            "each stale handle failed once"
        );
        assert_eq!(s.gpu_mut().mig_layout_calls, 3);
    }

    #[test]
    fn the_layout_is_read_again_every_rescan_interval() {
        let gpu = FakeGpu::new(vec![FakeDevice::new(0, 80 * GIB, GIB)]);
        let t = Timing {
            mig_rescan_interval: Duration::ZERO,
            ..timing()
        };
        let mut s = Sampler::new(gpu, Recorder::default(), t);
        s.tick();
        s.tick();
        s.tick_memory();
        s.tick();
        // Identity (1) + one rescan per later full tick (2).
        assert_eq!(s.gpu_mut().mig_layout_calls, 3);
    }

    #[test]
    fn a_driver_gone_error_downs_every_gpu_and_a_reopen_enumerates_again() {
        let gpu = FakeGpu::new(vec![
            FakeDevice::new(0, 80 * GIB, GIB),
            FakeDevice::new(1, 80 * GIB, GIB),
        ]);
        let mut s = Sampler::new(gpu, Recorder::default(), timing());
        assert!(s.tick().devices.iter().all(|d| d.up()));
        s.gpu_mut().devices[0].memory = Err(GpuError {
            operation: "memory_info",
            error: "lib_rm_version_mismatch",
        });
        let snap = s.tick();
        assert!(snap.devices.iter().all(|d| !d.up()), "nothing is trusted");
        assert_eq!(
            s.driver_gone().map(|e| e.error),
            Some("lib_rm_version_mismatch")
        );
        assert_eq!(
            snap.nvml_errors
                .get(&("memory_info", "lib_rm_version_mismatch")),
            Some(&1)
        );
        s.close_gpu();
        assert!(s.gpu_mut().closed);
        assert!(s.snapshot().devices.iter().all(|d| !d.up()));
        // The driver comes back with three GPUs, the old GPU 1 now at 0.
        let mut a = FakeDevice::new(1, 80 * GIB, 5 * GIB);
        a.info.gpu = "0".into();
        let mut b = FakeDevice::new(7, 80 * GIB, 6 * GIB);
        b.info.gpu = "1".into();
        let mut c = FakeDevice::new(8, 80 * GIB, 0);
        c.info.gpu = "2".into();
        s.count_reinit();
        s.replace_gpu(FakeGpu::new(vec![a, b, c]));
        assert!(s.driver_gone().is_none());
        let snap = s.tick();
        assert_eq!(
            up_uuids(&snap),
            vec![
                ("0".into(), "GPU-fake-0001".into(), true),
                ("1".into(), "GPU-fake-0007".into(), true),
                ("2".into(), "GPU-fake-0008".into(), true),
            ]
        );
        assert_eq!(snap.devices[0].memory.map(|m| m.used), Some(5 * GIB));
        assert_eq!(snap.nvml_reinit_attempts, 1);
        assert_eq!(
            snap.nvml_errors
                .get(&("memory_info", "lib_rm_version_mismatch")),
            Some(&1),
            "counters survive the re-open"
        );
    }

    fn all_on() -> Collectors {
        Collectors {
            processes: true,
            utilization: true,
            process_utilization: true,
            power_thermal: true,
            health: true,
        }
    }

    #[test]
    fn collectors_read_what_the_gpu_supports_and_skip_the_rest() {
        use crate::model::{ProcessUtilization, RemappedRows};
        let mut d0 = FakeDevice::new(0, 80 * GIB, GIB);
        d0.utilization = Utilization {
            gpu: Some(93),
            memory: Some(41),
            encoder: None,
            decoder: None,
        };
        d0.power.temperature_c = Some(44);
        d0.power.power_mw = Some(123_456);
        d0.health.ecc_enabled = Some(true);
        d0.health.remapped_rows = Some(RemappedRows {
            correctable: 0,
            uncorrectable: 1,
            pending: true,
            failed: false,
        });
        d0.processes = Ok(vec![process(7, GIB), process(8, GIB)]);
        let sample = |pid, ts, sm| ProcessUtilizationSample {
            pid,
            timestamp_us: ts,
            utilization: ProcessUtilization {
                sm,
                memory: 5,
                encoder: 0,
                decoder: 0,
            },
        };
        // pid 7: two samples, the later wins; pid 8: none (idle).
        d0.process_utilization = Some(vec![sample(7, 10, 50), sample(7, 20, 90)]);
        d0.xid = Some(vec![79, 48, 79]);
        let d1 = FakeDevice::new(1, 80 * GIB, GIB); // supports nothing
        let mut s = Sampler::new(FakeGpu::new(vec![d0, d1]), Recorder::default(), timing())
            .with_collectors(all_on());
        let snap = s.tick();
        let d = &snap.devices[0];
        assert_eq!(
            d.utilization.map(|u| (u.gpu, u.encoder)),
            Some((Some(93), None))
        );
        assert_eq!(d.power.and_then(|p| p.power_mw), Some(123_456));
        let h = d.health.as_ref().unwrap();
        assert_eq!(h.remapped_rows.map(|r| r.pending), Some(true));
        let xids: Vec<(u64, u64)> = h
            .xid_errors
            .as_ref()
            .unwrap()
            .iter()
            .map(|(k, v)| (*k, *v))
            .collect();
        assert_eq!(xids, vec![(48, 1), (79, 2)]);
        let utils: Vec<(u32, Option<u32>)> = d
            .processes
            .iter()
            .map(|p| (p.pid, p.utilization.map(|u| u.sm)))
            .collect();
        assert_eq!(utils, vec![(7, Some(90)), (8, Some(0))]);
        // GPU 1 supports none of it: no figures, no Xid family, and
        // nothing counted as an NVML error.
        let d = &snap.devices[1];
        assert_eq!(d.utilization.and_then(|u| u.gpu), None);
        assert_eq!(d.health.as_ref().and_then(|h| h.xid_errors.clone()), None);
        assert!(d.processes.is_empty());
        assert!(snap.nvml_errors.is_empty(), "{:?}", snap.nvml_errors);
        assert_eq!(s.unsupported_logged.len(), 12, "{:?}", s.unsupported_logged);
        // The next sample asks only for newer process samples: pid 7 idle.
        let snap = s.tick();
        assert_eq!(
            snap.devices[0].processes[0].utilization.map(|u| u.sm),
            Some(0)
        );
        assert_eq!(s.gpu_mut().xid_watched, vec![0], "watched once");
        assert_eq!(
            s.gpu_mut().slow_calls,
            4,
            "energy and ECC mode once per GPU within SLOW_READ_INTERVAL"
        );
        assert_eq!(
            snap.devices[0].health.as_ref().and_then(|h| h.ecc_enabled),
            Some(true),
            "the ECC mode is kept between slow reads"
        );
    }

    #[test]
    fn switched_off_collectors_make_no_calls() {
        let gpu = FakeGpu::new(vec![FakeDevice::new(0, 80 * GIB, GIB)]);
        let off = Collectors {
            processes: false,
            utilization: false,
            process_utilization: true, // needs processes: no calls either
            power_thermal: false,
            health: false,
        };
        let mut s = Sampler::new(gpu, Recorder::default(), timing()).with_collectors(off);
        let snap = s.tick();
        assert!(snap.devices[0].up());
        assert_eq!(s.gpu_mut().collector_calls, [0; 5]);
        assert_eq!(s.gpu_mut().process_calls, 0);
        let d = &snap.devices[0];
        assert!(d.utilization.is_none() && d.power.is_none() && d.health.is_none());
        // Switched on by a reload: called from the next sample.
        s.reconfigure(timing(), Selection::default(), all_on());
        s.tick();
        assert_eq!(s.gpu_mut().collector_calls, [1, 1, 1, 1, 1]);
        assert_eq!(s.gpu_mut().process_calls, 1);
    }

    #[test]
    fn a_collector_call_that_fails_otherwise_is_counted_and_unsupported_is_not() {
        let mut d0 = FakeDevice::new(0, 80 * GIB, GIB);
        d0.power.temperature_c = Some(40);
        let mut s = Sampler::new(FakeGpu::new(vec![d0]), Recorder::default(), timing())
            .with_collectors(Collectors {
                utilization: false,
                health: false,
                ..all_on()
            });
        s.tick();
        let snap = s.tick();
        assert!(snap.nvml_errors.is_empty(), "{:?}", snap.nvml_errors);
        assert_eq!(
            snap.devices[0].power.and_then(|p| p.temperature_c),
            Some(40)
        );
        s.gpu_mut().devices[0].collector_error = Some(lost("temperature"));
        let snap = s.tick();
        assert_eq!(snap.nvml_errors.get(&("temperature", "gpu_lost")), Some(&1));
        assert_eq!(snap.devices[0].power.and_then(|p| p.temperature_c), None);
    }
}
