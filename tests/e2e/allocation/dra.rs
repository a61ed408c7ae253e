//! Dynamic Resource Allocation end to end: the real binary on the fake
//! NVML (the parent module's GPUs: 0 whole, 1 in MIG mode, 2 whole), the
//! fake kubelet answering `dynamic_resources` (ResourceClaims) in the same
//! `List`, and the fake Kubernetes API serving this node's pods and its
//! ResourceSlices (`resource.k8s.io/v1`, list and watch with the
//! `spec.nodeName` field selector). Each device becomes a
//! `gpu_allocation_info` row with the claim, driver, pool and device and
//! the pod's UID; the slices say which GPU, and without them (403) the
//! index in the device's name does, counted and said once.

use std::time::Duration;

use serde_json::{Value, json};

use super::{GPU0, GPU1, GPU2, Labels, MIG1, allocations, counter, labels, scenario};
use crate::harness::cluster::{FakeNode, NODE, pod_uid, resource_slice, seeded_pod};
use crate::harness::kubelet::{FakeKubelet, dra_pod, proto};
use crate::harness::*;

const DRIVER: &str = "gpu.nvidia.com";
const MIG_DEVICE: &str = "gpu-1-mig-9-1-1";
/// A MIG device the DRA driver has just created: in its slice, not yet in
/// a MIG rescan of the exporter (dcgm-exporter #714).
const NEW_MIG_DEVICE: &str = "gpu-1-mig-9-2-1";
const NEW_MIG: &str = "MIG-99999999-0000-0000-0000-000000000000";

/// What the kubelet reports: a whole GPU (and a NIC of another driver,
/// not a GPU), a MIG device, a MIG device just created, and GPU 2 in two
/// claims of two pods.
fn kubelet_pods() -> Vec<proto::PodResources> {
    vec![
        dra_pod(
            "team-a",
            "trainer-0",
            &[
                (
                    "trainer",
                    &[
                        ("team-a", "trainer-0-gpu-x8f2k", &[(DRIVER, NODE, "gpu-0")]),
                        (
                            "team-a",
                            "trainer-0-nic",
                            &[("nic.example.com", NODE, "nic-0")],
                        ),
                    ],
                ),
                ("sidecar", &[]),
            ],
        ),
        dra_pod(
            "team-b",
            "infer-0",
            &[(
                "server",
                &[("team-b", "infer-mig-1g", &[(DRIVER, NODE, MIG_DEVICE)])],
            )],
        ),
        dra_pod(
            "team-b",
            "infer-1",
            &[(
                "server",
                &[("team-b", "infer-mig-new", &[(DRIVER, NODE, NEW_MIG_DEVICE)])],
            )],
        ),
        dra_pod(
            "team-c",
            "nb-a",
            &[(
                "jupyter",
                &[("team-c", "shared-a", &[(DRIVER, NODE, "gpu-2")])],
            )],
        ),
        dra_pod(
            "team-c",
            "nb-b",
            &[(
                "jupyter",
                &[("team-c", "shared-b", &[(DRIVER, NODE, "gpu-2")])],
            )],
        ),
    ]
}

/// The pods as the API server has them (their UIDs from the seeds).
fn api_pods() -> Vec<Value> {
    vec![
        seeded_pod("team-a", "trainer-0", 'a', "trainer", "containerd"),
        seeded_pod("team-b", "infer-0", 'b', "server", "containerd"),
        seeded_pod("team-b", "infer-1", 'e', "server", "containerd"),
        seeded_pod("team-c", "nb-a", 'c', "jupyter", "containerd"),
        seeded_pod("team-c", "nb-b", 'd', "jupyter", "containerd"),
    ]
}

/// NVIDIA's DRA driver's slice of this node (attributes as it publishes
/// them), a NIC driver's, and another node's (the field selector keeps it
/// out).
fn slices() -> Vec<Value> {
    vec![
        resource_slice(
            NODE,
            DRIVER,
            &[
                (
                    "gpu-0",
                    json!({"type": {"string": "gpu"}, "uuid": {"string": GPU0},
                           "productName": {"string": "NVIDIA H200"}, "driverVersion": {"version": "580.159.4"}}),
                ),
                (
                    MIG_DEVICE,
                    json!({"type": {"string": "mig"}, "uuid": {"string": MIG1},
                           "parentUUID": {"string": GPU1}, "profile": {"string": "1g.10gb"}}),
                ),
                (
                    NEW_MIG_DEVICE,
                    json!({"type": {"string": "mig"}, "uuid": {"string": NEW_MIG},
                           "parentUUID": {"string": GPU1}, "profile": {"string": "1g.10gb"}}),
                ),
                (
                    "gpu-2",
                    json!({"type": {"string": "gpu"}, "uuid": {"string": GPU2}}),
                ),
            ],
        ),
        resource_slice(
            NODE,
            "nic.example.com",
            &[("nic-0", json!({"pciAddress": {"string": "0000:3b:00.0"}}))],
        ),
        resource_slice(
            "gpu-node-2",
            DRIVER,
            &[("gpu-0", json!({"uuid": {"string": "GPU-elsewhere"}}))],
        ),
    ]
}

/// One row: the device labels, then the pod's and the claim's.
fn row(
    device: &[(&str, &str)],
    ns: &str,
    pod: &str,
    c: &str,
    seed: char,
    claim: &str,
    name: &str,
) -> Labels {
    let uid = pod_uid(seed);
    let mut l = labels(device);
    l.extend(labels(&[
        ("namespace", ns),
        ("pod", pod),
        ("container", c),
        ("pod_uid", &uid),
        ("dra_claim_namespace", ns),
        ("dra_claim_name", claim),
        ("dra_driver_name", DRIVER),
        ("dra_pool_name", NODE),
        ("dra_device_name", name),
    ]));
    l
}

/// The rows, with GPU 1's MIG devices as `mig` and `new_mig` (the slices
/// give the instance of the one the exporter has seen and the parent of
/// the new one; the fallback only their parent GPU).
fn expected(mig: &[(&str, &str)], new_mig: &[(&str, &str)]) -> Vec<Labels> {
    let mut want = vec![
        row(
            new_mig,
            "team-b",
            "infer-1",
            "server",
            'e',
            "infer-mig-new",
            NEW_MIG_DEVICE,
        ),
        row(
            &[("gpu", "0"), ("uuid", GPU0)],
            "team-a",
            "trainer-0",
            "trainer",
            'a',
            "trainer-0-gpu-x8f2k",
            "gpu-0",
        ),
        row(
            mig,
            "team-b",
            "infer-0",
            "server",
            'b',
            "infer-mig-1g",
            MIG_DEVICE,
        ),
        row(
            &[("gpu", "2"), ("uuid", GPU2)],
            "team-c",
            "nb-a",
            "jupyter",
            'c',
            "shared-a",
            "gpu-2",
        ),
        row(
            &[("gpu", "2"), ("uuid", GPU2)],
            "team-c",
            "nb-b",
            "jupyter",
            'd',
            "shared-b",
            "gpu-2",
        ),
    ];
    want.sort();
    want
}

fn start(node: &FakeNode, kubelet: &FakeKubelet) -> (Scenario, Exporter) {
    let sc = Scenario::new(&scenario());
    let kube = format!(
        "  pod_resources_socket: {}\n  pod_resources_interval: 200ms\n",
        kubelet.socket.display()
    );
    let ex = Exporter::with_config(&sc, &node.config_with(&sc, "", &kube), &[]);
    (sc, ex)
}

#[test]
fn dra_devices_resolved_through_resource_slices() {
    let node = FakeNode::start(api_pods());
    node.api.state.lock().unwrap().slices = slices();
    let kubelet = FakeKubelet::start(kubelet_pods());
    let (_sc, ex) = start(&node, &kubelet);

    let mig = [
        ("gpu", "1"),
        ("uuid", GPU1),
        ("mig_uuid", MIG1),
        ("gpu_instance_id", "1"),
        ("compute_instance_id", "0"),
    ];
    let new_mig = [("gpu", "1"), ("uuid", GPU1), ("mig_uuid", NEW_MIG)];
    let m = wait_for(Duration::from_secs(10), "the DRA rows", || {
        let m = ex.metrics();
        (allocations(&m) == expected(&mig, &new_mig)).then_some(m)
    });
    assert_eq!(counter(&m, "gpumem_exporter_dra_fallbacks_total"), 0.0);
    assert_eq!(
        counter(&m, "gpumem_exporter_resource_slice_errors_total"),
        0.0
    );
    // Listed and watched with this node's field selector, not per scrape.
    {
        let state = node.api.state.lock().unwrap();
        assert!(!state.slice_requests.is_empty());
        for r in &state.slice_requests {
            assert_eq!(
                r.query.get("fieldSelector").map(String::as_str),
                Some(format!("spec.nodeName={NODE}").as_str()),
                "{r:?}"
            );
        }
    }
    let requests = node.api.state.lock().unwrap().slice_requests.len();
    for _ in 0..20 {
        ex.metrics();
    }
    assert!(node.api.state.lock().unwrap().slice_requests.len() <= requests + 1);

    // A claim removed (nb-b's): its row is gone after one more List, the
    // other claim on the same GPU stays.
    let asked = kubelet.lists();
    for p in kubelet.state.lock().unwrap().pods.iter_mut() {
        if p.name == "nb-b" {
            p.containers[0].dynamic_resources.clear();
        }
    }
    let want: Vec<Labels> = expected(&mig, &new_mig)
        .into_iter()
        .filter(|l| l["pod"] != "nb-b")
        .collect();
    let m = wait_for(Duration::from_secs(5), "shared-b's row gone", || {
        let m = ex.metrics();
        (allocations(&m) == want).then_some(m)
    });
    assert!(kubelet.lists() > asked, "after a List");
    assert!(!m.text.contains("shared-b"));
    assert!(m.text.contains("shared-a"));
    assert_eq!(counter(&m, "gpumem_exporter_dra_fallbacks_total"), 0.0);
    assert!(
        !ex.stderr().contains("DRA device placed by the index"),
        "{}",
        ex.stderr()
    );
}

#[test]
fn dra_devices_by_name_when_resource_slices_are_forbidden() {
    let node = FakeNode::start(api_pods());
    {
        let mut state = node.api.state.lock().unwrap();
        state.slices = slices();
        state.slices_forbidden = true;
    }
    let kubelet = FakeKubelet::start(kubelet_pods());
    let (_sc, ex) = start(&node, &kubelet);

    // By the index in the name: the MIG device only as its parent GPU.
    let m = wait_for(
        Duration::from_secs(10),
        "the fallback rows, counted",
        || {
            let m = ex.metrics();
            (allocations(&m)
                == expected(
                    &[("gpu", "1"), ("uuid", GPU1)],
                    &[("gpu", "1"), ("uuid", GPU1)],
                )
                && m.get("gpumem_exporter_dra_fallbacks_total", &[]) >= Some(10.0))
            .then_some(m)
        },
    );
    assert!(counter(&m, "gpumem_exporter_resource_slice_errors_total") >= 1.0);
    assert!(!node.api.state.lock().unwrap().slice_requests.is_empty());
    ex.assert_logged_once("DRA device placed by the index in its name");
    assert!(ex.stderr().contains("cannot be read"), "{}", ex.stderr());
    // Everything else is served.
    assert_eq!(m.find("gpu_up", &[]).len(), 3);
}
