use std::sync::Arc;
use std::time::UNIX_EPOCH;

use super::*;
use crate::model::{
    CgroupLimit, DeviceInfo, DeviceSample, MemoryInfo, PodLimit, ProcIdentity, Readings, SlurmJob,
    TorchStats,
};

const GPU0: &str = "GPU-00000000-0000-0000-0000-000000000000";
const GPU1: &str = "GPU-11111111-0000-0000-0000-000000000000";
const GIB: u64 = 1 << 30;

/// A process: pid, bytes, pod UID (or a Slurm job as `job:N`, or a user
/// as `user:x`), its cgroup, its torch limit.
struct P(u32, u64, &'static str, Option<&'static str>, Option<u64>);

fn sample(p: &P) -> ProcessSample {
    let mut ident = ProcIdentity {
        cgroup: p.3.map(Arc::from),
        ..Default::default()
    };
    if let Some(job) = p.2.strip_prefix("job:") {
        ident.slurm = Some(SlurmJob {
            job: Arc::from(job),
            ..Default::default()
        });
    } else if let Some(user) = p.2.strip_prefix("user:") {
        ident.user = Arc::from(user);
    } else {
        ident.pod_uid = Arc::from(p.2);
    }
    ProcessSample {
        pid: p.0,
        used_bytes: Some(p.1),
        ident: Arc::new(ident),
        gpu_instance_id: None,
        compute_instance_id: None,
        used_peak_bytes: None,
        torch: p.4.map(|limit| {
            Arc::new(TorchStats {
                limit: Some(limit),
                ..Default::default()
            })
        }),
        readings: Readings::default(),
    }
}

fn snap(gpus: &[(&str, &[P])], pods: Vec<PodLimit>, cgroups: Vec<CgroupLimit>) -> Snapshot {
    let mut s = Snapshot::empty(UNIX_EPOCH);
    for (i, (uuid, procs)) in gpus.iter().enumerate() {
        s.devices.push(DeviceSample {
            info: Arc::new(DeviceInfo {
                gpu: i.to_string(),
                uuid: uuid.to_string(),
                name: "NVIDIA H200".into(),
                pci_bus_id: String::new(),
                memory: Default::default(),
            }),
            memory: Some(MemoryInfo {
                total: 80 * GIB,
                reserved: Some(0),
                used: 0,
                free: 80 * GIB,
            }),
            used_peak_bytes: None,
            processes: procs.iter().map(sample).collect(),
            other: None,
            mig: Arc::from(Vec::new()),
            readings: Default::default(),
        });
    }
    s.limits.pods = Arc::new(pods);
    s.limits.cgroups = Arc::new(cgroups);
    s
}

fn pod(
    uid: &str,
    uuid: Option<&str>,
    source: LimitSource,
    kind: LimitKind,
    amount: Amount,
) -> PodLimit {
    PodLimit {
        pod_uid: Arc::from(uid),
        uuid: uuid.map(Arc::from),
        source,
        kind,
        amount,
    }
}

fn cg(
    cgroup: &str,
    at: &str,
    uuid: &str,
    source: LimitSource,
    kind: LimitKind,
    bytes: u64,
) -> CgroupLimit {
    CgroupLimit {
        cgroup: Arc::from(cgroup),
        at: Arc::from(at),
        uuid: Arc::from(uuid),
        source,
        kind,
        bytes,
    }
}

/// (gpu, workload's identifying label value, used, [(source, kind, bytes)]).
type Row = (usize, String, u64, Vec<(&'static str, &'static str, u64)>);

fn rows(s: &Snapshot) -> Vec<Row> {
    assemble(s)
        .into_iter()
        .map(|w| {
            let id = w
                .workload
                .labels()
                .into_iter()
                .filter(|(k, _)| *k == "pod_uid" || *k == "slurm_job" || *k == "container_id")
                .map(|(_, v)| v.to_string())
                .collect::<Vec<_>>()
                .join(",");
            (
                w.gpu,
                id,
                w.used,
                w.limits
                    .iter()
                    .map(|l| (l.source.label(), l.kind.label(), l.bytes))
                    .collect(),
            )
        })
        .collect()
}

use LimitKind::*;
use LimitSource::*;

#[test]
fn the_table_of_joins() {
    let a = "/kubepods/poda/c1";
    let a2 = "/kubepods/poda/c2";
    let cases: Vec<(&str, Snapshot, Vec<Row>)> = vec![
        (
            "no source: nothing",
            snap(&[(GPU0, &[P(1, GIB, "a", Some(a), None)])], vec![], vec![]),
            vec![],
        ),
        (
            "hami on its GPU, by the pod's UID",
            snap(
                &[(
                    GPU0,
                    &[P(1, GIB, "a", None, None), P(2, GIB, "b", None, None)],
                )],
                vec![pod("a", Some(GPU0), Hami, Hard, Amount::Bytes(20 * GIB))],
                vec![],
            ),
            vec![(0, "a".into(), GIB, vec![("hami", "hard", 20 * GIB)])],
        ),
        (
            "a limit on another GPU does not apply here",
            snap(
                &[(GPU0, &[P(1, GIB, "a", None, None)])],
                vec![pod("a", Some(GPU1), Hami, Hard, Amount::Bytes(20 * GIB))],
                vec![],
            ),
            vec![],
        ),
        (
            "kai's fraction of each GPU the pod uses",
            snap(
                &[
                    (GPU0, &[P(1, GIB, "a", None, None)]),
                    (GPU1, &[P(2, 2 * GIB, "a", None, None)]),
                ],
                vec![pod("a", None, Kai, Granted, Amount::Fraction(0.25))],
                vec![],
            ),
            vec![
                (0, "a".into(), GIB, vec![("kai", "granted", 20 * GIB)]),
                (1, "a".into(), 2 * GIB, vec![("kai", "granted", 20 * GIB)]),
            ],
        ),
        (
            "a fraction that is no number or not positive is no limit",
            snap(
                &[(GPU0, &[P(1, GIB, "a", None, None)])],
                vec![
                    pod("a", None, Kai, Granted, Amount::Fraction(f64::NAN)),
                    pod("a", None, Kai, Granted, Amount::Fraction(-1.0)),
                ],
                vec![],
            ),
            vec![],
        ),
        (
            "driver: one pod directory shared by two containers counts once",
            snap(
                &[(
                    GPU0,
                    &[
                        P(1, GIB, "a", Some(a), None),
                        P(2, GIB, "a", Some(a2), None),
                    ],
                )],
                vec![],
                vec![
                    cg(a, "/kubepods/poda", GPU0, Driver, Hard, 10 * GIB),
                    cg(a2, "/kubepods/poda", GPU0, Driver, Hard, 10 * GIB),
                ],
            ),
            vec![(0, "a".into(), 2 * GIB, vec![("driver", "hard", 10 * GIB)])],
        ),
        (
            "dmem per container: the pod's is their sum",
            snap(
                &[(
                    GPU0,
                    &[
                        P(1, GIB, "a", Some(a), None),
                        P(2, GIB, "a", Some(a2), None),
                    ],
                )],
                vec![],
                vec![
                    cg(a, a, GPU0, Dmem, Hard, 4 * GIB),
                    cg(a2, a2, GPU0, Dmem, Hard, 6 * GIB),
                ],
            ),
            vec![(0, "a".into(), 2 * GIB, vec![("dmem", "hard", 10 * GIB)])],
        ),
        (
            "a limit on only one of the workload's processes is not the workload's",
            snap(
                &[(
                    GPU0,
                    &[
                        P(1, GIB, "a", Some(a), None),
                        P(2, GIB, "a", Some(a2), None),
                    ],
                )],
                vec![],
                vec![cg(a, a, GPU0, Dmem, Hard, 4 * GIB)],
            ),
            vec![],
        ),
        (
            "a process without a vouched-for cgroup gets no cgroup limit",
            snap(
                &[(GPU0, &[P(1, GIB, "a", None, None)])],
                vec![],
                vec![cg(a, a, GPU0, Dmem, Hard, 4 * GIB)],
            ),
            vec![],
        ),
        (
            "a cgroup limit of another GPU does not apply",
            snap(
                &[(GPU0, &[P(1, GIB, "a", Some(a), None)])],
                vec![],
                vec![cg(a, a, GPU1, Dmem, Hard, 4 * GIB)],
            ),
            vec![],
        ),
        (
            "torch: a Slurm job's two processes, each limited",
            snap(
                &[(
                    GPU0,
                    &[
                        P(1, GIB, "job:7", None, Some(5 * GIB)),
                        P(2, GIB, "job:7", None, Some(3 * GIB)),
                    ],
                )],
                vec![],
                vec![],
            ),
            vec![(0, "7".into(), 2 * GIB, vec![("torch", "hard", 8 * GIB)])],
        ),
        (
            "torch: one of two processes unlimited: none",
            snap(
                &[(
                    GPU0,
                    &[
                        P(1, GIB, "job:7", None, Some(5 * GIB)),
                        P(2, GIB, "job:7", None, None),
                    ],
                )],
                vec![],
                vec![],
            ),
            vec![],
        ),
        (
            "a user is no workload with a limit",
            snap(
                &[(GPU0, &[P(1, GIB, "user:alice", None, Some(5 * GIB))])],
                vec![],
                vec![],
            ),
            vec![],
        ),
        (
            "several sources side by side, sorted",
            snap(
                &[(GPU0, &[P(1, GIB, "a", Some(a), Some(30 * GIB))])],
                vec![
                    pod("a", Some(GPU0), Dra, Hard, Amount::Bytes(40 * GIB)),
                    pod("a", None, Kai, Granted, Amount::Bytes(16 * GIB)),
                ],
                vec![
                    cg(a, "/kubepods/poda", GPU0, Driver, Hard, 24 * GIB),
                    cg(a, "/kubepods/poda", GPU0, Driver, Soft, 12 * GIB),
                ],
            ),
            vec![(
                0,
                "a".into(),
                GIB,
                vec![
                    ("driver", "hard", 24 * GIB),
                    ("driver", "soft", 12 * GIB),
                    ("dra", "hard", 40 * GIB),
                    ("kai", "granted", 16 * GIB),
                    ("torch", "hard", 30 * GIB),
                ],
            )],
        ),
    ];
    for (name, s, want) in cases {
        assert_eq!(rows(&s), want, "{name}");
    }
}

#[test]
fn a_pods_limit_never_reaches_another_pods_processes() {
    // Pod "evil" states a limit on GPU0 where pod "victim" runs: keyed by
    // the annotated pod's UID, it cannot become the victim's.
    let s = snap(
        &[(GPU0, &[P(1, GIB, "victim", None, None)])],
        vec![pod("evil", Some(GPU0), Hami, Hard, Amount::Bytes(GIB))],
        vec![],
    );
    assert_eq!(rows(&s), vec![]);
}

#[test]
fn the_lowest_hard_limit() {
    let w = WorkloadLimits {
        workload: Workload::SlurmJob {
            job: Arc::from("1"),
        },
        gpu: 0,
        uuid: Arc::from(GPU0),
        used: 0,
        limits: vec![
            Limit {
                source: Driver,
                kind: Soft,
                bytes: 1,
            },
            Limit {
                source: Dmem,
                kind: Hard,
                bytes: 9,
            },
            Limit {
                source: Torch,
                kind: Hard,
                bytes: 7,
            },
            Limit {
                source: Kai,
                kind: Granted,
                bytes: 2,
            },
        ],
        limit_in: None,
    };
    assert_eq!(w.hard(), Some(7));
}
