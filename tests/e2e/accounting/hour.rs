//! The last-hour ranking of a workload older than the hour: the real
//! binary under `faketime` at 60 times real speed, its monotonic clock
//! too (the ledger integrates over it), for a little over a fake hour
//! (about 65 s): the pod holding X bytes from the start shows X × the
//! window (59–60 min) in the last hour and X × the whole run since start.

use std::process::Command;
use std::time::{Duration, Instant};

use super::*;
use crate::harness::tools::require_tool;

const SPEED: u32 = 60;

#[test]
fn a_workload_older_than_the_hour_shows_only_its_last_hour() {
    let faketime = require_tool("faketime");
    let sc = Scenario::new(&format!(
        "devices:\n  - uuid: {UUID0}\n    memory: {{total: 100000000000, reserved: 0, used: {X}}}\n    processes:\n      - {{pid: {POD_PID}, used: {X}}}\n"
    ));
    let proc_root = sc.dir.path().join("proc");
    write_proc(
        &proc_root,
        POD_PID,
        "python3",
        0,
        &cgroup_containerd('a'),
        &[],
    );
    let config = sc.file(
        "config.yaml",
        format!(
            "sample_interval: 5s\npath:\n  procfs: {}\n  cgroupfs: {}\n",
            proc_root.display(),
            cgroupfs_of(&proc_root).display(),
        )
        .as_bytes(),
    );
    let mut cmd = Command::new(faketime);
    cmd.args(["-f", &format!("+0 x{SPEED}"), BIN]);
    let cfg = config.to_str().unwrap_or_default().to_string();
    let ex = Exporter::spawn(Exporter::command(
        cmd,
        &sc,
        &["--config.file", &cfg, "--memory-sample-interval", "1s"],
    ));
    let pod = pod_uid('a');
    let started = Instant::now();
    let v = loop {
        assert!(
            started.elapsed() < Duration::from_secs(3700 / u64::from(SPEED) + 60),
            "the fake clock does not run at {SPEED}x"
        );
        std::thread::sleep(Duration::from_millis(500));
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&ex.get("/api/v1/snapshot").body)
        else {
            continue;
        };
        if v["workloads"]["since_start"]["window_seconds"]
            .as_f64()
            .is_some_and(|t| t > 3660.0)
        {
            break v;
        }
    };
    let hour = &v["workloads"]["last_hour"];
    let since = &v["workloads"]["since_start"];
    let window = hour["window_seconds"].as_f64().unwrap_or(0.0);
    let all = since["window_seconds"].as_f64().unwrap_or(0.0);
    eprintln!("last hour's window {window} s, since start {all} s");
    assert!((3540.0..=3600.0).contains(&window), "{hour}");
    for (r, t) in [(hour, window), (since, all)] {
        let list = r["workloads"].as_array().cloned().unwrap_or_default();
        assert_eq!(list.len(), 1, "{r}");
        assert_eq!(list[0]["kind"], "pod");
        assert_eq!(list[0]["pod_uid"], pod.as_str());
        within(
            list[0]["memory_used_byte_seconds"].as_f64().unwrap_or(0.0),
            X as f64 * t,
            "X for the window",
        );
        within(
            list[0]["memory_gib_hours"].as_f64().unwrap_or(0.0),
            X as f64 * t / 3600.0 / (1u64 << 30) as f64,
            "GiB-hours",
        );
    }
}
