//! Memory held by the dead and by nobody: `gpu_memory_unattributed_bytes`
//! (and its MIG twin), `gpu_memory_stale_bytes` per reason (0 when none)
//! and `gpu_process_stale_info` for each stale process, with the identity
//! it had when it was last seen alive. All from the last full sample (the
//! `Unattributed` and `Stale` readings the sampler leaves), so they change
//! with the process lists, never between them.

use std::fmt;

use prometheus_client::encoding::DescriptorEncoder;

use crate::encoding::{Ids, Labels, gauge, gpu_labels};
use crate::model::{DeviceSample, Idle, ProcessSample, Snapshot, Stale, StaleReason, Unattributed};

/// The bytes of `d`'s stale processes by reason, in the order of
/// [`StaleReason::ALL`]; `None` where the processes were not read in the
/// last full sample. The one sum behind the family, the JSON and the
/// recorder's columns.
pub(crate) fn stale_bytes(d: &DeviceSample) -> Option<[u64; StaleReason::ALL.len()]> {
    d.readings.get::<Unattributed>()?;
    let mut by_reason = [0u64; StaleReason::ALL.len()];
    for p in d.processes.iter() {
        if let Some(st) = p.readings.get::<Stale>() {
            by_reason[st.reason as usize] += p.used_bytes.unwrap_or(0);
        }
    }
    Some(by_reason)
}

/// Who holds the memory (as last seen alive): the labels of the stale and
/// idle per-process families.
fn holder<'a>(
    d: &'a DeviceSample,
    p: &'a ProcessSample,
    pid: &'a str,
) -> [(&'static str, &'a str); 9] {
    let i = &p.ident;
    [
        ("gpu", d.info.gpu.as_str()),
        ("uuid", d.info.uuid.as_str()),
        ("pid", pid),
        ("process", &*i.comm),
        ("user", &*i.user),
        ("namespace", &*i.namespace),
        ("pod", &*i.pod),
        ("container", &*i.container),
        ("slurm_job", i.slurm.as_ref().map_or("", |j| &*j.job)),
    ]
}

/// The families, in this order.
pub(super) fn families(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    unattributed(enc, s)?;
    stale_bytes_family(enc, s)?;
    stale_info(enc, s)?;
    idle(enc, s)
}

/// `gpu_memory_idle_held_bytes` per GPU whose processes were read, and
/// `gpu_process_idle_seconds` for each process idle at least
/// `processes.idle_after` (the body grows by the idle ones alone).
fn idle(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    let mut m = gauge(
        enc,
        "gpu_memory_idle_held_bytes",
        "Device memory held by processes that ran no kernel for at least processes.idle_after (30m), at the last full sample; 0 when none.",
    )?;
    for d in &s.devices {
        if d.readings.get::<Unattributed>().is_none() {
            continue;
        }
        let held: u64 = d
            .processes
            .iter()
            .filter(|p| p.readings.get::<Idle>().is_some())
            .filter_map(|p| p.used_bytes)
            .sum();
        m.encode_family(&gpu_labels(d))?.encode_gauge(&held)?;
    }
    let mut m = gauge(
        enc,
        "gpu_process_idle_seconds",
        "How long a process holding device memory has run no kernel (NVML's per-process utilisation samples, else the GPU's own utilisation), for processes idle at least processes.idle_after.",
    )?;
    let mut ids = Ids::default();
    for d in &s.devices {
        for p in d.processes.iter() {
            let Some(idle) = p.readings.get::<Idle>() else {
                continue;
            };
            let secs = s
                .taken_at
                .duration_since(idle.since)
                .map_or(0, |d| d.as_secs());
            m.encode_family(&Labels(holder(d, p, ids.pid(p))))?
                .encode_gauge(&secs)?;
        }
    }
    Ok(())
}

fn unattributed(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    let mut m = gauge(
        enc,
        "gpu_memory_unattributed_bytes",
        "Device memory used that no process NVML lists accounts for (used minus the listed processes' bytes, at least 0), at the last full sample; absent when a listed process has no figure.",
    )?;
    for d in &s.devices {
        if let Some(b) = d.readings.get::<Unattributed>().and_then(|u| u.bytes) {
            m.encode_family(&gpu_labels(d))?.encode_gauge(&b)?;
        }
    }
    let mut m = gauge(
        enc,
        "gpu_mig_memory_unattributed_bytes",
        "Memory used in one MIG instance that no process NVML lists on it accounts for, at the last full sample; absent when a listed process has no figure.",
    )?;
    for d in &s.devices {
        let Some(u) = d.readings.get::<Unattributed>() else {
            continue;
        };
        for (mig_uuid, bytes) in &u.mig {
            let (Some(b), Some(g)) = (bytes, d.mig.iter().find(|g| *g.info.mig_uuid == **mig_uuid))
            else {
                continue;
            };
            let gi = g.info.gpu_instance_id.to_string();
            let ci = g.info.compute_instance_id.to_string();
            let labels = Labels([
                ("gpu", d.info.gpu.as_str()),
                ("uuid", d.info.uuid.as_str()),
                ("gpu_instance_id", gi.as_str()),
                ("compute_instance_id", ci.as_str()),
            ]);
            m.encode_family(&labels)?.encode_gauge(b)?;
        }
    }
    Ok(())
}

fn stale_bytes_family(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    let mut m = gauge(
        enc,
        "gpu_memory_stale_bytes",
        "Device memory held by processes NVML still lists that are dead (exited, zombie, uninterruptible) or have lost their parent (reparented) or owner (owner_deleted), by reason; 0 when none.",
    )?;
    for d in &s.devices {
        // Only where the processes were read in the last full sample.
        let Some(by_reason) = stale_bytes(d) else {
            continue;
        };
        for (reason, bytes) in StaleReason::ALL.iter().zip(by_reason) {
            let labels = Labels([
                ("gpu", d.info.gpu.as_str()),
                ("uuid", d.info.uuid.as_str()),
                ("reason", reason.label()),
            ]);
            m.encode_family(&labels)?.encode_gauge(&bytes)?;
        }
    }
    Ok(())
}

fn stale_info(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    let mut m = gauge(
        enc,
        "gpu_process_stale_info",
        "A process NVML still lists that is stale, by reason (exited, zombie, uninterruptible, reparented, owner_deleted), with the identity it had when last seen alive; value is always 1.",
    )?;
    let mut ids = Ids::default();
    for d in &s.devices {
        for p in d.processes.iter() {
            let Some(st) = p.readings.get::<Stale>() else {
                continue;
            };
            let [a, b, c, e, f, g, h, i, j] = holder(d, p, ids.pid(p));
            let labels = Labels([a, b, c, e, f, g, h, i, j, ("reason", st.reason.label())]);
            m.encode_family(&labels)?.encode_gauge(&1u32)?;
        }
    }
    Ok(())
}
