//! What a collector is written against: the [`Collector`] trait, the
//! [`Context`] of one full sample (the GPU source's handles, the time, where
//! failures go) and [`PerGpu`] state.

use std::sync::Arc;
use std::time::Instant;

use crate::gpu::{GpuError, GpuSource, Handle, Operation, RawProcess};
use crate::model::{Reading, Readings};

/// Where a collector's failed calls go: the sampler's NVML error
/// accounting (`sample/errors.rs`).
pub(crate) trait Failures {
    /// A call on GPU `gpu` failed: unsupported calls are logged once,
    /// anything else counted.
    fn collector_failed(&mut self, gpu: usize, e: GpuError);
    /// A call not tied to one GPU failed: counted.
    fn count(&mut self, e: GpuError);
}

/// What a collector works with during one full sample.
pub(crate) struct Context<'a> {
    gpu: &'a mut dyn GpuSource,
    /// When this full sample started.
    pub(crate) now: Instant,
    errors: &'a mut dyn Failures,
}

impl<'a> Context<'a> {
    pub(crate) fn new(
        gpu: &'a mut dyn GpuSource,
        now: Instant,
        errors: &'a mut dyn Failures,
    ) -> Self {
        Context { gpu, now, errors }
    }

    /// The handle for calls on GPU `gpu`; without one, `operation` fails.
    pub(crate) fn handle(
        &mut self,
        gpu: usize,
        operation: Operation,
    ) -> Result<Handle<'_>, GpuError> {
        self.gpu.handle(Some(gpu), operation)
    }

    /// The handle for calls on the source as a whole (event sets).
    pub(crate) fn source_handle(&mut self, operation: Operation) -> Result<Handle<'_>, GpuError> {
        self.gpu.handle(None, operation)
    }

    /// The GPU instance ids of GPU `gpu`'s MIG layout.
    pub(crate) fn mig_gpu_instances(&self, gpu: usize) -> Vec<u32> {
        self.gpu.mig_gpu_instances(gpu)
    }

    /// A call on GPU `gpu` failed: a call the GPU does not support leaves
    /// its family out for that GPU (logged once, with the other calls of
    /// this sample, and not counted); any other failure is counted.
    pub(crate) fn failed(&mut self, gpu: usize, e: GpuError) {
        self.errors.collector_failed(gpu, e);
    }

    /// A call not tied to one GPU failed: counted.
    pub(crate) fn count(&mut self, e: GpuError) {
        self.errors.count(e);
    }

    /// Calls that leave each failure in a list (one GPU, several calls):
    /// run `read` on GPU `gpu`'s handle (or answer `T::default()` when
    /// there is none, with `operation` failed), then report every failure.
    pub(crate) fn read_all<T: Default>(
        &mut self,
        gpu: usize,
        operation: Operation,
        read: impl FnOnce(Handle<'_>, &mut Vec<GpuError>) -> T,
    ) -> T {
        let mut failed = Vec::new();
        let value = match self.handle(gpu, operation) {
            Ok(h) => read(h, &mut failed),
            Err(e) => {
                failed.push(e);
                T::default()
            }
        };
        failed.into_iter().for_each(|e| self.failed(gpu, e));
        value
    }

    /// One call on GPU `gpu`'s handle.
    pub(crate) fn call<T>(
        &mut self,
        gpu: usize,
        operation: Operation,
        call: impl FnOnce(Handle<'_>) -> Result<T, GpuError>,
    ) -> Result<T, GpuError> {
        call(self.handle(gpu, operation)?)
    }
}

/// A switchable collector. One instance serves every GPU and keeps its
/// per-GPU state itself (index = NVML index); it is made afresh when NVML
/// is re-opened and when it is switched on.
pub(crate) trait Collector: Send {
    /// A full sample of GPU `gpu`, which is known and answered its memory
    /// query in this sample.
    fn collect(&mut self, cx: &mut Context<'_>, gpu: usize);

    /// The processes NVML listed on `gpu` in this full sample (called only
    /// while the `processes` collector is on and the list was read).
    fn processes(&mut self, _cx: &mut Context<'_>, _gpu: usize, _listed: &[RawProcess]) {}

    /// After every GPU of a full sample; `answering[i]` says whether GPU
    /// `i` was collected in it.
    fn finish(&mut self, _cx: &mut Context<'_>, _answering: &[bool]) {}

    /// GPU `gpu` did not answer (or NVML was closed): its readings go.
    fn forget(&mut self, gpu: usize);

    /// What this collector read of GPU `gpu` in the last full sample.
    fn reading(&self, gpu: usize) -> Option<Arc<dyn Reading>>;

    /// Every reading it leaves in GPU `gpu`'s sample: [`Self::reading`],
    /// and any reading of a shared type (in `model`) that a reader
    /// outside `collectors/` asks for without naming this collector.
    fn readings(&self, gpu: usize, out: &mut Readings) {
        if let Some(r) = self.reading(gpu) {
            out.put(r);
        }
    }

    /// What it read of process `pid` on GPU `gpu`, for per-process
    /// collectors.
    fn process_reading(&self, _gpu: usize, _pid: u32) -> Option<Arc<dyn Reading>> {
        None
    }
}

/// Per-GPU state of a collector, grown as GPUs are seen.
#[derive(Debug, Default)]
pub(crate) struct PerGpu<T>(Vec<T>);

impl<T: Default> PerGpu<T> {
    /// The state of GPU `gpu`, made when first asked.
    pub(crate) fn at(&mut self, gpu: usize) -> &mut T {
        if self.0.len() <= gpu {
            self.0.resize_with(gpu + 1, T::default);
        }
        &mut self.0[gpu]
    }

    pub(crate) fn get(&self, gpu: usize) -> Option<&T> {
        self.0.get(gpu)
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (usize, &mut T)> {
        self.0.iter_mut().enumerate()
    }
}
