//! Everything one scrape shows ([`Snapshot`]), with the sampler's own
//! cumulative state (tick histograms, NVML error counters) and the
//! forecast.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use super::Forecast;
use super::{
    Accounts, ContainerLookups, DeviceSample, DriverInfo, ExporterCounters, JobMappingState,
    KubeState, PodResourcesState, TorchCounters,
};
use crate::gpu_error::{ErrorKind, Operation};

/// Cumulative histogram of tick durations, owned by the sampler and copied
/// into each snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct DurationHistogram {
    /// Upper bounds in seconds, ascending, without +Inf.
    pub bounds: &'static [f64],
    /// Non-cumulative counts per bound, plus one trailing slot for +Inf.
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl DurationHistogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, seconds: f64) {
        let slot = self
            .bounds
            .iter()
            .position(|b| seconds <= *b)
            .unwrap_or(self.bounds.len());
        if let Some(c) = self.counts.get_mut(slot) {
            *c += 1;
        }
        self.sum += seconds;
        self.count += 1;
    }
}

/// Key of the NVML error counter: the `operation` and `error` labels,
/// typed until they are encoded (ordered by label).
pub type ErrorKey = (Operation, ErrorKind);

/// Everything one scrape shows. Built fresh by every tick: a process that
/// exited is simply not in the next snapshot.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// When the tick that built it finished.
    pub taken_at: SystemTime,
    pub driver: Arc<DriverInfo>,
    pub devices: Vec<DeviceSample>,
    pub nvml_errors: Arc<BTreeMap<ErrorKey, u64>>,
    /// Wall time of full samples (memory + processes + /proc).
    pub sample_duration: Arc<DurationHistogram>,
    /// The part of each full sample spent inside NVML calls.
    pub sample_nvml_duration: Arc<DurationHistogram>,
    /// Memory-only samples taken so far (between full samples).
    pub memory_samples: u64,
    /// Pids NVML reported that could not be looked up in /proc.
    pub process_lookup_failures: u64,
    /// Attribution claims refused, by reason (`attribute::ProcCache`).
    pub attribution_rejected: super::AttributionRejections,
    /// Times NVML was re-opened because every GPU kept failing.
    pub nvml_reinit_attempts: u64,
    /// State of the Kubernetes pod watcher, when enabled.
    pub kubernetes: Option<KubeState>,
    /// Torch bridge counters, when `processes.torch_bridge` is on.
    pub torch: Option<TorchCounters>,
    /// Container engine lookups, when `containers.engine_socket` is set.
    pub containers: Option<ContainerLookups>,
    /// The devices the kubelet allocated to pods (pod-resources API), and
    /// that client's counters; `None` while that part is off. Copied in
    /// when the snapshot is published, like `exporter`.
    pub pod_resources: Option<PodResourcesState>,
    /// The devices Slurm jobs hold (job-mapping directory) and the
    /// reader's counters; `None` while that part is off. Copied in when
    /// published, like `pod_resources`.
    pub job_mapping: Option<JobMappingState>,
    /// The exporter's own counters outside the sampler (reloads, HTTP),
    /// copied in when the snapshot is published.
    pub exporter: ExporterCounters,
    /// When each GPU's memory, and each PyTorch process's reserved memory
    /// under its limit, would be full at the growth of the present regime
    /// of the exporter's own history; computed when published.
    pub forecasts: Forecasts,
    /// Memory-time, busy-time and allocated time integrated since start
    /// (`accounting`), as of this snapshot. Computed when published.
    pub accounting: Accounts,
    /// Each workload's own limits on each GPU beside its use: the sources'
    /// limits copied in when published, joined to the workloads there
    /// (`crate::limits`).
    pub limits: super::Limits,
    /// The series budget and per-process mode in force when the sampler
    /// built it (`processes.series`, `series_budget`).
    pub series: super::SeriesPolicy,
}

/// The forecasts of one snapshot (see `history`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Forecasts {
    /// Per GPU (by position in `devices`); `None` where it is not growing.
    pub gpus: Vec<Option<Forecast>>,
    /// PyTorch processes with a memory limit whose reserved memory grows,
    /// by (GPU position, pid).
    pub torch: Vec<TorchForecast>,
}

impl Forecasts {
    /// The forecast of GPU `gpu` (by position), if it grows.
    pub fn gpu(&self, gpu: usize) -> Option<Forecast> {
        self.gpus.get(gpu).copied().flatten()
    }

    /// The limit forecast of process `pid` on GPU `gpu`, if it grows.
    pub fn torch(&self, gpu: usize, pid: u32) -> Option<Forecast> {
        self.torch
            .binary_search_by_key(&(gpu, pid), |t| (t.gpu, t.pid))
            .ok()
            .map(|i| self.torch[i].forecast)
    }
}

/// When a PyTorch process's reserved memory reaches its memory limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TorchForecast {
    pub gpu: usize,
    pub pid: u32,
    /// `full_in_seconds`: until reserved reaches the limit.
    pub forecast: Forecast,
}

impl Snapshot {
    /// A snapshot of no GPU, taken at `taken_at`.
    pub fn empty(taken_at: SystemTime) -> Snapshot {
        Snapshot {
            taken_at,
            driver: Arc::default(),
            devices: Vec::new(),
            nvml_errors: Arc::default(),
            sample_duration: Arc::new(DurationHistogram::new(&[])),
            sample_nvml_duration: Arc::new(DurationHistogram::new(&[])),
            memory_samples: 0,
            process_lookup_failures: 0,
            attribution_rejected: super::AttributionRejections::default(),
            nvml_reinit_attempts: 0,
            kubernetes: None,
            torch: None,
            containers: None,
            pod_resources: None,
            job_mapping: None,
            exporter: ExporterCounters::default(),
            forecasts: Forecasts::default(),
            accounting: Accounts::default(),
            limits: super::Limits::default(),
            series: super::SeriesPolicy::default(),
        }
    }
}
