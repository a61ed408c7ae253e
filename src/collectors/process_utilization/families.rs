//! The `process_utilization` collector's families: how busy each process
//! is (`nvidia-smi pmon -s um`), as ratios 0–1, with the labels of
//! `gpu_process_memory_used_bytes`.

use std::fmt;

use prometheus_client::encoding::DescriptorEncoder;

use super::ProcessUtilization;
use crate::encoding::{Ids, gauge, process_labels, workload_groups};
use crate::model::{SeriesMode, Snapshot};

type ProcessPick = fn(&ProcessUtilization) -> u32;

/// `gpu_process_*_utilization_ratio`, with the labels of
/// `gpu_process_memory_used_bytes`.
pub(crate) fn encode(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    let any = s.devices.iter().any(|d| {
        d.processes
            .iter()
            .any(|p| p.readings.get::<ProcessUtilization>().is_some())
    });
    if !any || s.series.mode == SeriesMode::Off {
        return Ok(());
    }
    let families: [(&str, &str, ProcessPick); 4] = [
        (
            "gpu_process_sm_utilization_ratio",
            "Share of the last sample period in which this process ran kernels on the GPU's SMs (nvidia-smi pmon sm), 0-1.",
            |u| u.sm,
        ),
        (
            "gpu_process_memory_utilization_ratio",
            "Share of the last sample period in which this process read or wrote device memory (nvidia-smi pmon mem), 0-1.",
            |u| u.memory,
        ),
        (
            "gpu_process_encoder_utilization_ratio",
            "This process's use of the video encoder, 0-1.",
            |u| u.encoder,
        ),
        (
            "gpu_process_decoder_utilization_ratio",
            "This process's use of the video decoder, 0-1.",
            |u| u.decoder,
        ),
    ];
    let mut ids = Ids::default();
    for (name, help, pick) in families {
        let mut m = gauge(enc, name, help)?;
        if s.series.mode == SeriesMode::Workload {
            // Per workload: its processes' shares summed.
            for d in &s.devices {
                for g in workload_groups(d, false) {
                    let sum = g
                        .members
                        .iter()
                        .filter_map(|p| p.readings.get::<ProcessUtilization>())
                        .map(pick)
                        .reduce(|a, b| a.saturating_add(b));
                    if let Some(v) = sum {
                        m.encode_family(&g.labels)?
                            .encode_gauge(&(f64::from(v) / 100.0))?;
                    }
                }
            }
            continue;
        }
        for d in &s.devices {
            for p in d.processes.iter() {
                if let Some(u) = p.readings.get::<ProcessUtilization>() {
                    let (pid, gi, ci) = ids.all(p);
                    m.encode_family(&process_labels(d, p, pid, gi, ci))?
                        .encode_gauge(&(f64::from(pick(u)) / 100.0))?;
                }
            }
        }
    }
    Ok(())
}
