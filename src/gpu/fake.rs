//! An in-process [`GpuSource`] with scripted answers, so the sampler's tick
//! (selection, peaks, error counting, MIG, attribution calls) gets unit
//! tests without a GPU, the fake `libnvidia-ml.so.1` or the binary. Change
//! a device's answers between ticks through `Sampler::gpu_mut`.
//!
//! The end-to-end tests use the cdylib in `tests/fake-nvml` instead, which
//! stands in for the real library under the production NVML code.

use super::{GpuError, GpuSource, RawProcess, merge_process};
use crate::model::{DeviceInfo, DriverInfo, MemoryInfo, MigInfo};

/// One scripted GPU.
#[derive(Debug, Clone)]
pub struct FakeDevice {
    pub info: DeviceInfo,
    /// What the next `memory` call answers.
    pub memory: Result<MemoryInfo, GpuError>,
    /// What the next `processes` call answers (merged by pid, as NVML's
    /// compute, graphics and MPS lists are).
    pub processes: Result<Vec<RawProcess>, GpuError>,
    /// MIG instances and what their memory query answers.
    pub mig: Vec<(MigInfo, Result<MemoryInfo, GpuError>)>,
}

impl FakeDevice {
    /// GPU `index` with `total` bytes of which `used` are used, and no
    /// processes.
    pub fn new(index: usize, total: u64, used: u64) -> Self {
        FakeDevice {
            info: DeviceInfo {
                gpu: index.to_string(),
                uuid: format!("GPU-fake-{index:04}"),
                name: "Fake GPU".into(),
                pci_bus_id: format!("00000000:{index:02X}:00.0"),
            },
            memory: Ok(memory(total, used)),
            processes: Ok(Vec::new()),
            mig: Vec::new(),
        }
    }
}

/// Memory with no reserved bytes.
pub fn memory(total: u64, used: u64) -> MemoryInfo {
    MemoryInfo {
        total,
        reserved: 0,
        used,
        free: total.saturating_sub(used),
    }
}

/// A process with a memory figure.
pub fn process(pid: u32, used: u64) -> RawProcess {
    RawProcess {
        pid,
        used_bytes: Some(used),
        gpu_instance_id: None,
        compute_instance_id: None,
    }
}

/// Scripted GPUs, and how often each was asked.
#[derive(Debug, Clone, Default)]
pub struct FakeGpu {
    pub driver: DriverInfo,
    pub devices: Vec<FakeDevice>,
    /// `processes` calls so far, all devices.
    pub process_calls: u64,
    infos: Vec<DeviceInfo>,
    migs: Vec<Vec<MigInfo>>,
}

impl FakeGpu {
    /// These devices, identities fixed from now on (as NVML's are read once).
    pub fn new(devices: Vec<FakeDevice>) -> Self {
        FakeGpu {
            driver: DriverInfo {
                driver_version: "580.0".into(),
                nvml_version: "13.580.0".into(),
                cuda_driver_version: "13.0".into(),
            },
            infos: devices.iter().map(|d| d.info.clone()).collect(),
            migs: devices
                .iter()
                .map(|d| d.mig.iter().map(|(m, _)| m.clone()).collect())
                .collect(),
            devices,
            process_calls: 0,
        }
    }

    fn device(&self, i: usize, operation: &'static str) -> Result<&FakeDevice, GpuError> {
        self.devices.get(i).ok_or(GpuError {
            operation,
            error: super::error::INVALID_DEVICE_INDEX,
        })
    }
}

impl GpuSource for FakeGpu {
    fn driver_info(&self) -> DriverInfo {
        self.driver.clone()
    }

    fn devices(&self) -> &[DeviceInfo] {
        &self.infos
    }

    fn memory(&mut self, device: usize) -> Result<MemoryInfo, GpuError> {
        self.device(device, "memory_info")?.memory.clone()
    }

    fn processes(&mut self, device: usize, out: &mut Vec<RawProcess>) -> Result<(), GpuError> {
        self.process_calls += 1;
        for p in self
            .device(device, "running_compute_processes")?
            .processes
            .clone()?
        {
            merge_process(out, p);
        }
        Ok(())
    }

    fn mig_devices(&self, device: usize) -> &[MigInfo] {
        self.migs.get(device).map_or(&[], Vec::as_slice)
    }

    fn mig_memory(&mut self, device: usize, mig: usize) -> Result<MemoryInfo, GpuError> {
        let d = self.device(device, "mig_memory_info")?;
        match d.mig.get(mig) {
            Some((_, m)) => m.clone(),
            None => Err(GpuError {
                operation: "mig_memory_info",
                error: super::error::INVALID_DEVICE_INDEX,
            }),
        }
    }
}
