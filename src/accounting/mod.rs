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
//! the per-workload totals are folded only when a list changes (a full
//! sample), from the list's processes summed per workload once
//! (`model::LiveWorkload`); the per-process totals only while they are
//! asked for (`processes.byte_seconds`, or the recorder), see
//! `model::accounting`. Hand-written: a few sums over the snapshot,
//! nothing a library would do for us.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use crate::model::{
    Accounts, AllocatedDevice, AllocationRow, Busy, BusySamples, DeviceInfo, DeviceSample,
    GpuAccount, Idle, LiveWorkload, ProcessSample, Snapshot, Stale, Unattributed,
    WORKLOAD_GRACE_SECONDS, Workload, WorkloadAccount,
};

mod ranking;

pub(crate) use ranking::{Ranked, Ranking, rank};

/// What one GPU showed at the last sample: held until this one.
#[derive(Debug)]
struct Held {
    /// The GPU's UUID (its totals' key).
    uuid: Arc<str>,
    /// The identity it was last taken in with: while a sample carries the
    /// very same one, its UUID and index are those of its totals, which
    /// a memory-only sample then knows without comparing strings.
    info: Arc<DeviceInfo>,
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
    /// In the sample being taken in (the GPUs not in it leave).
    seen: bool,
}

/// What the ledger reads of one GPU's sample beside its process list.
struct Figures {
    used: Option<u64>,
    /// The busy fraction from the held percentage: only where NVML has no
    /// utilisation samples (`sampled` is `None`).
    busy: Option<f64>,
    sampled: Option<BusySamples>,
}

impl Figures {
    fn of(d: &DeviceSample) -> Self {
        let reading = d.readings.get::<Busy>();
        let sampled = reading.and_then(|b| b.samples);
        // NVML's samples where it has them; else the gauge, held.
        let busy = match sampled {
            Some(_) => None,
            None => reading
                .and_then(|b| b.percent)
                .map(|pct| f64::from(pct.min(100)) / 100.0),
        };
        Self {
            used: d.memory.map(|m| m.used),
            busy,
            sampled,
        }
    }
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

/// `list`'s processes summed per workload, in workload order (processes
/// of no known workload left out). A pod's entry carries its names where
/// any of its processes has them.
fn live_workloads(list: &[ProcessSample]) -> Vec<LiveWorkload> {
    let mut out: Vec<LiveWorkload> = Vec::new();
    let mut at: HashMap<Workload, usize> = HashMap::new();
    for p in list {
        let Some(w) = Workload::of(&p.ident) else {
            continue;
        };
        let bytes = p.used_bytes.unwrap_or(0);
        let idle = p.readings.get::<Idle>().is_some();
        // A workload's processes are often next to each other (by pid).
        let i = match out.last() {
            Some(last) if last.workload == w => Some(out.len() - 1),
            _ => at.get(&w).copied(),
        };
        match i.and_then(|i| out.get_mut(i)) {
            Some(e) => {
                e.bytes += bytes;
                if idle {
                    e.idle_bytes += bytes;
                    e.idle = true;
                }
                if !e.workload.same_names(&w) && !p.ident.pod.is_empty() {
                    e.workload = w;
                }
            }
            None => {
                at.insert(w.clone(), out.len());
                out.push(LiveWorkload {
                    workload: w,
                    bytes,
                    idle_bytes: if idle { bytes } else { 0 },
                    idle,
                });
            }
        }
    }
    out.sort_by(|a, b| a.workload.cmp(&b.workload));
    out
}

/// The integrator. Only `Shared::publish` calls it (one writer).
#[derive(Debug, Default)]
pub struct Ledger {
    start: Option<Instant>,
    last: Option<Instant>,
    accounts: Accounts,
    /// Per GPU of the last sample, in its order.
    held: Vec<Held>,
    /// The allocation rows of the last sample: which GPU each is on.
    rows_key: Option<RowsKey>,
    /// The workload ranking's minutes.
    ranking: Ranking,
    /// GPUs whose processes' totals were kept while they were down or
    /// gone: at their next answer, the totals of processes they no longer
    /// list go.
    kept: HashSet<Arc<str>>,
    /// Keep each process's total whatever the snapshots' series policy
    /// says (the recorder's CSV and summary read them).
    processes: bool,
    /// The per-GPU totals two samples back, which the last snapshot but
    /// one shared: once that snapshot is gone, the next sample writes
    /// its totals into this map instead of cloning a new one (a BTreeMap
    /// node allocated and freed at every sample, ten a second).
    spare: Option<Arc<BTreeMap<Arc<str>, GpuAccount>>>,
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

    /// Keep every process's total (`process_byte_seconds`) from now on,
    /// not only while a snapshot asks for the per-process counter
    /// (`processes.byte_seconds`): the recorder's CSV and summary read
    /// them.
    pub(crate) fn keep_processes(&mut self, keep: bool) {
        self.processes = keep;
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
        let per_process = self.processes || s.series.process_byte_seconds;
        if !per_process && !self.accounts.processes.is_empty() {
            // Not asked for any more: each starts from 0 when it is again.
            self.accounts.processes = Arc::default();
            self.kept.clear();
        }
        let folded = self.take_in(s, t, per_process);
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
        let gpus = Self::gpus_mut(&mut self.accounts.gpus, &mut self.spare);
        for h in &self.held {
            // Its key is most often the very same Arc: no string compared.
            let g = match gpus.iter_mut().find(|(k, _)| Arc::ptr_eq(k, &h.uuid)) {
                Some((_, g)) => g,
                None => match gpus.get_mut(&h.uuid) {
                    Some(g) => g,
                    None => continue,
                },
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

    /// The per-GPU totals, to change: the last snapshot shares them, so
    /// they are copied into the spare map when no snapshot holds that
    /// one any more and it has the same GPUs, else cloned.
    fn gpus_mut<'a>(
        gpus: &'a mut Arc<BTreeMap<Arc<str>, GpuAccount>>,
        spare: &mut Option<Arc<BTreeMap<Arc<str>, GpuAccount>>>,
    ) -> &'a mut BTreeMap<Arc<str>, GpuAccount> {
        if Arc::get_mut(gpus).is_none() {
            let now = &*gpus;
            let reused = spare.take().and_then(|mut spare| {
                let into = Arc::get_mut(&mut spare)?;
                let same_gpus = into.len() == now.len()
                    && into.keys().zip(now.keys()).all(|(a, b)| Arc::ptr_eq(a, b));
                if !same_gpus {
                    return None;
                }
                for (to, from) in into.values_mut().zip(now.values()) {
                    to.copy_from(from);
                }
                Some(spare)
            });
            let fresh = reused.unwrap_or_else(|| Arc::new((**now).clone()));
            *spare = Some(std::mem::replace(gpus, fresh));
        }
        Arc::make_mut(gpus)
    }

    /// Hold `s`'s figures from now on; fold the process lists that
    /// changed. Returns whether any was folded. A memory-only sample (the
    /// same GPUs with the very same lists) only replaces the used bytes.
    fn take_in(&mut self, s: &Snapshot, t: f64, per_process: bool) -> bool {
        for h in &mut self.held {
            h.seen = false;
        }
        let mut folded = false;
        for (n, d) in s.devices.iter().filter(|d| d.info.is_known()).enumerate() {
            let uuid = d.info.uuid.as_str();
            // The same place as last time, unless the GPUs changed.
            let at = match self.held.get(n) {
                Some(h) if Arc::ptr_eq(&h.info, &d.info) || *h.uuid == *uuid => Some(n),
                _ => self.held.iter().position(|h| *h.uuid == *uuid),
            };
            let figures = Figures::of(d);
            if !self.take_in_unchanged(at, d, &figures) {
                folded |= self.take_in_changed(n, at, d, &figures, t, per_process);
            }
        }
        // A GPU that left the snapshot (re-enumerated, not yet identified)
        // holds nothing from now on; its totals stay.
        while let Some(i) = self.held.iter().position(|h| !h.seen) {
            let h = self.held.remove(i);
            self.fold(&h.uuid, &h.processes, &[], true, t, per_process);
            folded = true;
        }
        if folded {
            self.expire(t);
        }
        folded
    }

    /// A GPU held at `at` whose sample `d` has the very same process list,
    /// the same busy figure and no new utilisation samples (a memory-only
    /// sample): take in its used bytes and return true. Otherwise nothing
    /// changes and it returns false.
    fn take_in_unchanged(&mut self, at: Option<usize>, d: &DeviceSample, f: &Figures) -> bool {
        let Some(h) = at.and_then(|i| self.held.get_mut(i)) else {
            return false;
        };
        let unchanged = Arc::ptr_eq(&h.processes, &d.processes)
            && h.busy == f.busy
            && f.sampled.is_none_or(|b| h.samples_read == Some(b.read))
            && (Arc::ptr_eq(&h.info, &d.info)
                || self
                    .accounts
                    .gpus
                    .get(d.info.uuid.as_str())
                    .is_some_and(|g| *g.gpu == *d.info.gpu));
        if !unchanged {
            return false;
        }
        if !Arc::ptr_eq(&h.info, &d.info) {
            h.info = Arc::clone(&d.info);
        }
        h.used = f.used;
        h.seen = true;
        true
    }

    /// Take in GPU `d` (the `n`th known GPU of the sample, held at `at` if
    /// it was before) whose list, busy figure or identity changed: add its
    /// new utilisation samples, fold its list if that changed, and hold it
    /// at `n`. Returns whether a list was folded.
    fn take_in_changed(
        &mut self,
        n: usize,
        at: Option<usize>,
        d: &DeviceSample,
        f: &Figures,
        t: f64,
        per_process: bool,
    ) -> bool {
        let key: Arc<str> = match at.and_then(|i| self.held.get(i)) {
            Some(h) => Arc::clone(&h.uuid),
            None => Arc::from(d.info.uuid.as_str()),
        };
        let prev_read = at
            .and_then(|i| self.held.get(i))
            .and_then(|h| h.samples_read);
        let gpus = Arc::make_mut(&mut self.accounts.gpus);
        let g = gpus.entry(Arc::clone(&key)).or_default();
        if *g.gpu != *d.info.gpu {
            g.gpu = Arc::from(d.info.gpu.as_str());
        }
        if (f.busy.is_some() || f.sampled.is_some()) && g.busy_seconds.is_none() {
            g.busy_seconds = Some(0.0);
        }
        let mut samples_read = prev_read;
        if let Some(b) = f.sampled
            && prev_read != Some(b.read)
        {
            // Before the fold: the samples are of the list until now.
            let secs = b.seconds();
            *g.busy_seconds.get_or_insert(0.0) += secs;
            g.pending_busy_seconds += secs;
            samples_read = Some(b.read);
        }
        let old = at.map(|i| self.held.remove(i));
        let same = old
            .as_ref()
            .is_some_and(|h| Arc::ptr_eq(&h.processes, &d.processes));
        let stale = match &old {
            Some(h) if same => h.stale,
            _ => stale_bytes(d),
        };
        if !same {
            // A GPU that does not answer lists no process: keep its
            // processes' totals until it answers without them.
            let keep = d.memory.is_none();
            let old = old.as_ref().map(|h| Arc::clone(&h.processes));
            self.fold(
                &key,
                old.as_deref().unwrap_or(&[]),
                &d.processes,
                keep,
                t,
                per_process,
            );
        }
        let h = Held {
            uuid: key,
            info: Arc::clone(&d.info),
            used: f.used,
            busy: f.busy,
            samples_read,
            processes: Arc::clone(&d.processes),
            stale,
            seen: true,
        };
        // Back in the place it has in this sample.
        let i = n.min(self.held.len());
        self.held.insert(i, h);
        !same
    }

    /// Move GPU `uuid`'s pending seconds into the totals of the processes
    /// (when kept: `per_process`) and workloads of `old`, its list until
    /// now, and start `new`. A process of `old` not in `new` loses its
    /// total unless `keep` (the GPU is down or gone: it may list the
    /// process again).
    fn fold(
        &mut self,
        uuid: &Arc<str>,
        old: &[ProcessSample],
        new: &[ProcessSample],
        keep: bool,
        t: f64,
        per_process: bool,
    ) {
        let gpus = Arc::make_mut(&mut self.accounts.gpus);
        let Some(g) = gpus.get_mut(uuid) else {
            return;
        };
        let pending = std::mem::take(&mut g.pending_seconds);
        let pending_busy = std::mem::take(&mut g.pending_busy_seconds);
        let live = Arc::from(live_workloads(new));
        let was = std::mem::replace(&mut g.live, live);
        if per_process {
            let procs = Arc::make_mut(&mut self.accounts.processes);
            // A GPU that answers again after its totals were kept: drop
            // those of processes it no longer lists (a pid reused
            // meanwhile too).
            if keep {
                self.kept.insert(Arc::clone(uuid));
            } else if self.kept.remove(uuid) {
                procs.retain(|(u, pid, start), _| u != uuid || listed(new, *pid, *start));
            }
            for p in old {
                let key = (Arc::clone(uuid), p.pid, p.ident.start_time);
                let still = listed(new, p.pid, p.ident.start_time);
                if still || keep {
                    *procs.entry(key).or_insert(0.0) += p.used_bytes.unwrap_or(0) as f64 * pending;
                } else {
                    procs.remove(&key);
                }
            }
        }
        let loads = Arc::make_mut(&mut self.accounts.workloads);
        for w in was.iter() {
            if let Some(a) = loads.get_mut(&(w.workload.clone(), Arc::clone(uuid))) {
                a.used_byte_seconds += w.bytes as f64 * pending;
                a.idle_byte_seconds += w.idle_bytes as f64 * pending;
                if a.live {
                    // Once per workload per fold, however many processes.
                    a.busy_seconds += pending_busy;
                    a.live = false;
                }
                a.last_seen = t;
            }
        }
        let Some(g) = self.accounts.gpus.get(uuid) else {
            return;
        };
        for w in g.live.iter() {
            let key = (w.workload.clone(), Arc::clone(uuid));
            // A pod first seen by UID alone, named now: the same account,
            // under its names from now on.
            if let Some((old, _)) = loads.get_key_value(&key)
                && !old.0.same_names(&key.0)
                && matches!(&w.workload, Workload::Pod { pod, .. } if !pod.is_empty())
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

/// [`workload_totals`] of the totals `a` with the GPUs of `devices`
/// (their current lists' workloads, [`crate::model::GpuAccount::live`]).
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
        // One entry per workload: its busy seconds are charged once.
        for w in g.live.iter() {
            let e = out
                .entry((w.workload.clone(), Arc::clone(uuid)))
                .or_insert((0.0, 0.0));
            e.0 += w.bytes as f64 * g.pending_seconds;
            e.1 += g.pending_busy_seconds;
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
        for w in g.live.iter().filter(|w| w.idle) {
            *out.entry((w.workload.clone(), Arc::clone(uuid)))
                .or_insert(0.0) += w.idle_bytes as f64 * g.pending_seconds;
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
