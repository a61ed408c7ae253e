//! Snapshot → exposition text. Every metric name the exporter serves is
//! defined in this file. A scrape encodes the latest [`Snapshot`] through a
//! custom `prometheus-client` collector and never touches NVML.

use std::fmt;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use std::time::UNIX_EPOCH;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::model::{
    DeviceSample, DurationHistogram, OtherProcesses, ProcessSample, Snapshot, TorchStats,
};

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

/// A published snapshot plus its encodings, made lazily and at most once
/// per (format, compression): however many scrapers ask, a snapshot is
/// encoded once per format and gzipped once.
#[derive(Debug)]
pub struct Published {
    pub snapshot: Arc<Snapshot>,
    cache: [OnceLock<Option<Bytes>>; 4],
}

impl Published {
    pub fn new(snapshot: Snapshot) -> Self {
        Published {
            snapshot: Arc::new(snapshot),
            cache: Default::default(),
        }
    }

    /// The encoded body; `None` only if encoding failed (a bug, logged).
    pub fn body(&self, format: Format, gzip: bool) -> Option<Bytes> {
        let slot = match (format, gzip) {
            (Format::Text, false) => 0,
            (Format::Text, true) => 1,
            (Format::OpenMetrics, false) => 2,
            (Format::OpenMetrics, true) => 3,
        };
        self.cache[slot]
            .get_or_init(|| {
                if gzip {
                    let plain = self.body(format, false)?;
                    let mut z = flate2::write::GzEncoder::new(
                        Vec::with_capacity(plain.len() / 4),
                        flate2::Compression::fast(),
                    );
                    std::io::Write::write_all(&mut z, &plain).ok()?;
                    z.finish().ok().map(Bytes::from)
                } else {
                    match encode(&self.snapshot, format) {
                        Ok(s) => Some(Bytes::from(s)),
                        Err(_) => {
                            tracing::error!("encoding the snapshot failed");
                            None
                        }
                    }
                }
            })
            .clone()
    }
}

/// True when the `Accept-Encoding` header accepts gzip (q > 0).
pub fn accepts_gzip(accept_encoding: Option<&str>) -> bool {
    accept_encoding.is_some_and(|h| {
        h.split(',').any(|part| {
            let mut it = part.split(';');
            let coding = it.next().unwrap_or("").trim();
            let q = it
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
                .map(|(_, v)| v.trim().parse::<f32>().unwrap_or(0.0))
                .unwrap_or(1.0);
            (coding.eq_ignore_ascii_case("gzip") || coding == "*") && q > 0.0
        })
    })
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

fn gpu_labels(d: &DeviceSample) -> [(&'static str, &str); 2] {
    [("gpu", d.info.gpu.as_str()), ("uuid", d.info.uuid.as_str())]
}

/// An optional id as label text ("" when absent).
fn id_label(v: Option<u32>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

/// Labels of every per-process value series: the GPU (and MIG instance),
/// the pid, its name and its pod.
fn process_labels<'a>(
    d: &'a DeviceSample,
    p: &'a ProcessSample,
    pid: &'a str,
    gi: &'a str,
    ci: &'a str,
) -> [(&'static str, &'a str); 9] {
    [
        ("gpu", d.info.gpu.as_str()),
        ("uuid", d.info.uuid.as_str()),
        ("pid", pid),
        ("process", &*p.ident.comm),
        ("namespace", &*p.ident.namespace),
        ("pod", &*p.ident.pod),
        ("container", &*p.ident.container),
        ("gpu_instance_id", gi),
        ("compute_instance_id", ci),
    ]
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
    };
    for d in &s.devices {
        for p in d.processes.iter() {
            if let Some(v) = value(p) {
                let pid = p.pid.to_string();
                let (gi, ci) = (id_label(p.gpu_instance_id), id_label(p.compute_instance_id));
                let labels = process_labels(d, p, &pid, &gi, &ci);
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

/// PyTorch allocator figures a process published (torch bridge), with the
/// labels of `gpu_process_memory_used_bytes`. Only processes that publish
/// have series; there is no `pid="other"` rollup (torch figures of the
/// processes left out are not read at all).
fn torch_families(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    type Pick = fn(&TorchStats) -> u64;
    let families: [(&str, &str, MetricType, Pick); 8] = [
        (
            "gpu_process_torch_allocated_bytes",
            "Bytes in live tensors of this process on this GPU, from torch.cuda.memory_stats() (allocated_bytes.all.current), published by the process through the torch bridge.",
            MetricType::Gauge,
            |t| t.allocated,
        ),
        (
            "gpu_process_torch_reserved_bytes",
            "Bytes the PyTorch caching allocator holds from CUDA on this GPU: allocated plus cached (reserved_bytes.all.current). gpu_process_memory_used_bytes minus this is the non-torch part (CUDA context, libraries).",
            MetricType::Gauge,
            |t| t.reserved,
        ),
        (
            "gpu_process_torch_allocated_peak_bytes",
            "Peak of gpu_process_torch_allocated_bytes since the process started or reset its peaks (allocated_bytes.all.peak).",
            MetricType::Gauge,
            |t| t.allocated_peak,
        ),
        (
            "gpu_process_torch_reserved_peak_bytes",
            "Peak of gpu_process_torch_reserved_bytes since the process started or reset its peaks (reserved_bytes.all.peak).",
            MetricType::Gauge,
            |t| t.reserved_peak,
        ),
        (
            "gpu_process_torch_active_bytes",
            "Bytes in active memory blocks of the PyTorch allocator, including blocks still used by pending streams (active_bytes.all.current).",
            MetricType::Gauge,
            |t| t.active,
        ),
        (
            "gpu_process_torch_inactive_split_bytes",
            "Bytes in inactive, split blocks of the PyTorch allocator: cached memory that fragmentation keeps from being released (inactive_split_bytes.all.current).",
            MetricType::Gauge,
            |t| t.inactive_split,
        ),
        (
            "gpu_process_torch_alloc_retries",
            "Allocations the PyTorch allocator retried after freeing its cache (num_alloc_retries); a rising count means memory pressure.",
            MetricType::Counter,
            |t| t.alloc_retries,
        ),
        (
            "gpu_process_torch_ooms",
            "Out-of-memory errors the PyTorch allocator raised in this process (num_ooms).",
            MetricType::Counter,
            |t| t.ooms,
        ),
    ];
    for (name, help, kind, pick) in families {
        let mut m = enc.encode_descriptor(name, help, None, kind)?;
        for d in &s.devices {
            for p in d.processes.iter() {
                let Some(t) = &p.torch else { continue };
                let pid = p.pid.to_string();
                let (gi, ci) = (id_label(p.gpu_instance_id), id_label(p.compute_instance_id));
                let labels = process_labels(d, p, &pid, &gi, &ci);
                let v = pick(t);
                match kind {
                    MetricType::Counter => m
                        .encode_family(&labels)?
                        .encode_counter::<NoLabelSet, _, u64>(&v, None)?,
                    _ => m.encode_family(&labels)?.encode_gauge(&v)?,
                }
            }
        }
    }
    Ok(())
}

fn histogram(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    h: &DurationHistogram,
) -> Result<(), fmt::Error> {
    let mut buckets: Vec<(f64, u64)> = h
        .bounds
        .iter()
        .copied()
        .zip(h.counts.iter().copied())
        .collect();
    buckets.push((f64::INFINITY, h.counts.last().copied().unwrap_or(0)));
    enc.encode_descriptor(name, help, None, MetricType::Histogram)?
        .encode_histogram::<NoLabelSet>(h.sum, h.count, &buckets, None)
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
                |d| d.memory.map(|m| m.reserved),
            ),
            (
                "gpu_memory_used_peak_bytes",
                "Largest gpu_memory_used_bytes seen over the last peak_window, fast memory samples included: catches spikes between scrapes.",
                |d| d.used_peak_bytes,
            ),
        ];
        for (name, help, pick) in memory {
            let mut m = gauge(&mut enc, name, help)?;
            for d in &s.devices {
                if let Some(v) = pick(d) {
                    m.encode_family(&gpu_labels(d))?.encode_gauge(&v)?;
                }
            }
        }

        process_family(
            &mut enc,
            s,
            "gpu_process_memory_used_bytes",
            "Device memory used by one process on one GPU, in bytes, as NVML reports it. pid=\"other\" sums the processes left out by processes.min_bytes / processes.top_n.",
            |p| p.used_bytes,
            |o| Some(o.used_bytes),
        )?;
        process_family(
            &mut enc,
            s,
            "gpu_process_memory_used_peak_bytes",
            "Largest gpu_process_memory_used_bytes of this live process over the last peak_window (full samples).",
            |p| p.used_peak_bytes,
            |_| None,
        )?;
        process_family(
            &mut enc,
            s,
            "gpu_process_memory_unavailable",
            "1 for a process NVML lists on this GPU without a memory figure (NVML_VALUE_NOT_AVAILABLE); such a process has no gpu_process_memory_used_bytes series.",
            |p| p.used_bytes.is_none().then_some(1),
            |_| None,
        )?;
        if s.torch.is_some() {
            torch_families(&mut enc, s)?;
        }

        let mut m = gauge(
            &mut enc,
            "gpu_processes_other",
            "Number of processes summed into the pid=\"other\" series of this GPU.",
        )?;
        for d in &s.devices {
            if let Some(o) = &d.other {
                m.encode_family(&gpu_labels(d))?.encode_gauge(&o.count)?;
            }
        }

        let mut m = gauge(
            &mut enc,
            "gpu_process_info",
            "Identity of a process on a GPU; value is always 1. user from the host's passwd (or the uid), container_id and pod_uid from its cgroup.",
        )?;
        for d in &s.devices {
            for p in d.processes.iter() {
                let pid = p.pid.to_string();
                let i = &p.ident;
                let base = [
                    ("gpu", d.info.gpu.as_str()),
                    ("uuid", d.info.uuid.as_str()),
                    ("pid", pid.as_str()),
                    ("process", &*i.comm),
                    ("user", &*i.user),
                    ("container_id", &*i.container_id),
                    ("pod_uid", &*i.pod_uid),
                ];
                match &i.cmdline {
                    Some(c) => m
                        .encode_family(&(base, [("cmdline", &**c)]))?
                        .encode_gauge(&1u32)?,
                    None => m.encode_family(&base)?.encode_gauge(&1u32)?,
                }
            }
        }

        let mut m = gauge(
            &mut enc,
            "gpu_mig_info",
            "Identity of a MIG instance; value is always 1. gpu and uuid name the parent GPU.",
        )?;
        for d in &s.devices {
            for g in d.mig.iter() {
                let gi = g.info.gpu_instance_id.to_string();
                let ci = g.info.compute_instance_id.to_string();
                let labels = [
                    ("gpu", d.info.gpu.as_str()),
                    ("uuid", d.info.uuid.as_str()),
                    ("mig_uuid", g.info.mig_uuid.as_str()),
                    ("name", g.info.name.as_str()),
                    ("gpu_instance_id", gi.as_str()),
                    ("compute_instance_id", ci.as_str()),
                ];
                m.encode_family(&labels)?.encode_gauge(&1u32)?;
            }
        }
        type MigPick = fn(&crate::model::MemoryInfo) -> u64;
        let mig_memory: [(&str, &str, MigPick); 4] = [
            (
                "gpu_mig_memory_total_bytes",
                "Memory of one MIG instance (its own memory_info), in bytes.",
                |m| m.total,
            ),
            (
                "gpu_mig_memory_used_bytes",
                "Memory used in one MIG instance, in bytes.",
                |m| m.used,
            ),
            (
                "gpu_mig_memory_free_bytes",
                "Free memory of one MIG instance, in bytes.",
                |m| m.free,
            ),
            (
                "gpu_mig_memory_reserved_bytes",
                "Reserved memory of one MIG instance, in bytes.",
                |m| m.reserved,
            ),
        ];
        for (name, help, pick) in mig_memory {
            let mut m = gauge(&mut enc, name, help)?;
            for d in &s.devices {
                for g in d.mig.iter() {
                    if let Some(mem) = &g.memory {
                        let gi = g.info.gpu_instance_id.to_string();
                        let ci = g.info.compute_instance_id.to_string();
                        let labels = [
                            ("gpu", d.info.gpu.as_str()),
                            ("uuid", d.info.uuid.as_str()),
                            ("gpu_instance_id", gi.as_str()),
                            ("compute_instance_id", ci.as_str()),
                        ];
                        m.encode_family(&labels)?.encode_gauge(&pick(mem))?;
                    }
                }
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

        histogram(
            &mut enc,
            "gpumem_exporter_sample_duration_seconds",
            "Wall time of one full sample over all GPUs: NVML calls and /proc reads.",
            &s.sample_duration,
        )?;
        histogram(
            &mut enc,
            "gpumem_exporter_sample_nvml_duration_seconds",
            "The part of each full sample spent inside NVML calls; the rest is the exporter's own work.",
            &s.sample_nvml_duration,
        )?;
        enc.encode_descriptor(
            "gpumem_exporter_memory_samples",
            "Memory-only samples taken between full samples (memory_sample_interval).",
            None,
            MetricType::Counter,
        )?
        .encode_counter::<NoLabelSet, _, u64>(&s.memory_samples, None)?;

        enc.encode_descriptor(
            "gpumem_exporter_nvml_reinit_attempts",
            "Times NVML was opened afresh because every GPU kept failing (3 samples in a row, then with backoff).",
            None,
            MetricType::Counter,
        )?
        .encode_counter::<NoLabelSet, _, u64>(&s.nvml_reinit_attempts, None)?;

        let mut m = enc.encode_descriptor(
            "gpumem_exporter_config_reloads",
            "Config file reloads on SIGHUP; a failed one keeps the running config.",
            None,
            MetricType::Counter,
        )?;
        for (result, n) in [
            ("success", &crate::config::RELOAD_SUCCESS),
            ("failure", &crate::config::RELOAD_FAILURE),
        ] {
            m.encode_family(&[("result", result)])?
                .encode_counter::<NoLabelSet, _, u64>(
                    &n.load(std::sync::atomic::Ordering::Relaxed),
                    None,
                )?;
        }

        enc.encode_descriptor(
            "gpumem_exporter_process_lookup_failures",
            "Pids reported by NVML that were not visible in /proc (exited, or no host PID namespace): their series carry the pid but no name, user or pod.",
            None,
            MetricType::Counter,
        )?
        .encode_counter::<NoLabelSet, _, u64>(&s.process_lookup_failures, None)?;

        if let Some(t) = &s.torch {
            enc.encode_descriptor(
                "gpumem_exporter_torch_reports",
                "Torch bridge documents read and accepted (at most one per process per full sample).",
                None,
                MetricType::Counter,
            )?
            .encode_counter::<NoLabelSet, _, u64>(&t.reports, None)?;
            let mut m = enc.encode_descriptor(
                "gpumem_exporter_torch_reports_dropped",
                "Torch bridge documents dropped: malformed (not the v1 JSON, wrong types, not a sealed memfd), oversized (over 64 KiB), permission (the process's fds may not be read; once per process).",
                None,
                MetricType::Counter,
            )?;
            for (reason, n) in [
                ("malformed", t.malformed),
                ("oversized", t.oversized),
                ("permission", t.permission),
            ] {
                m.encode_family(&[("reason", reason)])?
                    .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
            }
        }

        if let Some(k) = &s.kubernetes {
            gauge(
                &mut enc,
                "gpumem_exporter_kubernetes_pods",
                "Pods of this node in the pod watcher's cache.",
            )?
            .encode_gauge(&k.pods)?;
            gauge(
                &mut enc,
                "gpumem_exporter_kubernetes_synced",
                "1 once the pod watcher has listed this node's pods.",
            )?
            .encode_gauge(&u32::from(k.synced))?;
            for (name, help, v) in [
                (
                    "gpumem_exporter_kubernetes_lists",
                    "Full LISTs of this node's pods (start, and after a watch expired).",
                    k.lists_total,
                ),
                (
                    "gpumem_exporter_kubernetes_watch_restarts",
                    "Pod watches re-established after a drop.",
                    k.watch_restarts_total,
                ),
                (
                    "gpumem_exporter_kubernetes_errors",
                    "Errors talking to the Kubernetes API or parsing its answers.",
                    k.errors_total,
                ),
            ] {
                enc.encode_descriptor(name, help, None, MetricType::Counter)?
                    .encode_counter::<NoLabelSet, _, u64>(&v, None)?;
            }
        }

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

        // HTTP server and web config (src/server.rs, src/web.rs): process
        // counters, read when this snapshot is first encoded.
        {
            use crate::{server, web};
            use std::sync::atomic::Ordering::Relaxed;
            let mut m = enc.encode_descriptor(
                "gpumem_exporter_web_config_reloads",
                "Web config file (--web.config.file) reloads on SIGHUP; a failed one keeps the running config.",
                None,
                MetricType::Counter,
            )?;
            for (result, n) in [
                ("success", &web::RELOAD_SUCCESS),
                ("failure", &web::RELOAD_FAILURE),
            ] {
                m.encode_family(&[("result", result)])?
                    .encode_counter::<NoLabelSet, _, u64>(&n.load(Relaxed), None)?;
            }
            gauge(
                &mut enc,
                "gpumem_exporter_http_connections",
                "Open HTTP connections.",
            )?
            .encode_gauge(&(server::CONNECTIONS_OPEN.load(Relaxed) as i64))?;
            for (name, help, n) in [
                (
                    "gpumem_exporter_http_connections_evicted",
                    "Idle HTTP connections closed to make room at the connection cap (http_server_config.max_connections).",
                    &server::CONNECTIONS_EVICTED,
                ),
                (
                    "gpumem_exporter_http_connections_refused",
                    "HTTP connections closed at once: the cap was reached and every connection was busy.",
                    &server::CONNECTIONS_REFUSED,
                ),
            ] {
                enc.encode_descriptor(name, help, None, MetricType::Counter)?
                    .encode_counter::<NoLabelSet, _, u64>(&n.load(Relaxed), None)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gzip_negotiation() {
        for (h, want) in [
            (None, false),
            (Some("gzip"), true),
            (Some("gzip, deflate, br"), true),
            (Some("deflate"), false),
            (Some("gzip;q=0"), false),
            (Some("*"), true),
            (Some("identity, gzip;q=0.5"), true),
            (Some(";;,"), false),
        ] {
            assert_eq!(accepts_gzip(h), want, "{h:?}");
        }
    }

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
