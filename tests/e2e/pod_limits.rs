//! The limits the Kubernetes API states for a pod, end to end: the real
//! binary on the fake NVML (two GPUs shared by pods), a fake /proc whose
//! processes sit in those pods' cgroups, the fake API serving the pods
//! with HAMi's and KAI's annotations, this node's ResourceSlices and a
//! ResourceClaim with consumed capacity, and the fake kubelet naming the
//! claim for two pods. Each pod's limit is `gpu_workload_memory_limit_bytes`
//! with its `source` and `kind`; an annotation names only its own pod; a
//! malformed one is said once and gives nothing; the claim is read by name
//! on its own task, not per scrape, and without RBAC the rest still
//! stands.

use std::collections::BTreeSet;
use std::time::Duration;

use axum::body::Bytes;
use serde_json::{Value, json};

use crate::harness::cluster::{
    self, FakeNode, NODE, cgroup_containerd, pod_uid, resource_claim, resource_slice, seeded_pod,
};
use crate::harness::kubelet::{FakeKubelet, dra_pod, proto};
use crate::harness::*;

const GPU0: &str = "GPU-0d0d0d0d-0000-0000-0000-000000000000";
const GPU1: &str = "GPU-1e1e1e1e-0000-0000-0000-000000000000";
const TOTAL: u64 = 85_899_345_920;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const DRIVER: &str = "gpu.nvidia.com";
const HAMI: &str = "hami.io/vgpu-devices-allocated";

/// One pod with one process: (namespace, pod, seed of its UID and
/// container id, pid, GPU, annotations).
struct P {
    ns: &'static str,
    pod: &'static str,
    seed: char,
    pid: u32,
    gpu: &'static str,
    annotations: Value,
}

fn pods() -> Vec<P> {
    let p = |ns, pod, seed, pid, gpu, annotations| P {
        ns,
        pod,
        seed,
        pid,
        gpu,
        annotations,
    };
    vec![
        // HAMi: two containers on GPU 0, as its scheduler writes it.
        p(
            "team-a",
            "hami-0",
            'a',
            5101,
            GPU0,
            json!({HAMI: format!("{GPU0},NVIDIA,2000,30:;{GPU0},NVIDIA,3000,30:;")}),
        ),
        // KAI: MiB, and a fraction of the GPU's total.
        p(
            "team-b",
            "kai-mem-0",
            'b',
            5102,
            GPU0,
            json!({"gpu-memory": "4000"}),
        ),
        p(
            "team-b",
            "kai-frac-0",
            'c',
            5103,
            GPU0,
            json!({"gpu-fraction": "0.25"}),
        ),
        // Broken: nothing, said once per annotation.
        p(
            "team-b",
            "broken-0",
            'd',
            5104,
            GPU0,
            json!({HAMI: format!("{GPU0},NVIDIA,lots,0:;"), "gpu-fraction": "1.5"}),
        ),
        // A tenant naming the GPU its neighbour holds: its own pod only,
        // and it has no process there.
        p(
            "team-e",
            "forger-0",
            'e',
            5105,
            GPU0,
            json!({HAMI: format!("{GPU1},NVIDIA,1,0:;")}),
        ),
        p("team-f", "victim-0", 'f', 5106, GPU1, json!({})),
        // DRA: one claim shared by two pods on GPU 1.
        p("team-c", "dra-a", '1', 5107, GPU1, json!({})),
        p("team-c", "dra-b", '2', 5108, GPU1, json!({})),
    ]
}

fn api_pod(p: &P) -> Value {
    let mut v = seeded_pod(p.ns, p.pod, p.seed, "main", "containerd");
    v["metadata"]["annotations"] = p.annotations.clone();
    v
}

fn scenario(pods: &[P]) -> String {
    let mut y = String::from("devices:\n");
    for gpu in [GPU0, GPU1] {
        y.push_str(&format!(
            "  - uuid: {gpu}\n    memory: {{total: {TOTAL}, reserved: 536870912, used: 20000000000}}\n    processes:\n"
        ));
        for p in pods.iter().filter(|p| p.gpu == gpu) {
            y.push_str(&format!(
                "      - {{pid: {}, used: {}}}\n",
                p.pid,
                u64::from(p.pid - 5100) * GIB
            ));
        }
    }
    y
}

fn kubelet_pods() -> Vec<proto::PodResources> {
    ["dra-a", "dra-b"]
        .into_iter()
        .map(|pod| {
            dra_pod(
                "team-c",
                pod,
                &[("main", &[("team-c", "shared", &[(DRIVER, NODE, "gpu-1")])])],
            )
        })
        .collect()
}

/// The node, its kubelet and the exporter on them.
struct World {
    node: FakeNode,
    _kubelet: FakeKubelet,
    _scenario: Scenario,
    ex: Exporter,
}

fn start(forbid_claims: bool) -> World {
    let pods = pods();
    let node = FakeNode::start(pods.iter().map(api_pod).collect());
    for p in &pods {
        cluster::write_proc(
            node.proc_root.path(),
            p.pid,
            "python3",
            1000,
            &cgroup_containerd(p.seed),
            &[],
        );
    }
    {
        let mut api = node.api.state.lock().unwrap();
        api.slices = vec![resource_slice(
            NODE,
            DRIVER,
            &[("gpu-1", json!({"uuid": {"string": GPU1}}))],
        )];
        api.claims = vec![resource_claim(
            "team-c",
            "shared",
            DRIVER,
            &[("gpu-1", Some("20Gi"))],
        )];
        api.claims_forbidden = forbid_claims;
    }
    let kubelet = FakeKubelet::start(kubelet_pods());
    let sc = Scenario::new(&scenario(&pods));
    let kube = format!(
        "  pod_resources_socket: {}\n  pod_resources_interval: 200ms\n",
        kubelet.socket.display()
    );
    let ex = Exporter::with_config(&sc, &node.config_with(&sc, "", &kube), &[]);
    World {
        node,
        _kubelet: kubelet,
        _scenario: sc,
        ex,
    }
}

/// Every `gpu_workload_memory_limit_bytes` series as (pod, pod UID seed,
/// uuid, source, kind, bytes).
type Row = (String, String, String, String, String, u64);

fn limits(m: &Metrics) -> BTreeSet<Row> {
    m.find("gpu_workload_memory_limit_bytes", &[])
        .into_iter()
        .map(|(l, v)| {
            let get = |k: &str| l.get(k).cloned().unwrap_or_default();
            (
                get("pod"),
                get("pod_uid"),
                get("uuid"),
                get("source"),
                get("kind"),
                v as u64,
            )
        })
        .collect()
}

fn row(pod: &str, seed: char, uuid: &str, source: &str, kind: &str, bytes: u64) -> Row {
    (
        pod.into(),
        pod_uid(seed),
        uuid.into(),
        source.into(),
        kind.into(),
        bytes,
    )
}

fn annotated_rows() -> Vec<Row> {
    vec![
        row("hami-0", 'a', GPU0, "hami", "hard", 5000 * MIB),
        row("kai-mem-0", 'b', GPU0, "kai", "granted", 4000 * MIB),
        row("kai-frac-0", 'c', GPU0, "kai", "granted", TOTAL / 4),
    ]
}

fn dra_rows() -> Vec<Row> {
    vec![
        row("dra-a", '1', GPU1, "dra", "hard", 20 * GIB),
        row("dra-b", '2', GPU1, "dra", "hard", 20 * GIB),
    ]
}

/// HAMi's, KAI's and a shared claim's limits, each on its own pod; the
/// broken and the forged annotations give nothing to anyone.
#[test]
fn each_pod_gets_the_limits_the_api_states_for_it() {
    let w = start(false);
    let want: BTreeSet<Row> = annotated_rows().into_iter().chain(dra_rows()).collect();
    let m = wait_for(Duration::from_secs(15), "every pod's limits", || {
        let m = w.ex.metrics();
        (limits(&m) == want).then_some(m)
    });
    // Used beside each, with the pod's names.
    assert_eq!(
        m.get_u64(
            "gpu_workload_memory_used_bytes",
            &[
                ("gpu", "0"),
                ("uuid", GPU0),
                ("namespace", "team-a"),
                ("pod", "hami-0"),
                ("pod_uid", &pod_uid('a')),
            ]
        ),
        Some(GIB)
    );
    for pod in ["broken-0", "forger-0", "victim-0"] {
        assert!(
            m.find("gpu_workload_memory_limit_bytes", &[("pod", pod)])
                .is_empty(),
            "{pod}:\n{}",
            m.text
        );
    }
    for source in ["hami", "kai", "dra"] {
        assert_eq!(
            m.get("gpumem_exporter_limit_sources", &[("source", source)]),
            Some(1.0),
            "{source}"
        );
    }

    // The broken pod is said once per annotation, naming it and what is
    // wrong, however often it is seen.
    let log = w.ex.stderr();
    let said: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("pod annotation ignored"))
        .collect();
    assert_eq!(said.len(), 2, "{log}");
    assert!(said.iter().all(|l| l.contains("broken-0")), "{log}");
    assert!(said.iter().any(|l| l.contains("lots")), "{log}");
    assert!(said.iter().any(|l| l.contains("1.5")), "{log}");

    // The claim was read by name, not listed, and not per scrape.
    let asked = w.node.api.state.lock().unwrap().claim_requests.clone();
    assert!(!asked.is_empty());
    assert!(asked.iter().all(|r| r == "team-c/shared"), "{asked:?}");
    for _ in 0..30 {
        w.ex.metrics();
    }
    let again = w.node.api.state.lock().unwrap().claim_requests.len();
    assert!(again <= asked.len() + 1, "{again} after {}", asked.len());
}

/// Without RBAC for claims (403): no DRA limit, said with the rule to
/// add, and every other limit stays; an annotation added to a running pod
/// (a MODIFIED event) gives its limit.
#[test]
fn a_refused_claim_and_a_later_annotation() {
    let mut w = start(true);
    let m = wait_for(
        Duration::from_secs(15),
        "the annotations' limits, DRA looked for",
        || {
            let m = w.ex.metrics();
            let asked = !w.node.api.state.lock().unwrap().claim_requests.is_empty();
            (asked
                && limits(&m) == annotated_rows().into_iter().collect()
                && m.get("gpumem_exporter_limit_sources", &[("source", "dra")]) == Some(0.0))
            .then_some(m)
        },
    );
    assert_eq!(
        m.get("gpumem_exporter_limit_sources", &[("source", "hami")]),
        Some(1.0)
    );
    assert!(
        w.ex.stderr().contains("resourceclaims"),
        "{}",
        w.ex.stderr()
    );
    // The DRA allocations themselves are still served.
    assert_eq!(
        m.find("gpu_allocation_info", &[("dra_claim_name", "shared")])
            .len(),
        2
    );

    // KAI's annotation on a running pod.
    let (_, mut watch) = w.node.rt.block_on(w.node.api.next_watch());
    let mut victim = api_pod(&pods()[5]);
    victim["metadata"]["annotations"] = json!({"gpu-memory": "1024"});
    victim["metadata"]["resourceVersion"] = json!("11");
    w.node
        .rt
        .block_on(watch.send_data(Bytes::from(cluster::event("MODIFIED", victim))))
        .unwrap();
    let want: BTreeSet<Row> = annotated_rows()
        .into_iter()
        .chain([row("victim-0", 'f', GPU1, "kai", "granted", GIB)])
        .collect();
    wait_for(Duration::from_secs(10), "the annotated pod's limit", || {
        (limits(&w.ex.metrics()) == want).then_some(())
    });
    let mut gone = api_pod(&pods()[5]);
    gone["metadata"]["resourceVersion"] = json!("12");
    w.node
        .rt
        .block_on(watch.send_data(Bytes::from(cluster::event("DELETED", gone))))
        .unwrap();
    wait_for(
        Duration::from_secs(10),
        "the deleted pod's limit gone",
        || (limits(&w.ex.metrics()) == annotated_rows().into_iter().collect()).then_some(()),
    );
}
