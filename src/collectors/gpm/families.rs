//! The `gpm` collector's families: how busy each GPU (and MIG GPU
//! instance) is inside, beside how full — GPM ratios 0–1 (NVML's percent
//! / 100) and throughputs in bytes per second (NVML's MiB/s × 2^20),
//! averaged between two full samples. `gpu_gpm_*` per GPU,
//! `gpu_mig_gpm_*` per MIG GPU instance (labels gpu, uuid,
//! gpu_instance_id), so summing a family never adds an instance to its
//! GPU. A family is absent when no GPU has its figure. Last, the stale
//! answers not served (`gpumem_exporter_gpm_stale_readings_total`, per GPU
//! with GPM).

use std::fmt;

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use super::{Gpm, GpmMetric, GpmReading, GpmUnit};
use crate::encoding::{Labels, gauge, gpu_labels};
use crate::model::Snapshot;

/// A metric's family name (after `gpu_gpm_` / `gpu_mig_gpm_`) and HELP.
pub(super) fn family(m: GpmMetric) -> (&'static str, &'static str) {
    match m {
        GpmMetric::SmActivity => (
            "sm_activity_ratio",
            "GPM: share of time an SM had at least one warp assigned, averaged over SMs, 0-1 (NVML_GPM_METRIC_SM_UTIL).",
        ),
        GpmMetric::SmOccupancy => (
            "sm_occupancy_ratio",
            "GPM: resident warps over the SMs' maximum, averaged over SMs, 0-1 (NVML_GPM_METRIC_SM_OCCUPANCY).",
        ),
        GpmMetric::TensorActivity => (
            "tensor_activity_ratio",
            "GPM: share of time the tensor cores were busy (any type), 0-1 (NVML_GPM_METRIC_ANY_TENSOR_UTIL).",
        ),
        GpmMetric::DramBandwidth => (
            "dram_bandwidth_utilization_ratio",
            "GPM: DRAM bandwidth used over the theoretical maximum, 0-1 (NVML_GPM_METRIC_DRAM_BW_UTIL).",
        ),
        GpmMetric::Fp16Activity => (
            "fp16_activity_ratio",
            "GPM: share of time the FP16 pipes were busy, 0-1 (NVML_GPM_METRIC_FP16_UTIL).",
        ),
        GpmMetric::Fp32Activity => (
            "fp32_activity_ratio",
            "GPM: share of time the FP32 pipes were busy, 0-1 (NVML_GPM_METRIC_FP32_UTIL).",
        ),
        GpmMetric::Fp64Activity => (
            "fp64_activity_ratio",
            "GPM: share of time the FP64 pipes were busy, 0-1 (NVML_GPM_METRIC_FP64_UTIL).",
        ),
        GpmMetric::PcieTransmit => (
            "pcie_transmit_bytes_per_second",
            "GPM: PCIe bytes sent by the GPU per second (NVML_GPM_METRIC_PCIE_TX_PER_SEC).",
        ),
        GpmMetric::PcieReceive => (
            "pcie_receive_bytes_per_second",
            "GPM: PCIe bytes received by the GPU per second (NVML_GPM_METRIC_PCIE_RX_PER_SEC).",
        ),
        GpmMetric::NvlinkTransmit => (
            "nvlink_transmit_bytes_per_second",
            "GPM: NVLink bytes sent per second, all links (NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC).",
        ),
        GpmMetric::NvlinkReceive => (
            "nvlink_receive_bytes_per_second",
            "GPM: NVLink bytes received per second, all links (NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC).",
        ),
    }
}

/// NVML's figure in Prometheus units.
pub(super) fn value(g: &Gpm, m: GpmMetric) -> Option<f64> {
    let v = g.values[m as usize]?;
    Some(match m.unit() {
        GpmUnit::Percent => v / 100.0,
        GpmUnit::MibPerSecond => v * 1_048_576.0,
    })
}

pub(crate) fn encode(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    for m in GpmMetric::ALL {
        let (suffix, help) = family(m);
        let of_gpu = |d: &crate::model::DeviceSample| {
            d.readings
                .get::<GpmReading>()
                .and_then(|r| r.gpu.as_ref().and_then(|g| value(g, m)))
        };
        if s.devices.iter().any(|d| of_gpu(d).is_some()) {
            let name = format!("gpu_gpm_{suffix}");
            let mut f = gauge(enc, &name, help)?;
            for d in &s.devices {
                if let Some(v) = of_gpu(d) {
                    f.encode_family(&gpu_labels(d))?.encode_gauge(&v)?;
                }
            }
        }
    }
    for m in GpmMetric::ALL {
        let (suffix, help) = family(m);
        let rows: Vec<_> = s
            .devices
            .iter()
            .filter_map(|d| Some((d, d.readings.get::<GpmReading>()?)))
            .flat_map(|(d, r)| {
                r.instances
                    .iter()
                    .filter_map(move |(gi, g)| Some((d, *gi, value(g, m)?)))
            })
            .collect();
        if rows.is_empty() {
            continue;
        }
        let help = help.replacen("GPM:", "GPM, one MIG GPU instance:", 1);
        let name = format!("gpu_mig_gpm_{suffix}");
        let mut f = gauge(enc, &name, &help)?;
        for (d, gi, v) in rows {
            let gi = gi.to_string();
            let labels = Labels([
                ("gpu", d.info.gpu.as_str()),
                ("uuid", d.info.uuid.as_str()),
                ("gpu_instance_id", gi.as_str()),
            ]);
            f.encode_family(&labels)?.encode_gauge(&v)?;
        }
    }
    let stale: Vec<_> = s
        .devices
        .iter()
        .filter_map(|d| Some((d, d.readings.get::<GpmReading>()?.stale)))
        .collect();
    if !stale.is_empty() {
        let mut f = enc.encode_descriptor(
            "gpumem_exporter_gpm_stale_readings",
            "GPM answers not served because they repeated the previous answer of the GPU (or a MIG instance) bit for bit while busy: samples that did not advance, e.g. with another GPM client on the GPU. Per GPU with GPM.",
            None,
            MetricType::Counter,
        )?;
        for (d, n) in stale {
            f.encode_family(&gpu_labels(d))?
                .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
        }
    }
    Ok(())
}
