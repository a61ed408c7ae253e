//! End to end through a real Prometheus: the exporter on the fake NVML (with
//! a fake /proc root and a local Kubernetes API, so process series carry
//! namespace/pod/container and gpu_process_info a user) is scraped every
//! second by the `prometheus` binary, which also evaluates
//! deploy/prometheus/rules.yml (every group every second, the hourly
//! accounting tiles included: `rules_at_global_interval`). Then every query of every panel of
//! grafana/gpumem-exporter.json and every rule expression is run through
//! Prometheus's HTTP API: each must parse, each panel must return data, each
//! alert that the scenario makes true must return exactly the series it is
//! about, and the metrics of the rules that need hours of history must exist.
//!
//! The scenario, three scrape targets of job "gpumem-exporter":
//! - `main`: GPU 0 93% used (GpuMemoryHigh) with two pods' processes, two
//!   small ones summed into pid="other" (processes.min_bytes / top_n) and
//!   one without a memory figure. The trainer pod's process is a real
//!   `python3` running the torch bridge (python/) with the stub `torch`
//!   (tests/torch_stub), as in the `torch` tests: its fake /proc entry
//!   links `fd` to its real /proc/<pid>/fd, so the exporter reads its
//!   allocator figures (gpu_process_torch_*), and its allocation retries
//!   keep rising (GpuTorchAllocRetriesRising). GPU 1 in MIG mode with a pod's process in
//!   one instance and a pid hidden from /proc in the other; GPU 2 answers at
//!   start, then reports gpu_lost (gpu_up 0, GpuDown; the error counter
//!   grows, NvmlErrorsRising).
//!   A fake kubelet (pod-resources API) allocated GPU 0 to the trainer and
//!   the inference pod (time-slicing replicas, both busy) and both MIG
//!   instances of GPU 1 to the notebook, which uses only instance 1: instance
//!   2 is allocated but idle (GpuAllocatedButIdle, the idle rollup).
//!   A Slurm job's process (4105, cgroup v1 `/slurm/uid_1000/job_4242/…`)
//!   runs on GPU 0 beside the pods; a job-mapping directory (dcgm layout)
//!   says job 4242 holds GPU 0 (busy) and job 4243 MIG instance 1 of GPU 1,
//!   where no process of 4243 runs (GpuAllocatedButIdle for Slurm).
//!   For the accounting rules and the "Who used it, who wasted it" row:
//!   GPU 0's third replica is allocated to team-b's `batch-idle` pod,
//!   which runs nothing (idle allocated hours for a namespace), and bob's
//!   `render` (4106, his login session: no pod, job or container) runs on
//!   GPU 1, so a workload is charged to a user.
//!   Held for nobody (the "Waste" row): bob's `sweep` (4107) on GPU 0 is a
//!   zombie NVML still lists (GpuMemoryHeldByDeadProcesses); job 4242's
//!   step loses its parent (its slurmstepd) once Prometheus scrapes, so it
//!   runs on reparented (GpuMemoryHeldByOrphans); GPU 1's level, once
//!   risen, is 11.5 GB more than its processes hold
//!   (GpuMemoryUnattributed; so is the `stale` exporter's GPU, 8 GB used
//!   with no process). With `processes.idle_after: 20s`, the processes of
//!   GPU 0 that have no utilisation samples (job 4242's step, the zombie)
//!   are idle 20 s after the start (gpu_process_idle_seconds, the idle
//!   byte-seconds of their workloads); the trainer and the inference pod
//!   have samples at every rewrite (every 2 s; read every 10 s), so they
//!   never are.
//!   Each workload's own limit: KAI granted the trainer half of GPU 0
//!   (`gpu-fraction: 0.5`, below its 50 GB: over its share) and the
//!   inference server 0.6 of it (the shares sum past GPU 0's total); HAMi
//!   limits the inference server to 30000 MiB on GPU 0, which it holds
//!   more than 90 % of and grows toward at 5 MB/s (its forecast under 10
//!   minutes); the trainer's PyTorch fraction is a `torch` hard limit.
//! - `stale`: an exporter whose GPU calls hang (fake NVML `delay_ms`) after
//!   its first sample, so the sample it serves ages
//!   (GpuMemExporterSamplesStale).
//! - `down`: a socket that never answers (up 0, GpuMemExporterDown).
//!
//! The summary table goes to stderr unconditionally (also when the test
//! passes).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::harness::cluster::{
    FakeNode, cgroup_containerd, cgroup_crio, cgroup_v1, pods_resolved, team_pods, write_proc,
};
use crate::harness::fleet::VmStack;
use crate::harness::kubelet::{self, FakeKubelet};
use crate::harness::prom::{
    Prometheus, QueryApi, QueryResult, config_with_rules, grafana_regex, grafana_substitute,
    metric_names, prometheus_binary, rules_at_global_interval,
};
use crate::harness::python::{Py, StubState};
use crate::harness::*;
use serde::Deserialize;
use serde_json::{Value, json};

// ------------------------------------------------------------------ DRA
// Dynamic Resource Allocation rows (GPUs held by ResourceClaims): a test
// of their own with its own exporter and Prometheus, beside the World
// below.
mod dra;

// ------------------------------------------------------------------ VictoriaMetrics
// The same panel queries and rules in VictoriaMetrics (fed by Prometheus's
// remote write, rules in vmalert): the answers compared with Prometheus's.
mod victoria;

const GPU0: &str = "GPU-0a0a0a0a-0000-0000-0000-000000000000";
const GPU1: &str = "GPU-1b1b1b1b-0000-0000-0000-000000000000";
const GPU2: &str = "GPU-2c2c2c2c-0000-0000-0000-000000000000";
const GPU_STALE: &str = "GPU-5e5e5e5e-0000-0000-0000-000000000000";
const MIG1: &str = "MIG-11111111-0000-0000-0000-000000000000";
const MIG2: &str = "MIG-22222222-0000-0000-0000-000000000000";
/// GPU 0's UUID as CUDA (and the stub torch) spell it: without `GPU-`.
const GPU0_CUDA: &str = "0a0a0a0a-0000-0000-0000-000000000000";

/// GPU 1's used memory: its level, the spike it has for 300 ms between two
/// scrapes, and the level it rises to after it (GpuMemorySpikeWouldNotFit).
const GPU1_LEVEL: u64 = 9_000_000_000;
const GPU1_SPIKE: u64 = 80_000_000_000;
const GPU1_RISEN: u64 = 20_000_000_000;

/// The trainer's memory: NVML's figure, and torch's allocated and reserved
/// (so 36 GB in tensors, 12 GB cached, 2 GB outside torch).
const TRAINER_USED: u64 = 50_000_000_000;
pub(super) const TORCH_ALLOCATED: u64 = 36_000_000_000;
const TORCH_RESERVED: u64 = 48_000_000_000;
/// The stub's allocation retries grow by one this often.
const RETRY_EVERY: Duration = Duration::from_millis(500);
/// The pids the fake /proc and the fake NVML use: the trainer's real pid
/// must not be one of them.
const FAKE_PIDS: [u32; 9] = [4102, 4103, 4104, 4105, 4106, 4107, 6000, 6100, 7002];

/// `$__rate_interval` as Grafana would set it for a 1s scrape interval
/// (rounded up, so two samples are always in the window).
pub(super) const RATE_INTERVAL: &str = "10s";

/// The stale-sample alert needs a sample older than 30 s. Waiting that long
/// in real time would double the test's run time, so its expression is
/// evaluated this far in the future (Prometheus answers from the latest
/// samples within its 5-minute lookback): true for the hung exporter, whose
/// sample is already older than 30 s − STALE_AHEAD_S, and not for the
/// healthy one (its sample is at most a scrape interval old).
pub(super) const STALE_AHEAD_S: f64 = 22.0;

/// The dashboard table of allocated devices.
const ALLOCATED: &str = "Allocated GPUs and their memory";

/// The dashboard panel that splits a torch process's memory.
const REAL_OR_CACHE: &str = "Real or cache? (PyTorch allocator per process)";

/// Everything must be true within this long after Prometheus is ready.
const DEADLINE: Duration = Duration::from_secs(35);

// ------------------------------------------------------------------ world

/// The three pods of [`team_pods`] (containerd/cgroup v2, CRI-O/cgroup
/// v2, cgroupfs/cgroup v1) and one host process outside any pod. The
/// trainer (`trainer_pid`) is a real process: its `fd` directory is its
/// real one, where the exporter finds the torch bridge's memfd.
pub(super) fn fake_proc(root: &Path, trainer_pid: u32) {
    write_proc(
        root,
        trainer_pid,
        "python3",
        1000,
        &cgroup_containerd('a'),
        &[],
    );
    std::os::unix::fs::symlink(
        format!("/proc/{trainer_pid}/fd"),
        root.join(trainer_pid.to_string()).join("fd"),
    )
    .unwrap();
    write_proc(root, 4102, "tritonserver", 1001, &cgroup_crio('b'), &[]);
    write_proc(root, 4103, "jupyter", 1000, &cgroup_v1('c'), &[]);
    write_proc(
        root,
        4104,
        "nvtop",
        1001,
        "0::/user.slice/user-1001.slice\n",
        &[],
    );
    write_proc(
        root,
        4105,
        "python3",
        1000,
        "11:memory:/slurm/uid_1000/job_4242/step_0/task_0\n4:freezer:/slurm/uid_1000/job_4242/step_0\n1:name=systemd:/system.slice/slurmd.service\n",
        &[],
    );
    // The step's parent is its slurmstepd until World::start_rewriting.
    write_stat(root, 4105, "python3", 'S', STEPD_PID);
    // bob's render job in his login session: in no pod, job or container,
    // so its memory-time is charged to the user (the accounting rules'
    // per-user figures).
    write_proc(
        root,
        4106,
        "render",
        1001,
        "0::/user.slice/user-1001.slice/session-3.scope\n",
        &[],
    );
    // bob's `sweep` exited and its parent never reaped it: a zombie that
    // NVML still lists with its memory.
    write_proc(
        root,
        4107,
        "sweep",
        1001,
        "0::/user.slice/user-1001.slice/session-3.scope\n",
        &[],
    );
    write_stat(root, 4107, "sweep", 'Z', 4106);
}

/// Job 4242's slurmstepd, the parent of its step (4105) until the step
/// is reparented.
const STEPD_PID: u32 = 4100;

/// Rewrite `/proc/<pid>/stat` under the fake root, atomically, with a
/// state and a parent pid, and the start time [`write_proc`] gave it (so
/// it is the same process).
fn write_stat(root: &Path, pid: u32, comm: &str, state: char, ppid: u32) {
    let dir = root.join(pid.to_string());
    let tmp = dir.join("stat.tmp");
    std::fs::write(
        &tmp,
        format!(
            "{pid} ({comm}) {state} {ppid} 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {}\n",
            1000 + pid
        ),
    )
    .unwrap();
    std::fs::rename(&tmp, dir.join("stat")).unwrap();
}

/// The job-mapping directory a Slurm prolog would write (dcgm layout):
/// job 4242 holds GPU 0, job 4243 GPU 1's MIG GPU instance 1.
pub(super) fn job_mapping(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("0"), "4242\n").unwrap();
    std::fs::write(dir.join("1.1"), "4243\n").unwrap();
}

/// GPU 0's used memory when the test starts.
const GPU0_USED: u64 = 80_000_000_000;

/// The inference server's memory at the start, its growth (bytes per
/// second) and its HAMi limit (MiB) on GPU 0.
const INFER_USED: u64 = 29_000_000_000;
const INFER_GROWTH: f64 = 5e6;
const INFER_HAMI_MIB: u64 = 30_000;

/// The pods of [`team_pods`] with the limits their schedulers wrote: KAI's
/// shares of GPU 0 for the trainer (0.5) and the inference server (0.6),
/// and HAMi's memory for the inference server on GPU 0.
fn limited_team_pods() -> Vec<Value> {
    let mut pods = team_pods();
    for p in &mut pods {
        p["metadata"]["annotations"] = match p["metadata"]["name"].as_str() {
            Some("trainer-0") => json!({"gpu-fraction": "0.5"}),
            Some("infer-7f9c") => json!({
                "gpu-fraction": "0.6",
                "hami.io/vgpu-devices-allocated": format!("{GPU0},NVIDIA,{INFER_HAMI_MIB},100:;"),
            }),
            _ => continue,
        };
    }
    pods
}

/// When GPU 0's used memory starts growing: the first time a scenario is
/// written (Unix seconds).
/// The main exporter's GPUs; GPU 2 is lost (every call on it fails).
/// GPU 0 is busy and unhealthy (uncorrectable ECC errors, a pending and a
/// failed row remap, `xids` critical Xid 79 events so far); GPU 1 holds
/// memory while idle and retires pages (a GPU before Ampere).
pub(super) fn main_scenario(
    trainer_pid: u32,
    xids: usize,
    gpu1_used: u64,
    ramp_start: f64,
) -> String {
    let xid_list = vec!["79"; xids].join(", ");
    // GPU 0's used memory grows 20 MB/s from `ramp_start`, when its World
    // started (the fake's used_timeline, the same in every rewrite of that
    // World; each World has its own, as tests of one process run minutes
    // apart): the time-to-full
    // rules have a slope to divide by, and the exporter's forecast a growth
    // (gpu_memory_growth_bytes_per_second): its free memory less the
    // headroom is gone in under a minute (GpuMemoryFillingFast), and it
    // stops growing 250 s in, well after the test.
    let start = ramp_start;
    let (from, to) = (GPU0_USED, GPU0_USED + 250 * 20_000_000);
    let gpu0_timeline = format!("[[{start}, {from}], [{}, {to}]]", start + 250.0);
    // The inference server (4102) grows 5 MB/s from the same start toward
    // its HAMi limit (INFER_HAMI_MIB): 2.46 GB away, 8 minutes at the start.
    let infer_used = INFER_USED + ((unix_now() - ramp_start).max(0.0) * INFER_GROWTH) as u64;
    format!(
        "devices:
  - uuid: {GPU0}
    memory: {{total: 85899345920, reserved: 536870912, used: {from}}}
    used_timeline: {gpu0_timeline}
    processes:
      - {{pid: {trainer_pid}, used: {TRAINER_USED}}}
      - {{pid: 4102, used: {infer_used}}}
      - {{pid: 4105, used: 5000000000}}
      - {{pid: 4107, used: 2000000000}}
      - {{pid: 4104, used: 300000000}}
      - {{pid: 6000, used: 50000000}}
      - {{pid: 6100, used: null}}
    utilization: {{gpu: 97, memory: 55, encoder: 3, decoder: 1}}
    process_utilization:
      - {{pid: {trainer_pid}, sm: 80, memory: 45, encoder: 0, decoder: 0}}
      - {{pid: 4102, sm: 15, memory: 9, encoder: 3, decoder: 1}}
    temperature_c: 71
    power_mw: 612000
    power_limit_mw: 700000
    energy_mj: 9876543210
    clocks_mhz: {{graphics: 1755, sm: 1755, memory: 2619, video: 1620}}
    performance_state: 0
    clock_event_reasons: 0x4
    ecc: {{enabled: true, corrected_volatile: 12, corrected_aggregate: 40, uncorrected_volatile: 1, uncorrected_aggregate: 1}}
    remapped_rows: {{correctable: 2, uncorrectable: 1, pending: true, failed: true}}
    xid_events: [{xid_list}]
    gpm: {{sm_util: 91, sm_occupancy: 48, any_tensor_util: 72, dram_bw_util: 35, fp16_util: 20, fp32_util: 4, fp64_util: 0, pcie_tx_per_sec: 120, pcie_rx_per_sec: 900, nvlink_total_tx_per_sec: 30000, nvlink_total_rx_per_sec: 29500}}
  - uuid: {GPU1}
    memory: {{total: 85899345920, reserved: 536870912, used: {gpu1_used}}}
    utilization: {{gpu: 2, memory: 1, encoder: 0, decoder: 0}}
    temperature_c: 35
    power_mw: 90000
    power_limit_mw: 700000
    energy_mj: 1234567890
    clocks_mhz: {{graphics: 345, sm: 345, memory: 2619, video: 540}}
    performance_state: 8
    clock_event_reasons: 0x1
    ecc: {{enabled: true}}
    retired_pages: {{single_bit_ecc: 1, double_bit_ecc: 0, pending: true}}
    mig_devices:
      - uuid: {MIG1}
        gpu_instance_id: 1
        compute_instance_id: 0
        memory: {{total: 20000000000, reserved: 0, used: 6000000000}}
        processes: [{{pid: 4103, used: 5000000000}}]
      - uuid: {MIG2}
        gpu_instance_id: 2
        compute_instance_id: 0
        memory: {{total: 20000000000, reserved: 0, used: 2500000000}}
        processes: [{{pid: 7002, used: 2000000000}}, {{pid: 4106, used: 1500000000}}]
  - uuid: {GPU2}
    memory: {{total: 85899345920, reserved: 536870912, used: 1000000000}}
    error: gpu_lost
"
    )
}

/// What the kubelet allocated: GPU 0 shared by time-slicing between the
/// trainer and the inference server, both of GPU 1's MIG instances to the
/// notebook (which runs on instance 1 only), and GPU 0's third replica to
/// a batch pod of team-b that never starts a process (idle allocated
/// GPU-hours for a namespace).
pub(super) fn kubelet_pods() -> Vec<kubelet::proto::PodResources> {
    let (r0, r1) = (format!("{GPU0}::0"), format!("{GPU0}::1"));
    vec![
        kubelet::pod(
            "team-a",
            "trainer-0",
            &[("trainer", &[("nvidia.com/gpu", &[&r0])])],
        ),
        kubelet::pod(
            "team-b",
            "infer-7f9c",
            &[("server", &[("nvidia.com/gpu", &[&r1])])],
        ),
        kubelet::pod(
            "team-a",
            "notebook",
            &[("jupyter", &[("nvidia.com/mig-1g.10gb", &[MIG1, MIG2])])],
        ),
        kubelet::pod(
            "team-b",
            "batch-idle",
            &[("worker", &[("nvidia.com/gpu", &[&format!("{GPU0}::2")])])],
        ),
    ]
}

pub(super) fn stale_scenario(delay_ms: u64) -> String {
    format!(
        "devices:
  - uuid: {GPU_STALE}
    memory: {{total: 85899345920, reserved: 536870912, used: 8000000000}}
    delay_ms: {delay_ms}
"
    )
}

/// The trainer pod's process: `python3` running the torch bridge with the
/// stub torch (tests/torch_stub), whose figures come from a state file this
/// test rewrites; its allocation retries grow by one every RETRY_EVERY (and
/// it had one OOM, of which the bridge writes a snapshot into `dir`: OOM
/// snapshots are on, as is a memory fraction of 0.5). Killed, and the
/// rewriting stopped, on drop.
pub(super) struct Trainer {
    pub(super) py: Py,
    stop: Arc<AtomicBool>,
    ticker: Option<JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

/// Reserved bytes creep up by this much per RETRY_EVERY (2 MiB/s), so the
/// time-to-limit rule has a slope and the exporter's limit forecast a
/// growth well above its noise floor (the checks allow for it:
/// [`CREEP_SLACK`]).
const RESERVED_CREEP: u64 = 1 << 20;
/// What the creep can add up to while the test runs (5 minutes).
const CREEP_SLACK: f64 = 600.0 * 1_048_576.0;

/// `torch.cuda.memory_stats()` of GPU 0 as the stub returns them.
fn torch_stats(retries: u64) -> Value {
    let reserved = TORCH_RESERVED + RESERVED_CREEP * retries;
    json!({
        "allocated_bytes.all.current": TORCH_ALLOCATED,
        "reserved_bytes.all.current": reserved,
        "allocated_bytes.all.peak": TORCH_ALLOCATED + 4_000_000_000u64,
        "reserved_bytes.all.peak": reserved,
        "active_bytes.all.current": TORCH_ALLOCATED + 1_000_000_000u64,
        "inactive_split_bytes.all.current": 3_000_000_000u64,
        "num_alloc_retries": retries,
        "num_ooms": 1,
        // The pools: 35 GB + 1 GB allocated, 46 GB + 2 GB reserved.
        "allocated_bytes.large_pool.current": TORCH_ALLOCATED - 1_000_000_000u64,
        "allocated_bytes.small_pool.current": 1_000_000_000u64,
        "reserved_bytes.large_pool.current": reserved - 2_000_000_000u64,
        "reserved_bytes.small_pool.current": 2_000_000_000u64,
        "inactive_split_bytes.large_pool.current": 2_500_000_000u64,
        "inactive_split_bytes.small_pool.current": 500_000_000u64,
        "segment.large_pool.current": 700,
        "segment.small_pool.current": 950,
    })
}

/// The trainer: a memory fraction of 0.5 (the torch memory limit), and a
/// training loop taking an optimizer step every 50 ms that keeps nothing
/// (growth 0 per step), in a thread.
const TRAINER_CODE: &str = "torch.cuda.set_per_process_memory_fraction(0.5, 0)
import threading, time
def _train():
    opt = torch.optim.SGD([], lr=0.1)
    while True:
        opt.step()
        time.sleep(0.05)
threading.Thread(target=_train, daemon=True).start()
";

impl Trainer {
    pub(super) fn start() -> Trainer {
        let state = Arc::new(StubState::new(&[(GPU0_CUDA, torch_stats(0))]));
        // A pid the fake /proc already uses would mix two processes up: try
        // again (the other child is killed when dropped, after the loop).
        let mut discarded = Vec::new();
        let dir = tempfile::tempdir().expect("tempdir");
        let snapshots = dir.path().join("snapshots");
        let py = loop {
            let py = Py::bridge_to(
                &state,
                TRAINER_CODE,
                &[
                    (
                        "GPUMEM_BRIDGE_OOM_SNAPSHOT_DIR",
                        snapshots.to_str().unwrap(),
                    ),
                    ("GPUMEM_BRIDGE_WARN_AT", "0.9"),
                ],
                &dir.path().join("stderr"),
            );
            if !FAKE_PIDS.contains(&py.pid) {
                break py;
            }
            assert!(discarded.len() < 5, "python3 keeps getting the fake pids");
            discarded.push(py);
        };
        drop(discarded);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let ticker = std::thread::spawn(move || {
            let mut retries = 0;
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(RETRY_EVERY);
                retries += 1;
                state.write(&[(GPU0_CUDA, torch_stats(retries))]);
            }
        });
        Trainer {
            py,
            stop,
            ticker: Some(ticker),
            _dir: dir,
        }
    }
}

impl Drop for Trainer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
    }
}

// ------------------------------------------------------------------ rules and dashboard

#[derive(Deserialize)]
struct RuleFile {
    groups: Vec<RuleGroup>,
}

#[derive(Deserialize)]
struct RuleGroup {
    rules: Vec<Rule>,
}

#[derive(Deserialize)]
pub(super) struct Rule {
    pub(super) record: Option<String>,
    pub(super) alert: Option<String>,
    pub(super) expr: String,
}

pub(super) fn rules() -> Vec<Rule> {
    let path = repo_file("deploy/prometheus/rules.yml");
    let text = std::fs::read_to_string(&path).expect("read rules.yml");
    let file: RuleFile = serde_saphyr::from_str(&text).expect("parse rules.yml");
    let rules: Vec<Rule> = file.groups.into_iter().flat_map(|g| g.rules).collect();
    assert!(!rules.is_empty(), "rules.yml has no rules");
    rules
}

/// (panel title, refId, expr) of every query of every panel, rows' nested
/// panels included.
pub(super) fn dashboard_queries() -> Vec<(String, String, String)> {
    fn walk(panels: &[Value], out: &mut Vec<(String, String, String)>) {
        for p in panels {
            let title = p["title"].as_str().unwrap_or("?").to_string();
            for t in p["targets"].as_array().into_iter().flatten() {
                let expr = t["expr"]
                    .as_str()
                    .unwrap_or_else(|| panic!("{title}: target without expr"));
                let r = t["refId"].as_str().unwrap_or("?");
                out.push((title.clone(), r.to_string(), expr.to_string()));
            }
            if let Some(nested) = p["panels"].as_array() {
                walk(nested, out);
            }
        }
    }
    let path = repo_file("grafana/gpumem-exporter.json");
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("read dashboard"))
        .expect("dashboard JSON");
    let mut out = Vec::new();
    walk(dash["panels"].as_array().expect("panels"), &mut out);
    assert!(!out.is_empty(), "the dashboard has no queries");
    out
}

/// What the scenario shows for an alert.
enum Expect {
    /// True now: each answered series matches one of these label sets and
    /// each label set matches an answered series.
    Now(Vec<Vec<(&'static str, String)>>),
    /// True when evaluated this many seconds ahead (see STALE_AHEAD_S).
    Ahead(f64, Vec<Vec<(&'static str, String)>>),
    /// Needs more history than a test can wait for: only checked to parse
    /// and that every metric it selects exists.
    SelectorsOnly(&'static str),
}

struct Targets {
    main: String,
    stale: String,
    down: String,
    /// The pid of the trainer (the torch bridge process) on `main`.
    trainer: String,
}

fn expectation(alert: &str, t: &Targets) -> Expect {
    let i = |v: &String| ("instance", v.clone());
    match alert {
        "GpuMemoryHigh" => Expect::Now(vec![vec![i(&t.main), ("gpu", "0".into())]]),
        // Lost from the start: its identity was never read, so no uuid.
        "GpuDown" => Expect::Now(vec![vec![
            i(&t.main),
            ("gpu", "2".into()),
            ("uuid", String::new()),
        ]]),
        "NvmlErrorsRising" => Expect::Now(vec![vec![i(&t.main), ("error", "gpu_lost".into())]]),
        "GpuTorchAllocRetriesRising" => Expect::Now(vec![vec![
            i(&t.main),
            ("gpu", "0".into()),
            ("pid", t.trainer.clone()),
            ("pod", "trainer-0".into()),
        ]]),
        "GpuMemExporterDown" => Expect::Now(vec![vec![i(&t.down)]]),
        "GpuMemoryRowRemapPending" | "GpuMemoryRowRemapFailed" => {
            Expect::Now(vec![vec![i(&t.main), ("gpu", "0".into())]])
        }
        "GpuUncorrectableEccErrors" => Expect::Now(vec![vec![
            i(&t.main),
            ("gpu", "0".into()),
            ("type", "uncorrected".into()),
            ("scope", "volatile".into()),
        ]]),
        "GpuXidCritical" => Expect::Now(vec![vec![
            i(&t.main),
            ("gpu", "0".into()),
            ("xid", "79".into()),
        ]]),
        // MIG instance 2 of GPU 1: allocated to the notebook, which runs on
        // instance 1 only. (Its `for: 1h` is not waited for: the
        // expression is checked, and the alert must be pending.)
        "GpuAllocatedButIdle" => Expect::Now(vec![
            vec![
                i(&t.main),
                ("gpu", "1".into()),
                ("uuid", GPU1.into()),
                ("mig_uuid", MIG2.into()),
                ("gpu_instance_id", "2".into()),
                ("namespace", "team-a".into()),
                ("pod", "notebook".into()),
            ],
            // team-b's batch pod holds GPU 0's third replica and runs
            // nothing.
            vec![
                i(&t.main),
                ("gpu", "0".into()),
                ("uuid", GPU0.into()),
                ("replica", "2".into()),
                ("namespace", "team-b".into()),
                ("pod", "batch-idle".into()),
            ],
            vec![
                // Job 4243 holds MIG instance 1 of GPU 1, where only the
                // notebook's process runs.
                i(&t.main),
                ("gpu", "1".into()),
                ("uuid", GPU1.into()),
                ("mig_uuid", MIG1.into()),
                ("gpu_instance_id", "1".into()),
                ("slurm_job", "4243".into()),
                ("pod", String::new()),
            ],
        ]),
        "GpuMemExporterSamplesStale" => Expect::Ahead(STALE_AHEAD_S, vec![vec![i(&t.stale)]]),
        "GpuMemoryExhaustionPredicted" => {
            Expect::SelectorsOnly("needs a 30-minute decline of free memory")
        }
        "GpuProcessMemoryLeakSuspected" => {
            Expect::SelectorsOnly("needs 30 minutes of steady growth")
        }
        // GPU 1 spiked by 71 GB over its level between scrapes, then its
        // level rose by 11 GB: the spike no longer fits in what is free.
        "GpuMemorySpikeWouldNotFit" => Expect::Now(vec![vec![
            i(&t.main),
            ("gpu", "1".into()),
            ("uuid", GPU1.into()),
        ]]),
        "GpuMemoryWillFillSoon" => Expect::SelectorsOnly(
            "needs 5 minutes of falling free memory (offset 5m); GPU 0's falls 20 MB/s so its recording rule has data",
        ),
        "GpuTorchWillHitLimit" => Expect::SelectorsOnly(
            "needs 5 minutes of growing reserved memory (offset 5m); the trainer's creeps up so its recording rule has data",
        ),
        // GPU 0 grows 20 MB/s from the start: its free memory is within a
        // minute of the headroom.
        "GpuMemoryFillingFast" => Expect::Now(vec![vec![i(&t.main), ("gpu", "0".into())]]),
        "GpuTorchLimitFillingFast" => Expect::SelectorsOnly(
            "the trainer's reserved memory grows 2 MiB/s, so its limit forecast exists, but 27 GB below its limit that is hours away, not under 10 minutes",
        ),
        "GpuTorchMemoryLeak" => Expect::SelectorsOnly(
            "needs 15 minutes of steps (offset 15m); the trainer steps, without a leak",
        ),
        // bob's zombie (4107, 2 GB) on GPU 0.
        "GpuMemoryHeldByDeadProcesses" => Expect::Now(vec![vec![
            i(&t.main),
            ("gpu", "0".into()),
            ("uuid", GPU0.into()),
        ]]),
        // Job 4242's step (4105, 5 GB) on GPU 0, reparented.
        "GpuMemoryHeldByOrphans" => Expect::Now(vec![vec![
            i(&t.main),
            ("gpu", "0".into()),
            ("uuid", GPU0.into()),
        ]]),
        // GPU 1 once its level rose (20 GB used, 8.5 GB in its processes);
        // GPU 0 has none (a listed process has no figure), GPU 2 is lost.
        // And the hung exporter's GPU: 8 GB used, no process listed, in
        // the one sample it serves.
        "GpuMemoryUnattributed" => Expect::Now(vec![
            vec![i(&t.main), ("gpu", "1".into()), ("uuid", GPU1.into())],
            vec![i(&t.stale), ("gpu", "0".into()), ("uuid", GPU_STALE.into())],
        ]),
        // Job 4242's step and bob's zombie are idle after 20 s, but hold
        // 7 GB together and for seconds, not hours.
        "GpuMemoryHeldIdle" => Expect::SelectorsOnly("needs 2 hours of idle memory"),
        // Each workload's own limit: the inference server holds more
        // than 90 % of its HAMi limit and grows toward it within minutes.
        "GpuWorkloadMemoryNearLimit" | "GpuWorkloadMemoryLimitFillingFast" => {
            Expect::Now(vec![vec![
                i(&t.main),
                ("gpu", "0".into()),
                ("uuid", GPU0.into()),
                ("namespace", "team-b".into()),
                ("pod", "infer-7f9c".into()),
            ]])
        }
        // The trainer's 50 GB against the half of GPU 0 KAI granted it (its
        // PyTorch limit is half of the stub's 150 GB: far).
        "GpuWorkloadMemoryOverGrantedShare" => Expect::Now(vec![vec![
            i(&t.main),
            ("gpu", "0".into()),
            ("uuid", GPU0.into()),
            ("namespace", "team-a".into()),
            ("pod", "trainer-0".into()),
        ]]),
        // GPU 0: the trainer's 0.5 and the inference server's 0.6.
        "GpuMemoryGrantsExceedTotal" => Expect::Now(vec![vec![
            i(&t.main),
            ("gpu", "0".into()),
            ("uuid", GPU0.into()),
        ]]),
        other => panic!(
            "rules.yml has a new alert {other}: add what the scenario shows for it to \
             `expectation` in tests/e2e/prometheus.rs"
        ),
    }
}

/// `labels` has every wanted label; a wanted empty value means the label is
/// absent (Prometheus drops empty labels).
fn matches(labels: &serde_json::Map<String, Value>, want: &[(&str, String)]) -> bool {
    want.iter()
        .all(|(k, v)| labels.get(*k).and_then(Value::as_str).unwrap_or("") == v.as_str())
}

/// Every answered series matches one label set, and every label set one
/// series; the mismatch otherwise. At least one label set, none empty: an
/// empty one would match any series.
fn check_series(q: &QueryResult, want: &[Vec<(&str, String)>]) -> Result<(), String> {
    assert!(
        !want.is_empty() && want.iter().all(|w| !w.is_empty()),
        "expected series without labels: {want:?}"
    );
    let got = q.labels();
    if let Some(extra) = got.iter().find(|l| !want.iter().any(|w| matches(l, w))) {
        return Err(format!(
            "unexpected series {}",
            Value::Object(extra.clone())
        ));
    }
    if let Some(missing) = want.iter().find(|w| !got.iter().any(|l| matches(l, w))) {
        return Err(format!("no series with {missing:?}"));
    }
    Ok(())
}

// ------------------------------------------------------------------ report

struct Row {
    kind: &'static str,
    name: String,
    /// Result counts per pass ("all", "sel"); one entry for rules.
    counts: Vec<usize>,
    expr: String,
    problem: Option<String>,
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "\nResult counts. panel: all = variables at \"All\", sel = a selection (one instance, \
         gpu 0|1, namespace team-a, pod trainer-0|notebook). record: all = its expression, \
         sel = the recorded series. alert: all = now; alert+: sel = evaluated ahead; \
         alert-: sel = metric names selected, each checked to have series.\n\
         \n  ok  all  sel  kind    name: expr (Grafana variables as written)\n",
    );
    for r in rows {
        let c = |i: usize| {
            r.counts
                .get(i)
                .map(|n| n.to_string())
                .unwrap_or_else(|| "-".into())
        };
        let expr = if r.expr.is_empty() {
            String::new()
        } else {
            format!(": {}", one_line(&r.expr))
        };
        out.push_str(&format!(
            "{:>4} {:>4} {:>4}  {:<6}  {}{expr}\n",
            if r.problem.is_none() { "ok" } else { "FAIL" },
            c(0),
            c(1),
            r.kind,
            r.name,
        ));
        if let Some(p) = &r.problem {
            out.push_str(&format!("                      -> {p}\n"));
        }
    }
    out
}

// ------------------------------------------------------------------ the test

/// The dashboard's variables as Grafana substitutes them: at "All", and at
/// a selection (one instance, gpu 0|1, namespace team-a, pod
/// trainer-0|notebook, job 4242).
fn variables(t: &Targets) -> [Vec<(&'static str, String)>; 2] {
    let all = vec![
        ("instance", ".*".to_string()),
        ("gpu", ".*".to_string()),
        ("namespace", ".*".to_string()),
        ("pod", ".*".to_string()),
        ("slurm_job", ".*".to_string()),
        ("__rate_interval", RATE_INTERVAL.to_string()),
    ];
    let selected = vec![
        ("instance", grafana_regex(&[&t.main])),
        ("gpu", grafana_regex(&["0", "1"])),
        ("namespace", grafana_regex(&["team-a"])),
        ("pod", grafana_regex(&["trainer-0", "notebook"])),
        ("slurm_job", grafana_regex(&["4242"])),
        ("__rate_interval", RATE_INTERVAL.to_string()),
    ];
    [all, selected]
}

struct Checks<'a> {
    /// Prometheus, or VictoriaMetrics with vmalert: the same checks.
    prom: &'a dyn QueryApi,
    targets: &'a Targets,
    /// Exporter metric families, as Prometheus names their series.
    families: Vec<String>,
    /// Series counts by metric name, per round.
    counts: BTreeMap<String, usize>,
    /// How old the newest samples a rule evaluation sees may be: 0 for
    /// Prometheus (its rules read its own head); for vmalert, the
    /// VictoriaMetrics `-search.latencyOffset` (1 s) and a scrape interval.
    record_lag: f64,
}

impl Checks<'_> {
    /// Run a query that must parse: a parse error never heals, so it fails
    /// the test at once.
    fn query(&self, what: &str, expr: &str, at: Option<f64>) -> QueryResult {
        let q = match at {
            Some(t) => self.prom.query_at(expr, t),
            None => self.prom.query(expr),
        };
        assert!(
            q.ok(),
            "{what}: {} rejects\n    {expr}\n{}",
            self.prom.name(),
            q.error.as_deref().unwrap_or("(no error text)")
        );
        q
    }

    /// Whether each stored value (`stored`, sorted) of a record evaluated
    /// at `t` lies between the values its expression gives at instants
    /// within `record_lag` before `t`: what a rule engine that saw samples
    /// up to that old would have recorded.
    fn within_lag(&self, what: &str, expr: &str, t: f64, stored: &[f64]) -> bool {
        if self.record_lag <= 0.0 {
            return false;
        }
        let answers: Vec<Vec<f64>> = (0..=8)
            .map(|i| {
                sorted(
                    self.query(what, expr, Some(t - self.record_lag * i as f64 / 8.0))
                        .values(),
                )
            })
            .collect();
        stored.iter().enumerate().all(|(i, v)| {
            let at_i: Vec<f64> = answers.iter().filter_map(|a| a.get(i).copied()).collect();
            let lo = at_i.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = at_i.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            at_i.len() == answers.len() && lo - 1e-9 * lo.abs() <= *v && *v <= hi + 1e-9 * hi.abs()
        })
    }

    fn count_of(&mut self, name: &str) -> usize {
        if let Some(n) = self.counts.get(name) {
            return *n;
        }
        let n = self.prom.series_count(name);
        self.counts.insert(name.to_string(), n);
        n
    }

    /// Metric names the expression selects that have no series.
    fn missing_selectors(&mut self, expr: &str) -> Vec<String> {
        metric_names(expr)
            .into_iter()
            .filter(|n| self.count_of(n) == 0)
            .collect()
    }

    fn round(&mut self) -> Vec<Row> {
        self.counts.clear();
        let t = self.targets;
        let mut rows = Vec::new();

        // Every panel query, with the variables at "All" and at a selection.
        let [all, selected] = variables(t);
        for (title, ref_id, expr) in dashboard_queries() {
            let mut counts = Vec::new();
            let mut problem = None;
            for (pass, vars) in [("all", &all), ("sel", &selected)] {
                let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
                let e = grafana_substitute(&expr, &vars);
                assert!(
                    !e.contains('$'),
                    "panel {title}: a variable is left after substitution: {e}"
                );
                let q = self.query(&format!("panel {title} ({pass})"), &e, None);
                counts.push(q.result.len());
                if q.result.is_empty() && problem.is_none() {
                    problem = Some(format!("no data with the variables at \"{pass}\""));
                }
            }
            let missing = self.missing_selectors(&grafana_substitute(
                &expr,
                &[("__rate_interval", RATE_INTERVAL)],
            ));
            if !missing.is_empty() && problem.is_none() {
                problem = Some(format!("no series named {missing:?}"));
            }
            rows.push(Row {
                kind: "panel",
                name: format!("{title} [{ref_id}]"),
                counts,
                expr,
                problem,
            });
        }

        // Every rule.
        for rule in rules() {
            let name = rule
                .alert
                .clone()
                .or(rule.record.clone())
                .expect("a rule is an alert or a record");
            let q = self.query(&name, &rule.expr, None);
            let missing = self.missing_selectors(&rule.expr);
            let mut problem = (!missing.is_empty()).then(|| format!("no series named {missing:?}"));
            let mut counts = vec![q.result.len()];
            if let Some(record) = &rule.record {
                if q.result.is_empty() {
                    problem.get_or_insert("no data".into());
                }
                // The recorded series itself, written by Prometheus's rule
                // evaluation.
                let stored = self.query(record, record, None);
                counts.push(stored.result.len());
                if stored.result.is_empty() {
                    problem.get_or_insert(format!("the recorded series {record} does not exist"));
                } else if sorted(stored.values()) != sorted(q.values()) {
                    // A record that moves with every scrape (a deriv):
                    // compare with its expression at the time the stored
                    // samples were evaluated. (An instant query's series
                    // come in no fixed order.)
                    let at = self
                        .query(record, &format!("max(timestamp({record}))"), None)
                        .values()
                        .first()
                        .copied();
                    let then = at.map(|t| self.query(&name, &rule.expr, Some(t)).values());
                    if then.map(sorted) != Some(sorted(stored.values()))
                        && !at.is_some_and(|t| {
                            self.within_lag(&name, &rule.expr, t, &sorted(stored.values()))
                        })
                    {
                        problem.get_or_insert(format!(
                            "{record} stored {:?}, its expression gives {:?}",
                            stored.values(),
                            q.values()
                        ));
                    }
                }
                rows.push(Row {
                    kind: "record",
                    name,
                    counts,
                    expr: rule.expr,
                    problem,
                });
                continue;
            }
            let (kind, shown) = match expectation(&name, t) {
                Expect::Now(want) => {
                    if let Err(e) = check_series(&q, &want) {
                        problem.get_or_insert(e);
                    }
                    ("alert", name)
                }
                Expect::Ahead(secs, want) => {
                    let ahead = self.query(&name, &rule.expr, Some(unix_now() + secs));
                    counts.push(ahead.result.len());
                    if let Err(e) = check_series(&ahead, &want) {
                        problem.get_or_insert(format!("{secs} s ahead: {e}"));
                    }
                    ("alert+", name)
                }
                Expect::SelectorsOnly(why) => {
                    let names: Vec<String> = metric_names(&rule.expr)
                        .into_iter()
                        .map(|n| format!("{n}={}", self.count_of(&n)))
                        .collect();
                    if names.is_empty() {
                        problem.get_or_insert("selects no metric to check".into());
                    }
                    counts.push(names.len());
                    let shown = format!("{name} ({why}; series per selector: {})", names.join(" "));
                    ("alert-", shown)
                }
            };
            rows.push(Row {
                kind,
                name: shown,
                counts,
                expr: rule.expr,
                problem,
            });
        }

        // Prometheus's own rule evaluation: every rule healthy, and the
        // alerts that are true now are pending (their `for:` is minutes).
        let api = self.prom.rules_api("/api/v1/rules");
        let evaluated: Vec<&Value> = api["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().into_iter().flatten())
            .collect();
        let unhealthy: Vec<String> = evaluated
            .iter()
            .filter(|r| r["health"] != "ok")
            .map(|r| format!("{} ({}: {})", r["name"], r["health"], r["lastError"]))
            .collect();
        rows.push(Row {
            kind: "api",
            name: "/api/v1/rules: every rule evaluated without error".into(),
            counts: vec![evaluated.len()],
            expr: String::new(),
            problem: if evaluated.len() != rules().len() {
                Some(format!(
                    "{} rules loaded, rules.yml has {}",
                    evaluated.len(),
                    rules().len()
                ))
            } else if !unhealthy.is_empty() {
                Some(format!("not ok: {unhealthy:?}"))
            } else {
                None
            },
        });
        let active: BTreeSet<String> = self.prom.rules_api("/api/v1/alerts")["data"]["alerts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a["labels"]["alertname"].as_str().map(str::to_string))
            .collect();
        let want: BTreeSet<String> = rules()
            .iter()
            .filter_map(|r| r.alert.clone())
            .filter(|a| matches!(expectation(a, t), Expect::Now(_)))
            .collect();
        assert!(!want.is_empty(), "no alert is expected to be active");
        let not_active: Vec<&String> = want.difference(&active).collect();
        rows.push(Row {
            kind: "api",
            name: format!("/api/v1/alerts: pending or firing {want:?}"),
            counts: vec![active.len()],
            expr: String::new(),
            problem: (!not_active.is_empty()).then(|| format!("not active: {not_active:?}")),
        });

        // Every metric family the exporter declares reached Prometheus.
        let families = self.families.clone();
        let missing: Vec<String> = families
            .iter()
            .filter(|f| self.count_of(f) == 0)
            .cloned()
            .collect();
        rows.push(Row {
            kind: "scrape",
            name: format!(
                "every metric family of the exporter has series ({} families)",
                families.len()
            ),
            counts: vec![families.len() - missing.len()],
            expr: String::new(),
            problem: (!missing.is_empty()).then(|| format!("no series: {missing:?}")),
        });

        // The top-processes table keeps the pid="other" rollup (no
        // gpu_process_info) and joins the user of the others.
        let (title, _, expr) = dashboard_queries()
            .into_iter()
            .find(|(title, _, _)| title == "Top processes by GPU memory")
            .expect("the top-processes table");
        let vars: Vec<(&str, &str)> = all.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let q = self.query(&title, &grafana_substitute(&expr, &vars), None);
        let rows_of = |pid: &str| {
            q.labels()
                .into_iter()
                .filter(|l| l.get("pid").and_then(Value::as_str) == Some(pid))
                .collect::<Vec<_>>()
        };
        let other = rows_of("other");
        let trainer = rows_of(&t.trainer);
        let problem = if other.len() != 1 {
            Some(format!("{} rows with pid=\"other\"", other.len()))
        } else if trainer.len() != 1
            || trainer[0].get("user").and_then(Value::as_str) != Some("alice")
            || trainer[0].get("pod").and_then(Value::as_str) != Some("trainer-0")
        {
            Some(format!("pid {} (trainer): {trainer:?}", t.trainer))
        } else {
            None
        };
        rows.push(Row {
            kind: "table",
            name: "top processes: pid=\"other\" kept, the trainer with user alice, pod trainer-0"
                .into(),
            counts: vec![q.result.len()],
            expr: String::new(),
            problem,
        });

        // "Allocated GPUs and their memory": each allocated device with the
        // bytes its pod (or Slurm job) holds on it and how many processes:
        // the trainer's replica of GPU 0, the notebook's MIG instance 1,
        // and its idle instance 2 at 0 bytes and 0 processes; job 4242's
        // GPU 0 and job 4243's idle MIG instance 1.
        let mut got = BTreeMap::new();
        for (title, ref_id, expr) in dashboard_queries() {
            if title != ALLOCATED {
                continue;
            }
            let q = self.query(&title, &grafana_substitute(&expr, &vars), None);
            for series in &q.result {
                let m = &series["metric"];
                let key = format!(
                    "{}{}/{} {}",
                    m["pod"].as_str().unwrap_or(""),
                    m["slurm_job"].as_str().unwrap_or(""),
                    m["mig_uuid"].as_str().unwrap_or(""),
                    ref_id
                );
                let v = series["value"][1]
                    .as_str()
                    .and_then(|v| v.parse::<f64>().ok());
                got.insert(key, v);
            }
        }
        let want: BTreeMap<String, Option<f64>> = [
            ("trainer-0/ A", TRAINER_USED as f64),
            ("trainer-0/ B", 1.0),
            // Grown since the start (checked below, then set to its start).
            ("infer-7f9c/ A", INFER_USED as f64),
            ("infer-7f9c/ B", 1.0),
            (&format!("notebook/{MIG1} A") as &str, 5_000_000_000.0),
            (&format!("notebook/{MIG1} B"), 1.0),
            (&format!("notebook/{MIG2} A"), 0.0),
            (&format!("notebook/{MIG2} B"), 0.0),
            ("batch-idle/ A", 0.0),
            ("batch-idle/ B", 0.0),
            // Slurm: job 4242 holds GPU 0 and runs 4105 there; job 4243
            // holds MIG instance 1 and runs nothing.
            ("4242/ A", 5_000_000_000.0),
            ("4242/ B", 1.0),
            (&format!("4243/{MIG1} A"), 0.0),
            (&format!("4243/{MIG1} B"), 0.0),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), Some(v)))
        .collect();
        // The inference server grows INFER_GROWTH from the start: its
        // bytes, within what a test's minutes add, count as its start.
        if let Some(Some(v)) = got.get_mut("infer-7f9c/ A")
            && (INFER_USED as f64..INFER_USED as f64 + INFER_GROWTH * 900.0).contains(v)
        {
            *v = INFER_USED as f64;
        }
        rows.push(Row {
            kind: "table",
            name: format!("{ALLOCATED}: bytes (A) and processes (B) per allocated device"),
            counts: vec![got.len()],
            expr: String::new(),
            problem: (got != want).then(|| format!("got {got:?}, want {want:?}")),
        });

        // "Who used it, who wasted it": the day's sums say who is idle and
        // who is not. team-b's batch pod and job 4243 hold devices they
        // never run on; so does team-a's notebook, on its MIG instance 2
        // (its process runs on instance 1); team-a's trainer and job 4242
        // run on all of theirs; bob's render job is charged to him.
        let day = |rule: &str, label: &str, value: &str| {
            self.query(rule, &format!("{rule}{{{label}=\"{value}\"}}"), None)
                .values()
                .first()
                .copied()
        };
        let idle = "namespace:gpu_allocation_idle_hours:increase1d";
        let job_idle = "slurm_job:gpu_allocation_idle_hours:increase1d";
        let got = [
            ("team-b idle", day(idle, "namespace", "team-b")),
            ("team-a idle", day(idle, "namespace", "team-a")),
            (
                "trainer-0 idle",
                self.query(
                    "raw",
                    "sum(gpu_allocation_idle_seconds_total{pod=\"trainer-0\"})",
                    None,
                )
                .values()
                .first()
                .copied(),
            ),
            ("job 4243 idle", day(job_idle, "slurm_job", "4243")),
            ("job 4242 idle", day(job_idle, "slurm_job", "4242")),
            (
                "bob's memory",
                day(
                    "user:gpu_workload_memory_used_gib_hours:increase1d",
                    "user",
                    "bob",
                ),
            ),
            (
                "team-a busy",
                day(
                    "namespace:gpu_workload_busy_hours:increase1d",
                    "namespace",
                    "team-a",
                ),
            ),
        ];
        let want_positive = [true, true, false, true, false, true, true];
        let right = got
            .iter()
            .zip(want_positive)
            .all(|((_, v), pos)| v.is_some_and(|v| if pos { v > 0.0 } else { v == 0.0 }));
        rows.push(Row {
            kind: "record",
            name: "accounting: idle hours for team-b, team-a's notebook and job 4243 only; bob's memory and team-a's busy hours counted".into(),
            counts: vec![got.iter().filter(|(_, v)| v.is_some()).count()],
            expr: String::new(),
            problem: (!right).then(|| format!("got {got:?}")),
        });

        // "Real or cache?" splits the trainer's NVML figure into torch's
        // allocated, cached and non-torch parts: the stub's figures, which
        // add up to NVML's.
        let want = [
            ("A", "allocated", TORCH_ALLOCATED),
            ("B", "cached", TORCH_RESERVED - TORCH_ALLOCATED),
            ("C", "non-torch", TRAINER_USED - TORCH_RESERVED),
        ];
        let mut got = Vec::new();
        for (title, ref_id, expr) in dashboard_queries() {
            if title != REAL_OR_CACHE {
                continue;
            }
            let q = self.query(&title, &grafana_substitute(&expr, &vars), None);
            let value = q
                .result
                .iter()
                .find(|s| s["metric"]["pid"].as_str() == Some(t.trainer.as_str()))
                .and_then(|s| s["value"][1].as_str())
                .and_then(|v| v.parse::<f64>().ok());
            got.push((ref_id, value));
        }
        // Reserved creeps up (RESERVED_CREEP): cached (B) may be up to
        // CREEP_SLACK more, non-torch (C) as much less.
        let close = want.iter().zip(&got).all(|((r, _, v), (g_ref, g))| {
            let d = g.map(|g| g - *v as f64);
            *r == *g_ref
                && d.is_some_and(|d| match *r {
                    "B" => (0.0..=CREEP_SLACK).contains(&d),
                    "C" => (-CREEP_SLACK..=0.0).contains(&d),
                    _ => d == 0.0,
                })
        });
        rows.push(Row {
            kind: "stack",
            name: format!(
                "{REAL_OR_CACHE}: the trainer's {} add up to NVML's {TRAINER_USED}",
                want.map(|(r, what, v)| format!("{r} {what} {v}"))
                    .join(", ")
            ),
            counts: vec![got.iter().filter(|(_, v)| v.is_some()).count()],
            expr: String::new(),
            problem: (!close || got.len() != want.len()).then(|| format!("got {got:?}")),
        });
        rows
    }
}

/// What both Prometheus tests scrape: a hung exporter whose sample ages,
/// and the main one on a fake node (pods, a kubelet, MIG, a torch process,
/// GPU 2 lost from the start, every collector), started and ready: pod names
/// and the trainer's torch figures are served. Everything stops on drop.
pub(super) struct World {
    pub(super) stale: Exporter,
    pub(super) main: Exporter,
    pub(super) trainer: Trainer,
    pub(super) scenario: Scenario,
    /// When GPU 0's ramp started (unix seconds), for every rewrite.
    ramp_start: f64,
    /// Rewrites `scenario` every 2 s once started ([`World::start_rewriting`]).
    rewriter: std::sync::Mutex<Option<(Arc<AtomicBool>, JoinHandle<()>)>>,
    _stale_scenario: Scenario,
    node: FakeNode,
    _kubelet: FakeKubelet,
}

impl World {
    pub(super) fn start() -> World {
        // The hung exporter first: its served sample starts ageing at once.
        let stale_scn = Scenario::new(&stale_scenario(0));
        let stale = Exporter::with_config(
            &stale_scn,
            "kubernetes:\n  enabled: false\nprocesses:\n  enabled: false\n",
            &["--sample-interval", "1s"],
        );
        stale_scn.write(&stale_scenario(60_000));

        // The Kubernetes API, the kubelet and the fake /proc root of the
        // main exporter.
        let node = FakeNode::start(limited_team_pods());
        let kubelet = FakeKubelet::start(kubelet_pods());
        let trainer = Trainer::start();
        fake_proc(node.proc_root.path(), trainer.py.pid);

        // GPU 2 is lost from the start (fell off the bus before the
        // exporter started): the exporter serves the two others at once and
        // GPU 2 as gpu_up 0 with no uuid, so every panel has data and
        // GpuDown is pending.
        let ramp_start = unix_now().floor();
        let scenario = Scenario::new(&main_scenario(trainer.py.pid, 1, GPU1_LEVEL, ramp_start));
        let config = node.config_with(
            &scenario,
            "  min_bytes: 1000000000\n  top_n: 4\n  idle_after: 20s\n",
            &format!(
                "  pod_resources_socket: {}\n  pod_resources_interval: 1s\n",
                kubelet.socket.display()
            ),
        ) + &format!(
            "collectors:\n  process_utilization: true\n  gpm: true\nslurm:\n  job_mapping_dir: {}\n  job_mapping_interval: 1s\n",
            scenario.dir.path().join("slurm-jobs").display()
        );
        job_mapping(&scenario.dir.path().join("slurm-jobs"));
        let main = Exporter::with_config(&scenario, &config, &[]);
        let pid = trainer.py.pid.to_string();
        wait_for(
            Duration::from_secs(10),
            "pod names and the trainer's torch figures (gpu_process_torch_*) on the main exporter",
            || {
                let m = main.metrics();
                let torch = m.find(
                    "gpu_process_torch_allocated_bytes",
                    &[("pid", pid.as_str()), ("pod", "trainer-0")],
                );
                (pods_resolved(&m, &["trainer-0", "notebook"])
                    && m.find("gpu_allocation_info", &[("slurm_job", "4243")])
                        .len()
                        == 1
                    && m.find("gpu_process_memory_used_bytes", &[("slurm_job", "4242")])
                        .len()
                        == 1
                    && torch.len() == 1
                    && torch[0].1 == TORCH_ALLOCATED as f64)
                    .then_some(())
            },
        );
        World {
            stale,
            main,
            trainer,
            scenario,
            ramp_start,
            rewriter: std::sync::Mutex::new(None),
            _stale_scenario: stale_scn,
            node,
            _kubelet: kubelet,
        }
    }
}

impl World {
    /// Start rewriting the main scenario, once Prometheus scrapes: a
    /// critical Xid every 2 s on GPU 0, so its counter grows while
    /// Prometheus watches (GpuXidCritical's increase() branch); GPU 1 spikes for 300 ms
    /// at the second rewrite (4 s in: rule evaluation has begun) and its
    /// level rises at the fourth, after several evaluations have recorded
    /// the spike over the old level (GpuMemorySpikeWouldNotFit). First,
    /// job 4242's slurmstepd dies: its step (4105) goes to init.
    pub(super) fn start_rewriting(&self) {
        write_stat(self.node.proc_root.path(), 4105, "python3", 'S', 1);
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, path, pid, ramp_start) = (
            Arc::clone(&stop),
            self.scenario.path.clone(),
            self.trainer.py.pid,
            self.ramp_start,
        );
        let ticker = std::thread::spawn(move || {
            let write = |n: usize, gpu1: u64| {
                let tmp = path.with_extension("xid.tmp");
                std::fs::write(&tmp, main_scenario(pid, n, gpu1, ramp_start)).unwrap();
                std::fs::rename(&tmp, &path).unwrap();
            };
            let mut n = 1;
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_secs(2));
                n += 1;
                if n == 3 {
                    write(n, GPU1_SPIKE);
                    std::thread::sleep(Duration::from_millis(300));
                }
                write(n, if n >= 5 { GPU1_RISEN } else { GPU1_LEVEL });
            }
        });
        *self.rewriter.lock().unwrap() = Some((stop, ticker));
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let taken = self.rewriter.lock().map(|mut r| r.take()).unwrap_or(None);
        if let Some((stop, ticker)) = taken {
            stop.store(true, Ordering::Relaxed);
            let _ = ticker.join();
        }
    }
}

#[test]
fn every_dashboard_query_and_rule_works_in_a_real_prometheus() {
    let started = Instant::now();
    prometheus_binary();

    let world = World::start();
    let (stale, trainer, main) = (&world.stale, &world.trainer, &world.main);

    // The exporter's metric families, as Prometheus names their series.
    let families: Vec<String> = main
        .get("/metrics")
        .body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let mut it = l.split_whitespace();
            let (name, kind) = (it.next().unwrap(), it.next().unwrap_or(""));
            if kind == "histogram" {
                format!("{name}_bucket")
            } else {
                name.to_string()
            }
        })
        .collect();
    assert!(
        !families.is_empty(),
        "the exporter declares no metric family"
    );

    // A target that accepts connections and never answers: up 0.
    let down_socket = TcpListener::bind("127.0.0.1:0").unwrap();
    let targets = Targets {
        main: main.addr.to_string(),
        stale: stale.addr.to_string(),
        down: down_socket.local_addr().unwrap().to_string(),
        trainer: trainer.py.pid.to_string(),
    };
    // VictoriaMetrics gets every sample Prometheus scrapes, by remote
    // write, and vmalert evaluates the same rules there.
    let vm = VmStack::start("1s");
    let config = config_with_rules(&[(
        &[
            targets.main.clone(),
            targets.stale.clone(),
            targets.down.clone(),
        ],
        None,
    )]) + &vm.remote_write_to();
    let prom = Prometheus::start(&config);
    // The scenario's changes (GPU 1's spike among them) only once
    // Prometheus's remote write has begun to reach VictoriaMetrics (it
    // starts seconds after the first scrape), so vmalert sees them too.
    let main_used = format!("gpu_memory_used_bytes{{instance=\"{}\"}}", targets.main);
    wait_for(
        Duration::from_secs(30),
        "the main exporter's samples in VictoriaMetrics",
        || (!QueryApi::query(&vm, &main_used).result.is_empty()).then_some(()),
    );
    let ready_at = Instant::now();
    world.start_rewriting();

    for server in [&prom as &dyn QueryApi, &vm] {
        let mut checks = Checks {
            prom: server,
            targets: &targets,
            families: families.clone(),
            counts: BTreeMap::new(),
            record_lag: if std::ptr::addr_eq(server, &prom) {
                0.0
            } else {
                2.0
            },
        };
        let rows = loop {
            let rows = checks.round();
            assert!(!rows.is_empty(), "no checks");
            if rows.iter().all(|r| r.problem.is_none()) {
                break rows;
            }
            if ready_at.elapsed() > DEADLINE {
                let failed: Vec<String> = rows
                    .iter()
                    .filter_map(|r| r.problem.as_ref().map(|p| format!("{}: {p}", r.name)))
                    .collect();
                panic!(
                    "{}: not all queries return what the scenario shows after {DEADLINE:?}:{}\n{}\n\
                     log:\n{}\nmain exporter log:\n{}",
                    server.name(),
                    table(&rows),
                    failed.join("\n"),
                    server.log(),
                    main.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        };
        // Shown even when the test passes (the harness captures only print!).
        let _ = writeln!(
            std::io::stderr(),
            "{}: {}\n{} queries and checks passed; exporters and Prometheus up {:.1?} after the start, data complete {:.1?} later",
            server.name(),
            table(&rows),
            rows.len(),
            ready_at.duration_since(started),
            ready_at.elapsed()
        );
    }
    victoria::same_answers(&prom, &vm, &targets);
    drop(world);
    drop(down_socket);
}

#[test]
fn metric_names_skips_functions_keywords_labels_and_durations() {
    let names = |e: &str| metric_names(e).into_iter().collect::<Vec<_>>();
    assert_eq!(
        names(
            "gpu_memory_used_bytes / (gpu_memory_total_bytes > 0) > on() group_left() gpumem:memory_high_threshold:ratio"
        ),
        [
            "gpu_memory_total_bytes",
            "gpu_memory_used_bytes",
            "gpumem:memory_high_threshold:ratio"
        ]
    );
    assert_eq!(
        names(
            "predict_linear(gpu_memory_free_bytes[30m], 600) < 0 and gpu_memory_free_bytes < gpu_memory_free_bytes offset 5m"
        ),
        ["gpu_memory_free_bytes"]
    );
    assert_eq!(
        names(
            "label_replace(sum by (namespace, pod) (x{pod=~\"a|b\", namespace!=\"\"}), \"pod\", \"(none)\", \"pod\", \"\")"
        ),
        ["x"]
    );
    assert_eq!(
        names(
            "histogram_quantile(0.99, sum by (instance, le) (rate(h_bucket{instance=~\".*\"}[10s]))) or vector(0) unless time() - up{job=\"j\"} == 0"
        ),
        ["h_bucket", "up"]
    );
    assert_eq!(
        names("sum by (namespace) (a) + count without (pid) (b) + max(c)"),
        ["a", "b", "c"]
    );
    assert_eq!(
        names("topk(20, a * on(instance, gpu, pid) group_left(user) b or on(pid) c)"),
        ["a", "b", "c"]
    );
}

#[test]
fn grafana_variables_are_substituted_like_grafana() {
    assert_eq!(
        grafana_substitute(
            "rate(x{instance=~\"$instance\", pod=~\"${pod}\"}[$__rate_interval])",
            &[
                ("instance", &grafana_regex(&["127.0.0.1:9877"])),
                ("pod", &grafana_regex(&["a", "b"])),
                ("__rate_interval", "10s"),
            ]
        ),
        "rate(x{instance=~\"127\\\\.0\\\\.0\\\\.1:9877\", pod=~\"(a|b)\"}[10s])"
    );
}

// ------------------------------------------- unified memory (Grace-era)
//
// Apart from the world above: one exporter with a GB10-like GPU (memory
// NOT_SUPPORTED, figures from the fake meminfo) beside an H200, scraped by
// a real Prometheus with the shipped rules.

#[test]
fn a_unified_memory_gpu_raises_no_alert_in_a_real_prometheus() {
    use crate::discovery::unified_memory::{GB10, meminfo, scenario, write_meminfo};
    prometheus_binary();
    let sc = Scenario::new(&scenario());
    let root = write_meminfo(&sc, &meminfo(128_452_000, 112_233_444));
    let ex = Exporter::start(&sc, &["--sample-interval", "200ms", "--path.procfs", &root]);
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\n\
         scrape_configs:\n  - job_name: gpumem-exporter\n    static_configs:\n      - targets: ['{}']\n",
        rules_at_global_interval().display(),
        ex.addr
    );
    let prom = Prometheus::start(&config);
    let used = (128_452_000u64 - 112_233_444) * 1024;
    let stored = format!("gpu_memory_used_bytes{{uuid=\"{GB10}\"}}");
    wait_for(
        Duration::from_secs(30),
        "the GB10's memory in Prometheus",
        || (prom.query(&stored).values() == vec![used as f64]).then_some(()),
    );
    // Several evaluations of every rule over that data, then: nothing
    // firing or pending for the GPU, and no NVML errors to alert on.
    std::thread::sleep(Duration::from_secs(4));
    let rules = prom.api("/api/v1/rules");
    for g in rules["data"]["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            assert_eq!(r["health"], "ok", "{r}");
        }
    }
    let alerts = prom.api("/api/v1/alerts");
    let alerts = alerts["data"]["alerts"].as_array().unwrap();
    let about: Vec<&Value> = alerts
        .iter()
        .filter(|a| a["labels"]["uuid"] == GB10 || a["labels"]["alertname"] == "NvmlErrorsRising")
        .collect();
    assert!(
        about.is_empty(),
        "alerts for the unified-memory GPU: {about:?}"
    );
    assert!(
        prom.query("gpumem_exporter_nvml_errors_total")
            .values()
            .is_empty(),
        "NVML errors stored"
    );
    assert_eq!(
        prom.query(&format!("gpu_info{{uuid=\"{GB10}\", memory=\"unified\"}}"))
            .values(),
        vec![1.0]
    );
}
