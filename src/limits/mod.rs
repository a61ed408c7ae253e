//! Each workload's own limits on each GPU, beside its use: the sources'
//! limits (copied into the snapshot by the sampler and `publish`) joined
//! to the workloads the snapshot's processes belong to, keyed as the
//! ledger keys them (a pod, else a Slurm job, else a container; a user is
//! no workload with a limit of its own).
//!
//! - **Cgroup-keyed** (driver, dmem): a workload is limited by a source
//!   only when every one of its processes on that GPU is (a partial limit
//!   is not the workload's); processes under one directory share its
//!   limit, under several (one limit per container) the workload's is
//!   their sum.
//! - **Pod-keyed** (hami, dra, kai): by the pod's UID alone, so an
//!   annotation or claim can only ever speak of its own pod; a limit that
//!   names no GPU applies to each GPU the pod uses, a fraction of that
//!   GPU's total; one that names a MIG device applies on its GPU.
//! - **torch**: a process's own `set_per_process_memory_fraction` limit;
//!   the workload's is their sum when each of its processes has one.
//!
//! The forecast of `limit_in` is `history`'s (the workload's own
//! one-second history); this module is pure and reads only `model`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::model::{
    Amount, CgroupLimit, DeviceSample, Limit, LimitKind, LimitSource, PodLimit, ProcessSample,
    Snapshot, Workload, WorkloadLimits,
};

/// The workloads of `s` with at least one limit, by GPU then workload.
pub(crate) fn assemble(s: &Snapshot) -> Vec<WorkloadLimits> {
    let limits = &s.limits;
    if limits.pods.is_empty() && limits.cgroups.is_empty() && !any_torch_limit(s) {
        return Vec::new();
    }
    let mut cgroups: HashMap<(&str, &str), Vec<&CgroupLimit>> = HashMap::new();
    for c in limits.cgroups.iter() {
        cgroups.entry((&c.cgroup, &c.uuid)).or_default().push(c);
    }
    let mut pods: HashMap<&str, Vec<&PodLimit>> = HashMap::new();
    for p in limits.pods.iter() {
        pods.entry(&p.pod_uid).or_default().push(p);
    }
    let mut out = Vec::new();
    for (gpu, d) in s.devices.iter().enumerate() {
        let Some(memory) = d.memory else { continue };
        if !d.info.is_known() {
            continue;
        }
        let mut by_workload: BTreeMap<Workload, Vec<&ProcessSample>> = BTreeMap::new();
        for p in d.processes.iter() {
            match Workload::of(&p.ident) {
                Some(Workload::User { .. }) | None => {}
                Some(w) => by_workload.entry(w).or_default().push(p),
            }
        }
        for (workload, procs) in by_workload {
            let mut found: BTreeMap<(LimitSource, LimitKind), u64> = BTreeMap::new();
            from_cgroups(d, &procs, &cgroups, &mut found);
            if let Workload::Pod { pod_uid, .. } = &workload
                && let Some(mine) = pods.get(pod_uid.as_ref())
            {
                from_pod(d, memory.total, mine, &mut found);
            }
            from_torch(&procs, &mut found);
            if found.is_empty() {
                continue;
            }
            out.push(WorkloadLimits {
                used: procs.iter().filter_map(|p| p.used_bytes).sum(),
                workload,
                gpu,
                uuid: Arc::from(d.info.uuid.as_str()),
                limits: found
                    .into_iter()
                    .map(|((source, kind), bytes)| Limit {
                        source,
                        kind,
                        bytes,
                    })
                    .collect(),
                limit_in: None,
            });
        }
    }
    out
}

fn any_torch_limit(s: &Snapshot) -> bool {
    s.devices
        .iter()
        .flat_map(|d| d.processes.iter())
        .any(|p| p.torch.as_ref().is_some_and(|t| t.limit.is_some()))
}

/// Driver and dmem: each (source, kind) that limits every process, summed
/// over the distinct directories it is set on.
fn from_cgroups(
    d: &DeviceSample,
    procs: &[&ProcessSample],
    cgroups: &HashMap<(&str, &str), Vec<&CgroupLimit>>,
    found: &mut BTreeMap<(LimitSource, LimitKind), u64>,
) {
    let uuid = d.info.uuid.as_str();
    // Per (source, kind): how many processes it limits, and the distinct
    // (directory, bytes) it is set on.
    type Seen<'a> = (usize, BTreeSet<(&'a str, u64)>);
    let mut per: BTreeMap<(LimitSource, LimitKind), Seen<'_>> = BTreeMap::new();
    for p in procs {
        let Some(cg) = p.ident.cgroup.as_deref() else {
            return;
        };
        for c in cgroups.get(&(cg, uuid)).into_iter().flatten() {
            let e = per.entry((c.source, c.kind)).or_default();
            e.0 += 1;
            e.1.insert((&c.at, c.bytes));
        }
    }
    for (key, (count, dirs)) in per {
        if count == procs.len() {
            found.insert(key, dirs.iter().map(|(_, b)| b).sum());
        }
    }
}

/// hami, dra, kai: the pod's own limits on this GPU (or one of its MIG
/// devices), or naming no GPU.
fn from_pod(
    d: &DeviceSample,
    total: u64,
    mine: &[&PodLimit],
    found: &mut BTreeMap<(LimitSource, LimitKind), u64>,
) {
    let on_this_gpu =
        |uuid: &str| uuid == d.info.uuid || d.mig.iter().any(|m| m.info.mig_uuid == uuid);
    for p in mine {
        if p.uuid.as_deref().is_some_and(|u| !on_this_gpu(u)) {
            continue;
        }
        let bytes = match p.amount {
            Amount::Bytes(b) => b,
            Amount::Fraction(f) if f.is_finite() && f > 0.0 => {
                (total as f64 * f.min(1.0)).round() as u64
            }
            Amount::Fraction(_) => continue,
        };
        let e = found.entry((p.source, p.kind)).or_insert(0);
        *e = e.saturating_add(bytes);
    }
}

/// torch: the sum of the processes' own limits, when each has one.
fn from_torch(procs: &[&ProcessSample], found: &mut BTreeMap<(LimitSource, LimitKind), u64>) {
    let limits: Option<Vec<u64>> = procs
        .iter()
        .map(|p| p.torch.as_ref().and_then(|t| t.limit))
        .collect();
    if let Some(l) = limits.filter(|l| !l.is_empty()) {
        found.insert((LimitSource::Torch, LimitKind::Hard), l.iter().sum());
    }
}

#[cfg(test)]
mod tests;
