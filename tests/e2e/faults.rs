//! End-to-end faults: NVML not ready at start, every GPU lost, a hung NVML
//! call, config reload on SIGHUP. The fake NVML has a knob for each.

use std::time::{Duration, Instant};

use crate::harness::*;

const UUID0: &str = "GPU-eeeeeeee-0000-0000-0000-000000000000";
const UUID1: &str = "GPU-ffffffff-0000-0000-0000-000000000000";

fn scenario(init_error: &str, error: &str, delay_ms: u64, procs: usize) -> String {
    let mut p = String::new();
    for i in 0..procs {
        p.push_str(&format!(
            "      - {{pid: {}, used: {}}}\n",
            3900000 + i,
            1000 * (i + 1)
        ));
    }
    let p = if p.is_empty() {
        " []\n".to_string()
    } else {
        format!("\n{p}")
    };
    format!(
        "init_error: {init_error}\ndevices:\n  - uuid: {UUID0}\n    memory: {{total: 1000000, reserved: 0, used: 1000}}\n    error: {error}\n    delay_ms: {delay_ms}\n    processes:{p}  - uuid: {UUID1}\n    memory: {{total: 1000000, reserved: 0, used: 2000}}\n    error: {error}\n"
    )
}

/// Driver not loaded yet (after a reboot) or no permission yet: the process
/// stays up, says why once, is live but not ready, and recovers by itself.
#[test]
fn nvml_not_ready_at_start_then_recovers() {
    for init_error in ["driver_not_loaded", "no_permission"] {
        let sc = Scenario::new(&scenario(init_error, "null", 0, 1));
        let ex = Exporter::start(&sc, &["--sample-interval", "200ms"]);
        assert_eq!(ex.get("/healthz").status, 200, "{init_error}: live");
        let ready = ex.get("/readyz");
        assert_eq!(ready.status, 503, "{init_error}: not ready");
        assert!(
            ready.body.contains("NVML is not initialised yet"),
            "{}",
            ready.body
        );
        assert_eq!(ex.get("/metrics").status, 503);
        let want = match init_error {
            "driver_not_loaded" => "NVIDIA kernel driver is not loaded",
            _ => "no permission to talk to the driver",
        };
        let log = ex.stderr();
        assert!(
            log.contains(want) && log.contains("retries with backoff"),
            "{log}"
        );
        assert!(
            log.contains(fake_nvml().to_str().unwrap()),
            "names where NVML came from: {log}"
        );
        // Still live after a few backoff rounds.
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(ex.get("/healthz").status, 200);
        sc.write(&scenario("null", "null", 0, 1));
        let t = Instant::now();
        wait_for(Duration::from_secs(10), "ready after NVML answers", || {
            (ex.get("/readyz").status == 200).then_some(())
        });
        let m = ex.metrics();
        assert_eq!(m.get("gpu_up", &[("gpu", "0"), ("uuid", UUID0)]), Some(1.0));
        ex.assert_logged_once("retries with backoff");
        eprintln!("{init_error}: ready {:?} after NVML answered", t.elapsed());
    }
}

#[test]
fn every_gpu_lost_keeps_serving_then_recovers() {
    let sc = Scenario::new(&scenario("null", "null", 0, 2));
    let ex = Exporter::start(&sc, &["--sample-interval", "100ms"]);
    assert_eq!(ex.get("/readyz").status, 200);
    sc.write(&scenario("null", "gpu_lost", 0, 2));
    let m = wait_for(Duration::from_secs(5), "both GPUs down", || {
        let m = ex.metrics();
        (m.get("gpu_up", &[("gpu", "0"), ("uuid", UUID0)]) == Some(0.0)
            && m.get("gpu_up", &[("gpu", "1"), ("uuid", UUID1)]) == Some(0.0))
        .then_some(m)
    });
    assert!(
        m.find("gpu_process_memory_used_bytes", &[]).is_empty(),
        "no stale processes"
    );
    assert_eq!(ex.get("/readyz").status, 503);
    assert_eq!(ex.get("/healthz").status, 200);
    // NVML is re-opened (with backoff) while every GPU keeps failing.
    wait_for(Duration::from_secs(5), "a re-open attempt", || {
        (ex.metrics()
            .get("gpumem_exporter_nvml_reinit_attempts_total", &[])
            .unwrap_or(0.0)
            >= 1.0)
            .then_some(())
    });
    sc.write(&scenario("null", "null", 0, 2));
    wait_for(Duration::from_secs(5), "recovery", || {
        let m = ex.metrics();
        (m.get("gpu_up", &[("gpu", "0"), ("uuid", UUID0)]) == Some(1.0)
            && m.get("gpu_up", &[("gpu", "1"), ("uuid", UUID1)]) == Some(1.0)
            && m.find("gpu_process_memory_used_bytes", &[]).len() == 2)
            .then_some(())
    });
    assert_eq!(ex.get("/readyz").status, 200);
}

/// A hung NVML call: /metrics keeps serving the last snapshot (its age
/// visible), /healthz fails after 3 missed intervals, then recovers.
#[test]
fn hung_nvml_call_keeps_serving_and_fails_liveness() {
    let sc = Scenario::new(&scenario("null", "null", 0, 1));
    let ex = Exporter::start(
        &sc,
        &[
            "--sample-interval",
            "100ms",
            "--memory-sample-interval",
            "100ms",
        ],
    );
    assert_eq!(ex.get("/healthz").status, 200);
    sc.write(&scenario("null", "null", 2500, 1));
    let t = Instant::now();
    let unhealthy = wait_for(Duration::from_secs(3), "/healthz 503", || {
        let r = ex.get("/healthz");
        (r.status == 503).then_some(r.body)
    });
    assert!(unhealthy.contains("an NVML call may hang"), "{unhealthy}");
    eprintln!("/healthz failed {:?} after the hang began", t.elapsed());
    // Scrapes still answer at once, with the last snapshot, whose age shows.
    let s = Instant::now();
    let m = ex.metrics();
    assert!(
        s.elapsed() < Duration::from_millis(500),
        "scrape took {:?}",
        s.elapsed()
    );
    let ts = m
        .get("gpumem_exporter_last_sample_timestamp_seconds", &[])
        .unwrap();
    let now = unix_now();
    assert!(now - ts >= 0.3, "sample age {} s", now - ts);
    assert_eq!(m.get("gpu_up", &[("gpu", "0"), ("uuid", UUID0)]), Some(1.0));
    sc.write(&scenario("null", "null", 0, 1));
    wait_for(Duration::from_secs(10), "/healthz 200 again", || {
        (ex.get("/healthz").status == 200).then_some(())
    });
}

#[test]
fn sighup_reloads_config_and_keeps_the_old_one_when_bad() {
    let sc = Scenario::new(&scenario("null", "null", 0, 5));
    let ex = Exporter::with_config(&sc, "sample_interval: 100ms\n", &[]);
    let count = |ex: &Exporter| {
        ex.metrics()
            .find("gpu_process_memory_used_bytes", &[("gpu", "0")])
            .len()
    };
    assert_eq!(count(&ex), 5);
    sc.file(
        "config.yaml",
        b"sample_interval: 100ms\nprocesses:\n  top_n: 2\n",
    );
    ex.signal_only("HUP");
    wait_for(Duration::from_secs(5), "top_n 2 applied", || {
        (count(&ex) == 3).then_some(())
    });
    let ok = |ex: &Exporter, result: &str| {
        ex.metrics()
            .get(
                "gpumem_exporter_config_reloads_total",
                &[("result", result)],
            )
            .unwrap_or(-1.0)
    };
    assert_eq!(ok(&ex, "success"), 1.0);
    sc.file(
        "config.yaml",
        b"sample_interval: 100ms\nprocesses:\n  top_n: lots\n",
    );
    ex.signal_only("HUP");
    wait_for(Duration::from_secs(5), "failure counted", || {
        (ok(&ex, "failure") == 1.0).then_some(())
    });
    assert_eq!(count(&ex), 3, "the running config stays");
    assert!(
        ex.stderr()
            .contains("config reload failed, keeping the running config"),
        "{}",
        ex.stderr()
    );
    assert!(
        ex.stderr().contains("key processes.top_n"),
        "{}",
        ex.stderr()
    );
    assert_eq!(ex.get("/healthz").status, 200);
}
