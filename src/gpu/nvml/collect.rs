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
use crate::gpu::readings::{self, Health, PowerThermal, RemappedRows, RetiredPages, Utilization};
use crate::gpu::{GpuError, Operation};

/// The value of a collector call, or `None` with its error pushed.
pub(super) fn keep<T>(
    r: Result<T, NvmlError>,
    operation: Operation,
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
    let rates = keep(dev.utilization_rates(), Operation::UtilizationRates, failed);
    Utilization {
        gpu: rates.as_ref().map(|r| r.gpu),
        memory: rates.as_ref().map(|r| r.memory),
        encoder: keep(
            dev.encoder_utilization(),
            Operation::EncoderUtilization,
            failed,
        )
        .map(|u| u.utilization),
        decoder: keep(
            dev.decoder_utilization(),
            Operation::DecoderUtilization,
            failed,
        )
        .map(|u| u.utilization),
    }
}

/// The `power_thermal` collector's calls on one GPU (the energy counter
/// is a slow read of its own).
pub(super) fn power_thermal(dev: &Device<'static>, failed: &mut Vec<GpuError>) -> PowerThermal {
    PowerThermal {
        temperature_c: keep(
            dev.temperature(TemperatureSensor::Gpu),
            Operation::Temperature,
            failed,
        ),
        power_mw: keep(dev.power_usage(), Operation::PowerUsage, failed),
        power_limit_mw: keep(
            dev.enforced_power_limit(),
            Operation::EnforcedPowerLimit,
            failed,
        ),
        energy_mj: None,
        clocks_mhz: readings::Clock::ALL.map(|c| {
            let (clock, op) = match c {
                readings::Clock::Graphics => (Clock::Graphics, Operation::ClockInfoGraphics),
                readings::Clock::Sm => (Clock::SM, Operation::ClockInfoSm),
                readings::Clock::Memory => (Clock::Memory, Operation::ClockInfoMemory),
                readings::Clock::Video => (Clock::Video, Operation::ClockInfoVideo),
            };
            keep(dev.clock_info(clock), op, failed)
        }),
        performance_state: keep(dev.performance_state(), Operation::PerformanceState, failed)
            .and_then(pstate_number),
        clock_event_reasons: keep(
            clock_event_reasons(dev),
            Operation::ClockEventReasons,
            failed,
        ),
    }
}

/// The `health` collector's calls on one GPU (the ECC mode is a slow read
/// of its own; Xid events are read for all GPUs at once).
pub(super) fn health(
    dev: &Device<'static>,
    ecc_enabled: bool,
    failed: &mut Vec<GpuError>,
) -> Health {
    // Counters only mean something with ECC on (NVML answers
    // NOT_SUPPORTED otherwise); ask only then.
    let ecc_errors = readings::EccCounter::ALL.map(|c| {
        use readings::EccCounter as C;
        let (kind, counter) = match c {
            C::CorrectedVolatile => (MemoryError::Corrected, EccCounter::Volatile),
            C::CorrectedAggregate => (MemoryError::Corrected, EccCounter::Aggregate),
            C::UncorrectedVolatile => (MemoryError::Uncorrected, EccCounter::Volatile),
            C::UncorrectedAggregate => (MemoryError::Uncorrected, EccCounter::Aggregate),
        };
        ecc_enabled
            .then(|| {
                keep(
                    dev.total_ecc_errors(kind, counter),
                    Operation::TotalEccErrors,
                    failed,
                )
            })
            .flatten()
    });
    let remapped = keep(remapped_rows(dev), Operation::RemappedRows, failed);
    // Page retirement is what GPUs before Ampere do instead of row
    // remapping: asked only where row remapping is not supported.
    let retired_pages = if remapped.is_none() {
        let single = keep(
            dev.retired_pages(RetirementCause::MultipleSingleBitEccErrors),
            Operation::RetiredPagesSingleBitEcc,
            failed,
        );
        let double = keep(
            dev.retired_pages(RetirementCause::DoubleBitEccError),
            Operation::RetiredPagesDoubleBitEcc,
            failed,
        );
        let pending = keep(
            dev.are_pages_pending_retired(),
            Operation::RetiredPagesPending,
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
