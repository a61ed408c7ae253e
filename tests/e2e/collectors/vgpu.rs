//! A vGPU guest (`nvmlDeviceGetVirtualizationMode` = VGPU): the collectors
//! whose calls misbehave there (health: row remapping fills the guest's
//! kernel log) are skipped on its GPU, said once; the rest is served.

use std::time::Duration;

use super::{calls, start};
use crate::harness::*;

const GUEST: &str = "GPU-76900000-0000-0000-0000-000000000000";

fn scenario(mode: &str) -> String {
    format!(
        "devices:
  - uuid: {GUEST}
    name: GRID H200-80C
    virtualization_mode: {mode}
    memory: {{total: 85899345920, reserved: 0, used: 1000}}
    temperature_c: 51
    ecc: {{enabled: true}}
    remapped_rows: {{correctable: 0, uncorrectable: 0}}
    xid_events: []
"
    )
}

const HEALTH_CALLS: [&str; 5] = [
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetEccMode",
    "nvmlDeviceGetRetiredPages",
    "nvmlDeviceRegisterEvents",
];

#[test]
fn a_vgpu_guest_skips_health_and_says_so_once() {
    let sc = Scenario::new(&scenario("vgpu"));
    let calls_file = sc.dir.path().join("calls.txt");
    let ex = start(&sc, &calls_file, &[]);
    let c = wait_for(Duration::from_secs(3), "call counts written", || {
        let c = calls(&calls_file);
        (c.get("nvmlDeviceGetMemoryInfo_v2").copied().unwrap_or(0) >= 5).then_some(c)
    });
    for f in HEALTH_CALLS {
        assert_eq!(c.get(f), None, "{f} called in a vGPU guest: {c:?}");
    }
    assert_eq!(c.get("nvmlDeviceGetVirtualizationMode"), Some(&1), "{c:?}");
    let m = ex.metrics();
    let gpu = [("gpu", "0"), ("uuid", GUEST)];
    assert_eq!(m.get("gpu_up", &gpu), Some(1.0));
    assert_eq!(m.get("gpu_temperature_celsius", &gpu), Some(51.0));
    assert!(
        m.find("gpu_memory_ecc_enabled", &[]).is_empty(),
        "{}",
        m.text
    );
    assert!(m.find("gpu_memory_remapped_rows", &[]).is_empty());
    assert!(m.find("gpumem_exporter_nvml_errors_total", &[]).is_empty());
    ex.assert_logged_once("GPU of a vGPU guest");
    assert!(ex.stderr().contains("skipped=health"), "{}", ex.stderr());
}

/// The same GPU in passthrough (or on bare metal) keeps health.
#[test]
fn passthrough_keeps_health() {
    let sc = Scenario::new(&scenario("passthrough"));
    let calls_file = sc.dir.path().join("calls.txt");
    let ex = start(&sc, &calls_file, &[]);
    let gpu = [("gpu", "0"), ("uuid", GUEST)];
    wait_for(Duration::from_secs(3), "health served", || {
        let m = ex.metrics();
        (m.get("gpu_memory_ecc_enabled", &gpu) == Some(1.0)).then_some(())
    });
    let m = ex.metrics();
    assert_eq!(
        m.get(
            "gpu_memory_remapped_rows",
            &[("gpu", "0"), ("uuid", GUEST), ("cause", "correctable")]
        ),
        Some(0.0)
    );
    assert!(!ex.stderr().contains("GPU of a vGPU guest"));
}
