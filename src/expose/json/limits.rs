//! `/api/v1/snapshot`'s limits: per GPU, its workloads with a limit of
//! their own (`gpus[].limits`, the rows of `gpu_workload_memory_limit_bytes`
//! and its siblings), and at the top level which limit sources were looked
//! for and found (`limit_sources`, `gpumem_exporter_limit_sources`).
//! Serialized straight from the snapshot's rows: nothing is collected.

use serde::Serialize;
use serde::ser::{SerializeMap, Serializer};

use crate::model::{Limit, LimitSource, LimitSources, WorkloadLimits};

/// `gpus[].limits`: the rows of the GPU at position `gpu`.
pub(super) struct OnGpu<'a> {
    pub(super) rows: &'a [WorkloadLimits],
    pub(super) gpu: usize,
}

impl Serialize for OnGpu<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.rows.iter().filter(|w| w.gpu == self.gpu).map(Row::of))
    }
}

/// One workload with a limit on one GPU.
#[derive(Serialize)]
struct Row<'a> {
    /// `pod`, `slurm_job` or `container` (a user has no limit of its own).
    kind: &'static str,
    namespace: Option<&'a str>,
    pod: Option<&'a str>,
    pod_uid: Option<&'a str>,
    slurm_job: Option<&'a str>,
    container_id: Option<&'a str>,
    used_bytes: u64,
    limits: Limits<'a>,
    hard_limit_bytes: Option<u64>,
    to_limit_bytes: Option<u64>,
    limit_in_seconds: Option<f64>,
}

impl<'a> Row<'a> {
    fn of(w: &'a WorkloadLimits) -> Self {
        let hard = w.hard();
        let ids = super::WorkloadIds::of(&w.workload);
        Row {
            kind: ids.kind,
            namespace: ids.namespace,
            pod: ids.pod,
            pod_uid: ids.pod_uid,
            slurm_job: ids.slurm_job,
            container_id: ids.container_id,
            used_bytes: w.used,
            limits: Limits(&w.limits),
            hard_limit_bytes: hard,
            to_limit_bytes: hard.map(|h| h.saturating_sub(w.used)),
            limit_in_seconds: w.limit_in.map(|f| f.full_in_seconds),
        }
    }
}

/// `[{source, kind, bytes}]`, sorted by source, then kind.
struct Limits<'a>(&'a [Limit]);

impl Serialize for Limits<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct One {
            source: &'static str,
            kind: &'static str,
            bytes: u64,
        }
        s.collect_seq(self.0.iter().map(|l| One {
            source: l.source.label(),
            kind: l.kind.label(),
            bytes: l.bytes,
        }))
    }
}

/// `limit_sources`: `{"driver": false, "torch": true, …}`, only the
/// sources looked for (an input that is off has no key).
pub(super) struct Sources(pub(super) LimitSources);

impl Serialize for Sources {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        for src in LimitSource::ALL {
            if let Some(found) = self.0.get(src) {
                map.serialize_entry(src.label(), &found)?;
            }
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, UNIX_EPOCH};

    use serde_json::{Value, json};

    use crate::model::{
        DeviceInfo, DeviceSample, Forecast, Limit, LimitKind, LimitSource, Snapshot, Workload,
        WorkloadLimits,
    };

    const GIB: u64 = 1 << 30;

    fn gpus(n: usize) -> Snapshot {
        let mut s = Snapshot::empty(UNIX_EPOCH + Duration::from_secs(7));
        for i in 0..n {
            s.devices.push(DeviceSample {
                info: Arc::new(DeviceInfo::unknown(i)),
                memory: None,
                used_peak_bytes: None,
                processes: Arc::new([]),
                other: None,
                mig: Arc::new([]),
                readings: Default::default(),
            });
        }
        s
    }

    fn doc(s: &Snapshot) -> Value {
        let bytes = super::super::snapshot(s, Duration::from_secs(1)).unwrap_or_default();
        serde_json::from_slice(&bytes).unwrap_or_default()
    }

    fn pod(ns: &str, name: &str, uid: &str) -> Workload {
        Workload::Pod {
            namespace: Arc::from(ns),
            pod: Arc::from(name),
            pod_uid: Arc::from(uid),
        }
    }

    fn limit(source: LimitSource, kind: LimitKind, bytes: u64) -> Limit {
        Limit {
            source,
            kind,
            bytes,
        }
    }

    /// Each row as the API writes it: (workload, used, limits, forecast)
    /// → the object in `gpus[].limits`.
    #[test]
    fn each_workloads_limits_hard_headroom_and_forecast() {
        use LimitKind::*;
        use LimitSource::*;
        type Case = (Workload, u64, Vec<Limit>, Option<f64>, Value);
        let cases: Vec<Case> = vec![
            // Two hard limits: the lowest counts; a soft one beside them.
            (
                pod("team-a", "trainer-0", "uid-a"),
                12 * GIB,
                vec![
                    limit(Driver, Hard, 20 * GIB),
                    limit(Driver, Soft, 16 * GIB),
                    limit(Torch, Hard, 18 * GIB),
                ],
                Some(96.5),
                json!({
                    "kind": "pod", "namespace": "team-a", "pod": "trainer-0", "pod_uid": "uid-a",
                    "slurm_job": null, "container_id": null,
                    "used_bytes": 12 * GIB,
                    "limits": [
                        {"source": "driver", "kind": "hard", "bytes": 20 * GIB},
                        {"source": "driver", "kind": "soft", "bytes": 16 * GIB},
                        {"source": "torch", "kind": "hard", "bytes": 18 * GIB},
                    ],
                    "hard_limit_bytes": 18 * GIB, "to_limit_bytes": 6 * GIB,
                    "limit_in_seconds": 96.5,
                }),
            ),
            // Over its hard limit: no negative headroom.
            (
                Workload::SlurmJob {
                    job: Arc::from("4242"),
                },
                21 * GIB,
                vec![limit(Dmem, Hard, 20 * GIB)],
                None,
                json!({
                    "kind": "slurm_job", "namespace": null, "pod": null, "pod_uid": null,
                    "slurm_job": "4242", "container_id": null,
                    "used_bytes": 21 * GIB,
                    "limits": [{"source": "dmem", "kind": "hard", "bytes": 20 * GIB}],
                    "hard_limit_bytes": 20 * GIB, "to_limit_bytes": 0,
                    "limit_in_seconds": null,
                }),
            ),
            // A granted share only: no hard limit, no headroom, no forecast.
            (
                Workload::Container {
                    container_id: Arc::from("c0ffee"),
                },
                GIB,
                vec![limit(Kai, Granted, 40 * GIB)],
                None,
                json!({
                    "kind": "container", "namespace": null, "pod": null, "pod_uid": null,
                    "slurm_job": null, "container_id": "c0ffee",
                    "used_bytes": GIB,
                    "limits": [{"source": "kai", "kind": "granted", "bytes": 40 * GIB}],
                    "hard_limit_bytes": null, "to_limit_bytes": null,
                    "limit_in_seconds": null,
                }),
            ),
            // A pod whose names the watcher does not know yet: its UID.
            (
                pod("", "", "uid-b"),
                0,
                vec![limit(Hami, Hard, 8 * GIB)],
                None,
                json!({
                    "kind": "pod", "namespace": null, "pod": null, "pod_uid": "uid-b",
                    "slurm_job": null, "container_id": null,
                    "used_bytes": 0,
                    "limits": [{"source": "hami", "kind": "hard", "bytes": 8 * GIB}],
                    "hard_limit_bytes": 8 * GIB, "to_limit_bytes": 8 * GIB,
                    "limit_in_seconds": null,
                }),
            ),
        ];
        for (i, (workload, used, limits, limit_in, want)) in cases.into_iter().enumerate() {
            let mut s = gpus(1);
            s.limits.workloads = Arc::new(vec![WorkloadLimits {
                uuid: Arc::from(s.devices[0].info.uuid.as_str()),
                workload,
                gpu: 0,
                used,
                limits,
                limit_in: limit_in.map(|full_in_seconds| Forecast {
                    full_in_seconds,
                    growth_bytes_per_second: 1e6,
                    window_seconds: 60,
                }),
            }]);
            assert_eq!(doc(&s)["gpus"][0]["limits"], json!([want]), "case {i}");
        }
    }

    /// Each GPU lists its own rows, in the snapshot's order; a GPU without
    /// any has `[]`.
    #[test]
    fn rows_go_to_their_gpu() {
        let mut s = gpus(3);
        let row = |gpu: usize, uid: &str| WorkloadLimits {
            workload: pod("ns", uid, uid),
            gpu,
            uuid: Arc::from(""),
            used: 1,
            limits: vec![limit(LimitSource::Driver, LimitKind::Hard, 2)],
            limit_in: None,
        };
        s.limits.workloads = Arc::new(vec![row(0, "a"), row(2, "b"), row(2, "c")]);
        let v = doc(&s);
        let uids = |g: usize| -> Vec<Value> {
            v["gpus"][g]["limits"]
                .as_array()
                .map(|r| r.iter().map(|w| w["pod_uid"].clone()).collect())
                .unwrap_or_default()
        };
        assert_eq!(uids(0), [json!("a")]);
        assert_eq!(v["gpus"][1]["limits"], json!([]));
        assert_eq!(uids(2), [json!("b"), json!("c")]);
    }

    /// Only the sources looked for, each found or not.
    #[test]
    fn limit_sources_name_only_those_looked_for() {
        let mut s = gpus(1);
        assert_eq!(doc(&s)["limit_sources"], json!({}));
        s.limits.sources.set(LimitSource::Driver, false);
        s.limits.sources.set(LimitSource::Dmem, true);
        s.limits.sources.set(LimitSource::Torch, true);
        assert_eq!(
            doc(&s)["limit_sources"],
            json!({"driver": false, "dmem": true, "torch": true})
        );
        assert_eq!(doc(&s)["gpus"][0]["limits"], json!([]));
    }
}
