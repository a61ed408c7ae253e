//! One tick: read every GPU (memory; on a full tick also identity, MIG,
//! the collectors that are on and the processes), and build a fresh
//! [`Snapshot`]. The [`Sampler`] owns all cumulative state (error counters,
//! tick histograms, peak windows, the collectors' state), so each snapshot
//! is complete.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use super::device::DeviceState;
use super::errors::Errors;
use super::limits::CgroupLimits;
use super::processes;
use crate::attribute::ProcessLookup;
use crate::bridge::Figures;
use crate::collectors::{Context, Def, REGISTRY, Running};
use crate::config::{SamplerConfig, Selection, Timing};
use crate::gpu::{GpuError, GpuSource, RawProcess};
use crate::model::{
    Accounts, DeviceSample, DriverInfo, DurationHistogram, ErrorKey, Limits, MemoryInfo, Readings,
    Snapshot,
};

/// An unchanged memory-only sample is published anyway once the last
/// snapshot is this old, so the served sample's time
/// (`gpumem_exporter_last_sample_timestamp_seconds`) never lags the
/// sampler by more, whatever the full sample's interval.
pub(crate) const UNCHANGED_REPUBLISH: Duration = Duration::from_secs(1);

/// Bucket bounds (seconds) of the tick histograms: a tick costs
/// microseconds per GPU and ~20 µs per process and query.
pub const SAMPLE_DURATION_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// Builds snapshots from a [`GpuSource`] (see `device.rs` for the per-GPU
/// state machine). A driver-gone error on any call downs every GPU, and
/// [`Sampler::driver_gone`] tells the thread to re-open NVML, after which
/// [`Sampler::replace_gpu`] starts discovery over.
pub struct Sampler<G: GpuSource, P: ProcessLookup> {
    gpu: G,
    procs: P,
    /// The torch bridge's reader, when that source is on: a per-process
    /// reading keyed by (pid, start time), beside identity.
    bridge: Option<Box<dyn Figures>>,
    config: SamplerConfig,
    driver: Arc<DriverInfo>,
    devices: Vec<DeviceState>,
    collectors: Running,
    errors: Errors,
    durations: Arc<DurationHistogram>,
    nvml_durations: Arc<DurationHistogram>,
    memory_samples: u64,
    reinit_attempts: u64,
    /// The process list of the GPU being read (reused between GPUs).
    listed: Vec<RawProcess>,
    /// The cgroup-keyed limits (driver, dmem), on their own interval.
    limits: CgroupLimits,
    /// Placeholders for what publish fills in (the ledger's totals, the
    /// pod limits and the per-workload rows), made once: each snapshot
    /// shares these `Arc`s instead of allocating empty ones ten times a
    /// second only for publish to drop them.
    blank_accounts: Accounts,
    blank_limits: Limits,
    /// A down GPU's readings (none), shared the same way.
    blank_readings: Arc<Readings>,
    /// Each GPU's readings as of the last full sample (the collectors'
    /// and the unattributed bytes'): a memory-only sample carries them
    /// again without asking every collector; `None` once anything that
    /// changes them ran (a full sample sets them anew).
    readings: Option<Vec<Arc<Readings>>>,
    /// What the last snapshot built showed of each GPU's memory (reading
    /// and peak) and of the error counts: a memory-only sample that
    /// changes none of it need not be published
    /// ([`Sampler::tick_memory_if_changed`]).
    shown: Shown,
}

/// What a memory-only sample can change in a snapshot, as the last one
/// built showed it.
#[derive(Default)]
struct Shown {
    memory: Vec<(Option<MemoryInfo>, Option<u64>)>,
    /// The error counts' `Arc` that snapshot holds: any count since
    /// replaces it (`Arc::make_mut` on a shared map), so pointer equality
    /// means no NVML call failed since.
    errors: Option<Arc<BTreeMap<ErrorKey, u64>>>,
    taken_at: Option<Instant>,
}

impl<G: GpuSource, P: ProcessLookup> Sampler<G, P> {
    /// GPUs as NVML enumerated them; identities are read by the first tick.
    pub fn new(gpu: G, procs: P, config: SamplerConfig) -> Self {
        Self::with_registry(gpu, procs, config, REGISTRY)
    }

    /// [`Sampler::new`] with another collector table (tests add to it).
    pub fn with_registry(
        gpu: G,
        procs: P,
        config: SamplerConfig,
        registry: &'static [Def],
    ) -> Self {
        Sampler {
            driver: Arc::new(gpu.driver_info()),
            devices: (0..gpu.device_count()).map(DeviceState::unknown).collect(),
            gpu,
            procs,
            bridge: None,
            collectors: Running::new(registry, &config.collectors),
            limits: CgroupLimits::new(config.timing.limits_interval, config.cgroupfs.clone()),
            config,
            errors: Errors::new(),
            durations: Arc::new(DurationHistogram::new(SAMPLE_DURATION_BUCKETS)),
            nvml_durations: Arc::new(DurationHistogram::new(SAMPLE_DURATION_BUCKETS)),
            memory_samples: 0,
            reinit_attempts: 0,
            listed: Vec::new(),
            blank_accounts: Accounts::default(),
            blank_limits: Limits::default(),
            blank_readings: Arc::default(),
            readings: None,
            shown: Shown::default(),
        }
    }

    /// Read the torch bridge's figures through `reader` (the pipeline
    /// starts it).
    pub(crate) fn with_bridge(mut self, reader: Option<Box<dyn Figures>>) -> Self {
        self.bridge = reader;
        self
    }

    /// The timing in force.
    pub fn timing(&self) -> Timing {
        self.config.timing
    }

    /// A reloaded config: intervals, selection and collectors apply from
    /// the next tick (a collector switched off takes its state with it).
    pub fn reconfigure(&mut self, config: SamplerConfig) {
        self.readings = None;
        self.collectors.switch(&config.collectors);
        self.limits
            .configure(config.timing.limits_interval, config.cgroupfs.clone());
        self.config = config;
    }

    /// Count an attempt to open NVML afresh.
    pub fn count_reinit(&mut self) {
        self.reinit_attempts += 1;
    }

    /// The GPU source, to change a fake's answers between ticks.
    pub fn gpu_mut(&mut self) -> &mut G {
        &mut self.gpu
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
        self.mark_all_down();
    }

    /// Swap in a freshly opened GPU source, keeping counters and
    /// histograms. The device list is enumerated again (the count may have
    /// changed) and every identity is read again at the next tick, so series
    /// follow the new index ↔ UUID pairs; the collectors start over.
    pub fn replace_gpu(&mut self, gpu: G) {
        self.driver = Arc::new(gpu.driver_info());
        self.devices = (0..gpu.device_count()).map(DeviceState::unknown).collect();
        self.gpu = gpu;
        self.errors.reopened();
        self.readings = None;
        self.collectors.restart();
    }

    /// Which processes get their own series.
    pub fn with_selection(mut self, selection: Selection) -> Self {
        self.config.selection = selection;
        self
    }

    fn mark_all_down(&mut self) {
        self.readings = None;
        for dev in &mut self.devices {
            dev.mark_down();
        }
        for c in self.collectors.each() {
            (0..self.devices.len()).for_each(|i| c.forget(i));
        }
    }

    /// A memory-only sample of every GPU (the rest keeps the last full
    /// sample's figures).
    pub fn tick_memory(&mut self) -> Snapshot {
        let now = Instant::now();
        self.read_memory_only(now);
        self.emit(now)
    }

    /// [`Sampler::tick_memory`], but `None` when the sample changed
    /// nothing a snapshot shows (every GPU's memory and peak as the last
    /// snapshot built showed them, no NVML call failed, no full sample's
    /// state reset since) and that snapshot is younger than
    /// [`UNCHANGED_REPUBLISH`]: an idle GPU's 10 Hz samples then publish
    /// nothing, and scrapes keep the cached body. The sample is still
    /// counted (`memory_samples`), and shown with the next snapshot.
    pub fn tick_memory_if_changed(&mut self) -> Option<Snapshot> {
        self.tick_memory_if_changed_at(Instant::now())
    }

    /// [`Sampler::tick_memory_if_changed`] at `now`.
    fn tick_memory_if_changed_at(&mut self, now: Instant) -> Option<Snapshot> {
        self.read_memory_only(now);
        let fresh = self
            .shown
            .taken_at
            .is_some_and(|t| now.saturating_duration_since(t) < UNCHANGED_REPUBLISH);
        if fresh && self.unchanged() {
            return None;
        }
        Some(self.emit(now))
    }

    /// Whether the memory read since the last snapshot built is what it
    /// showed (see [`Shown`]).
    fn unchanged(&self) -> bool {
        self.readings.is_some()
            && self
                .shown
                .errors
                .as_ref()
                .is_some_and(|e| Arc::ptr_eq(e, &self.errors.counts))
            && self.shown.memory.len() == self.devices.len()
            && self
                .devices
                .iter()
                .zip(&self.shown.memory)
                .all(|(d, shown)| (d.memory, d.memory.and(d.used_peak.max())) == *shown)
    }

    /// The snapshot of the state as it stands, remembered as shown.
    fn emit(&mut self, now: Instant) -> Snapshot {
        self.shown.memory.clear();
        self.shown.memory.extend(
            self.devices
                .iter()
                .map(|d| (d.memory, d.memory.and(d.used_peak.max()))),
        );
        self.shown.errors = Some(Arc::clone(&self.errors.counts));
        self.shown.taken_at = Some(now);
        self.snapshot()
    }

    /// Read every GPU's memory (feeding its peak window) and count the
    /// memory-only sample.
    fn read_memory_only(&mut self, now: Instant) {
        let window = self.config.timing.peak_window;
        for dev in &mut self.devices {
            dev.read_memory(
                &mut self.gpu,
                &mut self.errors,
                now,
                window,
                &self.config.procfs,
            );
        }
        self.memory_samples += 1;
    }

    /// A full sample: identities still unknown, memory, MIG layout when
    /// due, the collectors, processes and /proc for every GPU.
    pub fn tick(&mut self) -> Snapshot {
        let started = Instant::now();
        // The collectors and the process lists change below.
        self.readings = None;
        self.procs.begin_tick();
        let mut in_nvml = Duration::ZERO;
        let mut answering = vec![false; self.devices.len()];
        for (i, up) in answering.iter_mut().enumerate() {
            in_nvml += self.full_sample(i, started);
            *up = self.devices[i].memory.is_some();
        }
        if self.errors.driver_gone.is_none() {
            let t = Instant::now();
            // A vGPU guest's GPUs do not answer to the collectors skipped
            // there.
            let hosted: Vec<bool> = answering
                .iter()
                .zip(&self.devices)
                .map(|(&up, d)| up && !d.vgpu_guest)
                .collect();
            let mut cx = Context::new(&mut self.gpu, started, &mut self.errors);
            for (def, c) in self.collectors.each_with_def() {
                c.finish(&mut cx, if def.vgpu_guest { &answering } else { &hosted });
            }
            in_nvml += t.elapsed();
        }
        if self.errors.driver_gone.is_none() && self.config.collectors.processes() {
            let t = Instant::now();
            self.limits
                .read_if_due(&mut self.gpu, &self.devices, &mut self.errors, started);
            in_nvml += t.elapsed();
        }
        self.errors.flush_unsupported();
        if self.errors.driver_gone.is_some() {
            // Calls made before the error in this tick answered from a
            // driver that is now gone: nothing of this tick is trusted.
            self.mark_all_down();
        }
        let devices = &self.devices;
        let live = |pid: u32| {
            devices
                .iter()
                .any(|d| d.processes.binary_search_by_key(&pid, |p| p.pid).is_ok())
        };
        self.procs.retain(&live);
        if let Some(b) = &mut self.bridge {
            b.end_tick(&live);
        }
        Arc::make_mut(&mut self.durations).observe(started.elapsed().as_secs_f64());
        Arc::make_mut(&mut self.nvml_durations).observe(in_nvml.as_secs_f64());
        self.readings = Some(
            self.devices
                .iter()
                .map(|d| Arc::new(self.readings_of(d)))
                .collect(),
        );
        self.emit(started)
    }

    /// One GPU's part of a full sample. Returns the time spent in NVML
    /// (everything but attribution's /proc reads).
    fn full_sample(&mut self, i: usize, now: Instant) -> Duration {
        let t = Instant::now();
        let timing = self.config.timing;
        let dev = &mut self.devices[i];
        if self.errors.driver_gone.is_none() && !dev.info.is_known() {
            dev.discover(&mut self.gpu, &mut self.errors, now, &self.config.procfs);
            if dev.vgpu_guest {
                tracing::info!(
                    gpu = i,
                    skipped = self.collectors.skipped_in_vgpu_guests().join(","),
                    "GPU of a vGPU guest (NVML virtualization mode VGPU): the collectors whose calls misbehave there are skipped on it"
                );
            }
        }
        dev.read_memory(
            &mut self.gpu,
            &mut self.errors,
            now,
            timing.peak_window,
            &self.config.procfs,
        );
        if dev.memory.is_none() {
            self.down(i);
            return t.elapsed();
        }
        if dev.mig_rescan_due(now, timing.mig_rescan_interval) {
            dev.rescan_mig(&mut self.gpu, &mut self.errors, now);
        }
        let guest = dev.vgpu_guest;
        let mut cx = Context::new(&mut self.gpu, now, &mut self.errors);
        for (def, c) in self.collectors.each_with_def() {
            if def.vgpu_guest || !guest {
                c.collect(&mut cx, i);
            }
        }
        self.listed.clear();
        let listed = if self.config.collectors.processes() {
            self.gpu.processes(i, &mut self.listed)
        } else {
            Ok(())
        };
        let dev = &mut self.devices[i];
        if listed.is_ok() && !dev.mig_read_in(now) && dev.unknown_instance(&self.listed) {
            dev.rescan_mig(&mut self.gpu, &mut self.errors, now);
        }
        if dev.read_mig_memory(&mut self.gpu, &mut self.errors) && !dev.mig_read_in(now) {
            dev.rescan_mig(&mut self.gpu, &mut self.errors, now);
            dev.read_mig_memory(&mut self.gpu, &mut self.errors);
        }
        if let Err(e) = listed {
            self.errors.count(e);
            self.down(i);
            return t.elapsed();
        }
        self.listed.sort_unstable_by_key(|p| p.pid);
        if self.config.collectors.processes() {
            let guest = self.devices[i].vgpu_guest;
            let mut cx = Context::new(&mut self.gpu, now, &mut self.errors);
            for (def, c) in self.collectors.each_with_def() {
                if def.vgpu_guest || !guest {
                    c.processes(&mut cx, i, &self.listed);
                }
            }
        }
        let in_nvml = t.elapsed();
        processes::update(
            &mut self.devices[i],
            &self.listed,
            &self.config.selection,
            processes::Lookups {
                read: self.config.collectors.processes(),
                procs: &mut self.procs,
                bridge: self.bridge.as_deref_mut(),
            },
            &self.collectors,
            now,
            timing.peak_window,
        );
        in_nvml
    }

    /// GPU `i` did not answer in this sample.
    fn down(&mut self, i: usize) {
        self.readings = None;
        self.devices[i].mark_down();
        for c in self.collectors.each() {
            c.forget(i);
        }
    }

    /// GPU `d`'s readings: the collectors' and its unattributed bytes.
    fn readings_of(&self, d: &DeviceState) -> Readings {
        let mut r = self.collectors.readings(d.index);
        if let Some(u) = &d.unattributed {
            r.put(Arc::clone(u) as _);
        }
        r
    }

    /// The state as it stands, without calling NVML (every GPU is down
    /// while the source is closed).
    pub fn snapshot(&self) -> Snapshot {
        let (lookup_failures, attribution_rejected) = self.procs.counters();
        Snapshot {
            taken_at: SystemTime::now(),
            driver: Arc::clone(&self.driver),
            devices: self
                .devices
                .iter()
                .enumerate()
                .map(|(i, d)| DeviceSample {
                    info: Arc::clone(&d.info),
                    memory: d.memory,
                    used_peak_bytes: d.memory.and(d.used_peak.max()),
                    processes: Arc::clone(&d.processes),
                    other: d.other,
                    mig: Arc::clone(&d.mig),
                    readings: match d.memory {
                        Some(_) => match self.readings.as_ref().and_then(|r| r.get(i)) {
                            Some(r) => Arc::clone(r),
                            None => Arc::new(self.readings_of(d)),
                        },
                        None => Arc::clone(&self.blank_readings),
                    },
                })
                .collect(),
            nvml_errors: Arc::clone(&self.errors.counts),
            sample_duration: Arc::clone(&self.durations),
            sample_nvml_duration: Arc::clone(&self.nvml_durations),
            memory_samples: self.memory_samples,
            process_lookup_failures: lookup_failures,
            attribution_rejected,
            nvml_reinit_attempts: self.reinit_attempts,
            // Filled in by `publish::Shared::publish`, from the sources.
            kubernetes: None,
            torch: None,
            containers: None,
            pod_resources: None,
            job_mapping: None,
            exporter: Default::default(),
            forecasts: Default::default(),
            accounting: self.blank_accounts.clone(),
            // The pod-level sources and the per-workload rows are added
            // when published.
            limits: Limits {
                cgroups: self.limits.rows(),
                sources: self.limits.sources(),
                pods: Arc::clone(&self.blank_limits.pods),
                workloads: Arc::clone(&self.blank_limits.workloads),
            },
            series: self.config.selection.series,
        }
    }
}

#[cfg(test)]
mod tests;
