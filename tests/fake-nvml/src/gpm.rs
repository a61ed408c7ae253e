//! GPU Performance Monitoring (GPM) and the virtualization mode.
//!
//! GPM: a GPU (or MIG device) with a `gpm:` map answers
//! `nvmlGpmQueryDeviceSupport` with isSupportedDevice = 1, and
//! `nvmlGpmSampleGet` / `nvmlGpmMigSampleGet` fill a sample with the
//! scenario's values at that moment; `nvmlGpmMetricsGet` answers each
//! requested metric from the *later* sample's values (so a scenario rewrite
//! shows after the next sample), per metric NOT_SUPPORTED where the map
//! lacks it. Without `gpm:` the sample calls are NOT_SUPPORTED and the
//! support query says 0. Samples are live from `nvmlGpmSampleAlloc` to
//! `nvmlGpmSampleFree`; any other pointer is INVALID_ARGUMENT.
//!
//! Like a real GPU, whose counters never give a busy GPU the same figure
//! for two intervals, every other sample of a GPU (or instance) answers
//! its values times (1 + 2^-40) (a relative 1e-12: the exact value to 11
//! digits), so two successive answers of a GPU with any non-zero figure
//! differ; an idle one (all 0) answers 0 every time. With `gpm_stale:
//! true` a sample does not advance: it is a copy of the GPU's previous
//! one (same figures, same place in time), and nvmlGpmMetricsGet over
//! such a pair answers those figures again without an error, as an H200
//! did with `nvidia-smi dmon --gpm-metrics` beside the exporter.

use std::collections::BTreeMap;
use std::ffi::c_uint;
use std::sync::Mutex;

use nvml_wrapper_sys::bindings::*;

use crate::scenario::Target;
use crate::{INVALID_ARGUMENT, NOT_SUPPORTED, SUCCESS, put, with_device, with_gpu, with_scenario};

/// What a filled sample holds: whose, when (a sequence number), and the
/// values of that moment.
#[derive(Clone)]
struct Filled {
    device: usize,
    gpu_instance_id: Option<u32>,
    seq: u64,
    values: Vec<(c_uint, f64)>,
}

struct Samples {
    next_seq: u64,
    /// Live samples by address: `None` until filled.
    live: BTreeMap<usize, Option<Filled>>,
    /// The last sample filled of each (GPU, instance), and how many so far.
    last: BTreeMap<(usize, Option<u32>), (Filled, u64)>,
}

static SAMPLES: Mutex<Samples> = Mutex::new(Samples {
    next_seq: 1,
    live: BTreeMap::new(),
    last: BTreeMap::new(),
});

/// The wobble of every other sample (see the module doc).
const WOBBLE: f64 = 1.0 / (1u64 << 40) as f64;

fn samples() -> std::sync::MutexGuard<'static, Samples> {
    SAMPLES.lock().unwrap_or_else(|e| e.into_inner())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleAlloc(sample: *mut nvmlGpmSample_t) -> nvmlReturn_t {
    with_scenario("nvmlGpmSampleAlloc", |_| {
        if sample.is_null() {
            return INVALID_ARGUMENT;
        }
        // A real allocation, so every live sample has its own address.
        let p = Box::into_raw(Box::new(0u64));
        samples().live.insert(p as usize, None);
        unsafe { put(sample, p.cast::<nvmlGpmSample_st>()) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleFree(sample: nvmlGpmSample_t) -> nvmlReturn_t {
    with_scenario("nvmlGpmSampleFree", |_| {
        if samples().live.remove(&(sample as usize)).is_none() {
            return INVALID_ARGUMENT;
        }
        // SAFETY: allocated by nvmlGpmSampleAlloc as a Box<u64>, freed once.
        drop(unsafe { Box::from_raw(sample.cast::<u64>()) });
        SUCCESS
    })
}

/// Fill `sample` with `values` (None: NOT_SUPPORTED); with `stale`, a
/// copy of the last sample of the same GPU (or instance) instead.
fn fill(
    sample: nvmlGpmSample_t,
    device: usize,
    gpu_instance_id: Option<u32>,
    values: Option<&Vec<(c_uint, f64)>>,
    stale: bool,
) -> nvmlReturn_t {
    let mut s = samples();
    if !s.live.contains_key(&(sample as usize)) {
        return INVALID_ARGUMENT;
    }
    let Some(values) = values else {
        return NOT_SUPPORTED;
    };
    let key = (device, gpu_instance_id);
    if stale && let Some((previous, _)) = s.last.get(&key).cloned() {
        s.live.insert(sample as usize, Some(previous));
        return SUCCESS;
    }
    let seq = s.next_seq;
    s.next_seq += 1;
    let count = s.last.get(&key).map_or(0, |l| l.1) + 1;
    let factor = if count.is_multiple_of(2) {
        1.0 + WOBBLE
    } else {
        1.0
    };
    let filled = Filled {
        device,
        gpu_instance_id,
        seq,
        values: values.iter().map(|&(id, v)| (id, v * factor)).collect(),
    };
    s.last.insert(key, (filled.clone(), count));
    s.live.insert(sample as usize, Some(filled));
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmSampleGet(
    device: nvmlDevice_t,
    gpm_sample: nvmlGpmSample_t,
) -> nvmlReturn_t {
    with_gpu("nvmlGpmSampleGet", device, |i, g| {
        fill(gpm_sample, i, None, g.gpm.as_ref(), g.gpm_stale)
    })
}

/// `device` is the parent GPU; the instance is named by its GPU instance id.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmMigSampleGet(
    device: nvmlDevice_t,
    gpu_instance_id: c_uint,
    gpm_sample: nvmlGpmSample_t,
) -> nvmlReturn_t {
    with_gpu("nvmlGpmMigSampleGet", device, |i, g| {
        if !g.mig_enabled() {
            return NOT_SUPPORTED;
        }
        let Some(mig) = g.migs.iter().find(|m| m.gpu_instance_id == gpu_instance_id) else {
            return INVALID_ARGUMENT;
        };
        fill(
            gpm_sample,
            i,
            Some(gpu_instance_id),
            mig.gpm.as_ref(),
            g.gpm_stale,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmQueryDeviceSupport(
    device: nvmlDevice_t,
    gpm_support: *mut nvmlGpmSupport_t,
) -> nvmlReturn_t {
    with_gpu("nvmlGpmQueryDeviceSupport", device, |_, g| {
        if gpm_support.is_null() {
            return INVALID_ARGUMENT;
        }
        // SAFETY: non-null, the caller's struct.
        let version = unsafe { std::ptr::addr_of!((*gpm_support).version).read() };
        if version != NVML_GPM_SUPPORT_VERSION {
            return nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        }
        let support = nvmlGpmSupport_t {
            version,
            isSupportedDevice: c_uint::from(g.gpm.is_some()),
        };
        unsafe { put(gpm_support, support) }
    })
}

/// Both samples filled, of the same GPU (or instance), the second later
/// (or, on a GPU with `gpm_stale`, two copies of one: answered again).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpmMetricsGet(metrics_get: *mut nvmlGpmMetricsGet_t) -> nvmlReturn_t {
    with_scenario("nvmlGpmMetricsGet", |scenario| {
        if metrics_get.is_null() {
            return INVALID_ARGUMENT;
        }
        // SAFETY: non-null, the caller's request per NVML's contract.
        let req = unsafe { &mut *metrics_get };
        if req.version != NVML_GPM_METRICS_GET_VERSION {
            return nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        }
        if req.numMetrics as usize > req.metrics.len() {
            return INVALID_ARGUMENT;
        }
        let s = samples();
        let get = |p: nvmlGpmSample_t| s.live.get(&(p as usize)).cloned().flatten();
        let (Some(a), Some(b)) = (get(req.sample1), get(req.sample2)) else {
            return INVALID_ARGUMENT;
        };
        let stale_pair = b.seq == a.seq
            && req.sample1 != req.sample2
            && scenario.gpus.get(a.device).is_some_and(|g| g.gpm_stale);
        if (a.device, a.gpu_instance_id) != (b.device, b.gpu_instance_id)
            || (b.seq <= a.seq && !stale_pair)
        {
            return INVALID_ARGUMENT;
        }
        for m in req.metrics.iter_mut().take(req.numMetrics as usize) {
            match b.values.iter().find(|(id, _)| *id == m.metricId) {
                Some(&(_, v)) => {
                    m.value = v;
                    m.nvmlReturn = SUCCESS;
                }
                None => {
                    m.value = 0.0;
                    m.nvmlReturn = NOT_SUPPORTED;
                }
            }
            m.metricInfo.shortName = std::ptr::null_mut();
            m.metricInfo.longName = std::ptr::null_mut();
            m.metricInfo.unit = std::ptr::null_mut();
        }
        SUCCESS
    })
}

// ------------------------------------------------------------ virtualization

/// The scenario's `virtualization_mode` (default none, bare metal). MIG
/// handles answer their GPU's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetVirtualizationMode(
    device: nvmlDevice_t,
    mode: *mut nvmlGpuVirtualizationMode_t,
) -> nvmlReturn_t {
    with_device(
        "nvmlDeviceGetVirtualizationMode",
        device,
        |_, t: Target<'_>| unsafe { put(mode, t.gpu().virtualization_mode) },
    )
}
