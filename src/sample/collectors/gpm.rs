//! `gpm`: NVML's GPU Performance Monitoring (Hopper and later): SM
//! activity and occupancy, tensor-core, DRAM bandwidth and FP16/32/64
//! activity, PCIe and NVLink bytes per second, per GPU and per MIG GPU
//! instance. A GPM metric is the difference of two samples: each full
//! sample takes one per GPU (and instance), and the figures are the
//! averages since the previous full sample (the source keeps that sample,
//! see `GpuSource::gpm`), so the first full sample has none.
//!
//! Support is asked once per GPU (`nvmlGpmQueryDeviceSupport`); a GPU
//! without it is logged once and never sampled. Cost on the H200 (driver
//! 580), measured in the exporter by scripts/gpu/gpm.py: +254 µs per GPU
//! per full sample (196 → 450 µs); off by default until it has run on
//! more than one GPU model.

use std::sync::Arc;

use super::{Collector, Context, PerGpu};
use crate::gpu::readings::GpmReading;
use crate::gpu::{ErrorKind, GpuError, Operation};
use crate::model::Reading;

#[derive(Default)]
struct Gpu {
    /// `None` until asked, then whether the GPU has GPM.
    supported: Option<bool>,
    /// The GPU's own sample, and the MIG GPU instances' samples (by id),
    /// that answered NOT_SUPPORTED (logged once): not asked again.
    gpu_unsupported: bool,
    instances_unsupported: Vec<u32>,
    read: Option<Arc<GpmReading>>,
}

#[derive(Default)]
pub(super) struct GpmCollector {
    gpus: PerGpu<Gpu>,
}

impl GpmCollector {
    pub(super) fn boxed() -> Box<dyn Collector> {
        Box::<GpmCollector>::default()
    }
}

impl Collector for GpmCollector {
    fn collect(&mut self, cx: &mut Context<'_>, gpu: usize) {
        let state = self.gpus.at(gpu);
        if state.supported.is_none() {
            match cx.gpu.gpm_supported(gpu) {
                Ok(true) => state.supported = Some(true),
                Ok(false) => {
                    state.supported = Some(false);
                    cx.failed(
                        gpu,
                        GpuError::new(Operation::GpmQueryDeviceSupport, ErrorKind::NotSupported),
                    );
                }
                Err(e) => {
                    if e.kind.is_unsupported() {
                        state.supported = Some(false);
                    }
                    cx.failed(gpu, e);
                }
            }
        }
        if state.supported != Some(true) {
            state.read = None;
            return;
        }
        let mut reading = GpmReading::default();
        if !state.gpu_unsupported {
            match cx.gpu.gpm(gpu, None) {
                Ok(g) => reading.gpu = g,
                Err(e) => {
                    state.gpu_unsupported = e.kind.is_unsupported();
                    cx.failed(gpu, e);
                }
            }
        }
        for gi in cx.gpu.mig_gpu_instances(gpu) {
            if state.instances_unsupported.contains(&gi) {
                continue;
            }
            match cx.gpu.gpm(gpu, Some(gi)) {
                Ok(Some(g)) => reading.instances.push((gi, g)),
                Ok(None) => {}
                Err(e) => {
                    if e.kind.is_unsupported() {
                        state.instances_unsupported.push(gi);
                    }
                    cx.failed(gpu, e);
                }
            }
        }
        state.read = (reading != GpmReading::default()).then(|| Arc::new(reading));
    }

    fn forget(&mut self, gpu: usize) {
        self.gpus.at(gpu).read = None;
    }

    fn reading(&self, gpu: usize) -> Option<Arc<dyn Reading>> {
        let r = self.gpus.get(gpu)?.read.clone()?;
        Some(r)
    }
}
