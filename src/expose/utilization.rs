//! The `utilization` and `process_utilization` collectors' families: how
//! busy each GPU is (`nvidia-smi --query-gpu=utilization.gpu,...`), and each
//! process (`nvidia-smi pmon -s um`), as ratios 0–1.

use std::fmt;

use prometheus_client::encoding::DescriptorEncoder;

use super::encoder::{Ids, gauge, gpu_labels};
use super::process::process_labels;
use crate::gpu::readings::{ProcessUtilization, Utilization};
use crate::model::Snapshot;

type DevicePick = fn(&Utilization) -> Option<u32>;
type ProcessPick = fn(&ProcessUtilization) -> u32;

/// `gpu_*_utilization_ratio`; a family is absent when no GPU has its figure.
pub(super) fn devices(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    let families: [(&str, &str, DevicePick); 4] = [
        (
            "gpu_utilization_ratio",
            "Share of the last sampling period in which a kernel ran on the GPU (nvidia-smi utilization.gpu), 0-1.",
            |u| u.gpu,
        ),
        (
            "gpu_memory_utilization_ratio",
            "Share of the last sampling period in which device memory was read or written (nvidia-smi utilization.memory), 0-1.",
            |u| u.memory,
        ),
        (
            "gpu_encoder_utilization_ratio",
            "Video encoder busy, 0-1.",
            |u| u.encoder,
        ),
        (
            "gpu_decoder_utilization_ratio",
            "Video decoder busy, 0-1.",
            |u| u.decoder,
        ),
    ];
    for (name, help, pick) in families {
        let value = |d: &crate::model::DeviceSample| d.readings.get::<Utilization>().and_then(pick);
        if !s.devices.iter().any(|d| value(d).is_some()) {
            continue;
        }
        let mut m = gauge(enc, name, help)?;
        for d in &s.devices {
            if let Some(pct) = value(d) {
                m.encode_family(&gpu_labels(d))?
                    .encode_gauge(&(f64::from(pct) / 100.0))?;
            }
        }
    }
    Ok(())
}

/// `gpu_process_*_utilization_ratio`, with the labels of
/// `gpu_process_memory_used_bytes`.
pub(super) fn processes(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    let any = s.devices.iter().any(|d| {
        d.processes
            .iter()
            .any(|p| p.readings.get::<ProcessUtilization>().is_some())
    });
    if !any {
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
