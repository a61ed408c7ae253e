//! `health`: ECC error counters (with ECC on), row remapping or, before
//! Ampere, retired pages, at every full sample; the ECC mode (a slow call)
//! every [`SLOW_READ_INTERVAL`](super::power_thermal::SLOW_READ_INTERVAL);
//! critical Xid events for every GPU at once after the GPUs are read,
//! counted by Xid since the exporter started watching each GPU.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use super::power_thermal::slow_read_due;
use super::{Collector, Context, PerGpu};
use crate::gpu::readings;
use crate::model::Reading;

#[derive(Default)]
struct Gpu {
    read: Option<Arc<readings::Health>>,
    /// When the ECC mode was last read, and what it answered.
    ecc_read_at: Option<Instant>,
    ecc_enabled: Option<bool>,
    /// Xid watch: `None` not tried yet, then whether the GPU delivers them.
    xid_watched: Option<bool>,
    /// Critical Xid events seen, by Xid.
    xid_errors: Arc<BTreeMap<u64, u64>>,
}

#[derive(Default)]
pub(super) struct Health {
    gpus: PerGpu<Gpu>,
    events: Vec<(usize, u64)>,
}

impl Health {
    pub(super) fn boxed() -> Box<dyn Collector> {
        Box::<Health>::default()
    }
}

impl Collector for Health {
    fn collect(&mut self, cx: &mut Context<'_>, gpu: usize) {
        let state = self.gpus.at(gpu);
        if slow_read_due(state.ecc_read_at, cx.now) {
            let ecc = cx.gpu.ecc_mode(gpu);
            state.ecc_read_at = Some(cx.now);
            state.ecc_enabled = ecc.map_err(|e| cx.failed(gpu, e)).ok();
        }
        let mut failed = Vec::new();
        let h = readings::Health {
            ecc_enabled: state.ecc_enabled,
            ..cx.gpu
                .health(gpu, state.ecc_enabled == Some(true), &mut failed)
        };
        failed.into_iter().for_each(|e| cx.failed(gpu, e));
        state.read = Some(Arc::new(h));
    }

    /// Register the GPUs not watched yet for critical Xid events (once
    /// each), read the events that arrived, and hand each GPU's counts to
    /// its reading.
    fn finish(&mut self, cx: &mut Context<'_>, answering: &[bool]) {
        for (gpu, &up) in answering.iter().enumerate() {
            let state = self.gpus.at(gpu);
            if !up || state.xid_watched.is_some() {
                continue;
            }
            match cx.gpu.watch_xid(gpu) {
                Ok(()) => state.xid_watched = Some(true),
                Err(e) => {
                    if e.kind.is_unsupported() {
                        state.xid_watched = Some(false);
                    }
                    cx.failed(gpu, e);
                }
            }
        }
        self.events.clear();
        if let Err(e) = cx.gpu.xid_events(&mut self.events) {
            cx.count(e);
        }
        for &(gpu, xid) in &self.events {
            let state = self.gpus.at(gpu);
            tracing::warn!(gpu, xid, "critical Xid event");
            *Arc::make_mut(&mut state.xid_errors).entry(xid).or_insert(0) += 1;
        }
        for (_, state) in self.gpus.iter_mut() {
            if let (Some(h), Some(true)) = (state.read.as_mut(), state.xid_watched) {
                Arc::make_mut(h).xid_errors = Some(Arc::clone(&state.xid_errors));
            }
        }
    }

    fn forget(&mut self, gpu: usize) {
        self.gpus.at(gpu).read = None;
    }

    fn reading(&self, gpu: usize) -> Option<Arc<dyn Reading>> {
        let h = self.gpus.get(gpu)?.read.clone()?;
        Some(h)
    }
}
