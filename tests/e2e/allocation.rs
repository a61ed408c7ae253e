//! `gpu_allocation_info` end to end: the real binary on the fake NVML (a
//! whole GPU, a GPU in MIG mode, a GPU shared by time-slicing) and a fake
//! kubelet serving the pod-resources v1 API on a Unix socket
//! (harness/kubelet.rs). The exporter calls `List` on its own task every
//! `kubernetes.pod_resources_interval`; each scrape shows the latest answer,
//! matched to the GPU indexes and MIG instances of the same snapshot.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::harness::kubelet::{FakeKubelet, pod, proto};
use crate::harness::*;

/// Dynamic Resource Allocation: ResourceClaims in the same answer.
mod dra;

const GPU0: &str = "GPU-0a0a0a0a-0000-0000-0000-000000000000";
const GPU1: &str = "GPU-1b1b1b1b-0000-0000-0000-000000000000";
const GPU2: &str = "GPU-2c2c2c2c-0000-0000-0000-000000000000";
const MIG1: &str = "MIG-11111111-0000-0000-0000-000000000000";
const MIG2: &str = "MIG-22222222-0000-0000-0000-000000000000";

/// GPU 0 whole, GPU 1 in MIG mode with instances 1/0 and 2/0, GPU 2 for
/// time-slicing. No process holds memory anywhere.
fn scenario() -> String {
    format!(
        "devices:
  - uuid: {GPU0}
    memory: {{total: 85899345920, reserved: 536870912, used: 0}}
    processes: []
  - uuid: {GPU1}
    memory: {{total: 85899345920, reserved: 536870912, used: 0}}
    mig_devices:
      - uuid: {MIG1}
        gpu_instance_id: 1
        compute_instance_id: 0
        memory: {{total: 20000000000, reserved: 0, used: 0}}
        processes: []
      - uuid: {MIG2}
        gpu_instance_id: 2
        compute_instance_id: 0
        memory: {{total: 20000000000, reserved: 0, used: 0}}
        processes: []
  - uuid: {GPU2}
    memory: {{total: 85899345920, reserved: 536870912, used: 0}}
    processes: []
"
    )
}

/// What the NVIDIA device plugin would have allocated: whole GPUs, MIG
/// devices in both id forms (mixed strategy resource names), time-slicing
/// replicas (`UUID::N`, one under a renamed resource that is configured),
/// and what is not exported: another plugin's device, a resource not
/// configured, a pod with CPUs only.
fn kubelet_pods() -> Vec<proto::PodResources> {
    let r0 = format!("{GPU2}::0");
    let r1 = format!("{GPU2}::1");
    let r3 = format!("{GPU2}::3");
    let shared = format!("{GPU0}::1");
    let mig_old = format!("MIG-{GPU1}/2/0");
    vec![
        pod(
            "team-a",
            "trainer-0",
            &[
                ("trainer", &[("nvidia.com/gpu", &[GPU0])]),
                ("sidecar", &[]),
            ],
        ),
        pod(
            "team-b",
            "infer-0",
            &[("server", &[("nvidia.com/mig-1g.10gb", &[MIG1])])],
        ),
        pod(
            "team-b",
            "infer-1",
            &[("server", &[("nvidia.com/mig-1g.10gb", &[&mig_old])])],
        ),
        pod(
            "team-c",
            "notebook-a",
            &[("jupyter", &[("nvidia.com/gpu", &[&r0])])],
        ),
        pod(
            "team-c",
            "notebook-b",
            &[("jupyter", &[("nvidia.com/gpu", &[&r1, &r3])])],
        ),
        pod(
            "team-d",
            "shared",
            &[("main", &[("nvidia.com/gpu.shared", &[&shared])])],
        ),
        pod(
            "team-d",
            "fpga",
            &[
                ("main", &[("example.com/fpga", &["fpga-0"])]),
                ("other", &[("nvidia.com/gpu.unconfigured", &[GPU0])]),
            ],
        ),
        pod("team-d", "cpu-only", &[("main", &[])]),
    ]
}

type Labels = BTreeMap<String, String>;

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The series the pods above give, label sets exactly.
fn expected() -> Vec<Labels> {
    let gpu =
        |gpu: &str, uuid: &str, ns: &str, pod: &str, c: &str, res: &str, extra: &[(&str, &str)]| {
            let mut l = labels(&[
                ("gpu", gpu),
                ("uuid", uuid),
                ("namespace", ns),
                ("pod", pod),
                ("container", c),
                ("resource", res),
            ]);
            l.extend(labels(extra));
            l
        };
    let mut want = vec![
        gpu(
            "0",
            GPU0,
            "team-a",
            "trainer-0",
            "trainer",
            "nvidia.com/gpu",
            &[],
        ),
        gpu(
            "1",
            GPU1,
            "team-b",
            "infer-0",
            "server",
            "nvidia.com/mig-1g.10gb",
            &[
                ("mig_uuid", MIG1),
                ("gpu_instance_id", "1"),
                ("compute_instance_id", "0"),
            ],
        ),
        gpu(
            "1",
            GPU1,
            "team-b",
            "infer-1",
            "server",
            "nvidia.com/mig-1g.10gb",
            &[
                ("mig_uuid", MIG2),
                ("gpu_instance_id", "2"),
                ("compute_instance_id", "0"),
            ],
        ),
        gpu(
            "2",
            GPU2,
            "team-c",
            "notebook-a",
            "jupyter",
            "nvidia.com/gpu",
            &[("replica", "0")],
        ),
        gpu(
            "2",
            GPU2,
            "team-c",
            "notebook-b",
            "jupyter",
            "nvidia.com/gpu",
            &[("replica", "1")],
        ),
        gpu(
            "2",
            GPU2,
            "team-c",
            "notebook-b",
            "jupyter",
            "nvidia.com/gpu",
            &[("replica", "3")],
        ),
        gpu(
            "0",
            GPU0,
            "team-d",
            "shared",
            "main",
            "nvidia.com/gpu.shared",
            &[("replica", "1")],
        ),
    ];
    want.sort();
    want
}

fn allocations(m: &Metrics) -> Vec<Labels> {
    let mut got: Vec<Labels> = m
        .find("gpu_allocation_info", &[])
        .into_iter()
        .map(|(l, v)| {
            assert_eq!(v, 1.0, "{l:?}");
            l
        })
        .collect();
    got.sort();
    got
}

fn config(socket: &std::path::Path) -> String {
    format!(
        "sample_interval: 100ms\nkubernetes:\n  pod_resources_socket: {}\n  pod_resources_interval: 200ms\n  pod_resources_extra_resources: [nvidia.com/gpu.shared]\n",
        socket.display()
    )
}

fn counter(m: &Metrics, name: &str) -> f64 {
    m.get(name, &[])
        .unwrap_or_else(|| panic!("no {name}:\n{}", m.text))
}

#[test]
fn allocations_of_whole_gpus_mig_devices_and_replicas() {
    let mut kubelet = FakeKubelet::start(kubelet_pods());
    let sc = Scenario::new(&scenario());
    let ex = Exporter::with_config(&sc, &config(&kubelet.socket), &[]);

    // Exactly the allocated devices, joined with this snapshot's GPUs and
    // MIG instances.
    let m = wait_for(Duration::from_secs(10), "the allocations", || {
        let m = ex.metrics();
        (allocations(&m) == expected()).then_some(m)
    });
    assert!(counter(&m, "gpumem_exporter_pod_resources_lists_total") >= 1.0);
    assert_eq!(
        counter(&m, "gpumem_exporter_pod_resources_errors_total"),
        0.0
    );
    assert!(kubelet.lists() >= 1);
    // The kubelet is asked on the interval, not per scrape.
    let before = kubelet.lists();
    for _ in 0..20 {
        ex.metrics();
    }
    assert!(
        kubelet.lists() <= before + 2,
        "20 scrapes made {} List calls",
        kubelet.lists() - before
    );

    // A pod removed: its series are gone after one more List.
    kubelet
        .state
        .lock()
        .unwrap()
        .pods
        .retain(|p| p.name != "notebook-b");
    let want: Vec<Labels> = expected()
        .into_iter()
        .filter(|l| l["pod"] != "notebook-b")
        .collect();
    let asked = kubelet.lists();
    let m = wait_for(Duration::from_secs(5), "notebook-b's series gone", || {
        let m = ex.metrics();
        (allocations(&m) == want).then_some(m)
    });
    assert!(kubelet.lists() > asked, "after a List");
    assert!(!m.text.contains("notebook-b"));

    // The kubelet goes away: errors counted, everything else still served;
    // after three intervals without an answer the allocations are dropped.
    kubelet.stop();
    let m = wait_for(Duration::from_secs(5), "errors counted", || {
        let m = ex.metrics();
        (counter(&m, "gpumem_exporter_pod_resources_errors_total") >= 2.0).then_some(m)
    });
    for g in ["0", "1", "2"] {
        assert_eq!(m.find("gpu_up", &[("gpu", g)]).len(), 1, "gpu {g}");
    }
    assert_eq!(m.find("gpu_mig_info", &[]).len(), 2);
    wait_for(Duration::from_secs(5), "stale allocations dropped", || {
        allocations(&ex.metrics()).is_empty().then_some(())
    });
    assert_eq!(ex.get("/metrics").status, 200);
    ex.assert_logged_once("kubelet pod-resources List failed");
}

/// No kubelet socket: this part is off, said once, nothing exported.
#[test]
fn no_socket_no_allocations() {
    let dir = tempfile::tempdir().unwrap();
    let sc = Scenario::new(&scenario());
    let ex = Exporter::with_config(&sc, &config(&dir.path().join("kubelet.sock")), &[]);
    let m = ex.metrics();
    assert!(!m.text.contains("gpu_allocation_info"), "{}", m.text);
    assert!(
        !m.text.contains("gpumem_exporter_pod_resources"),
        "{}",
        m.text
    );
    assert_eq!(m.find("gpu_up", &[]).len(), 3);
    ex.assert_logged_once("no kubelet pod-resources socket");
}

/// `record` runs the same pipeline as the daemon: with the fake kubelet,
/// every format carries the allocations (docs/record.md).
#[test]
fn a_recording_carries_the_allocations() {
    let kubelet = FakeKubelet::start(kubelet_pods());
    let sc = Scenario::new(&scenario());
    let cfg = sc.file("config.yaml", config(&kubelet.socket).as_bytes());
    let record = |name: &str| -> String {
        let out = sc.dir.path().join(name);
        let status = std::process::Command::new(BIN)
            .arg("record")
            .arg("--config.file")
            .arg(&cfg)
            .arg("--nvml.library")
            .arg(fake_nvml())
            .args(["--log.level", "warn", "--duration", "1500ms", "-o"])
            .arg(&out)
            .env("FAKE_NVML_CONFIG", &sc.path)
            .env_remove("KUBECONFIG")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run record");
        assert!(status.status.success(), "{}", output_text(&status));
        std::fs::read_to_string(&out).expect("read the recording")
    };

    // OpenMetrics: the same gpu_allocation_info series as a scrape.
    let om = record("run.om");
    let want = format!(
        "gpu=\"0\",uuid=\"{GPU0}\",namespace=\"team-a\",pod=\"trainer-0\",container=\"trainer\",resource=\"nvidia.com/gpu\"}} 1 "
    );
    let found = om
        .lines()
        .any(|l| l.starts_with("gpu_allocation_info{instance=") && l.contains(&want));
    assert!(found, "{want} not in:\n{om}");
    assert!(om.contains(&format!("mig_uuid=\"{MIG1}\"")), "{om}");

    // CSV: allocation rows with the container and resource columns.
    let csv = record("run.csv");
    let header: Vec<&str> = csv.lines().next().unwrap_or("").split(',').collect();
    let col = |name: &str| header.iter().position(|c| *c == name).expect(name);
    let rows: Vec<Vec<&str>> = csv
        .lines()
        .map(|l| l.split(',').collect::<Vec<_>>())
        .filter(|r| r.get(col("kind")) == Some(&"allocation"))
        .collect();
    let trainer = rows.iter().find(|r| r[col("pod")] == "trainer-0");
    let trainer = trainer.unwrap_or_else(|| panic!("no trainer-0 allocation row:\n{csv}"));
    assert_eq!(
        [
            trainer[col("gpu")],
            trainer[col("uuid")],
            trainer[col("namespace")],
            trainer[col("container")],
            trainer[col("resource")],
        ],
        ["0", GPU0, "team-a", "trainer", "nvidia.com/gpu"]
    );
    let mig = rows
        .iter()
        .find(|r| r[col("pod")] == "infer-0")
        .expect("infer-0 row");
    assert_eq!((mig[col("gpu")], mig[col("uuid")]), ("1", MIG1));
    // Written when the set changes, not at every full sample.
    let sets = rows.iter().filter(|r| r[col("pod")] == "trainer-0").count();
    assert_eq!(sets, 1, "{csv}");

    // Trace: an instant event on GPU 0's track.
    let trace = record("run.trace.json");
    let want = format!("allocated: team-a/trainer-0/trainer nvidia.com/gpu {GPU0}");
    assert!(trace.contains(&want), "{want} not in:\n{trace}");
}
