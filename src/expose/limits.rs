//! Each workload's own limits beside its use: `gpu_workload_memory_limit_bytes`
//! (by `source` and `kind`), `gpu_workload_memory_used_bytes` and
//! `gpu_workload_memory_limit_in_seconds` for the workloads with a limit
//! (`crate::limits`' rows, joined when published), and
//! `gpumem_exporter_limit_sources`, which says which sources this node has.
//! A node without limited workloads serves the sources gauge alone.

use std::fmt;

use prometheus_client::encoding::DescriptorEncoder;

use crate::encoding::gauge;
use crate::model::{LimitSource, Snapshot, WorkloadLimits};

/// A row's labels: `gpu`, `uuid`, then the workload's (empty ones left
/// out), then `extra`.
fn labels<'a>(
    s: &'a Snapshot,
    w: &'a WorkloadLimits,
    extra: &[(&'static str, &'a str)],
) -> Vec<(&'static str, &'a str)> {
    let gpu = s.devices.get(w.gpu).map_or("", |d| d.info.gpu.as_str());
    let mut l: Vec<(&str, &str)> = vec![("gpu", gpu), ("uuid", &w.uuid)];
    l.extend(w.workload.labels());
    l.extend_from_slice(extra);
    l.retain(|(_, v)| !v.is_empty());
    l
}

/// The per-workload families; none while no workload has a limit.
pub(super) fn families(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    let rows = &s.limits.workloads;
    if rows.is_empty() {
        return Ok(());
    }
    let mut m = gauge(
        enc,
        "gpu_workload_memory_limit_bytes",
        "A workload's own device memory limit on one GPU (its pod, else its Slurm job, else its container), by source (driver, dmem, hami, dra, kai, torch) and kind (hard: allocations past it fail; soft: guaranteed before pressure; granted: a scheduler's unenforced share).",
    )?;
    for w in rows.iter() {
        for l in &w.limits {
            let extra = [("source", l.source.label()), ("kind", l.kind.label())];
            m.encode_family(&labels(s, w, &extra))?
                .encode_gauge(&l.bytes)?;
        }
    }
    let mut m = gauge(
        enc,
        "gpu_workload_memory_used_bytes",
        "Device memory used on one GPU by one workload's processes (those with a figure), at the last full sample; served for the workloads with a limit on that GPU (gpu_workload_memory_limit_bytes).",
    )?;
    for w in rows.iter() {
        m.encode_family(&labels(s, w, &[]))?.encode_gauge(&w.used)?;
    }
    let mut m = gauge(
        enc,
        "gpu_workload_memory_limit_in_seconds",
        "Seconds until a workload's used memory on one GPU reaches its lowest hard limit at the growth of the present regime of its own one-second history (the change-point method of gpu_memory_full_in_seconds); absent unless it grows.",
    )?;
    for w in rows.iter() {
        if let Some(f) = w.limit_in {
            m.encode_family(&labels(s, w, &[]))?
                .encode_gauge(&f.full_in_seconds)?;
        }
    }
    Ok(())
}

/// `gpumem_exporter_limit_sources`: 1 for each source found on this node,
/// 0 for one looked for and absent; a source not looked for (its input
/// off) has no series.
pub(super) fn sources(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    let known: Vec<(LimitSource, bool)> = LimitSource::ALL
        .iter()
        .filter_map(|&src| Some((src, s.limits.sources.get(src)?)))
        .collect();
    if known.is_empty() {
        return Ok(());
    }
    let mut m = gauge(
        enc,
        "gpumem_exporter_limit_sources",
        "Whether each source of per-workload memory limits was found on this node (1) or looked for and absent (0), e.g. driver 0 on drivers without nvmlDeviceGetMemoryLimits_v1; absent where that input is off.",
    )?;
    for (src, present) in known {
        m.encode_family(&[("source", src.label())])?
            .encode_gauge(&u64::from(present))?;
    }
    Ok(())
}
