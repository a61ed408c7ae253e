//! The process step of a full sample, for one GPU: feed every listed
//! process's peak window, select the ones that get series of their own
//! (the rest summed), and ask attribution who each is (with the torch
//! bridge's figures for this GPU or its MIG instance) and the per-process
//! collectors what they read.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::device::DeviceState;
use super::peaks::WindowMax;
use super::select::select;
use crate::attribute::ProcessLookup;
use crate::bridge::Figures;
use crate::collectors::Running;
use crate::config::Selection;
use crate::gpu::RawProcess;
use crate::model::ProcessSample;

/// Who each process is (attribution) and what it publishes about itself
/// (the torch bridge, when on).
pub(super) struct Lookups<'a, P> {
    /// The processes were read in this sample (the `processes` step is
    /// on): only then is there an unattributed figure.
    pub(super) read: bool,
    pub(super) procs: &'a mut P,
    pub(super) bridge: Option<&'a mut (dyn Figures + 'static)>,
}

/// Replace `dev`'s processes with `listed` (sorted by pid, one per pid).
pub(super) fn update<P: ProcessLookup>(
    dev: &mut DeviceState,
    listed: &[RawProcess],
    selection: &Selection,
    lookups: Lookups<'_, P>,
    collectors: &Running,
    now: Instant,
    window: Duration,
) {
    // Peaks follow every listed process, exported or not, so a process
    // that climbs into the top N arrives with its history.
    for p in listed {
        if let Some(b) = p.used_bytes {
            dev.process_peaks
                .entry(p.pid)
                .or_default()
                .push(now, b, window);
        }
    }
    dev.process_peaks
        .retain(|pid, _| listed.binary_search_by_key(pid, |p| p.pid).is_ok());
    let Lookups {
        read,
        procs,
        mut bridge,
    } = lookups;
    let (keep, other) = select(listed, selection);
    let mut list = Vec::with_capacity(keep.len());
    for k in keep {
        let p = &listed[k];
        let ident = procs.identify(p.pid);
        // The bridge's figures for this very process (pid and the start
        // time identify() just read), for its MIG instance's UUID, whose
        // UUID torch reports, else the GPU's.
        let seen = procs.seen(p.pid);
        let torch = match (bridge.as_deref_mut(), seen.start) {
            (Some(b), Some(start)) => match dev.instance_of(p) {
                Some(m) => b.stats(
                    p.pid,
                    start,
                    &[m.info.mig_uuid.as_str(), dev.info.uuid.as_str()],
                ),
                None => b.stats(p.pid, start, &[dev.info.uuid.as_str()]),
            },
            _ => None,
        };
        list.push(ProcessSample {
            pid: p.pid,
            used_bytes: p.used_bytes,
            ident,
            gpu_instance_id: p.gpu_instance_id,
            compute_instance_id: p.compute_instance_id,
            used_peak_bytes: p
                .used_bytes
                .and_then(|_| dev.process_peaks.get(&p.pid))
                .and_then(WindowMax::max),
            torch,
            readings: match seen.stale {
                Some(stale) => collectors.process_readings(dev.index, p.pid).with(stale),
                None => collectors.process_readings(dev.index, p.pid),
            },
        });
    }
    dev.processes = Arc::from(list);
    dev.other = other;
    dev.unattributed = read.then(|| Arc::new(dev.unattributed(listed)));
}
