//! GPM (GPU Performance Monitoring, Hopper and later) through
//! nvml-wrapper's safe API (`Device::gpm_sample`, `gpm_mig_sample`,
//! `gpm::gpm_metrics_get`): one sample per GPU (or MIG GPU instance) per
//! call, the metrics between it and the previous one, which is kept here
//! and freed when replaced (or with the source, before `nvmlShutdown`).

use std::collections::HashMap;

use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::gpm::{GpmSample, gpm_metrics_get};
use nvml_wrapper::{Device, Nvml};

use crate::gpu::readings::{Gpm, GpmMetric};
use crate::gpu::{GpuError, Operation};

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

/// The previous sample of each (GPU, MIG GPU instance).
#[derive(Default)]
pub(super) struct Previous {
    samples: HashMap<(usize, Option<u32>), GpmSample<'static>>,
}

impl Previous {
    /// A new sample; the metrics since the previous one, which it replaces.
    pub(super) fn next(
        &mut self,
        nvml: &'static Nvml,
        dev: &Device<'static>,
        device: usize,
        gpu_instance: Option<u32>,
    ) -> Result<Option<Gpm>, GpuError> {
        let key = (device, gpu_instance);
        let sample = match gpu_instance {
            None => dev
                .gpm_sample()
                .map_err(|e| GpuError::nvml(Operation::GpmSampleGet, &e)),
            Some(gi) => dev
                .gpm_mig_sample(gi)
                .map_err(|e| GpuError::nvml(Operation::GpmMigSampleGet, &e)),
        };
        let sample = match sample {
            Ok(s) => s,
            Err(e) => {
                // A gap: the next metrics start from the next sample.
                self.samples.remove(&key);
                return Err(e);
            }
        };
        let Some(before) = self.samples.insert(key, sample) else {
            return Ok(None);
        };
        let Some(after) = self.samples.get(&key) else {
            return Ok(None);
        };
        let ids = GpmMetric::ALL.map(id);
        let results = gpm_metrics_get(nvml, &before, after, &ids)
            .map_err(|e| GpuError::nvml(Operation::GpmMetricsGet, &e))?;
        let mut gpm = Gpm::default();
        // A metric this GPU lacks (per-metric NOT_SUPPORTED) leaves only
        // its family out.
        for (slot, r) in gpm.values.iter_mut().zip(results) {
            *slot = r.ok().map(|r| r.value).filter(|v| v.is_finite());
        }
        Ok(Some(gpm))
    }
}
