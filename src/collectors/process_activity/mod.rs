//! `process_activity`: when each process on a GPU last ran a kernel, from
//! NVML's per-process utilisation samples (`nvmlDeviceGetProcessUtilization`,
//! the query `process_utilization` makes, asked here on its own slow
//! interval, [`EVERY`]). The driver buffers those samples, so one read every
//! 10 s sees every sample since the last one, at a tenth of the cost of a
//! read per full sample (0.7–1.4 ms of driver CPU per call on the H200, so
//! 0.07–0.14 ms a second per GPU). It leaves an [`Activity`] reading on each
//! listed process; the sampler turns it into idle time. Where the driver
//! does not have the samples it leaves none (said once in the log), and
//! the sampler falls back to the GPU's own utilisation.
//!
//! Its NVML call is `process_utilization`'s (`calls::samples_as`), counted
//! under its own operation label.

pub(crate) mod calls;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::process_utilization::Sample;
use super::{Collector, Context, PerGpu};
use crate::gpu::RawProcess;
use crate::model::{Activity, Reading};

/// How often the samples are read.
pub(crate) const EVERY: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Gpu {
    /// Newest sample seen (NVML µs), asked after.
    since_us: u64,
    /// When it was last read.
    read_at: Option<Instant>,
    /// The driver has the samples (`None`: not asked yet).
    supported: Option<bool>,
    /// When each listed pid last had a busy sample.
    last_active: HashMap<u32, SystemTime>,
    /// The listed pids (their readings).
    listed: Vec<u32>,
}

#[derive(Default)]
pub(super) struct ProcessActivityCollector {
    gpus: PerGpu<Gpu>,
    scratch: Vec<Sample>,
}

impl ProcessActivityCollector {
    pub(super) fn boxed() -> Box<dyn Collector> {
        Box::<ProcessActivityCollector>::default()
    }
}

impl Collector for ProcessActivityCollector {
    fn collect(&mut self, _cx: &mut Context<'_>, _gpu: usize) {}

    fn processes(&mut self, cx: &mut Context<'_>, gpu: usize, listed: &[RawProcess]) {
        let state = self.gpus.at(gpu);
        state.listed.clear();
        state.listed.extend(listed.iter().map(|p| p.pid));
        state
            .last_active
            .retain(|pid, _| listed.binary_search_by_key(pid, |p| p.pid).is_ok());
        let due = state
            .read_at
            .is_none_or(|at| cx.now.saturating_duration_since(at) >= EVERY);
        if !due || state.supported == Some(false) {
            return;
        }
        state.read_at = Some(cx.now);
        self.scratch.clear();
        let (since_us, scratch) = (state.since_us, &mut self.scratch);
        match cx.call(gpu, calls::PROCESS_ACTIVITY, |h| {
            super::process_utilization::calls::samples_as(
                calls::PROCESS_ACTIVITY,
                h,
                since_us,
                scratch,
            )
        }) {
            Ok(()) => {
                state.supported = Some(true);
                for s in &self.scratch {
                    state.since_us = state.since_us.max(s.timestamp_us);
                    let u = s.utilization;
                    if u.sm + u.memory + u.encoder + u.decoder == 0 {
                        continue;
                    }
                    let at = UNIX_EPOCH + Duration::from_micros(s.timestamp_us);
                    let e = state.last_active.entry(s.pid).or_insert(at);
                    *e = (*e).max(at);
                }
            }
            Err(e) => {
                if e.kind.is_unsupported() {
                    state.supported = Some(false);
                }
                cx.failed(gpu, e);
            }
        }
    }

    fn forget(&mut self, gpu: usize) {
        let state = self.gpus.at(gpu);
        state.listed.clear();
    }

    fn reading(&self, _gpu: usize) -> Option<Arc<dyn Reading>> {
        None
    }

    fn process_reading(&self, gpu: usize, pid: u32) -> Option<Arc<dyn Reading>> {
        let state = self.gpus.get(gpu)?;
        if state.supported != Some(true) {
            return None;
        }
        Some(Arc::new(Activity {
            last_active: state.last_active.get(&pid).copied(),
        }))
    }
}
