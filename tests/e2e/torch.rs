//! End-to-end torch bridge: real Python processes run `gpumem_bridge`
//! (python/) with a stub `torch` (tests/torch_stub), the fake NVML lists
//! their pids, and the real exporter reads their documents from /proc.
//! Also runs the Python package's own unit tests.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use crate::harness::python::{Py, StubState, python3};
use crate::harness::tools::assert_promtool_check_metrics_clean;
use crate::harness::*;
use serde_json::json;

mod steps;
mod tenants;

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

const POOL_FAMILIES: [&str; 4] = [
    "gpu_process_torch_pool_allocated_bytes",
    "gpu_process_torch_pool_reserved_bytes",
    "gpu_process_torch_pool_inactive_split_bytes",
    "gpu_process_torch_pool_segments",
];
const LIMIT: &str = "gpu_process_torch_memory_limit_bytes";
const INFO: &str = "gpu_process_torch_allocator_info";
const SNAPSHOTS: &str = "gpu_process_torch_oom_snapshots_total";

/// Per-pool figures derived from one number, all distinct (bytes above
/// 2^32): for the large then the small pool, allocated, reserved, inactive
/// split bytes and segments (in POOL_FAMILIES order).
#[derive(Clone, Copy)]
struct Pools(u64);

impl Pools {
    fn values(self) -> [[u64; 4]; 2] {
        let b = self.0;
        [
            [b, b + (3 << 30), (6 << 20) + 1, b % 89 + 1],
            [b / 3, b / 3 + (5 << 20), (1 << 20) + 3, b % 83 + 2],
        ]
    }

    /// The stub's `memory_stats()`: `fig`'s keys and the pools'.
    fn stats(self, fig: Figures) -> serde_json::Value {
        let mut s = fig.stats();
        for (pool, v) in ["large", "small"].iter().zip(self.values()) {
            s[format!("allocated_bytes.{pool}_pool.current")] = json!(v[0]);
            s[format!("reserved_bytes.{pool}_pool.current")] = json!(v[1]);
            s[format!("inactive_split_bytes.{pool}_pool.current")] = json!(v[2]);
            s[format!("segment.{pool}_pool.current")] = json!(v[3]);
        }
        s
    }
}

/// The labels of gpu_process_memory_used_bytes for (gpu index, pid).
fn used_labels(m: &Metrics, gpu_index: &str, pid: &str) -> Option<BTreeMap<String, String>> {
    let used = m.find(
        "gpu_process_memory_used_bytes",
        &[("gpu", gpu_index), ("pid", pid)],
    );
    let [(labels, _)] = used.as_slice() else {
        return None;
    };
    Some(labels.clone())
}

/// `name` for (gpu index, pid) with exactly the used-bytes labels plus `more`.
fn value_with(
    m: &Metrics,
    name: &str,
    gpu_index: &str,
    pid: &str,
    more: &[(&str, &str)],
) -> Option<u64> {
    let mut l = used_labels(m, gpu_index, pid)?;
    for (k, v) in more {
        l.insert(k.to_string(), v.to_string());
    }
    m.get_u64(name, &pairs(&l))
}

/// The pool series of (gpu index, pid), in Pools::values order.
fn exported_pools(m: &Metrics, gpu_index: &str, pid: &str) -> Option<[[u64; 4]; 2]> {
    let mut out = [[0u64; 4]; 2];
    for (p, pool) in ["large", "small"].iter().enumerate() {
        for (i, name) in POOL_FAMILIES.iter().enumerate() {
            out[p][i] = value_with(m, name, gpu_index, pid, &[("pool", pool)])?;
        }
    }
    Some(out)
}

/// The allocator info series of (gpu index, pid), if there is exactly one
/// and it has exactly the used-bytes labels plus the three settings: those.
fn settings_of(m: &Metrics, gpu_index: &str, pid: &str) -> Option<[String; 3]> {
    let used = used_labels(m, gpu_index, pid)?;
    let found = m.find(INFO, &[("gpu", gpu_index), ("pid", pid)]);
    let [(labels, value)] = found.as_slice() else {
        return None;
    };
    let get = |k: &str| labels.get(k).cloned();
    let settings = [
        get("backend")?,
        get("expandable_segments")?,
        get("max_split_size_bytes")?,
    ];
    let mut rest = labels.clone();
    for k in ["backend", "expandable_segments", "max_split_size_bytes"] {
        rest.remove(k);
    }
    (rest == used && *value == 1.0).then_some(settings)
}

fn strings<const N: usize>(v: [&str; N]) -> [String; N] {
    v.map(str::to_string)
}

/// Lines of `path` (a child's stderr) that contain `needle`.
fn lines_with(path: &std::path::Path, needle: &str) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_string)
        .collect()
}

#[test]
fn pools_limit_and_allocator_settings_match_the_stub() {
    let (a0, a1) = (Figures(5_000_000_007), Figures(9_000_000_011));
    let (p0, p1) = (Pools(6_000_000_029), Pools(8_000_000_041));
    // CUDA order is the reverse of NVML's: CUDA device 1 is GPU 0.
    let state = StubState::new(&[(U1, p1.stats(a1)), (U0, p0.stats(a0))]);
    let tmp = tempfile::tempdir().unwrap();
    let err = tmp.path().join("stderr");
    // A fraction on CUDA device 1 only; the stub's GPUs have 150754820096
    // bytes, and torch keeps size_t(0.3 * that).
    let py = Py::bridge_to(
        &state,
        "torch.cuda.set_per_process_memory_fraction(0.3, 1)",
        &[(
            "PYTORCH_CUDA_ALLOC_CONF",
            "expandable_segments:True, max_split_size_mb:256,roundup_power2_divisions:[256:1,>:4],",
        )],
        &err,
    );
    let pid = py.pid_str();
    let scenario = Scenario::new(&scenario_yaml(&[
        (U0, &[(py.pid, 12 << 30)]),
        (U1, &[(py.pid, 10 << 30)]),
    ]));
    let ex = start(&scenario, "");
    let m = wait_for(
        WAIT,
        "pool series and the limit equal to the stub's",
        || {
            let m = ex.metrics();
            (exported_pools(&m, "0", &pid) == Some(p0.values())
                && exported_pools(&m, "1", &pid) == Some(p1.values())
                && value_with(&m, LIMIT, "0", &pid, &[]) == Some(45_226_446_028))
            .then_some(m)
        },
    );
    // The totals are as before, beside them.
    assert_eq!(exported(&m, "0", &pid), Some(a0.values()), "{}", m.text);
    assert_eq!(exported(&m, "1", &pid), Some(a1.values()), "{}", m.text);
    // Two series per GPU (large, small) in each pool family, no more.
    for f in POOL_FAMILIES {
        assert_eq!(m.find(f, &[("pid", &pid)]).len(), 4, "{f}:\n{}", m.text);
    }
    // The limit only where a fraction is set.
    assert_eq!(m.find(LIMIT, &[]).len(), 1, "{}", m.text);
    // The settings, parsed, on each GPU; never the variable itself.
    let want = strings(["native", "true", "268435456"]);
    assert_eq!(settings_of(&m, "0", &pid), Some(want.clone()), "{}", m.text);
    assert_eq!(settings_of(&m, "1", &pid), Some(want), "{}", m.text);
    assert!(!m.text.contains("roundup"), "{}", m.text);
    // OOM snapshots were not asked for: no counter.
    assert!(m.find(SNAPSHOTS, &[]).is_empty(), "{}", m.text);
    assert_promtool_check_metrics_clean(&m.text);

    // The pools change: the series follow.
    let (q0, q1) = (Pools(7_000_000_043), Pools(4_000_000_051));
    state.write(&[(U1, q1.stats(a1)), (U0, q0.stats(a0))]);
    wait_for(WAIT, "pool series following the stub", || {
        let m = ex.metrics();
        (exported_pools(&m, "0", &pid) == Some(q0.values())
            && exported_pools(&m, "1", &pid) == Some(q1.values()))
        .then_some(())
    });
    // A stub without pool figures (a torch that lacks them): no pool series,
    // the rest stays.
    state.write(&[(U1, a1.stats()), (U0, a0.stats())]);
    let m = wait_for(WAIT, "pool series gone with the figures", || {
        let m = ex.metrics();
        POOL_FAMILIES
            .iter()
            .all(|f| m.find(f, &[]).is_empty())
            .then_some(m)
    });
    assert_eq!(exported(&m, "0", &pid), Some(a0.values()), "{}", m.text);
    assert!(settings_of(&m, "1", &pid).is_some(), "{}", m.text);
    let log = std::fs::read_to_string(&err).unwrap_or_default();
    assert!(
        !log.contains("gpumem_bridge"),
        "no warning expected:\n{log}"
    );
}

#[test]
fn malformed_allocator_settings_drop_only_the_info_series_with_one_warning() {
    let (fb, pb) = (Figures(3_000_000_023), Pools(2_000_000_057));
    let (fg, pg) = (Figures(4_000_000_027), Pools(5_000_000_061));
    let (sb, sg) = (
        StubState::new(&[(U0, pb.stats(fb))]),
        StubState::new(&[(U0, pg.stats(fg))]),
    );
    let tmp = tempfile::tempdir().unwrap();
    let (err_bad, err_good) = (tmp.path().join("bad"), tmp.path().join("good"));
    // torch accepts only True/False here, so the allocator would refuse it.
    let bad = Py::bridge_to(
        &sb,
        "",
        &[("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:true")],
        &err_bad,
    );
    let good = Py::bridge_to(
        &sg,
        "",
        &[("PYTORCH_CUDA_ALLOC_CONF", "backend:async")],
        &err_good,
    );
    let (pb_, pg_) = (bad.pid_str(), good.pid_str());
    let scenario = Scenario::new(&scenario_yaml(&[(
        U0,
        &[(bad.pid, 2 << 30), (good.pid, 3 << 30)],
    )]));
    let ex = start(&scenario, "");
    wait_for(
        WAIT,
        "both processes' figures, the good one's settings",
        || {
            let m = ex.metrics();
            (exported(&m, "0", &pb_) == Some(fb.values())
                && exported_pools(&m, "0", &pb_) == Some(pb.values())
                && exported(&m, "0", &pg_) == Some(fg.values())
                && settings_of(&m, "0", &pg_)
                    == Some(strings(["cudaMallocAsync", "false", "unlimited"])))
            .then_some(())
        },
    );
    // Several more documents (every 0.1 s) and samples.
    std::thread::sleep(Duration::from_millis(800));
    let m = ex.metrics();
    assert!(m.find(INFO, &[("pid", &pb_)]).is_empty(), "{}", m.text);
    assert_eq!(exported(&m, "0", &pb_), Some(fb.values()), "{}", m.text);
    assert_eq!(
        exported_pools(&m, "0", &pb_),
        Some(pb.values()),
        "{}",
        m.text
    );
    // The document is fine; only the settings were left out of it.
    assert_eq!(dropped(&m, "malformed"), 0, "{}", m.text);
    let warned = lines_with(&err_bad, "PYTORCH_CUDA_ALLOC_CONF");
    assert_eq!(warned.len(), 1, "one warning: {warned:?}");
    assert!(warned[0].contains("malformed"), "{warned:?}");
    let all = std::fs::read_to_string(&err_bad).unwrap_or_default();
    assert_eq!(all.lines().count(), 1, "nothing else on stderr:\n{all}");
    assert_eq!(std::fs::read_to_string(&err_good).unwrap_or_default(), "");
}

/// Python that makes the stub's allocator run out of memory `n` times on
/// CUDA device `device` (each caught, as a training loop might).
fn ooms(n: usize, device: u32) -> String {
    format!(
        "for _ in range({n}):\n    try:\n        torch.cuda.stub_out_of_memory({device})\n    except torch.cuda.OutOfMemoryError:\n        pass\n    else:\n        raise SystemExit('no OOM raised')\n"
    )
}

/// The snapshot files in `dir` (by the bridge's name pattern), and the
/// other entries, sorted.
fn snapshot_files(dir: &std::path::Path) -> (Vec<String>, Vec<String>) {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
        .into_iter()
        .partition(|n| snapshot_name_pid(n).is_some())
}

/// The pid in a name `gpumem-oom-<pid>-<YYYYMMDDTHHMMSS.ffffff>Z.pickle`.
fn snapshot_name_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("gpumem-oom-")?.strip_suffix("Z.pickle")?;
    let (pid, time) = rest.split_once('-')?;
    let b = time.as_bytes();
    let shape = b.len() == 22
        && b[8] == b'T'
        && b[15] == b'.'
        && b.iter()
            .enumerate()
            .all(|(i, c)| i == 8 || i == 15 || c.is_ascii_digit());
    shape.then(|| pid.parse().ok()).flatten()
}

#[test]
fn a_simulated_oom_writes_one_snapshot_that_the_exporter_counts() {
    use std::os::unix::fs::PermissionsExt;

    // No OOM before the bridge starts (num_ooms 0: figures divisible by 5).
    let (f0, f1) = (Figures(5_000_000_005), Figures(6_000_000_010));
    let state = StubState::new(&[(U1, f1.stats()), (U0, f0.stats())]);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("snapshots"); // the bridge makes it
    let err = tmp.path().join("stderr");
    // One OOM on CUDA device 1, which is GPU 0, with allocation history on.
    let py = Py::bridge_to(
        &state,
        &ooms(1, 1),
        &[
            ("GPUMEM_BRIDGE_OOM_SNAPSHOT_DIR", dir.to_str().unwrap()),
            ("GPUMEM_BRIDGE_OOM_HISTORY", "python"),
        ],
        &err,
    );
    let pid = py.pid_str();
    let scenario = Scenario::new(&scenario_yaml(&[
        (U0, &[(py.pid, 12 << 30)]),
        (U1, &[(py.pid, 10 << 30)]),
    ]));
    let ex = start(&scenario, "");
    let m = wait_for(WAIT, "the snapshot counted", || {
        let m = ex.metrics();
        (value_with(&m, SNAPSHOTS, "0", &pid, &[]) == Some(1)).then_some(m)
    });
    // Counted on the GPU that ran out, 0 on the other; torch's own count too.
    assert_eq!(
        value_with(&m, SNAPSHOTS, "1", &pid, &[]),
        Some(0),
        "{}",
        m.text
    );
    assert_eq!(
        value_with(&m, "gpu_process_torch_ooms_total", "0", &pid, &[]),
        Some(f0.values()[7] + 1),
        "{}",
        m.text
    );
    assert_promtool_check_metrics_clean(&m.text);

    // One file, named with the pid and the time, nothing else left behind.
    let (files, other) = snapshot_files(&dir);
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(other.is_empty(), "{other:?}");
    assert_eq!(snapshot_name_pid(&files[0]), Some(py.pid));
    let path = dir.join(&files[0]);
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    // It is the pickle memory_viz reads: segments and device_traces, the
    // OOM in device 1's trace (history was on); the time in its name is now.
    let check = Command::new(python3())
        .args([
            "-c",
            "import calendar, pickle, sys, time\n\
             d = pickle.load(open(sys.argv[1], 'rb'))\n\
             assert isinstance(d['segments'], list) and d['segments'], d\n\
             assert [e['action'] for e in d['device_traces'][1]] == ['oom'], d['device_traces']\n\
             stamp = sys.argv[1].rsplit('-', 1)[1][:15]\n\
             t = calendar.timegm(time.strptime(stamp, '%Y%m%dT%H%M%S'))\n\
             assert abs(time.time() - t) < 300, (stamp, time.time())\n\
             print('ok')",
            path.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(output_text(&check).trim(), "ok", "{}", output_text(&check));
    // The path on stderr, once.
    let said = lines_with(&err, path.to_str().unwrap());
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(
        said[0].contains("cuda:1") && said[0].contains("memory_viz"),
        "{said:?}"
    );

    // Later samples: still 1 (a count, not an event).
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(
        value_with(&ex.metrics(), SNAPSHOTS, "0", &pid, &[]),
        Some(1)
    );
}

#[test]
fn oom_snapshots_stay_within_their_bounds() {
    let f = Figures(7_000_000_020); // num_ooms 0
    let tmp = tempfile::tempdir().unwrap();
    let (by_count, by_bytes) = (tmp.path().join("count"), tmp.path().join("bytes"));
    std::fs::create_dir(&by_count).unwrap();
    // Files that are not snapshots are neither counted nor deleted.
    std::fs::write(by_count.join("notes.txt"), "keep me").unwrap();
    std::fs::write(by_count.join("gpumem-oom-1-old.pickle"), "keep me too").unwrap();
    let small = StubState::new_with(&[(U0, f.stats())], json!({"snapshot_pad": 1000}));
    let big = StubState::new_with(&[(U0, f.stats())], json!({"snapshot_pad": 20000}));
    let env = |dir: &std::path::Path, k: &'static str, v: &'static str| {
        vec![
            (
                "GPUMEM_BRIDGE_OOM_SNAPSHOT_DIR",
                dir.to_str().unwrap().to_string(),
            ),
            (k, v.to_string()),
        ]
    };
    let spawn = |state: &StubState, env: Vec<(&str, String)>, err: &std::path::Path| {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        Py::bridge_to(state, &ooms(25, 0), &env, err)
    };
    let errs: Vec<_> = (0..3).map(|i| tmp.path().join(format!("err{i}"))).collect();
    // At most 3 files, shared by two processes (one after the other).
    let a = spawn(
        &small,
        env(&by_count, "GPUMEM_BRIDGE_OOM_SNAPSHOT_MAX_FILES", "3"),
        &errs[0],
    );
    let b = spawn(
        &small,
        env(&by_count, "GPUMEM_BRIDGE_OOM_SNAPSHOT_MAX_FILES", "3"),
        &errs[1],
    );
    // At most 50,000 bytes: two snapshots of ~20 KB fit, three do not.
    let c = spawn(
        &big,
        env(&by_bytes, "GPUMEM_BRIDGE_OOM_SNAPSHOT_MAX_BYTES", "50000"),
        &errs[2],
    );
    let procs = [&a, &b, &c];
    let scenario = Scenario::new(&scenario_yaml(&[(U0, &procs.map(|p| (p.pid, 1 << 30)))]));
    let ex = start(&scenario, "");
    let m = wait_for(WAIT, "25 snapshots counted for each process", || {
        let m = ex.metrics();
        procs
            .iter()
            .all(|p| value_with(&m, SNAPSHOTS, "0", &p.pid_str(), &[]) == Some(25))
            .then_some(m)
    });
    assert_promtool_check_metrics_clean(&m.text);

    // The newest three, all the second process's; the other files kept.
    let (files, other) = snapshot_files(&by_count);
    assert_eq!(other, ["gpumem-oom-1-old.pickle", "notes.txt"]);
    let printed: Vec<String> = lines_with(&errs[1], "allocator snapshot written to")
        .iter()
        .filter_map(|l| {
            l.split(" written to ")
                .nth(1)?
                .split(' ')
                .next()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(printed.len(), 25, "{printed:?}");
    let newest: Vec<String> = printed[22..]
        .iter()
        .map(|p| p.rsplit('/').next().unwrap().to_string())
        .collect();
    assert_eq!(files, newest);
    assert_eq!(
        lines_with(&errs[0], "allocator snapshot written to").len(),
        25
    );

    let (files, other) = snapshot_files(&by_bytes);
    assert!(other.is_empty(), "{other:?}");
    let bytes: u64 = files
        .iter()
        .map(|n| std::fs::metadata(by_bytes.join(n)).unwrap().len())
        .sum();
    assert_eq!(files.len(), 2, "{files:?}");
    assert!(bytes <= 50_000 && bytes > 40_000, "{bytes}");
    for e in &errs {
        let log = std::fs::read_to_string(e).unwrap_or_default();
        assert!(
            log.lines()
                .all(|l| l.contains("allocator snapshot written to")),
            "nothing but the paths on stderr:\n{log}"
        );
    }
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
