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
    /// When set, `identify` fails with it (a GPU that fell off the bus
    /// before the exporter started).
    pub identity_error: Option<GpuError>,
    /// What the next `memory` call answers.
    pub memory: Result<MemoryInfo, GpuError>,
    /// What the next `processes` call answers (merged by pid, as NVML's
    /// compute, graphics and MPS lists are).
    pub processes: Result<Vec<RawProcess>, GpuError>,
    /// The MIG layout now, and what each instance's memory query answers.
    /// `mig_memory` answers for the layout last handed out by `mig_layout`:
    /// an instance removed since is a stale handle (`invalid_arg`).
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
            identity_error: None,
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

/// Scripted GPUs, and how often each call was made.
#[derive(Debug, Clone, Default)]
pub struct FakeGpu {
    pub driver: DriverInfo,
    /// The GPUs; their number is fixed at construction (as NVML's count is
    /// at init), their answers may change between ticks.
    pub devices: Vec<FakeDevice>,
    /// `processes` calls so far, all devices.
    pub process_calls: u64,
    /// `identify` calls so far, all devices.
    pub identify_calls: u64,
    /// `mig_layout` calls so far, all devices.
    pub mig_layout_calls: u64,
    /// Set by `close`: every call fails with `uninitialized` from then on.
    pub closed: bool,
    count: usize,
    /// Per GPU: the MIG UUIDs of the layout last handed out.
    handed_out: Vec<Vec<String>>,
}

const CLOSED: GpuError = GpuError {
    operation: "fake",
    error: "uninitialized",
};

impl FakeGpu {
    /// These devices, as NVML enumerates them when opened.
    pub fn new(devices: Vec<FakeDevice>) -> Self {
        FakeGpu {
            driver: DriverInfo {
                driver_version: "580.0".into(),
                nvml_version: "13.580.0".into(),
                cuda_driver_version: "13.0".into(),
            },
            count: devices.len(),
            handed_out: vec![Vec::new(); devices.len()],
            devices,
            ..FakeGpu::default()
        }
    }

    fn device(&self, i: usize, operation: &'static str) -> Result<&FakeDevice, GpuError> {
        if self.closed {
            return Err(GpuError {
                operation,
                ..CLOSED
            });
        }
        self.devices
            .get(i)
            .filter(|_| i < self.count)
            .ok_or(GpuError {
                operation,
                error: super::error::INVALID_DEVICE_INDEX,
            })
    }
}

impl GpuSource for FakeGpu {
    fn driver_info(&self) -> DriverInfo {
        self.driver.clone()
    }

    fn device_count(&self) -> usize {
        self.count
    }

    fn identify(&mut self, device: usize) -> Result<DeviceInfo, GpuError> {
        self.identify_calls += 1;
        let d = self.device(device, "device_uuid")?;
        match &d.identity_error {
            Some(e) => Err(e.clone()),
            None => Ok(d.info.clone()),
        }
    }

    fn mig_layout(&mut self, device: usize) -> Result<Vec<MigInfo>, GpuError> {
        self.mig_layout_calls += 1;
        let d = self.device(device, "mig_mode")?;
        let infos: Vec<MigInfo> = d.mig.iter().map(|(m, _)| m.clone()).collect();
        if let Some(slot) = self.handed_out.get_mut(device) {
            *slot = infos.iter().map(|m| m.mig_uuid.clone()).collect();
        }
        Ok(infos)
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

    fn mig_memory(&mut self, device: usize, mig: usize) -> Result<MemoryInfo, GpuError> {
        let d = self.device(device, "mig_memory_info")?;
        let invalid = |error| GpuError {
            operation: "mig_memory_info",
            error,
        };
        let uuid = self
            .handed_out
            .get(device)
            .and_then(|l| l.get(mig))
            .ok_or(invalid(super::error::INVALID_DEVICE_INDEX))?;
        match d.mig.iter().find(|(m, _)| &m.mig_uuid == uuid) {
            Some((_, m)) => m.clone(),
            // The instance was destroyed: its handle is stale.
            None => Err(invalid("invalid_arg")),
        }
    }

    fn close(&mut self) {
        self.closed = true;
    }
}
