//! # fake-nvml: a scripted `libnvidia-ml.so.1`
//!
//! A `cdylib` that exports the part of NVML's C API the exporter uses, with
//! NVML's exact contract (argument types and struct layouts from
//! `nvml-wrapper-sys`, return codes, count queries, reference-counted init),
//! so the production binary runs unchanged against it:
//!
//! ```text
//! cargo build -p fake-nvml
//! FAKE_NVML_CONFIG=tests/fake-nvml/scenarios/example.yaml \
//!     gpumem-exporter --nvml.library target/debug/libfake_nvml.so
//! ```
//!
//! ## Scenario
//!
//! The library answers from a YAML file named by `FAKE_NVML_CONFIG`. It is
//! reread at every `nvmlInit*`, and at every other call whenever the file's
//! (device, inode, size, mtime ns) changed, so a test rewrites it (write a temp
//! file, rename it over) to make processes appear or exit, memory grow or a GPU
//! fail. A file that does not parse or validate keeps the previous good
//! scenario and prints one line (`fake-nvml: <path>: <error> ...`) to stderr;
//! with no good scenario at all `nvmlInit*` prints why and returns
//! `NVML_ERROR_UNKNOWN`. Unknown keys are errors.
//!
//! ```yaml
//! driver_version: "580.159.04"       # default "580.159.04"
//! nvml_version: "13.580.159.04"      # default "13.580.159.04"
//! cuda_driver_version: 13000         # default 13000
//! init_error: null                   # null | driver_not_loaded | no_permission | unknown |
//!                                    # lib_rm_version_mismatch
//! init_delay_ms: 0                   # nvmlInit* sleeps this long (then applies init_error)
//! runtime_error: null                # null | lib_rm_version_mismatch | driver_not_loaded |
//!                                    # uninitialized: every call after init (but nvmlShutdown
//!                                    # and nvmlErrorString) fails so (a driver upgraded or
//!                                    # unloaded under a running exporter)
//! devices:                           # default []; [] means zero GPUs
//!   - uuid: GPU-00000000-0000-0000-0000-000000000000   # required, unique (GPUs and MIG)
//!     name: NVIDIA H200              # default "NVIDIA H200"
//!     pci_bus_id: "00000000:00:06.0" # default "00000000:<index+1 hex>:00.0"; 4- or
//!                                    # 8-digit domain, any case; reported upper-case,
//!                                    # 8-digit (busId) and 4-digit (busIdLegacy)
//!     memory:                        # default {total: 150754820096, reserved: 644939776, used: 0}
//!       total: 150754820096          # required inside `memory`
//!       reserved: 644939776          # default 0
//!       used: 12363563008            # default 0; free = total - reserved - used (saturating)
//!     processes:                     # default []; must be empty when mig_devices is not
//!       - pid: 436
//!         used: 12354322432          # null or absent: NVML_VALUE_NOT_AVAILABLE (u64::MAX)
//!         type: compute              # compute (default) | graphics | both | mps
//!     error: null                    # null | gpu_lost | unknown | not_supported |
//!                                    # no_permission | timeout
//!     handle_error: null             # same values as error: nvmlDeviceGetHandleByIndex_v2
//!                                    # fails so (a GPU that fell off the bus before init)
//!     delay_ms: 0                    # every call on this GPU sleeps this long first
//!     mig_devices:                   # default []; non-empty: MIG mode current=pending=1
//!       - uuid: MIG-00000000-0000-0000-0000-000000000001   # required, unique
//!         gpu_instance_id: 1         # required; (gi, ci) unique per GPU
//!         compute_instance_id: 0     # required
//!         memory: {total: 19000000000, reserved: 0, used: 1000}   # required
//!         processes: [{pid: 500, used: 1000, type: compute}]
//!     # Telemetry and health. Every key is optional: a value left
//!     # out makes its call NOT_SUPPORTED on this GPU (as on hardware without
//!     # it); MIG device handles answer NOT_SUPPORTED to all of them.
//!     utilization:                   # percent, 0..=100, each key optional
//!       gpu: 99                      # nvmlDeviceGetUtilizationRates needs gpu and memory
//!       memory: 22
//!       encoder: 0                   # nvmlDeviceGetEncoderUtilization (period 167000 µs)
//!       decoder: 0                   # nvmlDeviceGetDecoderUtilization (period 167000 µs)
//!     process_utilization:           # nvmlDeviceGetProcessUtilization; [] = no samples
//!       - {pid: 436, sm: 97, memory: 22, encoder: 0, decoder: 0}   # percent, default 0
//!     utilization_samples: {gpu: 50, period_us: 166667}   # nvmlDeviceGetSamples
//!                                    # (NVML_GPU_UTILIZATION_SAMPLES): `gpu` % every period_us
//!                                    # (default 166667) on the wall clock, the newest 120
//!     temperature_c: 62              # nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)
//!     power_mw: 692700               # nvmlDeviceGetPowerUsage
//!     power_limit_mw: 700000         # nvmlDeviceGetEnforcedPowerLimit
//!     energy_mj: 81234567890         # nvmlDeviceGetTotalEnergyConsumption
//!     clocks_mhz: {graphics: 1470, sm: 1470, memory: 3201, video: 1305}   # nvmlDeviceGetClockInfo
//!     performance_state: 0           # 0..=15, nvmlDeviceGetPerformanceState
//!     clock_event_reasons: 0x4       # bitmask, nvmlDeviceGetCurrentClocks{Event,Throttle}Reasons
//!     ecc:                           # nvmlDeviceGetEccMode, nvmlDeviceGetTotalEccErrors
//!       enabled: true                # default true; counters are NOT_SUPPORTED while false
//!       pending_enabled: true        # default: enabled (the mode after a reboot)
//!       corrected_volatile: 0        # the four counters default to 0
//!       corrected_aggregate: 0
//!       uncorrected_volatile: 0
//!       uncorrected_aggregate: 0
//!     remapped_rows: {correctable: 0, uncorrectable: 0, pending: false, failed: false}
//!                                    # nvmlDeviceGetRemappedRows; each defaults to 0/false
//!     retired_pages: {single_bit_ecc: 0, double_bit_ecc: 0, pending: false}
//!                                    # nvmlDeviceGetRetiredPages(_v2) page counts and
//!                                    # nvmlDeviceGetRetiredPagesPendingStatus (an H200 has
//!                                    # none of it: leave it out)
//!     xid_events: [79, 48]           # critical Xids, each delivered once per event set
//!     # Grace-era hardware: unified memory, vGPU guests, GPM.
//!     unified_memory: false          # true: nvmlDeviceGetMemoryInfo and _v2 answer
//!                                    # NOT_SUPPORTED, as on a DGX Spark (GB10); `memory`
//!                                    # is then ignored
//!     virtualization_mode: none      # none | passthrough | vgpu | host_vgpu | host_vsga:
//!                                    # nvmlDeviceGetVirtualizationMode (vgpu = a vGPU guest)
//!     gpm:                           # GPM metrics (see "GPM" below); absent: GPM NOT_SUPPORTED
//!       sm_util: 85.5                # percent, 0..=100: graphics_util, sm_util, sm_occupancy,
//!       any_tensor_util: 60          # any_tensor_util, dram_bw_util, fp64_util, fp32_util,
//!       dram_bw_util: 40             # fp16_util
//!       pcie_tx_per_sec: 1024        # MiB/s: pcie_tx_per_sec, pcie_rx_per_sec,
//!       nvlink_total_rx_per_sec: 0   # nvlink_total_rx_per_sec, nvlink_total_tx_per_sec
//!     # and under a mig device: `gpm:` with the same keys (nvmlGpmMigSampleGet)
//! ```
//!
//! ## Behaviour worth knowing
//!
//! - Process queries: `compute` is listed by the compute query, `graphics` by
//!   the graphics query, `both` by both (same pid and bytes), `mps` by the MPS
//!   compute query only. Outside MIG, gpuInstanceId/computeInstanceId are
//!   0xFFFFFFFF. A MIG-enabled GPU's queries list the processes of all its MIG
//!   devices with their instance ids; a MIG handle lists only its own.
//! - Count contract: NULL buffer or `*count` too small → `*count` = needed and
//!   `NVML_ERROR_INSUFFICIENT_SIZE` (`SUCCESS` with `*count = 0` when there are
//!   no processes); big enough → filled, `*count` = real number, `SUCCESS`.
//! - `error` / `delay_ms` apply to every call that takes the GPU's handle or
//!   one of its MIG handles; `nvmlDeviceGetHandleByIndex_v2` and
//!   `nvmlDeviceGetHandleByUUID` still answer (without delay).
//! - `nvmlDeviceGetMemoryInfo` (v1) reports used = reserved + used (capped at
//!   total) as real NVML does, so free is the same figure as in v2.
//!   `nvmlDeviceGetMemoryInfo_v2` requires `version == nvmlMemory_v2`
//!   (`NVML_ERROR_ARGUMENT_VERSION_MISMATCH` otherwise).
//! - `nvmlDeviceGetMemoryLimits_v1` (drivers R615 and later) answers from the
//!   GPU's `memory_limits: {"/sys/fs/cgroup/<path>": {soft, hard, used}}`
//!   by the cgroup directory asked (`NOT_FOUND` for any other, a hard limit
//!   left out is all ones: no limit); a MIG handle is `NOT_SUPPORTED`. A
//!   test that needs a driver without the call patches the symbol's name
//!   in a copy of this library.
//! - Handles encode indices (GPU index + 1 in bits 0..16, MIG index + 1 in bits
//!   16..32, a tag of the MIG UUID in bits 32..48); a handle that does not
//!   resolve against the current scenario is `NVML_ERROR_INVALID_ARGUMENT`, as
//!   are NULL out-pointers. So a MIG instance removed or replaced in the
//!   scenario leaves its old handle stale, as a destroyed instance does in NVML.
//! - The device count is the number of GPUs at the first `nvmlInit*` still in
//!   force (as in NVML): GPUs added to the scenario later appear after
//!   `nvmlShutdown` and a new init; GPUs removed make their handles invalid.
//! - MIG: max MIG device count is 7 (or more if the scenario lists more);
//!   an index past the listed MIG devices is `NOT_FOUND`, past the maximum
//!   `INVALID_ARGUMENT`; on a GPU without MIG it is `NOT_SUPPORTED`. MIG handles
//!   answer name (`<GPU name> MIG`), UUID, memory, processes, the parent's PCI
//!   info, instance ids and their parent; `nvmlDeviceGetIndex`, MIG mode and
//!   max MIG count on them are `NOT_SUPPORTED`.
//! - Telemetry and health calls check their arguments first (NULL
//!   out-pointers, a sensor other than `NVML_TEMPERATURE_GPU`, a clock type
//!   past VIDEO, an ECC error/counter type or retirement cause out of range:
//!   `INVALID_ARGUMENT`), then whether the scenario has the value
//!   (`NOT_SUPPORTED` if not). A real MIG-enabled GPU answers NOT_SUPPORTED
//!   to utilisation and process utilisation; leave those keys out there.
//! - Process utilisation: sample i of a GPU has timeStamp = the scenario
//!   file's mtime in µs since the epoch + i (never below the last scenario's
//!   timestamps, so even a rewrite within one mtime tick is newer). Only
//!   samples newer than `lastSeenTimeStamp` are returned; none (or `[]`) is
//!   `NVML_ERROR_NOT_FOUND`, as real NVML answers; NULL buffer or `*count`
//!   too small → `*count` = needed, `INSUFFICIENT_SIZE`. So a caller that
//!   carries the last timestamp it saw gets each scenario write's samples once.
//! - Retired pages: no pages → `SUCCESS` with `*pageCount = 0`; addresses NULL
//!   or `*pageCount` too small → `*pageCount` = needed, `INSUFFICIENT_SIZE`;
//!   addresses are distinct fake page addresses, `_v2` timestamps fake times.
//! - Xid events: `nvmlDeviceGetSupportedEventTypes` answers
//!   `nvmlEventTypeXidCriticalError` (0x8) on a GPU with `xid_events` (even
//!   `[]`), and `nvmlDeviceRegisterEvents` accepts only that type there
//!   (other bits or no `xid_events`: NOT_SUPPORTED; no bits: INVALID_ARGUMENT).
//!   `nvmlEventSetWait_v2` (and v1) delivers each listed Xid once per set, in
//!   list order, GPUs in registration order: eventType 0x8, eventData the Xid,
//!   device the GPU's handle, instance ids 0xFFFFFFFF. Appending to the list
//!   in a rewrite delivers the new ones. Nothing pending: a registered GPU's
//!   `error` if it has one, else it sleeps `timeoutms` (at most 100 ms) and
//!   answers `NVML_ERROR_TIMEOUT`. The wait first sleeps the largest
//!   `delay_ms` of its GPUs. Sets die at nvmlEventSetFree and the last
//!   nvmlShutdown.
//! - GPM: `nvmlGpmQueryDeviceSupport` says supported where the GPU has `gpm`;
//!   `nvmlGpmSampleAlloc` / `nvmlGpmSampleFree` manage real allocations (any
//!   other pointer: INVALID_ARGUMENT); `nvmlGpmSampleGet` (on the GPU) and
//!   `nvmlGpmMigSampleGet` (on the parent GPU, by GPU instance id) fill a
//!   sample with the scenario's values of that moment, NOT_SUPPORTED without
//!   `gpm`; `nvmlGpmMetricsGet` needs both samples filled, of the same GPU or
//!   instance, the second taken later (else INVALID_ARGUMENT), and answers each
//!   metric with the later sample's value, per-metric NOT_SUPPORTED where the
//!   scenario lacks it; metricInfo strings are NULL.
//! - Call counting: every export counts its calls (failed ones too). With
//!   `FAKE_NVML_CALLS=<file>` the counts are written there as sorted lines
//!   `nvmlDeviceGetTemperature 42` (temp file renamed over it), on the first
//!   call, then on the first call at least 100 ms after the last write, and at
//!   every `nvmlShutdown`: a test proves a switched-off collector makes no
//!   call by the name's absence (or an unchanged count).
//! - Every call before `nvmlInit*` or after the last `nvmlShutdown` is
//!   `NVML_ERROR_UNINITIALIZED` (init is reference counted). No call panics
//!   across the FFI boundary: a panic would become `NVML_ERROR_UNKNOWN`.

// NVML's C contract is the safety contract: pointers are NULL or valid for the
// documented buffer/struct. Repeating that on every export adds nothing.
#![allow(clippy::missing_safety_doc)]

mod calls;
mod events;
mod gpm;
mod health;
mod scenario;
mod state;
mod telemetry;
#[cfg(test)]
mod tests;

use std::ffi::{CStr, c_char, c_int, c_uint};
use std::panic::{self, AssertUnwindSafe};

use nvml_wrapper_sys::bindings::*;

use crate::scenario::{Gpu, MAX_MIG_DEVICES, Query, Scenario, Target};

const SUCCESS: nvmlReturn_t = nvmlReturn_enum_NVML_SUCCESS;
const INVALID_ARGUMENT: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
const NOT_SUPPORTED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
const INSUFFICIENT_SIZE: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
const UNKNOWN: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_UNKNOWN;
const NOT_FOUND: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_FOUND;

/// `NVML_STRUCT_VERSION(Memory, 2)` from nvml.h.
const MEMORY_V2_VERSION: c_uint = (std::mem::size_of::<nvmlMemory_v2_t>() as c_uint) | (2 << 24);

// ------------------------------------------------------------------ helpers

/// Counts the call, and keeps a panic from unwinding into C: it becomes
/// NVML_ERROR_UNKNOWN. Every export goes through here.
fn guard(name: &'static str, f: impl FnOnce() -> nvmlReturn_t) -> nvmlReturn_t {
    panic::catch_unwind(AssertUnwindSafe(|| {
        calls::hit(name);
        f()
    }))
    .unwrap_or(UNKNOWN)
}

/// Calls that need an initialised library but no device.
fn with_scenario(name: &'static str, f: impl FnOnce(&Scenario) -> nvmlReturn_t) -> nvmlReturn_t {
    guard(name, || match state::enter() {
        Ok(scenario) => match scenario.runtime_error {
            Some(code) => code,
            None => f(&scenario),
        },
        Err(code) => code,
    })
}

/// Calls on a device: resolve the handle, then the GPU's injected delay and
/// error, then the call itself.
fn with_device(
    name: &'static str,
    device: nvmlDevice_t,
    f: impl FnOnce(&Scenario, Target<'_>) -> nvmlReturn_t,
) -> nvmlReturn_t {
    with_scenario(name, |scenario| {
        let Some(target) = scenario.resolve(device.addr()) else {
            return INVALID_ARGUMENT;
        };
        let gpu = target.gpu();
        if !gpu.delay.is_zero() {
            std::thread::sleep(gpu.delay);
        }
        if let Some(code) = gpu.error {
            return code;
        }
        f(scenario, target)
    })
}

/// Calls a MIG device handle does not answer (NOT_SUPPORTED there): the
/// closure gets the physical GPU and its index.
fn with_gpu(
    name: &'static str,
    device: nvmlDevice_t,
    f: impl FnOnce(usize, &Gpu) -> nvmlReturn_t,
) -> nvmlReturn_t {
    with_device(name, device, |_, t| match t {
        Target::Gpu { index, gpu } => f(index, gpu),
        Target::Mig { .. } => NOT_SUPPORTED,
    })
}

/// Writes a value the scenario may lack: NOT_SUPPORTED when it does, after
/// the NULL check (NVML checks its arguments first).
unsafe fn put_some<T>(ptr: *mut T, value: Option<T>) -> nvmlReturn_t {
    if ptr.is_null() {
        return INVALID_ARGUMENT;
    }
    match value {
        // SAFETY: non-null, valid per NVML's contract.
        Some(v) => unsafe { put(ptr, v) },
        None => NOT_SUPPORTED,
    }
}

fn handle(value: usize) -> nvmlDevice_t {
    std::ptr::without_provenance_mut(value)
}

/// Writes `value` through an out-pointer, INVALID_ARGUMENT if it is NULL.
unsafe fn put<T>(ptr: *mut T, value: T) -> nvmlReturn_t {
    if ptr.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: non-null, and the caller passes a valid T per NVML's contract.
    unsafe { ptr.write(value) };
    SUCCESS
}

/// Copies `s` plus NUL into a caller buffer of `length` bytes.
unsafe fn put_str(buf: *mut c_char, length: c_uint, s: &str) -> nvmlReturn_t {
    if buf.is_null() {
        return INVALID_ARGUMENT;
    }
    let bytes = s.as_bytes();
    if (length as usize) <= bytes.len() {
        return INSUFFICIENT_SIZE;
    }
    // SAFETY: the buffer holds `length` > bytes.len() bytes per the contract.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, bytes.len());
        buf.add(bytes.len()).write(0);
    }
    SUCCESS
}

/// NVML's count-query contract for process tables.
unsafe fn put_processes(
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
    list: &[nvmlProcessInfo_t],
) -> nvmlReturn_t {
    if count.is_null() {
        return INVALID_ARGUMENT;
    }
    let needed = c_uint::try_from(list.len()).unwrap_or(c_uint::MAX);
    // SAFETY: non-null count pointer from the caller.
    let capacity = unsafe { count.read() };
    if infos.is_null() || capacity < needed {
        // SAFETY: as above.
        unsafe { count.write(needed) };
        return if needed == 0 {
            SUCCESS
        } else {
            INSUFFICIENT_SIZE
        };
    }
    for (i, info) in list.iter().enumerate() {
        // SAFETY: the buffer holds `capacity` >= list.len() entries.
        unsafe { infos.add(i).write(*info) };
    }
    // SAFETY: as above.
    unsafe { count.write(needed) };
    SUCCESS
}

// ---------------------------------------------------------- init / shutdown

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    guard("nvmlInit_v2", state::init)
}

/// Flags (NO_GPUS, NO_ATTACH) change nothing here.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    guard("nvmlInitWithFlags", state::init)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    guard("nvmlShutdown", || {
        let code = state::shutdown();
        calls::flush();
        code
    })
}

/// The strings libnvidia-ml returns; valid without init, never freed.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    // Counting cannot panic in practice; if it did, the string still comes back.
    let _ = panic::catch_unwind(|| calls::hit("nvmlErrorString"));
    let s: &'static CStr = match result {
        0 => c"Success",
        1 => c"Uninitialized",
        2 => c"Invalid Argument",
        3 => c"Not Supported",
        4 => c"Insufficient Permissions",
        5 => c"Already Initialized",
        6 => c"Not Found",
        7 => c"Insufficient Size",
        8 => c"Insufficient External Power",
        9 => c"Driver Not Loaded",
        10 => c"Timeout",
        11 => c"Interrupt request issue",
        12 => c"NVML Shared Library Not Found",
        13 => c"Function Not Found",
        14 => c"Corrupted infoROM",
        15 => c"GPU is lost",
        16 => c"GPU requires restart",
        17 => c"The operating system has blocked the request.",
        18 => c"RM has detected an NVML/RM version mismatch.",
        19 => c"In use by another client",
        20 => c"Insufficient Memory",
        21 => c"No data",
        22 => c"The requested vgpu operation is not available on target device, because ECC is enabled",
        23 => c"Insufficient resources for request",
        24 => c"Frequency not supported",
        25 => c"Argument version mismatch",
        26 => c"Deprecated",
        27 => c"Not Ready",
        28 => c"GPU not found",
        29 => c"Invalid state",
        _ => c"Unknown Error",
    };
    s.as_ptr()
}

// ------------------------------------------------------------------- system

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_scenario("nvmlSystemGetDriverVersion", |s| unsafe {
        put_str(version, length, &s.driver_version)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_scenario("nvmlSystemGetNVMLVersion", |s| unsafe {
        put_str(version, length, &s.nvml_version)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) -> nvmlReturn_t {
    with_scenario("nvmlSystemGetCudaDriverVersion", |s| unsafe {
        put(version, s.cuda_driver_version)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> nvmlReturn_t {
    with_scenario("nvmlSystemGetCudaDriverVersion_v2", |s| unsafe {
        put(version, s.cuda_driver_version)
    })
}

// ---------------------------------------------------------- device handles

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    with_scenario("nvmlDeviceGetCount_v2", |s| {
        let visible = s.gpus.len().min(state::gpus_at_init());
        unsafe { put(count, c_uint::try_from(visible).unwrap_or(0)) }
    })
}

/// Answers even for a GPU with `error` set (the handle is just an index),
/// but not for one with `handle_error`, nor past the count seen at init.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with_scenario("nvmlDeviceGetHandleByIndex_v2", |s| {
        let i = index as usize;
        let Some(gpu) = s.gpus.get(i).filter(|_| i < state::gpus_at_init()) else {
            return INVALID_ARGUMENT;
        };
        if let Some(code) = gpu.handle_error {
            return code;
        }
        unsafe { put(device, handle(scenario::gpu_handle(i))) }
    })
}

/// Accepts GPU and MIG UUIDs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with_scenario("nvmlDeviceGetHandleByUUID", |s| {
        if uuid.is_null() || device.is_null() {
            return INVALID_ARGUMENT;
        }
        // SAFETY: NVML's contract: a NUL-terminated string.
        let wanted = unsafe { CStr::from_ptr(uuid) };
        match s.handle_by_uuid(wanted.to_bytes()) {
            Some(h) => unsafe { put(device, handle(h)) },
            None => NOT_FOUND,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    index: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetIndex", device, |_, t| match t {
        Target::Gpu { index: i, .. } => unsafe { put(index, c_uint::try_from(i).unwrap_or(0)) },
        Target::Mig { .. } => NOT_SUPPORTED,
    })
}

// ------------------------------------------------------------ device info

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetName", device, |_, t| unsafe {
        put_str(name, length, t.name())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetUUID", device, |_, t| unsafe {
        put_str(uuid, length, t.uuid())
    })
}

/// A MIG handle reports its GPU's PCI identity.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetPciInfo_v3", device, |_, t| unsafe {
        put(pci, t.gpu().pci)
    })
}

/// v1 counts reserved memory as used, like libnvidia-ml does.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetMemoryInfo", device, |_, t| {
        if matches!(t, Target::Gpu { gpu, .. } if gpu.unified_memory) {
            return NOT_SUPPORTED;
        }
        let m = t.memory();
        let used = m.used.saturating_add(m.reserved).min(m.total);
        let info = nvmlMemory_t {
            total: m.total,
            free: m.total - used,
            used,
        };
        unsafe { put(memory, info) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetMemoryInfo_v2", device, |_, t| {
        if memory.is_null() {
            return INVALID_ARGUMENT;
        }
        // SAFETY: non-null, points at the caller's nvmlMemory_v2_t.
        let version = unsafe { std::ptr::addr_of!((*memory).version).read() };
        if version != MEMORY_V2_VERSION {
            return nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        }
        if matches!(t, Target::Gpu { gpu, .. } if gpu.unified_memory) {
            return NOT_SUPPORTED;
        }
        let m = t.memory();
        let info = nvmlMemory_v2_t {
            version,
            total: m.total,
            reserved: m.reserved,
            free: m.free(),
            used: m.used,
        };
        unsafe { put(memory, info) }
    })
}

/// `nvmlGetMemoryLimits_v1_t`: the cgroup directory asked about, and
/// its limits and use.
#[repr(C)]
#[allow(non_snake_case)]
pub struct nvmlGetMemoryLimits_v1_t {
    pub nameSpace: *const std::ffi::c_char,
    pub softLimit: u64,
    pub hardLimit: u64,
    pub currentUsed: u64,
}

/// The driver's per-cgroup limits (R615 and later), from the GPU's
/// `memory_limits` by the path asked; `NOT_FOUND` for any other path,
/// `NOT_SUPPORTED` on a MIG handle (as NVIDIA documents).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryLimits_v1(
    device: nvmlDevice_t,
    limits: *mut nvmlGetMemoryLimits_v1_t,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetMemoryLimits_v1", device, |_, t| {
        let Target::Gpu { gpu, .. } = t else {
            return NOT_SUPPORTED;
        };
        if limits.is_null() {
            return INVALID_ARGUMENT;
        }
        // SAFETY: non-null, points at the caller's struct.
        let path = unsafe { std::ptr::addr_of!((*limits).nameSpace).read() };
        if path.is_null() {
            return INVALID_ARGUMENT;
        }
        // SAFETY: the caller passes a NUL-terminated string.
        let path = unsafe { std::ffi::CStr::from_ptr(path) }.to_string_lossy();
        let Some(l) = gpu.memory_limits.get(path.as_ref()) else {
            return NOT_FOUND;
        };
        // SAFETY: as above; the caller's struct, written field by field.
        unsafe {
            std::ptr::addr_of_mut!((*limits).softLimit).write(l.soft);
            std::ptr::addr_of_mut!((*limits).hardLimit).write(l.hard);
            std::ptr::addr_of_mut!((*limits).currentUsed).write(l.used);
        }
        SUCCESS
    })
}

// -------------------------------------------------------------- processes

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    with_device(
        "nvmlDeviceGetComputeRunningProcesses_v3",
        device,
        |_, t| unsafe { put_processes(info_count, infos, &t.processes(Query::Compute)) },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v3(
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    with_device(
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        device,
        |_, t| unsafe { put_processes(info_count, infos, &t.processes(Query::Graphics)) },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    info_count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    with_device(
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        device,
        |_, t| unsafe { put_processes(info_count, infos, &t.processes(Query::Mps)) },
    )
}

// -------------------------------------------------------------------- MIG

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current_mode: *mut c_uint,
    pending_mode: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetMigMode", device, |_, t| {
        let Target::Gpu { gpu, .. } = t else {
            return NOT_SUPPORTED;
        };
        if current_mode.is_null() || pending_mode.is_null() {
            return INVALID_ARGUMENT;
        }
        let mode = if gpu.mig_enabled() {
            NVML_DEVICE_MIG_ENABLE
        } else {
            NVML_DEVICE_MIG_DISABLE
        };
        unsafe {
            put(current_mode, mode);
            put(pending_mode, mode)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetMaxMigDeviceCount", device, |_, t| match t {
        Target::Gpu { gpu, .. } => {
            let max = gpu.migs.len().max(MAX_MIG_DEVICES);
            unsafe { put(count, c_uint::try_from(max).unwrap_or(c_uint::MAX)) }
        }
        Target::Mig { .. } => NOT_SUPPORTED,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig_device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetMigDeviceHandleByIndex", device, |_, t| {
        let Target::Gpu {
            index: gpu_index,
            gpu,
        } = t
        else {
            return INVALID_ARGUMENT;
        };
        if mig_device.is_null() || index as usize >= gpu.migs.len().max(MAX_MIG_DEVICES) {
            return INVALID_ARGUMENT;
        }
        if !gpu.mig_enabled() {
            return NOT_SUPPORTED;
        }
        if index as usize >= gpu.migs.len() {
            return NOT_FOUND;
        }
        unsafe {
            put(
                mig_device,
                handle(scenario::mig_handle(
                    gpu_index,
                    index as usize,
                    &gpu.migs[index as usize].uuid,
                )),
            )
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    is_mig_device: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceIsMigDeviceHandle", device, |_, t| {
        let is_mig = matches!(t, Target::Mig { .. });
        unsafe { put(is_mig_device, c_uint::from(is_mig)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetGpuInstanceId", device, |_, t| match t {
        Target::Mig { mig, .. } => unsafe { put(id, mig.gpu_instance_id) },
        Target::Gpu { .. } => NOT_SUPPORTED,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetComputeInstanceId", device, |_, t| match t {
        Target::Mig { mig, .. } => unsafe { put(id, mig.compute_instance_id) },
        Target::Gpu { .. } => NOT_SUPPORTED,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig_device: nvmlDevice_t,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with_device(
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        mig_device,
        |_, t| match t {
            Target::Mig { parent_index, .. } => unsafe {
                put(device, handle(scenario::gpu_handle(parent_index)))
            },
            Target::Gpu { .. } => INVALID_ARGUMENT,
        },
    )
}
