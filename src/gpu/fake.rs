//! An in-process [`GpuSource`] with scripted answers, so the sampler's tick
//! (selection, peaks, error counting, MIG, attribution calls) gets unit
//! tests without a GPU, the fake `libnvidia-ml.so.1` or the binary. Change
//! a device's answers between ticks through `Sampler::gpu_mut`.
//!
//! It has the shape of the NVML source: the sampler's own calls are
//! [`GpuSource`] methods; a collector's calls get a [`Handle`], and each
//! collector's `calls.rs` answers them from its own script type, kept in
//! [`Scripts`] (per device, or source-wide), so a collector's fake answers
//! live in its folder too.
//!
//! The end-to-end tests use the cdylib in `tests/fake-nvml` instead, which
//! stands in for the real library under the production NVML code.

use std::any::{Any, TypeId};
use std::collections::{BTreeMap, HashMap};
use std::fmt;

use super::{ErrorKind, GpuError, GpuSource, Operation, RawProcess, Virtualization, merge_process};
use crate::model::{DeviceInfo, DriverInfo, MemoryInfo, MigInfo};

/// A script value: any clonable type.
trait Script: Any + Send {
    fn clone_box(&self) -> Box<dyn Script>;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

impl<T: Any + Clone + Send> Script for T {
    fn clone_box(&self) -> Box<dyn Script> {
        Box::new(self.clone())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// The collectors' scripted answers, one value per type (each collector's
/// `calls.rs` names its own types).
#[derive(Default)]
pub struct Scripts(HashMap<TypeId, Box<dyn Script>>);

impl Clone for Scripts {
    fn clone(&self) -> Self {
        Scripts(self.0.iter().map(|(k, v)| (*k, v.clone_box())).collect())
    }
}

impl fmt::Debug for Scripts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Scripts({} values)", self.0.len())
    }
}

impl Scripts {
    /// The script of type `T`, if one was set.
    pub fn get<T: Any>(&self) -> Option<&T> {
        self.0.get(&TypeId::of::<T>())?.as_any().downcast_ref()
    }

    /// The script of type `T`, if one was set, to change.
    pub fn get_mut<T: Any>(&mut self) -> Option<&mut T> {
        self.0
            .get_mut(&TypeId::of::<T>())?
            .as_any_mut()
            .downcast_mut()
    }

    /// The script of type `T`, made with `Default` when first asked.
    pub fn at<T: Any + Clone + Send + Default>(&mut self) -> &mut T {
        let slot = self
            .0
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Box::new(T::default()));
        match slot.as_any_mut().downcast_mut() {
            Some(t) => t,
            None => unreachable!("a script slot holds its own type"),
        }
    }

    /// Set the script of type `T`.
    pub fn set<T: Any + Clone + Send>(&mut self, value: T) {
        self.0.insert(TypeId::of::<T>(), Box::new(value));
    }
}

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
    /// nvmlDeviceGetVirtualizationMode's answer.
    pub virtualization: Virtualization,
    /// The collectors' answers for this GPU (absent: not supported, as
    /// each collector's `calls.rs` says).
    pub scripts: Scripts,
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
            virtualization: Virtualization::None,
            scripts: Scripts::default(),
        }
    }
}

/// Memory with no reserved bytes.
pub(crate) fn memory(total: u64, used: u64) -> MemoryInfo {
    MemoryInfo {
        total,
        reserved: Some(0),
        used,
        free: total.saturating_sub(used),
    }
}

/// A process with a memory figure.
pub(crate) fn process(pid: u32, used: u64) -> RawProcess {
    RawProcess {
        pid,
        used_bytes: Some(used),
        gpu_instance_id: None,
        compute_instance_id: None,
    }
}

/// Scripted GPUs, and how often each call was made.
#[derive(Debug, Clone, Default)]
pub(crate) struct FakeGpu {
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
    /// Collector calls so far, all devices, by the name each collector's
    /// `calls.rs` counts them under.
    pub calls: BTreeMap<&'static str, u64>,
    /// The collectors' source-wide scripts and state (e.g. which GPUs are
    /// registered for events).
    pub scripts: Scripts,
    /// Set by `close`: every call fails with `uninitialized` from then on.
    pub closed: bool,
    count: usize,
    /// Per GPU: the MIG UUIDs of the layout last handed out.
    handed_out: Vec<Vec<String>>,
}

impl FakeGpu {
    /// These devices, as NVML enumerates them when opened.
    pub(crate) fn new(devices: Vec<FakeDevice>) -> Self {
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

    /// Collector calls so far under each of `names`.
    pub(crate) fn calls_of<const N: usize>(&self, names: [&str; N]) -> [u64; N] {
        names.map(|n| self.calls.get(n).copied().unwrap_or(0))
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
        let d = self.device(device, Operation::DEVICE_UUID)?;
        match &d.identity_error {
            Some(e) => Err(*e),
            None => Ok(d.info.clone()),
        }
    }

    fn mig_layout(&mut self, device: usize) -> Result<Vec<MigInfo>, GpuError> {
        self.mig_layout_calls += 1;
        let d = self.device(device, Operation::MIG_MODE)?;
        let infos: Vec<MigInfo> = d.mig.iter().map(|(m, _)| m.clone()).collect();
        if let Some(slot) = self.handed_out.get_mut(device) {
            *slot = infos.iter().map(|m| m.mig_uuid.clone()).collect();
        }
        Ok(infos)
    }

    fn memory(&mut self, device: usize) -> Result<MemoryInfo, GpuError> {
        self.device(device, Operation::MEMORY_INFO)?.memory
    }

    fn processes(&mut self, device: usize, out: &mut Vec<RawProcess>) -> Result<(), GpuError> {
        self.process_calls += 1;
        for p in self
            .device(device, Operation::RUNNING_COMPUTE_PROCESSES)?
            .processes
            .clone()?
        {
            merge_process(out, p);
        }
        Ok(())
    }

    fn mig_memory(&mut self, device: usize, mig: usize) -> Result<MemoryInfo, GpuError> {
        let d = self.device(device, Operation::MIG_MEMORY_INFO)?;
        let invalid = |kind| GpuError::new(Operation::MIG_MEMORY_INFO, kind);
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

    fn virtualization(&mut self, device: usize) -> Result<Virtualization, GpuError> {
        Ok(self
            .device(device, Operation::VIRTUALIZATION_MODE)?
            .virtualization)
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

    fn handle(
        &mut self,
        device: Option<usize>,
        operation: Operation,
    ) -> Result<super::Handle<'_>, GpuError> {
        if let Some(i) = device {
            self.device(i, operation)?;
        } else if self.closed {
            return Err(GpuError::new(operation, ErrorKind::Uninitialized));
        }
        Ok(super::Handle::Fake(Handle {
            devices: &mut self.devices,
            calls: &mut self.calls,
            scripts: &mut self.scripts,
            device,
        }))
    }

    fn close(&mut self) {
        self.closed = true;
    }
}

/// A collector's view of the fake: the GPU asked for (or all of them),
/// the call counters and the source-wide scripts.
pub struct Handle<'a> {
    devices: &'a mut [FakeDevice],
    calls: &'a mut BTreeMap<&'static str, u64>,
    scripts: &'a mut Scripts,
    device: Option<usize>,
}

impl Handle<'_> {
    /// The GPU asked for; `operation` fails with `invalid_device_index` on
    /// the source-wide handle.
    pub fn device(&mut self, operation: Operation) -> Result<&mut FakeDevice, GpuError> {
        self.device
            .and_then(|i| self.devices.get_mut(i))
            .ok_or(GpuError::new(operation, ErrorKind::InvalidDeviceIndex))
    }

    /// The index of the GPU asked for (`None`: the source-wide handle).
    pub fn index(&self) -> Option<usize> {
        self.device
    }

    /// Every GPU (source-wide calls).
    pub fn devices(&mut self) -> &mut [FakeDevice] {
        self.devices
    }

    /// Count one call under `name` (see [`FakeGpu::calls`]).
    pub fn count(&mut self, name: &'static str) {
        *self.calls.entry(name).or_insert(0) += 1;
    }

    /// The source-wide scripts.
    pub fn scripts(&mut self) -> &mut Scripts {
        self.scripts
    }
}

/// A call the fake's script does not have.
pub(crate) fn unsupported(operation: Operation) -> GpuError {
    GpuError::new(operation, ErrorKind::NotSupported)
}
