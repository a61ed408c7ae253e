//! Memory health: ECC mode and counters, row remapping, page retirement.
//! NOT_SUPPORTED where the scenario leaves the key out (an H200 answers so
//! for page retirement) and on MIG device handles; arguments first.

use std::ffi::{c_uint, c_ulonglong};

use nvml_wrapper_sys::bindings::*;

use crate::{INSUFFICIENT_SIZE, INVALID_ARGUMENT, NOT_SUPPORTED, SUCCESS, put, with_gpu};

/// Fake page addresses: distinct per cause and page, page-aligned.
const SINGLE_BIT_BASE: u64 = 0x0001_0000_0000;
const DOUBLE_BIT_BASE: u64 = 0x0002_0000_0000;
const PAGE: u64 = 0x1000;
/// Fake retirement times (seconds since the epoch, 2023-11-14), one apart.
const RETIRED_AT: u64 = 1_700_000_000;

fn enable_state(on: bool) -> nvmlEnableState_t {
    if on {
        nvmlEnableState_enum_NVML_FEATURE_ENABLED
    } else {
        nvmlEnableState_enum_NVML_FEATURE_DISABLED
    }
}

// ---------------------------------------------------------------------- ECC

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEccMode(
    device: nvmlDevice_t,
    current: *mut nvmlEnableState_t,
    pending: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceGetEccMode", device, |_, g| {
        if current.is_null() || pending.is_null() {
            return INVALID_ARGUMENT;
        }
        let Some(ecc) = g.health.ecc else {
            return NOT_SUPPORTED;
        };
        unsafe {
            put(pending, enable_state(ecc.pending_enabled));
            put(current, enable_state(ecc.enabled))
        }
    })
}

/// Counters need ECC on (`ecc.enabled`), as in NVML: NOT_SUPPORTED while off.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTotalEccErrors(
    device: nvmlDevice_t,
    error_type: nvmlMemoryErrorType_t,
    counter_type: nvmlEccCounterType_t,
    ecc_counts: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceGetTotalEccErrors", device, |_, g| {
        const CORRECTED: nvmlMemoryErrorType_t =
            nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_CORRECTED;
        const UNCORRECTED: nvmlMemoryErrorType_t =
            nvmlMemoryErrorType_enum_NVML_MEMORY_ERROR_TYPE_UNCORRECTED;
        const VOLATILE: nvmlEccCounterType_t = nvmlEccCounterType_enum_NVML_VOLATILE_ECC;
        const AGGREGATE: nvmlEccCounterType_t = nvmlEccCounterType_enum_NVML_AGGREGATE_ECC;
        if ecc_counts.is_null()
            || !matches!(error_type, CORRECTED | UNCORRECTED)
            || !matches!(counter_type, VOLATILE | AGGREGATE)
        {
            return INVALID_ARGUMENT;
        }
        let Some(ecc) = g.health.ecc.filter(|e| e.enabled) else {
            return NOT_SUPPORTED;
        };
        let n = match (error_type, counter_type) {
            (CORRECTED, VOLATILE) => ecc.corrected_volatile,
            (CORRECTED, _) => ecc.corrected_aggregate,
            (_, VOLATILE) => ecc.uncorrected_volatile,
            _ => ecc.uncorrected_aggregate,
        };
        unsafe { put(ecc_counts, n) }
    })
}

// ----------------------------------------------------------- row remapping

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRemappedRows(
    device: nvmlDevice_t,
    corr_rows: *mut c_uint,
    unc_rows: *mut c_uint,
    is_pending: *mut c_uint,
    failure_occurred: *mut c_uint,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceGetRemappedRows", device, |_, g| {
        if corr_rows.is_null()
            || unc_rows.is_null()
            || is_pending.is_null()
            || failure_occurred.is_null()
        {
            return INVALID_ARGUMENT;
        }
        let Some(r) = g.health.remapped_rows else {
            return NOT_SUPPORTED;
        };
        unsafe {
            put(corr_rows, r.correctable);
            put(unc_rows, r.uncorrectable);
            put(is_pending, c_uint::from(r.pending));
            put(failure_occurred, c_uint::from(r.failed))
        }
    })
}

// --------------------------------------------------------- page retirement

/// NVML's count contract: no pages → SUCCESS with `*page_count = 0`;
/// `addresses` NULL or `*page_count` too small → `*page_count` = needed and
/// INSUFFICIENT_SIZE; else the addresses (and timestamps, where given).
unsafe fn retired_pages(
    g: &crate::scenario::Gpu,
    cause: nvmlPageRetirementCause_t,
    page_count: *mut c_uint,
    addresses: *mut c_ulonglong,
    timestamps: *mut c_ulonglong,
) -> nvmlReturn_t {
    const SINGLE: nvmlPageRetirementCause_t =
        nvmlPageRetirementCause_enum_NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS;
    const DOUBLE: nvmlPageRetirementCause_t =
        nvmlPageRetirementCause_enum_NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR;
    if page_count.is_null() {
        return INVALID_ARGUMENT;
    }
    let (needed, base) = match cause {
        SINGLE => (
            g.health.retired_pages.map(|r| r.single_bit_ecc),
            SINGLE_BIT_BASE,
        ),
        DOUBLE => (
            g.health.retired_pages.map(|r| r.double_bit_ecc),
            DOUBLE_BIT_BASE,
        ),
        _ => return INVALID_ARGUMENT,
    };
    let Some(needed) = needed else {
        return NOT_SUPPORTED;
    };
    // SAFETY: non-null count pointer from the caller.
    let capacity = unsafe { page_count.read() };
    // SAFETY: as above.
    unsafe { page_count.write(needed) };
    if needed == 0 {
        return SUCCESS;
    }
    if addresses.is_null() || capacity < needed {
        return INSUFFICIENT_SIZE;
    }
    for i in 0..needed as usize {
        // SAFETY: both buffers hold `capacity` >= needed entries.
        unsafe {
            addresses.add(i).write(base + i as u64 * PAGE);
            if !timestamps.is_null() {
                timestamps.add(i).write(RETIRED_AT + i as u64);
            }
        }
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPages(
    device: nvmlDevice_t,
    cause: nvmlPageRetirementCause_t,
    page_count: *mut c_uint,
    addresses: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceGetRetiredPages", device, |_, g| unsafe {
        retired_pages(g, cause, page_count, addresses, std::ptr::null_mut())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPages_v2(
    device: nvmlDevice_t,
    cause: nvmlPageRetirementCause_t,
    page_count: *mut c_uint,
    addresses: *mut c_ulonglong,
    timestamps: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceGetRetiredPages_v2", device, |_, g| unsafe {
        retired_pages(g, cause, page_count, addresses, timestamps)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPagesPendingStatus(
    device: nvmlDevice_t,
    is_pending: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceGetRetiredPagesPendingStatus", device, |_, g| {
        let state = g.health.retired_pages.map(|r| enable_state(r.pending));
        unsafe { crate::put_some(is_pending, state) }
    })
}
