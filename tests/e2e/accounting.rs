//! The ledger's memory-time counters end to end: byte-seconds of a process
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

use crate::harness::cluster::{cgroup_containerd, cgroupfs_of, pod_uid, write_proc};
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
    write_proc(
        &proc_root,
        POD_PID,
        "python3",
        0,
        &cgroup_containerd('a'),
        &[],
    );
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
    // The per-process counter is asked for (`processes.byte_seconds`),
    // so its exactness is tested beside the workload's.
    let config = format!(
        "sample_interval: 500ms\npath:\n  procfs: {}\n  cgroupfs: {}\nslurm:\n  job_mapping_dir: {}\n  job_mapping_interval: 200ms\nprocesses:\n  byte_seconds: true\n",
        proc_root.display(),
        cgroupfs_of(&proc_root).display(),
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
    eprintln!(
        "{what}: got {got:.1}, want {want:.1}, off by {:.4} %",
        err * 100.0
    );
    assert!(
        err <= 0.005,
        "{what}: got {got}, want {want} ({:.3} % off)",
        err * 100.0
    );
}

/// Every counter of the ledger, by series.
fn counters(m: &Metrics) -> BTreeMap<String, f64> {
    m.samples
        .iter()
        .filter(|(k, _)| !k.starts_with("gpumem_exporter_"))
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
        (!ex_find(
            &node.ex,
            "gpu_process_memory_used_byte_seconds_total",
            &proc_labels,
        ))
        .then_some(())
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
        (
            "gpu_process_memory_used_byte_seconds_total",
            &proc_labels[..],
        ),
        (
            "gpu_workload_memory_used_byte_seconds_total",
            &pod_labels[..],
        ),
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
        m2.get(
            "gpumem_exporter_config_reloads_total",
            &[("result", "success")]
        ),
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
    let kept = one(
        &gone,
        "gpu_workload_memory_used_byte_seconds_total",
        &pod_labels,
    );
    assert!(
        kept >= one(
            &m2,
            "gpu_workload_memory_used_byte_seconds_total",
            &pod_labels
        )
    );
    std::thread::sleep(Duration::from_millis(1000));
    let (_, later) = scrape(&node.ex);
    assert_eq!(
        one(
            &later,
            "gpu_workload_memory_used_byte_seconds_total",
            &pod_labels
        ),
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
    wait_for(
        Duration::from_secs(10),
        "the allocation row's counters",
        || (!ex_find(&node.ex, "gpu_allocation_idle_seconds_total", &row)).then_some(()),
    );
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
        (!ex_find(
            &node.ex,
            "gpu_workload_memory_used_byte_seconds_total",
            &job,
        ))
        .then_some(())
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
        let want_up = if error0 == "gpu_lost" || !top.is_empty() {
            0.0
        } else {
            1.0
        };
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
    assert!(
        text.contains("gpu_busy_seconds_total{"),
        "gpu_busy_seconds_total in the recording"
    );
    // The per-process counter only when asked for, as on /metrics.
    assert!(
        !text.contains("gpu_process_memory_used_byte_seconds_total{"),
        "no per-process counter at the defaults"
    );
}

// ------------------------------------------------------------ record's summary

const TOTAL: u64 = 10 << 30;
const BASE: u64 = 1 << 30;
/// The command's process: 9 GiB, so the GPU (1 + 9 of 10 GiB) is above
/// 90 % while it is listed.
const OWN: u64 = 9 << 30;

fn summary_scenario(own_pid: Option<&str>) -> String {
    let (used, procs) = match own_pid {
        Some(pid) => (
            BASE + OWN,
            format!("\n      - {{pid: {pid}, used: {OWN}}}\n"),
        ),
        None => (BASE, " []\n".to_string()),
    };
    format!(
        "devices:\n  - uuid: {UUID0}\n    memory: {{total: {TOTAL}, reserved: 0, used: {used}}}\n    processes:{procs}"
    )
}

/// `record -o run.csv -- sh -c SCRIPT`, where the script first lists its
/// own pid in the scenario (the fake re-reads it), then does `then`.
fn record_command(sc: &Scenario, then: &str) -> std::process::Command {
    let listed = summary_scenario(Some("$$"));
    let script = format!(
        "printf '%s' \"{}\" > {p}.tmp && mv {p}.tmp {p}; {then}",
        listed.replace('"', "\\\""),
        p = sc.path.display()
    );
    let mut cmd = std::process::Command::new(BIN);
    cmd.arg("record")
        .arg("--nvml.library")
        .arg(fake_nvml())
        .args(["--log.level", "warn", "--sample-interval", "200ms", "-o"])
        .arg(sc.dir.path().join("run.csv"))
        .args(["--", "sh", "-c", &script])
        .env("FAKE_NVML_CONFIG", &sc.path)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    cmd
}

/// The summary's figures against the recording's own rows (the fake's
/// history as the recorder saw it): the same samples, the same sums.
fn check_summary(sc: &Scenario, out: &std::process::Output, end: &str, code: i32) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("gpumem-exporter record: "), "{stderr}");
    assert!(
        stderr.contains(&format!("ended: {end} (exit code {code})")),
        "{stderr}"
    );
    let json = std::fs::read_to_string(sc.dir.path().join("run.csv.summary.json"))
        .expect("the summary beside the recording");
    let v: serde_json::Value = serde_json::from_str(&json).expect("summary JSON");
    assert_eq!(v["end"], end, "{json}");
    assert_eq!(v["exit_code"], code, "{json}");
    // The recording's gpu rows: (seconds, used bytes).
    let mut r = csv::Reader::from_path(sc.dir.path().join("run.csv")).expect("csv");
    let header = r.headers().expect("header").clone();
    let col = |name: &str| header.iter().position(|h| h == name).expect("column");
    let (t, used, kind, pid) = (
        col("unix_seconds"),
        col("used_bytes"),
        col("kind"),
        col("pid"),
    );
    let rows: Vec<csv::StringRecord> = r.records().map(|x| x.expect("row")).collect();
    let gpu: Vec<(f64, u64)> = rows
        .iter()
        .filter(|x| &x[kind] == "gpu")
        .map(|x| (x[t].parse().unwrap(), x[used].parse().unwrap()))
        .collect();
    let g = &v["gpus"][0];
    assert_eq!(g["uuid"], UUID0);
    assert_eq!(g["peak_used_bytes"], BASE + OWN, "{json}");
    let above: f64 = gpu
        .windows(2)
        .filter(|w| w[0].1 as f64 >= 0.9 * TOTAL as f64)
        .map(|w| w[1].0 - w[0].0)
        .sum();
    let got = g["seconds_above_90_percent"].as_f64().unwrap();
    assert!(
        (got - above).abs() < 0.01,
        "above 90 %: {got} vs the rows' {above}"
    );
    assert!(above > 0.5, "{above}");
    // Mean and GiB-hours: the rows' time-weighted sum (left rule).
    let bs: f64 = gpu
        .windows(2)
        .map(|w| w[0].1 as f64 * (w[1].0 - w[0].0))
        .sum();
    let span = gpu[gpu.len() - 1].0 - gpu[0].0;
    let gib_hours = g["gib_hours"].as_f64().unwrap();
    let want = bs / 3600.0 / (1u64 << 30) as f64;
    assert!(
        (gib_hours - want).abs() <= want * 0.005,
        "GiB-hours {gib_hours} vs {want}"
    );
    let mean = g["mean_used_bytes"].as_f64().unwrap();
    assert!(
        (mean - bs / span).abs() <= bs / span * 0.005,
        "mean {mean} vs {}",
        bs / span
    );
    // The command's own process: exactly its bytes, and it is the only one.
    let procs = v["processes"].as_array().expect("processes");
    assert_eq!(procs.len(), 1, "{json}");
    let p = &procs[0];
    assert_eq!(p["peak_used_bytes"], OWN);
    let mean = p["mean_used_bytes"].as_f64().unwrap();
    assert!(
        (mean - OWN as f64).abs() < 1.0,
        "mean of a constant: {mean}"
    );
    assert!(
        rows.iter()
            .any(|x| &x[kind] == "process" && x[pid].parse::<u64>().ok() == p["pid"].as_u64()),
        "the pid is the recording's"
    );
}

#[test]
fn record_ends_with_a_summary_when_the_command_succeeds_fails_or_is_interrupted() {
    for (then, end, code) in [("sleep 2", "exited", 0), ("sleep 2; exit 3", "exited", 3)] {
        let sc = Scenario::new(&summary_scenario(None));
        let out = record_command(&sc, then).output().expect("record");
        assert_eq!(out.status.code(), Some(code), "{}", output_text(&out));
        check_summary(&sc, &out, end, code);
    }
    // Ctrl-C: SIGINT to the recorder's process group, as a terminal does.
    let sc = Scenario::new(&summary_scenario(None));
    let mut cmd = record_command(&sc, "sleep 30");
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let child = cmd.spawn().expect("record");
    std::thread::sleep(Duration::from_millis(2500));
    let pgid = libc::pid_t::try_from(child.id()).expect("pid");
    // SAFETY: kill(2) on the process group we just made, a valid signal.
    assert_eq!(unsafe { libc::kill(-pgid, libc::SIGINT) }, 0);
    let out = child.wait_with_output().expect("record");
    assert_eq!(out.status.code(), Some(130), "{}", output_text(&out));
    check_summary(&sc, &out, "signalled", 130);
}

// ------------------------------------------- busy time from NVML's samples

/// GPU 0's driver has utilisation samples (50 % every 10 ms) and a gauge
/// that says 90 %; GPU 1's has none (NOT_SUPPORTED) and says 40 %.
fn samples_scenario() -> String {
    format!(
        "devices:\n  - uuid: {UUID0}\n    utilization: {{gpu: 90, memory: 10}}\n    utilization_samples: {{gpu: 50, period_us: 10000}}\n  - uuid: {UUID1}\n    utilization: {{gpu: 40, memory: 10}}\n"
    )
}

/// A GPU whose samples say 50 % for T seconds gets T/2 busy seconds
/// (not the gauge's 90 %), counted from the samples' own timestamps; a
/// GPU without samples falls back to the gauge held between reads, and
/// the log says so once.
#[test]
fn busy_seconds_integrate_nvmls_utilisation_samples_and_fall_back_to_the_gauge() {
    let sc = Scenario::new(&samples_scenario());
    // Full samples at the memory-sample rate: the samples are read at
    // every snapshot, so the counter is a snapshot's to within a sample
    // period (10 ms) and the span between two scrapes is its span.
    let ex = Exporter::start(&sc, &["--sample-interval", "100ms"]);
    let gpu0 = [("gpu", "0"), ("uuid", UUID0)];
    let gpu1 = [("gpu", "1"), ("uuid", UUID1)];
    wait_for(Duration::from_secs(10), "busy seconds of both GPUs", || {
        let m = ex.metrics();
        (m.find("gpu_busy_seconds_total", &gpu0).len() == 1
            && m.find("gpu_busy_seconds_total", &gpu1).len() == 1)
            .then_some(())
    });
    // A scrape every 250 ms for 6 s, the counter against the snapshot's
    // time: the least-squares slope, so one scrape that lagged its samples
    // (a tick preempted on a loaded machine) weighs little.
    let mut points: Vec<(f64, f64, f64)> = Vec::new();
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_secs(6) {
        let (t, m) = scrape(&ex);
        let busy = |l: &[(&str, &str)]| one(&m, "gpu_busy_seconds_total", l);
        points.push((t, busy(&gpu0), busy(&gpu1)));
        std::thread::sleep(Duration::from_millis(250));
    }
    let span = points[points.len() - 1].0 - points[0].0;
    let slope = |pick: fn(&(f64, f64, f64)) -> f64| {
        let n = points.len() as f64;
        let mt = points.iter().map(|p| p.0).sum::<f64>() / n;
        let mv = points.iter().map(pick).sum::<f64>() / n;
        let num: f64 = points.iter().map(|p| (p.0 - mt) * (pick(p) - mv)).sum();
        let den: f64 = points.iter().map(|p| (p.0 - mt) * (p.0 - mt)).sum();
        num / den
    };
    eprintln!("{} scrapes over {span:.2} s", points.len());
    within(slope(|p| p.1) * span, 0.5 * span, "GPU 0 from its samples");
    within(slope(|p| p.2) * span, 0.4 * span, "GPU 1 from its gauge");
    ex.assert_logged_once("NVML has no utilisation samples for this GPU");
    let log = ex.stderr();
    let line = log
        .lines()
        .find(|l| l.contains("NVML has no utilisation samples"))
        .unwrap_or_default();
    assert_eq!(field(line, "gpu"), Some("1"), "{line}");
}

// ------------------------------------------------ the ranking in the API

fn ranked<'a>(v: &'a serde_json::Value, window: &str) -> &'a Vec<serde_json::Value> {
    v["workloads"][window]["workloads"]
        .as_array()
        .unwrap_or_else(|| panic!("workloads.{window}: {v}"))
}

/// The pod holding X bytes since the start and the Slurm job holding X
/// on GPU 1 from some point on: each X·T in both windows (under an hour,
/// the last hour is since start), T the time each was listed, read from
/// its own counter; the JSON's entries exact.
#[test]
fn the_api_ranks_workloads_by_memory_time_over_the_last_hour_and_since_start() {
    let node = start();
    let pod = pod_uid('a');
    let pod_labels = [("uuid", UUID0), ("pod_uid", pod.as_str())];
    wait_for(Duration::from_secs(10), "the pod's counter", || {
        (!ex_find(
            &node.ex,
            "gpu_workload_memory_used_byte_seconds_total",
            &pod_labels,
        ))
        .then_some(())
    });
    node.sc.write(&scenario("", true, true, "null"));
    std::thread::sleep(Duration::from_secs(3));
    // The JSON and the metrics of the same snapshot: read the JSON, then
    // scrape until the sample time matches.
    let (v, m) = wait_for(Duration::from_secs(10), "one snapshot twice", || {
        let v: serde_json::Value =
            serde_json::from_str(&node.ex.get("/api/v1/snapshot").body).ok()?;
        let (t, m) = scrape(&node.ex);
        (v["taken_at"].as_f64().is_some_and(|j| (j - t).abs() < 1e-3)).then_some((v, m))
    });
    for window in ["last_hour", "since_start"] {
        let list = ranked(&v, window);
        assert_eq!(list.len(), 2, "{window}: {list:?}");
        // The pod first (listed longer), then the job.
        assert_eq!(list[0]["kind"], "pod", "{list:?}");
        assert_eq!(list[0]["pod_uid"], pod.as_str());
        assert_eq!(list[1]["kind"], "slurm_job");
        assert_eq!(list[1]["slurm_job"], "42");
        assert_eq!(list[1]["user"], serde_json::Value::Null);
        for (entry, labels) in [
            (&list[0], vec![("pod_uid", pod.as_str())]),
            (&list[1], vec![("slurm_job", "42")]),
        ] {
            let bytes = m
                .find("gpu_workload_memory_used_byte_seconds_total", &labels)
                .iter()
                .map(|s| s.1)
                .sum::<f64>();
            let busy = m
                .find("gpu_workload_busy_seconds_total", &labels)
                .iter()
                .map(|s| s.1)
                .sum::<f64>();
            let got = entry["memory_used_byte_seconds"].as_f64().unwrap_or(-1.0);
            within(got, bytes, &format!("{window} {labels:?} byte-seconds"));
            let gib_h = entry["memory_gib_hours"].as_f64().unwrap_or(-1.0);
            within(gib_h, got / 3600.0 / (1u64 << 30) as f64, "GiB-hours");
            if busy > 0.0 {
                within(
                    entry["busy_seconds"].as_f64().unwrap_or(-1.0),
                    busy,
                    "busy seconds",
                );
                within(
                    entry["busy_gpu_hours"].as_f64().unwrap_or(-1.0),
                    busy / 3600.0,
                    "busy GPU-hours",
                );
            }
        }
        assert_eq!(
            v["workloads"][window]["omitted"],
            serde_json::Value::Null,
            "{window}"
        );
    }
    // X held for T: the pod since the exporter's first sample.
    let pod_bytes = ranked(&v, "since_start")[0]["memory_used_byte_seconds"]
        .as_f64()
        .unwrap_or(0.0);
    let t = v["workloads"]["since_start"]["window_seconds"]
        .as_f64()
        .unwrap_or(0.0);
    assert_eq!(
        v["workloads"]["last_hour"]["window_seconds"],
        v["workloads"]["since_start"]["window_seconds"],
        "under an hour the window is since start"
    );
    within(pod_bytes, X as f64 * t, "the pod: X for the ledger's T");
}
