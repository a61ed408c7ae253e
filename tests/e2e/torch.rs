//! End-to-end torch bridge: real Python processes run `gpumem_bridge`
//! (python/) with a stub `torch` (tests/torch_stub), the fake NVML lists
//! their pids, and the real exporter reads their documents from /proc.
//! Also runs the Python package's own unit tests.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use crate::harness::python::{Py, StubState, python3};
use crate::harness::tools::{assert_promtool_check_metrics_clean, output_text};
use crate::harness::*;
use serde_json::json;

/// CUDA's (bare) UUIDs of the stub's devices; NVML spells them `GPU-…`.
const U0: &str = "8f2c1d3e-5a6b-4c7d-8e9f-00000000aaaa";
const U1: &str = "8f2c1d3e-5a6b-4c7d-8e9f-00000000bbbb";
const WAIT: Duration = Duration::from_secs(20);

const FAMILIES: [&str; 8] = [
    "gpu_process_torch_allocated_bytes",
    "gpu_process_torch_reserved_bytes",
    "gpu_process_torch_allocated_peak_bytes",
    "gpu_process_torch_reserved_peak_bytes",
    "gpu_process_torch_active_bytes",
    "gpu_process_torch_inactive_split_bytes",
    "gpu_process_torch_alloc_retries_total",
    "gpu_process_torch_ooms_total",
];

fn gpu(bare: &str) -> String {
    format!("GPU-{bare}")
}

/// Allocator figures derived from one number, all distinct and above 2^32
/// (so exactness is checked), in the stub's and the exporter's spelling.
#[derive(Clone, Copy)]
struct Figures(u64);

impl Figures {
    fn values(self) -> [u64; 8] {
        let b = self.0;
        // allocated, reserved, allocated_peak, reserved_peak, active,
        // inactive_split, alloc_retries, ooms (in FAMILIES order)
        [
            b,
            b + (1 << 30),
            b + (2 << 30),
            b + (3 << 30),
            b + 4096,
            2 << 20,
            b % 97,
            b % 5,
        ]
    }

    /// `torch.cuda.memory_stats()` keys, as the stub returns them.
    fn stats(self) -> serde_json::Value {
        let v = self.values();
        json!({
            "allocated_bytes.all.current": v[0],
            "reserved_bytes.all.current": v[1],
            "allocated_bytes.all.peak": v[2],
            "reserved_bytes.all.peak": v[3],
            "active_bytes.all.current": v[4],
            "inactive_split_bytes.all.current": v[5],
            "num_alloc_retries": v[6],
            "num_ooms": v[7],
        })
    }

    /// The bridge's document entry for one device.
    fn entry(self, uuid: &str) -> serde_json::Value {
        let v = self.values();
        json!({
            "uuid": uuid, "allocated": v[0], "reserved": v[1], "allocated_peak": v[2],
            "reserved_peak": v[3], "active": v[4], "inactive_split": v[5],
            "alloc_retries": v[6], "ooms": v[7],
        })
    }
}

/// A fake-NVML scenario: per GPU (bare UUID), the pids on it and bytes.
fn scenario_yaml(gpus: &[(&str, &[(u32, u64)])]) -> String {
    let mut y = String::from("devices:\n");
    for (uuid, procs) in gpus {
        let used: u64 = procs.iter().map(|p| p.1).sum::<u64>() + (600 << 20);
        y.push_str(&format!(
            "  - uuid: {}\n    memory: {{total: 150754820096, reserved: 644939776, used: {used}}}\n",
            gpu(uuid)
        ));
        if procs.is_empty() {
            y.push_str("    processes: []\n");
        } else {
            y.push_str("    processes:\n");
            for (pid, b) in *procs {
                y.push_str(&format!("      - {{pid: {pid}, used: {b}}}\n"));
            }
        }
    }
    y
}

/// Samples every 100 ms; `extra`: more config lines.
fn config(extra: &str) -> String {
    format!("sample_interval: 100ms\nmemory_sample_interval: 100ms\n{extra}")
}

fn start(scenario: &Scenario, extra: &str) -> Exporter {
    Exporter::with_config(scenario, &config(extra), &[])
}

/// Labels of a series as owned pairs.
fn pairs(l: &BTreeMap<String, String>) -> Vec<(&str, &str)> {
    l.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// The torch figures exported for (gpu index, pid), in FAMILIES order,
/// each with exactly the labels of gpu_process_memory_used_bytes.
fn exported(m: &Metrics, gpu_index: &str, pid: &str) -> Option<[u64; 8]> {
    let used = m.find(
        "gpu_process_memory_used_bytes",
        &[("gpu", gpu_index), ("pid", pid)],
    );
    let [(labels, _)] = used.as_slice() else {
        return None;
    };
    let labels = pairs(labels);
    let mut out = [0u64; 8];
    for (i, name) in FAMILIES.iter().enumerate() {
        out[i] = m.get_u64(name, &labels)?;
    }
    Some(out)
}

fn torch_series_of(m: &Metrics, pid: &str) -> usize {
    FAMILIES
        .iter()
        .map(|f| m.find(f, &[("pid", pid)]).len())
        .sum()
}

fn dropped(m: &Metrics, reason: &str) -> u64 {
    m.get_u64(
        "gpumem_exporter_torch_reports_dropped_total",
        &[("reason", reason)],
    )
    .unwrap_or(0)
}

#[test]
fn series_match_the_stub_follow_it_and_vanish_with_the_process() {
    let (a0, a1) = (Figures(5_000_000_007), Figures(9_000_000_011));
    // CUDA order is the reverse of NVML's: only the UUID joins them.
    let state = StubState::new(&[(U1, a1.stats()), (U0, a0.stats())]);
    let py = Py::bridge(&state, "");
    let pid = py.pid_str();
    let scenario = Scenario::new(&scenario_yaml(&[
        (U0, &[(py.pid, 12 << 30)]),
        (U1, &[(py.pid, 10 << 30)]),
    ]));
    let ex = start(&scenario, "");

    let m = wait_for(WAIT, "torch series equal to the stub's figures", || {
        let m = ex.metrics();
        (exported(&m, "0", &pid) == Some(a0.values())
            && exported(&m, "1", &pid) == Some(a1.values()))
        .then_some(m)
    });
    // Same labels as gpu_process_memory_used_bytes, one series per GPU.
    for f in FAMILIES {
        assert_eq!(m.find(f, &[("pid", &pid)]).len(), 2, "{f}:\n{}", m.text);
    }
    let used = m.find("gpu_process_memory_used_bytes", &[("pid", &pid)]);
    assert_eq!(used[0].0["uuid"], gpu(U0));
    assert!(
        m.get("gpumem_exporter_torch_reports_total", &[])
            .unwrap_or(0.0)
            >= 1.0
    );
    for reason in ["malformed", "oversized", "permission"] {
        assert_eq!(dropped(&m, reason), 0, "{reason}:\n{}", m.text);
    }
    // The exposition is valid, counters included.
    assert_promtool_check_metrics_clean(&m.text);

    // The process's figures change: the series follow.
    let (b0, b1) = (Figures(6_000_000_013), Figures(7_000_000_017));
    state.write(&[(U1, b1.stats()), (U0, b0.stats())]);
    wait_for(WAIT, "series following the stub", || {
        let m = ex.metrics();
        (exported(&m, "0", &pid) == Some(b0.values())
            && exported(&m, "1", &pid) == Some(b1.values()))
        .then_some(())
    });

    // The process exits while NVML still lists it: NVML's bytes stay, the
    // torch figures vanish at once.
    drop(py);
    let m = wait_for(WAIT, "torch series gone", || {
        let m = ex.metrics();
        (torch_series_of(&m, &pid) == 0).then_some(m)
    });
    assert_eq!(
        m.find("gpu_process_memory_used_bytes", &[("pid", &pid)])
            .len(),
        2,
        "{}",
        m.text
    );
}

#[test]
fn a_process_reports_only_about_itself() {
    let y = Py::plain();
    // X claims to be Y, for both GPUs, in every way the document allows.
    let (x0, x1) = (Figures(11_000_000_003), Figures(12_000_000_005));
    let mut e0 = x0.entry(&gpu(U0));
    e0["pid"] = json!(y.pid);
    let doc = json!({"v": 1, "pid": y.pid, "seq": 1, "devices": [e0, x1.entry(&gpu(U1))]});
    let (x, _dir) = Py::raw(doc.to_string().as_bytes(), true);
    // X is on GPU 0 only; Y is on both.
    let scenario = Scenario::new(&scenario_yaml(&[
        (U0, &[(x.pid, 3 << 30), (y.pid, 4 << 30)]),
        (U1, &[(y.pid, 5 << 30)]),
    ]));
    let ex = start(&scenario, "");
    wait_for(WAIT, "X's own series", || {
        (exported(&ex.metrics(), "0", &x.pid_str()) == Some(x0.values())).then_some(())
    });
    // A few more samples: Y never gets torch series, nor does GPU 1.
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(120));
        let m = ex.metrics();
        assert_eq!(torch_series_of(&m, &y.pid_str()), 0, "{}", m.text);
        for f in FAMILIES {
            assert!(m.find(f, &[("gpu", "1")]).is_empty(), "{f}:\n{}", m.text);
            assert_eq!(m.find(f, &[]).len(), 1, "{f}:\n{}", m.text);
        }
        assert_eq!(
            m.find("gpu_process_memory_used_bytes", &[("pid", &y.pid_str())])
                .len(),
            2
        );
    }
}

#[test]
fn malformed_and_oversized_documents_are_dropped_and_counted() {
    let good = Figures(8_000_000_009);
    let state = StubState::new(&[(U0, good.stats())]);
    let ok = Py::bridge(&state, "");
    let (garbage, _d1) = Py::raw(b"this is not json", true);
    let wrong_types = json!({"v": 1, "devices": [{"uuid": gpu(U0), "allocated": "lots"}]});
    let (typed, _d2) = Py::raw(wrong_types.to_string().as_bytes(), true);
    let mut big = json!({"v": 1, "devices": [good.entry(&gpu(U0))]});
    big["padding"] = json!("x".repeat(70 * 1024));
    let (oversized, _d3) = Py::raw(big.to_string().as_bytes(), true);
    // A valid document that was never sealed: still "being written",
    // skipped without a count.
    let valid = json!({"v": 1, "devices": [good.entry(&gpu(U0))]});
    let (unsealed, _d4) = Py::raw(valid.to_string().as_bytes(), false);
    let bad = [&garbage, &typed, &oversized, &unsealed];
    let procs: Vec<(u32, u64)> = std::iter::once(&ok)
        .chain(bad)
        .map(|p| (p.pid, 1 << 30))
        .collect();
    let scenario = Scenario::new(&scenario_yaml(&[(U0, &procs)]));
    let ex = start(&scenario, "");
    let m = wait_for(WAIT, "drops counted and the good process reported", || {
        let m = ex.metrics();
        (dropped(&m, "malformed") >= 2
            && dropped(&m, "oversized") >= 1
            && exported(&m, "0", &ok.pid_str()) == Some(good.values()))
        .then_some(m)
    });
    for p in bad {
        assert_eq!(torch_series_of(&m, &p.pid_str()), 0, "{}", m.text);
        assert_eq!(
            m.find("gpu_process_memory_used_bytes", &[("pid", &p.pid_str())])
                .len(),
            1
        );
    }
    assert_eq!(dropped(&m, "permission"), 0);
    // Dropped on every read (one per sample), so the rate shows a broken
    // client; logged once per reason.
    let before = dropped(&m, "malformed");
    wait_for(WAIT, "malformed keeps counting", || {
        (dropped(&ex.metrics(), "malformed") > before).then_some(())
    });
    let log = ex.stderr();
    for reason in ["reason=malformed", "reason=oversized"] {
        assert_eq!(
            log.lines()
                .filter(|l| l.contains("dropped a torch bridge document") && l.contains(reason))
                .count(),
            1,
            "{reason} logged once:\n{log}"
        );
    }
}

/// Start the exporter without any capability (root keeps its uid but loses
/// CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH), as a DaemonSet without them.
fn start_without_caps(scenario: &Scenario) -> Exporter {
    let cfg = scenario.file("config.yaml", config("").as_bytes());
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let cmd = if root {
        let mut c = Command::new("setpriv");
        c.args(["--inh-caps=-all", "--bounding-set=-all", "--", BIN]);
        c
    } else {
        Command::new(BIN)
    };
    Exporter::spawn(Exporter::command(
        cmd,
        scenario,
        &["--config.file", cfg.to_str().unwrap()],
    ))
}

#[test]
fn permission_denied_is_counted_once_per_process_and_logged_once() {
    let state = StubState::new(&[(U0, Figures(4_000_000_001).stats())]);
    // Non-dumpable: its /proc/<pid>/fd links need CAP_SYS_PTRACE to follow,
    // even for the same uid.
    let (a, b) = (
        Py::bridge(
            &state,
            "import ctypes\nassert ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) == 0",
        ),
        Py::bridge(
            &state,
            "import ctypes\nassert ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) == 0",
        ),
    );
    let scenario = Scenario::new(&scenario_yaml(&[(
        U0,
        &[(a.pid, 1 << 30), (b.pid, 1 << 30)],
    )]));
    let ex = start_without_caps(&scenario);
    let m = wait_for(WAIT, "permission counted", || {
        let m = ex.metrics();
        (dropped(&m, "permission") == 2).then_some(m)
    });
    assert_eq!(torch_series_of(&m, &a.pid_str()), 0, "{}", m.text);
    // Counted once per process, not once per sample.
    std::thread::sleep(Duration::from_millis(500));
    let m = ex.metrics();
    assert_eq!(dropped(&m, "permission"), 2, "{}", m.text);
    assert_eq!(torch_series_of(&m, &b.pid_str()), 0, "{}", m.text);
    // NVML's figures and the process name are still there.
    let used = m.find("gpu_process_memory_used_bytes", &[("pid", &a.pid_str())]);
    assert_eq!(used.len(), 1);
    assert!(!used[0].0["process"].is_empty(), "{}", m.text);
    ex.assert_logged_once("CAP_SYS_PTRACE");
}

#[test]
fn mig_instance_is_joined_by_its_own_uuid() {
    let f = Figures(3_000_000_019);
    let state = StubState::new(&[(U1, f.stats())]);
    let py = Py::bridge(&state, "");
    // The parent GPU has another UUID; CUDA's is the MIG instance's.
    let scenario = Scenario::new(&format!(
        "devices:\n  - uuid: {}\n    memory: {{total: 85899345920, reserved: 536870912, used: 20000000000}}\n    mig_devices:\n      - uuid: MIG-{U1}\n        gpu_instance_id: 3\n        compute_instance_id: 0\n        memory: {{total: 20000000000, reserved: 0, used: 7000000000}}\n        processes: [{{pid: {}, used: 6000000000}}]\n",
        gpu(U0),
        py.pid
    ));
    let ex = start(&scenario, "");
    let m = wait_for(WAIT, "torch series on the MIG instance", || {
        let m = ex.metrics();
        (exported(&m, "0", &py.pid_str()) == Some(f.values())).then_some(m)
    });
    let s = m.find(
        "gpu_process_torch_reserved_bytes",
        &[("pid", &py.pid_str())],
    );
    assert_eq!(s[0].0["gpu_instance_id"], "3", "{}", m.text);
    assert_eq!(s[0].0["uuid"], gpu(U0));
}

#[test]
fn torch_bridge_false_reads_nothing() {
    let f = Figures(2_000_000_003);
    let state = StubState::new(&[(U0, f.stats())]);
    let py = Py::bridge(&state, "");
    let yaml = scenario_yaml(&[(U0, &[(py.pid, 1 << 30)])]);
    let scenario = Scenario::new(&yaml);
    let ex = start(&scenario, "processes:\n  torch_bridge: false\n");
    // Control: with the bridge on (the default), another exporter reads
    // this process's figures, so there is something the first one skips.
    let control_scenario = Scenario::new(&yaml);
    let control = start(&control_scenario, "");
    wait_for(WAIT, "the control exporter reading the bridge", || {
        (exported(&control.metrics(), "0", &py.pid_str()) == Some(f.values())).then_some(())
    });
    std::thread::sleep(Duration::from_millis(400));
    let m = ex.metrics();
    assert_eq!(
        m.find("gpu_process_memory_used_bytes", &[("pid", &py.pid_str())])
            .len(),
        1
    );
    assert!(!m.text.contains("gpu_process_torch_"), "{}", m.text);
    assert!(!m.text.contains("gpumem_exporter_torch_"), "{}", m.text);
}

/// The Python package's unit tests (python/tests), with the stub torch.
#[test]
fn python_unit_tests() {
    let out = Command::new(python3())
        .args(["-m", "unittest", "discover", "-s", "python/tests", "-v"])
        .current_dir(repo())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("run python3 -m unittest");
    let text = output_text(&out);
    assert!(out.status.success(), "python unit tests failed:\n{text}");
    assert!(text.contains("OK"), "{text}");
    // unittest says OK, exit 0, when it finds no test at all (Python < 3.12).
    let ran: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("Ran ")?.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no 'Ran N tests' line:\n{text}"));
    assert!(ran > 0, "no Python unit test ran:\n{text}");
}
