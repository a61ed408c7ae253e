//! The only code that opens NVML and makes the sampler's own calls
//! (discovery, memory, processes, MIG). [`GpuSource`] is the small seam the
//! sampler uses; [`nvml::NvmlSource`] is the production impl,
//! [`fake::FakeGpu`] an in-process one for unit tests of the tick.
//!
//! A collector does not widen [`GpuSource`]: it asks for a [`Handle`] on
//! one GPU (or on the source, for event sets) and makes its own calls on
//! it, in its own folder (`collectors/<name>/calls.rs`). The handle is as
//! narrow as NVML allows: the device, the library (for the few calls that
//! take it), and a slot for state that must not outlive the library
//! (`handle::NvmlHandle::state`). Only the sampler thread holds a source, so
//! every call is still made on that one thread.
//!
//! The error labels sit below this module (`crate::gpu_error`); mapping
//! nvml-wrapper's `NvmlError` to them is [`error`]'s.

pub(crate) mod error;
#[cfg(test)]
pub(crate) mod fake;
mod handle;
pub(crate) mod limits;
pub(crate) mod nvml;

use crate::model::{DeviceInfo, DriverInfo, MemoryInfo, MigInfo};

pub(crate) use handle::{Handle, keep};

pub(crate) use error::GpuError;
pub use error::{ErrorKind, Operation};
pub(crate) use limits::DriverLimits;

/// One process as the driver lists it, before /proc lookups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawProcess {
    pub pid: u32,
    pub used_bytes: Option<u64>,
    /// MIG GPU / compute instance the process runs on (MIG mode only).
    pub gpu_instance_id: Option<u32>,
    pub compute_instance_id: Option<u32>,
}

/// nvmlDeviceGetVirtualizationMode, as far as the sampler cares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Virtualization {
    /// Bare metal, passthrough, or a hypervisor host.
    #[default]
    None,
    /// A vGPU guest: some calls misbehave there (row remapping queries
    /// spam the kernel log, nvidia_gpu_exporter #384).
    VgpuGuest,
}

/// What the sampler needs from a GPU driver. Implementations are owned by
/// the sampler thread and never shared.
///
/// Discovery is per device: opening the source only enumerates the GPUs;
/// the sampler asks each one's identity (and MIG layout) itself and retries
/// the ones that do not answer, so one dead GPU does not hide the others.
pub trait GpuSource {
    fn driver_info(&self) -> DriverInfo;
    /// How many GPUs NVML enumerated when the source was opened.
    fn device_count(&self) -> usize;
    /// Read device `device`'s handle and identity (UUID, name, PCI bus id).
    fn identify(&mut self, device: usize) -> Result<DeviceInfo, GpuError>;
    /// Read the GPU's MIG mode and instances afresh, replacing the instance
    /// handles `mig_memory` uses; empty when MIG is off or not supported.
    fn mig_layout(&mut self, device: usize) -> Result<Vec<MigInfo>, GpuError>;
    fn memory(&mut self, device: usize) -> Result<MemoryInfo, GpuError>;
    /// Running compute, graphics and MPS client processes, merged to one
    /// entry per pid and appended to `out`.
    fn processes(&mut self, device: usize, out: &mut Vec<RawProcess>) -> Result<(), GpuError>;
    /// Memory of MIG instance `mig` (its index in the last `mig_layout`).
    fn mig_memory(&mut self, device: usize, mig: usize) -> Result<MemoryInfo, GpuError>;
    /// The GPU instance ids of the MIG layout last read (each once).
    fn mig_gpu_instances(&self, device: usize) -> Vec<u32>;
    /// Whether GPU `device` runs in a vGPU guest (read once, at discovery).
    fn virtualization(&mut self, device: usize) -> Result<Virtualization, GpuError>;
    /// The handle a collector makes its calls on: GPU `device`, or, for
    /// `None`, the source as a whole (event sets). Fails, as `operation`
    /// would, when the GPU has no handle or the source is closed.
    fn handle(
        &mut self,
        device: Option<usize>,
        operation: Operation,
    ) -> Result<Handle<'_>, GpuError>;
    /// Whether the driver has per-cgroup memory limits
    /// (`nvmlDeviceGetMemoryLimits_v1`); `false` while closed.
    fn has_memory_limits(&self) -> bool {
        false
    }
    /// The driver's memory limits of cgroup directory `path` (its full
    /// sysfs path) on GPU `device`; `function_not_found` where the driver
    /// has no such call.
    fn memory_limits(
        &mut self,
        _device: usize,
        _path: &std::ffi::CStr,
    ) -> Result<DriverLimits, GpuError> {
        Err(GpuError::new(
            Operation::MEMORY_LIMITS,
            ErrorKind::FunctionNotFound,
        ))
    }
    /// Let go of the driver (handles, and the library itself), so that the
    /// next open loads it afresh, e.g. after a driver upgrade. Every call
    /// after this fails with [`ErrorKind::Uninitialized`].
    fn close(&mut self);
}

/// Merge `p` into `out`, keeping one entry per pid. A process with both a
/// compute and a graphics context is listed by both queries with the same
/// figure; if only one of them knows the bytes, keep that one.
pub(crate) fn merge_process(out: &mut Vec<RawProcess>, p: RawProcess) {
    match out.iter_mut().find(|q| q.pid == p.pid) {
        Some(q) => {
            q.used_bytes = match (q.used_bytes, p.used_bytes) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            q.gpu_instance_id = q.gpu_instance_id.or(p.gpu_instance_id);
            q.compute_instance_id = q.compute_instance_id.or(p.compute_instance_id);
        }
        None => out.push(p),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(pid: u32, used_bytes: Option<u64>) -> RawProcess {
        RawProcess {
            pid,
            used_bytes,
            gpu_instance_id: None,
            compute_instance_id: None,
        }
    }

    #[test]
    fn merge_dedupes_by_pid_and_keeps_known_bytes() {
        let mut out = Vec::new();
        merge_process(&mut out, p(1, None));
        merge_process(&mut out, p(2, Some(5)));
        merge_process(&mut out, p(1, Some(7)));
        merge_process(&mut out, p(2, Some(3)));
        assert_eq!(out, vec![p(1, Some(7)), p(2, Some(5))]);
    }
}
