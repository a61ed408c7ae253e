//! The ledger's counters end to end (issue 37): byte-seconds of a process
//! holding exactly X bytes, across a SIGHUP; its pod's total after it
//! exits; idle seconds of an allocated GPU (a Slurm job-mapping row) until
//! a process of its job appears; every counter monotonic through GPU loss
//! and a driver reload. Processes come from a fake /proc root (a pod's
//! cgroup, a Slurm job's cgroup), so attribution is the real code's.
//!
//! Rates are measured between two scrapes against the served snapshot's
//! own time (`gpumem_exporter_last_sample_timestamp_seconds`), so they do
//! not depend on how long a scrape took.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::harness::cluster::{cgroup_containerd, pod_uid, write_proc};
use crate::harness::*;

const UUID0: &str = "GPU-acc00000-0000-0000-0000-000000000000";
const UUID1: &str = "GPU-acc11111-0000-0000-0000-000000000000";
const X: u64 = 3 << 30;
const POD_PID: u32 = 4100;
const JOB_PID: u32 = 4200;

/// GPU 0 with the pod's process holding X bytes (or not); GPU 1 with the
/// Slurm job's process (or not); `top` for the driver-wide knobs and
/// `error0` GPU 0's error knob.
fn scenario(top: &str, pod: bool, job: bool, error0: &str) -> String {
    let procs = |on: bool, pid: u32| {
        if on {
            format!("\n      - {{pid: {pid}, used: {X}}}\n")
        } else {
            " []\n".to_string()
        }
    };
    format!(
        "{top}devices:\n  - uuid: {UUID0}\n    memory: {{total: 100000000000, reserved: 0, used: {}}}\n    utilization: {{gpu: 40, memory: 10}}\n    error: {error0}\n    processes:{}  - uuid: {UUID1}\n    memory: {{total: 100000000000, reserved: 0, used: {}}}\n    processes:{}",
        if pod { X } else { 0 },
        procs(pod, POD_PID),
        if job { X } else { 0 },
        procs(job, JOB_PID),
    )
}

struct Node {
    sc: Scenario,
    ex: Exporter,
}

fn start() -> Node {
    let sc = Scenario::new(&scenario("", true, false, "null"));
    let proc_root = sc.dir.path().join("proc");
    write_proc(&proc_root, POD_PID, "python3", 0, &cgroup_containerd('a'), &[]);
    write_proc(
        &proc_root,
        JOB_PID,
        "python3",
        0,
        "5:freezer:/slurm_node1/uid_0/job_42/step_0\n",
        &[],
    );
    let jobs = sc.dir.path().join("jobs");
    std::fs::create_dir_all(&jobs).expect("job dir");
    std::fs::write(jobs.join("1"), "42\n").expect("job file");
    let config = format!(
        "sample_interval: 500ms\npath:\n  procfs: {}\nslurm:\n  job_mapping_dir: {}\n  job_mapping_interval: 200ms\n",
        proc_root.display(),
        jobs.display()
    );
    let ex = Exporter::with_config(&sc, &config, &[]);
    Node { sc, ex }
}

/// One scrape: (the served snapshot's time, the metrics).
fn scrape(ex: &Exporter) -> (f64, Metrics) {
    let m = ex.metrics();
    let t = m
        .get("gpumem_exporter_last_sample_timestamp_seconds", &[])
        .expect("sample timestamp");
    (t, m)
}

fn one(m: &Metrics, name: &str, labels: &[(&str, &str)]) -> f64 {
    let found = m.find(name, labels);
    assert_eq!(found.len(), 1, "{name} {labels:?}: {found:?}\n{}", m.text);
    found[0].1
}

/// Within 0.5 % of `want`.
fn within(got: f64, want: f64, what: &str) {
    let err = (got - want).abs() / want;
    eprintln!("{what}: got {got:.1}, want {want:.1}, off by {:.4} %", err * 100.0);
    assert!(err <= 0.005, "{what}: got {got}, want {want} ({:.3} % off)", err * 100.0);
}

/// Every counter of the ledger, by series.
fn counters(m: &Metrics) -> BTreeMap<String, f64> {
    m.samples
        .iter()
        .filter(|(k, _)| {
            k.contains("_byte_seconds_total")
                || k.contains("_busy_seconds_total")
                || k.starts_with("gpu_allocation_seconds_total")
                || k.starts_with("gpu_allocation_idle_seconds_total")
        })
        .map(|(k, v)| (k.clone(), v.parse().unwrap_or(f64::NAN)))
        .collect()
}

/// No series of `before` went down in `after` (a series may be absent).
fn monotonic(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>, what: &str) {
    for (k, v) in before {
        if let Some(w) = after.get(k) {
            assert!(w >= v, "{what}: {k} went from {v} to {w}");
        }
    }
}

#[test]
fn byte_seconds_are_exact_across_sighup_and_outlive_the_process_in_its_pod() {
    let mut node = start();
    let pod = pod_uid('a');
    let proc_labels = [("uuid", UUID0), ("pid", "4100")];
    let pod_labels = [("uuid", UUID0), ("pod_uid", pod.as_str())];
    let gpu0 = [("gpu", "0"), ("uuid", UUID0)];
    wait_for(Duration::from_secs(10), "the process's counter", || {
        (!ex_find(&node.ex, "gpu_process_memory_used_byte_seconds_total", &proc_labels)).then_some(())
    });
    let (t1, m1) = scrape(&node.ex);
    std::thread::sleep(Duration::from_millis(1500));
    node.ex.signal_only("HUP");
    std::thread::sleep(Duration::from_millis(2500));
    let (t2, m2) = scrape(&node.ex);
    let span = t2 - t1;
    assert!(span > 3.5, "{span}");
    let want = X as f64 * span;
    for (name, labels) in [
        ("gpu_process_memory_used_byte_seconds_total", &proc_labels[..]),
        ("gpu_workload_memory_used_byte_seconds_total", &pod_labels[..]),
        ("gpu_memory_used_byte_seconds_total", &gpu0[..]),
    ] {
        within(one(&m2, name, labels) - one(&m1, name, labels), want, name);
    }
    within(
        one(&m2, "gpu_busy_seconds_total", &gpu0) - one(&m1, "gpu_busy_seconds_total", &gpu0),
        0.4 * span,
        "gpu_busy_seconds_total",
    );
    within(
        one(&m2, "gpu_workload_busy_seconds_total", &pod_labels)
            - one(&m1, "gpu_workload_busy_seconds_total", &pod_labels),
        0.4 * span,
        "gpu_workload_busy_seconds_total",
    );
    assert_eq!(
        m2.get("gpumem_exporter_config_reloads_total", &[("result", "success")]),
        Some(1.0),
        "the SIGHUP reloaded the config in between"
    );

    // The process exits: its series goes, its pod's total stays as it was.
    node.sc.write(&scenario("", false, false, "null"));
    let (_, gone) = wait_for(Duration::from_secs(10), "the process gone", || {
        let (t, m) = scrape(&node.ex);
        m.find("gpu_process_memory_used_byte_seconds_total", &proc_labels)
            .is_empty()
            .then_some((t, m))
    });
    let kept = one(&gone, "gpu_workload_memory_used_byte_seconds_total", &pod_labels);
    assert!(kept >= one(&m2, "gpu_workload_memory_used_byte_seconds_total", &pod_labels));
    std::thread::sleep(Duration::from_millis(1000));
    let (_, later) = scrape(&node.ex);
    assert_eq!(
        one(&later, "gpu_workload_memory_used_byte_seconds_total", &pod_labels),
        kept,
        "no process of the pod: its total stands still"
    );
    let _ = node.ex.signal("TERM");
}

fn ex_find(ex: &Exporter, name: &str, labels: &[(&str, &str)]) -> bool {
    ex.metrics().find(name, labels).is_empty()
}

#[test]
fn an_allocated_gpu_without_its_jobs_process_is_idle_until_one_appears_and_counters_survive_faults()
{
    let node = start();
    let row = [("uuid", UUID1), ("slurm_job", "42")];
    wait_for(Duration::from_secs(10), "the allocation row's counters", || {
        (!ex_find(&node.ex, "gpu_allocation_idle_seconds_total", &row)).then_some(())
    });
    let (t1, m1) = scrape(&node.ex);
    std::thread::sleep(Duration::from_millis(2000));
    let (t2, m2) = scrape(&node.ex);
    let idle = |m: &Metrics| one(m, "gpu_allocation_idle_seconds_total", &row);
    let all = |m: &Metrics| one(m, "gpu_allocation_seconds_total", &row);
    within(idle(&m2) - idle(&m1), t2 - t1, "idle seconds at 1 s/s");
    within(all(&m2) - all(&m1), t2 - t1, "allocated seconds at 1 s/s");

    // A process of job 42 appears on GPU 1: idle stops, allocated goes on.
    node.sc.write(&scenario("", true, true, "null"));
    let job = [("uuid", UUID1), ("slurm_job", "42")];
    wait_for(Duration::from_secs(10), "the job's process", || {
        (!ex_find(&node.ex, "gpu_workload_memory_used_byte_seconds_total", &job)).then_some(())
    });
    let (t3, m3) = scrape(&node.ex);
    std::thread::sleep(Duration::from_millis(1500));
    let (t4, m4) = scrape(&node.ex);
    assert_eq!(idle(&m4), idle(&m3), "busy: no idle second");
    within(all(&m4) - all(&m3), t4 - t3, "allocated seconds while busy");

    // GPU 0 lost, back; then the driver goes and comes back: nothing goes
    // backwards at any point.
    let mut last = counters(&m4);
    let steps: [(&str, &str, &str); 4] = [
        ("", "gpu_lost", "GPU 0 lost"),
        ("", "null", "GPU 0 back"),
        ("runtime_error: driver_not_loaded\n", "null", "driver gone"),
        ("", "null", "driver back"),
    ];
    for (top, error0, what) in steps {
        node.sc.write(&scenario(top, true, true, error0));
        let want_up = if error0 == "gpu_lost" || !top.is_empty() { 0.0 } else { 1.0 };
        let m = wait_for(Duration::from_secs(15), what, || {
            let m = node.ex.metrics();
            (m.get("gpu_up", &[("gpu", "0"), ("uuid", UUID0)]) == Some(want_up)
                || (want_up == 0.0 && m.find("gpu_up", &[("uuid", UUID0)]).is_empty()))
            .then_some(m)
        });
        std::thread::sleep(Duration::from_millis(700));
        let m2 = node.ex.metrics();
        let now = counters(&m);
        monotonic(&last, &now, what);
        let after = counters(&m2);
        monotonic(&now, &after, what);
        eprintln!("{what}: {} counters, none went back", after.len());
        last.extend(after);
    }
    let end = node.ex.metrics();
    let gpu0 = [("gpu", "0"), ("uuid", UUID0)];
    assert!(
        one(&end, "gpu_memory_used_byte_seconds_total", &gpu0)
            >= one(&m4, "gpu_memory_used_byte_seconds_total", &gpu0),
        "GPU 0's total carried through the re-open"
    );
}

/// An OpenMetrics recording carries the counters at each full sample,
/// growing (the CSV's columns are checked in `record::`).
#[test]
fn an_openmetrics_recording_carries_the_counters() {
    let sc = Scenario::new(&scenario("", true, false, "null"));
    let out = sc.dir.path().join("run.om");
    let run = std::process::Command::new(BIN)
        .arg("record")
        .arg("--nvml.library")
        .arg(fake_nvml())
        .args(["--log.level", "warn", "-o"])
        .arg(&out)
        .args(["--duration", "2500ms"])
        .env("FAKE_NVML_CONFIG", &sc.path)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("record");
    assert!(run.status.success(), "{}", output_text(&run));
    let text = std::fs::read_to_string(&out).expect("recording");
    let series = format!("uuid=\"{UUID0}\"}} ");
    let values: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with("gpu_memory_used_byte_seconds_total{"))
        .filter_map(|l| l.split_once(series.as_str()))
        .filter_map(|(_, rest)| rest.split(' ').next()?.parse().ok())
        .collect();
    assert!(values.len() >= 2, "{series} in\n{text}");
    assert!(values.windows(2).all(|w| w[0] <= w[1]), "{values:?}");
    assert!(values[values.len() - 1] > 0.0, "{values:?}");
    for family in [
        "gpu_busy_seconds_total{",
        "gpu_process_memory_used_byte_seconds_total{",
    ] {
        assert!(text.contains(family), "{family} in the recording");
    }
}
