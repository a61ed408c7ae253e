//! The `power_thermal` collector's NVML calls (the energy counter is a
//! slow read of its own), and the in-process fake's answers: a
//! [`PowerThermal`] script (no temperature answers `not_supported`), and
//! [`Failing`] to make the calls fail.

use nvml_wrapper::Device;
use nvml_wrapper::enum_wrappers::device::{self, PerformanceState, TemperatureSensor};
use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};

use super::{Clock, PowerThermal};
use crate::gpu::keep;
use crate::gpu::{GpuError, Handle, Operation};

pub(crate) const TEMPERATURE: Operation = Operation::new("temperature");
pub(crate) const POWER_USAGE: Operation = Operation::new("power_usage");
pub(crate) const ENFORCED_POWER_LIMIT: Operation = Operation::new("enforced_power_limit");
pub(crate) const TOTAL_ENERGY_CONSUMPTION: Operation = Operation::new("total_energy_consumption");
pub(crate) const CLOCK_INFO_GRAPHICS: Operation = Operation::new("clock_info_graphics");
pub(crate) const CLOCK_INFO_SM: Operation = Operation::new("clock_info_sm");
pub(crate) const CLOCK_INFO_MEMORY: Operation = Operation::new("clock_info_memory");
pub(crate) const CLOCK_INFO_VIDEO: Operation = Operation::new("clock_info_video");
pub(crate) const PERFORMANCE_STATE: Operation = Operation::new("performance_state");
pub(crate) const CLOCK_EVENT_REASONS: Operation = Operation::new("clock_event_reasons");

pub(crate) const OPERATIONS: &[Operation] = &[
    TEMPERATURE,
    POWER_USAGE,
    ENFORCED_POWER_LIMIT,
    TOTAL_ENERGY_CONSUMPTION,
    CLOCK_INFO_GRAPHICS,
    CLOCK_INFO_SM,
    CLOCK_INFO_MEMORY,
    CLOCK_INFO_VIDEO,
    PERFORMANCE_STATE,
    CLOCK_EVENT_REASONS,
];

/// Fake only: every call of this collector on the GPU fails with it.
#[cfg(test)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Failing(pub GpuError);

/// Every call but the energy counter on one GPU; each that fails leaves
/// its field `None` and is pushed to `failed`.
pub(super) fn read(h: Handle<'_>, failed: &mut Vec<GpuError>) -> PowerThermal {
    match h {
        Handle::Nvml(h) => match h.device(TEMPERATURE) {
            Ok(dev) => nvml_read(dev, failed),
            Err(e) => {
                failed.push(e);
                PowerThermal::default()
            }
        },
        #[cfg(test)]
        Handle::Fake(mut h) => {
            h.count("power_thermal");
            let d = match h.device(TEMPERATURE) {
                Ok(d) => d,
                Err(e) => {
                    failed.push(e);
                    return PowerThermal::default();
                }
            };
            if let Some(Failing(e)) = d.scripts.get::<Failing>() {
                failed.push(*e);
                return PowerThermal::default();
            }
            let p = d.scripts.get::<PowerThermal>().copied().unwrap_or_default();
            if p.temperature_c.is_none() {
                failed.push(crate::gpu::fake::unsupported(TEMPERATURE));
            }
            PowerThermal {
                energy_mj: None,
                ..p
            }
        }
    }
}

/// Energy since the driver loaded, mJ (slow on the H200: 4.1 ms).
pub(super) fn energy(h: Handle<'_>) -> Result<u64, GpuError> {
    match h {
        Handle::Nvml(h) => h
            .device(TOTAL_ENERGY_CONSUMPTION)?
            .total_energy_consumption()
            .map_err(|e| GpuError::nvml(TOTAL_ENERGY_CONSUMPTION, &e)),
        #[cfg(test)]
        Handle::Fake(mut h) => {
            h.count("energy");
            h.device(TOTAL_ENERGY_CONSUMPTION)?
                .scripts
                .get::<PowerThermal>()
                .and_then(|p| p.energy_mj)
                .ok_or(crate::gpu::fake::unsupported(TOTAL_ENERGY_CONSUMPTION))
        }
    }
}

fn nvml_read(dev: &Device<'static>, failed: &mut Vec<GpuError>) -> PowerThermal {
    PowerThermal {
        temperature_c: keep(dev.temperature(TemperatureSensor::Gpu), TEMPERATURE, failed),
        power_mw: keep(dev.power_usage(), POWER_USAGE, failed),
        power_limit_mw: keep(dev.enforced_power_limit(), ENFORCED_POWER_LIMIT, failed),
        energy_mj: None,
        clocks_mhz: Clock::ALL.map(|c| {
            let (clock, op) = match c {
                Clock::Graphics => (device::Clock::Graphics, CLOCK_INFO_GRAPHICS),
                Clock::Sm => (device::Clock::SM, CLOCK_INFO_SM),
                Clock::Memory => (device::Clock::Memory, CLOCK_INFO_MEMORY),
                Clock::Video => (device::Clock::Video, CLOCK_INFO_VIDEO),
            };
            keep(dev.clock_info(clock), op, failed)
        }),
        performance_state: keep(dev.performance_state(), PERFORMANCE_STATE, failed)
            .and_then(pstate_number),
        clock_event_reasons: keep(clock_event_reasons(dev), CLOCK_EVENT_REASONS, failed),
    }
}

/// nvmlDeviceGetCurrentClocksEventReasons (nvml-wrapper wraps only the
/// deprecated ...ThrottleReasons name of the same call).
fn clock_event_reasons(dev: &Device<'static>) -> Result<u64, NvmlError> {
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

fn pstate_number(p: PerformanceState) -> Option<u32> {
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
