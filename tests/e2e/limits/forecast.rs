//! The limit forecast on the fake NVML, under `faketime` at 10 times real
//! speed: a pod limited to 20 GiB by the driver on an 80 GiB GPU holds
//! 5 GiB flat for 2 minutes, then grows at 100 MiB/s. Read at 25, 50 and
//! 75 % of the way from 5 GiB to its limit, `gpu_workload_memory_limit_in_seconds`
//! must be within 15 % of the time the limit is really reached after that
//! sample, and absent while it is flat; the GPU's own forecast
//! (`gpu_memory_full_in_seconds`, towards 80 GiB) is printed beside it.
//! About 35 s.

use std::process::Command;
use std::time::{Duration, Instant};

use super::{GIB, UUID, cid, pod_dir};
use crate::harness::cluster::{cgroupfs_of, containerd_cgroup, write_proc};
use crate::harness::tools::require_tool;
use crate::harness::*;

const SPEED: u32 = 10;
/// The fake clock at the exporter's start: 2030-01-01T00:00:00Z.
const FAKE_START: f64 = 1_893_456_000.0;
const POD: &str = "cccccccc-3333-4333-8333-333333333333";
const FLAT: f64 = 120.0;
const FROM: u64 = 5 * GIB;
const LIMIT: u64 = 20 * GIB;
const RATE: u64 = 100 << 20;

#[test]
fn a_workload_growing_toward_its_limit_is_forecast() {
    let faketime = require_tool("faketime");
    let sc = Scenario::new("devices: []\n");
    let proc_root = sc.dir.path().join("proc");
    write_proc(
        &proc_root,
        5101,
        "python3",
        0,
        &containerd_cgroup(POD, &cid('c')),
        &[],
    );
    let v2 = cgroupfs_of(&proc_root).join("unified");
    let reach = FLAT + (LIMIT - FROM) as f64 / RATE as f64;
    let t = |s: f64| FAKE_START + s;
    sc.write(&format!(
        "devices:\n  - uuid: {UUID}\n    memory: {{total: {}, reserved: 0, used: {}}}\n    used_timeline: [[{}, {FROM}], [{}, {FROM}], [{}, {LIMIT}]]\n    processes: [{{pid: 5101, used: {FROM}, used_timeline: [[{}, {FROM}], [{}, {FROM}], [{}, {LIMIT}]]}}]\n    memory_limits:\n      \"{}\": {{hard: {LIMIT}}}\n",
        80 * GIB,
        FROM,
        t(0.0),
        t(FLAT),
        t(reach),
        t(0.0),
        t(FLAT),
        t(reach),
        v2.join(pod_dir(POD).trim_start_matches('/')).display(),
    ));
    let cfg = sc.file(
        "config.yaml",
        format!(
            "sample_interval: 100ms\nmemory_sample_interval: 20ms\npath:\n  procfs: {}\n  cgroupfs: {}\nlimits:\n  interval: 100ms\n",
            proc_root.display(),
            cgroupfs_of(&proc_root).display()
        )
        .as_bytes(),
    );
    let mut cmd = Command::new(faketime);
    cmd.args(["-f", &format!("@2030-01-01 00:00:00 x{SPEED}"), BIN])
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    let ex = Exporter::spawn(Exporter::command(
        cmd,
        &sc,
        &["--config.file", cfg.to_str().unwrap()],
    ));
    let pod = [("gpu", "0"), ("uuid", UUID), ("pod_uid", POD)];
    // (fake second of the sample, used, limit forecast, GPU forecast)
    let mut seen: Vec<(f64, u64, Option<f64>, Option<f64>)> = Vec::new();
    let started = Instant::now();
    loop {
        assert!(
            started.elapsed() < Duration::from_secs_f64(reach / f64::from(SPEED) + 30.0),
            "the fake clock does not run at {SPEED}x, or no limit came: {:?}\n{}",
            seen.last(),
            ex.get("/metrics")
                .body
                .lines()
                .filter(|l| l.contains("limit")
                    || l.contains("process_memory_used")
                    || l.contains("timestamp"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        std::thread::sleep(Duration::from_millis(30));
        let m = ex.metrics();
        let Some(ts) = m.get("gpumem_exporter_last_sample_timestamp_seconds", &[]) else {
            continue;
        };
        let Some(used) = m.get_u64("gpu_workload_memory_used_bytes", &pod) else {
            continue;
        };
        let at = ts - FAKE_START;
        seen.push((
            at,
            used,
            m.get("gpu_workload_memory_limit_in_seconds", &pod),
            m.get(
                "gpu_memory_full_in_seconds",
                &[("gpu", "0"), ("uuid", UUID)],
            ),
        ));
        if used >= LIMIT || at > reach {
            break;
        }
    }
    let flat_forecasts: Vec<_> = seen
        .iter()
        .filter(|s| s.0 < FLAT - 1.0 && s.2.is_some())
        .collect();
    assert!(
        flat_forecasts.is_empty(),
        "a forecast while flat: {flat_forecasts:?}"
    );
    let mut failures = Vec::new();
    println!("| read at | fake s | truth s | limit forecast s | error | GPU forecast s |");
    println!("|---|---|---|---|---|---|");
    for q in [0.25, 0.5, 0.75] {
        let at = FLAT + (LIMIT - FROM) as f64 * q / RATE as f64;
        let near = seen
            .iter()
            .filter(|s| s.0 >= at - 2.0 && s.0 < reach - 1.0)
            .min_by(|a, b| (a.0 - at).abs().total_cmp(&(b.0 - at).abs()));
        let Some(&(t, _, f, gpu)) = near else {
            failures.push(format!("no scrape near {:.0} %", q * 100.0));
            continue;
        };
        let truth = reach - t;
        let err = f.map(|f| (f - truth) / truth);
        println!(
            "| {:.0} % | {t:.1} | {truth:.1} | {} | {} | {} |",
            q * 100.0,
            f.map_or("none".into(), |f| format!("{f:.1}")),
            err.map_or("-".into(), |e| format!("{:+.1} %", e * 100.0)),
            gpu.map_or("none".into(), |g| format!("{g:.1}")),
        );
        if !err.is_some_and(|e| e.abs() <= 0.15) {
            failures.push(format!("at {:.0} %: {f:?} against {truth:.1}", q * 100.0));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
