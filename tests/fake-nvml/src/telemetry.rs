//! Utilisation (device and per process), temperature, power, energy, clocks,
//! P-state and clock event reasons. Each answers from the GPU's scenario
//! value, NOT_SUPPORTED where the scenario leaves it out and on MIG device
//! handles; arguments (NULL pointers, enum values) are checked first.

use std::ffi::{c_uint, c_ulonglong};

use nvml_wrapper_sys::bindings::*;

use crate::scenario::Scenario;
use crate::{
    INSUFFICIENT_SIZE, INVALID_ARGUMENT, NOT_FOUND, NOT_SUPPORTED, SUCCESS, put, put_some,
    with_device, with_gpu,
};

/// What an H200 reports as the encoder/decoder sampling period.
pub const CODEC_SAMPLING_PERIOD_US: c_uint = 167_000;

// -------------------------------------------------------------- utilisation

/// Needs both `utilization.gpu` and `utilization.memory`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceGetUtilizationRates", device, |_, g| {
        let t = &g.telemetry;
        let rates = t
            .gpu_util
            .zip(t.memory_util)
            .map(|(gpu, memory)| nvmlUtilization_t { gpu, memory });
        unsafe { put_some(utilization, rates) }
    })
}

unsafe fn put_codec(
    utilization: *mut c_uint,
    sampling_period_us: *mut c_uint,
    value: Option<u32>,
) -> nvmlReturn_t {
    if utilization.is_null() || sampling_period_us.is_null() {
        return INVALID_ARGUMENT;
    }
    let Some(v) = value else {
        return NOT_SUPPORTED;
    };
    unsafe {
        put(sampling_period_us, CODEC_SAMPLING_PERIOD_US);
        put(utilization, v)
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEncoderUtilization(
    device: nvmlDevice_t,
    utilization: *mut c_uint,
    sampling_period_us: *mut c_uint,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceGetEncoderUtilization", device, |_, g| unsafe {
        put_codec(utilization, sampling_period_us, g.telemetry.encoder_util)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDecoderUtilization(
    device: nvmlDevice_t,
    utilization: *mut c_uint,
    sampling_period_us: *mut c_uint,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceGetDecoderUtilization", device, |_, g| unsafe {
        put_codec(utilization, sampling_period_us, g.telemetry.decoder_util)
    })
}

/// Samples newer than `last_seen_time_stamp`. Sample i of a scenario has
/// timeStamp `sample_base_us + i` (the file's mtime in µs, kept increasing
/// across rewrites), so each scenario write gives one fresh set of samples to
/// a caller that carries the last timestamp it saw, as NVML asks. None newer:
/// NOT_FOUND, as real NVML answers. NULL buffer or `*count` too small:
/// `*count` = needed and INSUFFICIENT_SIZE.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    utilization: *mut nvmlProcessUtilizationSample_t,
    process_samples_count: *mut c_uint,
    last_seen_time_stamp: c_ulonglong,
) -> nvmlReturn_t {
    with_device("nvmlDeviceGetProcessUtilization", device, |s, t| {
        let crate::scenario::Target::Gpu { gpu, .. } = t else {
            return NOT_SUPPORTED;
        };
        if process_samples_count.is_null() {
            return INVALID_ARGUMENT;
        }
        let Some(list) = &gpu.telemetry.process_utilization else {
            return NOT_SUPPORTED;
        };
        let samples = new_samples(s, list, last_seen_time_stamp);
        if samples.is_empty() {
            return NOT_FOUND;
        }
        let needed = c_uint::try_from(samples.len()).unwrap_or(c_uint::MAX);
        // SAFETY: non-null count pointer from the caller.
        let capacity = unsafe { process_samples_count.read() };
        // SAFETY: as above.
        unsafe { process_samples_count.write(needed) };
        if utilization.is_null() || capacity < needed {
            return INSUFFICIENT_SIZE;
        }
        for (i, sample) in samples.into_iter().enumerate() {
            // SAFETY: the buffer holds `capacity` >= needed entries.
            unsafe { utilization.add(i).write(sample) };
        }
        SUCCESS
    })
}

fn new_samples(
    s: &Scenario,
    list: &[crate::scenario::ProcessUtilization],
    last_seen: u64,
) -> Vec<nvmlProcessUtilizationSample_t> {
    list.iter()
        .enumerate()
        .map(|(i, p)| nvmlProcessUtilizationSample_t {
            pid: p.pid,
            timeStamp: s.sample_base_us.saturating_add(i as u64),
            smUtil: p.sm,
            memUtil: p.memory,
            encUtil: p.encoder,
            decUtil: p.decoder,
        })
        .filter(|sample| sample.timeStamp > last_seen)
        .collect()
}

// ---------------------------------------------------- thermal, power, clocks

/// Only NVML_TEMPERATURE_GPU exists (anything else: INVALID_ARGUMENT).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: nvmlDevice_t,
    sensor_type: nvmlTemperatureSensors_t,
    temp: *mut c_uint,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceGetTemperature", device, |_, g| {
        if sensor_type != nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU {
            return INVALID_ARGUMENT;
        }
        unsafe { put_some(temp, g.telemetry.temperature_c) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(
    device: nvmlDevice_t,
    power: *mut c_uint,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceGetPowerUsage", device, |_, g| unsafe {
        put_some(power, g.telemetry.power_mw)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEnforcedPowerLimit(
    device: nvmlDevice_t,
    limit: *mut c_uint,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceGetEnforcedPowerLimit", device, |_, g| unsafe {
        put_some(limit, g.telemetry.power_limit_mw)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTotalEnergyConsumption(
    device: nvmlDevice_t,
    energy: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_gpu(
        "nvmlDeviceGetTotalEnergyConsumption",
        device,
        |_, g| unsafe { put_some(energy, g.telemetry.energy_mj) },
    )
}

/// GRAPHICS, SM, MEM, VIDEO from `clocks_mhz`; any other type: INVALID_ARGUMENT.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetClockInfo(
    device: nvmlDevice_t,
    type_: nvmlClockType_t,
    clock: *mut c_uint,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceGetClockInfo", device, |_, g| {
        const GRAPHICS: nvmlClockType_t = nvmlClockType_enum_NVML_CLOCK_GRAPHICS;
        const SM: nvmlClockType_t = nvmlClockType_enum_NVML_CLOCK_SM;
        const MEM: nvmlClockType_t = nvmlClockType_enum_NVML_CLOCK_MEM;
        const VIDEO: nvmlClockType_t = nvmlClockType_enum_NVML_CLOCK_VIDEO;
        let t = &g.telemetry;
        let value = match type_ {
            GRAPHICS => t.clock_graphics,
            SM => t.clock_sm,
            MEM => t.clock_memory,
            VIDEO => t.clock_video,
            _ => return INVALID_ARGUMENT,
        };
        unsafe { put_some(clock, value) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPerformanceState(
    device: nvmlDevice_t,
    p_state: *mut nvmlPstates_t,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceGetPerformanceState", device, |_, g| unsafe {
        put_some(p_state, g.telemetry.performance_state)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksEventReasons(
    device: nvmlDevice_t,
    clocks_event_reasons: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_gpu(
        "nvmlDeviceGetCurrentClocksEventReasons",
        device,
        |_, g| unsafe { put_some(clocks_event_reasons, g.telemetry.clock_event_reasons) },
    )
}

/// The deprecated name of nvmlDeviceGetCurrentClocksEventReasons (what
/// nvml-wrapper 0.13 calls).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksThrottleReasons(
    device: nvmlDevice_t,
    clocks_throttle_reasons: *mut c_ulonglong,
) -> nvmlReturn_t {
    with_gpu(
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        device,
        |_, g| unsafe { put_some(clocks_throttle_reasons, g.telemetry.clock_event_reasons) },
    )
}
