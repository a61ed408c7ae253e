//! The exporter's own families (`gpumem_exporter_*`): build info, sample
//! durations, counters of the sampler, the config reloads, /proc lookups,
//! the torch bridge, the pod watcher, the pod-resources client, the Slurm
//! job-mapping reader, NVML
//! errors and the HTTP server.
//! Encoded last, after the GPU data.
//!
//! Every counter and gauge is a row of [`FAMILIES`] (name, help, type, and
//! the series it reads from the snapshot), like the torch families; only
//! the two duration histograms have code of their own.

use std::fmt;
use std::time::UNIX_EPOCH;

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use crate::encoding::Labels;
use crate::model::{DurationHistogram, HttpBody, Snapshot};

/// `version` and `revision` labels of `gpumem_exporter_build_info`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const REVISION: &str = env!("GPUMEM_EXPORTER_REVISION");

/// One family the exporter writes about itself.
struct Family {
    name: &'static str,
    help: &'static str,
    /// `Counter` or `Gauge`: how each series' value is written.
    kind: MetricType,
    /// The family's series in output order; `None` where the part it
    /// counts is off (no torch bridge, no pod watcher, ...): then the
    /// family is left out, HELP and TYPE too.
    series: fn(&Snapshot) -> Option<Vec<Series>>,
}

/// One series: at most two labels (an unused one is `("", "")`, left out
/// like every empty value, see [`Labels`]) and its value.
type Series = (Labels<'static, 2>, Value);

/// A series' value: counts as integers, the one time stamp as a float
/// (so it is written with its fraction).
#[derive(Debug, Clone, Copy)]
enum Value {
    Int(u64),
    Float(f64),
}

/// The label set of a series without labels.
const NO_LABELS: Labels<'static, 2> = Labels([("", ""), ("", "")]);

/// One series without labels.
fn one(value: Value) -> Vec<Series> {
    vec![(NO_LABELS, value)]
}

/// One series without labels, of a count.
fn count(n: u64) -> Vec<Series> {
    one(Value::Int(n))
}

/// One count per value of one label, in the order given.
fn by<const N: usize>(label: &'static str, counts: [(&'static str, u64); N]) -> Vec<Series> {
    counts
        .into_iter()
        .map(|(value, n)| (Labels([(label, value), ("", "")]), Value::Int(n)))
        .collect()
}

/// The build's version and revision: first, before the samples' families.
const BUILD_INFO: Family = Family {
    name: "gpumem_exporter_build_info",
    help: "Version and git revision of the running gpumem-exporter; value is always 1.",
    kind: MetricType::Gauge,
    series: |_| {
        let labels = Labels([("version", VERSION), ("revision", REVISION)]);
        Some(vec![(labels, Value::Int(1))])
    },
};

/// Every family after the duration histograms, in output order.
static FAMILIES: &[Family] = &[
    Family {
        name: "gpumem_exporter_memory_samples",
        help: "Memory-only samples taken between full samples (memory_sample_interval).",
        kind: MetricType::Counter,
        series: |s| Some(count(s.memory_samples)),
    },
    Family {
        name: "gpumem_exporter_nvml_reinit_attempts",
        help: "Times NVML was opened afresh because every GPU kept failing (3 samples in a row, then with backoff).",
        kind: MetricType::Counter,
        series: |s| Some(count(s.nvml_reinit_attempts)),
    },
    Family {
        name: "gpumem_exporter_config_reloads",
        help: "Config file reloads on SIGHUP; a failed one keeps the running config.",
        kind: MetricType::Counter,
        series: |s| {
            Some(by(
                "result",
                [
                    ("success", s.exporter.config_reloads_success),
                    ("failure", s.exporter.config_reloads_failure),
                ],
            ))
        },
    },
    Family {
        name: "gpumem_exporter_process_lookup_failures",
        help: "Pids reported by NVML that were not visible in /proc (exited, or no host PID namespace): their series carry the pid but no name, user or pod.",
        kind: MetricType::Counter,
        series: |s| Some(count(s.process_lookup_failures)),
    },
    Family {
        name: "gpumem_exporter_attribution_rejected",
        help: "GPU processes whose cgroup named a Slurm job, pod or container that was refused, by reason (cgroup_owner: a directory on the path owned by a non-root uid; cgroup_unverified: the path could not be checked under path.cgroupfs; cgroup_misplaced: the names out of their real place; container_pod_mismatch: the container belongs to another pod; slurm_owner: the job's owner is not the process's uid): their series keep the pid without job or pod labels.",
        kind: MetricType::Counter,
        series: |s| Some(by("reason", s.attribution_rejected.by_reason())),
    },
    // The torch bridge (processes.torch_bridge).
    Family {
        name: "gpumem_exporter_torch_reports",
        help: "Torch bridge documents accepted: messages on the bridge socket, and memfd reads of the fd fallback (at most one per process per full sample).",
        kind: MetricType::Counter,
        series: |s| s.torch.map(|t| count(t.reports)),
    },
    Family {
        name: "gpumem_exporter_torch_reports_dropped",
        help: "Torch bridge documents dropped: malformed (not the v1 JSON, wrong types, no socket header, not a sealed memfd), oversized (over 64 KiB), permission (the fd fallback may not read the process's fds; once per process), identity (a socket connection or message whose sender the kernel could not vouch for as the process that connected).",
        kind: MetricType::Counter,
        series: |s| {
            s.torch.map(|t| {
                by(
                    "reason",
                    [
                        ("malformed", t.malformed),
                        ("oversized", t.oversized),
                        ("permission", t.permission),
                        ("identity", t.identity),
                    ],
                )
            })
        },
    },
    Family {
        name: "gpumem_exporter_torch_bridge_connections",
        help: "Connections open on the torch bridge socket (processes.torch_bridge_socket); absent while it does not listen.",
        kind: MetricType::Gauge,
        series: |s| s.torch.and_then(|t| t.socket).map(|b| count(b.connections)),
    },
    Family {
        name: "gpumem_exporter_torch_bridge_limited",
        help: "Limits of the torch bridge socket at work, per budget holder (the peer's pod, container or Slurm job where its root-owned cgroup path names one, else its uid) and in all: connections (a connection closed at once: its holder had 64 open, or 512 were open in all), connects (closed at once: its holder connected more than 16 a second past a burst of 64), rate (a holder, or everyone, paused for passing 500 messages or 2 MiB a second per holder, 4000 or 16 MiB in all; the waiting messages stay in the socket), memory (a document not kept: its process is not on a GPU past 8 per holder, or the documents kept would pass 4 MiB per holder or 24 MiB in all), fds (a connection that passed file descriptors, closed; its holder refused for 60 s), idle (a connection closed after 180 s without a message).",
        kind: MetricType::Counter,
        series: |s| {
            s.torch.and_then(|t| t.socket).map(|b| {
                by(
                    "reason",
                    [
                        ("connections", b.limited_connections),
                        ("connects", b.limited_connects),
                        ("fds", b.limited_fds),
                        ("idle", b.idle_closed),
                        ("memory", b.limited_memory),
                        ("rate", b.limited_rate),
                    ],
                )
            })
        },
    },
    Family {
        name: "gpumem_exporter_torch_bridge_held_bytes",
        help: "Memory of the torch bridge documents the socket keeps now (their parsed size), at most 24 MiB.",
        kind: MetricType::Gauge,
        series: |s| s.torch.and_then(|t| t.socket).map(|b| count(b.held_bytes)),
    },
    Family {
        name: "gpumem_exporter_torch_bridge_stalled_seconds",
        help: "How long the torch bridge socket's listener has been stuck in one round: 0 unless over 2 s (its longest sleep is 0.5 s); /readyz fails meanwhile.",
        kind: MetricType::Gauge,
        series: |s| {
            s.torch
                .and_then(|t| t.socket)
                .map(|b| one(Value::Float(b.stalled_ms as f64 / 1000.0)))
        },
    },
    Family {
        name: "gpumem_exporter_torch_bridge_stalls",
        help: "Rounds of the torch bridge socket's listener that took over 2 s, counted when they end.",
        kind: MetricType::Counter,
        series: |s| s.torch.and_then(|t| t.socket).map(|b| count(b.stalls)),
    },
    Family {
        name: "gpumem_exporter_torch_bridge_close_waiting",
        help: "File descriptors the torch bridge socket hands to a thread of their own to close (passed fds and connections, on kernels before 6.16 that cannot refuse passed fds): a lingering TCP socket or a FUSE file waits there, not in the listener. Always 0 where the kernel refuses passed fds.",
        kind: MetricType::Gauge,
        series: |s| {
            s.torch
                .and_then(|t| t.socket)
                .map(|b| count(b.close_waiting))
        },
    },
    // The container engine (containers.engine_socket).
    Family {
        name: "gpumem_exporter_container_lookups",
        help: "Requests to the container engine's API (containers.engine_socket), by result: found, not_found (404: not asked again for 60s), error (no answer: socket missing or refused, timeout, unexpected status, malformed body; retried after 1s doubling to 30s). One per new container, never per scrape.",
        kind: MetricType::Counter,
        series: |s| {
            s.containers.map(|c| {
                by(
                    "result",
                    [
                        ("found", c.found),
                        ("not_found", c.not_found),
                        ("error", c.error),
                    ],
                )
            })
        },
    },
    // The pod watcher.
    Family {
        name: "gpumem_exporter_kubernetes_pods",
        help: "Pods of this node in the pod watcher's cache.",
        kind: MetricType::Gauge,
        series: |s| s.kubernetes.map(|k| count(k.pods)),
    },
    Family {
        name: "gpumem_exporter_kubernetes_synced",
        help: "1 once the pod watcher has listed this node's pods.",
        kind: MetricType::Gauge,
        series: |s| s.kubernetes.map(|k| count(u64::from(k.synced))),
    },
    Family {
        name: "gpumem_exporter_kubernetes_lists",
        help: "Full LISTs of this node's pods (start, and after a watch expired).",
        kind: MetricType::Counter,
        series: |s| s.kubernetes.map(|k| count(k.lists_total)),
    },
    Family {
        name: "gpumem_exporter_kubernetes_watch_restarts",
        help: "Pod watches re-established after a drop.",
        kind: MetricType::Counter,
        series: |s| s.kubernetes.map(|k| count(k.watch_restarts_total)),
    },
    Family {
        name: "gpumem_exporter_kubernetes_errors",
        help: "Errors talking to the Kubernetes API or parsing its answers.",
        kind: MetricType::Counter,
        series: |s| s.kubernetes.map(|k| count(k.errors_total)),
    },
    // The pod-resources client, then DRA (after the two above, so their
    // order is unchanged).
    Family {
        name: "gpumem_exporter_pod_resources_lists",
        help: "Answered List calls to the kubelet's pod-resources API (one every kubernetes.pod_resources_interval).",
        kind: MetricType::Counter,
        series: |s| s.pod_resources.as_ref().map(|p| count(p.lists_total)),
    },
    Family {
        name: "gpumem_exporter_pod_resources_errors",
        help: "Failed List calls to the kubelet's pod-resources API (no socket, no answer in time, an error status, an undecodable answer).",
        kind: MetricType::Counter,
        series: |s| s.pod_resources.as_ref().map(|p| count(p.errors_total)),
    },
    Family {
        name: "gpumem_exporter_dra_fallbacks",
        help: "DRA devices not found in this node's ResourceSlices, placed by the index in their name (gpu-<n>) or not at all; once per device per pod-resources answer.",
        kind: MetricType::Counter,
        series: |s| {
            s.pod_resources
                .as_ref()
                .map(|p| count(p.dra_fallbacks_total))
        },
    },
    Family {
        name: "gpumem_exporter_resource_slice_errors",
        help: "Failed requests of the ResourceSlice watcher (resource.k8s.io/v1, this node's slices; a 403 without RBAC for resourceslices included).",
        kind: MetricType::Counter,
        series: |s| {
            let p = s.pod_resources.as_ref()?;
            p.resource_slice_errors_total.map(count)
        },
    },
    // The Slurm job-mapping reader.
    Family {
        name: "gpumem_exporter_slurm_job_mapping_reads",
        help: "Reads of the Slurm job-mapping directory (one every slurm.job_mapping_interval).",
        kind: MetricType::Counter,
        series: |s| s.job_mapping.as_ref().map(|j| count(j.reads_total)),
    },
    Family {
        name: "gpumem_exporter_slurm_job_mapping_errors",
        help: "Slurm job-mapping entries skipped, by reason: read (directory or file unreadable), name (no device of the format), content (no valid job id), not_regular (a symlink, FIFO or device: never read), too_large (file over 4 KiB), too_many (over 1024 files), unsafe_dir (the directory refused: not owned by root, or writable by group or others).",
        kind: MetricType::Counter,
        series: |s| {
            s.job_mapping
                .as_ref()
                .map(|j| by("reason", j.errors.by_reason()))
        },
    },
    Family {
        name: "gpumem_exporter_last_sample_timestamp_seconds",
        help: "Unix time when the sample served now was taken; its age shows a stuck sampler.",
        kind: MetricType::Gauge,
        series: |s| {
            let ts = s
                .taken_at
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0);
            Some(one(Value::Float(ts)))
        },
    },
    Family {
        name: "gpumem_exporter_nvml_errors",
        help: "NVML calls that failed, by operation and error.",
        kind: MetricType::Counter,
        series: |s| {
            let series = s.nvml_errors.iter().map(|((op, err), n)| {
                let labels = Labels([("operation", op.label()), ("error", err.label())]);
                (labels, Value::Int(*n))
            });
            Some(series.collect())
        },
    },
    // The HTTP server's and web config's counters, copied into the snapshot
    // when it was published (crate::telemetry).
    Family {
        name: "gpumem_exporter_web_config_reloads",
        help: "Web config file (--web.config.file) reloads on SIGHUP; a failed one keeps the running config.",
        kind: MetricType::Counter,
        series: |s| {
            Some(by(
                "result",
                [
                    ("success", s.exporter.web_config_reloads_success),
                    ("failure", s.exporter.web_config_reloads_failure),
                ],
            ))
        },
    },
    Family {
        name: "gpumem_exporter_http_connections",
        help: "Open HTTP connections.",
        kind: MetricType::Gauge,
        series: |s| Some(count(s.exporter.http_connections_open)),
    },
    Family {
        name: "gpumem_exporter_http_connections_evicted",
        help: "HTTP connections not being answered (slow half-open ones first) closed to make room at a connection cap (http_server_config.max_connections or max_connections_per_ip).",
        kind: MetricType::Counter,
        series: |s| Some(count(s.exporter.http_connections_evicted)),
    },
    Family {
        name: "gpumem_exporter_http_connections_refused",
        help: "HTTP connections closed at once: at a cap with every connection (of that address) busy, or with the cap and its reserve full.",
        kind: MetricType::Counter,
        series: |s| Some(count(s.exporter.http_connections_refused)),
    },
    Family {
        name: "gpumem_exporter_http_body_encodes",
        help: "Response bodies encoded from a snapshot, by body (text, openmetrics, snapshot_json, history_json): at most one per snapshot each (history_json: per snapshot and seconds), however many requests ask.",
        kind: MetricType::Counter,
        series: |s| {
            let counts = HttpBody::ALL.map(|b| (b.label(), *s.exporter.http_body_encodes.get(b)));
            Some(by("body", counts))
        },
    },
];

impl Family {
    /// HELP, TYPE and every series, or nothing where the part is off.
    fn encode(&self, enc: &mut DescriptorEncoder, s: &Snapshot) -> fmt::Result {
        let Some(series) = (self.series)(s) else {
            return Ok(());
        };
        let mut m = enc.encode_descriptor(self.name, self.help, None, self.kind)?;
        for (labels, value) in &series {
            let mut m = m.encode_family(labels)?;
            match (self.kind, *value) {
                (MetricType::Counter, Value::Int(n)) => {
                    m.encode_counter::<NoLabelSet, _, u64>(&n, None)?
                }
                (MetricType::Counter, Value::Float(v)) => {
                    m.encode_counter::<NoLabelSet, _, u64>(&v, None)?
                }
                (_, Value::Int(n)) => m.encode_gauge(&n)?,
                (_, Value::Float(v)) => m.encode_gauge(&v)?,
            }
        }
        Ok(())
    }
}

/// A duration histogram without labels: the one shape a row of
/// [`FAMILIES`] does not have (buckets, sum and count).
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
    BUILD_INFO.encode(enc, s)?;
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
    for family in FAMILIES {
        family.encode(enc, s)?;
    }
    super::limits::sources(enc, s)
}
