//! The exporter's own families (`gpumem_exporter_*`): build info, sample
//! durations, counters of the sampler, the config reloads, /proc lookups,
//! the torch bridge, the pod watcher, the pod-resources client, the Slurm
//! job-mapping reader, NVML
//! errors and the HTTP server.
//! Encoded last, after the GPU data.

use std::fmt;
use std::time::UNIX_EPOCH;

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use crate::encoding::{Labels, gauge};
use crate::model::{DurationHistogram, HttpBody, Snapshot};

/// `version` and `revision` labels of `gpumem_exporter_build_info`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const REVISION: &str = env!("GPUMEM_EXPORTER_REVISION");

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

pub(super) fn families(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    let mut m = gauge(
        enc,
        "gpumem_exporter_build_info",
        "Version and git revision of the running gpumem-exporter; value is always 1.",
    )?;
    let labels = Labels([("version", VERSION), ("revision", REVISION)]);
    m.encode_family(&labels)?.encode_gauge(&1u32)?;

    histogram(
        enc,
        "gpumem_exporter_sample_duration_seconds",
        "Wall time of one full sample over all GPUs: NVML calls and /proc reads.",
        &s.sample_duration,
    )?;
    histogram(
        enc,
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
        ("success", s.exporter.config_reloads_success),
        ("failure", s.exporter.config_reloads_failure),
    ] {
        m.encode_family(&Labels([("result", result)]))?
            .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
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
            m.encode_family(&Labels([("reason", reason)]))?
                .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
        }
    }

    if let Some(c) = &s.containers {
        let mut m = enc.encode_descriptor(
            "gpumem_exporter_container_lookups",
            "Requests to the container engine's API (containers.engine_socket), by result: found, not_found (404: not asked again for 60s), error (no answer: socket missing or refused, timeout, unexpected status, malformed body; retried after 1s doubling to 30s). One per new container, never per scrape.",
            None,
            MetricType::Counter,
        )?;
        for (result, n) in [
            ("found", c.found),
            ("not_found", c.not_found),
            ("error", c.error),
        ] {
            m.encode_family(&Labels([("result", result)]))?
                .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
        }
    }

    if let Some(k) = &s.kubernetes {
        gauge(
            enc,
            "gpumem_exporter_kubernetes_pods",
            "Pods of this node in the pod watcher's cache.",
        )?
        .encode_gauge(&k.pods)?;
        gauge(
            enc,
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

    if let Some(p) = &s.pod_resources {
        for (name, help, v) in [
            (
                "gpumem_exporter_pod_resources_lists",
                "Answered List calls to the kubelet's pod-resources API (one every kubernetes.pod_resources_interval).",
                p.lists_total,
            ),
            (
                "gpumem_exporter_pod_resources_errors",
                "Failed List calls to the kubelet's pod-resources API (no socket, no answer in time, an error status, an undecodable answer).",
                p.errors_total,
            ),
        ] {
            enc.encode_descriptor(name, help, None, MetricType::Counter)?
                .encode_counter::<NoLabelSet, _, u64>(&v, None)?;
        }
        // DRA (after the two above, so their order is unchanged).
        let slices = p.resource_slice_errors_total.map(|v| {
            (
                "gpumem_exporter_resource_slice_errors",
                "Failed requests of the ResourceSlice watcher (resource.k8s.io/v1, this node's slices; a 403 without RBAC for resourceslices included).",
                v,
            )
        });
        for (name, help, v) in [(
            "gpumem_exporter_dra_fallbacks",
            "DRA devices not found in this node's ResourceSlices, placed by the index in their name (gpu-<n>) or not at all; once per device per pod-resources answer.",
            p.dra_fallbacks_total,
        )]
        .into_iter()
        .chain(slices)
        {
            enc.encode_descriptor(name, help, None, MetricType::Counter)?
                .encode_counter::<NoLabelSet, _, u64>(&v, None)?;
        }
    }

    if let Some(j) = &s.job_mapping {
        enc.encode_descriptor(
            "gpumem_exporter_slurm_job_mapping_reads",
            "Reads of the Slurm job-mapping directory (one every slurm.job_mapping_interval).",
            None,
            MetricType::Counter,
        )?
        .encode_counter::<NoLabelSet, _, u64>(&j.reads_total, None)?;
        let mut m = enc.encode_descriptor(
            "gpumem_exporter_slurm_job_mapping_errors",
            "Slurm job-mapping entries skipped, by reason: read (directory or file unreadable), name (no device of the format), content (no valid job id), too_large (file over 4 KiB), too_many (over 1024 files).",
            None,
            MetricType::Counter,
        )?;
        for (reason, n) in j.errors.by_reason() {
            m.encode_family(&Labels([("reason", reason)]))?
                .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
        }
    }

    let ts = s
        .taken_at
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    gauge(
        enc,
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
        let labels = Labels([("operation", op.label()), ("error", err.label())]);
        m.encode_family(&labels)?
            .encode_counter::<NoLabelSet, _, u64>(n, None)?;
    }

    // The HTTP server's and web config's counters, copied into the snapshot
    // when it was published (crate::telemetry).
    let own = &s.exporter;
    let mut m = enc.encode_descriptor(
        "gpumem_exporter_web_config_reloads",
        "Web config file (--web.config.file) reloads on SIGHUP; a failed one keeps the running config.",
        None,
        MetricType::Counter,
    )?;
    for (result, n) in [
        ("success", own.web_config_reloads_success),
        ("failure", own.web_config_reloads_failure),
    ] {
        m.encode_family(&Labels([("result", result)]))?
            .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
    }
    gauge(
        enc,
        "gpumem_exporter_http_connections",
        "Open HTTP connections.",
    )?
    .encode_gauge(&(own.http_connections_open as i64))?;
    for (name, help, n) in [
        (
            "gpumem_exporter_http_connections_evicted",
            "HTTP connections not being answered (slow half-open ones first) closed to make room at a connection cap (http_server_config.max_connections or max_connections_per_ip).",
            own.http_connections_evicted,
        ),
        (
            "gpumem_exporter_http_connections_refused",
            "HTTP connections closed at once: at a cap with every connection (of that address) busy, or with the cap and its reserve full.",
            own.http_connections_refused,
        ),
    ] {
        enc.encode_descriptor(name, help, None, MetricType::Counter)?
            .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
    }
    let mut m = enc.encode_descriptor(
        "gpumem_exporter_http_body_encodes",
        "Response bodies encoded from a snapshot, by body (text, openmetrics, snapshot_json, history_json): at most one per snapshot each (history_json: per snapshot and seconds), however many requests ask.",
        None,
        MetricType::Counter,
    )?;
    for body in HttpBody::ALL {
        m.encode_family(&[("body", body.label())])?
            .encode_counter::<NoLabelSet, _, u64>(own.http_body_encodes.get(body), None)?;
    }
    Ok(())
}
