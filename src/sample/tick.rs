//! One tick: read every GPU (memory; on a full tick also processes and MIG
//! instances), feed the peak windows, select the processes that get series,
//! ask attribution who they are, and build a fresh [`Snapshot`].

use super::peaks::WindowMax;
use super::select::select;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::attribute::ProcessLookup;
use crate::config::{Selection, Timing};
use crate::gpu::{GpuError, GpuSource, RawProcess};
use crate::model::{
    DeviceInfo, DeviceSample, DriverInfo, DurationHistogram, ErrorKey, MemoryInfo, MigSample,
    OtherProcesses, ProcIdentity, ProcessSample, Snapshot,
};

/// Bucket bounds (seconds) of the tick histograms: a tick costs
/// microseconds per GPU and ~20 µs per process and query.
pub const SAMPLE_DURATION_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// A lookup that knows nothing (used to build per-device state only).
struct NoLookup;

impl ProcessLookup for NoLookup {
    fn identify(&mut self, _pid: u32) -> Arc<ProcIdentity> {
        Arc::new(ProcIdentity::default())
    }
    fn retain(&mut self, _live: &dyn Fn(u32) -> bool) {}
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
    /// The timing in force.
    pub fn timing(&self) -> Timing {
        self.timing
    }

    /// A reloaded config's timing and selection.
    pub fn reconfigure(&mut self, timing: Timing, selection: Selection) {
        self.timing = timing;
        self.selection = selection;
    }

    /// Count an attempt to open NVML afresh.
    pub fn count_reinit(&mut self) {
        self.reinit_attempts += 1;
    }

    /// The GPU source, to change a fake's answers between ticks.
    pub fn gpu_mut(&mut self) -> &mut G {
        &mut self.gpu
    }

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
            // Filled in by `publish::Shared::publish`.
            exporter: Default::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::fake::{FakeDevice, FakeGpu, memory, process};
    use crate::model::MigInfo;

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
}
