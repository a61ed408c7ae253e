//! [`GpuSource`] over NVML through `nvml-wrapper` (which dlopens
//! `libnvidia-ml.so.1` at run time, so the binary starts on hosts without a
//! driver and fails with a clear message instead); the handle the
//! collectors make their own calls on is `handle.rs`'s.

use std::ffi::OsStr;

use nvml_wrapper::enum_wrappers::device::GpuVirtualizationMode;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper::{Device, Nvml};

use super::handle::{NvmlHandle, State};
use super::{ErrorKind, GpuError, GpuSource, Operation, RawProcess, Virtualization, merge_process};
use crate::model::{DeviceInfo, DriverInfo, MemoryInfo, MigInfo};

/// The library name the dynamic loader resolves when none is configured.
pub(crate) const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// Why NVML could not be started. Each variant's message is one line that
/// says what failed, where, and what to do.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("NVML could not be loaded from {where_}: {detail}. {advice}")]
    Load {
        where_: String,
        detail: String,
        advice: String,
    },
    #[error(
        "NVML was loaded from {where_} but the NVIDIA kernel driver is not loaded (NVML_ERROR_DRIVER_NOT_LOADED): check that `nvidia-smi` works and that the nvidia module is loaded"
    )]
    DriverNotLoaded { where_: String },
    #[error(
        "NVML was loaded from {where_} but has no permission to talk to the driver (NVML_ERROR_NO_PERMISSION): the exporter needs read/write access to /dev/nvidiactl and /dev/nvidia*"
    )]
    NoPermission { where_: String },
    #[error("NVML initialisation failed ({where_}): {operation}: {source}")]
    Other {
        where_: String,
        operation: Operation,
        #[source]
        source: NvmlError,
    },
}

/// What to do when the library cannot be loaded. `in_container`:
/// NVIDIA_VISIBLE_DEVICES is set, as in a container meant for the NVIDIA
/// container toolkit, which mounts the library (the image has none).
fn load_advice(in_container: bool) -> String {
    let arch = std::env::consts::ARCH;
    if in_container {
        format!(
            "NVIDIA_VISIBLE_DEVICES is set but the NVIDIA container toolkit did not mount libnvidia-ml.so.1 (expected at /usr/lib/{arch}-linux-gnu/libnvidia-ml.so.1 in this image): run the container with the NVIDIA runtime (Kubernetes: runtimeClassName: nvidia; Docker/Podman: --runtime=nvidia or --gpus all, or CDI --device nvidia.com/gpu=all) and NVIDIA_DRIVER_CAPABILITIES=utility"
        )
    } else {
        format!(
            "Install the NVIDIA driver, or point --nvml.library (config key nvml.library) at libnvidia-ml.so.1, e.g. --nvml.library=/usr/lib/{arch}-linux-gnu/libnvidia-ml.so.1"
        )
    }
}

fn gpu_err(operation: Operation) -> impl Fn(NvmlError) -> GpuError {
    move |e| GpuError::nvml(operation, &e)
}

/// NVML plus the device handles it hands out, or nothing after
/// [`GpuSource::close`].
pub struct NvmlSource {
    opened: Option<Opened>,
    driver: DriverInfo,
    count: usize,
}

/// The handles borrow the `Nvml` value, so it is boxed (stable address) and
/// dropped after them.
struct Opened {
    // Field order matters: the handles must drop before `nvml`.
    /// Per GPU: its handle, once `device_by_index` answered.
    handles: Vec<Option<Device<'static>>>,
    /// Per GPU: its MIG instance handles as the last layout read found them.
    mig_handles: Vec<Vec<Device<'static>>>,
    /// Per GPU: the GPU instance ids of its MIG layout (each once).
    mig_gis: Vec<Vec<u32>>,
    /// The collectors' NVML allocations (the last GPM samples, the Xid
    /// event set): kept here, not in the collectors, because they are
    /// freed through the library and must go before `nvml` does.
    state: State,
    /// `nvmlDeviceGetMemoryLimits_v1`, where this driver has it.
    memory_limits: Option<super::limits::MemoryLimitsCall>,
    nvml: Box<Nvml>,
}

impl Opened {
    fn nvml(&self) -> &'static Nvml {
        // SAFETY: `nvml` lives in a Box owned by `self`, so its address is
        // stable, and every `Device` made from this reference is stored in
        // `handles` / `mig_handles`, declared (so dropped) before `nvml`;
        // no handle escapes `Opened`.
        unsafe { &*(self.nvml.as_ref() as *const Nvml) }
    }
}

/// The error of every call after `close` (as NVML answers after shutdown).
const CLOSED: ErrorKind = ErrorKind::Uninitialized;

impl NvmlSource {
    /// Load and initialise NVML and count the GPUs. Identities are read by
    /// the sampler, device by device ([`GpuSource::identify`]), so a GPU
    /// that does not answer fails only itself.
    pub fn open(library: Option<&str>) -> Result<Self, InitError> {
        let where_ = match library {
            Some(p) => format!("{p:?}"),
            None => format!("{DEFAULT_LIBRARY:?} (the dynamic loader's search path)"),
        };
        let mut builder = Nvml::builder();
        if let Some(p) = library {
            builder.lib_path(OsStr::new(p));
        }
        let nvml = builder.init().map_err(|e| match e {
            NvmlError::LibloadingError(le) => InitError::Load {
                where_: where_.clone(),
                detail: le.to_string(),
                advice: load_advice(std::env::var_os("NVIDIA_VISIBLE_DEVICES").is_some()),
            },
            NvmlError::FailedToLoadSymbol(s) => InitError::Load {
                where_: where_.clone(),
                detail: format!("missing symbol {s}"),
                advice: load_advice(std::env::var_os("NVIDIA_VISIBLE_DEVICES").is_some()),
            },
            NvmlError::DriverNotLoaded => InitError::DriverNotLoaded {
                where_: where_.clone(),
            },
            NvmlError::NoPermission => InitError::NoPermission {
                where_: where_.clone(),
            },
            other => InitError::Other {
                where_: where_.clone(),
                operation: Operation::INIT,
                source: other,
            },
        })?;
        let other = |operation: Operation| {
            let where_ = where_.clone();
            move |source: NvmlError| InitError::Other {
                where_,
                operation,
                source,
            }
        };
        let driver = DriverInfo {
            driver_version: nvml
                .sys_driver_version()
                .map_err(other(Operation::SYSTEM_DRIVER_VERSION))?,
            nvml_version: nvml
                .sys_nvml_version()
                .map_err(other(Operation::SYSTEM_NVML_VERSION))?,
            cuda_driver_version: nvml
                .sys_cuda_driver_version()
                .map(cuda_version_string)
                .map_err(other(Operation::SYSTEM_CUDA_DRIVER_VERSION))?,
        };
        let count = nvml
            .device_count()
            .map_err(other(Operation::DEVICE_COUNT))? as usize;
        Ok(Self {
            opened: Some(Opened {
                handles: (0..count).map(|_| None).collect(),
                mig_handles: (0..count).map(|_| Vec::new()).collect(),
                mig_gis: (0..count).map(|_| Vec::new()).collect(),
                state: State::default(),
                memory_limits: super::limits::MemoryLimitsCall::resolve(
                    library.unwrap_or(DEFAULT_LIBRARY),
                ),
                nvml: Box::new(nvml),
            }),
            driver,
            count,
        })
    }

    fn opened(&mut self, operation: Operation) -> Result<&mut Opened, GpuError> {
        self.opened.as_mut().ok_or(GpuError::new(operation, CLOSED))
    }

    fn device_handle(
        &self,
        device: usize,
        operation: Operation,
    ) -> Result<&Device<'static>, GpuError> {
        let opened = self
            .opened
            .as_ref()
            .ok_or(GpuError::new(operation, CLOSED))?;
        opened
            .handles
            .get(device)
            .and_then(Option::as_ref)
            .ok_or(GpuError::new(operation, ErrorKind::InvalidDeviceIndex))
    }
}

/// The MIG instances of a GPU in MIG mode; empty when MIG is off or not
/// supported. Re-read by the sampler every `mig_rescan_interval` and when a
/// MIG call fails in a way that means the layout changed.
fn mig_instances(dev: &Device<'static>) -> Result<(Vec<Device<'static>>, Vec<MigInfo>), GpuError> {
    match dev.mig_mode() {
        Ok(m) if m.current == 1 => {}
        Ok(_) | Err(NvmlError::NotSupported) | Err(NvmlError::FailedToLoadSymbol(_)) => {
            return Ok((Vec::new(), Vec::new()));
        }
        Err(e) => return Err(gpu_err(Operation::MIG_MODE)(e)),
    }
    let max = dev
        .mig_device_count()
        .map_err(gpu_err(Operation::MAX_MIG_DEVICE_COUNT))?;
    let mut handles = Vec::new();
    let mut infos = Vec::new();
    for i in 0..max {
        let mig = match dev.mig_device_by_index(i) {
            Ok(m) => m,
            // Slots without an instance answer NOT_FOUND.
            Err(NvmlError::NotFound) | Err(NvmlError::InvalidArg) => continue,
            Err(e) => return Err(gpu_err(Operation::MIG_DEVICE_BY_INDEX)(e)),
        };
        infos.push(MigInfo {
            mig_uuid: mig.uuid().map_err(gpu_err(Operation::MIG_DEVICE_UUID))?,
            name: mig.name().unwrap_or_default(),
            gpu_instance_id: instance_id(&mig, InstanceKind::Gpu)
                .map_err(gpu_err(Operation::MIG_GPU_INSTANCE_ID))?,
            compute_instance_id: instance_id(&mig, InstanceKind::Compute)
                .map_err(gpu_err(Operation::MIG_COMPUTE_INSTANCE_ID))?,
        });
        handles.push(mig);
    }
    Ok((handles, infos))
}

enum InstanceKind {
    Gpu,
    Compute,
}

/// nvmlDeviceGetGpuInstanceId / nvmlDeviceGetComputeInstanceId, which
/// nvml-wrapper does not wrap.
fn instance_id(mig: &Device<'static>, kind: InstanceKind) -> Result<u32, NvmlError> {
    let lib = mig.nvml().lib();
    let sym = match kind {
        InstanceKind::Gpu => nvml_sym(lib.nvmlDeviceGetGpuInstanceId.as_ref())?,
        InstanceKind::Compute => nvml_sym(lib.nvmlDeviceGetComputeInstanceId.as_ref())?,
    };
    let mut id: std::os::raw::c_uint = 0;
    // SAFETY: the handle comes from this NVML instance and `id` is a valid
    // out-pointer for the duration of the call.
    nvml_try(unsafe { sym(mig.handle(), &mut id) })?;
    Ok(id)
}

/// 13000 → "13.0", 12040 → "12.4" (NVML encodes major*1000 + minor*10).
pub(crate) fn cuda_version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

fn raw(p: nvml_wrapper::struct_wrappers::device::ProcessInfo) -> RawProcess {
    RawProcess {
        pid: p.pid,
        used_bytes: match p.used_gpu_memory {
            UsedGpuMemory::Used(b) => Some(b),
            UsedGpuMemory::Unavailable => None,
        },
        gpu_instance_id: p.gpu_instance_id,
        compute_instance_id: p.compute_instance_id,
    }
}

fn memory_of(dev: &Device<'static>) -> Result<MemoryInfo, GpuError> {
    let m = dev.memory_info().map_err(gpu_err(Operation::MEMORY_INFO))?;
    Ok(MemoryInfo {
        total: m.total,
        reserved: Some(m.reserved),
        used: m.used,
        free: m.free,
    })
}

impl GpuSource for NvmlSource {
    fn driver_info(&self) -> DriverInfo {
        self.driver.clone()
    }

    fn device_count(&self) -> usize {
        self.count
    }

    fn identify(&mut self, device: usize) -> Result<DeviceInfo, GpuError> {
        let opened = self.opened(Operation::DEVICE_BY_INDEX)?;
        let nvml = opened.nvml();
        let slot = opened.handles.get_mut(device).ok_or(GpuError::new(
            Operation::DEVICE_BY_INDEX,
            ErrorKind::InvalidDeviceIndex,
        ))?;
        let dev = match slot.take() {
            Some(dev) => dev,
            None => {
                let index = u32::try_from(device).map_err(|_| {
                    GpuError::new(Operation::DEVICE_BY_INDEX, ErrorKind::InvalidDeviceIndex)
                })?;
                nvml.device_by_index(index)
                    .map_err(gpu_err(Operation::DEVICE_BY_INDEX))?
            }
        };
        let dev = slot.insert(dev);
        Ok(DeviceInfo {
            gpu: device.to_string(),
            uuid: dev.uuid().map_err(gpu_err(Operation::DEVICE_UUID))?,
            name: dev.name().map_err(gpu_err(Operation::DEVICE_NAME))?,
            pci_bus_id: dev
                .pci_info()
                .map_err(gpu_err(Operation::DEVICE_PCI_INFO))?
                .bus_id,
            memory: Default::default(),
        })
    }

    fn mig_layout(&mut self, device: usize) -> Result<Vec<MigInfo>, GpuError> {
        let (handles, infos) = mig_instances(self.device_handle(device, Operation::MIG_MODE)?)?;
        if let Some(o) = self.opened.as_mut() {
            if let Some(slot) = o.mig_handles.get_mut(device) {
                *slot = handles;
            }
            if let Some(slot) = o.mig_gis.get_mut(device) {
                let mut gis: Vec<u32> = infos.iter().map(|m| m.gpu_instance_id).collect();
                gis.sort_unstable();
                gis.dedup();
                *slot = gis;
            }
        }
        Ok(infos)
    }

    fn memory(&mut self, device: usize) -> Result<MemoryInfo, GpuError> {
        memory_of(self.device_handle(device, Operation::MEMORY_INFO)?)
    }

    fn processes(&mut self, device: usize, out: &mut Vec<RawProcess>) -> Result<(), GpuError> {
        let dev = self.device_handle(device, Operation::RUNNING_COMPUTE_PROCESSES)?;
        for p in dev
            .running_compute_processes()
            .map_err(gpu_err(Operation::RUNNING_COMPUTE_PROCESSES))?
        {
            merge_process(out, raw(p));
        }
        // Compute-only boards may not support the graphics query, and GPUs
        // without an MPS server may not support the MPS one: neither is a
        // fault of the GPU.
        match dev.running_graphics_processes() {
            Ok(list) => list.into_iter().for_each(|p| merge_process(out, raw(p))),
            Err(NvmlError::NotSupported) => {}
            Err(e) => return Err(gpu_err(Operation::RUNNING_GRAPHICS_PROCESSES)(e)),
        }
        match dev.mps_running_compute_processes() {
            Ok(list) => list.into_iter().for_each(|p| merge_process(out, raw(p))),
            Err(NvmlError::NotSupported) | Err(NvmlError::FailedToLoadSymbol(_)) => {}
            Err(e) => return Err(gpu_err(Operation::MPS_RUNNING_COMPUTE_PROCESSES)(e)),
        }
        Ok(())
    }

    fn mig_memory(&mut self, device: usize, mig: usize) -> Result<MemoryInfo, GpuError> {
        let opened = self.opened(Operation::MIG_MEMORY_INFO)?;
        let h = opened
            .mig_handles
            .get(device)
            .and_then(|m| m.get(mig))
            .ok_or(GpuError::new(
                Operation::MIG_MEMORY_INFO,
                ErrorKind::InvalidDeviceIndex,
            ))?;
        memory_of(h).map_err(|e| GpuError::new(Operation::MIG_MEMORY_INFO, e.kind))
    }

    fn virtualization(&mut self, device: usize) -> Result<Virtualization, GpuError> {
        const OP: Operation = Operation::VIRTUALIZATION_MODE;
        match self.device_handle(device, OP)?.virtualization_mode() {
            Ok(GpuVirtualizationMode::Vgpu) => Ok(Virtualization::VgpuGuest),
            Ok(_) => Ok(Virtualization::None),
            Err(e) => Err(gpu_err(OP)(e)),
        }
    }

    fn has_memory_limits(&self) -> bool {
        self.opened
            .as_ref()
            .is_some_and(|o| o.memory_limits.is_some())
    }

    fn memory_limits(
        &mut self,
        device: usize,
        path: &std::ffi::CStr,
    ) -> Result<super::DriverLimits, GpuError> {
        let op = Operation::MEMORY_LIMITS;
        let opened = self.opened(op)?;
        let handle = opened
            .handles
            .get(device)
            .and_then(Option::as_ref)
            .ok_or(GpuError::new(op, ErrorKind::InvalidDeviceIndex))?;
        let call = opened
            .memory_limits
            .as_ref()
            .ok_or(GpuError::new(op, ErrorKind::FunctionNotFound))?;
        // SAFETY: the handle is this instance's, alive while `opened` is.
        unsafe { call.call(handle.handle(), path) }.map_err(|e| GpuError::nvml(op, &e))
    }

    fn handle(
        &mut self,
        device: Option<usize>,
        operation: Operation,
    ) -> Result<super::Handle<'_>, GpuError> {
        let opened = self.opened(operation)?;
        let nvml = opened.nvml();
        let device = match device {
            None => None,
            Some(i) => Some(
                opened
                    .handles
                    .get(i)
                    .and_then(Option::as_ref)
                    .ok_or(GpuError::new(operation, ErrorKind::InvalidDeviceIndex))?,
            ),
        };
        Ok(super::Handle::Nvml(NvmlHandle {
            nvml,
            device,
            state: &mut opened.state,
        }))
    }

    fn mig_gpu_instances(&self, device: usize) -> Vec<u32> {
        self.opened
            .as_ref()
            .and_then(|o| o.mig_gis.get(device).cloned())
            .unwrap_or_default()
    }

    fn close(&mut self) {
        // Drops the handles, then `Nvml`: nvmlShutdown and the library
        // unloaded, so the next open maps the (possibly upgraded) one anew.
        self.opened = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_versions() {
        assert_eq!(cuda_version_string(13000), "13.0");
        assert_eq!(cuda_version_string(12040), "12.4");
    }
}
