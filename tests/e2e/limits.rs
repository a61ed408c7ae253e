//! Each workload's own limits on the fake NVML and a fake node: the
//! driver's per-cgroup limits (`nvmlDeviceGetMemoryLimits_v1`, answered
//! by the scenario's `memory_limits` by the cgroup directory asked) and the
//! kernel's `dmem.max` (a fake cgroup v2 hierarchy that lists `dmem`):
//! - a pod's container under a pod directory with a driver limit gets its
//!   hard and soft limit, `source="driver"`; a pod with `dmem.max` on its
//!   directory its `dmem` limit; each with its used bytes beside it;
//! - a process in a delegated cgroup (a directory owned by a user, which
//!   that user could have filled with any limit files) gets none, though
//!   the fake and `dmem.max` both have one for its path;
//! - `gpumem_exporter_limit_sources` says driver 1, dmem 1; no NVML error
//!   is counted for the directories the driver knows nothing of;
//! - a driver without the call (a copy of the fake with the symbol's name
//!   patched, so `dlsym` finds nothing): no driver series, driver 0, no
//!   error counted, dmem unaffected.
//!
//! The forecast of a limit (flat, then growing toward it) is in
//! `limits::forecast`.

#[cfg(feature = "external-tools")]
#[path = "limits/forecast.rs"]
mod forecast;

use std::os::unix::fs::chown;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::harness::cluster::{cgroupfs_of, containerd_cgroup, write_proc};
use crate::harness::*;

const UUID: &str = "GPU-11a10000-0000-0000-0000-000000000000";
const GIB: u64 = 1 << 30;
const POD_A: &str = "aaaaaaaa-1111-4111-8111-111111111111";
const POD_B: &str = "bbbbbbbb-2222-4222-8222-222222222222";

fn cid(c: char) -> String {
    std::iter::repeat_n(c, 64).collect()
}

/// The v2 path of pod `uid`'s directory under containerd (systemd driver).
fn pod_dir(uid: &str) -> String {
    let cg = containerd_cgroup(uid, &cid('0'));
    let path = cg.trim().trim_start_matches("0::");
    path.rsplit_once('/')
        .map(|(d, _)| d.to_string())
        .unwrap_or_default()
}

/// The fake node: pid 5001 (pod A), 5002 (pod B), 5003 (a user's
/// delegated cgroup); the v2 hierarchy lists `dmem`; B's pod directory and
/// the delegated one carry `dmem.max` for GPU 0 (PCI 0000:01:00.0).
fn node(sc: &Scenario) -> (std::path::PathBuf, String) {
    let proc_root = sc.dir.path().join("proc");
    let a = containerd_cgroup(POD_A, &cid('a'));
    let b = containerd_cgroup(POD_B, &cid('b'));
    let delegated = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/job\n";
    write_proc(&proc_root, 5001, "python3", 0, &a, &[]);
    write_proc(&proc_root, 5002, "python3", 0, &b, &[]);
    write_proc(&proc_root, 5003, "python3", 1000, delegated, &[]);
    let v2 = cgroupfs_of(&proc_root).join("unified");
    std::fs::write(v2.join("cgroup.controllers"), "cpu memory dmem\n").unwrap();
    std::fs::write(
        v2.join(pod_dir(POD_B).trim_start_matches('/'))
            .join("dmem.max"),
        "drm/0000:01:00.0/vram0 8589934592\ndrm/0000:02:00.0/vram0 1\n",
    )
    .unwrap();
    let user = v2.join("user.slice/user-1000.slice/user@1000.service");
    for dir in [
        user.clone(),
        user.join("app.slice"),
        user.join("app.slice/job"),
    ] {
        chown(&dir, Some(1000), Some(1000)).unwrap();
    }
    std::fs::write(
        user.join("app.slice/job/dmem.max"),
        "drm/0000:01:00.0/vram0 1024\n",
    )
    .unwrap();
    let config = format!(
        "sample_interval: 200ms\npath:\n  procfs: {}\n  cgroupfs: {}\nlimits:\n  interval: 200ms\n",
        proc_root.display(),
        cgroupfs_of(&proc_root).display()
    );
    (v2, config)
}

fn scenario(v2: &Path) -> String {
    let key = |dir: &str| format!("\"{}\"", v2.join(dir.trim_start_matches('/')).display());
    format!(
        "devices:\n  - uuid: {UUID}\n    memory: {{total: {}, reserved: 0, used: {}}}\n    processes: [{{pid: 5001, used: {}}}, {{pid: 5002, used: {}}}, {{pid: 5003, used: {}}}]\n    memory_limits:\n      {}: {{soft: {}, hard: {}, used: 1}}\n      {}: {{hard: 1024}}\n",
        80 * GIB,
        7 * GIB,
        3 * GIB,
        2 * GIB,
        2 * GIB,
        key(&pod_dir(POD_A)),
        10 * GIB,
        20 * GIB,
        key("/user.slice/user-1000.slice/user@1000.service/app.slice/job"),
    )
}

/// `(pod_uid or "", source, kind, bytes)` of every limit series.
fn limits(m: &Metrics) -> Vec<(String, String, String, u64)> {
    let mut out: Vec<_> = m
        .find("gpu_workload_memory_limit_bytes", &[("uuid", UUID)])
        .into_iter()
        .map(|(l, v)| {
            let g = |k: &str| l.get(k).cloned().unwrap_or_default();
            (g("pod_uid"), g("source"), g("kind"), v as u64)
        })
        .collect();
    out.sort();
    out
}

fn start(sc: &Scenario, config: &str, library: Option<&Path>) -> Exporter {
    let cfg = sc.file("config.yaml", config.as_bytes());
    let args = ["--config.file", cfg.to_str().unwrap()];
    match library {
        None => Exporter::start(sc, &args),
        Some(lib) => Exporter::spawn(Exporter::command_with_library(
            Command::new(BIN),
            lib,
            sc,
            &args,
        )),
    }
}

#[test]
fn driver_and_dmem_limits_of_root_owned_cgroups_only() {
    let sc = Scenario::new("devices: []\n");
    let (v2, config) = node(&sc);
    sc.write(&scenario(&v2));
    let ex = start(&sc, &config, None);
    let m = wait_for(Duration::from_secs(10), "both pods' limits", || {
        let m = ex.metrics();
        (limits(&m).len() == 3).then_some(m)
    });
    assert_eq!(
        limits(&m),
        vec![
            (POD_A.into(), "driver".into(), "hard".into(), 20 * GIB),
            (POD_A.into(), "driver".into(), "soft".into(), 10 * GIB),
            (POD_B.into(), "dmem".into(), "hard".into(), 8 * GIB),
        ],
        "the delegated cgroup's process (pid 5003) must have none"
    );
    for (pod, used) in [(POD_A, 3 * GIB), (POD_B, 2 * GIB)] {
        assert_eq!(
            m.get_u64(
                "gpu_workload_memory_used_bytes",
                &[("gpu", "0"), ("uuid", UUID), ("pod_uid", pod)]
            ),
            Some(used),
            "{pod}"
        );
    }
    assert_eq!(m.find("gpu_workload_memory_used_bytes", &[]).len(), 2);
    assert!(
        m.find("gpu_workload_memory_limit_in_seconds", &[])
            .is_empty(),
        "nothing grows"
    );
    for (source, v) in [("driver", 1.0), ("dmem", 1.0)] {
        assert_eq!(
            m.get("gpumem_exporter_limit_sources", &[("source", source)]),
            Some(v),
            "{source}"
        );
    }
    assert_eq!(
        m.get("gpumem_exporter_limit_sources", &[("source", "torch")]),
        Some(1.0),
        "the torch bridge is on by default: a process's own limit can be read"
    );
    assert!(
        m.find(
            "gpumem_exporter_nvml_errors_total",
            &[("operation", "memory_limits")]
        )
        .is_empty(),
        "NOT_FOUND for a directory without limits is no error"
    );
}

/// A copy of the fake NVML whose `nvmlDeviceGetMemoryLimits_v1` cannot be
/// found: the symbol's name in the dynamic string table changed by one
/// letter (same length), as a driver older than R615 has none.
fn without_the_symbol(dir: &Path) -> std::path::PathBuf {
    let mut bytes = std::fs::read(fake_nvml()).unwrap();
    let name = b"nvmlDeviceGetMemoryLimits_v1";
    // Every copy: the dynamic and the debug symbol tables, a log line.
    let mut found = 0;
    while let Some(at) = bytes.windows(name.len()).position(|w| w == name) {
        bytes[at] = b'x';
        found += 1;
    }
    assert!(found > 0, "the symbol's name in the fake");
    let out = dir.join("libfake_nvml_580.so");
    std::fs::write(&out, bytes).unwrap();
    out
}

#[test]
fn a_driver_without_the_call_is_said_not_counted() {
    let sc = Scenario::new("devices: []\n");
    let (v2, config) = node(&sc);
    sc.write(&scenario(&v2));
    let lib = without_the_symbol(sc.dir.path());
    let ex = start(&sc, &config, Some(&lib));
    let m = wait_for(Duration::from_secs(10), "dmem's limit", || {
        let m = ex.metrics();
        (!limits(&m).is_empty()).then_some(m)
    });
    assert_eq!(
        limits(&m),
        vec![(POD_B.into(), "dmem".into(), "hard".into(), 8 * GIB)]
    );
    assert_eq!(
        m.get("gpumem_exporter_limit_sources", &[("source", "driver")]),
        Some(0.0)
    );
    assert_eq!(
        m.get("gpumem_exporter_limit_sources", &[("source", "dmem")]),
        Some(1.0)
    );
    assert!(
        m.find(
            "gpumem_exporter_nvml_errors_total",
            &[("operation", "memory_limits")]
        )
        .is_empty()
    );
    assert!(
        ex.stderr().contains("driver=absent"),
        "the log says the driver has no limits"
    );
}
