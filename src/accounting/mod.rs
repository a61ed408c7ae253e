//! The ledger: memory-time, busy-time and allocated/idle time, integrated
//! at every published sample (ten a second at the defaults), so what
//! happens between two scrapes is counted. `publish::Shared` owns the one
//! [`Ledger`] and feeds it each snapshot with the monotonic time it was
//! published; the totals go into that snapshot ([`Accounts`]).
//!
//! Integration is the left rule: what one sample shows (a GPU's used
//! bytes and utilisation, its process list, an allocation and whether its
//! GPU holds a process of its owner) is taken to hold until the next
//! sample, over the real elapsed time between them (`Instant`). A GPU that
//! did not answer (or is gone) adds nothing until it answers again. The
//! totals are keyed by what survives a reload — the GPU's UUID, the pid,
//! the workload, the allocation row — and live in `Shared`, which SIGHUP,
//! GPU loss and an NVML re-open leave in place: they only reset at a
//! restart.
//!
//! Per-sample cost: a GPU whose process list is the very same `Arc` as in
//! the last sample (every memory-only sample) costs two multiplications;
//! the per-process and per-workload totals are folded only when a list
//! changes (a full sample), see `model::accounting`. Hand-written: a few
//! sums over the snapshot, nothing a library would do for us.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use crate::model::{
    Accounts, AllocatedDevice, AllocationRow, Busy, DeviceSample, Idle, ProcessSample, Snapshot,
    Stale, Unattributed, WORKLOAD_GRACE_SECONDS, Workload, WorkloadAccount,
};

mod ranking;

pub(crate) use ranking::{Ranked, Ranking, rank};

/// What one GPU showed at the last sample: held until this one.
#[derive(Debug)]
struct Held {
    used: Option<u64>,
    /// The GPU's busy percentage (a `Busy` reading), held between samples:
    /// only where NVML has no utilisation samples for the GPU.
    busy: Option<f64>,
    /// The utilisation samples' read last added (`BusySamples::read`).
    samples_read: Option<u64>,
    processes: Arc<[ProcessSample]>,
    /// Bytes its stale processes hold, by reason; `None` where the
    /// processes were not read (computed once per process list).
    stale: Option<[u64; 5]>,
}

/// The bytes `d`'s stale processes hold, by reason (`None` where its
/// processes were not read in the sample the list is from).
fn stale_bytes(d: &DeviceSample) -> Option<[u64; 5]> {
    d.readings.get::<Unattributed>()?;
    let mut by_reason = [0u64; 5];
    for p in d.processes.iter() {
        if let Some(st) = p.readings.get::<Stale>() {
            by_reason[st.reason as usize] += p.used_bytes.unwrap_or(0);
        }
    }
    Some(by_reason)
}

/// The integrator. Only `Shared::publish` calls it (one writer).
#[derive(Debug, Default)]
pub struct Ledger {
    start: Option<Instant>,
    last: Option<Instant>,
    accounts: Accounts,
    held: HashMap<Arc<str>, Held>,
    /// The allocation rows of the last sample: which GPU each is on.
    rows_key: Option<RowsKey>,
    /// The workload ranking's minutes.
    ranking: Ranking,
    /// GPUs whose processes' totals were kept while they were down or
    /// gone: at their next answer, the totals of processes they no longer
    /// list go.
    kept: HashSet<Arc<str>>,
}

/// The inputs the allocation rows' idle flags were computed from
/// (compared by address, like the body cache's).
#[derive(Debug)]
struct RowsKey {
    kube: Option<Arc<[crate::model::Allocation]>>,
    dra: Option<Arc<[crate::model::DraAllocation]>>,
    slurm: Option<Arc<[crate::model::JobAllocation]>>,
}

impl Ledger {
    pub fn new() -> Ledger {
        Ledger::default()
    }

    /// Integrate from the last sample up to `now`, take in `s`, and
    /// return the totals as of `s`.
    pub fn record(&mut self, s: &Snapshot, now: Instant) -> Accounts {
        let start = *self.start.get_or_insert(now);
        let dt = self
            .last
            .map_or(0.0, |l| now.saturating_duration_since(l).as_secs_f64());
        self.last = Some(now);
        let t = now.saturating_duration_since(start).as_secs_f64();
        self.integrate(dt);
        let folded = self.take_in(s, t);
        self.allocations(s, dt, t, folded);
        self.accounts.seconds = t;
        if let Some(base) = self.ranking.minute(t, &self.accounts, &s.devices) {
            self.accounts.ranking = base;
        }
        self.accounts.clone()
    }

    /// What the last sample showed, over `dt` seconds.
    fn integrate(&mut self, dt: f64) {
        if dt <= 0.0 || self.held.is_empty() {
            return;
        }
        let gpus = Arc::make_mut(&mut self.accounts.gpus);
        for (uuid, h) in &self.held {
            let Some(g) = gpus.get_mut(uuid) else {
                continue;
            };
            if let Some(used) = h.used {
                g.used_byte_seconds += used as f64 * dt;
            }
            if let Some(b) = h.busy {
                *g.busy_seconds.get_or_insert(0.0) += b * dt;
                g.pending_busy_seconds += b * dt;
            }
            if let Some(stale) = h.stale {
                let total = g.stale_byte_seconds.get_or_insert([0.0; 5]);
                for (t, b) in total.iter_mut().zip(stale) {
                    *t += b as f64 * dt;
                }
            }
            g.pending_seconds += dt;
        }
    }

    /// Hold `s`'s figures from now on; fold the process lists that
    /// changed. Returns whether any was folded.
    fn take_in(&mut self, s: &Snapshot, t: f64) -> bool {
        let mut seen: HashSet<&str> = HashSet::with_capacity(s.devices.len());
        let mut folded = false;
        for d in s.devices.iter().filter(|d| d.info.is_known()) {
            let uuid = d.info.uuid.as_str();
            seen.insert(uuid);
            let reading = d.readings.get::<Busy>();
            let sampled = reading.and_then(|b| b.samples);
            // NVML's samples where it has them; else the gauge, held.
            let busy = match sampled {
                Some(_) => None,
                None => reading
                    .and_then(|b| b.percent)
                    .map(|pct| f64::from(pct.min(100)) / 100.0),
            };
            let prev_read = self.held.get(uuid).and_then(|h| h.samples_read);
            let used = d.memory.map(|m| m.used);
            let key: Arc<str> = match self.held.get_key_value(uuid) {
                Some((k, _)) => Arc::clone(k),
                None => Arc::from(uuid),
            };
            let gpus = Arc::make_mut(&mut self.accounts.gpus);
            let g = gpus.entry(Arc::clone(&key)).or_default();
            if g.gpu != d.info.gpu {
                g.gpu = d.info.gpu.clone();
            }
            if (busy.is_some() || sampled.is_some()) && g.busy_seconds.is_none() {
                g.busy_seconds = Some(0.0);
            }
            let mut samples_read = prev_read;
            if let Some(b) = sampled
                && prev_read != Some(b.read)
            {
                // Before the fold: the samples are of the list until now.
                let secs = b.seconds();
                *g.busy_seconds.get_or_insert(0.0) += secs;
                g.pending_busy_seconds += secs;
                samples_read = Some(b.read);
            }
            let same = self
                .held
                .get(uuid)
                .is_some_and(|h| Arc::ptr_eq(&h.processes, &d.processes));
            let stale = match self.held.get(uuid) {
                Some(h) if same => h.stale,
                _ => stale_bytes(d),
            };
            if !same {
                let old = self.held.remove(uuid).map(|h| h.processes);
                // A GPU that does not answer lists no process: keep its
                // processes' totals until it answers without them.
                let keep = d.memory.is_none();
                self.fold(&key, old.as_deref().unwrap_or(&[]), &d.processes, keep, t);
                folded = true;
            }
            self.held.insert(
                key,
                Held {
                    used,
                    busy,
                    samples_read,
                    processes: Arc::clone(&d.processes),
                    stale,
                },
            );
        }
        // A GPU that left the snapshot (re-enumerated, not yet identified)
        // holds nothing from now on; its totals stay.
        let gone: Vec<Arc<str>> = self
            .held
            .keys()
            .filter(|k| !seen.contains(&***k))
            .cloned()
            .collect();
        for key in gone {
            if let Some(h) = self.held.remove(&key) {
                self.fold(&key, &h.processes, &[], true, t);
                folded = true;
            }
        }
        if folded {
            self.expire(t);
        }
        folded
    }

    /// Move GPU `uuid`'s pending seconds into the totals of the processes
    /// and workloads of `old`, its list until now, and start `new`. A
    /// process of `old` not in `new` loses its total unless `keep` (the
    /// GPU is down or gone: it may list the process again).
    fn fold(
        &mut self,
        uuid: &Arc<str>,
        old: &[ProcessSample],
        new: &[ProcessSample],
        keep: bool,
        t: f64,
    ) {
        let gpus = Arc::make_mut(&mut self.accounts.gpus);
        let Some(g) = gpus.get_mut(uuid) else {
            return;
        };
        let pending = std::mem::take(&mut g.pending_seconds);
        let pending_busy = std::mem::take(&mut g.pending_busy_seconds);
        let procs = Arc::make_mut(&mut self.accounts.processes);
        let loads = Arc::make_mut(&mut self.accounts.workloads);
        // A GPU that answers again after its totals were kept: drop those
        // of processes it no longer lists (a pid reused meanwhile too).
        if keep {
            self.kept.insert(Arc::clone(uuid));
        } else if self.kept.remove(uuid) {
            procs.retain(|(u, pid, start), _| u != uuid || listed(new, *pid, *start));
        }
        for p in old {
            let key = (Arc::clone(uuid), p.pid, p.ident.start_time);
            let bytes = p.used_bytes.unwrap_or(0) as f64 * pending;
            let still = listed(new, p.pid, p.ident.start_time);
            if still || keep {
                *procs.entry(key).or_insert(0.0) += bytes;
            } else {
                procs.remove(&key);
            }
            if let Some(w) = Workload::of(&p.ident)
                && let Some(a) = loads.get_mut(&(w, Arc::clone(uuid)))
            {
                a.used_byte_seconds += bytes;
                if p.readings.get::<Idle>().is_some() {
                    a.idle_byte_seconds += bytes;
                }
                if a.live {
                    // Once per workload per fold, however many processes.
                    a.busy_seconds += pending_busy;
                    a.live = false;
                }
                a.last_seen = t;
            }
        }
        for p in new {
            if let Some(w) = Workload::of(&p.ident) {
                let key = (w, Arc::clone(uuid));
                // A pod first seen by UID alone, named now: the same
                // account, under its names from now on.
                if let Some((old, _)) = loads.get_key_value(&key)
                    && !old.0.same_names(&key.0)
                    && !p.ident.pod.is_empty()
                    && let Some(a) = loads.remove(&key)
                {
                    loads.insert(key.clone(), a);
                }
                let a = loads.entry(key).or_insert_with(|| WorkloadAccount {
                    since: t,
                    ..WorkloadAccount::default()
                });
                a.live = true;
                a.last_seen = t;
            }
        }
    }

    /// Forget workloads and allocation rows gone for longer than the grace.
    fn expire(&mut self, t: f64) {
        let grace = WORKLOAD_GRACE_SECONDS as f64;
        if self
            .accounts
            .workloads
            .values()
            .any(|a| !a.live && t - a.last_seen > grace)
        {
            Arc::make_mut(&mut self.accounts.workloads)
                .retain(|_, a| a.live || t - a.last_seen <= grace);
        }
        if self
            .accounts
            .allocations
            .values()
            .any(|a| !a.present && t - a.last_seen > grace)
        {
            Arc::make_mut(&mut self.accounts.allocations)
                .retain(|_, a| a.present || t - a.last_seen <= grace);
        }
    }

    /// Allocation rows: the last sample's, over `dt`; then `s`'s rows and
    /// whether each GPU holds a process of its owner, recomputed only when
    /// the rows or a process list changed.
    fn allocations(&mut self, s: &Snapshot, dt: f64, t: f64, folded: bool) {
        self.accounts.allocation_pending_seconds += dt;
        let key = RowsKey {
            kube: s.pod_resources.as_ref().map(|p| Arc::clone(&p.allocations)),
            dra: s.pod_resources.as_ref().map(|p| Arc::clone(&p.dra)),
            slurm: s.job_mapping.as_ref().map(|j| Arc::clone(&j.allocations)),
        };
        let same = !folded
            && self.rows_key.as_ref().is_some_and(|k| {
                ptr_eq_opt(&k.kube, &key.kube)
                    && ptr_eq_opt(&k.dra, &key.dra)
                    && ptr_eq_opt(&k.slurm, &key.slurm)
            });
        if same {
            return;
        }
        let pending = std::mem::take(&mut self.accounts.allocation_pending_seconds);
        let rows = Arc::make_mut(&mut self.accounts.allocations);
        for a in rows.values_mut().filter(|a| a.present) {
            a.seconds += pending;
            if a.idle {
                a.idle_seconds += pending;
            }
            a.present = false;
        }
        let by_uuid: HashMap<&str, &[ProcessSample]> = s
            .devices
            .iter()
            .filter(|d| d.info.is_known())
            .map(|d| (d.info.uuid.as_str(), &d.processes[..]))
            .collect();
        // The processes on the allocated device itself: a MIG device's
        // are those of its instance, as `GpuAllocatedButIdle` matches them.
        let gpu_of = |device: &AllocatedDevice| -> Option<Vec<&ProcessSample>> {
            let uuid = gpu_uuid(s, device)?;
            let on = instance_of(s, device);
            let ps = by_uuid.get(uuid).copied()?;
            Some(ps.iter().filter(|p| on.holds(p)).collect())
        };
        let mut put = |row: AllocationRow, busy: bool| {
            let a = rows.entry(row).or_default();
            a.present = true;
            a.idle = !busy;
            a.last_seen = t;
        };
        if let Some(p) = &s.pod_resources {
            for a in p.allocations.iter() {
                let busy = gpu_of(&a.device).is_some_and(|ps| {
                    ps.iter()
                        .any(|p| *p.ident.namespace == *a.namespace && *p.ident.pod == *a.pod)
                });
                put(AllocationRow::Kube(a.clone()), busy);
            }
            for a in p.dra.iter() {
                let busy = gpu_of(&a.device).is_some_and(|ps| {
                    ps.iter().any(|p| match &a.pod_uid {
                        Some(uid) if !p.ident.pod_uid.is_empty() => *p.ident.pod_uid == **uid,
                        _ => *p.ident.namespace == *a.namespace && *p.ident.pod == *a.pod,
                    })
                });
                put(AllocationRow::Dra(a.clone()), busy);
            }
        }
        if let Some(j) = &s.job_mapping {
            for a in j.allocations.iter() {
                let busy = gpu_of(&a.device).is_some_and(|ps| {
                    ps.iter()
                        .any(|p| p.ident.slurm.as_ref().is_some_and(|sj| *sj.job == *a.job))
                });
                put(AllocationRow::Slurm(a.clone()), busy);
            }
        }
        self.rows_key = Some(key);
    }
}

/// Whether `list` (sorted by pid) holds the process `pid` started at
/// `start`.
fn listed(list: &[ProcessSample], pid: u32, start: Option<u64>) -> bool {
    list.binary_search_by_key(&pid, |n| n.pid)
        .is_ok_and(|i| list[i].ident.start_time == start)
}

fn ptr_eq_opt<T: ?Sized>(a: &Option<Arc<T>>, b: &Option<Arc<T>>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        _ => false,
    }
}

/// Which processes of its GPU an allocated device holds.
#[derive(Debug, Clone, Copy)]
enum On {
    /// The whole GPU (or a MIG device not seen yet: its parent stands in).
    Gpu,
    /// One MIG GPU instance, and one compute instance where the id says.
    Instance { gi: u32, ci: Option<u32> },
}

impl On {
    fn holds(self, p: &ProcessSample) -> bool {
        match self {
            On::Gpu => true,
            On::Instance { gi, ci } => {
                p.gpu_instance_id == Some(gi) && ci.is_none_or(|c| p.compute_instance_id == Some(c))
            }
        }
    }
}

/// The MIG instance an allocated device names, in this snapshot.
fn instance_of(s: &Snapshot, device: &AllocatedDevice) -> On {
    let by_mig_uuid = |mig_uuid: &str| {
        s.devices
            .iter()
            .flat_map(|d| d.mig.iter())
            .find(|m| m.info.mig_uuid == mig_uuid)
            .map_or(On::Gpu, |m| On::Instance {
                gi: m.info.gpu_instance_id,
                ci: Some(m.info.compute_instance_id),
            })
    };
    match device {
        AllocatedDevice::Mig { mig_uuid } | AllocatedDevice::MigOfParent { mig_uuid, .. } => {
            by_mig_uuid(mig_uuid)
        }
        AllocatedDevice::MigOfGpu {
            gpu_instance_id,
            compute_instance_id,
            ..
        } => On::Instance {
            gi: *gpu_instance_id,
            ci: Some(*compute_instance_id),
        },
        AllocatedDevice::MigOfGpuIndex {
            gpu_instance_id, ..
        } => On::Instance {
            gi: *gpu_instance_id,
            ci: None,
        },
        AllocatedDevice::Gpu { .. }
        | AllocatedDevice::GpuIndex { .. }
        | AllocatedDevice::Other { .. } => On::Gpu,
    }
}

/// The UUID of the GPU (a MIG device's parent) an allocated device is on,
/// in this snapshot.
fn gpu_uuid<'a>(s: &'a Snapshot, device: &'a AllocatedDevice) -> Option<&'a str> {
    let by_index = |gpu: &str| {
        s.devices
            .iter()
            .find(|d| d.info.is_known() && d.info.gpu == gpu)
            .map(|d| d.info.uuid.as_str())
    };
    match device {
        AllocatedDevice::Gpu { uuid } => Some(uuid),
        AllocatedDevice::MigOfParent { gpu_uuid, .. }
        | AllocatedDevice::MigOfGpu { gpu_uuid, .. } => Some(gpu_uuid),
        AllocatedDevice::Mig { mig_uuid } => s
            .devices
            .iter()
            .find(|d| d.mig.iter().any(|m| m.info.mig_uuid == *mig_uuid))
            .map(|d| d.info.uuid.as_str()),
        AllocatedDevice::GpuIndex { gpu } | AllocatedDevice::MigOfGpuIndex { gpu, .. } => {
            by_index(gpu)
        }
        AllocatedDevice::Other { .. } => None,
    }
}

/// A process's byte-seconds on GPU `uuid` as of the snapshot `a` came
/// with: its folded total plus its bytes over the list's pending seconds.
pub(crate) fn process_byte_seconds(a: &Accounts, uuid: &str, p: &ProcessSample) -> f64 {
    let pending = a.gpus.get(uuid).map_or(0.0, |g| g.pending_seconds);
    let folded = a
        .processes
        .get(&(Arc::from(uuid), p.pid, p.ident.start_time))
        .copied()
        .unwrap_or(0.0);
    folded + p.used_bytes.unwrap_or(0) as f64 * pending
}

/// Every workload's totals per GPU as of the snapshot (folded plus what
/// the current lists hold since): (used byte-seconds, busy seconds).
pub(crate) fn workload_totals(s: &Snapshot) -> BTreeMap<(Workload, Arc<str>), (f64, f64)> {
    workload_totals_of(&s.accounting, &s.devices)
}

/// [`workload_totals`] of the totals `a` with the process lists of
/// `devices`.
fn workload_totals_of(
    a: &Accounts,
    devices: &[DeviceSample],
) -> BTreeMap<(Workload, Arc<str>), (f64, f64)> {
    let mut out: BTreeMap<(Workload, Arc<str>), (f64, f64)> = a
        .workloads
        .iter()
        .map(|(k, w)| (k.clone(), (w.used_byte_seconds, w.busy_seconds)))
        .collect();
    for d in devices.iter().filter(|d| d.info.is_known()) {
        let Some((uuid, g)) = a.gpus.get_key_value(d.info.uuid.as_str()) else {
            continue;
        };
        let live: Vec<(Workload, u64)> = d
            .processes
            .iter()
            .filter_map(|p| Some((Workload::of(&p.ident)?, p.used_bytes.unwrap_or(0))))
            .collect();
        let mut charged: HashSet<&Workload> = HashSet::new();
        for (w, bytes) in &live {
            let e = out
                .entry((w.clone(), Arc::clone(uuid)))
                .or_insert((0.0, 0.0));
            e.0 += *bytes as f64 * g.pending_seconds;
            if charged.insert(w) {
                e.1 += g.pending_busy_seconds;
            }
        }
    }
    out
}

/// Each workload's idle byte-seconds on each GPU as of `s` (folded, plus
/// its idle processes' bytes over the GPU's pending seconds); only the
/// workloads that held memory idle at all.
pub(crate) fn workload_idle_totals(s: &Snapshot) -> BTreeMap<(Workload, Arc<str>), f64> {
    let a = &s.accounting;
    let mut out: BTreeMap<(Workload, Arc<str>), f64> = a
        .workloads
        .iter()
        .filter(|(_, w)| w.idle_byte_seconds > 0.0)
        .map(|(k, w)| (k.clone(), w.idle_byte_seconds))
        .collect();
    for d in s.devices.iter().filter(|d| d.info.is_known()) {
        let Some((uuid, g)) = a.gpus.get_key_value(d.info.uuid.as_str()) else {
            continue;
        };
        for p in d.processes.iter() {
            if p.readings.get::<Idle>().is_none() {
                continue;
            }
            if let Some(w) = Workload::of(&p.ident) {
                *out.entry((w, Arc::clone(uuid))).or_insert(0.0) +=
                    p.used_bytes.unwrap_or(0) as f64 * g.pending_seconds;
            }
        }
    }
    out
}

/// An allocation row's (seconds, idle seconds) as of the snapshot.
pub(crate) fn allocation_seconds(a: &Accounts, row: &AllocationRow) -> Option<(f64, f64)> {
    let r = a.allocations.get(row)?;
    let pending = if r.present {
        a.allocation_pending_seconds
    } else {
        0.0
    };
    Some((
        r.seconds + pending,
        r.idle_seconds + if r.idle { pending } else { 0.0 },
    ))
}

#[cfg(test)]
mod tests;
