//! End-to-end attribution: the real binary on the fake NVML, a fake /proc
//! root (`--path.procfs`) laid out like the kernel's, and a local HTTP
//! server speaking the Kubernetes list/watch wire format.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::harness::cluster::{
    self, FakeNode, cgroup_containerd, cgroup_crio, cgroup_v1, container_id as cid, pod_uid as uid,
    pods_resolved, team_pods,
};
use crate::harness::*;

const GPU: &str = "GPU-dddddddd-0000-0000-0000-000000000000";

/// A process in the fake /proc root.
struct FakeProc {
    pid: u32,
    comm: &'static str,
    uid: u32,
    cgroup: String,
    cmdline: &'static [&'static str],
}

/// The processes of the three pods of [`team_pods`] time-sharing one GPU,
/// each pod with a different runtime and cgroup layout, and their owners.
fn three_pods() -> Vec<FakeProc> {
    vec![
        FakeProc {
            pid: 4101,
            comm: "python3",
            uid: 1000,
            cgroup: cgroup_containerd('a'),
            cmdline: &["python3", "train.py", "--token", "s3cr3t", "--lr", "0.1"],
        },
        FakeProc {
            pid: 4102,
            comm: "tritonserver",
            uid: 1001,
            cgroup: cgroup_crio('b'),
            cmdline: &["tritonserver", "--model-repository=/models"],
        },
        FakeProc {
            pid: 4103,
            comm: "jupyter",
            uid: 4242,
            cgroup: cgroup_v1('c'),
            cmdline: &["jupyter", "lab", "API_KEY=abc"],
        },
    ]
}

struct World {
    node: FakeNode,
    scenario: Scenario,
}

fn scenario_yaml(procs: &[(u32, u64)]) -> String {
    let mut y = format!(
        "devices:\n  - uuid: {GPU}\n    memory: {{total: 85899345920, reserved: 536870912, used: 30000000000}}\n    processes:\n"
    );
    for (pid, used) in procs {
        y.push_str(&format!("      - {{pid: {pid}, used: {used}}}\n"));
    }
    if procs.is_empty() {
        y = y.replace("    processes:\n", "    processes: []\n");
    }
    y
}

fn world(procs: &[FakeProc]) -> World {
    let node = FakeNode::start(team_pods());
    for p in procs {
        cluster::write_proc(
            node.proc_root.path(),
            p.pid,
            p.comm,
            p.uid,
            &p.cgroup,
            p.cmdline,
        );
    }
    let scenario = Scenario::new(&scenario_yaml(
        &procs
            .iter()
            .map(|p| (p.pid, 1_000_000_000 * u64::from(p.pid - 4100)))
            .collect::<Vec<_>>(),
    ));
    World { node, scenario }
}

impl World {
    /// The exporter on this node; `processes`: more lines under
    /// `processes:`.
    fn start(&self, processes: &str) -> Exporter {
        let config = self.node.config(&self.scenario, processes);
        Exporter::with_config(&self.scenario, &config, &[])
    }
}

fn labels_of(m: &Metrics, name: &str, pid: &str) -> BTreeMap<String, String> {
    let found = m.find(name, &[("pid", pid)]);
    assert_eq!(found.len(), 1, "{name} pid {pid}:\n{}", m.text);
    found[0].0.clone()
}

#[test]
fn three_pods_sharing_a_gpu_get_their_own_series() {
    let procs = three_pods();
    let w = world(&procs);
    let ex = w.start("");
    // The watcher lists asynchronously: wait until names are resolved.
    let m = wait_for(Duration::from_secs(10), "pod names", || {
        let m = ex.metrics();
        pods_resolved(&m, &["notebook", "trainer-0", "infer-7f9c"]).then_some(m)
    });
    let want = [
        (
            "4101",
            "python3",
            "team-a",
            "trainer-0",
            "trainer",
            "alice",
            'a',
        ),
        (
            "4102",
            "tritonserver",
            "team-b",
            "infer-7f9c",
            "server",
            "bob",
            'b',
        ),
        (
            "4103", "jupyter", "team-a", "notebook", "jupyter", "4242", 'c',
        ),
    ];
    for (pid, comm, ns, pod, container, user, seed) in want {
        let l = labels_of(&m, "gpu_process_memory_used_bytes", pid);
        assert_eq!(
            (
                l["process"].as_str(),
                l["namespace"].as_str(),
                l["pod"].as_str(),
                l["container"].as_str()
            ),
            (comm, ns, pod, container),
            "pid {pid}"
        );
        assert_eq!(l["gpu"], "0");
        assert_eq!(l["uuid"], GPU);
        let info = labels_of(&m, "gpu_process_info", pid);
        assert_eq!(info["user"], user, "pid {pid}");
        assert_eq!(info["container_id"], cid(seed), "pid {pid}");
        assert_eq!(info["pod_uid"], uid(seed), "pid {pid}");
        assert!(
            !info.contains_key("cmdline"),
            "command lines are off by default"
        );
        let bytes = m.get_u64(
            "gpu_process_memory_used_bytes",
            &l.iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect::<Vec<_>>(),
        );
        assert_eq!(
            bytes,
            Some(1_000_000_000 * (pid.parse::<u64>().unwrap() - 4100))
        );
    }
    // The watcher asked only for this node's pods.
    let lists = w.node.api.state.lock().unwrap().lists.clone();
    assert!(!lists.is_empty(), "the watcher listed the pods");
    assert!(
        lists
            .iter()
            .all(|r| r.query.get("fieldSelector").map(String::as_str)
                == Some("spec.nodeName=gpu-node-1")),
        "{lists:?}"
    );
    assert_eq!(m.get("gpumem_exporter_kubernetes_synced", &[]), Some(1.0));
    assert_eq!(m.get("gpumem_exporter_kubernetes_pods", &[]), Some(3.0));
}

#[test]
fn deleted_pod_and_exited_process_leave_no_series() {
    let procs = three_pods();
    let mut w = world(&procs);
    let ex = w.start("");
    wait_for(Duration::from_secs(10), "infer pod resolved", || {
        pods_resolved(&ex.metrics(), &["infer-7f9c"]).then_some(())
    });
    // The pod is deleted from the API, its process leaves the GPU and /proc.
    w.node.delete("infer-7f9c");
    w.scenario.write(&scenario_yaml(&[
        (4101, 1_000_000_000),
        (4103, 3_000_000_000),
    ]));
    std::fs::remove_dir_all(w.node.proc_root.path().join("4102")).unwrap();
    let m = wait_for(Duration::from_secs(5), "pid 4102 gone", || {
        let m = ex.metrics();
        (m.find("gpu_process_memory_used_bytes", &[("pid", "4102")])
            .is_empty())
        .then_some(m)
    });
    // The pod's workload counters (`gpu_workload_*`) stay for their grace
    // after its last process (docs/metrics.md); every other series goes.
    let rest: String = m
        .text
        .lines()
        .filter(|l| !l.starts_with("gpu_workload_"))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(!rest.contains("infer-7f9c"), "{}", m.text);
    assert!(!rest.contains("pid=\"4102\""), "{}", m.text);
    assert!(!rest.contains(&cid('b')), "{}", m.text);
    wait_for(
        Duration::from_secs(5),
        "the watcher to drop the pod",
        || (ex.metrics().get("gpumem_exporter_kubernetes_pods", &[]) == Some(2.0)).then_some(()),
    );
    // The others are untouched.
    assert_eq!(
        m.find("gpu_process_memory_used_bytes", &[("pod", "trainer-0")])
            .len(),
        1
    );
}

#[test]
fn top_n_keeps_totals_equal_to_what_nvml_reported() {
    let w = world(&three_pods());
    let procs: Vec<(u32, u64)> = (0..10)
        .map(|i| (5000 + i, 1_000_000 * u64::from(i + 1)))
        .collect();
    let total: u64 = procs.iter().map(|p| p.1).sum();
    w.scenario.write(&scenario_yaml(&procs));
    let ex = w.start("  top_n: 3\n  min_bytes: 2000000\n");
    let m = ex.metrics();
    let series = m.find("gpu_process_memory_used_bytes", &[("gpu", "0")]);
    let pids: Vec<&str> = series.iter().map(|(l, _)| l["pid"].as_str()).collect();
    // The three largest and the rollup.
    assert_eq!(series.len(), 4, "{pids:?}");
    for pid in ["5009", "5008", "5007", "other"] {
        assert!(pids.contains(&pid), "{pid} in {pids:?}");
    }
    let sum: f64 = series.iter().map(|(_, v)| v).sum();
    assert_eq!(sum as u64, total, "sum of series equals what NVML reported");
    assert_eq!(
        m.get("gpu_processes_other", &[("gpu", "0"), ("uuid", GPU)]),
        Some(7.0)
    );
}

#[test]
fn hidden_pids_are_exported_by_pid_and_counted() {
    let w = world(&three_pods());
    w.scenario
        .write(&scenario_yaml(&[(4101, 1_000_000_000), (6000, 42)]));
    let ex = w.start("");
    let m = ex.metrics();
    let l = labels_of(&m, "gpu_process_memory_used_bytes", "6000");
    // Unknown name and pod: no such labels (an absent label is unknown).
    assert_eq!((l.get("process"), l.get("pod")), (None, None));
    assert!(
        m.get("gpumem_exporter_process_lookup_failures_total", &[])
            .unwrap()
            >= 1.0
    );
    ex.assert_logged_once("not visible in /proc");
}

#[test]
fn cmdline_only_when_enabled_and_redacted() {
    let w = world(&three_pods());
    let ex = w.start("  cmdline: true\n  cmdline_max_length: 64\n");
    let m = ex.metrics();
    let a = labels_of(&m, "gpu_process_info", "4101");
    assert_eq!(a["cmdline"], "python3 train.py --token <redacted> --lr 0.1");
    let c = labels_of(&m, "gpu_process_info", "4103");
    assert_eq!(c["cmdline"], "jupyter lab API_KEY=<redacted>");
    assert!(
        !m.text.contains("s3cr3t") && !m.text.contains("abc"),
        "{}",
        m.text
    );
}

/// Every command-line form that leaked verbatim into
/// `gpu_process_info{cmdline}` and the API when only secret-looking option
/// names were redacted, one process each: no secret in either.
#[test]
fn every_leaked_cmdline_form_is_redacted_in_metrics_and_api() {
    let forms: [&[&str]; 12] = [
        &["mysql", "-phunter2"],
        &["mysql", "-p", "hunter2"],
        &["openssl", "enc", "-pass", "pass:hunter2"],
        &["app", "--pass", "hunter2"],
        &["app", "--pwd=hunter2"],
        &["app", "--db-pass=hunter2"],
        &["app", "--private-key=hunter2"],
        &["app", "--key", "hunter2"],
        &["app", "--password", "-hunter2"],
        &["curl", "-H", "Authorization: Bearer hunter2"],
        &["curl", "https://h/x?token=hunter2&sig=hunter2"],
        &["app", r#"{"password":"hunter2"}"#],
    ];
    let procs: Vec<FakeProc> = forms
        .iter()
        .enumerate()
        .map(|(i, cmdline)| FakeProc {
            pid: 4101 + i as u32,
            comm: "app",
            uid: 1000,
            cgroup: cgroup_containerd('a'),
            cmdline,
        })
        .collect();
    let w = world(&procs);
    let ex = w.start("  cmdline: true\n  cmdline_max_length: 200\n");
    let m = wait_for(Duration::from_secs(10), "every process", || {
        let m = ex.metrics();
        (m.find("gpu_process_info", &[]).len() == forms.len()).then_some(m)
    });
    let api = ex.get("/api/v1/snapshot");
    assert_eq!(api.status, 200);
    for (i, form) in forms.iter().enumerate() {
        let info = labels_of(&m, "gpu_process_info", &(4101 + i).to_string());
        eprintln!("{form:?} -> {:?}", info["cmdline"]);
        assert!(info["cmdline"].contains("<redacted>"), "{form:?}: {info:?}");
    }
    assert!(!m.text.contains("hunter2"), "{}", m.text);
    assert!(!api.body.contains("hunter2"), "{}", api.body);
    assert!(api.body.contains("<redacted>"), "{}", api.body);
}

#[test]
fn mig_instances_and_their_processes() {
    let w = world(&[]);
    w.scenario.write(&format!(
        "devices:\n  - uuid: {GPU}\n    memory: {{total: 85899345920, reserved: 536870912, used: 20000000000}}\n    mig_devices:\n      - uuid: MIG-11111111-0000-0000-0000-000000000000\n        gpu_instance_id: 1\n        compute_instance_id: 0\n        memory: {{total: 20000000000, reserved: 0, used: 7000000000}}\n        processes: [{{pid: 7001, used: 6000000000}}]\n      - uuid: MIG-22222222-0000-0000-0000-000000000000\n        gpu_instance_id: 2\n        compute_instance_id: 0\n        memory: {{total: 20000000000, reserved: 0, used: 3000000000}}\n        processes: [{{pid: 7002, used: 2500000000}}]\n"
    ));
    let ex = w.start("");
    let m = ex.metrics();
    let a = labels_of(&m, "gpu_process_memory_used_bytes", "7001");
    let b = labels_of(&m, "gpu_process_memory_used_bytes", "7002");
    assert_eq!(
        (
            a["gpu_instance_id"].as_str(),
            a["compute_instance_id"].as_str()
        ),
        ("1", "0")
    );
    assert_eq!(
        (
            b["gpu_instance_id"].as_str(),
            b["compute_instance_id"].as_str()
        ),
        ("2", "0")
    );
    assert_eq!((a["gpu"].as_str(), a["uuid"].as_str()), ("0", GPU));
    let inst = |gi: &'static str| {
        [
            ("gpu", "0"),
            ("uuid", GPU),
            ("gpu_instance_id", gi),
            ("compute_instance_id", "0"),
        ]
    };
    assert_eq!(
        m.get_u64("gpu_mig_memory_used_bytes", &inst("1")),
        Some(7_000_000_000)
    );
    assert_eq!(
        m.get_u64("gpu_mig_memory_used_bytes", &inst("2")),
        Some(3_000_000_000)
    );
    assert_eq!(
        m.get_u64("gpu_mig_memory_total_bytes", &inst("2")),
        Some(20_000_000_000)
    );
    assert_eq!(
        m.find(
            "gpu_mig_info",
            &[
                ("mig_uuid", "MIG-22222222-0000-0000-0000-000000000000"),
                ("gpu_instance_id", "2")
            ]
        )
        .len(),
        1
    );
}

#[test]
fn mps_clients_appear_with_their_own_pid_and_pod() {
    let procs = three_pods();
    let w = world(&procs);
    w.scenario.write(&format!(
        "devices:\n  - uuid: {GPU}\n    memory: {{total: 85899345920, reserved: 536870912, used: 3000000000}}\n    processes:\n      - {{pid: 4101, used: 1000000000, type: mps}}\n      - {{pid: 4102, used: 2000000000, type: mps}}\n"
    ));
    let ex = w.start("");
    let m = wait_for(Duration::from_secs(10), "MPS clients with pods", || {
        let m = ex.metrics();
        pods_resolved(&m, &["infer-7f9c", "trainer-0"]).then_some(m)
    });
    assert_eq!(
        labels_of(&m, "gpu_process_memory_used_bytes", "4101")["namespace"],
        "team-a"
    );
    assert_eq!(
        labels_of(&m, "gpu_process_memory_used_bytes", "4102")["namespace"],
        "team-b"
    );
}

// ------------------------------------------------------------------ client config

/// The exporter on `w`'s node with `kubernetes` (lines under
/// `kubernetes:`) and `env`, the pod-resources client off.
fn start_with_env(w: &World, kubernetes: &str, env: &[(&str, String)]) -> Exporter {
    let config = format!(
        "{}kubernetes:\n  pod_resources_socket: \"\"\n{kubernetes}",
        w.node.base_config(&w.scenario, "")
    );
    let path = w.scenario.file("config.yaml", config.as_bytes());
    let mut cmd = Exporter::command(
        std::process::Command::new(BIN),
        &w.scenario,
        &["--config.file", path.to_str().unwrap()],
    );
    for (k, v) in env {
        cmd.env(k, v);
    }
    Exporter::spawn(cmd)
}

/// The three pods' processes carry their pod names.
fn wait_attributed(ex: &Exporter) -> Metrics {
    wait_for(Duration::from_secs(10), "pod names", || {
        let m = ex.metrics();
        pods_resolved(&m, &["notebook", "trainer-0", "infer-7f9c"]).then_some(m)
    })
}

/// Only KUBECONFIG (and NODE_NAME) set, no kubernetes key: kube-rs reads the
/// kubeconfig's current context (another context names another cluster and
/// user), its server, CA and token; the API server takes only that token.
#[test]
fn kubeconfig_with_a_token_is_enough() {
    let w = world(&three_pods());
    let kubeconfig = w
        .node
        .api
        .kubeconfig("kubeconfig.yaml", "token: kubeconfig-token");
    w.node.api.state.lock().unwrap().require = Some(cluster::Accept {
        tokens: vec!["kubeconfig-token".into()],
        client_cert: None,
    });
    let ex = start_with_env(
        &w,
        "",
        &[
            ("KUBECONFIG", kubeconfig.display().to_string()),
            ("NODE_NAME", cluster::NODE.into()),
        ],
    );
    let m = wait_attributed(&ex);
    assert_eq!(m.get("gpumem_exporter_kubernetes_synced", &[]), Some(1.0));
    let state = w.node.api.state.lock().unwrap();
    assert!(state.refused.is_empty(), "{:?}", state.refused);
    assert!(
        state
            .lists
            .iter()
            .all(|r| r.auth.as_deref() == Some("Bearer kubeconfig-token")
                && r.query.get("fieldSelector").map(String::as_str)
                    == Some("spec.nodeName=gpu-node-1")),
        "{:?}",
        state.lists
    );
    let log = ex.stderr();
    assert!(
        log.contains("kubernetes pod watcher starting")
            && log.contains(&format!("api={}/", w.node.api.url()))
            && log.contains("credentials=\"bearer token\""),
        "{log}"
    );
}

/// A kubeconfig with a client certificate (as a kubelet's own kubeconfig
/// has), made for this test: the API server accepts exactly that
/// certificate and no token.
#[test]
fn kubeconfig_with_a_client_certificate() {
    let w = world(&three_pods());
    let kubeconfig = w
        .node
        .api
        .kubeconfig_with_client_cert("kubelet.conf", "system:node:gpu-node-1");
    let ex = start_with_env(
        &w,
        "",
        &[
            ("KUBECONFIG", kubeconfig.display().to_string()),
            ("NODE_NAME", cluster::NODE.into()),
        ],
    );
    wait_attributed(&ex);
    let state = w.node.api.state.lock().unwrap();
    let want = state.require.as_ref().unwrap().client_cert.clone();
    assert!(want.is_some());
    assert!(state.refused.is_empty(), "{:?}", state.refused);
    assert!(
        state
            .lists
            .iter()
            .chain(&state.watches)
            .all(|r| r.client_cert == want && r.auth.is_none()),
        "every request presented the certificate and no token"
    );
    assert!(
        ex.stderr().contains("credentials=\"client certificate\""),
        "{}",
        ex.stderr()
    );
}

/// In a pod: KUBERNETES_SERVICE_HOST/PORT and NODE_NAME from the kubelet.
/// The service account files are not at their fixed path here, so the
/// token and CA come from kubernetes.token_file and ca_file, as a
/// DaemonSet with a projected token elsewhere would set them.
#[test]
fn in_cluster_environment() {
    let w = world(&three_pods());
    let token = w.scenario.file("token", b"sa-token\n");
    w.node.api.state.lock().unwrap().require = Some(cluster::Accept {
        tokens: vec!["sa-token".into()],
        client_cert: None,
    });
    let ex = start_with_env(
        &w,
        &format!(
            "  token_file: {}\n  ca_file: {}\n",
            token.display(),
            w.node.api.ca_file().display()
        ),
        &[
            ("KUBERNETES_SERVICE_HOST", "127.0.0.1".into()),
            (
                "KUBERNETES_SERVICE_PORT",
                w.node.api.addr.port().to_string(),
            ),
            ("NODE_NAME", cluster::NODE.into()),
        ],
    );
    wait_attributed(&ex);
    let state = w.node.api.state.lock().unwrap();
    assert!(state.refused.is_empty(), "{:?}", state.refused);
    assert!(!state.lists.is_empty());
    assert!(
        ex.stderr()
            .contains("config=KUBERNETES_SERVICE_HOST/PORT credentials=\"bearer token file (kubernetes.token_file)\""),
        "{}",
        ex.stderr()
    );
}

/// A kubeconfig that cannot be read: one clear log line, the GPU and
/// process series served without pod names, the errors counted.
#[test]
fn broken_kubeconfig_serves_without_pod_names() {
    let w = world(&three_pods());
    let broken = w
        .scenario
        .file("kubeconfig.yaml", b"apiVersion: v1\nclusters: {{{\n");
    let ex = start_with_env(
        &w,
        "",
        &[
            ("KUBECONFIG", broken.display().to_string()),
            ("NODE_NAME", cluster::NODE.into()),
        ],
    );
    let m = wait_for(Duration::from_secs(10), "errors counted", || {
        let m = ex.metrics();
        (m.get("gpumem_exporter_kubernetes_errors_total", &[])
            .unwrap_or(0.0)
            >= 2.0)
            .then_some(m)
    });
    assert_eq!(m.get("gpumem_exporter_kubernetes_synced", &[]), Some(0.0));
    assert_eq!(m.get("gpumem_exporter_kubernetes_pods", &[]), Some(0.0));
    for pid in ["4101", "4102", "4103"] {
        let l = labels_of(&m, "gpu_process_memory_used_bytes", pid);
        assert_eq!(
            l.get("pod").map(String::as_str).unwrap_or(""),
            "",
            "pid {pid}"
        );
        assert!(!l["process"].is_empty(), "pid {pid} still has its name");
    }
    assert!(w.node.api.state.lock().unwrap().lists.is_empty());
    ex.assert_logged_once("no Kubernetes client config");
    let log = ex.stderr();
    let line = log
        .lines()
        .find(|l| l.contains("no Kubernetes client config"))
        .unwrap();
    assert!(line.contains(&broken.display().to_string()), "{line}");
}
