//! Memory held by the dead and by nobody, end to end: the fake NVML keeps
//! listing a pid while the fake /proc root says it exited (its entry
//! removed), turned zombie (`Z`) or stuck (`D`), or lost its parent (ppid
//! 1), or while the fake Kubernetes API deletes its pod or the job-mapping
//! file of its Slurm job goes; a pid that never had a /proc entry is never
//! `exited`; and `gpu_memory_unattributed_bytes` against the scenario.
//! Each reason is checked in `gpu_process_stale_info`, in
//! `gpu_memory_stale_bytes{reason}`, in `/api/v1/snapshot` and, with
//! `--features external-tools`, on the page in a real Chromium
//! ([`external`]).
//!
//! How many full samples passed is read from the exporter itself: a pid
//! missing from /proc adds one to `process_lookup_failures` (the API's
//! `gpumem_exporter_process_lookup_failures_total`) at each full sample,
//! in the same snapshot as the processes it describes.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::cluster::{self, FakeNode, cgroup_containerd, team_pods};
use crate::harness::*;

#[cfg(feature = "external-tools")]
mod external;

const GPU: &str = "GPU-5a1e5a1e-0000-0000-0000-000000000000";
const MIB: u64 = 1 << 20;
/// A live process beside the one under test, 8 GiB.
const LIVE: u32 = 4200;
const LIVE_BYTES: u64 = 8192 * MIB;
/// The process under test, 2 GiB.
const PID: u32 = 4201;
const PID_BYTES: u64 = 2048 * MIB;
/// 1 GiB held by no listed process.
const UNATTRIBUTED: u64 = 1024 * MIB;
const REASONS: [&str; 5] = [
    "exited",
    "zombie",
    "uninterruptible",
    "reparented",
    "owner_deleted",
];

/// One GPU using `used`, listing these (pid, bytes).
fn scenario(used: u64, procs: &[(u32, u64)]) -> String {
    let mut y = format!(
        "devices:\n  - uuid: {GPU}\n    name: NVIDIA H200\n    memory: {{total: 150754820096, reserved: 644939776, used: {used}}}\n    processes:"
    );
    if procs.is_empty() {
        y.push_str(" []\n");
    }
    for (pid, bytes) in procs {
        y.push_str(&format!("\n      - {{pid: {pid}, used: {bytes}}}"));
    }
    y.push('\n');
    y
}

/// [`LIVE`] and [`PID`] on the GPU, with 1 GiB unattributed.
fn two_processes() -> String {
    scenario(
        LIVE_BYTES + PID_BYTES + UNATTRIBUTED,
        &[(LIVE, LIVE_BYTES), (PID, PID_BYTES)],
    )
}

/// `/proc/<pid>/stat` of a process in `state` with parent `ppid`, its
/// start time unchanged (1000 + pid, as [`cluster::write_proc`] writes
/// it): the same process, seen again.
fn write_stat(root: &Path, pid: u32, comm: &str, state: char, ppid: u32) {
    let stat = format!(
        "{pid} ({comm}) {state} {ppid} {ppid} {ppid} 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {}\n",
        1000 + pid
    );
    let tmp = root.join(format!("{pid}.stat.tmp"));
    std::fs::write(&tmp, stat).unwrap();
    std::fs::rename(&tmp, root.join(pid.to_string()).join("stat")).unwrap();
}

/// A host process (no pod) of alice's.
fn host_proc(root: &Path, pid: u32, comm: &str) {
    let host = "0::/system.slice/train.service\n";
    cluster::write_proc(root, pid, comm, 1000, host, &[]);
}

/// A fake node with [`LIVE`] in /proc, and the scenario.
struct World {
    node: FakeNode,
    sc: Scenario,
}

impl World {
    fn new(yaml: &str) -> World {
        let node = FakeNode::start(team_pods());
        host_proc(node.proc_root.path(), LIVE, "sleep");
        World {
            node,
            sc: Scenario::new(yaml),
        }
    }

    fn root(&self) -> &Path {
        self.node.proc_root.path()
    }

    /// The exporter on this node without the pod watcher: full samples
    /// every `interval` (memory-only samples no more often), `processes`
    /// and `more` (top-level keys) in its config.
    fn start(&self, interval: &str, processes: &str, more: &str) -> Exporter {
        let config = self.node.base_config(&self.sc, processes).replace(
            "sample_interval: 100ms\n",
            &format!("sample_interval: {interval}\nmemory_sample_interval: {interval}\n"),
        );
        Exporter::with_config(&self.sc, &format!("{config}{more}"), &[])
    }
}

/// The API's snapshot (null before the first sample).
fn snapshot(ex: &Exporter) -> Value {
    let r = ex.get("/api/v1/snapshot");
    if r.status != 200 {
        return Value::Null;
    }
    serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("{e}: {}", r.body))
}

fn process(v: &Value, pid: u32) -> Option<&Value> {
    v["gpus"][0]["processes"]
        .as_array()?
        .iter()
        .find(|p| p["pid"] == pid)
}

/// The API's stale bytes with `bytes` for `reason` (none: all 0).
fn stale_bytes(reason: Option<&str>, bytes: u64) -> Value {
    let mut o = serde_json::Map::new();
    for r in REASONS {
        o.insert(r.into(), json!(if Some(r) == reason { bytes } else { 0 }));
    }
    Value::Object(o)
}

/// Wait until the API lists `pid` seen alive in /proc (named `comm`).
fn seen_alive(ex: &Exporter, pid: u32, comm: &str) -> Value {
    wait_for(Duration::from_secs(20), "the pid seen in /proc", || {
        let v = snapshot(ex);
        (process(&v, pid)?["process"] == comm).then_some(v)
    })
}

/// What a stale process should look like everywhere.
struct Held<'a> {
    pid: u32,
    comm: &'a str,
    reason: &'a str,
    bytes: u64,
    /// Labels of `gpu_process_stale_info` besides gpu, uuid, pid, process
    /// and reason.
    labels: &'a [(&'a str, &'a str)],
    /// The last owner on the page's "Held by the dead" table.
    owner: &'a str,
}

const GPU_LABELS: [(&str, &str); 2] = [("gpu", "0"), ("uuid", GPU)];

/// `h` in the API, the info series, the bytes per reason and the page;
/// the snapshot that first showed it.
fn check_held(ex: &Exporter, h: &Held) -> Value {
    let v = wait_for(Duration::from_secs(20), h.reason, || {
        let v = snapshot(ex);
        (process(&v, h.pid)?["stale"]["reason"] == h.reason).then_some(v)
    });
    // The API: the process's reason and since, its identity kept, the
    // GPU's bytes per reason, the unattributed rest.
    let p = process(&v, h.pid).unwrap();
    assert_eq!(p["process"], h.comm, "{p}");
    assert_eq!(p["memory_used_bytes"], h.bytes);
    let since = p["stale"]["since"].as_f64().unwrap();
    let taken = v["taken_at"].as_f64().unwrap();
    assert!(
        since <= taken + 0.01 && taken - since < 60.0,
        "since {since}, taken {taken}"
    );
    let g = &v["gpus"][0];
    assert_eq!(
        g["memory_stale_bytes"],
        stale_bytes(Some(h.reason), h.bytes),
        "{g}"
    );
    assert_eq!(g["memory_unattributed_bytes"], UNATTRIBUTED);
    assert_eq!(
        process(&v, LIVE).unwrap()["stale"],
        Value::Null,
        "the live one"
    );

    // The metrics: one info series with the identity, the bytes per reason.
    let m = ex.metrics();
    let pid = h.pid.to_string();
    let mut labels = vec![
        ("gpu", "0"),
        ("uuid", GPU),
        ("pid", pid.as_str()),
        ("process", h.comm),
        ("reason", h.reason),
    ];
    labels.extend_from_slice(h.labels);
    assert_eq!(
        m.get("gpu_process_stale_info", &labels),
        Some(1.0),
        "{}",
        m.text
    );
    assert_eq!(
        m.find("gpu_process_stale_info", &[]).len(),
        1,
        "only {pid}:\n{}",
        m.text
    );
    for r in REASONS {
        let want = if r == h.reason { h.bytes } else { 0 };
        let mut l = GPU_LABELS.to_vec();
        l.push(("reason", r));
        assert_eq!(m.get_u64("gpu_memory_stale_bytes", &l), Some(want), "{r}");
    }
    assert_eq!(
        m.get_u64("gpu_memory_unattributed_bytes", &GPU_LABELS),
        Some(UNATTRIBUTED)
    );

    #[cfg(feature = "external-tools")]
    external::page_shows(
        ex,
        &[LIVE, h.pid],
        &[(h.pid, h.reason, h.bytes, h.owner)],
        Some(&external::segments(LIVE_BYTES, UNATTRIBUTED, h.bytes)),
    );
    #[cfg(not(feature = "external-tools"))]
    let _ = h.owner;
    v
}

/// The pid under test is alice's python3 on the host.
fn alice(reason: &'static str) -> Held<'static> {
    Held {
        pid: PID,
        comm: "python3",
        reason,
        bytes: PID_BYTES,
        labels: &[("user", "alice")],
        owner: "python3, user alice",
    }
}

/// Removed from /proc while NVML still lists it: nothing after one full
/// sample without it (the read may race the exit), `exited` after two,
/// since the first, with the name and user it had.
#[test]
fn a_pid_gone_from_proc_is_exited_after_two_full_samples_and_not_after_one() {
    let w = World::new(&two_processes());
    host_proc(w.root(), PID, "python3");
    // Half a second between full samples: room to read the snapshot of
    // the first sample without it, from the API and /metrics.
    let ex = w.start("500ms", "", "");
    let v = seen_alive(&ex, PID, "python3");
    assert_eq!(process(&v, PID).unwrap()["stale"], Value::Null);
    let failures = |v: &Value| v["process_lookup_failures"].as_u64().unwrap();
    let before = failures(&v);
    std::fs::remove_dir_all(w.root().join(PID.to_string())).unwrap();

    let mut one_missing = 0;
    let mut first_missing_at = None;
    let two_missing = wait_for(Duration::from_secs(20), "two missing samples", || {
        let v = snapshot(&ex);
        let missing = failures(&v) - before;
        let p = process(&v, PID).expect("still listed");
        match missing {
            0 => assert_eq!(p["stale"], Value::Null, "{p}"),
            1 => {
                assert_eq!(p["stale"], Value::Null, "one missing sample: {p}");
                assert_eq!(p["process"], "python3", "the identity it had");
                assert_eq!(v["gpus"][0]["memory_stale_bytes"], stale_bytes(None, 0));
                first_missing_at.get_or_insert(v["taken_at"].as_f64().unwrap());
                // The same snapshot's metrics: no info series, no bytes.
                let m = ex.metrics();
                let t = m.get("gpumem_exporter_last_sample_timestamp_seconds", &[]);
                if t.is_some_and(|t| (t - v["taken_at"].as_f64().unwrap()).abs() < 0.002) {
                    assert!(
                        m.find("gpu_process_stale_info", &[]).is_empty(),
                        "{}",
                        m.text
                    );
                    let mut l = GPU_LABELS.to_vec();
                    l.push(("reason", "exited"));
                    assert_eq!(m.get_u64("gpu_memory_stale_bytes", &l), Some(0));
                    one_missing += 1;
                }
            }
            _ => return Some(v),
        }
        None
    });
    assert!(
        one_missing > 0,
        "the snapshot of the first sample without the pid was read in the API and /metrics"
    );
    assert_eq!(
        failures(&two_missing) - before,
        2,
        "not later than the second"
    );
    let p = process(&two_missing, PID).unwrap();
    assert_eq!(p["stale"]["reason"], "exited", "{p}");
    assert_eq!(p["user"], "alice", "the identity it had");
    // Since the first sample that missed it: the wall clock of its /proc
    // read, within that sample (a sample is 500 ms from the next).
    let since = p["stale"]["since"].as_f64().unwrap();
    let first = first_missing_at.unwrap();
    assert!(
        (first - 0.1..first + 0.4).contains(&since),
        "since {since}, first missing sample taken at {first}"
    );
    let v = check_held(&ex, &alice("exited"));
    assert_eq!(process(&v, PID).unwrap()["stale"]["since"], since);
}

/// A pid NVML lists that never had a /proc entry (another pid namespace)
/// is never `exited`, however many samples miss it.
#[test]
fn a_pid_that_never_had_a_proc_entry_is_never_exited() {
    let w = World::new(&two_processes());
    let ex = w.start("100ms", "", "");
    seen_alive(&ex, LIVE, "sleep");
    let v = wait_for(Duration::from_secs(20), "six missed samples", || {
        let v = snapshot(&ex);
        (v["process_lookup_failures"].as_u64()? >= 6).then_some(v)
    });
    let p = process(&v, PID).unwrap();
    assert_eq!(p["stale"], Value::Null, "{p}");
    assert_eq!(p["process"], "", "never named");
    assert_eq!(v["gpus"][0]["memory_stale_bytes"], stale_bytes(None, 0));
    assert_eq!(v["gpus"][0]["memory_unattributed_bytes"], UNATTRIBUTED);
    let m = ex.metrics();
    assert!(
        m.find("gpu_process_stale_info", &[]).is_empty(),
        "{}",
        m.text
    );
    for r in REASONS {
        let mut l = GPU_LABELS.to_vec();
        l.push(("reason", r));
        assert_eq!(m.get_u64("gpu_memory_stale_bytes", &l), Some(0), "{r}");
    }
    let held = m.find("gpu_process_memory_used_bytes", &[("pid", "4201")]);
    assert_eq!(held.len(), 1, "still exported by pid:\n{}", m.text);
    assert_eq!(held[0].1, PID_BYTES as f64);
    #[cfg(feature = "external-tools")]
    external::page_shows(
        &ex,
        &[LIVE, PID],
        &[],
        Some(&external::segments(LIVE_BYTES + PID_BYTES, UNATTRIBUTED, 0)),
    );
}

/// `Z` in its stat: a zombie at once, since the first sample that saw it
/// so (the same figure in later snapshots).
#[test]
fn a_zombie_in_stat_is_zombie_since_it_was_first_seen_so() {
    let w = World::new(&two_processes());
    host_proc(w.root(), PID, "python3");
    let ex = w.start("100ms", "", "");
    seen_alive(&ex, PID, "python3");
    write_stat(w.root(), PID, "python3", 'Z', 1);
    let v = check_held(&ex, &alice("zombie"));
    let since = &process(&v, PID).unwrap()["stale"]["since"];
    let taken = v["taken_at"].clone();
    let later = wait_for(Duration::from_secs(10), "a later snapshot", || {
        let v = snapshot(&ex);
        (v["taken_at"] != taken).then_some(v)
    });
    assert_eq!(&process(&later, PID).unwrap()["stale"]["since"], since);
}

/// `D` in its stat: `uninterruptible` once it has been in D for
/// `processes.uninterruptible_after` (2 s here), not before.
#[test]
fn a_process_in_d_is_uninterruptible_after_the_configured_time_not_before() {
    let w = World::new(&two_processes());
    host_proc(w.root(), PID, "python3");
    let ex = w.start("100ms", "  uninterruptible_after: 2s\n", "");
    seen_alive(&ex, PID, "python3");
    let written = unix_now();
    write_stat(w.root(), PID, "python3", 'D', 1);
    // Every snapshot until it is stale: (taken_at, stale?).
    let mut seen = Vec::new();
    let v = wait_for(Duration::from_secs(20), "uninterruptible", || {
        let v = snapshot(&ex);
        let p = process(&v, PID)?;
        seen.push((v["taken_at"].as_f64()?, p["stale"].clone()));
        (p["stale"]["reason"] == "uninterruptible").then_some(v)
    });
    let since = process(&v, PID).unwrap()["stale"]["since"]
        .as_f64()
        .unwrap();
    assert!(since >= written - 0.01, "since {since}, D from {written}");
    for (taken, stale) in &seen[..seen.len() - 1] {
        assert_eq!(*stale, Value::Null, "at {taken}");
    }
    let in_d_not_yet: Vec<f64> = seen
        .iter()
        .map(|(t, _)| *t)
        .filter(|t| *t > since + 0.2 && *t < since + 1.8)
        .collect();
    assert!(
        !in_d_not_yet.is_empty(),
        "snapshots in D under 2 s were read, and not stale: {seen:?}"
    );
    let first_stale = seen.last().unwrap().0;
    assert!(
        first_stale >= since + 1.9 && first_stale < since + 3.0,
        "stale at {first_stale}, in D since {since}"
    );
    check_held(&ex, &alice("uninterruptible"));
}

/// Its parent pid turns 1 (the parent died): `reparented`.
#[test]
fn a_parent_pid_changed_to_1_is_reparented() {
    let w = World::new(&two_processes());
    host_proc(w.root(), PID, "python3");
    write_stat(w.root(), PID, "python3", 'S', 4100);
    let ex = w.start("100ms", "", "");
    let v = seen_alive(&ex, PID, "python3");
    assert_eq!(process(&v, PID).unwrap()["stale"], Value::Null);
    write_stat(w.root(), PID, "python3", 'S', 1);
    check_held(&ex, &alice("reparented"));
}

/// Its pod deleted in the API (a DELETED event on the watch):
/// `owner_deleted`, with the pod it had.
#[test]
fn a_pod_deleted_in_the_api_leaves_its_process_owner_deleted() {
    let mut w = World::new(&two_processes());
    let cgroup = cgroup_containerd('a');
    cluster::write_proc(w.root(), PID, "python3", 1000, &cgroup, &[]);
    let config = w.node.config(&w.sc, "");
    let ex = Exporter::with_config(&w.sc, &config, &[]);
    wait_for(Duration::from_secs(20), "the pod resolved", || {
        let v = snapshot(&ex);
        (process(&v, PID)?["pod"] == "trainer-0").then_some(())
    });
    let v = snapshot(&ex);
    assert_eq!(process(&v, PID).unwrap()["stale"], Value::Null);
    w.node.delete("trainer-0");
    check_held(
        &ex,
        &Held {
            labels: &[
                ("user", "alice"),
                ("namespace", "team-a"),
                ("pod", "trainer-0"),
                ("container", "trainer"),
            ],
            owner: "python3, pod team-a/trainer-0 (trainer)",
            ..alice("owner_deleted")
        },
    );
}

/// Its Slurm job's file removed from the job-mapping directory (the
/// epilog ran) after it was listed there: `owner_deleted`.
#[test]
fn a_job_map_file_removed_leaves_its_process_owner_deleted() {
    let w = World::new(&two_processes());
    cluster::write_proc(
        w.root(),
        PID,
        "python3",
        0,
        "5:freezer:/slurm_node1/uid_0/job_42/step_0\n",
        &[],
    );
    let jobs = w.sc.dir.path().join("jobs");
    std::fs::create_dir_all(&jobs).unwrap();
    std::fs::write(jobs.join("0"), "42\n").unwrap();
    let ex = w.start(
        "100ms",
        "",
        &format!(
            "slurm:\n  job_mapping_dir: {}\n  job_mapping_interval: 100ms\n",
            jobs.display()
        ),
    );
    // Listed by the job map (its allocation row), then a full sample more
    // with the process in that job.
    wait_for(Duration::from_secs(20), "the job mapped", || {
        let m = ex.metrics();
        let listed = !m
            .find("gpu_allocation_info", &[("slurm_job", "42")])
            .is_empty();
        let v = snapshot(&ex);
        (listed && process(&v, PID)?["slurm_job"] == "42").then_some(())
    });
    let v = snapshot(&ex);
    assert_eq!(process(&v, PID).unwrap()["stale"], Value::Null);
    let taken = v["taken_at"].clone();
    wait_for(Duration::from_secs(10), "a later snapshot", || {
        (snapshot(&ex)["taken_at"] != taken).then_some(())
    });
    std::fs::remove_file(jobs.join("0")).unwrap();
    check_held(
        &ex,
        &Held {
            labels: &[("user", "root"), ("slurm_job", "42")],
            owner: "python3, Slurm job 42.0",
            ..alice("owner_deleted")
        },
    );
}

/// Used minus the listed processes' bytes: all of it with no process
/// (`processes: []`), the rest beside two processes.
#[test]
fn unattributed_is_used_minus_the_processes_sum() {
    let used = 5000 * MIB + 123;
    let w = World::new(&scenario(used, &[]));
    let ex = w.start("100ms", "", "");
    let unattributed = |m: &Metrics| m.get_u64("gpu_memory_unattributed_bytes", &GPU_LABELS);
    let m = wait_for(Duration::from_secs(20), "the first full sample", || {
        let m = ex.metrics();
        unattributed(&m).is_some().then_some(m)
    });
    assert_eq!(unattributed(&m), Some(used), "no process: all of it");
    let v = snapshot(&ex);
    assert_eq!(v["gpus"][0]["memory_unattributed_bytes"], used);
    assert_eq!(v["gpus"][0]["memory_stale_bytes"], stale_bytes(None, 0));

    host_proc(w.root(), PID, "python3");
    let (a, b) = (3000 * MIB + 7, 1500 * MIB + 11);
    let used2 = 7000 * MIB + 1;
    w.sc.write(&scenario(used2, &[(LIVE, a), (PID, b)]));
    let m = wait_for(Duration::from_secs(20), "two processes", || {
        let m = ex.metrics();
        (m.find("gpu_process_memory_used_bytes", &[]).len() == 2).then_some(m)
    });
    assert_eq!(unattributed(&m), Some(used2 - a - b));
    let v = wait_for(Duration::from_secs(10), "two processes in the API", || {
        let v = snapshot(&ex);
        (v["gpus"][0]["processes"].as_array()?.len() == 2).then_some(v)
    });
    assert_eq!(v["gpus"][0]["memory_unattributed_bytes"], used2 - a - b);
    assert_eq!(v["gpus"][0]["memory"]["used_bytes"], used2);
    #[cfg(feature = "external-tools")]
    external::page_shows(
        &ex,
        &[LIVE, PID],
        &[],
        Some(&external::segments(a + b, used2 - a - b, 0)),
    );
}
