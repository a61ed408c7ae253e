//! Snapshot → JSON for `/api/v1/snapshot`, and the memory history → JSON
//! for `/api/v1/history`: the schema of [docs/api.md](../../docs/api.md),
//! version [`SCHEMA_VERSION`]. Field names are the metrics' label names
//! (`gpu`, `uuid`, `pid`, `process`, `user`, `namespace`, `pod`, …) and
//! value names follow the metric names without their prefix
//! (`gpu_memory_used_bytes` → `memory.used_bytes`); ratios are 0–1, bytes
//! are integers. A figure the exporter does not have is `null`, never a
//! fake 0. Like the exposition, this reads only the [`Snapshot`] (and the
//! history it is handed). serde_json writes it.
//!
//! Bounded: at most [`MAX_PROCESSES_PER_GPU`] processes per GPU are listed
//! (the largest); the rest are summed in `processes_omitted`. Strings are
//! bounded where they are read (comm 16 bytes, Kubernetes names 253,
//! the command line by `processes.cmdline_max_length`).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::value::RawValue;

use super::exporter::{REVISION, VERSION};
use crate::accounting::{Ranked, rank};
use crate::collectors::{Def, REGISTRY, ToJson};
use crate::history::{History, unix_seconds};
use crate::model::{
    DeviceSample, Forecast, Idle, MemoryInfo, ProcessSample, Readings, Snapshot, Stale,
    Unattributed, Workload, WorkloadTotals,
};
use limits::{OnGpu, Sources};

/// `schema_version` of both documents; bumped on any incompatible change
/// (a field removed, renamed or retyped). New fields may appear within a
/// version.
pub(crate) const SCHEMA_VERSION: u32 = 1;

/// Processes listed per GPU in `/api/v1/snapshot`, largest first when
/// there are more (then sorted by pid like the rest).
pub(crate) const MAX_PROCESSES_PER_GPU: usize = 512;

pub(crate) const JSON_CONTENT_TYPE: &str = "application/json";

mod limits;

fn seconds(t: SystemTime) -> f64 {
    // Millisecond resolution, so the text is short and exact.
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as f64 / 1000.0)
        .unwrap_or(0.0)
}

#[derive(Serialize)]
struct SnapshotDoc<'a> {
    schema_version: u32,
    exporter: Exporter,
    taken_at: f64,
    sample_interval_seconds: f64,
    driver: Driver<'a>,
    gpus: Vec<Gpu<'a>>,
    nvml_errors: Vec<NvmlError>,
    process_lookup_failures: u64,
    nvml_reinit_attempts: u64,
    kubernetes: Option<Kubernetes>,
    workloads: Workloads,
    /// Which limit sources were looked for (keys) and found (values).
    limit_sources: Sources,
    /// The collectors with a key in each GPU's object (registry order),
    /// so the page shows each one's figures without knowing it.
    collectors: Vec<CollectorDoc>,
}

/// Workloads listed per window in `workloads`, the largest first.
pub(crate) const MAX_RANKED_WORKLOADS: usize = 100;

/// The ledger's workloads ranked by memory-time (`accounting::rank`).
#[derive(Serialize)]
struct Workloads {
    last_hour: RankedDoc,
    since_start: RankedDoc,
}

#[derive(Serialize)]
struct RankedDoc {
    window_seconds: f64,
    workloads: Vec<RankedWorkload>,
    omitted: Option<RankedTotals>,
}

#[derive(Serialize)]
struct RankedTotals {
    memory_gib_hours: f64,
    busy_gpu_hours: f64,
    memory_used_byte_seconds: f64,
    busy_seconds: f64,
}

impl From<WorkloadTotals> for RankedTotals {
    fn from(t: WorkloadTotals) -> Self {
        RankedTotals {
            memory_gib_hours: t.used_byte_seconds / (3600.0 * (1u64 << 30) as f64),
            busy_gpu_hours: t.busy_seconds / 3600.0,
            memory_used_byte_seconds: t.used_byte_seconds,
            busy_seconds: t.busy_seconds,
        }
    }
}

#[derive(Serialize)]
struct RankedWorkload {
    /// `pod`, `slurm_job`, `container` or `user`.
    kind: &'static str,
    namespace: Option<String>,
    pod: Option<String>,
    pod_uid: Option<String>,
    slurm_job: Option<String>,
    container_id: Option<String>,
    user: Option<String>,
    #[serde(flatten)]
    totals: RankedTotals,
}

/// A workload's kind and ids as the API names them (a row each in the
/// ranking and in each GPU's limits); an empty name is null.
pub(super) struct WorkloadIds<'a> {
    /// `pod`, `slurm_job`, `container` or `user`.
    pub(super) kind: &'static str,
    pub(super) namespace: Option<&'a str>,
    pub(super) pod: Option<&'a str>,
    pub(super) pod_uid: Option<&'a str>,
    pub(super) slurm_job: Option<&'a str>,
    pub(super) container_id: Option<&'a str>,
    pub(super) user: Option<&'a str>,
}

impl<'a> WorkloadIds<'a> {
    pub(super) fn of(w: &'a Workload) -> Self {
        let some = |s: &'a str| (!s.is_empty()).then_some(s);
        let mut ids = WorkloadIds {
            kind: "user",
            namespace: None,
            pod: None,
            pod_uid: None,
            slurm_job: None,
            container_id: None,
            user: None,
        };
        match w {
            Workload::Pod {
                namespace,
                pod,
                pod_uid,
            } => {
                ids.kind = "pod";
                ids.namespace = some(namespace);
                ids.pod = some(pod);
                ids.pod_uid = some(pod_uid);
            }
            Workload::SlurmJob { job } => {
                ids.kind = "slurm_job";
                ids.slurm_job = some(job);
            }
            Workload::Container { container_id } => {
                ids.kind = "container";
                ids.container_id = some(container_id);
            }
            Workload::User { user } => ids.user = some(user),
        }
        ids
    }
}

fn ranked(r: Ranked) -> RankedDoc {
    RankedDoc {
        window_seconds: r.seconds,
        workloads: r
            .workloads
            .into_iter()
            .map(|(w, t)| {
                let ids = WorkloadIds::of(&w);
                let own = |v: Option<&str>| v.map(str::to_string);
                RankedWorkload {
                    kind: ids.kind,
                    namespace: own(ids.namespace),
                    pod: own(ids.pod),
                    pod_uid: own(ids.pod_uid),
                    slurm_job: own(ids.slurm_job),
                    container_id: own(ids.container_id),
                    user: own(ids.user),
                    totals: t.into(),
                }
            })
            .collect(),
        omitted: (r.omitted != WorkloadTotals::default()).then(|| r.omitted.into()),
    }
}

#[derive(Serialize)]
struct Exporter {
    version: &'static str,
    revision: &'static str,
}

#[derive(Serialize)]
struct Driver<'a> {
    driver_version: &'a str,
    nvml_version: &'a str,
    cuda_driver_version: &'a str,
}

#[derive(Serialize)]
struct Memory {
    total_bytes: u64,
    /// `null` on a unified-memory GPU (no driver reservation).
    reserved_bytes: Option<u64>,
    used_bytes: u64,
    free_bytes: u64,
}

impl From<MemoryInfo> for Memory {
    fn from(m: MemoryInfo) -> Self {
        Memory {
            total_bytes: m.total,
            reserved_bytes: m.reserved,
            used_bytes: m.used,
            free_bytes: m.free,
        }
    }
}

#[derive(Serialize)]
struct Gpu<'a> {
    gpu: &'a str,
    uuid: &'a str,
    name: &'a str,
    pci_bus_id: &'a str,
    up: bool,
    /// `"unified"` on a GPU whose memory is the host's, else absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    memory_kind: Option<&'static str>,
    /// What the page says of such memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    memory_note: Option<&'static str>,
    memory: Option<Memory>,
    memory_used_peak_bytes: Option<u64>,
    /// Each collector's object, under its key (registry order).
    #[serde(flatten)]
    collectors: Collected<'a>,
    /// `[Process]`, serialized once per full sample ([`Reuse`]).
    processes: &'a RawValue,
    processes_other: Option<Rollup>,
    processes_omitted: Option<Rollup>,
    mig: Vec<Mig<'a>>,
    forecast: Option<GpuForecast>,
    /// Used memory no listed process accounts for (last full sample).
    memory_unattributed_bytes: Option<u64>,
    /// Memory held by stale processes, by reason; `null` where the
    /// processes were not read.
    memory_stale_bytes: Option<StaleBytes>,
    /// Memory held by idle processes; `null` where the processes were not
    /// read.
    memory_idle_held_bytes: Option<u64>,
    /// Its workloads with a limit of their own.
    limits: OnGpu<'a>,
}

#[derive(Serialize, Default)]
struct StaleBytes {
    exited: u64,
    zombie: u64,
    uninterruptible: u64,
    reparented: u64,
    owner_deleted: u64,
}

impl StaleBytes {
    fn of(d: &DeviceSample) -> Option<StaleBytes> {
        let [exited, zombie, uninterruptible, reparented, owner_deleted] =
            super::stale::stale_bytes(d)?;
        Some(StaleBytes {
            exited,
            zombie,
            uninterruptible,
            reparented,
            owner_deleted,
        })
    }
}

/// Why a process is stale, and since when (Unix seconds).
#[derive(Serialize)]
struct StaleDoc {
    reason: &'static str,
    since: f64,
}

#[derive(Serialize)]
struct GpuForecast {
    full_in_seconds: f64,
    growth_bytes_per_second: f64,
    window_seconds: u64,
}

/// The collectors' readings of one GPU or process, each under its
/// registry row's key, through the row's JSON step: this file names no
/// collector.
struct Collected<'a> {
    readings: &'a Readings,
    registry: &'static [Def],
    /// The process step (else the GPU's).
    process: bool,
}

impl Collected<'_> {
    fn steps(&self) -> impl Iterator<Item = (&'static str, ToJson)> + '_ {
        self.registry.iter().filter_map(|d| {
            let j = d.json?;
            Some((j.key, if self.process { j.process? } else { j.gpu? }))
        })
    }
}

impl Serialize for Collected<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(None)?;
        for (key, step) in self.steps() {
            map.serialize_entry(key, &step(self.readings))?;
        }
        map.end()
    }
}

#[derive(Serialize)]
struct CollectorDoc {
    key: &'static str,
    help: &'static str,
}

#[derive(Serialize, Clone, Copy, Debug)]
struct Rollup {
    count: u64,
    memory_used_bytes: u64,
}

#[derive(Serialize)]
struct Mig<'a> {
    mig_uuid: &'a str,
    name: &'a str,
    gpu_instance_id: u32,
    compute_instance_id: u32,
    memory: Option<Memory>,
    /// Used memory no process listed on this instance accounts for.
    unattributed_bytes: Option<u64>,
}

#[derive(Serialize)]
struct Process<'a> {
    pid: u32,
    process: &'a str,
    user: &'a str,
    namespace: &'a str,
    pod: &'a str,
    container: &'a str,
    container_id: &'a str,
    container_name: Option<&'a str>,
    container_image: Option<&'a str>,
    compose_project: Option<&'a str>,
    compose_service: Option<&'a str>,
    pod_uid: &'a str,
    slurm_job: Option<&'a str>,
    slurm_step: Option<&'a str>,
    slurm_uid: Option<&'a str>,
    cmdline: Option<&'a str>,
    gpu_instance_id: Option<u32>,
    compute_instance_id: Option<u32>,
    memory_used_bytes: Option<u64>,
    memory_used_peak_bytes: Option<u64>,
    /// Each per-process collector's object, under its key.
    #[serde(flatten)]
    collectors: Collected<'a>,
    torch: Option<Torch>,
    /// Why it holds memory nobody uses (dead, orphaned, owner deleted).
    stale: Option<StaleDoc>,
    /// Since when it has run no kernel, where that is at least
    /// `processes.idle_after` (Unix seconds).
    idle_since: Option<f64>,
}

#[derive(Serialize)]
struct Torch {
    allocated_bytes: u64,
    reserved_bytes: u64,
    allocated_peak_bytes: u64,
    reserved_peak_bytes: u64,
    active_bytes: u64,
    inactive_split_bytes: u64,
    alloc_retries: u64,
    ooms: u64,
    limit_bytes: Option<u64>,
    steps: Option<Steps>,
    threshold: Option<Threshold>,
}

#[derive(Serialize)]
struct Steps {
    total: u64,
    allocated_bytes: Option<u64>,
    growth_bytes_per_step: Option<f64>,
    steps_per_second: Option<f64>,
    window_steps: u32,
}

#[derive(Serialize)]
struct Threshold {
    bytes: u64,
    crossings: u64,
    above: bool,
}

#[derive(Serialize)]
struct NvmlError {
    operation: &'static str,
    error: &'static str,
    count: u64,
}

#[derive(Serialize)]
struct Kubernetes {
    synced: bool,
    pods: u64,
}

/// A field the container engine gave, `None` (null) when not known.
fn engine_field(
    i: &crate::model::ProcIdentity,
    f: fn(&crate::model::ContainerInfo) -> &str,
) -> Option<&str> {
    i.engine.as_deref().map(f).filter(|v| !v.is_empty())
}

/// A Slurm field of the process's job (`None`: in no job, or not in the
/// path).
fn slurm_field(
    i: &crate::model::ProcIdentity,
    f: fn(&crate::model::SlurmJob) -> &str,
) -> Option<&str> {
    i.slurm.as_ref().map(f).filter(|v| !v.is_empty())
}

fn process<'a>(p: &'a ProcessSample, registry: &'static [Def]) -> Process<'a> {
    let i = &p.ident;
    Process {
        pid: p.pid,
        process: &i.comm,
        user: &i.user,
        namespace: &i.namespace,
        pod: &i.pod,
        container: &i.container,
        container_id: &i.container_id,
        container_name: engine_field(i, |c| &c.name),
        container_image: engine_field(i, |c| &c.image),
        compose_project: engine_field(i, |c| &c.compose_project),
        compose_service: engine_field(i, |c| &c.compose_service),
        pod_uid: &i.pod_uid,
        slurm_job: slurm_field(i, |j| &j.job),
        slurm_step: slurm_field(i, |j| &j.step),
        slurm_uid: slurm_field(i, |j| &j.uid),
        cmdline: i.cmdline.as_deref(),
        gpu_instance_id: p.gpu_instance_id,
        compute_instance_id: p.compute_instance_id,
        memory_used_bytes: p.used_bytes,
        memory_used_peak_bytes: p.used_peak_bytes,
        collectors: Collected {
            readings: &p.readings,
            registry,
            process: true,
        },
        idle_since: p.readings.get::<Idle>().map(|i| seconds(i.since)),
        stale: p.readings.get::<Stale>().map(|st| StaleDoc {
            reason: st.reason.label(),
            since: seconds(st.since),
        }),
        torch: p.torch.as_deref().map(|t| Torch {
            allocated_bytes: t.allocated,
            reserved_bytes: t.reserved,
            allocated_peak_bytes: t.allocated_peak,
            reserved_peak_bytes: t.reserved_peak,
            active_bytes: t.active,
            inactive_split_bytes: t.inactive_split,
            alloc_retries: t.alloc_retries,
            ooms: t.ooms,
            limit_bytes: t.limit,
            steps: t.steps.map(|st| Steps {
                total: st.total,
                allocated_bytes: st.allocated,
                growth_bytes_per_step: st.growth_bytes(),
                steps_per_second: st.steps_per_second(),
                window_steps: st.window,
            }),
            threshold: t.threshold.map(|th| Threshold {
                bytes: th.bytes,
                crossings: th.crossings,
                above: th.above,
            }),
        }),
    }
}

/// The processes listed (at most [`MAX_PROCESSES_PER_GPU`], by pid) and
/// the rollup of those left out.
fn processes<'a>(
    d: &'a DeviceSample,
    registry: &'static [Def],
) -> (Vec<Process<'a>>, Option<Rollup>) {
    let all = &d.processes;
    let process = |p| process(p, registry);
    if all.len() <= MAX_PROCESSES_PER_GPU {
        return (all.iter().map(process).collect(), None);
    }
    let mut by_size: Vec<&ProcessSample> = all.iter().collect();
    by_size.sort_by_key(|p| std::cmp::Reverse(p.used_bytes.unwrap_or(0)));
    let (kept, left) = by_size.split_at(MAX_PROCESSES_PER_GPU);
    let mut kept = kept.to_vec();
    kept.sort_by_key(|p| p.pid);
    let omitted = Rollup {
        count: left.len() as u64,
        memory_used_bytes: left.iter().filter_map(|p| p.used_bytes).sum(),
    };
    (kept.into_iter().map(process).collect(), Some(omitted))
}

/// One GPU's process list as JSON, kept while the snapshots hold the
/// same list (the same `Arc`: memory-only samples share it).
#[derive(Debug)]
struct KeptProcesses {
    of: Arc<[ProcessSample]>,
    json: Box<RawValue>,
    omitted: Option<Rollup>,
}

/// The process lists of the last snapshot encoded, per GPU: at 8 GPUs ×
/// 256 processes they are nearly all of `/api/v1/snapshot`, and only a
/// full sample changes them, so a snapshot from a memory-only sample
/// copies them instead of serializing 2,048 processes again.
#[derive(Debug)]
pub(crate) struct Reuse {
    kept: Mutex<Vec<KeptProcesses>>,
    /// Bytes of the last document besides its process lists: the next
    /// one's room for them, so a document is one allocation that does not
    /// grow while it is written.
    rest: AtomicUsize,
    reused: AtomicU64,
    /// The collectors whose JSON steps run.
    registry: &'static [Def],
}

impl Default for Reuse {
    fn default() -> Self {
        Reuse::with_registry(REGISTRY)
    }
}

impl Reuse {
    /// Encode with this collector table (the toy collector's test).
    pub(crate) fn with_registry(registry: &'static [Def]) -> Self {
        Reuse {
            kept: Mutex::new(Vec::new()),
            rest: AtomicUsize::new(16 * 1024),
            reused: AtomicU64::new(0),
            registry,
        }
    }

    /// Process lists copied instead of serialized (tests look).
    #[cfg(test)]
    fn reused(&self) -> u64 {
        self.reused.load(Ordering::Relaxed)
    }
}

fn processes_of(
    d: &DeviceSample,
    registry: &'static [Def],
) -> Result<KeptProcesses, serde_json::Error> {
    let (list, omitted) = processes(d, registry);
    Ok(KeptProcesses {
        of: Arc::clone(&d.processes),
        json: serde_json::value::to_raw_value(&list)?,
        omitted,
    })
}

fn gpu<'a>(
    d: &'a DeviceSample,
    forecast: Option<Forecast>,
    procs: &'a KeptProcesses,
    registry: &'static [Def],
    limits: OnGpu<'a>,
) -> Gpu<'a> {
    let i = &d.info;
    let processes = &*procs.json;
    let processes_omitted = procs.omitted;
    Gpu {
        gpu: &i.gpu,
        uuid: &i.uuid,
        name: &i.name,
        pci_bus_id: &i.pci_bus_id,
        up: d.up(),
        memory_kind: i.memory.label(),
        memory_note: i
            .memory
            .label()
            .map(|_| "unified memory, shared with the host"),
        memory: d.memory.map(Memory::from),
        memory_used_peak_bytes: d.used_peak_bytes,
        collectors: Collected {
            readings: &d.readings,
            registry,
            process: false,
        },
        processes,
        processes_other: d.other.map(|o| Rollup {
            count: o.count,
            memory_used_bytes: o.used_bytes,
        }),
        processes_omitted,
        mig: d
            .mig
            .iter()
            .map(|m| Mig {
                mig_uuid: &m.info.mig_uuid,
                name: &m.info.name,
                gpu_instance_id: m.info.gpu_instance_id,
                compute_instance_id: m.info.compute_instance_id,
                memory: m.memory.map(Memory::from),
                unattributed_bytes: d
                    .readings
                    .get::<Unattributed>()
                    .and_then(|u| u.mig.iter().find(|(id, _)| **id == *m.info.mig_uuid))
                    .and_then(|(_, b)| *b),
            })
            .collect(),
        memory_unattributed_bytes: d.readings.get::<Unattributed>().and_then(|u| u.bytes),
        memory_stale_bytes: StaleBytes::of(d),
        memory_idle_held_bytes: d.readings.get::<Unattributed>().map(|_| {
            d.processes
                .iter()
                .filter(|p| p.readings.get::<Idle>().is_some())
                .filter_map(|p| p.used_bytes)
                .sum()
        }),
        forecast: forecast.map(|f| GpuForecast {
            full_in_seconds: f.full_in_seconds,
            growth_bytes_per_second: f.growth_bytes_per_second,
            window_seconds: f.window_seconds,
        }),
        limits,
    }
}

/// `/api/v1/snapshot`: `s` as JSON; `sample_interval` is the full sample
/// interval it was taken at (the page refreshes at that pace).
#[cfg(test)]
pub(crate) fn snapshot(
    s: &Snapshot,
    sample_interval: Duration,
) -> Result<Vec<u8>, serde_json::Error> {
    snapshot_reusing(s, sample_interval, &Reuse::default())
}

/// [`snapshot`], copying each GPU's process list from `reuse` when the
/// last snapshot encoded there had the same one, and keeping this one's.
#[cfg(test)]
pub(crate) fn snapshot_reusing(
    s: &Snapshot,
    sample_interval: Duration,
    reuse: &Reuse,
) -> Result<Vec<u8>, serde_json::Error> {
    snapshot_into(s, sample_interval, reuse, Vec::new())
}

/// `s` as JSON, each GPU's process list copied from `reuse` when the last
/// snapshot encoded there had the same one (this one's kept), written
/// into `buf` (emptied first): a body
/// recycled from an earlier snapshot (`http::cache`) keeps its pages, so
/// the new body faults none in.
pub(crate) fn snapshot_into(
    s: &Snapshot,
    sample_interval: Duration,
    reuse: &Reuse,
    buf: Vec<u8>,
) -> Result<Vec<u8>, serde_json::Error> {
    // Held across the encode; a poisoned lock only loses what was kept.
    let mut kept = reuse.kept.lock().unwrap_or_else(|e| {
        let mut g = e.into_inner();
        g.clear();
        g
    });
    let mut old = std::mem::take(&mut *kept).into_iter();
    let mut parts = Vec::with_capacity(s.devices.len());
    for d in &s.devices {
        match old.next() {
            Some(k) if Arc::ptr_eq(&k.of, &d.processes) => {
                reuse.reused.fetch_add(1, Ordering::Relaxed);
                parts.push(k);
            }
            _ => parts.push(processes_of(d, reuse.registry)?),
        }
    }
    let lists: usize = parts.iter().map(|p| p.json.get().len()).sum();
    // A little more than last time: counters and totals grow digits.
    let room = lists + reuse.rest.load(Ordering::Relaxed) + 1024;
    let body = encode_snapshot(s, sample_interval, &parts, reuse.registry, room, buf);
    if let Ok(b) = &body {
        reuse
            .rest
            .store(b.len().saturating_sub(lists), Ordering::Relaxed);
    }
    *kept = parts;
    body
}

fn encode_snapshot(
    s: &Snapshot,
    sample_interval: Duration,
    parts: &[KeptProcesses],
    registry: &'static [Def],
    room: usize,
    mut out: Vec<u8>,
) -> Result<Vec<u8>, serde_json::Error> {
    let doc = SnapshotDoc {
        schema_version: SCHEMA_VERSION,
        exporter: Exporter {
            version: VERSION,
            revision: REVISION,
        },
        taken_at: seconds(s.taken_at),
        sample_interval_seconds: sample_interval.as_secs_f64(),
        driver: Driver {
            driver_version: &s.driver.driver_version,
            nvml_version: &s.driver.nvml_version,
            cuda_driver_version: &s.driver.cuda_driver_version,
        },
        gpus: s
            .devices
            .iter()
            .zip(parts)
            .enumerate()
            .map(|(i, (d, p))| {
                let limits = OnGpu {
                    rows: &s.limits.workloads,
                    gpu: i,
                };
                gpu(d, s.forecasts.gpu(i), p, registry, limits)
            })
            .collect(),
        nvml_errors: s
            .nvml_errors
            .iter()
            .map(|(&(operation, error), &count)| NvmlError {
                operation: operation.label(),
                error: error.label(),
                count,
            })
            .collect(),
        process_lookup_failures: s.process_lookup_failures,
        nvml_reinit_attempts: s.nvml_reinit_attempts,
        kubernetes: s.kubernetes.map(|k| Kubernetes {
            synced: k.synced,
            pods: k.pods,
        }),
        workloads: {
            let (hour, since) = rank(s, MAX_RANKED_WORKLOADS);
            Workloads {
                last_hour: ranked(hour),
                since_start: ranked(since),
            }
        },
        limit_sources: Sources(s.limits.sources),
        collectors: registry
            .iter()
            .filter(|d| d.json.is_some_and(|j| j.gpu.is_some()))
            .filter_map(|d| {
                Some(CollectorDoc {
                    key: d.json?.key,
                    help: d.help,
                })
            })
            .collect(),
    };
    out.clear();
    out.reserve(room);
    serde_json::to_writer(&mut out, &doc)?;
    Ok(out)
}

#[derive(Serialize)]
struct HistoryDoc<'a> {
    schema_version: u32,
    taken_at: f64,
    seconds: u64,
    resolution_seconds: u64,
    gpus: Vec<HistoryGpu<'a>>,
}

#[derive(Serialize)]
struct HistoryGpu<'a> {
    gpu: &'a str,
    uuid: &'a str,
    memory_total_bytes: Option<u64>,
    /// `[unix seconds, largest used bytes in that second]`, oldest first.
    points: Vec<(u64, u64)>,
}

/// `/api/v1/history?seconds=N`: the last `seconds` of `history` up to
/// the time of `s` (newer points, of a snapshot published since, are left
/// out, so the document agrees with `s`).
pub(crate) fn history(
    s: &Snapshot,
    history: &History,
    seconds_back: u64,
) -> Result<Vec<u8>, serde_json::Error> {
    let until = unix_seconds(s.taken_at);
    let doc = HistoryDoc {
        schema_version: SCHEMA_VERSION,
        taken_at: seconds(s.taken_at),
        seconds: seconds_back,
        resolution_seconds: 1,
        gpus: s
            .devices
            .iter()
            .enumerate()
            .map(|(i, d)| HistoryGpu {
                gpu: &d.info.gpu,
                uuid: &d.info.uuid,
                memory_total_bytes: d.memory.map(|m| m.total),
                points: history
                    .points(i, until, seconds_back)
                    .into_iter()
                    .map(|p| (p.t, p.used))
                    .collect(),
            })
            .collect(),
    };
    serde_json::to_vec(&doc)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::model::{DeviceInfo, TorchStats, TorchSteps, TorchThreshold};

    fn proc(pid: u32, used: Option<u64>) -> ProcessSample {
        ProcessSample {
            pid,
            used_bytes: used,
            ident: Arc::default(),
            gpu_instance_id: None,
            compute_instance_id: None,
            used_peak_bytes: None,
            torch: None,
            readings: Default::default(),
        }
    }

    fn one_gpu(processes: Vec<ProcessSample>) -> Snapshot {
        let mut s = Snapshot::empty(UNIX_EPOCH + Duration::from_millis(1_500));
        s.devices.push(DeviceSample {
            info: Arc::new(DeviceInfo::unknown(0)),
            memory: None,
            used_peak_bytes: None,
            processes: processes.into(),
            other: None,
            mig: Arc::new([]),
            readings: Default::default(),
        });
        s
    }

    fn doc(s: &Snapshot) -> serde_json::Value {
        let bytes = snapshot(s, Duration::from_millis(250)).unwrap_or_default();
        serde_json::from_slice(&bytes).unwrap_or_default()
    }

    #[test]
    fn a_memory_only_snapshot_copies_the_process_lists_and_equals_a_fresh_encode() {
        let ps: Vec<ProcessSample> = (1..=600).map(|p| proc(p, Some(u64::from(p)))).collect();
        let full = one_gpu(ps);
        let reuse = Reuse::default();
        let at = Duration::from_secs(1);
        let first = snapshot_reusing(&full, at, &reuse).unwrap_or_default();
        assert_eq!(first, snapshot(&full, at).unwrap_or_default());
        assert_eq!(reuse.reused(), 0);
        // Same process list (same Arc), other memory: copied.
        let mut memory_only = full.clone();
        memory_only.devices[0].memory = Some(MemoryInfo {
            total: 10,
            reserved: Some(1),
            used: 4,
            free: 5,
        });
        let second = snapshot_reusing(&memory_only, at, &reuse).unwrap_or_default();
        assert_eq!(reuse.reused(), 1);
        assert_eq!(second, snapshot(&memory_only, at).unwrap_or_default());
        assert_ne!(first, second);
        // A new list with the same content (a full sample): encoded again.
        let mut full_again = memory_only.clone();
        full_again.devices[0].processes = full_again.devices[0].processes.iter().cloned().collect();
        let third = snapshot_reusing(&full_again, at, &reuse).unwrap_or_default();
        assert_eq!(reuse.reused(), 1);
        assert_eq!(third, second);
    }

    /// After the first document, each is written into one allocation
    /// sized from the last (no growth while written, little room left).
    #[test]
    fn a_document_after_the_first_is_one_allocation_of_about_its_size() {
        let ps: Vec<ProcessSample> = (1..=300).map(|p| proc(p, Some(u64::from(p)))).collect();
        let full = one_gpu(ps);
        let reuse = Reuse::default();
        let at = Duration::from_secs(1);
        let first = snapshot_reusing(&full, at, &reuse).unwrap_or_default();
        for _ in 0..3 {
            let body = snapshot_reusing(&full, at, &reuse).unwrap_or_default();
            assert_eq!(body, first);
            assert!(
                body.capacity() <= body.len() + 2048,
                "{} bytes in room for {}",
                body.len(),
                body.capacity()
            );
        }
    }

    #[test]
    fn at_most_512_processes_the_largest_by_pid_the_rest_summed() {
        // pid p uses p bytes; 600 of them, one without a figure.
        let mut ps: Vec<ProcessSample> = (1..=600).map(|p| proc(p, Some(u64::from(p)))).collect();
        ps[599].used_bytes = None;
        let v = doc(&one_gpu(ps));
        let listed = v["gpus"][0]["processes"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert_eq!(listed.len(), MAX_PROCESSES_PER_GPU);
        let pids: Vec<u64> = listed.iter().filter_map(|p| p["pid"].as_u64()).collect();
        // The largest 512 with a figure: 88..=599.
        assert_eq!(pids, (88..=599).collect::<Vec<u64>>());
        assert_eq!(
            v["gpus"][0]["processes_omitted"],
            serde_json::json!({"count": 88, "memory_used_bytes": (1..=87).sum::<u64>()})
        );
        assert_eq!(v["taken_at"], 1.5);
        assert_eq!(v["sample_interval_seconds"], 0.25);
        assert_eq!(v["gpus"][0]["up"], false);
        assert_eq!(v["gpus"][0]["memory"], serde_json::Value::Null);
        let few = doc(&one_gpu(vec![proc(7, Some(1))]));
        assert_eq!(few["gpus"][0]["processes_omitted"], serde_json::Value::Null);
    }

    /// A process's Slurm job as on gpu_process_info; null outside a job
    /// and for a field the path does not hold.
    #[test]
    fn slurm_job_and_step() {
        let mut p = proc(9, Some(1));
        p.ident = Arc::new(crate::model::ProcIdentity {
            slurm: Some(crate::model::SlurmJob {
                job: Arc::from("4242"),
                step: Arc::from("batch"),
                uid: Arc::from(""),
            }),
            ..crate::model::ProcIdentity::default()
        });
        let v = doc(&one_gpu(vec![p, proc(10, Some(1))]));
        let ps = &v["gpus"][0]["processes"];
        assert_eq!(ps[0]["slurm_job"], "4242");
        assert_eq!(ps[0]["slurm_step"], "batch");
        assert_eq!(ps[0]["slurm_uid"], serde_json::Value::Null);
        assert_eq!(ps[1]["slurm_job"], serde_json::Value::Null);
    }

    #[test]
    fn torch_figures_as_the_bridge_gave_them() {
        let mut p = proc(9, Some(11_782 << 20));
        p.torch = Some(Arc::new(TorchStats {
            allocated: 10_240 << 20,
            reserved: 11_264 << 20,
            allocated_peak: 10_300 << 20,
            reserved_peak: 11_300 << 20,
            active: 10_240 << 20,
            inactive_split: 3,
            alloc_retries: 2,
            ooms: 1,
            limit: None,
            steps: Some(TorchSteps {
                total: 812,
                allocated: Some(10_240 << 20),
                growth: crate::trend::slope(&[(0, 0), (2, 6 << 20)]),
                pace: Some((63, 5040)),
                window: 64,
            }),
            threshold: Some(TorchThreshold {
                bytes: 60 << 30,
                crossings: 1,
                above: true,
            }),
            ..TorchStats::default()
        }));
        let mut q = proc(10, Some(1 << 30));
        q.torch = Some(Arc::new(TorchStats {
            steps: Some(TorchSteps {
                total: 3,
                window: 3,
                ..TorchSteps::default()
            }),
            ..TorchStats::default()
        }));
        let v = doc(&one_gpu(vec![p, q]));
        assert_eq!(
            v["gpus"][0]["processes"][0]["torch"],
            serde_json::json!({
                "allocated_bytes": 10_240u64 << 20, "reserved_bytes": 11_264u64 << 20,
                "allocated_peak_bytes": 10_300u64 << 20, "reserved_peak_bytes": 11_300u64 << 20,
                "active_bytes": 10_240u64 << 20, "inactive_split_bytes": 3,
                "alloc_retries": 2, "ooms": 1, "limit_bytes": null,
                "steps": {"total": 812, "allocated_bytes": 10_240u64 << 20,
                          "growth_bytes_per_step": 3145728.0, "steps_per_second": 12.5,
                          "window_steps": 64},
                "threshold": {"bytes": 60u64 << 30, "crossings": 1, "above": true},
            })
        );
        assert_eq!(
            v["gpus"][0]["processes"][1]["torch"]["steps"],
            serde_json::json!({"total": 3, "allocated_bytes": null,
                "growth_bytes_per_step": null, "steps_per_second": null, "window_steps": 3}),
            "under 16 steps, no growth; no time passed, no pace"
        );
        assert_eq!(v["gpus"][0]["forecast"], serde_json::Value::Null);
        let mut s = one_gpu(vec![]);
        s.forecasts.gpus = vec![Some(crate::model::Forecast {
            full_in_seconds: 744.5,
            growth_bytes_per_second: 1048576.0,
            window_seconds: 599,
        })];
        assert_eq!(
            doc(&s)["gpus"][0]["forecast"],
            serde_json::json!({"full_in_seconds": 744.5, "growth_bytes_per_second": 1048576.0, "window_seconds": 599})
        );
    }
}
