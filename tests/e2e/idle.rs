//! Idle holders end to end, with `--processes.idle-after 2s`: a process
//! whose per-process utilisation samples stop becomes idle after 2 s and
//! its `gpu_process_idle_seconds` grows with the clock; its bytes are in
//! `gpu_memory_idle_held_bytes`, and its pod's idle byte-seconds grow by
//! exactly bytes × seconds; fresh samples end it. Where the driver has no
//! per-process samples (the scenario leaves `process_utilization` out:
//! NOT_SUPPORTED), the GPU's own utilisation decides: every holder of an
//! idle GPU is idle, and a busy GPU ends it at the next sample.
//!
//! The fake stamps a scenario's samples with the file's mtime, and the
//! `process_activity` collector reads them every 10 s: a process is active
//! as of the last rewrite the collector read. Rates are measured between
//! two scrapes against the served snapshot's own time
//! (`gpumem_exporter_last_sample_timestamp_seconds`).

use std::time::{Duration, Instant, UNIX_EPOCH};

use crate::harness::cluster::{cgroup_containerd, cgroupfs_of, pod_uid, write_proc};
use crate::harness::*;

const UUID: &str = "GPU-1d1e0000-0000-0000-0000-000000000000";
const X: u64 = 3 << 30;
const Y: u64 = 1 << 30;
const PID: u32 = 4600;
const PEER: u32 = 4601;

/// One GPU holding `PID` (X bytes, a pod's) and `PEER` (Y bytes); `gpu`
/// its utilisation; `samples` the `process_utilization` key's value, or
/// `None` to leave it out (NOT_SUPPORTED).
fn scenario(gpu: u32, samples: Option<&str>) -> String {
    let samples = samples.map_or(String::new(), |s| format!("    process_utilization: {s}\n"));
    format!(
        "devices:\n  - uuid: {UUID}\n    memory: {{total: 100000000000, reserved: 0, used: {}}}\n    utilization: {{gpu: {gpu}, memory: 0}}\n{samples}    processes: [{{pid: {PID}, used: {X}}}, {{pid: {PEER}, used: {Y}}}]\n",
        X + Y
    )
}

/// `PID` busy in the samples of this write.
const BUSY: &str = "[{pid: 4600, sm: 60, memory: 10}]";

fn start(sc: &Scenario) -> Exporter {
    let proc_root = sc.dir.path().join("proc");
    write_proc(&proc_root, PID, "python3", 0, &cgroup_containerd('d'), &[]);
    write_proc(&proc_root, PEER, "python3", 0, &cgroup_containerd('e'), &[]);
    let config = format!(
        "sample_interval: 500ms\npath:\n  procfs: {}\n  cgroupfs: {}\n",
        proc_root.display(),
        cgroupfs_of(&proc_root).display(),
    );
    Exporter::with_config(sc, &config, &["--processes.idle-after", "2s"])
}

/// One scrape: (the served snapshot's time, the metrics).
fn scrape(ex: &Exporter) -> (f64, Metrics) {
    let m = ex.metrics();
    let t = m
        .get("gpumem_exporter_last_sample_timestamp_seconds", &[])
        .expect("sample timestamp");
    (t, m)
}

fn idle_seconds(m: &Metrics, pid: u32) -> Option<f64> {
    let f = m.find(
        "gpu_process_idle_seconds",
        &[("gpu", "0"), ("uuid", UUID), ("pid", &pid.to_string())],
    );
    assert!(f.len() <= 1, "{f:?}");
    f.first().map(|(labels, v)| {
        assert_eq!(labels.get("process").map(String::as_str), Some("python3"));
        *v
    })
}

fn held(m: &Metrics) -> Option<u64> {
    m.get_u64(
        "gpu_memory_idle_held_bytes",
        &[("gpu", "0"), ("uuid", UUID)],
    )
}

/// The JSON's `idle_since` of `pid` (Unix seconds), `None` while not idle.
fn idle_since(ex: &Exporter, pid: u32) -> Option<f64> {
    let v: serde_json::Value =
        serde_json::from_str(&ex.get("/api/v1/snapshot").body).expect("snapshot JSON");
    v["gpus"][0]["processes"]
        .as_array()
        .expect("processes")
        .iter()
        .find(|p| p["pid"].as_u64() == Some(u64::from(pid)))
        .and_then(|p| p["idle_since"].as_f64())
}

/// The scenario file's mtime (Unix seconds): the fake's sample time.
fn mtime(sc: &Scenario) -> f64 {
    std::fs::metadata(&sc.path)
        .and_then(|m| m.modified())
        .expect("mtime")
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64()
}

/// Within 0.5 % of `want`.
fn within(got: f64, want: f64, what: &str) {
    let err = (got - want).abs() / want;
    eprintln!(
        "{what}: got {got:.1}, want {want:.1}, off by {:.4} %",
        err * 100.0
    );
    assert!(err <= 0.005, "{what}: got {got}, want {want}");
}

#[test]
fn stopped_samples_make_a_process_idle_and_fresh_ones_end_it() {
    // Busy at the start (GPU busy too: it must not matter where the
    // process's own samples say), then no new sample.
    let sc = Scenario::new(&scenario(90, Some(BUSY)));
    let ex = start(&sc);
    let pod = pod_uid('d');
    let proc_labels = [("uuid", UUID), ("pid", "4600")];
    let pod_labels = [("uuid", UUID), ("pod_uid", pod.as_str())];
    // Just listed: held, not idle.
    let m = wait_for(Duration::from_secs(10), "the process listed", || {
        let m = ex.metrics();
        (!m.find("gpu_process_memory_used_bytes", &proc_labels)
            .is_empty())
        .then_some(m)
    });
    assert_eq!(held(&m), Some(0), "{}", m.text);
    assert!(
        m.find("gpu_process_idle_seconds", &[]).is_empty(),
        "{}",
        m.text
    );
    assert!(
        m.find("gpu_workload_memory_idle_byte_seconds_total", &[])
            .is_empty(),
        "no workload held memory idle yet"
    );

    // 2 s after its last sample: idle, its bytes held idle. The peer, never
    // seen busy, is idle since first seen.
    let (t1, m1) = wait_for(Duration::from_secs(10), "the process idle", || {
        let (t, m) = scrape(&ex);
        idle_seconds(&m, PID).is_some().then_some((t, m))
    });
    assert_eq!(held(&m1), Some(X + Y), "{}", m1.text);
    assert!(idle_seconds(&m1, PEER).is_some(), "{}", m1.text);
    std::thread::sleep(Duration::from_secs(4));
    let (t2, m2) = scrape(&ex);
    let span = t2 - t1;
    assert!(span > 3.5, "{span}");
    // The gauge grows with the clock (whole seconds).
    let grew = idle_seconds(&m2, PID).unwrap() - idle_seconds(&m1, PID).unwrap();
    assert!((grew - span).abs() <= 1.0, "grew {grew} in {span} s");
    // The ledger: bytes × seconds idle, as the used byte-seconds of the
    // same span (the process was idle all along).
    let counter = |m: &Metrics, name: &str| {
        let f = m.find(name, &pod_labels);
        assert_eq!(f.len(), 1, "{name}: {f:?}\n{}", m.text);
        f[0].1
    };
    for name in [
        "gpu_workload_memory_idle_byte_seconds_total",
        "gpu_workload_memory_used_byte_seconds_total",
    ] {
        within(
            counter(&m2, name) - counter(&m1, name),
            X as f64 * span,
            name,
        );
    }
    let before = idle_seconds(&m2, PID).unwrap();

    // Fresh samples, written every 250 ms until the collector (every 10 s)
    // reads one: no longer idle, its bytes no longer held idle. The peer
    // stays idle.
    let started = Instant::now();
    let first_write = {
        sc.write(&scenario(90, Some(BUSY)));
        mtime(&sc)
    };
    let m = wait_for(Duration::from_secs(15), "activity read", || {
        sc.write(&scenario(90, Some(BUSY)));
        std::thread::sleep(Duration::from_millis(250));
        let m = ex.metrics();
        idle_seconds(&m, PID).is_none().then_some(m)
    });
    eprintln!("activity read after {:?}", started.elapsed());
    assert_eq!(held(&m), Some(Y), "{}", m.text);
    assert!(idle_seconds(&m, PEER).is_some(), "{}", m.text);

    // Samples stop again: idle 2 s after the last one read, counted from
    // it (not from the first idle spell).
    let m = wait_for(Duration::from_secs(10), "idle again", || {
        let m = ex.metrics();
        idle_seconds(&m, PID).is_some().then_some(m)
    });
    let again = idle_seconds(&m, PID).unwrap();
    assert!(again < before, "reset: {again} after {before}");
    let since = idle_since(&ex, PID).expect("idle_since");
    assert!(
        since >= first_write - 0.01,
        "idle since {since}, activity written from {first_write}"
    );
    assert_eq!(held(&m), Some(X + Y), "{}", m.text);
}

#[test]
fn without_per_process_samples_the_gpu_utilisation_decides() {
    // No process_utilization: NOT_SUPPORTED. The GPU is busy.
    let sc = Scenario::new(&scenario(40, None));
    let ex = start(&sc);
    let m = wait_for(Duration::from_secs(10), "the processes listed", || {
        let m = ex.metrics();
        (m.find("gpu_process_memory_used_bytes", &[("uuid", UUID)])
            .len()
            == 2)
            .then_some(m)
    });
    assert_eq!(held(&m), Some(0), "{}", m.text);
    // Well past idle_after, a busy GPU's holders are not idle.
    std::thread::sleep(Duration::from_secs(3));
    let m = ex.metrics();
    assert_eq!(held(&m), Some(0), "{}", m.text);
    assert!(
        m.find("gpu_process_idle_seconds", &[]).is_empty(),
        "{}",
        m.text
    );
    assert_eq!(idle_since(&ex, PID), None);

    // The GPU goes idle: 2 s later every holder is, since its last busy
    // sample.
    sc.write(&scenario(0, None));
    let quiet = mtime(&sc);
    let m = wait_for(Duration::from_secs(10), "both idle", || {
        let m = ex.metrics();
        (idle_seconds(&m, PID).is_some() && idle_seconds(&m, PEER).is_some()).then_some(m)
    });
    assert_eq!(held(&m), Some(X + Y), "{}", m.text);
    let since = idle_since(&ex, PID).expect("idle_since");
    // The last sample that saw it busy, at most a sample interval before
    // the write that made it idle (and not after it).
    assert!(
        (quiet - 1.0..=quiet + 0.6).contains(&since),
        "idle since {since}, GPU quiet from {quiet}"
    );

    // Busy again: no longer idle at the next sample.
    sc.write(&scenario(70, None));
    let m = wait_for(Duration::from_secs(3), "busy again", || {
        let m = ex.metrics();
        m.find("gpu_process_idle_seconds", &[])
            .is_empty()
            .then_some(m)
    });
    assert_eq!(held(&m), Some(0), "{}", m.text);
}
