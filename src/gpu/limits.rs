//! NVML's per-cgroup memory limits, `nvmlDeviceGetMemoryLimits_v1`
//! (drivers R615 and later; MPS memory partitioning): the soft and hard
//! limits set for one cgroup directory on one GPU, and what that cgroup
//! uses against them.
//!
//! Written by hand because nvml-wrapper 0.13 (and its bindings,
//! nvml-wrapper-sys 0.10) predate the call: its symbol is resolved here,
//! at run time, from the library NVML was loaded from (a second `dlopen`
//! of an already loaded library takes a reference on the same one). A
//! driver without the symbol (the H200's 580) leaves [`MemoryLimitsCall`]
//! absent: the caller says so once and never counts it as a failure.
//!
//! The struct follows NVIDIA's `nvmlGetMemoryLimits_v1_t`: `nameSpace`
//! (in: the cgroup directory's full sysfs path), `softLimit`,
//! `hardLimit`, `currentUsed` (out, bytes). "No limit" is a soft limit of
//! 0 and a hard limit of `NVML_DEVICE_MEMORY_LIMIT_MAX`.

use std::ffi::{CStr, c_char};

use nvml_wrapper::error::{NvmlError, nvml_try};
use nvml_wrapper_sys::bindings::{nvmlDevice_t, nvmlReturn_t};

/// The symbol this module resolves.
pub(crate) const SYMBOL: &str = "nvmlDeviceGetMemoryLimits_v1";

/// `NVML_DEVICE_MEMORY_LIMIT_MAX`: a hard limit of this (or more than the
/// GPU has) is no limit.
pub(crate) const NO_HARD_LIMIT: u64 = u64::MAX;

#[repr(C)]
struct GetMemoryLimitsV1 {
    name_space: *const c_char,
    soft_limit: u64,
    hard_limit: u64,
    current_used: u64,
}

type GetMemoryLimits = unsafe extern "C" fn(nvmlDevice_t, *mut GetMemoryLimitsV1) -> nvmlReturn_t;

/// What the driver says of one cgroup on one GPU, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriverLimits {
    /// 0: none.
    pub soft: u64,
    /// [`NO_HARD_LIMIT`]: none.
    pub hard: u64,
    pub used: u64,
}

/// The resolved call, kept with the library reference that makes it valid.
pub(crate) struct MemoryLimitsCall {
    call: GetMemoryLimits,
    _library: libloading::Library,
}

impl MemoryLimitsCall {
    /// The call, where `library` (NVML's path, or the loader's default
    /// name) has it; `None` otherwise (also when it cannot be opened again).
    pub(crate) fn resolve(library: &str) -> Option<MemoryLimitsCall> {
        // SAFETY: NVML is already loaded from this path, so opening it
        // again runs no initialiser; the symbol is only called with the
        // signature NVIDIA documents for it.
        unsafe {
            let lib = libloading::Library::new(library).ok()?;
            let call = *lib.get::<GetMemoryLimits>(SYMBOL.as_bytes()).ok()?;
            Some(MemoryLimitsCall {
                call,
                _library: lib,
            })
        }
    }

    /// The limits of cgroup directory `path` (its full sysfs path) on
    /// `device`.
    ///
    /// # Safety
    /// `device` must be a live handle of the NVML instance loaded from
    /// the library this was resolved in.
    pub(crate) unsafe fn call(
        &self,
        device: nvmlDevice_t,
        path: &CStr,
    ) -> Result<DriverLimits, NvmlError> {
        let mut out = GetMemoryLimitsV1 {
            name_space: path.as_ptr(),
            soft_limit: 0,
            hard_limit: NO_HARD_LIMIT,
            current_used: 0,
        };
        // SAFETY: `out` lives across the call and `path` outlives it.
        nvml_try(unsafe { (self.call)(device, &mut out) })?;
        Ok(DriverLimits {
            soft: out.soft_limit,
            hard: out.hard_limit,
            used: out.current_used,
        })
    }
}
