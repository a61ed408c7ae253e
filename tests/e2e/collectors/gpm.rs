//! The `gpm` collector on the fake NVML's GPM calls: every metric with its
//! exact value in Prometheus units (ratio = NVML percent / 100, bytes/s =
//! MiB/s × 2^20), per GPU and per MIG GPU instance; a metric the GPU lacks
//! absent; a GPU without GPM absent and logged once; a scenario change
//! followed; off by default with no GPM call at all; a stale answer (the
//! fake's `gpm_stale`, samples that do not advance) not served, counted
//! and logged once.

use std::time::Duration;

use super::{calls, start};
use crate::harness::*;

const FULL: &str = "GPU-69a00000-0000-0000-0000-000000000000";
const MIG: &str = "GPU-69a00000-0000-0000-0000-000000000001";
const NONE: &str = "GPU-69a00000-0000-0000-0000-000000000002";
const MIB: f64 = 1_048_576.0;

fn scenario(sm_util: f64) -> String {
    format!(
        "devices:
  - uuid: {FULL}
    memory: {{total: 150754820096, reserved: 644939776, used: 1000}}
    gpm: {{sm_util: {sm_util}, sm_occupancy: 42.25, any_tensor_util: 60, dram_bw_util: 37.5,
           fp16_util: 12.5, fp32_util: 3, fp64_util: 0, pcie_tx_per_sec: 1024,
           pcie_rx_per_sec: 256.5, nvlink_total_tx_per_sec: 4096, nvlink_total_rx_per_sec: 2048}}
  - uuid: {MIG}
    gpm: {{sm_util: 20}}
    mig_devices:
      - uuid: MIG-69a00000-0000-0000-0000-000000000001
        gpu_instance_id: 1
        compute_instance_id: 0
        memory: {{total: 19000000000, used: 1000}}
        gpm: {{sm_util: 50, dram_bw_util: 25, nvlink_total_rx_per_sec: 8}}
      - uuid: MIG-69a00000-0000-0000-0000-000000000002
        gpu_instance_id: 2
        compute_instance_id: 0
        memory: {{total: 19000000000, used: 1000}}
  - uuid: {NONE}
    memory: {{total: 34359738368, used: 2000}}
"
    )
}

fn g(gpu: &'static str, uuid: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![("gpu", gpu), ("uuid", uuid)]
}

/// A figure to 9 significant digits: the fake's answers move by a
/// relative 2^-40 from one sample to the next, as a real GPU's never
/// repeat (docs/fake-nvml.md).
fn r(v: Option<f64>) -> Option<f64> {
    v.map(|v| {
        if v == 0.0 {
            return 0.0;
        }
        let scale = 10f64.powi(8 - v.abs().log10().floor() as i32);
        (v * scale).round() / scale
    })
}

#[test]
fn gpm_metrics_have_exact_values_per_gpu_and_mig_instance() {
    let sc = Scenario::new(&scenario(85.5));
    let calls_file = sc.dir.path().join("calls.txt");
    let ex = start(&sc, &calls_file, &["--collector.gpm"]);
    // The second full sample is the first with figures.
    let m = wait_for(Duration::from_secs(5), "GPM figures", || {
        let m = ex.metrics();
        (!m.find("gpu_mig_gpm_sm_activity_ratio", &[("gpu_instance_id", "1")])
            .is_empty()
            && m.get("gpu_gpm_sm_activity_ratio", &g("0", FULL)).is_some())
        .then_some(m)
    });
    let full = g("0", FULL);
    let want: [(&str, f64); 11] = [
        ("gpu_gpm_sm_activity_ratio", 85.5 / 100.0),
        ("gpu_gpm_sm_occupancy_ratio", 42.25 / 100.0),
        ("gpu_gpm_tensor_activity_ratio", 60.0 / 100.0),
        ("gpu_gpm_dram_bandwidth_utilization_ratio", 37.5 / 100.0),
        ("gpu_gpm_fp16_activity_ratio", 12.5 / 100.0),
        ("gpu_gpm_fp32_activity_ratio", 3.0 / 100.0),
        ("gpu_gpm_fp64_activity_ratio", 0.0),
        ("gpu_gpm_pcie_transmit_bytes_per_second", 1024.0 * MIB),
        ("gpu_gpm_pcie_receive_bytes_per_second", 256.5 * MIB),
        ("gpu_gpm_nvlink_transmit_bytes_per_second", 4096.0 * MIB),
        ("gpu_gpm_nvlink_receive_bytes_per_second", 2048.0 * MIB),
    ];
    for (name, v) in want {
        assert_eq!(r(m.get(name, &full)), r(Some(v)), "{name}\n{}", m.text);
    }
    // GPU 1 (MIG): its own sample has only SM activity; instance 1 three
    // metrics; instance 2 has no GPM, so no series.
    assert_eq!(
        r(m.get("gpu_gpm_sm_activity_ratio", &g("1", MIG))),
        Some(20.0 / 100.0)
    );
    assert!(
        m.find("gpu_gpm_sm_occupancy_ratio", &g("1", MIG))
            .is_empty()
    );
    let gi1 = [("gpu", "1"), ("uuid", MIG), ("gpu_instance_id", "1")];
    assert_eq!(r(m.get("gpu_mig_gpm_sm_activity_ratio", &gi1)), Some(0.5));
    assert_eq!(
        r(m.get("gpu_mig_gpm_dram_bandwidth_utilization_ratio", &gi1)),
        Some(0.25)
    );
    assert_eq!(
        r(m.get("gpu_mig_gpm_nvlink_receive_bytes_per_second", &gi1)),
        Some(8.0 * MIB)
    );
    assert_eq!(m.find("gpu_mig_gpm_sm_activity_ratio", &[]).len(), 1);
    assert!(m.find("gpu_mig_gpm_tensor_activity_ratio", &[]).is_empty());
    // GPU 2 has no GPM: nothing, logged once, nothing counted.
    for (name, _) in want {
        assert!(m.find(name, &[("gpu", "2")]).is_empty(), "{name}");
        assert_eq!(
            m.find(name, &[]).len(),
            1 + usize::from(name.contains("sm_activity"))
        );
    }
    assert!(
        m.find("gpumem_exporter_nvml_errors_total", &[]).is_empty(),
        "{}",
        m.text
    );
    std::thread::sleep(Duration::from_millis(500));
    let log = ex.stderr();
    assert_eq!(log.matches("gpm_query_device_support").count(), 1, "{log}");
    assert_eq!(log.matches("gpm_mig_sample_get").count(), 1, "{log}");
    // The support query once per GPU, not per sample.
    let c = calls(&calls_file);
    assert_eq!(c.get("nvmlGpmQueryDeviceSupport"), Some(&3), "{c:?}");
    assert!(
        c.get("nvmlGpmMetricsGet").copied().unwrap_or(0) >= 3,
        "{c:?}"
    );

    // A new value: the figures follow at the next samples.
    sc.write(&scenario(10.0));
    wait_for(Duration::from_secs(5), "the new SM activity", || {
        let m = ex.metrics();
        (r(m.get("gpu_gpm_sm_activity_ratio", &g("0", FULL))) == Some(10.0 / 100.0)).then_some(())
    });
    // Samples are freed as they are replaced: allocs and frees differ by
    // the ones kept (GPU 0, GPU 1 and its instance 1), at most one more
    // in flight.
    let c = calls(&calls_file);
    let (alloc, free) = (
        c.get("nvmlGpmSampleAlloc").copied().unwrap_or(0),
        c.get("nvmlGpmSampleFree").copied().unwrap_or(0),
    );
    assert!(alloc > 6 && alloc - free <= 4, "{c:?}");
}

#[test]
fn gpm_is_off_by_default_and_makes_no_call() {
    let sc = Scenario::new(&scenario(85.5));
    let calls_file = sc.dir.path().join("calls.txt");
    let ex = start(&sc, &calls_file, &[]);
    let c = wait_for(Duration::from_secs(3), "call counts written", || {
        let c = calls(&calls_file);
        (c.get("nvmlDeviceGetMemoryInfo_v2").copied().unwrap_or(0) >= 5).then_some(c)
    });
    assert!(
        c.keys().all(|f| !f.starts_with("nvmlGpm")),
        "GPM called: {c:?}"
    );
    let m = ex.metrics();
    assert!(!m.text.contains("gpu_gpm_"), "{}", m.text);
    assert!(!m.text.contains("gpu_mig_gpm_"), "{}", m.text);
}

#[test]
fn a_stale_gpm_answer_is_not_served_counted_and_logged_once() {
    let sc = Scenario::new(&scenario(85.5));
    let calls_file = sc.dir.path().join("calls.txt");
    let ex = start(&sc, &calls_file, &["--collector.gpm"]);
    let full = g("0", FULL);
    let stale = |m: &Metrics| m.get("gpumem_exporter_gpm_stale_readings_total", &full);
    wait_for(Duration::from_secs(5), "GPM figures", || {
        let m = ex.metrics();
        (m.get("gpu_gpm_sm_activity_ratio", &full).is_some() && stale(&m) == Some(0.0))
            .then_some(())
    });
    // Samples that do not advance on GPU 0 (a second GPM client): its
    // figures go, the stale answers are counted; GPU 1 keeps its own.
    sc.write(&scenario(85.5).replacen(
        "    gpm: {sm_util",
        "    gpm_stale: true\n    gpm: {sm_util",
        1,
    ));
    let m = wait_for(Duration::from_secs(5), "the stale answers counted", || {
        let m = ex.metrics();
        (stale(&m).is_some_and(|n| n >= 2.0)).then_some(m)
    });
    for name in [
        "gpu_gpm_sm_activity_ratio",
        "gpu_gpm_tensor_activity_ratio",
        "gpu_gpm_pcie_transmit_bytes_per_second",
    ] {
        assert!(
            m.find(name, &full).is_empty(),
            "{name} served while stale:\n{}",
            m.text
        );
    }
    assert!(
        r(m.get("gpu_gpm_sm_activity_ratio", &g("1", MIG))) == Some(0.2),
        "{}",
        m.text
    );
    // Every sample while stale: absent at each of 4 scrapes, counted on.
    let mut last = stale(&m).unwrap_or(0.0);
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(600));
        let m = ex.metrics();
        assert!(
            m.find("gpu_gpm_sm_activity_ratio", &full).is_empty(),
            "{}",
            m.text
        );
        let n = stale(&m).unwrap_or(0.0);
        assert!(n >= last, "{n} < {last}");
        last = n;
    }
    assert!(last >= 4.0, "{last}");
    assert!(
        m.find("gpumem_exporter_nvml_errors_total", &[]).is_empty(),
        "a stale answer is no NVML error:\n{}",
        m.text
    );
    // The samples advance again: figures back, the count kept.
    sc.write(&scenario(85.5));
    let m = wait_for(Duration::from_secs(5), "fresh GPM figures again", || {
        let m = ex.metrics();
        m.get("gpu_gpm_sm_activity_ratio", &full)
            .is_some()
            .then_some(m)
    });
    assert!(stale(&m).is_some_and(|n| n >= last), "{}", m.text);
    ex.assert_logged_once("GPM answered exactly the figures of the previous sample");
}
