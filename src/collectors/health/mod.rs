//! `health`: ECC error counters (with ECC on), row remapping or, before
//! Ampere, retired pages, at every full sample; the ECC mode (a slow call)
//! every [`SLOW_READ_INTERVAL`](super::power_thermal::SLOW_READ_INTERVAL);
//! critical Xid events for every GPU at once after the GPUs are read,
//! counted by Xid since the exporter started watching each GPU.

pub(crate) mod calls;
pub(crate) mod families;
pub(crate) mod json;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use super::power_thermal::slow_read_due;
use super::{Collector, Context, PerGpu};
use crate::model::Reading;

/// An ECC counter of [`Health::ecc_errors`]: the `type` and `scope` labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EccCounter {
    CorrectedVolatile,
    CorrectedAggregate,
    UncorrectedVolatile,
    UncorrectedAggregate,
}

impl EccCounter {
    /// Every counter, in the order the family lists them.
    pub(crate) const ALL: [EccCounter; 4] = [
        EccCounter::CorrectedVolatile,
        EccCounter::CorrectedAggregate,
        EccCounter::UncorrectedVolatile,
        EccCounter::UncorrectedAggregate,
    ];

    /// The `type` label: corrected or uncorrected.
    pub(crate) fn error_type(self) -> &'static str {
        match self {
            EccCounter::CorrectedVolatile | EccCounter::CorrectedAggregate => "corrected",
            EccCounter::UncorrectedVolatile | EccCounter::UncorrectedAggregate => "uncorrected",
        }
    }

    /// The `scope` label: volatile (since the driver loaded) or aggregate
    /// (the GPU's life).
    pub(crate) fn scope(self) -> &'static str {
        match self {
            EccCounter::CorrectedVolatile | EccCounter::UncorrectedVolatile => "volatile",
            EccCounter::CorrectedAggregate | EccCounter::UncorrectedAggregate => "aggregate",
        }
    }
}

/// Memory health (`health` collector). `None`: not supported or failed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Health {
    pub ecc_enabled: Option<bool>,
    /// ECC error counts, indexed by [`EccCounter`] (`ecc_errors[c as usize]`).
    pub ecc_errors: [Option<u64>; 4],
    /// Row remapping (Ampere and later).
    pub remapped_rows: Option<RemappedRows>,
    /// Page retirement (before Ampere).
    pub retired_pages: Option<RetiredPages>,
    /// Critical Xid events seen since the exporter started watching this
    /// GPU, by Xid; `None` when the GPU does not deliver Xid events.
    pub xid_errors: Option<Arc<BTreeMap<u64, u64>>>,
}

/// nvmlDeviceGetRemappedRows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemappedRows {
    pub correctable: u32,
    pub uncorrectable: u32,
    /// A remap is pending: the GPU needs a reset to apply it.
    pub pending: bool,
    /// A remap failed: the GPU should be serviced.
    pub failed: bool,
}

/// Retired pages by cause, and whether a retirement waits for a reboot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetiredPages {
    pub single_bit_ecc: Option<u32>,
    pub double_bit_ecc: Option<u32>,
    pub pending: Option<bool>,
}

#[derive(Default)]
struct Gpu {
    read: Option<Arc<Health>>,
    /// When the ECC mode was last read, and what it answered.
    ecc_read_at: Option<Instant>,
    ecc_enabled: Option<bool>,
    /// Xid watch: `None` not tried yet, then whether the GPU delivers them.
    xid_watched: Option<bool>,
    /// Critical Xid events seen, by Xid.
    xid_errors: Arc<BTreeMap<u64, u64>>,
}

#[derive(Default)]
pub(super) struct HealthCollector {
    gpus: PerGpu<Gpu>,
    events: Vec<(usize, u64)>,
}

impl HealthCollector {
    pub(super) fn boxed() -> Box<dyn Collector> {
        Box::<HealthCollector>::default()
    }
}

impl Collector for HealthCollector {
    fn collect(&mut self, cx: &mut Context<'_>, gpu: usize) {
        let state = self.gpus.at(gpu);
        if slow_read_due(state.ecc_read_at, cx.now) {
            let ecc = cx.call(gpu, calls::ECC_MODE, calls::ecc_mode);
            state.ecc_read_at = Some(cx.now);
            state.ecc_enabled = ecc.map_err(|e| cx.failed(gpu, e)).ok();
        }
        let ecc_on = state.ecc_enabled == Some(true);
        let h = Health {
            ecc_enabled: state.ecc_enabled,
            // Without a handle, no call was made: name the one the
            // collector always makes (row remapping), not the ECC mode, a
            // slow read of its own.
            ..cx.read_all(gpu, calls::REMAPPED_ROWS, |h, failed| {
                calls::read(h, ecc_on, failed)
            })
        };
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
            match cx.call(gpu, calls::REGISTER_EVENTS, calls::watch_xid) {
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
        let events = &mut self.events;
        let read = cx
            .source_handle(calls::EVENT_SET_WAIT)
            .and_then(|h| calls::xid_events(h, events));
        if let Err(e) = read {
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
