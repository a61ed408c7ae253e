//! `utilization`: how busy each GPU is (kernels, memory controller, video
//! encoder and decoder), three cheap calls per GPU per full sample.

pub(crate) mod calls;
pub(crate) mod families;

use std::sync::Arc;

use super::{Collector, Context, PerGpu};
use crate::model::Reading;

/// Busy percentages of one GPU over NVML's last sampling period. A field
/// is `None` when its call failed or is not supported: the family is then
/// absent for this GPU, never a fake 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Utilization {
    /// nvidia-smi `utilization.gpu`: time a kernel was running, percent.
    pub gpu: Option<u32>,
    /// nvidia-smi `utilization.memory`: memory controller busy, percent.
    pub memory: Option<u32>,
    pub encoder: Option<u32>,
    pub decoder: Option<u32>,
}

#[derive(Default)]
pub(super) struct UtilizationCollector {
    /// Per GPU: the last full sample's figures.
    read: PerGpu<Option<Arc<Utilization>>>,
}

impl UtilizationCollector {
    pub(super) fn boxed() -> Box<dyn Collector> {
        Box::<UtilizationCollector>::default()
    }
}

impl Collector for UtilizationCollector {
    fn collect(&mut self, cx: &mut Context<'_>, gpu: usize) {
        let u = cx.read_all(gpu, calls::UTILIZATION_RATES, calls::read);
        *self.read.at(gpu) = Some(Arc::new(u));
    }

    fn forget(&mut self, gpu: usize) {
        *self.read.at(gpu) = None;
    }

    fn reading(&self, gpu: usize) -> Option<Arc<dyn Reading>> {
        let u = self.read.get(gpu)?.clone()?;
        Some(u)
    }
}
