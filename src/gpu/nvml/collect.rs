//! The collectors' NVML calls on one GPU (utilization, power_thermal,
//! health), and the calls nvml-wrapper does not wrap. Each failed call
//! leaves its figure `None` and is pushed to `failed` for the sampler to
//! count or, when not supported, to log once.

use nvml_wrapper::Device;
use nvml_wrapper::enum_wrappers::device::{
    Clock, EccCounter, MemoryError, PerformanceState, RetirementCause, TemperatureSensor,
};
use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};

use super::gpu_err;
use crate::gpu::GpuError;
use crate::model::{Health, PowerThermal, RemappedRows, RetiredPages, Utilization};

/// The value of a collector call, or `None` with its error pushed.
pub(super) fn keep<T>(
    r: Result<T, NvmlError>,
    operation: &'static str,
    failed: &mut Vec<GpuError>,
) -> Option<T> {
    r.map_err(|e| failed.push(gpu_err(operation)(e))).ok()
}

/// nvmlDeviceGetRemappedRows, which nvml-wrapper does not wrap.
pub(super) fn remapped_rows(dev: &Device<'static>) -> Result<RemappedRows, NvmlError> {
    let sym = nvml_sym(dev.nvml().lib().nvmlDeviceGetRemappedRows.as_ref())?;
    let (mut corr, mut unc, mut pending, mut failed) = (0, 0, 0, 0);
    // SAFETY: a handle of this NVML instance and four valid out-pointers.
    nvml_try(unsafe { sym(dev.handle(), &mut corr, &mut unc, &mut pending, &mut failed) })?;
    Ok(RemappedRows {
        correctable: corr,
        uncorrectable: unc,
        pending: pending != 0,
        failed: failed != 0,
    })
}

/// nvmlDeviceGetCurrentClocksEventReasons (nvml-wrapper wraps only the
/// deprecated ...ThrottleReasons name of the same call).
pub(super) fn clock_event_reasons(dev: &Device<'static>) -> Result<u64, NvmlError> {
    let sym = nvml_sym(
        dev.nvml()
            .lib()
            .nvmlDeviceGetCurrentClocksEventReasons
            .as_ref(),
    )?;
    let mut reasons: std::os::raw::c_ulonglong = 0;
    // SAFETY: a handle of this NVML instance and a valid out-pointer.
    nvml_try(unsafe { sym(dev.handle(), &mut reasons) })?;
    Ok(reasons)
}

pub(super) fn pstate_number(p: PerformanceState) -> Option<u32> {
    use PerformanceState::*;
    Some(match p {
        Zero => 0,
        One => 1,
        Two => 2,
        Three => 3,
        Four => 4,
        Five => 5,
        Six => 6,
        Seven => 7,
        Eight => 8,
        Nine => 9,
        Ten => 10,
        Eleven => 11,
        Twelve => 12,
        Thirteen => 13,
        Fourteen => 14,
        Fifteen => 15,
        Unknown => return None,
    })
}

/// The `utilization` collector's calls on one GPU.
pub(super) fn utilization(dev: &Device<'static>, failed: &mut Vec<GpuError>) -> Utilization {
    let rates = keep(dev.utilization_rates(), "utilization_rates", failed);
    Utilization {
        gpu: rates.as_ref().map(|r| r.gpu),
        memory: rates.as_ref().map(|r| r.memory),
        encoder: keep(dev.encoder_utilization(), "encoder_utilization", failed)
            .map(|u| u.utilization),
        decoder: keep(dev.decoder_utilization(), "decoder_utilization", failed)
            .map(|u| u.utilization),
    }
}

/// The `power_thermal` collector's calls on one GPU (the energy counter
/// is a slow read of its own).
pub(super) fn power_thermal(dev: &Device<'static>, failed: &mut Vec<GpuError>) -> PowerThermal {
    let clock = |c: Clock, op: &'static str, failed: &mut Vec<GpuError>| {
        keep(dev.clock_info(c), op, failed)
    };
    PowerThermal {
        temperature_c: keep(
            dev.temperature(TemperatureSensor::Gpu),
            "temperature",
            failed,
        ),
        power_mw: keep(dev.power_usage(), "power_usage", failed),
        power_limit_mw: keep(dev.enforced_power_limit(), "enforced_power_limit", failed),
        energy_mj: None,
        clocks_mhz: [
            clock(Clock::Graphics, "clock_info_graphics", failed),
            clock(Clock::SM, "clock_info_sm", failed),
            clock(Clock::Memory, "clock_info_memory", failed),
            clock(Clock::Video, "clock_info_video", failed),
        ],
        performance_state: keep(dev.performance_state(), "performance_state", failed)
            .and_then(pstate_number),
        clock_event_reasons: keep(clock_event_reasons(dev), "clock_event_reasons", failed),
    }
}

/// The `health` collector's calls on one GPU (the ECC mode is a slow read
/// of its own; Xid events are read for all GPUs at once).
pub(super) fn health(
    dev: &Device<'static>,
    ecc_enabled: bool,
    failed: &mut Vec<GpuError>,
) -> Health {
    let mut ecc_errors = [None; 4];
    // Counters only mean something with ECC on (NVML answers
    // NOT_SUPPORTED otherwise); ask only then.
    if ecc_enabled {
        let kinds = [
            (MemoryError::Corrected, EccCounter::Volatile),
            (MemoryError::Corrected, EccCounter::Aggregate),
            (MemoryError::Uncorrected, EccCounter::Volatile),
            (MemoryError::Uncorrected, EccCounter::Aggregate),
        ];
        for (slot, (kind, counter)) in ecc_errors.iter_mut().zip(kinds) {
            *slot = keep(
                dev.total_ecc_errors(kind, counter),
                "total_ecc_errors",
                failed,
            );
        }
    }
    let remapped = keep(remapped_rows(dev), "remapped_rows", failed);
    // Page retirement is what GPUs before Ampere do instead of row
    // remapping: asked only where row remapping is not supported.
    let retired_pages = if remapped.is_none() {
        let single = keep(
            dev.retired_pages(RetirementCause::MultipleSingleBitEccErrors),
            "retired_pages_single_bit_ecc",
            failed,
        );
        let double = keep(
            dev.retired_pages(RetirementCause::DoubleBitEccError),
            "retired_pages_double_bit_ecc",
            failed,
        );
        let pending = keep(
            dev.are_pages_pending_retired(),
            "retired_pages_pending",
            failed,
        );
        (single.is_some() || double.is_some() || pending.is_some()).then(|| RetiredPages {
            single_bit_ecc: single.map(|p| p.len() as u32),
            double_bit_ecc: double.map(|p| p.len() as u32),
            pending,
        })
    } else {
        None
    };
    Health {
        ecc_enabled: None,
        ecc_errors,
        remapped_rows: remapped,
        retired_pages,
        xid_errors: None,
    }
}
