//! Plain data that flows from the sampler to the encoder. No NVML types, no
//! behaviour beyond small helpers: a [`Snapshot`] is immutable once published.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use crate::gpu::error::{ErrorKind, Operation};
pub use crate::trend::Slope;

/// Identity of one GPU: read when NVML is opened, and retried at each full
/// sample while it cannot be read (then `uuid`, `name` and `pci_bus_id` are
/// empty and only `gpu_up 0` is exported for it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// NVML index as a string: the `gpu` label.
    pub gpu: String,
    pub uuid: String,
    pub name: String,
    pub pci_bus_id: String,
    /// Where its memory figures come from (found at discovery).
    pub memory: MemoryKind,
}

/// What kind of memory a GPU has: its own, or the host's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MemoryKind {
    /// Device memory, from NVML's memory info.
    #[default]
    Device,
    /// Unified memory shared with the host (DGX Spark / GB10): NVML
    /// answers NOT_SUPPORTED for memory info, and the figures are the
    /// host's, from `<path.procfs>/meminfo`.
    Unified,
}

impl MemoryKind {
    /// The `memory` label of `gpu_info` and the JSON API's `memory` field:
    /// `None` for device memory (the label is absent).
    pub fn label(self) -> Option<&'static str> {
        match self {
            MemoryKind::Device => None,
            MemoryKind::Unified => Some("unified"),
        }
    }
}

impl DeviceInfo {
    /// GPU `index` whose identity has not been read (yet).
    pub fn unknown(index: usize) -> Self {
        DeviceInfo {
            gpu: index.to_string(),
            uuid: String::new(),
            name: String::new(),
            pci_bus_id: String::new(),
            memory: MemoryKind::Device,
        }
    }

    /// Whether the identity was read: every GPU NVML can talk to has a UUID.
    pub fn is_known(&self) -> bool {
        !self.uuid.is_empty()
    }
}

/// A MIG instance of a GPU, as the last MIG rescan found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigInfo {
    pub mig_uuid: String,
    pub name: String,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
}

/// One MIG instance in one sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigSample {
    pub info: Arc<MigInfo>,
    /// `None` when its memory query failed in this sample.
    pub memory: Option<MemoryInfo>,
}

/// Who a process is, from /proc (and the Kubernetes API for pod names).
/// Shared (`Arc`) between snapshots: looked up once per (pid, start time).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcIdentity {
    /// `/proc/<pid>/comm`, empty when unreadable.
    pub comm: Arc<str>,
    /// Owner's user name (host passwd), or the uid in decimal; empty when
    /// the process is not visible.
    pub user: Arc<str>,
    /// 64-hex container id from the cgroup path; empty outside containers.
    pub container_id: Arc<str>,
    /// Kubernetes pod UID from the cgroup path; empty outside pods.
    pub pod_uid: Arc<str>,
    /// The Slurm job (and step, uid) from the cgroup path; `None` outside
    /// Slurm jobs.
    pub slurm: Option<SlurmJob>,
    /// Redacted, truncated command line; `None` unless enabled.
    pub cmdline: Option<Arc<str>>,
    /// Resolved through the pod watcher; empty when unknown.
    pub namespace: Arc<str>,
    pub pod: Arc<str>,
    pub container: Arc<str>,
    /// Name, image and compose labels from the container engine's API
    /// (`containers.engine_socket`); `None` when off, not in a container,
    /// not known (yet), or when the pod watcher knows the process.
    pub engine: Option<Arc<ContainerInfo>>,
}

/// A container as the Docker Engine API (Docker, Podman) describes it:
/// `GET /containers/{id}/json`. Empty fields are unknown.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerInfo {
    /// `.Name` without its leading `/`.
    pub name: Arc<str>,
    /// `.Config.Image`, as the container was created from.
    pub image: Arc<str>,
    /// `.Config.Labels["com.docker.compose.project"]`.
    pub compose_project: Arc<str>,
    /// `.Config.Labels["com.docker.compose.service"]`.
    pub compose_service: Arc<str>,
}

/// Container engine API lookups so far, by outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ContainerLookups {
    /// Answered with the container.
    pub found: u64,
    /// Answered 404: the engine does not know the id (negative cache).
    pub not_found: u64,
    /// No answer: socket missing or refused, timeout, an unexpected
    /// status, a malformed body.
    pub error: u64,
}

/// A process's Slurm job, from its cgroup path (`attribute::slurm`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlurmJob {
    /// The numeric job id, or the job's SLUID where the path names it so
    /// (Slurm 26.05's default cgroup v2 layout).
    pub job: Arc<str>,
    /// `batch`, `extern`, `interactive` or the step number; empty when the
    /// process sits in the job's own cgroup.
    pub step: Arc<str>,
    /// The job owner's uid (cgroup v1 paths only); empty otherwise.
    pub uid: Arc<str>,
}

/// Processes left out of the per-process series by `processes.min_bytes`
/// or `processes.top_n`, summed so totals still add up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OtherProcesses {
    pub count: u64,
    pub used_bytes: u64,
}

/// Driver-wide identity, read when NVML is opened (again after a re-open).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriverInfo {
    pub driver_version: String,
    pub nvml_version: String,
    /// CUDA driver API version as `major.minor`, e.g. `13.0`.
    pub cuda_driver_version: String,
}

/// Device memory as NVML's `nvmlDeviceGetMemoryInfo_v2` reports it, in bytes
/// (or, for a unified-memory GPU, the host's: see [`MemoryKind::Unified`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryInfo {
    pub total: u64,
    /// `None` on a unified-memory GPU: there is no driver reservation to
    /// report, and a 0 would be a fake figure.
    pub reserved: Option<u64>,
    pub used: u64,
    pub free: u64,
}

/// One process on one GPU, as NVML reports it (compute and graphics lists
/// merged, one entry per pid).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessSample {
    pub pid: u32,
    /// `None` when NVML answers NVML_VALUE_NOT_AVAILABLE for this process
    /// (e.g. under some virtualisation): exported as a separate signal,
    /// never as a fake 0.
    pub used_bytes: Option<u64>,
    /// Name, owner, container and pod.
    pub ident: Arc<ProcIdentity>,
    /// MIG instance the process runs on (MIG mode only).
    pub gpu_instance_id: Option<u32>,
    pub compute_instance_id: Option<u32>,
    /// Largest `used_bytes` seen for this pid on this GPU over the last
    /// `peak_window` (full samples only).
    pub used_peak_bytes: Option<u64>,
    /// PyTorch allocator figures the process itself published for this GPU
    /// (torch bridge, read in this tick); `None` without the bridge.
    pub torch: Option<TorchStats>,
    /// What the switchable collectors read of this process (e.g. the
    /// `process_utilization` collector's busy percentages); empty when
    /// they are off or the GPU does not support their calls.
    pub readings: Readings,
}

/// PyTorch caching-allocator figures of one process on one GPU, from
/// `torch.cuda.memory_stats()` via the torch bridge: bytes, and counts for
/// `alloc_retries` and `ooms`. The `Option`s are what a bridge may leave
/// out (an older bridge, a torch without the figure, a setting not made).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorchStats {
    pub allocated: u64,
    pub reserved: u64,
    pub allocated_peak: u64,
    pub reserved_peak: u64,
    pub active: u64,
    pub inactive_split: u64,
    pub alloc_retries: u64,
    pub ooms: u64,
    /// The large (blocks over 1 MiB) and small pools, where fragmentation
    /// shows.
    pub pools: Option<TorchPools>,
    /// Bytes the allocator may reserve on this GPU, when the process set a
    /// per-process memory fraction below 1.
    pub limit: Option<u64>,
    /// Allocator settings (the process's, the same on each of its GPUs);
    /// `None` when its `PYTORCH_CUDA_ALLOC_CONF` is malformed.
    pub allocator: Option<AllocatorSettings>,
    /// OOM snapshots the bridge wrote for OOMs on this GPU, when the
    /// process turned them on (`GPUMEM_BRIDGE_OOM_SNAPSHOT_DIR`).
    pub oom_snapshots: Option<u64>,
    /// Per-step figures from the bridge's optimizer step hook (or
    /// `gpumem_bridge.step()`), when the process has taken steps.
    pub steps: Option<TorchSteps>,
    /// The bridge's in-process threshold (`GPUMEM_BRIDGE_WARN_AT`), when set.
    pub threshold: Option<TorchThreshold>,
}

/// What the bridge recorded at the end of each training step on one GPU,
/// reduced to the figures exported (the steps themselves are not kept).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorchSteps {
    /// Steps the process has taken (every optimizer step, or `step()` call).
    pub total: u64,
    /// Allocated bytes at the end of the last recorded step.
    pub allocated: Option<u64>,
    /// Least-squares slope of allocated-at-step-end over step number, over
    /// the last `window` steps; `None` with fewer than
    /// [`crate::trend::MIN_GROWTH_STEPS`].
    pub growth: Option<Slope>,
    /// Steps and milliseconds from the first to the last step of the
    /// window (steps per second), when time passed between them.
    pub pace: Option<(u64, u64)>,
    /// Steps the figures are over (at most [`crate::trend::MAX_GROWTH_STEPS`]).
    pub window: u32,
}

impl TorchSteps {
    /// Growth in bytes per step.
    pub fn growth_bytes(&self) -> Option<f64> {
        self.growth.map(Slope::value)
    }

    /// Steps per second over the window.
    pub fn steps_per_second(&self) -> Option<f64> {
        self.pace
            .map(|(steps, ms)| steps as f64 * 1000.0 / ms as f64)
    }
}

/// The bridge's threshold on reserved bytes, and its upward crossings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorchThreshold {
    pub bytes: u64,
    pub crossings: u64,
    /// Reserved is at or above the threshold now (not yet re-armed).
    pub above: bool,
}

/// `torch.cuda.memory_stats()`' `*.large_pool.current` and
/// `*.small_pool.current`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorchPools {
    pub large: TorchPool,
    pub small: TorchPool,
}

/// One allocator pool: bytes, and the number of segments (`cudaMalloc`
/// calls the pool holds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorchPool {
    pub allocated: u64,
    pub reserved: u64,
    pub inactive_split: u64,
    pub segments: u64,
}

/// The caching-allocator settings that change what the figures mean, as
/// the bridge parsed them from the process's `PYTORCH_CUDA_ALLOC_CONF`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocatorSettings {
    pub backend: AllocatorBackend,
    pub expandable_segments: bool,
    /// Blocks larger than this are never split; `None`: unlimited.
    pub max_split_size: Option<u64>,
}

/// `backend:` of `PYTORCH_CUDA_ALLOC_CONF`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AllocatorBackend {
    /// The caching allocator (the default).
    #[default]
    Native,
    /// `cudaMallocAsync` (torch's `async`): most allocator figures are 0.
    CudaMallocAsync,
}

impl AllocatorBackend {
    pub fn as_str(self) -> &'static str {
        match self {
            AllocatorBackend::Native => "native",
            AllocatorBackend::CudaMallocAsync => "cudaMallocAsync",
        }
    }
}

/// Torch bridge documents accepted and dropped so far (by reason).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorchCounters {
    pub reports: u64,
    pub malformed: u64,
    pub oversized: u64,
    pub permission: u64,
}

/// One GPU in one sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSample {
    pub info: Arc<DeviceInfo>,
    /// `None` when the GPU did not answer in this sample (`gpu_up` 0).
    pub memory: Option<MemoryInfo>,
    /// Largest `memory.used` seen over the last `peak_window`, from the fast
    /// memory samples and the full samples alike.
    pub used_peak_bytes: Option<u64>,
    /// Sorted by pid. Shared between snapshots: only full samples change it.
    pub processes: Arc<[ProcessSample]>,
    /// Processes not listed one by one (min_bytes / top_n), if any.
    pub other: Option<OtherProcesses>,
    /// MIG instances with their memory (empty without MIG).
    pub mig: Arc<[MigSample]>,
    /// What the switchable collectors (`sample/collectors/`) read of this
    /// GPU, one reading per collector that is on and answered; empty while
    /// the GPU is down.
    pub readings: Readings,
}

impl DeviceSample {
    pub fn up(&self) -> bool {
        self.memory.is_some()
    }
}

/// What one collector read of one GPU or process in one sample: any plain
/// data type (`Debug`, `Eq`, shareable), found again by its type. The
/// collector module and its family group in `expose/` agree on the type;
/// this file does not need to know it, so a new collector adds none here.
pub trait Reading: Any + fmt::Debug + Send + Sync {
    fn as_any(&self) -> &dyn Any;
    /// Equal to `other` (same type, same value).
    fn same(&self, other: &dyn Reading) -> bool;
}

impl<T: Any + fmt::Debug + Send + Sync + Eq> Reading for T {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn same(&self, other: &dyn Reading) -> bool {
        other.as_any().downcast_ref::<T>() == Some(self)
    }
}

/// The readings of one GPU (or process) in one sample, at most one per
/// type. Cloning shares them (`Arc`): a memory-only sample carries the
/// last full sample's readings at the cost of a few pointer copies.
#[derive(Debug, Clone, Default)]
pub struct Readings(Vec<Arc<dyn Reading>>);

impl Readings {
    /// The reading of type `T`, if a collector left one.
    pub fn get<T: Reading>(&self) -> Option<&T> {
        self.0
            .iter()
            .find_map(|r| (**r).as_any().downcast_ref::<T>())
    }

    /// Add a reading (replacing one of the same type).
    pub fn put(&mut self, reading: Arc<dyn Reading>) {
        let id = (*reading).as_any().type_id();
        self.0.retain(|r| (**r).as_any().type_id() != id);
        self.0.push(reading);
    }

    /// These readings and `reading` (building a sample by hand).
    pub fn with<T: Reading>(mut self, reading: T) -> Self {
        self.put(Arc::new(reading));
        self
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The very same readings as `other` (the same `Arc`s, in order):
    /// what a memory-only sample carries over from the last full one.
    pub fn same_arcs(&self, other: &Readings) -> bool {
        self.0.len() == other.0.len()
            && self
                .0
                .iter()
                .zip(&other.0)
                .all(|(a, b)| std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b)))
    }
}

impl PartialEq for Readings {
    fn eq(&self, other: &Self) -> bool {
        self.0.len() == other.0.len()
            && self
                .0
                .iter()
                .all(|a| other.0.iter().any(|b| (**a).same(&**b)))
    }
}

impl Eq for Readings {}

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
    /// Per GPU (by position in `devices`), when its memory would be full at
    /// the rate of the last 10 minutes of the exporter's own history;
    /// `None` where it is not growing. Computed when published.
    pub forecasts: Vec<Option<Forecast>>,
}

/// "Full in about N minutes at the last 10 minutes' rate", from the
/// exporter's one-second used-memory history (see `history`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Forecast {
    /// Seconds until free memory reaches 0 at `growth_bytes_per_second`.
    pub full_in_seconds: f64,
    /// Least-squares slope of used bytes over the window.
    pub growth_bytes_per_second: f64,
    /// Seconds of history the slope is over.
    pub window_seconds: u64,
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
            nvml_reinit_attempts: 0,
            kubernetes: None,
            torch: None,
            containers: None,
            pod_resources: None,
            job_mapping: None,
            exporter: ExporterCounters::default(),
            forecasts: Vec::new(),
        }
    }
}

/// Counters of the config reloads and the HTTP server (see
/// `crate::telemetry`), as of publication.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExporterCounters {
    pub config_reloads_success: u64,
    pub config_reloads_failure: u64,
    pub web_config_reloads_success: u64,
    pub web_config_reloads_failure: u64,
    pub http_connections_open: u64,
    pub http_connections_evicted: u64,
    pub http_connections_refused: u64,
    /// Response bodies encoded, by body: each at most once per snapshot,
    /// however many requests ask.
    pub http_body_encodes: HttpBodyCounts,
}

/// A body the HTTP side encodes from a snapshot: the `body` label of
/// `gpumem_exporter_http_body_encodes_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpBody {
    Text,
    OpenMetrics,
    SnapshotJson,
    HistoryJson,
}

impl HttpBody {
    /// Every body, in exposition order.
    pub const ALL: [HttpBody; 4] = [
        HttpBody::Text,
        HttpBody::OpenMetrics,
        HttpBody::SnapshotJson,
        HttpBody::HistoryJson,
    ];

    pub fn label(self) -> &'static str {
        match self {
            HttpBody::Text => "text",
            HttpBody::OpenMetrics => "openmetrics",
            HttpBody::SnapshotJson => "snapshot_json",
            HttpBody::HistoryJson => "history_json",
        }
    }
}

/// One count per [`HttpBody`]: `u64` as published, `AtomicU64` where
/// counted (`crate::telemetry`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HttpBodyCounts<T = u64> {
    pub text: T,
    pub openmetrics: T,
    pub snapshot_json: T,
    pub history_json: T,
}

impl<T> HttpBodyCounts<T> {
    /// The count of `body`.
    pub fn get(&self, body: HttpBody) -> &T {
        match body {
            HttpBody::Text => &self.text,
            HttpBody::OpenMetrics => &self.openmetrics,
            HttpBody::SnapshotJson => &self.snapshot_json,
            HttpBody::HistoryJson => &self.history_json,
        }
    }

    /// Each count through `f`.
    pub fn map<U>(&self, mut f: impl FnMut(&T) -> U) -> HttpBodyCounts<U> {
        HttpBodyCounts {
            text: f(&self.text),
            openmetrics: f(&self.openmetrics),
            snapshot_json: f(&self.snapshot_json),
            history_json: f(&self.history_json),
        }
    }
}

/// The pod watcher's state and counters, read from its index and copied
/// into each full snapshot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KubeState {
    /// Pods of this node in the index.
    pub pods: u64,
    /// A LIST has completed: the index reflects the API server, not just
    /// an empty start.
    pub synced: bool,
    /// Completed LISTs (all pages), the first one included.
    pub lists_total: u64,
    /// Watches re-opened without a relist (stream end, drop, error).
    pub watch_restarts_total: u64,
    /// Well-formed watch events, bookmarks and `ERROR` events included.
    pub events_total: u64,
    /// Failed requests, bad statuses, malformed or oversize lines, `ERROR`
    /// events other than 410.
    pub errors_total: u64,
    /// When the API server last confirmed the index: a completed LIST or any
    /// watch event (bookmarks included). 0 before the first LIST.
    pub last_sync_unix_seconds: u64,
}

/// One device the kubelet allocated to one container, from the
/// pod-resources API's `List`. Which GPU it is, is decided when a snapshot
/// is encoded, from that snapshot's devices and MIG instances.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Allocation {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    /// The extended resource, e.g. `nvidia.com/gpu`, `nvidia.com/mig-1g.10gb`.
    pub resource: String,
    pub device: AllocatedDevice,
    /// The time-slicing replica (`<device id>::<replica>`), if the device
    /// plugin shares the device that way.
    pub replica: Option<u32>,
}

/// A device id as the NVIDIA device plugin reports it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum AllocatedDevice {
    /// A whole GPU by its UUID (`GPU-…`).
    Gpu { uuid: String },
    /// A MIG device by its UUID (`MIG-…`, drivers R470 and later).
    Mig { mig_uuid: String },
    /// A MIG device by its UUID and its parent GPU's (a DRA ResourceSlice's
    /// `uuid` and `parentUUID`): the parent names the GPU even before a MIG
    /// rescan has seen a device the DRA driver has just created.
    MigOfParent { mig_uuid: String, gpu_uuid: String },
    /// A MIG device in the older form `MIG-GPU-<uuid>/<gi>/<ci>`.
    MigOfGpu {
        gpu_uuid: String,
        gpu_instance_id: u32,
        compute_instance_id: u32,
    },
    /// A whole GPU by its NVML index (a Slurm job-mapping file's name).
    GpuIndex { gpu: String },
    /// A MIG device by its GPU's index and GPU instance id (dcgm-exporter's
    /// `<gpu>.<gpu_instance>` mapping file names).
    MigOfGpuIndex { gpu: String, gpu_instance_id: u32 },
    /// Any other id (another device plugin's resource): kept as it is.
    Other { id: String },
}

/// One device a Dynamic Resource Allocation driver allocated to one
/// container through a ResourceClaim, from the same pod-resources `List`
/// (`dynamic_resources`). One per (container, claim, device): a device
/// shared by several claims is several of these. Placed on the snapshot's
/// GPUs when encoded, like an [`Allocation`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct DraAllocation {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    /// From the pod watcher's index (by namespace and name), when it is on
    /// and knows the pod.
    pub pod_uid: Option<String>,
    pub claim_namespace: String,
    pub claim_name: String,
    /// The DRA driver, e.g. `gpu.nvidia.com`.
    pub driver: String,
    pub pool: String,
    /// The device's name in its pool, e.g. `gpu-0`, `gpu-1-mig-9-4-1`.
    pub device_name: String,
    /// Which GPU or MIG device: from this node's ResourceSlices; else the
    /// index in the device's name ([`AllocatedDevice::GpuIndex`]); else
    /// unknown (`Other` with an empty id).
    pub device: AllocatedDevice,
}

/// One device a Slurm job holds, from the job-mapping directory its
/// prolog writes (`jobmap`). Placed on this snapshot's GPUs when encoded,
/// like an [`Allocation`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct JobAllocation {
    pub device: AllocatedDevice,
    /// The job id as the file holds it.
    pub job: String,
    /// The job owner's uid, where the format has it (jobstats).
    pub uid: Option<String>,
}

/// The job-mapping reader's latest read and its counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobMappingState {
    /// Sorted, without duplicates; empty while the directory is missing.
    pub allocations: Arc<[JobAllocation]>,
    /// Reads of the directory so far.
    pub reads_total: u64,
    /// What could not be read, by reason.
    pub errors: JobMappingErrors,
}

/// Job-mapping entries skipped (or reads failed) so far, by reason: the
/// `reason` label of `gpumem_exporter_slurm_job_mapping_errors_total`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JobMappingErrors {
    /// The directory or a file could not be read.
    pub read: u64,
    /// A file's name is no device of the configured format.
    pub name: u64,
    /// A file holds no valid job id (or a malformed line).
    pub content: u64,
    /// A file larger than the per-file limit.
    pub too_large: u64,
    /// Files beyond the per-read limit.
    pub too_many: u64,
}

impl JobMappingErrors {
    /// (label, count) in exposition order.
    pub fn by_reason(&self) -> [(&'static str, u64); 5] {
        [
            ("content", self.content),
            ("name", self.name),
            ("read", self.read),
            ("too_large", self.too_large),
            ("too_many", self.too_many),
        ]
    }
}

/// The pod-resources client's latest answer and its counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodResourcesState {
    /// Sorted, without duplicates; empty until the first `List` answered
    /// and again when answers have failed for three intervals.
    pub allocations: Arc<[Allocation]>,
    /// `List` calls answered.
    pub lists_total: u64,
    /// `List` calls that failed (no socket, no answer in time, an error
    /// status, an answer that could not be decoded).
    pub errors_total: u64,
    /// The DRA devices of the same answer (sorted, without duplicates).
    pub dra: Arc<[DraAllocation]>,
    /// DRA devices not found in this node's ResourceSlices and placed by
    /// the index in their name (or not at all), once per device per answer.
    pub dra_fallbacks_total: u64,
    /// The ResourceSlice watcher's failed requests (403 included), when it
    /// runs (the pod watcher is on).
    pub resource_slice_errors_total: Option<u64>,
}
