//! Per-GPU families: `gpu_info`, `gpu_up`, the device memory gauges and
//! their peak, and `gpu_driver_info`.

use std::fmt;

use prometheus_client::encoding::DescriptorEncoder;

use crate::encoding::{Labels, gauge, gpu_labels};
use crate::model::{DeviceSample, Snapshot};

/// `gpu_info`, `gpu_up` and `gpu_memory_*_bytes`.
pub(super) fn devices(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    let mut m = gauge(
        enc,
        "gpu_info",
        // The HELP text is the golden files' (memory="unified" is in
        // docs/metrics.md).
        "GPU identity; value is always 1. gpu is the NVML index.",
    )?;
    // A GPU whose identity could not be read yet has only gpu_up 0.
    for d in s.devices.iter().filter(|d| d.info.is_known()) {
        let i = &d.info;
        let labels = Labels([
            ("gpu", i.gpu.as_str()),
            ("uuid", i.uuid.as_str()),
            ("name", i.name.as_str()),
            ("pci_bus_id", i.pci_bus_id.as_str()),
            // Absent (empty, left out) for device memory.
            ("memory", i.memory.label().unwrap_or_default()),
        ]);
        m.encode_family(&labels)?.encode_gauge(&1u32)?;
    }

    let mut m = gauge(
        enc,
        "gpu_up",
        "1 when the last sample of this GPU succeeded, else 0.",
    )?;
    for d in &s.devices {
        m.encode_family(&gpu_labels(d))?
            .encode_gauge(&u32::from(d.up()))?;
    }

    type Pick = fn(&DeviceSample) -> Option<u64>;
    let memory: [(&str, &str, Pick); 5] = [
        (
            "gpu_memory_total_bytes",
            "Total device memory in bytes (NVML memory_info v2).",
            |d| d.memory.map(|m| m.total),
        ),
        (
            "gpu_memory_used_bytes",
            "Device memory allocated by processes and the driver, in bytes.",
            |d| d.memory.map(|m| m.used),
        ),
        (
            "gpu_memory_free_bytes",
            "Unallocated device memory in bytes: total - reserved - used.",
            |d| d.memory.map(|m| m.free),
        ),
        (
            "gpu_memory_reserved_bytes",
            "Device memory reserved by the driver and firmware, in bytes.",
            |d| d.memory.and_then(|m| m.reserved),
        ),
        (
            "gpu_memory_used_peak_bytes",
            "Largest gpu_memory_used_bytes seen over the last peak_window, fast memory samples included: catches spikes between scrapes.",
            |d| d.used_peak_bytes,
        ),
    ];
    for (name, help, pick) in memory {
        let mut m = gauge(enc, name, help)?;
        for d in &s.devices {
            if let Some(v) = pick(d) {
                m.encode_family(&gpu_labels(d))?.encode_gauge(&v)?;
            }
        }
    }
    Ok(())
}

/// `gpu_driver_info`: one series per host.
pub(super) fn driver(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    let mut m = gauge(
        enc,
        "gpu_driver_info",
        "NVIDIA driver, NVML and CUDA driver API versions; value is always 1.",
    )?;
    let labels = Labels([
        ("driver_version", s.driver.driver_version.as_str()),
        ("nvml_version", s.driver.nvml_version.as_str()),
        ("cuda_driver_version", s.driver.cuda_driver_version.as_str()),
    ]);
    m.encode_family(&labels)?.encode_gauge(&1u32)?;
    Ok(())
}
