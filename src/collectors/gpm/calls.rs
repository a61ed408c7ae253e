//! The `gpm` collector's NVML calls, through nvml-wrapper's safe API
//! (`Device::gpm_support`, `gpm_sample`, `gpm_mig_sample`,
//! `gpm::gpm_metrics_get`): one sample per GPU (or MIG GPU instance) per
//! call, the metrics between it and the previous one. The previous sample
//! is an NVML allocation freed through the library, so it is kept in the
//! handle's state (freed when replaced, or with the source, before
//! `nvmlShutdown`), not in the collector. The in-process fake has no GPM:
//! its end-to-end tests run on the fake NVML library.

use std::collections::HashMap;

use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::gpm::{GpmSample, gpm_metrics_get};

use super::{Gpm, GpmMetric};
use crate::gpu::{GpuError, Handle, Operation};

pub(crate) const GPM_QUERY_DEVICE_SUPPORT: Operation = Operation::new("gpm_query_device_support");
pub(crate) const GPM_SAMPLE_GET: Operation = Operation::new("gpm_sample_get");
pub(crate) const GPM_MIG_SAMPLE_GET: Operation = Operation::new("gpm_mig_sample_get");
pub(crate) const GPM_METRICS_GET: Operation = Operation::new("gpm_metrics_get");

pub(crate) const OPERATIONS: &[Operation] = &[
    GPM_QUERY_DEVICE_SUPPORT,
    GPM_SAMPLE_GET,
    GPM_MIG_SAMPLE_GET,
    GPM_METRICS_GET,
];

/// NVML's id of each metric we ask for, in [`GpmMetric::ALL`]'s order.
fn id(m: GpmMetric) -> GpmMetricId {
    match m {
        GpmMetric::SmActivity => GpmMetricId::SmUtil,
        GpmMetric::SmOccupancy => GpmMetricId::SmOccupancy,
        GpmMetric::TensorActivity => GpmMetricId::AnyTensorUtil,
        GpmMetric::DramBandwidth => GpmMetricId::DramBwUtil,
        GpmMetric::Fp16Activity => GpmMetricId::Fp16Util,
        GpmMetric::Fp32Activity => GpmMetricId::Fp32Util,
        GpmMetric::Fp64Activity => GpmMetricId::Fp64Util,
        GpmMetric::PcieTransmit => GpmMetricId::PcieTxPerSec,
        GpmMetric::PcieReceive => GpmMetricId::PcieRxPerSec,
        GpmMetric::NvlinkTransmit => GpmMetricId::NvlinkTotalTxPerSec,
        GpmMetric::NvlinkReceive => GpmMetricId::NvlinkTotalRxPerSec,
    }
}

/// The previous sample of each (GPU, MIG GPU instance) (NVML state).
#[derive(Default)]
struct Previous {
    samples: HashMap<(usize, Option<u32>), GpmSample<'static>>,
}

/// Whether GPU `device` has GPM (`nvmlGpmQueryDeviceSupport`).
pub(super) fn supported(h: Handle<'_>) -> Result<bool, GpuError> {
    match h {
        Handle::Nvml(h) => h
            .device(GPM_QUERY_DEVICE_SUPPORT)?
            .gpm_support()
            .map_err(|e| GpuError::nvml(GPM_QUERY_DEVICE_SUPPORT, &e)),
        #[cfg(test)]
        Handle::Fake(mut h) => {
            h.device(GPM_QUERY_DEVICE_SUPPORT)?;
            Ok(false)
        }
    }
}

/// Take a GPM sample of GPU `device`, or of its MIG GPU instance
/// `gpu_instance`, and answer the metrics between the previous sample of
/// the same and this one: `Ok(None)` for the first.
pub(super) fn sample(
    h: Handle<'_>,
    device: usize,
    gpu_instance: Option<u32>,
) -> Result<Option<Gpm>, GpuError> {
    // One arm outside test builds, where `Handle` has no fake.
    #[allow(clippy::infallible_destructuring_match)]
    let mut h = match h {
        Handle::Nvml(h) => h,
        #[cfg(test)]
        Handle::Fake(_) => return Err(crate::gpu::fake::unsupported(GPM_SAMPLE_GET)),
    };
    let key = (device, gpu_instance);
    let dev = h.device(GPM_SAMPLE_GET)?;
    let sample = match gpu_instance {
        None => dev
            .gpm_sample()
            .map_err(|e| GpuError::nvml(GPM_SAMPLE_GET, &e)),
        Some(gi) => dev
            .gpm_mig_sample(gi)
            .map_err(|e| GpuError::nvml(GPM_MIG_SAMPLE_GET, &e)),
    };
    let nvml = h.nvml();
    let previous = h.state::<Previous>();
    let sample = match sample {
        Ok(s) => s,
        Err(e) => {
            // A gap: the next metrics start from the next sample.
            previous.samples.remove(&key);
            return Err(e);
        }
    };
    let Some(before) = previous.samples.insert(key, sample) else {
        return Ok(None);
    };
    let Some(after) = previous.samples.get(&key) else {
        return Ok(None);
    };
    let ids = GpmMetric::ALL.map(id);
    let results = gpm_metrics_get(nvml, &before, after, &ids)
        .map_err(|e| GpuError::nvml(GPM_METRICS_GET, &e))?;
    let mut gpm = Gpm::default();
    // A metric this GPU lacks (per-metric NOT_SUPPORTED) leaves only its
    // family out.
    for (slot, r) in gpm.values.iter_mut().zip(results) {
        *slot = r.ok().map(|r| r.value).filter(|v| v.is_finite());
    }
    Ok(Some(gpm))
}
