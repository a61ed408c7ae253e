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

/// Samples NVML keeps per GPU (the count a NULL-buffer query answers).
pub const UTILIZATION_SAMPLE_BUFFER: usize = 120;

/// One GPU's `utilization_samples` since when (µs), oldest first.
type SampleChanges = Vec<(u64, Option<crate::scenario::UtilizationSamples>)>;

/// Per GPU (UUID): since when (wall clock µs) each scenario's
/// `utilization_samples` was in force, oldest first, so a sample keeps the
/// value of the scenario it was taken under after the file changes.
static SAMPLE_HISTORY: std::sync::Mutex<Vec<(String, SampleChanges)>> =
    std::sync::Mutex::new(Vec::new());

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// A scenario was loaded: from now on its GPUs sample as it says.
pub fn note_scenario(s: &Scenario) {
    let at = now_us();
    let mut h = SAMPLE_HISTORY
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for g in &s.gpus {
        let v = g.telemetry.utilization_samples;
        let i = match h.iter().position(|(u, _)| *u == g.uuid) {
            Some(i) => i,
            None => {
                h.push((g.uuid.clone(), Vec::new()));
                h.len() - 1
            }
        };
        let list = &mut h[i].1;
        if list.last().map(|l| l.1) != Some(v) {
            list.push((at, v));
        }
        // A few minutes of changes is all a buffer of samples can reach.
        if list.len() > 64 {
            list.remove(0);
        }
    }
}

/// GPU `uuid`'s samples newer than `last_seen` up to `now`, at most the
/// buffer's newest: (timestamp µs, percent).
fn utilization_samples(uuid: &str, last_seen: u64, now: u64) -> Vec<(u64, u32)> {
    let h = SAMPLE_HISTORY
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some((_, list)) = h.iter().find(|(u, _)| u == uuid) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (i, (since, v)) in list.iter().enumerate() {
        let Some(v) = v else { continue };
        let until = list.get(i + 1).map_or(now.saturating_add(1), |n| n.0);
        let p = v.period_us;
        // Sample k is at k * period on the wall clock; none older than
        // the buffer holds is asked for.
        let from = (*since)
            .max(last_seen.saturating_add(1))
            .max(now.saturating_sub(p * UTILIZATION_SAMPLE_BUFFER as u64));
        let mut k = from.div_ceil(p);
        while k * p < until {
            let t = k * p;
            if t > last_seen && t <= now {
                out.push((t, v.gpu));
            }
            k += 1;
        }
    }
    let drop = out.len().saturating_sub(UTILIZATION_SAMPLE_BUFFER);
    out.drain(..drop);
    out
}

/// NVML_GPU_UTILIZATION_SAMPLES only (other types NOT_SUPPORTED, a type
/// past the last INVALID_ARGUMENT). A NULL `samples` buffer: `*count` =
/// the buffer's size and SUCCESS, as NVML answers; else the samples newer
/// than `last_seen_time_stamp`, the newest that fit, `*count` = how many,
/// NVML_VALUE_TYPE_UNSIGNED_INT; none newer: NOT_FOUND.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSamples(
    device: nvmlDevice_t,
    sample_type: nvmlSamplingType_t,
    last_seen_time_stamp: c_ulonglong,
    sample_val_type: *mut nvmlValueType_t,
    sample_count: *mut c_uint,
    samples: *mut nvmlSample_t,
) -> nvmlReturn_t {
    with_gpu("nvmlDeviceGetSamples", device, |_, g| {
        if sample_count.is_null() || sample_val_type.is_null() {
            return INVALID_ARGUMENT;
        }
        if sample_type >= nvmlSamplingType_enum_NVML_SAMPLINGTYPE_COUNT {
            return INVALID_ARGUMENT;
        }
        if sample_type != nvmlSamplingType_enum_NVML_GPU_UTILIZATION_SAMPLES
            || g.telemetry.utilization_samples.is_none()
        {
            return NOT_SUPPORTED;
        }
        // SAFETY: non-null pointers from the caller.
        unsafe { sample_val_type.write(nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_INT) };
        if samples.is_null() {
            let n = c_uint::try_from(UTILIZATION_SAMPLE_BUFFER).unwrap_or(c_uint::MAX);
            // SAFETY: as above.
            unsafe { sample_count.write(n) };
            return SUCCESS;
        }
        let list = utilization_samples(&g.uuid, last_seen_time_stamp, now_us());
        if list.is_empty() {
            // SAFETY: as above.
            unsafe { sample_count.write(0) };
            return NOT_FOUND;
        }
        // SAFETY: as above.
        let capacity = unsafe { sample_count.read() } as usize;
        let skip = list.len().saturating_sub(capacity);
        let kept = &list[skip..];
        for (i, (t, pct)) in kept.iter().enumerate() {
            let sample = nvmlSample_t {
                timeStamp: *t,
                sampleValue: nvmlValue_t { uiVal: *pct },
            };
            // SAFETY: the buffer holds `capacity` entries, i < capacity.
            unsafe { samples.add(i).write(sample) };
        }
        let n = c_uint::try_from(kept.len()).unwrap_or(c_uint::MAX);
        // SAFETY: as above.
        unsafe { sample_count.write(n) };
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
