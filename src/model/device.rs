//! One GPU: its identity, memory, MIG instances and driver, and what one
//! sample holds of it.

use std::sync::Arc;

use super::{OtherProcesses, ProcessSample, Readings};

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
    /// What the switchable collectors (`collectors/`) read of this
    /// GPU, one reading per collector that is on and answered; empty while
    /// the GPU is down. Behind one `Arc`: a memory-only sample shares the
    /// last full sample's with one count, not one per reading.
    pub readings: Arc<Readings>,
}

impl DeviceSample {
    pub fn up(&self) -> bool {
        self.memory.is_some()
    }
}
