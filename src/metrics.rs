//! Snapshot → exposition text. Every metric name the exporter serves is
//! defined in this file. A scrape encodes the latest [`Snapshot`] through a
//! custom `prometheus-client` collector and never touches NVML.

use std::fmt;
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::model::Snapshot;

/// Content types of the two formats served.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Exposition format, picked from the scraper's `Accept` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text format 0.0.4, the default.
    Text,
    OpenMetrics,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Text => TEXT_CONTENT_TYPE,
            Format::OpenMetrics => OPENMETRICS_CONTENT_TYPE,
        }
    }

    /// OpenMetrics when the `Accept` header lists
    /// `application/openmetrics-text` with a q-value that is positive and
    /// not lower than the best other acceptable type; the classic text
    /// format otherwise (also for a missing or malformed header).
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::Text;
        };
        let mut om_q: f32 = -1.0;
        let mut other_q: f32 = -1.0;
        for range in accept.split(',') {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or("").trim().to_ascii_lowercase();
            let mut q: f32 = 1.0;
            for p in parts {
                if let Some((k, v)) = p.split_once('=')
                    && k.trim().eq_ignore_ascii_case("q")
                {
                    q = v
                        .trim()
                        .parse::<f32>()
                        .ok()
                        .filter(|q| q.is_finite())
                        .unwrap_or(0.0);
                }
            }
            if media == "application/openmetrics-text" {
                om_q = om_q.max(q);
            } else if !media.is_empty() {
                other_q = other_q.max(q);
            }
        }
        if om_q > 0.0 && om_q >= other_q {
            Format::OpenMetrics
        } else {
            Format::Text
        }
    }
}

/// `version` and `revision` labels of `gpumem_exporter_build_info`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const REVISION: &str = env!("GPUMEM_EXPORTER_REVISION");

/// Encode one snapshot in the given format.
pub fn encode(snapshot: &Arc<Snapshot>, format: Format) -> Result<String, fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(SnapshotCollector(Arc::clone(snapshot))));
    let mut out = String::with_capacity(4096);
    match format {
        Format::Text => prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)?,
        Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut out, &registry)?,
    }
    Ok(out)
}

#[derive(Debug)]
struct SnapshotCollector(Arc<Snapshot>);

fn gauge<'a>(
    enc: &'a mut DescriptorEncoder,
    name: &'a str,
    help: &str,
) -> Result<prometheus_client::encoding::MetricEncoder<'a>, fmt::Error> {
    enc.encode_descriptor(name, help, None, MetricType::Gauge)
}

impl Collector for SnapshotCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), fmt::Error> {
        let s = &*self.0;

        let mut m = gauge(
            &mut enc,
            "gpu_info",
            "GPU identity; value is always 1. gpu is the NVML index.",
        )?;
        for d in &s.devices {
            let i = &d.info;
            let labels = [
                ("gpu", i.gpu.as_str()),
                ("uuid", i.uuid.as_str()),
                ("name", i.name.as_str()),
                ("pci_bus_id", i.pci_bus_id.as_str()),
            ];
            m.encode_family(&labels)?.encode_gauge(&1u32)?;
        }

        let mut m = gauge(
            &mut enc,
            "gpu_up",
            "1 when the last sample of this GPU succeeded, else 0.",
        )?;
        for d in &s.devices {
            let labels = [("gpu", d.info.gpu.as_str()), ("uuid", d.info.uuid.as_str())];
            m.encode_family(&labels)?.encode_gauge(&u32::from(d.up()))?;
        }

        type Pick = fn(&crate::model::MemoryInfo) -> u64;
        let memory: [(&str, &str, Pick); 4] = [
            (
                "gpu_memory_total_bytes",
                "Total device memory in bytes (NVML memory_info v2).",
                |m| m.total,
            ),
            (
                "gpu_memory_used_bytes",
                "Device memory allocated by processes and the driver, in bytes.",
                |m| m.used,
            ),
            (
                "gpu_memory_free_bytes",
                "Unallocated device memory in bytes: total - reserved - used.",
                |m| m.free,
            ),
            (
                "gpu_memory_reserved_bytes",
                "Device memory reserved by the driver and firmware, in bytes.",
                |m| m.reserved,
            ),
        ];
        for (name, help, pick) in memory {
            let mut m = gauge(&mut enc, name, help)?;
            for d in &s.devices {
                if let Some(mem) = &d.memory {
                    let labels = [("gpu", d.info.gpu.as_str()), ("uuid", d.info.uuid.as_str())];
                    m.encode_family(&labels)?.encode_gauge(&pick(mem))?;
                }
            }
        }

        let mut m = gauge(
            &mut enc,
            "gpu_process_memory_used_bytes",
            "Device memory used by one process on one GPU, in bytes, as NVML reports it.",
        )?;
        for d in &s.devices {
            for p in &d.processes {
                if let Some(bytes) = p.used_bytes {
                    let pid = pid_str(p.pid);
                    let labels = [
                        ("gpu", d.info.gpu.as_str()),
                        ("uuid", d.info.uuid.as_str()),
                        ("pid", pid.as_str()),
                        ("process", p.process.as_str()),
                    ];
                    m.encode_family(&labels)?.encode_gauge(&bytes)?;
                }
            }
        }

        let mut m = gauge(
            &mut enc,
            "gpu_process_memory_unavailable",
            "1 for a process NVML lists on this GPU without a memory figure (NVML_VALUE_NOT_AVAILABLE); such a process has no gpu_process_memory_used_bytes series.",
        )?;
        for d in &s.devices {
            for p in d.processes.iter().filter(|p| p.used_bytes.is_none()) {
                let pid = pid_str(p.pid);
                let labels = [
                    ("gpu", d.info.gpu.as_str()),
                    ("uuid", d.info.uuid.as_str()),
                    ("pid", pid.as_str()),
                    ("process", p.process.as_str()),
                ];
                m.encode_family(&labels)?.encode_gauge(&1u32)?;
            }
        }

        let mut m = gauge(
            &mut enc,
            "gpu_driver_info",
            "NVIDIA driver, NVML and CUDA driver API versions; value is always 1.",
        )?;
        let labels = [
            ("driver_version", s.driver.driver_version.as_str()),
            ("nvml_version", s.driver.nvml_version.as_str()),
            ("cuda_driver_version", s.driver.cuda_driver_version.as_str()),
        ];
        m.encode_family(&labels)?.encode_gauge(&1u32)?;

        let mut m = gauge(
            &mut enc,
            "gpumem_exporter_build_info",
            "Version and git revision of the running gpumem-exporter; value is always 1.",
        )?;
        let labels = [("version", VERSION), ("revision", REVISION)];
        m.encode_family(&labels)?.encode_gauge(&1u32)?;

        let h = &s.sample_duration;
        let mut buckets: Vec<(f64, u64)> = h
            .bounds
            .iter()
            .copied()
            .zip(h.counts.iter().copied())
            .collect();
        buckets.push((f64::INFINITY, h.counts.last().copied().unwrap_or(0)));
        enc.encode_descriptor(
            "gpumem_exporter_sample_duration_seconds",
            "Wall time of one sampling tick over all GPUs, NVML calls and /proc reads included.",
            None,
            MetricType::Histogram,
        )?
        .encode_histogram::<NoLabelSet>(h.sum, h.count, &buckets, None)?;

        let ts = s
            .taken_at
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        gauge(
            &mut enc,
            "gpumem_exporter_last_sample_timestamp_seconds",
            "Unix time when the sample served now was taken; its age shows a stuck sampler.",
        )?
        .encode_gauge(&ts)?;

        let mut m = enc.encode_descriptor(
            "gpumem_exporter_nvml_errors",
            "NVML calls that failed, by operation and error.",
            None,
            MetricType::Counter,
        )?;
        for ((op, err), n) in s.nvml_errors.iter() {
            let labels = [("operation", *op), ("error", err.as_str())];
            m.encode_family(&labels)?
                .encode_counter::<NoLabelSet, _, u64>(n, None)?;
        }
        Ok(())
    }
}

fn pid_str(pid: u32) -> String {
    pid.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation() {
        let cases = [
            (None, Format::Text),
            (Some(""), Format::Text),
            (Some("text/plain"), Format::Text),
            (Some("*/*"), Format::Text),
            (Some("application/openmetrics-text"), Format::OpenMetrics),
            // What Prometheus 2.x sends.
            (
                Some(
                    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                ),
                Format::OpenMetrics,
            ),
            (
                Some("text/plain;q=1,application/openmetrics-text;q=0.5"),
                Format::Text,
            ),
            (Some("application/openmetrics-text;q=0"), Format::Text),
            (Some("application/openmetrics-text;q=abc"), Format::Text),
            (Some(";;;,,,==="), Format::Text),
        ];
        for (accept, want) in cases {
            assert_eq!(Format::negotiate(accept), want, "{accept:?}");
        }
    }
}
