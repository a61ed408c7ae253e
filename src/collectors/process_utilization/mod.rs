//! `process_utilization`: per-process SM, memory, encoder and decoder
//! busy percentages, like `nvidia-smi pmon -s um`, from NVML's process
//! utilisation samples newer than the last seen (one call of 0.7–1.4 ms
//! on the H200, hence off by default). Runs on the process list, so only while
//! `processes` is on.

pub(crate) mod calls;
pub(crate) mod families;
pub(crate) mod json;

use std::collections::HashMap;
use std::sync::Arc;

use super::{Collector, Context, PerGpu};
use crate::gpu::RawProcess;
use crate::model::Reading;

/// One process's busy percentages (`nvidia-smi pmon -s um`), from NVML's
/// process utilisation samples; 0 when the process had no sample since the
/// previous full sample (it did no work).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcessUtilization {
    pub sm: u32,
    pub memory: u32,
    pub encoder: u32,
    pub decoder: u32,
}

/// One process utilisation sample as NVML gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sample {
    pub pid: u32,
    /// NVML's CPU timestamp of the sample, µs.
    pub timestamp_us: u64,
    pub utilization: ProcessUtilization,
}

#[derive(Default)]
struct Gpu {
    /// Newest sample seen (NVML µs), asked after.
    since_us: u64,
    /// The last full sample's figures by pid; `None` when the query
    /// failed or is not supported.
    by_pid: Option<HashMap<u32, Arc<ProcessUtilization>>>,
}

#[derive(Default)]
pub(super) struct ProcessUtilizationCollector {
    gpus: PerGpu<Gpu>,
    scratch: Vec<Sample>,
}

impl ProcessUtilizationCollector {
    pub(super) fn boxed() -> Box<dyn Collector> {
        Box::<ProcessUtilizationCollector>::default()
    }
}

impl Collector for ProcessUtilizationCollector {
    fn collect(&mut self, _cx: &mut Context<'_>, _gpu: usize) {}

    fn processes(&mut self, cx: &mut Context<'_>, gpu: usize, listed: &[RawProcess]) {
        let state = self.gpus.at(gpu);
        self.scratch.clear();
        let (since_us, scratch) = (state.since_us, &mut self.scratch);
        match cx.call(gpu, calls::PROCESS_UTILIZATION, |h| {
            calls::samples(h, since_us, scratch)
        }) {
            Ok(()) => {
                // The latest sample per pid; a listed process with none did
                // no work since the last full sample: 0.
                let mut latest: HashMap<u32, (u64, ProcessUtilization)> = HashMap::new();
                for p in &self.scratch {
                    let e = latest
                        .entry(p.pid)
                        .or_insert((p.timestamp_us, p.utilization));
                    if p.timestamp_us >= e.0 {
                        *e = (p.timestamp_us, p.utilization);
                    }
                }
                if let Some(t) = self.scratch.iter().map(|p| p.timestamp_us).max() {
                    state.since_us = t.max(state.since_us);
                }
                state.by_pid = Some(
                    listed
                        .iter()
                        .map(|p| {
                            let u = latest.get(&p.pid).map(|(_, u)| *u).unwrap_or_default();
                            (p.pid, Arc::new(u))
                        })
                        .collect(),
                );
            }
            Err(e) => {
                state.by_pid = None;
                cx.failed(gpu, e);
            }
        }
    }

    fn forget(&mut self, gpu: usize) {
        self.gpus.at(gpu).by_pid = None;
    }

    fn reading(&self, _gpu: usize) -> Option<Arc<dyn Reading>> {
        None
    }

    fn process_reading(&self, gpu: usize, pid: u32) -> Option<Arc<dyn Reading>> {
        let u = self.gpus.get(gpu)?.by_pid.as_ref()?.get(&pid)?.clone();
        Some(u)
    }
}
