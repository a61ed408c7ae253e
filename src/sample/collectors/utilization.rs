//! `utilization`: how busy each GPU is (kernels, memory controller, video
//! encoder and decoder), three cheap calls per GPU per full sample.

use std::sync::Arc;

use super::{Collector, Context, PerGpu};
use crate::gpu::readings;
use crate::model::Reading;

#[derive(Default)]
pub(super) struct Utilization {
    /// Per GPU: the last full sample's figures.
    read: PerGpu<Option<Arc<readings::Utilization>>>,
}

impl Utilization {
    pub(super) fn boxed() -> Box<dyn Collector> {
        Box::<Utilization>::default()
    }
}

impl Collector for Utilization {
    fn collect(&mut self, cx: &mut Context<'_>, gpu: usize) {
        let mut failed = Vec::new();
        let u = cx.gpu.utilization(gpu, &mut failed);
        failed.into_iter().for_each(|e| cx.failed(gpu, e));
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
