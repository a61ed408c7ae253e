//! The series budget and the per-process series modes, on the
//! real binary over the fake NVML and a fake /proc:
//!
//! - 8 GPUs × 1,024 processes with `series_budget: 2000`: the body holds
//!   at most 2,000 series besides the exporter's own, each GPU keeps its
//!   largest processes and rolls the rest into `pid="other"` (so a GPU's
//!   per-process bytes still sum to what NVML says), the drops are counted
//!   per family, no per-GPU family loses a series, and the page's JSON
//!   still lists the pids the body left out.
//! - `processes.series`, switched by SIGHUP on one running exporter: in
//!   `workload` mode no series carries `pid` and each workload's figures
//!   equal its pids' figures summed in `pid` mode (joined through
//!   `gpu_process_info`); in `off` mode there is no per-process family;
//!   the JSON lists the same pids in every mode.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::harness::cluster::{cgroup_containerd, cgroupfs_of, pod_uid, write_proc};
use crate::harness::*;

const MIB: u64 = 1 << 20;

fn uuid(g: usize) -> String {
    format!("GPU-ca{g:06}-0000-0000-0000-000000000000")
}

/// GPUs with these processes (pid, bytes or none), each GPU's used memory
/// the sum of its processes'.
fn scenario(gpus: &[Vec<(u32, Option<u64>)>]) -> String {
    let mut y = String::from("devices:\n");
    for (g, procs) in gpus.iter().enumerate() {
        let used: u64 = procs.iter().filter_map(|p| p.1).sum();
        y.push_str(&format!(
            "  - uuid: {}\n    memory: {{total: 150000000000, reserved: 0, used: {used}}}\n    processes:\n",
            uuid(g)
        ));
        for (pid, b) in procs {
            match b {
                Some(b) => y.push_str(&format!("      - {{pid: {pid}, used: {b}}}\n")),
                None => y.push_str(&format!("      - {{pid: {pid}, used: null}}\n")),
            }
        }
    }
    y
}

/// Series per family of a body (a line that is no comment is a series),
/// the exporter's own families left out.
fn series_per_family(text: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name = line.split(['{', ' ']).next().unwrap_or("");
        if !name.starts_with("gpumem_exporter_") {
            *out.entry(name.to_string()).or_insert(0) += 1;
        }
    }
    out
}

fn sum_by(m: &Metrics, name: &str, key: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for (labels, v) in m.find(name, &[]) {
        *out.entry(labels.get(key).cloned().unwrap_or_default())
            .or_insert(0) += v as u64;
    }
    out
}

fn json_pids(ex: &Exporter) -> BTreeMap<String, BTreeSet<u64>> {
    let r = ex.get("/api/v1/snapshot");
    assert_eq!(r.status, 200);
    let v: serde_json::Value = serde_json::from_str(&r.body).expect("snapshot JSON");
    let mut out = BTreeMap::new();
    for g in v["gpus"].as_array().cloned().unwrap_or_default() {
        let pids = g["processes"]
            .as_array()
            .map(|ps| ps.iter().filter_map(|p| p["pid"].as_u64()).collect())
            .unwrap_or_default();
        out.insert(g["uuid"].as_str().unwrap_or("").to_string(), pids);
    }
    out
}

#[test]
fn a_budget_of_2000_keeps_8_gpus_of_1024_processes_within_it_per_process_series_first() {
    const GPUS: usize = 8;
    const PROCS: u32 = 1024;
    const BUDGET: u64 = 2000;
    let gpus: Vec<Vec<(u32, Option<u64>)>> = (0..GPUS)
        .map(|g| {
            (0..PROCS)
                .map(|i| (100_000 + g as u32 * PROCS + i, Some(u64::from(i + 1) * MIB)))
                .collect()
        })
        .collect();
    let sc = Scenario::new(&scenario(&gpus));
    // An empty /proc: no process is visible, so every series is the
    // smallest a process has (no name, user or pod) and nothing is slow.
    let proc_root = sc.dir.path().join("proc");
    std::fs::create_dir_all(&proc_root).expect("proc root");
    let ex = Exporter::with_config(
        &sc,
        &format!(
            "sample_interval: 1s\nseries_budget: {BUDGET}\npath:\n  procfs: {}\n",
            proc_root.display()
        ),
        &[],
    );
    let m = wait_for(Duration::from_secs(30), "process series", || {
        let m = ex.metrics();
        (!m.find("gpu_process_memory_used_bytes", &[]).is_empty()).then_some(m)
    });
    let served = series_per_family(&m.text);
    let total: u64 = served.values().sum();
    eprintln!("{total} series served within {BUDGET}: {served:?}");
    assert!(total <= BUDGET, "{total} series > {BUDGET}:\n{served:?}");
    // The budget is used, not left empty: the cut is the largest that fits.
    assert!(total > BUDGET - 50, "{total} series: the cut is too deep");
    // Every per-GPU family is whole: one series per GPU.
    for family in [
        "gpu_info",
        "gpu_up",
        "gpu_memory_used_bytes",
        "gpu_processes_other",
    ] {
        assert_eq!(served.get(family), Some(&(GPUS as u64)), "{family}");
    }
    // Each GPU: its largest processes, the rest in pid="other", the sum
    // what NVML says the GPU uses.
    let used = sum_by(&m, "gpu_process_memory_used_bytes", "uuid");
    let nvml = sum_by(&m, "gpu_memory_used_bytes", "uuid");
    assert_eq!(used, nvml, "per-process bytes sum to the GPU's");
    let mut kept_per_gpu = BTreeSet::new();
    for g in 0..GPUS {
        let u = uuid(g);
        let pids: Vec<u32> = m
            .find("gpu_process_memory_used_bytes", &[("uuid", &u)])
            .into_iter()
            .filter_map(|(l, _)| l.get("pid").and_then(|p| p.parse().ok()))
            .collect();
        let n = pids.len() as u32;
        kept_per_gpu.insert(n);
        let first = 100_000 + g as u32 * PROCS;
        let want: Vec<u32> = (first + PROCS - n..first + PROCS).collect();
        let mut got = pids.clone();
        got.sort_unstable();
        assert_eq!(got, want, "GPU {g}: the {n} largest processes");
        let other = m
            .get_u64(
                "gpu_processes_other",
                &[("gpu", &g.to_string()), ("uuid", &u)],
            )
            .expect("rollup count");
        assert_eq!(other + u64::from(n), u64::from(PROCS), "GPU {g}");
    }
    assert_eq!(kept_per_gpu.len(), 1, "every GPU keeps as many");
    // The drops, per family: per-process families only.
    let dropped: BTreeMap<String, f64> = m
        .find("gpumem_exporter_series_dropped_total", &[])
        .into_iter()
        .map(|(l, v)| (l.get("family").cloned().unwrap_or_default(), v))
        .collect();
    eprintln!("dropped: {dropped:?}");
    let kept = *kept_per_gpu.iter().next().unwrap_or(&0) as f64;
    let cut = (f64::from(PROCS) - kept) * GPUS as f64;
    assert!(
        dropped.get("gpu_process_info").is_some_and(|v| *v >= cut),
        "{dropped:?}"
    );
    // A cut process costs its used-bytes series (less the rollup series
    // that was not there before) in every body encoded so far.
    assert!(
        dropped
            .get("gpu_process_memory_used_bytes")
            .is_some_and(|v| *v >= cut - GPUS as f64),
        "{dropped:?}"
    );
    assert!(
        dropped.keys().all(|f| f.starts_with("gpu_process")),
        "only per-process families lose series: {dropped:?}"
    );
    // The gauge tells what this very body holds.
    for (family, n) in &served {
        assert_eq!(
            m.get_u64("gpumem_exporter_series", &[("family", family)]),
            Some(*n),
            "{family}"
        );
    }
    // The page keeps per-pid detail: its 512 largest per GPU.
    let listed = json_pids(&ex);
    for g in 0..GPUS {
        let n = listed.get(&uuid(g)).map_or(0, BTreeSet::len);
        assert!(n as f64 > kept, "GPU {g}: {n} pids listed, {kept} served");
    }
}

/// Four workloads and a stranger on GPU 0, three on GPU 1.
struct Node {
    sc: Scenario,
    ex: Exporter,
    base: String,
}

fn node() -> Node {
    // pid, bytes (MiB), who: a pod (seed), a uid, or not visible.
    enum Who {
        Pod(char),
        Uid(u32),
        Nobody,
    }
    use Who::*;
    let gpu0: Vec<(u32, Option<u64>, Who)> = vec![
        (5000, Some(100), Pod('a')),
        (5001, Some(200), Pod('a')),
        (5002, Some(300), Pod('a')),
        (5003, Some(400), Pod('b')),
        (5004, Some(500), Pod('b')),
        (5005, Some(600), Uid(1000)),
        (5006, Some(700), Uid(1000)),
        (5007, Some(800), Uid(1001)),
        (5008, Some(900), Nobody),
        (5009, Some(10), Pod('a')),  // below the top 9: pid="other"
        (5010, Some(20), Uid(1001)), // the same
    ];
    let gpu1: Vec<(u32, Option<u64>, Who)> = vec![
        (5100, Some(1000), Pod('a')),
        (5101, Some(1100), Uid(1000)),
        (5102, None, Pod('b')),
        (5103, Some(1200), Pod('b')),
    ];
    let yaml = scenario(&[
        gpu0.iter().map(|p| (p.0, p.1.map(|b| b * MIB))).collect(),
        gpu1.iter().map(|p| (p.0, p.1.map(|b| b * MIB))).collect(),
    ]);
    let sc = Scenario::new(&yaml);
    let proc_root = sc.dir.path().join("proc");
    std::fs::create_dir_all(&proc_root).expect("proc root");
    for (pid, _, who) in gpu0.iter().chain(&gpu1) {
        match who {
            Pod(seed) => write_proc(
                &proc_root,
                *pid,
                "python3",
                0,
                &cgroup_containerd(*seed),
                &[],
            ),
            Uid(uid) => write_proc(
                &proc_root,
                *pid,
                "python3",
                *uid,
                &format!("0::/user.slice/user-{uid}.slice/session-1.scope\n"),
                &[],
            ),
            Nobody => {}
        }
    }
    let base = format!(
        "sample_interval: 200ms\npath:\n  procfs: {}\n  cgroupfs: {}\n",
        proc_root.display(),
        cgroupfs_of(&proc_root).display()
    );
    let ex = Exporter::with_config(&sc, &format!("{base}processes:\n  top_n: 9\n"), &[]);
    Node { sc, ex, base }
}

impl Node {
    /// Switch `processes.series` by SIGHUP (with the per-process counter
    /// asked for, `processes.byte_seconds`) and wait until a body shows it.
    fn switch(&self, mode: &str, shows: impl Fn(&Metrics) -> bool) -> Metrics {
        self.sc.file(
            "config.yaml",
            format!(
                "{}processes:\n  top_n: 9\n  series: {mode}\n  byte_seconds: true\n",
                self.base
            )
            .as_bytes(),
        );
        self.ex.signal_only("HUP");
        let shown = wait_for(Duration::from_secs(10), mode, || {
            let m = self.ex.metrics();
            shows(&m).then_some(m)
        });
        assert!(
            shown
                .get(
                    "gpumem_exporter_config_reloads_total",
                    &[("result", "success")]
                )
                .is_some_and(|n| n >= 1.0)
        );
        shown
    }
}

/// A series of the body carries a `pid` label (HELP texts name it).
fn has_pid(m: &Metrics) -> bool {
    m.text
        .lines()
        .any(|l| !l.starts_with('#') && (l.contains("{pid=\"") || l.contains(",pid=\"")))
}

/// A process's workload from its identity series: its pod, else its user,
/// else none ("other").
fn workload_of(info: &BTreeMap<String, String>) -> String {
    match (info.get("pod_uid"), info.get("user")) {
        (Some(p), _) => format!("pod_uid={p}"),
        (None, Some(u)) => format!("user={u}"),
        _ => "workload=other".to_string(),
    }
}

fn workload_key(labels: &BTreeMap<String, String>) -> String {
    for k in ["pod_uid", "user", "workload"] {
        if let Some(v) = labels.get(k) {
            return format!("{k}={v}");
        }
    }
    String::new()
}

/// Per (uuid, workload): the pid mode's figures of `family` summed over
/// pids (the workload through `gpu_process_info`; `pid="other"` is the
/// rollup, in `workload="other"`).
fn per_pid_summed(m: &Metrics, family: &str) -> BTreeMap<(String, String), u64> {
    let mut info: BTreeMap<(String, String), String> = BTreeMap::new();
    for (l, _) in m.find("gpu_process_info", &[]) {
        info.insert((l["uuid"].clone(), l["pid"].clone()), workload_of(&l));
    }
    let mut out = BTreeMap::new();
    for (l, v) in m.find(family, &[]) {
        let key = (l["uuid"].clone(), l["pid"].clone());
        let w = match info.get(&key) {
            Some(w) => w.clone(),
            None => "workload=other".to_string(),
        };
        *out.entry((l["uuid"].clone(), w)).or_insert(0) += v as u64;
    }
    out
}

fn per_workload(m: &Metrics, family: &str) -> BTreeMap<(String, String), u64> {
    let mut out = BTreeMap::new();
    for (l, v) in m.find(family, &[]) {
        let prev = out.insert((l["uuid"].clone(), workload_key(&l)), v as u64);
        assert!(prev.is_none(), "{family}: one series per workload: {l:?}");
    }
    out
}

#[test]
fn workload_mode_sums_the_pids_off_mode_has_none_and_the_page_keeps_them() {
    let node = node();
    let pid = wait_for(Duration::from_secs(20), "attributed", || {
        let m = node.ex.metrics();
        (m.find("gpu_process_info", &[("pod_uid", &pod_uid('a'))])
            .len()
            == 4
            && m.find("gpu_process_memory_used_bytes", &[("pid", "other")])
                .len()
                == 1)
            .then_some(m)
    });
    let pids = json_pids(&node.ex);
    assert_eq!(pids.get(&uuid(0)).map(BTreeSet::len), Some(9), "{pids:?}");
    // At the defaults a process's memory-time is its workload's counter
    // alone: no counter per pid.
    assert!(
        pid.find("gpu_process_memory_used_byte_seconds_total", &[])
            .is_empty(),
        "off by default"
    );
    assert!(
        !pid.find("gpu_workload_memory_used_byte_seconds_total", &[])
            .is_empty()
    );

    let wl = node.switch("workload", |m| {
        !has_pid(m) && !m.find("gpu_process_memory_used_bytes", &[]).is_empty()
    });
    // No pid label on any family.
    assert!(!has_pid(&wl), "{}", wl.text);
    for family in [
        "gpu_process_memory_used_bytes",
        "gpu_process_memory_unavailable",
    ] {
        let want = per_pid_summed(&pid, family);
        let got = per_workload(&wl, family);
        eprintln!("{family}: {got:?}");
        assert_eq!(got, want, "{family}: per workload = per pid summed");
    }
    // Five workloads on GPU 0 (pods a, b; uids 1000, 1001; other), three
    // on GPU 1.
    let used = per_workload(&wl, "gpu_process_memory_used_bytes");
    assert_eq!(
        used.keys().filter(|k| k.0 == uuid(0)).count(),
        5,
        "{used:?}"
    );
    assert_eq!(
        used.keys().filter(|k| k.0 == uuid(1)).count(),
        3,
        "{used:?}"
    );
    assert_eq!(
        used.get(&(uuid(0), format!("pod_uid={}", pod_uid('a')))),
        Some(&(600 * MIB)),
        "pod a's three listed pids (its fourth is in the rollup)"
    );
    // The rollup: the two pids below the top 9 and the one not visible.
    assert_eq!(
        wl.get_u64("gpu_processes_other", &[("gpu", "0"), ("uuid", &uuid(0))]),
        Some(3)
    );
    // The sum over workloads is the GPU's, as in pid mode.
    assert_eq!(
        sum_by(&wl, "gpu_process_memory_used_bytes", "uuid"),
        sum_by(&wl, "gpu_memory_used_bytes", "uuid")
    );
    for gone in [
        "gpu_process_info",
        "gpu_process_memory_used_peak_bytes",
        "gpu_process_memory_used_byte_seconds_total",
    ] {
        assert!(wl.find(gone, &[]).is_empty(), "{gone} in workload mode");
    }
    // The workloads' own counters stay.
    assert!(
        !wl.find("gpu_workload_memory_used_byte_seconds_total", &[])
            .is_empty()
    );
    assert_eq!(json_pids(&node.ex), pids, "the page keeps the pids");

    let off = node.switch("off", |m| {
        m.find("gpu_process_memory_used_bytes", &[]).is_empty()
            && !m.find("gpu_memory_used_bytes", &[]).is_empty()
    });
    let families = series_per_family(&off.text);
    assert!(
        families
            .keys()
            .all(|f| !f.starts_with("gpu_process_") && f != "gpu_processes_other"),
        "{families:?}"
    );
    assert!(!has_pid(&off));
    assert_eq!(json_pids(&node.ex), pids, "the page keeps the pids");

    // And back: pid mode's series again.
    let back = node.switch("pid", has_pid);
    assert_eq!(
        per_pid_summed(&back, "gpu_process_memory_used_bytes"),
        per_pid_summed(&pid, "gpu_process_memory_used_bytes")
    );
    // `processes.byte_seconds`, applied by the same SIGHUP: a counter per
    // listed pid (the rollup has none).
    assert_eq!(
        back.find(
            "gpu_process_memory_used_byte_seconds_total",
            &[("uuid", &uuid(0))]
        )
        .len(),
        9,
        "{}",
        back.text
    );
}
