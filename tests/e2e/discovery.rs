//! End-to-end discovery: a GPU that does not answer from the start, MIG
//! layouts that change at run time, a driver upgraded or unloaded under the
//! running exporter. The fake NVML has a knob for each (docs/fake-nvml.md).

use std::time::{Duration, Instant};

use crate::harness::*;

pub(crate) mod unified_memory;

const UUIDS: [&str; 4] = [
    "GPU-d1500000-0000-0000-0000-000000000000",
    "GPU-d1500000-0000-0000-0000-000000000001",
    "GPU-d1500000-0000-0000-0000-000000000002",
    "GPU-d1500000-0000-0000-0000-000000000003",
];
const TOTAL: u64 = 150_754_820_096;

/// `n` GPUs, GPU `i` using `(i + 1) * 1 GiB + i` bytes; `extra[i]` is
/// appended to GPU `i`'s entry (a knob such as `error: gpu_lost`), `top`
/// before `devices:`.
fn gpus(top: &str, n: usize, extra: &[(usize, &str)]) -> String {
    let mut y = format!("{top}devices:\n");
    for (i, uuid) in UUIDS.iter().enumerate().take(n) {
        y.push_str(&format!(
            "  - uuid: {uuid}\n    memory: {{total: {TOTAL}, reserved: 644939776, used: {}}}\n    processes: [{{pid: {}, used: {}}}]\n",
            used(i),
            4_100_000 + i,
            used(i) - 1000
        ));
        for (_, knob) in extra.iter().filter(|(g, _)| *g == i) {
            y.push_str(&format!("    {knob}\n"));
        }
    }
    y
}

fn used(i: usize) -> u64 {
    (i as u64 + 1) * (1 << 30) + i as u64
}

fn value(m: &Metrics, name: &str, gpu: usize) -> Option<u64> {
    m.get_u64(name, &[("gpu", &gpu.to_string()), ("uuid", UUIDS[gpu])])
}

/// `gpu_up` of GPU `gpu` whose uuid label is empty (or absent).
fn up_unknown(m: &Metrics, gpu: &str) -> Option<f64> {
    m.find("gpu_up", &[("gpu", gpu)])
        .into_iter()
        .find(|(l, _)| l.get("uuid").is_none_or(String::is_empty))
        .map(|(_, v)| v)
}

fn counter(m: &Metrics, operation: &str, error: &str) -> f64 {
    m.get(
        "gpumem_exporter_nvml_errors_total",
        &[("operation", operation), ("error", error)],
    )
    .unwrap_or(0.0)
}

fn assert_exact(m: &Metrics, gpu: usize) {
    assert_eq!(
        value(m, "gpu_memory_used_bytes", gpu),
        Some(used(gpu)),
        "gpu {gpu}"
    );
    assert_eq!(
        value(m, "gpu_memory_total_bytes", gpu),
        Some(TOTAL),
        "gpu {gpu}"
    );
    assert_eq!(
        value(m, "gpu_memory_free_bytes", gpu),
        Some(TOTAL - 644_939_776 - used(gpu)),
        "gpu {gpu}"
    );
    let pid = (4_100_000 + gpu).to_string();
    let procs = m.find(
        "gpu_process_memory_used_bytes",
        &[("gpu", &gpu.to_string()), ("pid", &pid)],
    );
    assert_eq!(procs.len(), 1, "gpu {gpu}: {procs:?}");
    assert_eq!(procs[0].1 as u64, used(gpu) - 1000);
}

/// Three GPUs, the third lost from the start (every call on it fails, as
/// after Xid 79), or its handle not even given out: the two others are
/// served from the first sample, the third is `gpu_up 0` with its index,
/// and it joins with no restart once it answers.
#[test]
fn a_gpu_lost_from_the_start_is_down_while_the_others_serve_then_joins() {
    for (knob, operation) in [
        ("error: gpu_lost", "device_uuid"),
        ("handle_error: gpu_lost", "device_by_index"),
    ] {
        let sc = Scenario::new(&gpus("", 3, &[(2, knob)]));
        let ex = Exporter::start(&sc, &["--sample-interval", "500ms"]);
        let ready = ex.get("/readyz");
        let m = ex.metrics();
        let first = m
            .get("gpumem_exporter_last_sample_timestamp_seconds", &[])
            .expect("a sample");
        assert_eq!(ready.status, 200, "{knob}: {}", ready.body);
        eprintln!(
            "{knob}: /readyz 200 {:.3} s after the first sample",
            unix_now() - first
        );
        for (g, uuid) in UUIDS.iter().enumerate().take(2) {
            assert_exact(&m, g);
            assert_eq!(
                m.get("gpu_up", &[("gpu", &g.to_string()), ("uuid", uuid)]),
                Some(1.0)
            );
        }
        assert_eq!(up_unknown(&m, "2"), Some(0.0), "{knob}: {}", m.text);
        assert!(m.find("gpu_info", &[("gpu", "2")]).is_empty(), "{knob}");
        assert!(m.find("gpu_memory_used_bytes", &[("gpu", "2")]).is_empty());
        assert!(
            counter(&m, operation, "gpu_lost") >= 1.0,
            "{knob}: {}",
            m.text
        );
        // Retried at each full sample: the counter climbs.
        let before = counter(&m, operation, "gpu_lost");
        let m = wait_for(Duration::from_secs(5), "retries counted", || {
            let m = ex.metrics();
            (counter(&m, operation, "gpu_lost") >= before + 2.0).then_some(m)
        });
        assert_eq!(up_unknown(&m, "2"), Some(0.0));
        ex.assert_logged_once("GPU identity cannot be read");

        sc.write(&gpus("", 3, &[]));
        let healed = Instant::now();
        let m = wait_for(Duration::from_secs(5), "GPU 2 joins", || {
            let m = ex.metrics();
            (value(&m, "gpu_memory_used_bytes", 2).is_some()).then_some(m)
        });
        let took = healed.elapsed();
        eprintln!("{knob}: GPU 2 served {took:?} after it answered (sample interval 500ms)");
        assert!(
            took < Duration::from_millis(1500),
            "within one full sample (+ scrape slack): {took:?}"
        );
        assert_exact(&m, 2);
        let info = m.find("gpu_info", &[("gpu", "2"), ("uuid", UUIDS[2])]);
        assert_eq!(info.len(), 1, "{}", m.text);
        assert_eq!(up_unknown(&m, "2"), None, "no unknown-uuid series left");
        wait_for(Duration::from_secs(5), "the join logged", || {
            ex.stderr().contains("GPU answered").then_some(())
        });
        ex.assert_logged_once("GPU answered; its series start now");
    }
}

fn mig_scenario(instances: &[(u32, Option<u32>)]) -> String {
    let mut y = format!(
        "devices:\n  - uuid: {}\n    memory: {{total: {TOTAL}, reserved: 0, used: 9000000}}\n",
        UUIDS[0]
    );
    if !instances.is_empty() {
        y.push_str("    mig_devices:\n");
    }
    for (gi, pid) in instances {
        y.push_str(&format!(
            "      - uuid: MIG-d1500000-0000-0000-0000-00000000000{gi}\n        gpu_instance_id: {gi}\n        compute_instance_id: 0\n        memory: {{total: 17000000000, reserved: 0, used: {}}}\n",
            u64::from(*gi) * 1_000_000
        ));
        if let Some(pid) = pid {
            y.push_str(&format!(
                "        processes: [{{pid: {pid}, used: {}}}]\n",
                u64::from(*gi) * 999_000
            ));
        }
    }
    if instances.is_empty() {
        y.push_str("    processes: [{pid: 4200009, used: 5000}]\n");
    }
    y
}

fn mig_instances(m: &Metrics) -> Vec<String> {
    let mut v: Vec<String> = m
        .find("gpu_mig_info", &[("gpu", "0")])
        .into_iter()
        .map(|(l, _)| l["gpu_instance_id"].clone())
        .collect();
    v.sort();
    v
}

fn process_instance(m: &Metrics, pid: &str) -> Option<String> {
    m.find("gpu_process_memory_used_bytes", &[("pid", pid)])
        .into_iter()
        .next()
        .map(|(l, _)| l.get("gpu_instance_id").cloned().unwrap_or_default())
}

/// A MIG layout changed at run time: instances added (with a process),
/// removed (without one: found by the periodic rescan or a stale handle)
/// and MIG turned off, each seen within the rescan bound.
#[test]
fn mig_instances_follow_the_layout_at_run_time() {
    let rescan = Duration::from_secs(1);
    let sc = Scenario::new(&mig_scenario(&[(1, Some(4200001)), (2, None)]));
    let ex = Exporter::start(
        &sc,
        &["--sample-interval", "200ms", "--mig-rescan-interval", "1s"],
    );
    let m = ex.metrics();
    assert_eq!(mig_instances(&m), ["1", "2"]);
    assert_eq!(process_instance(&m, "4200001").as_deref(), Some("1"));
    let bound = rescan + Duration::from_millis(200) + Duration::from_millis(500);

    type Layout = &'static [(u32, Option<u32>)];
    let steps: [(&str, Layout, &[&str]); 4] = [
        (
            "a third instance with a process",
            &[(1, Some(4200001)), (2, None), (3, Some(4200003))],
            &["1", "2", "3"],
        ),
        (
            "an idle instance destroyed",
            &[(1, Some(4200001)), (3, Some(4200003))],
            &["1", "3"],
        ),
        (
            "an idle instance created",
            &[(1, Some(4200001)), (3, Some(4200003)), (4, None)],
            &["1", "3", "4"],
        ),
        ("MIG turned off", &[], &[]),
    ];
    for (what, layout, want) in steps {
        sc.write(&mig_scenario(layout));
        let t = Instant::now();
        let m = wait_for(Duration::from_secs(10), what, || {
            let m = ex.metrics();
            (mig_instances(&m) == want).then_some(m)
        });
        let took = t.elapsed();
        eprintln!("{what}: seen after {took:?} (rescan interval {rescan:?})");
        assert!(took <= bound, "{what}: {took:?} > {bound:?}");
        // Memory of each instance exact; processes attributed to theirs.
        for gi in want {
            let used = m
                .find("gpu_mig_memory_used_bytes", &[("gpu_instance_id", gi)])
                .into_iter()
                .next()
                .map(|(_, v)| v as u64);
            let wait = wait_for(Duration::from_secs(3), "instance memory", || {
                let m = ex.metrics();
                m.find("gpu_mig_memory_used_bytes", &[("gpu_instance_id", gi)])
                    .into_iter()
                    .next()
                    .map(|(_, v)| v as u64)
            });
            let gi_n: u64 = gi.parse().unwrap();
            assert_eq!(
                used.unwrap_or(wait),
                gi_n * 1_000_000,
                "{what}: instance {gi}"
            );
        }
        for (gi, pid) in layout.iter() {
            if let Some(pid) = pid {
                assert_eq!(
                    process_instance(&m, &pid.to_string()).as_deref(),
                    Some(gi.to_string().as_str()),
                    "{what}: pid {pid}"
                );
            }
        }
    }
    let m = ex.metrics();
    assert!(m.find("gpu_mig_memory_used_bytes", &[]).is_empty());
    assert_eq!(process_instance(&m, "4200009").as_deref(), Some(""));
    assert_eq!(ex.get("/readyz").status, 200);
}

/// The driver upgraded under the running exporter (RM version mismatch) or
/// unloaded: every GPU down, /readyz 503, one log line saying what to do;
/// NVML re-opened with backoff, and the new device list (here one GPU more)
/// served with no restart.
#[test]
fn a_driver_reloaded_at_run_time_is_followed_without_a_restart() {
    for (knob, needle) in [
        (
            "lib_rm_version_mismatch",
            "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
        ),
        ("driver_not_loaded", "NVML_ERROR_DRIVER_NOT_LOADED"),
    ] {
        let sc = Scenario::new(&gpus("", 2, &[]));
        let ex = Exporter::start(&sc, &["--sample-interval", "200ms"]);
        assert_eq!(ex.get("/readyz").status, 200);
        let pid = ex.child.id();
        // The upgrade under way: every call fails, and so does init.
        let init = if knob == "driver_not_loaded" {
            "init_error: driver_not_loaded\n".to_string()
        } else {
            format!("init_error: {knob}\n")
        };
        sc.write(&gpus(&format!("{init}runtime_error: {knob}\n"), 2, &[]));
        let t = Instant::now();
        wait_for(Duration::from_secs(5), "/readyz 503", || {
            (ex.get("/readyz").status == 503).then_some(())
        });
        eprintln!("{knob}: /readyz 503 after {:?}", t.elapsed());
        // Several re-open attempts fail meanwhile; still one log line.
        let m = wait_for(Duration::from_secs(10), "re-open attempts", || {
            let m = ex.metrics();
            (m.get("gpumem_exporter_nvml_reinit_attempts_total", &[])
                .unwrap_or(0.0)
                >= 2.0)
                .then_some(m)
        });
        for (g, uuid) in UUIDS.iter().enumerate().take(2) {
            assert_eq!(
                m.get("gpu_up", &[("gpu", &g.to_string()), ("uuid", uuid)]),
                Some(0.0),
                "{knob}: {}",
                m.text
            );
        }
        assert!(m.find("gpu_memory_used_bytes", &[]).is_empty());
        assert!(m.find("gpu_process_memory_used_bytes", &[]).is_empty());
        let counted: f64 = m
            .find("gpumem_exporter_nvml_errors_total", &[("error", knob)])
            .iter()
            .map(|(_, v)| v)
            .sum();
        assert!(counted >= 1.0, "{knob} counted: {}", m.text);
        assert_eq!(ex.get("/healthz").status, 200, "live throughout");
        ex.assert_logged_once(needle);

        // Rebooted into the new driver without us: three GPUs now.
        sc.write(&gpus("", 3, &[]));
        let t = Instant::now();
        let m = wait_for(Duration::from_secs(40), "series back", || {
            let m = ex.metrics();
            (value(&m, "gpu_memory_used_bytes", 2).is_some()).then_some(m)
        });
        eprintln!(
            "{knob}: served again {:?} after the driver answered",
            t.elapsed()
        );
        for g in 0..3 {
            assert_exact(&m, g);
        }
        assert_eq!(ex.get("/readyz").status, 200);
        assert_eq!(ex.child.id(), pid, "no restart");
        ex.assert_logged_once(needle);
        // The log is read by another thread: wait for the line, then count.
        wait_for(Duration::from_secs(5), "the re-open logged", || {
            ex.stderr().contains("NVML re-opened").then_some(())
        });
        ex.assert_logged_once("NVML re-opened");
    }
}
