//! An in-process [`GpuSource`] with scripted answers, so the sampler's tick
//! (selection, peaks, error counting, MIG, attribution calls) gets unit
//! tests without a GPU, the fake `libnvidia-ml.so.1` or the binary. Change
//! a device's answers between ticks through `Sampler::gpu_mut`.
//!
//! The end-to-end tests use the cdylib in `tests/fake-nvml` instead, which
//! stands in for the real library under the production NVML code.

use super::readings::{Gpm, Health, PowerThermal, Utilization, Virtualization};
use super::{
    ErrorKind, GpuError, GpuSource, Operation, ProcessUtilizationSample, RawProcess, merge_process,
};
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
    /// Collector answers: a `None` field answers `not_supported`.
    pub utilization: Utilization,
    pub power: PowerThermal,
    pub health: Health,
    /// Process utilisation samples (`None`: not supported); a call returns
    /// those newer than its `since_us`.
    pub process_utilization: Option<Vec<ProcessUtilizationSample>>,
    /// Xid events still to deliver (`None`: the GPU has no Xid events).
    pub xid: Option<Vec<u64>>,
    /// When set, the power_thermal collector's call fails with it.
    pub collector_error: Option<GpuError>,
    /// nvmlDeviceGetVirtualizationMode's answer.
    pub virtualization: Virtualization,
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
                memory: Default::default(),
            },
            identity_error: None,
            memory: Ok(memory(total, used)),
            processes: Ok(Vec::new()),
            mig: Vec::new(),
            utilization: Utilization::default(),
            power: PowerThermal::default(),
            health: Health::default(),
            process_utilization: None,
            xid: None,
            collector_error: None,
            virtualization: Virtualization::None,
        }
    }
}

/// Memory with no reserved bytes.
pub fn memory(total: u64, used: u64) -> MemoryInfo {
    MemoryInfo {
        total,
        reserved: Some(0),
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
    /// Collector calls so far, all devices: utilization, power_thermal,
    /// health, process_utilization, xid_events.
    pub collector_calls: [u64; 5],
    /// `energy` and `ecc_mode` calls so far, all devices.
    pub slow_calls: u64,
    /// Devices registered for Xid events.
    pub xid_watched: Vec<usize>,
    /// Set by `close`: every call fails with `uninitialized` from then on.
    pub closed: bool,
    count: usize,
    /// Per GPU: the MIG UUIDs of the layout last handed out.
    handed_out: Vec<Vec<String>>,
}

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

    fn device(&self, i: usize, operation: Operation) -> Result<&FakeDevice, GpuError> {
        if self.closed {
            return Err(GpuError::new(operation, ErrorKind::Uninitialized));
        }
        self.devices
            .get(i)
            .filter(|_| i < self.count)
            .ok_or(GpuError::new(operation, ErrorKind::InvalidDeviceIndex))
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
        let d = self.device(device, Operation::DeviceUuid)?;
        match &d.identity_error {
            Some(e) => Err(*e),
            None => Ok(d.info.clone()),
        }
    }

    fn mig_layout(&mut self, device: usize) -> Result<Vec<MigInfo>, GpuError> {
        self.mig_layout_calls += 1;
        let d = self.device(device, Operation::MigMode)?;
        let infos: Vec<MigInfo> = d.mig.iter().map(|(m, _)| m.clone()).collect();
        if let Some(slot) = self.handed_out.get_mut(device) {
            *slot = infos.iter().map(|m| m.mig_uuid.clone()).collect();
        }
        Ok(infos)
    }

    fn memory(&mut self, device: usize) -> Result<MemoryInfo, GpuError> {
        self.device(device, Operation::MemoryInfo)?.memory
    }

    fn processes(&mut self, device: usize, out: &mut Vec<RawProcess>) -> Result<(), GpuError> {
        self.process_calls += 1;
        for p in self
            .device(device, Operation::RunningComputeProcesses)?
            .processes
            .clone()?
        {
            merge_process(out, p);
        }
        Ok(())
    }

    fn mig_memory(&mut self, device: usize, mig: usize) -> Result<MemoryInfo, GpuError> {
        let d = self.device(device, Operation::MigMemoryInfo)?;
        let invalid = |kind| GpuError::new(Operation::MigMemoryInfo, kind);
        let uuid = self
            .handed_out
            .get(device)
            .and_then(|l| l.get(mig))
            .ok_or(invalid(ErrorKind::InvalidDeviceIndex))?;
        match d.mig.iter().find(|(m, _)| &m.mig_uuid == uuid) {
            Some((_, m)) => *m,
            // The instance was destroyed: its handle is stale.
            None => Err(invalid(ErrorKind::InvalidArg)),
        }
    }

    fn utilization(&mut self, device: usize, failed: &mut Vec<GpuError>) -> Utilization {
        self.collector_calls[0] += 1;
        match self.device(device, Operation::UtilizationRates) {
            Ok(d) => {
                let u = d.utilization;
                for (op, missing) in [
                    (Operation::UtilizationRates, u.gpu.is_none()),
                    (Operation::EncoderUtilization, u.encoder.is_none()),
                    (Operation::DecoderUtilization, u.decoder.is_none()),
                ] {
                    if missing {
                        failed.push(unsupported(op));
                    }
                }
                u
            }
            Err(e) => {
                failed.push(e);
                Utilization::default()
            }
        }
    }

    fn power_thermal(&mut self, device: usize, failed: &mut Vec<GpuError>) -> PowerThermal {
        self.collector_calls[1] += 1;
        match self.device(device, Operation::Temperature) {
            Ok(d) => {
                if let Some(e) = &d.collector_error {
                    failed.push(*e);
                    return PowerThermal::default();
                }
                if d.power.temperature_c.is_none() {
                    failed.push(unsupported(Operation::Temperature));
                }
                PowerThermal {
                    energy_mj: None,
                    ..d.power
                }
            }
            Err(e) => {
                failed.push(e);
                PowerThermal::default()
            }
        }
    }

    fn energy(&mut self, device: usize) -> Result<u64, GpuError> {
        self.slow_calls += 1;
        self.device(device, Operation::TotalEnergyConsumption)?
            .power
            .energy_mj
            .ok_or(unsupported(Operation::TotalEnergyConsumption))
    }

    fn ecc_mode(&mut self, device: usize) -> Result<bool, GpuError> {
        self.slow_calls += 1;
        self.device(device, Operation::EccMode)?
            .health
            .ecc_enabled
            .ok_or(unsupported(Operation::EccMode))
    }

    fn health(&mut self, device: usize, ecc_enabled: bool, failed: &mut Vec<GpuError>) -> Health {
        self.collector_calls[2] += 1;
        match self.device(device, Operation::RemappedRows) {
            Ok(d) => {
                if d.health.remapped_rows.is_none() {
                    failed.push(unsupported(Operation::RemappedRows));
                }
                Health {
                    ecc_enabled: None,
                    ecc_errors: if ecc_enabled {
                        d.health.ecc_errors
                    } else {
                        [None; 4]
                    },
                    xid_errors: None,
                    ..d.health.clone()
                }
            }
            Err(e) => {
                failed.push(e);
                Health::default()
            }
        }
    }

    fn process_utilization(
        &mut self,
        device: usize,
        since_us: u64,
        out: &mut Vec<ProcessUtilizationSample>,
    ) -> Result<(), GpuError> {
        self.collector_calls[3] += 1;
        let d = self.device(device, Operation::ProcessUtilization)?;
        let samples = d
            .process_utilization
            .as_ref()
            .ok_or(unsupported(Operation::ProcessUtilization))?;
        out.extend(samples.iter().filter(|p| p.timestamp_us > since_us));
        Ok(())
    }

    fn watch_xid(&mut self, device: usize) -> Result<(), GpuError> {
        let d = self.device(device, Operation::RegisterEvents)?;
        if d.xid.is_none() {
            return Err(unsupported(Operation::RegisterEvents));
        }
        self.xid_watched.push(device);
        Ok(())
    }

    fn xid_events(&mut self, out: &mut Vec<(usize, u64)>) -> Result<(), GpuError> {
        self.collector_calls[4] += 1;
        if self.closed {
            return Err(GpuError::new(
                Operation::EventSetWait,
                ErrorKind::Uninitialized,
            ));
        }
        for &i in &self.xid_watched {
            if let Some(list) = self.devices.get_mut(i).and_then(|d| d.xid.as_mut()) {
                out.extend(list.drain(..).map(|x| (i, x)));
            }
        }
        Ok(())
    }

    fn virtualization(&mut self, device: usize) -> Result<Virtualization, GpuError> {
        Ok(self
            .device(device, Operation::VirtualizationMode)?
            .virtualization)
    }

    /// No GPM here: its end-to-end tests run on the fake NVML library.
    fn gpm_supported(&mut self, device: usize) -> Result<bool, GpuError> {
        self.device(device, Operation::GpmQueryDeviceSupport)?;
        Ok(false)
    }

    fn gpm(&mut self, _device: usize, _gpu_instance: Option<u32>) -> Result<Option<Gpm>, GpuError> {
        Err(unsupported(Operation::GpmSampleGet))
    }

    fn mig_gpu_instances(&self, device: usize) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .devices
            .get(device)
            .map(|d| d.mig.iter().map(|(m, _)| m.gpu_instance_id).collect())
            .unwrap_or_default();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    fn close(&mut self) {
        self.closed = true;
    }
}

fn unsupported(operation: Operation) -> GpuError {
    GpuError::new(operation, ErrorKind::NotSupported)
}
