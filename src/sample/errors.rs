//! The sampler's NVML error accounting: the counters every snapshot
//! carries (`gpumem_exporter_nvml_errors_total`), whether an error says the
//! driver is gone for this NVML instance, and the calls a GPU does not
//! support (left out, logged once per GPU and call, never counted).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::collectors::Failures;
use crate::gpu::{GpuError, Operation};
use crate::model::ErrorKey;
use crate::ratelimit::LogLimiter;

pub(super) struct Errors {
    pub(super) counts: Arc<BTreeMap<ErrorKey, u64>>,
    pub(super) driver_gone: Option<GpuError>,
    /// (GPU, operation) pairs already logged as not supported.
    unsupported_logged: LogLimiter<(usize, Operation)>,
    /// Unsupported calls of this sample not logged yet, per GPU.
    unsupported_new: Vec<(usize, Operation)>,
}

impl Errors {
    pub(super) fn new() -> Self {
        Errors {
            counts: Arc::new(BTreeMap::new()),
            driver_gone: None,
            unsupported_logged: LogLimiter::once(),
            unsupported_new: Vec::new(),
        }
    }

    /// Count a failed call; remember the first that says the driver is gone.
    pub(super) fn count(&mut self, e: GpuError) {
        tracing::debug!(operation = %e.operation, error = %e.kind, "NVML call failed");
        *Arc::make_mut(&mut self.counts)
            .entry((e.operation, e.kind))
            .or_insert(0) += 1;
        if self.driver_gone.is_none() && e.kind.is_driver_gone() {
            self.driver_gone = Some(e);
        }
    }

    /// A collector's call failed: unsupported is noted (to be logged once),
    /// anything else counted.
    pub(super) fn collector_failed(&mut self, gpu: usize, e: GpuError) {
        if e.kind.is_unsupported() {
            if self.unsupported_logged.check((gpu, e.operation)).is_some() {
                self.unsupported_new.push((gpu, e.operation));
            }
        } else {
            self.count(e);
        }
    }

    /// Log the unsupported calls noted since the last flush: one line per
    /// GPU naming them.
    pub(super) fn flush_unsupported(&mut self) {
        if self.unsupported_new.is_empty() {
            return;
        }
        self.unsupported_new.sort_by_key(|&(gpu, _)| gpu);
        for chunk in self.unsupported_new.chunk_by(|a, b| a.0 == b.0) {
            let calls: Vec<&str> = chunk.iter().map(|(_, op)| op.label()).collect();
            tracing::info!(
                gpu = chunk[0].0,
                calls = calls.join(","),
                "not supported by this GPU; the families of these calls are not exported for it"
            );
        }
        self.unsupported_new.clear();
    }

    /// A fresh NVML instance: nothing is gone, and support is asked anew.
    pub(super) fn reopened(&mut self) {
        self.driver_gone = None;
        self.unsupported_logged.clear();
    }

    #[cfg(test)]
    pub(super) fn unsupported_logged(&self) -> usize {
        self.unsupported_logged.len()
    }
}

impl Failures for Errors {
    fn collector_failed(&mut self, gpu: usize, e: GpuError) {
        Errors::collector_failed(self, gpu, e);
    }

    fn count(&mut self, e: GpuError) {
        Errors::count(self, e);
    }
}
