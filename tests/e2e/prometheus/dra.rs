//! Dynamic Resource Allocation rows through a real Prometheus, apart from
//! the shared `World` (which stays as it is): an exporter on the fake NVML
//! with a fake kubelet whose containers hold ResourceClaims, the fake API
//! serving the pods and this node's ResourceSlices, and a fake /proc root
//! with the trainer's process in its pod's cgroup. Prometheus scrapes it
//! every second and evaluates deploy/prometheus/rules.yml; then the
//! dashboard's "Allocated GPUs and their memory" queries and
//! GpuAllocatedButIdle's expression must answer the DRA rows exactly:
//! - `trainer-0`'s claim holds GPU 0 and its process uses 7 GB there;
//! - `nb-0`'s claim holds GPU 0 too (a device in two claims) and runs
//!   nothing: 0 bytes, 0 processes, idle;
//! - `infer-0`'s claim holds GPU 1's MIG device, idle.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{ALLOCATED, RATE_INTERVAL, dashboard_queries, rules};
use crate::harness::cluster::{
    FakeNode, NODE, cgroup_containerd, pods_resolved, resource_slice, seeded_pod, write_proc,
};
use crate::harness::kubelet::{FakeKubelet, dra_pod};
use crate::harness::prom::{Prometheus, config_with_rules, grafana_substitute, prometheus_binary};
use crate::harness::*;

const GPU0: &str = "GPU-0d0d0d0d-0000-0000-0000-000000000000";
const GPU1: &str = "GPU-1e1e1e1e-0000-0000-0000-000000000000";
const MIG1: &str = "MIG-1f1f1f1f-0000-0000-0000-000000000000";
const DRIVER: &str = "gpu.nvidia.com";
const TRAINER_PID: u32 = 5001;
const TRAINER_USED: u64 = 7_000_000_000;

fn scenario() -> String {
    format!(
        "devices:
  - uuid: {GPU0}
    memory: {{total: 85899345920, reserved: 536870912, used: 7500000000}}
    processes:
      - {{pid: {TRAINER_PID}, used: {TRAINER_USED}}}
  - uuid: {GPU1}
    memory: {{total: 85899345920, reserved: 536870912, used: 0}}
    mig_devices:
      - uuid: {MIG1}
        gpu_instance_id: 1
        compute_instance_id: 0
        memory: {{total: 20000000000, reserved: 0, used: 0}}
        processes: []
"
    )
}

/// Everything the check needs, answered by Prometheus; `None` while it
/// is not (yet) what the scenario shows.
fn check(prom: &Prometheus) -> Result<(), String> {
    let all = [
        ("instance", ".*"),
        ("gpu", ".*"),
        ("namespace", ".*"),
        ("pod", ".*"),
        ("slurm_job", ".*"),
        ("__rate_interval", RATE_INTERVAL),
    ];
    // The panel: bytes (A) and processes (B) per allocated device, keyed
    // by pod, claim and MIG device.
    let mut got = BTreeMap::new();
    for (title, ref_id, expr) in dashboard_queries() {
        if title != ALLOCATED {
            continue;
        }
        let q = prom.query(&grafana_substitute(&expr, &all));
        if !q.ok() {
            return Err(format!("{title} {ref_id}: {:?}", q.error));
        }
        for series in &q.result {
            let m = &series["metric"];
            let key = format!(
                "{} {} {}{} {ref_id}",
                m["pod"].as_str().unwrap_or(""),
                m["dra_claim_name"].as_str().unwrap_or(""),
                m["gpu"].as_str().unwrap_or(""),
                m["mig_uuid"]
                    .as_str()
                    .map_or(String::new(), |u| format!("/{u}")),
            );
            let v = series["value"][1]
                .as_str()
                .and_then(|v| v.parse::<f64>().ok());
            got.insert(key, v);
        }
    }
    let want: BTreeMap<String, Option<f64>> = [
        ("trainer-0 train-gpu 0 A".to_string(), TRAINER_USED as f64),
        ("trainer-0 train-gpu 0 B".to_string(), 1.0),
        ("nb-0 shared-nb 0 A".to_string(), 0.0),
        ("nb-0 shared-nb 0 B".to_string(), 0.0),
        (format!("infer-0 infer-mig 1/{MIG1} A"), 0.0),
        (format!("infer-0 infer-mig 1/{MIG1} B"), 0.0),
    ]
    .into_iter()
    .map(|(k, v)| (k, Some(v)))
    .collect();
    if got != want {
        return Err(format!("{ALLOCATED}: got {got:?}, want {want:?}"));
    }

    // GpuAllocatedButIdle's condition (its hour left out): the two idle
    // claims, not the busy one.
    let rule = rules()
        .into_iter()
        .find(|r| r.alert.as_deref() == Some("GpuAllocatedButIdle"))
        .ok_or("no GpuAllocatedButIdle in rules.yml")?;
    let q = prom.query(&rule.expr);
    let idle: BTreeSet<(String, String)> = q
        .labels()
        .iter()
        .map(|l| {
            let s = |k: &str| l.get(k).and_then(Value::as_str).unwrap_or("").to_string();
            (s("pod"), s("dra_claim_name"))
        })
        .collect();
    let want: BTreeSet<(String, String)> = [("infer-0", "infer-mig"), ("nb-0", "shared-nb")]
        .into_iter()
        .map(|(p, c)| (p.to_string(), c.to_string()))
        .collect();
    if idle != want {
        return Err(format!("GpuAllocatedButIdle: got {idle:?}, want {want:?}"));
    }
    Ok(())
}

#[test]
fn the_allocation_panel_and_idle_alert_cover_dra_rows() {
    prometheus_binary();
    let node = FakeNode::start(vec![
        seeded_pod("team-a", "trainer-0", 'a', "trainer", "containerd"),
        seeded_pod("team-a", "nb-0", 'c', "jupyter", "containerd"),
        seeded_pod("team-b", "infer-0", 'b', "server", "containerd"),
    ]);
    node.api.state.lock().unwrap().slices = vec![resource_slice(
        NODE,
        DRIVER,
        &[
            (
                "gpu-0",
                json!({"type": {"string": "gpu"}, "uuid": {"string": GPU0}}),
            ),
            (
                "gpu-1",
                json!({"type": {"string": "gpu"}, "uuid": {"string": GPU1}}),
            ),
            (
                "gpu-1-mig-9-1-1",
                json!({"type": {"string": "mig"}, "uuid": {"string": MIG1}, "parentUUID": {"string": GPU1}}),
            ),
        ],
    )];
    write_proc(
        node.proc_root.path(),
        TRAINER_PID,
        "python",
        1000,
        &cgroup_containerd('a'),
        &[],
    );
    let kubelet = FakeKubelet::start(vec![
        dra_pod(
            "team-a",
            "trainer-0",
            &[(
                "trainer",
                &[("team-a", "train-gpu", &[(DRIVER, NODE, "gpu-0")])],
            )],
        ),
        dra_pod(
            "team-a",
            "nb-0",
            &[(
                "jupyter",
                &[("team-a", "shared-nb", &[(DRIVER, NODE, "gpu-0")])],
            )],
        ),
        dra_pod(
            "team-b",
            "infer-0",
            &[(
                "server",
                &[("team-b", "infer-mig", &[(DRIVER, NODE, "gpu-1-mig-9-1-1")])],
            )],
        ),
    ]);
    let sc = Scenario::new(&scenario());
    let config = node.config_with(
        &sc,
        "",
        &format!(
            "  pod_resources_socket: {}\n  pod_resources_interval: 1s\n",
            kubelet.socket.display()
        ),
    );
    let ex = Exporter::with_config(&sc, &config, &[]);
    wait_for(
        Duration::from_secs(10),
        "the DRA rows and the trainer's pod",
        || {
            let m = ex.metrics();
            (pods_resolved(&m, &["trainer-0"])
                && m.find("gpu_allocation_info", &[("dra_driver_name", DRIVER)])
                    .len()
                    == 3
                && m.find("gpu_allocation_info", &[("mig_uuid", MIG1)]).len() == 1)
                .then_some(())
        },
    );

    let prom = Prometheus::start(&config_with_rules(&[(&[ex.addr.to_string()], None)]));
    let started = Instant::now();
    loop {
        match check(&prom) {
            Ok(()) => break,
            Err(e) if started.elapsed() > Duration::from_secs(30) => panic!(
                "{e}\nprometheus log:\n{}\nexporter log:\n{}",
                prom.log(),
                ex.stderr()
            ),
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    }
}
