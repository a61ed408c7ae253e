//! The `utilization` collector's families: how busy each GPU is
//! (`nvidia-smi --query-gpu=utilization.gpu,...`), as ratios 0–1.

use std::fmt;

use prometheus_client::encoding::DescriptorEncoder;

use super::Utilization;
use crate::encoding::{gauge, gpu_labels};
use crate::model::Snapshot;

type DevicePick = fn(&Utilization) -> Option<u32>;

/// `gpu_*_utilization_ratio`; a family is absent when no GPU has its figure.
pub(crate) fn encode(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
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
