//! Who holds which GPU, from outside NVML: the kubelet's device-plugin
//! and DRA allocations (pod-resources `List`), Slurm's job mapping, and
//! the counters of the clients that read them. Placed on a snapshot's
//! GPUs only when it is encoded.

use std::sync::Arc;

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
    /// An entry that is no regular file (a symlink, a FIFO, a device):
    /// never followed, never read.
    pub not_regular: u64,
    /// Reads of a directory refused whole: not owned by root, or
    /// writable by group or others.
    pub unsafe_dir: u64,
}

impl JobMappingErrors {
    /// (label, count) in exposition order.
    pub fn by_reason(&self) -> [(&'static str, u64); 7] {
        [
            ("content", self.content),
            ("name", self.name),
            ("not_regular", self.not_regular),
            ("read", self.read),
            ("too_large", self.too_large),
            ("too_many", self.too_many),
            ("unsafe_dir", self.unsafe_dir),
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
