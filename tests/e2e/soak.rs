//! Process-churn soak: the fake NVML starts and ends ~100 pids a minute
//! (each with a /proc entry that appears and disappears), for
//! `SOAK_SECONDS` (default 120, the CI version; the documented long run is
//! `SOAK_SECONDS=3600 cargo test --release --features external-tools --test e2e soak:: -- --nocapture`;
//! built only with that feature, so the fast loop stays fast).
//! After warm-up, RSS must stay flat within 1 MiB, open fds flat, and the
//! number of process series must equal the live pids at every check.

use std::collections::VecDeque;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::harness::cluster::write_proc;
use crate::harness::*;

const UUID: &str = "GPU-99999999-0000-0000-0000-000000000000";
const LIVE: usize = 20;

fn scenario(pids: &VecDeque<u32>) -> String {
    let mut y = format!(
        "devices:\n  - uuid: {UUID}\n    memory: {{total: 150754820096, reserved: 644939776, used: 12363563008}}\n    processes:\n"
    );
    for pid in pids {
        y.push_str(&format!(
            "      - {{pid: {pid}, used: {}}}\n",
            u64::from(*pid) * 4096
        ));
    }
    y
}

/// A worker process of uid 1000 outside any pod.
fn add_proc(root: &Path, pid: u32) {
    write_proc(
        root,
        pid,
        &format!("worker-{}", pid % 1000),
        1000,
        &format!("0::/system.slice/job-{pid}.service\n"),
        &[],
    );
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

#[test]
fn churn_keeps_memory_fds_and_series_flat() {
    let secs = env_u64("SOAK_SECONDS", 120);
    let per_minute = env_u64("SOAK_PIDS_PER_MINUTE", 100);
    let step = Duration::from_millis(60_000 / per_minute.max(1));
    let warmup = Duration::from_secs((secs / 4).max(20));
    let proc_root = tempfile::tempdir().unwrap();
    let mut live: VecDeque<u32> = (0..LIVE as u32).map(|i| 200_000 + i).collect();
    for pid in &live {
        add_proc(proc_root.path(), *pid);
    }
    let sc = Scenario::new(&scenario(&live));
    let ex = Exporter::start(
        &sc,
        &[
            "--sample-interval",
            "100ms",
            "--path.procfs",
            proc_root.path().to_str().unwrap(),
        ],
    );
    let pid = ex.child.id();
    let start = Instant::now();
    eprintln!("exporter up, soaking for {secs} s");
    let mut next_pid = 200_000 + LIVE as u32;
    let mut next_check = start + Duration::from_secs(5);
    let mut baseline: Option<(u64, usize)> = None;
    // Checks against the baseline: RSS and fds are compared only there.
    let mut compared = 0;
    let mut rows = Vec::new();
    let mut started_total = LIVE as u64;
    while start.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(step);
        // One process ends, a new one starts.
        if let Some(old) = live.pop_front() {
            let _ = std::fs::remove_dir_all(proc_root.path().join(old.to_string()));
        }
        add_proc(proc_root.path(), next_pid);
        live.push_back(next_pid);
        next_pid += 1;
        started_total += 1;
        sc.write(&scenario(&live));
        if Instant::now() >= next_check {
            next_check += Duration::from_secs(5);
            // Let one sample see the latest scenario, then compare.
            std::thread::sleep(Duration::from_millis(300));
            let m = ex.metrics();
            let series = m
                .find("gpu_process_memory_used_bytes", &[("uuid", UUID)])
                .len();
            assert_eq!(
                series,
                live.len(),
                "series equal live pids at {:?}",
                start.elapsed()
            );
            let infos = m.find("gpu_process_info", &[("uuid", UUID)]).len();
            assert_eq!(infos, live.len());
            let rss = status_kib(pid, "VmRSS:").unwrap();
            let n_fds = fds(pid);
            rows.push((
                start.elapsed().as_secs(),
                rss,
                status_kib(pid, "VmHWM:").unwrap(),
                n_fds,
                series,
            ));
            if start.elapsed() >= warmup {
                match baseline {
                    None => baseline = Some((rss, n_fds)),
                    Some((rss0, fds0)) => {
                        compared += 1;
                        assert!(
                            rss <= rss0 + 1024,
                            "RSS grew from {rss0} KiB to {rss} KiB after warm-up"
                        );
                        // A scrape's socket or a /proc file may be open at
                        // the moment of the check: allow those, no growth.
                        assert!(n_fds <= fds0 + 2, "open fds grew from {fds0} to {n_fds}");
                    }
                }
            }
        }
    }
    eprintln!("t_s  VmRSS_KiB  VmHWM_KiB  fds  series");
    for (t, rss, hwm, n, s) in &rows {
        eprintln!("{t:>4} {rss:>10} {hwm:>10} {n:>4} {s:>7}");
    }
    let (rss0, _) = baseline.expect("ran past warm-up");
    assert!(
        compared > 0,
        "no check after the baseline: RSS and fds never compared (SOAK_SECONDS={secs})"
    );
    let last = rows.last().unwrap();
    eprintln!(
        "soak: {secs} s, {started_total} pids started, RSS after warm-up {rss0} KiB, at end {} KiB ({:+} KiB), fds {}",
        last.1,
        last.1 as i64 - rss0 as i64,
        last.3
    );
}
