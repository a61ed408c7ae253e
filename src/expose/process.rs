//! Per-process families: memory used, its peak, the "no figure" marker,
//! the `pid="other"` rollup count and `gpu_process_info`. In
//! `processes.series: workload` memory used and the marker are written per
//! workload (their processes' figures summed, the rollup in
//! `workload="other"`), the peak and the info series not at all (a sum of
//! peaks is no peak; the workload's labels are on its value series); in
//! `off` none of them.

use std::fmt;

use prometheus_client::encoding::DescriptorEncoder;

use crate::encoding::{Ids, Labels, gauge, gpu_labels, process_labels, workload_groups};
use crate::model::{ContainerInfo, OtherProcesses, ProcessSample, SeriesMode, Snapshot};

/// One gauge family with a series per (GPU, workload) for which `value`
/// gives a figure for one of its processes (summed), plus the rollup's
/// figure (`other`) in the unknown workload's series.
fn workload_family(
    enc: &mut DescriptorEncoder,
    s: &Snapshot,
    (name, help): (&str, &str),
    value: fn(&ProcessSample) -> Option<u64>,
    other: fn(&OtherProcesses) -> Option<u64>,
) -> Result<(), fmt::Error> {
    let mut m = gauge(enc, name, help)?;
    for d in &s.devices {
        for g in workload_groups(d, true) {
            let mut sum = g
                .members
                .iter()
                .filter_map(|p| value(p))
                .reduce(|a, b| a + b);
            if g.other
                && g.labels.iter().all(|(k, _)| *k != "gpu_instance_id")
                && let Some(o) = d.other.as_ref().and_then(other)
            {
                sum = Some(sum.unwrap_or(0) + o);
            }
            if let Some(v) = sum {
                m.encode_family(&g.labels)?.encode_gauge(&v)?;
            }
        }
    }
    Ok(())
}

/// One gauge family with a series per (GPU, process) for which `value`
/// gives a figure, plus the `pid="other"` rollup when `other` gives one.
fn process_family(
    enc: &mut DescriptorEncoder,
    s: &Snapshot,
    name: &str,
    help: &str,
    value: fn(&ProcessSample) -> Option<u64>,
    other: fn(&OtherProcesses) -> Option<u64>,
) -> Result<(), fmt::Error> {
    let mut m = gauge(enc, name, help)?;
    let empty = ProcessSample {
        pid: 0,
        used_bytes: None,
        ident: Default::default(),
        gpu_instance_id: None,
        compute_instance_id: None,
        used_peak_bytes: None,
        torch: None,
        readings: Default::default(),
    };
    let mut ids = Ids::default();
    for d in &s.devices {
        for p in d.processes.iter() {
            if let Some(v) = value(p) {
                let (pid, gi, ci) = ids.all(p);
                let labels = process_labels(d, p, pid, gi, ci);
                m.encode_family(&labels)?.encode_gauge(&v)?;
            }
        }
        if let Some(v) = d.other.as_ref().and_then(other) {
            let labels = process_labels(d, &empty, "other", "", "");
            m.encode_family(&labels)?.encode_gauge(&v)?;
        }
    }
    Ok(())
}

const USED: (&str, &str) = (
    "gpu_process_memory_used_bytes",
    "Device memory used by one process on one GPU, in bytes, as NVML reports it. pid=\"other\" sums the processes left out by processes.min_bytes / processes.top_n.",
);

const UNAVAILABLE: (&str, &str) = (
    "gpu_process_memory_unavailable",
    "1 for a process NVML lists on this GPU without a memory figure (NVML_VALUE_NOT_AVAILABLE); such a process has no gpu_process_memory_used_bytes series.",
);

/// `gpu_process_memory_used_bytes`, `…_used_peak_bytes` and
/// `gpu_process_memory_unavailable`.
pub(super) fn memory(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    match s.series.mode {
        SeriesMode::Pid => {}
        SeriesMode::Off => return Ok(()),
        SeriesMode::Workload => {
            workload_family(enc, s, USED, |p| p.used_bytes, |o| Some(o.used_bytes))?;
            return workload_family(
                enc,
                s,
                UNAVAILABLE,
                |p| p.used_bytes.is_none().then_some(1),
                |_| None,
            );
        }
    }
    process_family(
        enc,
        s,
        USED.0,
        USED.1,
        |p| p.used_bytes,
        |o| Some(o.used_bytes),
    )?;
    process_family(
        enc,
        s,
        "gpu_process_memory_used_peak_bytes",
        "Largest gpu_process_memory_used_bytes of this live process over the last peak_window (full samples).",
        |p| p.used_peak_bytes,
        |_| None,
    )?;
    process_family(
        enc,
        s,
        UNAVAILABLE.0,
        UNAVAILABLE.1,
        |p| p.used_bytes.is_none().then_some(1),
        |_| None,
    )?;
    Ok(())
}

/// `gpu_processes_other` and `gpu_process_info`.
pub(super) fn rollup_and_identity(
    enc: &mut DescriptorEncoder,
    s: &Snapshot,
) -> Result<(), fmt::Error> {
    if s.series.mode == SeriesMode::Off {
        return Ok(());
    }
    let mut m = gauge(
        enc,
        "gpu_processes_other",
        "Number of processes summed into the pid=\"other\" series of this GPU.",
    )?;
    for d in &s.devices {
        let mut count = d.other.map_or(0, |o| o.count);
        if s.series.mode == SeriesMode::Workload {
            count += d
                .processes
                .iter()
                .filter(|p| crate::model::Workload::of(&p.ident).is_none())
                .count() as u64;
        }
        if d.other.is_some() || count > 0 {
            m.encode_family(&gpu_labels(d))?.encode_gauge(&count)?;
        }
    }
    if s.series.mode != SeriesMode::Pid {
        return Ok(());
    }

    let mut m = gauge(
        enc,
        "gpu_process_info",
        "Identity of a process on a GPU; value is always 1. user from the host's passwd (or the uid), container_id and pod_uid from its cgroup; container_name, container_image, compose_project and compose_service from the container engine's API (containers.engine_socket) when Kubernetes does not know the process.",
    )?;
    let mut ids = Ids::default();
    for d in &s.devices {
        for p in d.processes.iter() {
            let pid = ids.pid(p);
            let i = &p.ident;
            let slurm = i.slurm.as_ref();
            let engine = i.engine.as_deref();
            let from_engine = |f: fn(&ContainerInfo) -> &str| engine.map(f).unwrap_or("");
            let labels = Labels([
                ("gpu", d.info.gpu.as_str()),
                ("uuid", d.info.uuid.as_str()),
                ("pid", pid),
                ("process", &*i.comm),
                ("user", &*i.user),
                ("container_id", &*i.container_id),
                ("container_name", from_engine(|c| &c.name)),
                ("container_image", from_engine(|c| &c.image)),
                ("compose_project", from_engine(|c| &c.compose_project)),
                ("compose_service", from_engine(|c| &c.compose_service)),
                ("pod_uid", &*i.pod_uid),
                ("slurm_job", slurm.map_or("", |j| &*j.job)),
                ("slurm_step", slurm.map_or("", |j| &*j.step)),
                ("slurm_uid", slurm.map_or("", |j| &*j.uid)),
                ("cmdline", i.cmdline.as_deref().unwrap_or("")),
            ]);
            m.encode_family(&labels)?.encode_gauge(&1u32)?;
        }
    }
    Ok(())
}
