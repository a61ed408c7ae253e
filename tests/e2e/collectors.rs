//! End-to-end collectors: utilization, process_utilization, power_thermal
//! and health on the fake NVML — every family with exact values, absent
//! where the GPU does not support the call, and each collector switched off
//! removing its families and its NVML calls (the fake's call counts).

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use crate::harness::*;

#[cfg(feature = "external-tools")]
mod external;
mod gpm;
mod vgpu;

const H200: &str = "GPU-c0110000-0000-0000-0000-000000000000";
const V100: &str = "GPU-c0110000-0000-0000-0000-000000000001";
const BARE: &str = "GPU-c0110000-0000-0000-0000-000000000002";

/// GPU 0 answers everything an H200 does (row remapping), GPU 1 what an
/// older GPU does (page retirement, no row remapping), GPU 2 nothing.
fn scenario(xids: &str) -> String {
    format!(
        "devices:
  - uuid: {H200}
    memory: {{total: 150754820096, reserved: 644939776, used: 42000000000}}
    processes: [{{pid: 4300001, used: 40000000000}}, {{pid: 4300002, used: 1000000000}}]
    utilization: {{gpu: 93, memory: 41, encoder: 7, decoder: 3}}
    process_utilization:
      - {{pid: 4300001, sm: 88, memory: 40, encoder: 1, decoder: 2}}
    temperature_c: 62
    power_mw: 692700
    power_limit_mw: 700000
    energy_mj: 81234567890
    clocks_mhz: {{graphics: 1470, sm: 1980, memory: 3201, video: 1305}}
    performance_state: 2
    clock_event_reasons: 0x24
    ecc: {{enabled: true, corrected_volatile: 5, corrected_aggregate: 17, uncorrected_volatile: 1, uncorrected_aggregate: 2}}
    remapped_rows: {{correctable: 3, uncorrectable: 1, pending: true, failed: false}}
    xid_events: [{xids}]
  - uuid: {V100}
    memory: {{total: 34359738368, reserved: 0, used: 1000}}
    temperature_c: 40
    ecc: {{enabled: false}}
    retired_pages: {{single_bit_ecc: 2, double_bit_ecc: 1, pending: true}}
  - uuid: {BARE}
    memory: {{total: 34359738368, reserved: 0, used: 2000}}
"
    )
}

/// Labels of a series.
type Labels = Vec<(&'static str, &'static str)>;

fn g(gpu: &'static str, uuid: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![("gpu", gpu), ("uuid", uuid)]
}

fn with(
    mut base: Vec<(&'static str, &'static str)>,
    more: &[(&'static str, &'static str)],
) -> Vec<(&'static str, &'static str)> {
    base.extend_from_slice(more);
    base
}

/// The fake's call counts, by function.
fn calls(path: &std::path::Path) -> BTreeMap<String, u64> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (f, n) = l.split_once(' ')?;
            Some((f.to_string(), n.parse().ok()?))
        })
        .collect()
}

fn start(sc: &Scenario, calls_file: &std::path::Path, extra: &[&str]) -> Exporter {
    let mut args = vec!["--sample-interval", "200ms"];
    args.extend_from_slice(extra);
    let mut cmd = Exporter::command(Command::new(BIN), sc, &args);
    cmd.env("FAKE_NVML_CALLS", calls_file);
    Exporter::spawn(cmd)
}

/// Families of each collector, and the NVML functions it calls.
const COLLECTORS: [(&str, &[&str], &[&str]); 4] = [
    (
        "utilization",
        &[
            "gpu_utilization_ratio",
            "gpu_memory_utilization_ratio",
            "gpu_encoder_utilization_ratio",
            "gpu_decoder_utilization_ratio",
        ],
        &[
            "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceGetEncoderUtilization",
            "nvmlDeviceGetDecoderUtilization",
        ],
    ),
    (
        "process_utilization",
        &[
            "gpu_process_sm_utilization_ratio",
            "gpu_process_memory_utilization_ratio",
            "gpu_process_encoder_utilization_ratio",
            "gpu_process_decoder_utilization_ratio",
        ],
        &["nvmlDeviceGetProcessUtilization"],
    ),
    (
        "power_thermal",
        &[
            "gpu_temperature_celsius",
            "gpu_power_usage_watts",
            "gpu_power_limit_watts",
            "gpu_energy_consumed_joules_total",
            "gpu_clock_hertz",
            "gpu_performance_state",
            "gpu_clock_event_active",
        ],
        &[
            "nvmlDeviceGetTemperature",
            "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetEnforcedPowerLimit",
            "nvmlDeviceGetClockInfo",
            "nvmlDeviceGetPerformanceState",
            "nvmlDeviceGetCurrentClocksEventReasons",
        ],
    ),
    (
        "health",
        &[
            "gpu_memory_ecc_enabled",
            "gpu_memory_ecc_errors_total",
            "gpu_memory_remapped_rows",
            "gpu_memory_row_remap_pending",
            "gpu_memory_row_remap_failed",
            "gpu_memory_retired_pages",
            "gpu_memory_retired_pages_pending",
            "gpu_xid_errors_total",
        ],
        &[
            "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetRemappedRows",
            "nvmlDeviceGetRetiredPages",
            "nvmlDeviceGetRetiredPagesPendingStatus",
            "nvmlDeviceRegisterEvents",
            "nvmlEventSetWait_v2",
        ],
    ),
];

#[test]
fn every_collector_family_has_exact_values_and_is_absent_where_unsupported() {
    let sc = Scenario::new(&scenario("79, 48, 79"));
    let calls_file = sc.dir.path().join("calls.txt");
    let ex = start(&sc, &calls_file, &["--collector.process_utilization"]);
    let m = wait_for(Duration::from_secs(5), "three Xids counted", || {
        let m = ex.metrics();
        (m.get(
            "gpu_xid_errors_total",
            &with(g("0", H200), &[("xid", "79")]),
        ) == Some(2.0))
        .then_some(m)
    });
    let want: Vec<(&str, Labels, f64)> = vec![
        ("gpu_utilization_ratio", g("0", H200), 0.93),
        ("gpu_memory_utilization_ratio", g("0", H200), 0.41),
        ("gpu_encoder_utilization_ratio", g("0", H200), 0.07),
        ("gpu_decoder_utilization_ratio", g("0", H200), 0.03),
        ("gpu_temperature_celsius", g("0", H200), 62.0),
        ("gpu_temperature_celsius", g("1", V100), 40.0),
        ("gpu_power_usage_watts", g("0", H200), 692.7),
        ("gpu_power_limit_watts", g("0", H200), 700.0),
        (
            "gpu_energy_consumed_joules_total",
            g("0", H200),
            81_234_567.89,
        ),
        (
            "gpu_clock_hertz",
            with(g("0", H200), &[("clock", "graphics")]),
            1_470_000_000.0,
        ),
        (
            "gpu_clock_hertz",
            with(g("0", H200), &[("clock", "sm")]),
            1_980_000_000.0,
        ),
        (
            "gpu_clock_hertz",
            with(g("0", H200), &[("clock", "memory")]),
            3_201_000_000.0,
        ),
        (
            "gpu_clock_hertz",
            with(g("0", H200), &[("clock", "video")]),
            1_305_000_000.0,
        ),
        ("gpu_performance_state", g("0", H200), 2.0),
        // 0x24 = sw_power_cap (0x4) + sw_thermal_slowdown (0x20).
        (
            "gpu_clock_event_active",
            with(g("0", H200), &[("reason", "sw_power_cap")]),
            1.0,
        ),
        (
            "gpu_clock_event_active",
            with(g("0", H200), &[("reason", "sw_thermal_slowdown")]),
            1.0,
        ),
        (
            "gpu_clock_event_active",
            with(g("0", H200), &[("reason", "gpu_idle")]),
            0.0,
        ),
        (
            "gpu_clock_event_active",
            with(g("0", H200), &[("reason", "hw_slowdown")]),
            0.0,
        ),
        ("gpu_memory_ecc_enabled", g("0", H200), 1.0),
        ("gpu_memory_ecc_enabled", g("1", V100), 0.0),
        (
            "gpu_memory_ecc_errors_total",
            with(
                g("0", H200),
                &[("type", "corrected"), ("scope", "volatile")],
            ),
            5.0,
        ),
        (
            "gpu_memory_ecc_errors_total",
            with(
                g("0", H200),
                &[("type", "corrected"), ("scope", "aggregate")],
            ),
            17.0,
        ),
        (
            "gpu_memory_ecc_errors_total",
            with(
                g("0", H200),
                &[("type", "uncorrected"), ("scope", "volatile")],
            ),
            1.0,
        ),
        (
            "gpu_memory_ecc_errors_total",
            with(
                g("0", H200),
                &[("type", "uncorrected"), ("scope", "aggregate")],
            ),
            2.0,
        ),
        (
            "gpu_memory_remapped_rows",
            with(g("0", H200), &[("cause", "correctable")]),
            3.0,
        ),
        (
            "gpu_memory_remapped_rows",
            with(g("0", H200), &[("cause", "uncorrectable")]),
            1.0,
        ),
        ("gpu_memory_row_remap_pending", g("0", H200), 1.0),
        ("gpu_memory_row_remap_failed", g("0", H200), 0.0),
        (
            "gpu_memory_retired_pages",
            with(g("1", V100), &[("cause", "single_bit_ecc")]),
            2.0,
        ),
        (
            "gpu_memory_retired_pages",
            with(g("1", V100), &[("cause", "double_bit_ecc")]),
            1.0,
        ),
        ("gpu_memory_retired_pages_pending", g("1", V100), 1.0),
        (
            "gpu_xid_errors_total",
            with(g("0", H200), &[("xid", "79")]),
            2.0,
        ),
        (
            "gpu_xid_errors_total",
            with(g("0", H200), &[("xid", "48")]),
            1.0,
        ),
    ];
    for (name, labels, value) in &want {
        assert_eq!(
            m.get(name, labels),
            Some(*value),
            "{name} {labels:?}\n{}",
            m.text
        );
    }
    // Nothing else: every series of these families is one of the above.
    let families: Vec<&str> = COLLECTORS
        .iter()
        .filter(|(c, _, _)| *c != "process_utilization")
        .flat_map(|(_, f, _)| f.iter().copied())
        .collect();
    for f in &families {
        let expected = want.iter().filter(|(n, _, _)| n == f).count();
        let mut got = m.find(f, &[]).len();
        if *f == "gpu_clock_event_active" {
            got -= 5; // the 5 reasons of GPU 0 not listed above, all 0
            assert_eq!(m.find(f, &[("gpu", "0")]).len(), 9, "all nine reasons");
        }
        assert_eq!(got, expected, "{f}: {:?}", m.find(f, &[]));
    }
    // GPU 2 supports none of it: no series at all, and nothing counted.
    for f in &families {
        assert!(m.find(f, &[("gpu", "2")]).is_empty(), "{f} for GPU 2");
    }
    assert!(
        m.find("gpumem_exporter_nvml_errors_total", &[]).is_empty(),
        "{}",
        m.text
    );
    // Unsupported calls are logged once per GPU and call, not per sample.
    let lines = |ex: &Exporter| ex.stderr().matches("gpu=2 calls=").count();
    let before = lines(&ex);
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(lines(&ex), before, "logged again:\n{}", ex.stderr());
    assert!((1..=3).contains(&before), "{}", ex.stderr());
    assert!(ex.stderr().contains("temperature"), "{}", ex.stderr());

    // Per process: the labels of gpu_process_memory_used_bytes; the busy
    // pid's figures, 0 for the one with no sample.
    let mem = m.find("gpu_process_memory_used_bytes", &[("gpu", "0")]);
    for (name, busy) in [
        ("gpu_process_sm_utilization_ratio", 0.88),
        ("gpu_process_memory_utilization_ratio", 0.40),
        ("gpu_process_encoder_utilization_ratio", 0.01),
        ("gpu_process_decoder_utilization_ratio", 0.02),
    ] {
        let got = m.find(name, &[("gpu", "0")]);
        let labels: Vec<_> = got.iter().map(|(l, _)| l.clone()).collect();
        let mem_labels: Vec<_> = mem.iter().map(|(l, _)| l.clone()).collect();
        assert_eq!(labels, mem_labels, "{name}: same series as process memory");
        let v = |pid: &str| got.iter().find(|(l, _)| l["pid"] == pid).map(|(_, v)| *v);
        assert_eq!(v("4300001"), Some(busy), "{name}");
    }
    // Only the first sample after a scenario write carries the samples: the
    // process is idle after that.
    wait_for(
        Duration::from_secs(3),
        "busy pid idle after its sample",
        || {
            let m = ex.metrics();
            let v = m.find("gpu_process_sm_utilization_ratio", &[("pid", "4300001")]);
            (v.len() == 1 && v[0].1 == 0.0).then_some(())
        },
    );
    let c = calls(&calls_file);
    assert!(
        c.get("nvmlDeviceGetTotalEnergyConsumption")
            .copied()
            .unwrap_or(0)
            <= 3,
        "energy is a slow read: {c:?}"
    );
}

#[test]
fn each_collector_switched_off_removes_its_families_and_its_calls() {
    for (collector, families, functions) in COLLECTORS {
        let sc = Scenario::new(&scenario("79"));
        let calls_file = sc.dir.path().join("calls.txt");
        // process_activity makes process_utilization's query on its own
        // interval: off here, so each collector's calls are its own.
        let mut flags = vec![
            "--collector.process_utilization".to_string(),
            "--no-collector.process_activity".to_string(),
        ];
        flags.push(format!("--no-collector.{collector}"));
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let ex = start(&sc, &calls_file, &flags);
        std::thread::sleep(Duration::from_millis(700));
        let m = ex.metrics();
        for f in families {
            assert!(
                m.find(f, &[]).is_empty(),
                "--no-collector.{collector}: {f} still served"
            );
        }
        // The other collectors still serve.
        for (other, fams, _) in COLLECTORS.iter().filter(|(c, _, _)| *c != collector) {
            assert!(
                !m.find(fams[0], &[]).is_empty(),
                "--no-collector.{collector}: {other} lost {}",
                fams[0]
            );
        }
        let c = wait_for(Duration::from_secs(3), "call counts written", || {
            let c = calls(&calls_file);
            (c.get("nvmlDeviceGetMemoryInfo_v2").copied().unwrap_or(0) >= 5).then_some(c)
        });
        for f in functions {
            assert_eq!(
                c.get(*f),
                None,
                "--no-collector.{collector}: {f} called: {c:?}"
            );
        }
        eprintln!(
            "--no-collector.{collector}: none of {functions:?} called; {} calls of memory_info",
            c["nvmlDeviceGetMemoryInfo_v2"]
        );
    }
    // processes off: no process list calls, no process families.
    let sc = Scenario::new(&scenario("79"));
    let calls_file = sc.dir.path().join("calls.txt");
    let ex = start(
        &sc,
        &calls_file,
        &[
            "--no-collector.processes",
            "--collector.process_utilization",
        ],
    );
    std::thread::sleep(Duration::from_millis(700));
    let m = ex.metrics();
    assert!(m.find("gpu_process_memory_used_bytes", &[]).is_empty());
    assert!(m.find("gpu_process_sm_utilization_ratio", &[]).is_empty());
    assert_eq!(
        m.get_u64("gpu_memory_used_bytes", &g("0", H200)),
        Some(42_000_000_000)
    );
    let c = calls(&calls_file);
    for f in [
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetProcessUtilization",
    ] {
        assert_eq!(c.get(f), None, "--no-collector.processes: {f} called");
    }
    // The memory collector cannot be switched off.
    let (code, err) = run_to_exit(&["--no-collector.memory"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("the memory collector (device memory and peaks) cannot be switched off"),
        "{err}"
    );
}

#[test]
fn sighup_applies_the_collectors_map() {
    let sc = Scenario::new(&scenario("79"));
    let ex = Exporter::with_config(
        &sc,
        "collectors:\n  power_thermal: false\n",
        &["--sample-interval", "200ms"],
    );
    assert!(ex.metrics().find("gpu_temperature_celsius", &[]).is_empty());
    sc.file(
        "config.yaml",
        b"collectors:\n  power_thermal: true\n  utilization: false\n",
    );
    ex.signal_only("HUP");
    wait_for(Duration::from_secs(5), "collectors reloaded", || {
        let m = ex.metrics();
        (!m.find("gpu_temperature_celsius", &[]).is_empty()
            && m.find("gpu_utilization_ratio", &[]).is_empty())
        .then_some(())
    });
}
