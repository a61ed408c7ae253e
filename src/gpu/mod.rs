//! The only code that talks to the GPU driver. [`GpuSource`] is the small
//! seam the sampler uses; [`nvml::NvmlSource`] is the production impl,
//! [`fake::FakeGpu`] an in-process one for unit tests of the tick, and
//! [`error`] maps NVML errors to the `error` label.

pub mod error;
pub mod fake;
pub mod nvml;

use crate::model::{DeviceInfo, DriverInfo, MemoryInfo, MigInfo};

/// A failed driver call: the operation and a stable snake_case error name,
/// exactly the labels of `gpumem_exporter_nvml_errors_total`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{operation}: {error}")]
pub struct GpuError {
    pub operation: &'static str,
    pub error: &'static str,
}

/// One process as the driver lists it, before /proc lookups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawProcess {
    pub pid: u32,
    pub used_bytes: Option<u64>,
    /// MIG GPU / compute instance the process runs on (MIG mode only).
    pub gpu_instance_id: Option<u32>,
    pub compute_instance_id: Option<u32>,
}

/// What the sampler needs from a GPU driver. Implementations are owned by
/// the sampler thread and never shared.
pub trait GpuSource {
    fn driver_info(&self) -> DriverInfo;
    /// Devices in NVML index order, identities read once at start.
    fn devices(&self) -> &[DeviceInfo];
    fn memory(&mut self, device: usize) -> Result<MemoryInfo, GpuError>;
    /// Running compute, graphics and MPS client processes, merged to one
    /// entry per pid and appended to `out`.
    fn processes(&mut self, device: usize, out: &mut Vec<RawProcess>) -> Result<(), GpuError>;
    /// MIG instances of a GPU in MIG mode (read once at start), else empty.
    fn mig_devices(&self, device: usize) -> &[MigInfo];
    /// Memory of one MIG instance (its own memory_info).
    fn mig_memory(&mut self, device: usize, mig: usize) -> Result<MemoryInfo, GpuError>;
}

/// Merge `p` into `out`, keeping one entry per pid. A process with both a
/// compute and a graphics context is listed by both queries with the same
/// figure; if only one of them knows the bytes, keep that one.
pub fn merge_process(out: &mut Vec<RawProcess>, p: RawProcess) {
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
