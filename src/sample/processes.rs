//! The process step of a full sample, for one GPU: feed every listed
//! process's peak window, select the ones that get series of their own
//! (the rest summed), and ask attribution who each is (with the torch
//! bridge's figures for this GPU or its MIG instance) and the per-process
//! collectors what they read.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use super::device::DeviceState;
use super::peaks::WindowMax;
use super::select::select;
use crate::attribute::ProcessLookup;
use crate::bridge::Figures;
use crate::collectors::Running;
use crate::config::Selection;
use crate::gpu::RawProcess;
use crate::model::{Activity, Busy, Idle, ProcessSample, Readings};

/// Whether a process first seen at `first` is idle as of `now`: it ran no
/// kernel since `since` (its last busy per-process sample, else — where the
/// driver has no such samples — the GPU's last busy moment `gpu_busy_at`;
/// never before it was first seen), at least `after` ago.
fn idle(
    r: &Readings,
    first: SystemTime,
    gpu_busy_at: Option<SystemTime>,
    now: SystemTime,
    after: Duration,
) -> Option<Idle> {
    let active = match r.get::<Activity>() {
        Some(a) => a.last_active,
        None => gpu_busy_at,
    };
    let since = active.map_or(first, |a| a.max(first));
    (now.duration_since(since).ok()? >= after).then_some(Idle { since })
}

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
    let wall = SystemTime::now();
    dev.first_seen
        .retain(|pid, _| listed.binary_search_by_key(pid, |p| p.pid).is_ok());
    for p in listed {
        dev.first_seen.entry(p.pid).or_insert(wall);
    }
    // Where the driver has no per-process samples: the GPU's own
    // utilisation (every holder of an idle GPU is idle).
    if collectors
        .readings(dev.index)
        .get::<Busy>()
        .and_then(|b| b.percent)
        .is_some_and(|pct| pct > 0)
    {
        dev.busy_at = Some(wall);
    }
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
            torch: torch.map(Arc::new),
            readings: {
                let mut r = collectors.process_readings(dev.index, p.pid);
                if let Some(stale) = seen.stale {
                    r.put(Arc::new(stale));
                }
                let first = dev.first_seen.get(&p.pid).copied().unwrap_or(wall);
                if let Some(idle) = idle(&r, first, dev.busy_at, wall, selection.idle_after) {
                    r.put(Arc::new(idle));
                }
                r
            },
        });
    }
    dev.processes = Arc::from(list);
    dev.other = other;
    dev.unattributed = read.then(|| Arc::new(dev.unattributed(listed)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    /// Idle from the process's own samples where the driver has them,
    /// else from the GPU's; never counted from before it was first seen.
    #[test]
    fn idle_from_the_process_samples_else_the_gpu() {
        let at = |m: u64| UNIX_EPOCH + Duration::from_secs(60 * m);
        let active = |m: Option<u64>| {
            Readings::default().with(Activity {
                last_active: m.map(at),
            })
        };
        let none = Readings::default();
        let after = Duration::from_secs(30 * 60);
        // (readings, first seen, GPU busy at, now, idle since), minutes.
        type Case<'a> = (&'a Readings, u64, Option<u64>, u64, Option<u64>);
        let cases: [Case<'_>; 8] = [
            (&active(Some(10)), 0, None, 39, None),
            (&active(Some(10)), 0, None, 40, Some(10)),
            // The GPU busy does not matter where the process's own say.
            (&active(Some(10)), 0, Some(45), 45, Some(10)),
            // Never active: since first seen.
            (&active(None), 5, Some(44), 35, Some(5)),
            (&active(None), 5, None, 34, None),
            // No per-process samples: the GPU's utilisation.
            (&none, 0, Some(50), 79, None),
            (&none, 0, Some(50), 80, Some(50)),
            (&none, 20, None, 50, Some(20)),
        ];
        for (i, (r, first, gpu, now, want)) in cases.into_iter().enumerate() {
            let got = idle(r, at(first), gpu.map(at), at(now), after).map(|i| i.since);
            assert_eq!(got, want.map(at), "case {i}");
        }
    }
}
