//! The ledger's counters (`accounting`): memory-time per GPU, process and
//! workload, busy time per GPU and workload. Values are the totals as of
//! the snapshot, each process's and workload's pending part added here
//! (see `model::accounting`). The allocation rows' counters are written
//! beside `gpu_allocation_info`, with its labels (`allocation.rs`).

use std::fmt;

use prometheus_client::encoding::{DescriptorEncoder, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use crate::accounting::{process_byte_seconds, workload_totals};
use crate::encoding::{Ids, Labels, process_labels};
use crate::model::{Accounts, Snapshot};

fn counter<'a>(
    enc: &'a mut DescriptorEncoder,
    name: &'a str,
    help: &str,
) -> Result<MetricEncoder<'a>, fmt::Error> {
    enc.encode_descriptor(name, help, None, MetricType::Counter)
}

pub(super) fn value(m: MetricEncoder<'_>, v: f64) -> fmt::Result {
    let mut m = m;
    m.encode_counter::<NoLabelSet, _, u64>(&v, None)
}

/// Per GPU, per process, per workload; a family is absent while it has
/// no series (no GPU seen yet). The workloads' totals come from `whole`,
/// the snapshot before any series budget cut (`budget::cut`), so a cut
/// process still counts for its workload.
pub(super) fn families(
    enc: &mut DescriptorEncoder,
    s: &Snapshot,
    whole: &Snapshot,
) -> Result<(), fmt::Error> {
    let a = &s.accounting;
    if a.gpus.is_empty() {
        return Ok(());
    }
    {
        let mut m = counter(
            enc,
            "gpu_memory_used_byte_seconds",
            "Device memory used on the GPU integrated over time at every memory sample, in byte-seconds (divide by 3600 * 2^30 for GiB-hours); counts across GPU loss and NVML re-opens, resets only when the exporter restarts.",
        )?;
        for (uuid, g) in a.gpus.iter() {
            value(
                m.encode_family(&Labels([("gpu", &*g.gpu), ("uuid", uuid)]))?,
                g.used_byte_seconds,
            )?;
        }
    }
    if a.gpus.values().any(|g| g.busy_seconds.is_some()) {
        let mut m = counter(
            enc,
            "gpu_busy_seconds",
            "Seconds a kernel ran on the GPU: NVML's utilisation samples integrated (each sample's share times the time since the one before), else NVML's utilization.gpu held between full samples where the driver has no samples.",
        )?;
        for (uuid, g) in a.gpus.iter() {
            if let Some(b) = g.busy_seconds {
                value(
                    m.encode_family(&Labels([("gpu", &*g.gpu), ("uuid", uuid)]))?,
                    b,
                )?;
            }
        }
    }
    stale_byte_seconds(enc, a)?;
    // Per pid only: a sum of per-process counters over processes that come
    // and go is no counter; the workload's own counter follows. Off unless
    // asked for (`processes.byte_seconds`): the workload's counter is what
    // a fleet keeps.
    if s.series.mode == crate::model::SeriesMode::Pid
        && s.series.process_byte_seconds
        && s.devices.iter().any(|d| !d.processes.is_empty())
    {
        let mut m = counter(
            enc,
            "gpu_process_memory_used_byte_seconds",
            "Device memory used by one process on one GPU integrated over its life, in byte-seconds; the series goes away with the process (its workload's total keeps it).",
        )?;
        let mut ids = Ids::default();
        for d in &s.devices {
            for p in d.processes.iter() {
                let v = process_byte_seconds(a, &d.info.uuid, p);
                let (pid, gi, ci) = ids.all(p);
                value(m.encode_family(&process_labels(d, p, pid, gi, ci))?, v)?;
            }
        }
    }
    let loads = workload_totals(whole);
    if loads.is_empty() {
        return Ok(());
    }
    let gpu_of = |uuid: &str| a.gpus.get(uuid).map_or("", |g| &*g.gpu);
    for (name, help, busy) in [
        (
            "gpu_workload_memory_used_byte_seconds",
            "Device memory used on one GPU by one workload's processes (its pod, else its Slurm job, else its container, else its user), in byte-seconds; keeps counting across the workload's processes and goes away 300 s after its last one left the GPU.",
            false,
        ),
        (
            "gpu_workload_busy_seconds",
            "Busy seconds of one GPU (gpu_busy_seconds_total) while one workload held a process on it: a GPU shared by two workloads counts each of them in full.",
            true,
        ),
    ] {
        let mut m = counter(enc, name, help)?;
        for ((w, uuid), (bytes, secs)) in &loads {
            let mut labels: Vec<(&str, &str)> = vec![("gpu", gpu_of(uuid)), ("uuid", uuid)];
            labels.extend(w.labels());
            labels.retain(|(_, v)| !v.is_empty());
            value(m.encode_family(&labels)?, if busy { *secs } else { *bytes })?;
        }
    }
    idle_byte_seconds(enc, a, whole)
}

/// `gpu_memory_stale_byte_seconds_total`, per GPU whose processes were
/// read.
fn stale_byte_seconds(enc: &mut DescriptorEncoder, a: &Accounts) -> Result<(), fmt::Error> {
    if a.gpus.values().any(|g| g.stale_byte_seconds.is_some()) {
        let mut m = counter(
            enc,
            "gpu_memory_stale_byte_seconds",
            "Device memory held by stale processes (see gpu_memory_stale_bytes) integrated over time at every sample, by reason, in byte-seconds: memory the dead and the orphaned wasted; resets only when the exporter restarts.",
        )?;
        for (uuid, g) in a.gpus.iter() {
            let Some(by_reason) = g.stale_byte_seconds else {
                continue;
            };
            for (reason, v) in crate::model::StaleReason::ALL.iter().zip(by_reason) {
                let labels = Labels([("gpu", &*g.gpu), ("uuid", uuid), ("reason", reason.label())]);
                value(m.encode_family(&labels)?, v)?;
            }
        }
    }
    Ok(())
}

/// `gpu_workload_memory_idle_byte_seconds_total`, for the workloads that
/// held memory idle.
fn idle_byte_seconds(
    enc: &mut DescriptorEncoder,
    a: &Accounts,
    whole: &Snapshot,
) -> Result<(), fmt::Error> {
    let gpu_of = |uuid: &str| a.gpus.get(uuid).map_or("", |g| &*g.gpu);
    let idle = crate::accounting::workload_idle_totals(whole);
    if !idle.is_empty() {
        let mut m = counter(
            enc,
            "gpu_workload_memory_idle_byte_seconds",
            "Device memory one workload's processes held on one GPU while idle (no kernel for at least processes.idle_after), in byte-seconds; present once the workload held memory idle.",
        )?;
        for ((w, uuid), bytes) in &idle {
            let mut labels: Vec<(&str, &str)> = vec![("gpu", gpu_of(uuid)), ("uuid", uuid)];
            labels.extend(w.labels());
            labels.retain(|(_, v)| !v.is_empty());
            value(m.encode_family(&labels)?, *bytes)?;
        }
    }
    Ok(())
}
