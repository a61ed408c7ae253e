//! The only code that talks to the GPU driver. [`GpuSource`] is the small
//! seam the sampler uses; [`nvml::NvmlSource`] is the production impl,
//! [`fake::FakeGpu`] an in-process one for unit tests of the tick, and
//! [`error`] holds the typed errors (kind and operation) and their labels.

pub mod error;
#[cfg(test)]
pub mod fake;
pub mod nvml;
pub mod readings;

use crate::model::{DeviceInfo, DriverInfo, MemoryInfo, MigInfo};
use readings::{Gpm, Health, PowerThermal, ProcessUtilization, Utilization, Virtualization};

pub use error::{ErrorKind, GpuError, Operation};

/// One process as the driver lists it, before /proc lookups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawProcess {
    pub pid: u32,
    pub used_bytes: Option<u64>,
    /// MIG GPU / compute instance the process runs on (MIG mode only).
    pub gpu_instance_id: Option<u32>,
    pub compute_instance_id: Option<u32>,
}

/// One process utilisation sample as NVML gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessUtilizationSample {
    pub pid: u32,
    /// NVML's CPU timestamp of the sample, µs.
    pub timestamp_us: u64,
    pub utilization: ProcessUtilization,
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
    /// `utilization` collector. Each call that fails leaves its field `None`
    /// and is pushed to `failed` (unsupported calls included).
    fn utilization(&mut self, device: usize, failed: &mut Vec<GpuError>) -> Utilization;
    /// `power_thermal` collector without the energy counter, as
    /// [`GpuSource::utilization`].
    fn power_thermal(&mut self, device: usize, failed: &mut Vec<GpuError>) -> PowerThermal;
    /// Energy since the driver loaded, mJ (slow on the H200: 4.1 ms).
    fn energy(&mut self, device: usize) -> Result<u64, GpuError>;
    /// Whether ECC is on (slow on the H200: 134 µs).
    fn ecc_mode(&mut self, device: usize) -> Result<bool, GpuError>;
    /// `health` collector without the ECC mode and Xid events, as
    /// [`GpuSource::utilization`]; the ECC counters are read only when
    /// `ecc_enabled`.
    fn health(&mut self, device: usize, ecc_enabled: bool, failed: &mut Vec<GpuError>) -> Health;
    /// Process utilisation samples newer than `since_us` (NVML's sample
    /// timestamps, µs), appended to `out`; none newer is `Ok` and empty.
    fn process_utilization(
        &mut self,
        device: usize,
        since_us: u64,
        out: &mut Vec<ProcessUtilizationSample>,
    ) -> Result<(), GpuError>;
    /// Start delivering critical Xid events of this GPU to `xid_events`.
    fn watch_xid(&mut self, device: usize) -> Result<(), GpuError>;
    /// Critical Xid events that arrived since the last call, as (device,
    /// Xid), without waiting.
    fn xid_events(&mut self, out: &mut Vec<(usize, u64)>) -> Result<(), GpuError>;
    /// Whether GPU `device` runs in a vGPU guest (read once, at discovery).
    fn virtualization(&mut self, device: usize) -> Result<Virtualization, GpuError>;
    /// Whether GPU `device` has GPM (`nvmlGpmQueryDeviceSupport`).
    fn gpm_supported(&mut self, device: usize) -> Result<bool, GpuError>;
    /// Take a GPM sample of GPU `device`, or of its MIG GPU instance
    /// `gpu_instance`, and answer the metrics between the previous sample
    /// of the same and this one: `Ok(None)` for the first. The source
    /// keeps the previous sample (an NVML allocation that must be freed
    /// before NVML is shut down, so it cannot outlive the source).
    fn gpm(&mut self, device: usize, gpu_instance: Option<u32>) -> Result<Option<Gpm>, GpuError>;
    /// The GPU instance ids of the MIG layout last read (each once).
    fn mig_gpu_instances(&self, device: usize) -> Vec<u32>;
    /// Let go of the driver (handles, and the library itself), so that the
    /// next open loads it afresh, e.g. after a driver upgrade. Every call
    /// after this fails with [`ErrorKind::Uninitialized`].
    fn close(&mut self);
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
