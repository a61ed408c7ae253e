//! End-to-end: the live page at `/` in a real headless Chromium (DevTools
//! protocol), and the JSON API behind it (`/api/v1/snapshot`,
//! `/api/v1/history`): exact values against the scenario, one encode per
//! snapshot however many requests, 503 before the first sample, 400 for a
//! bad query, the page's weight, its Content-Security-Policy, basic auth.
//!
//! The node is the attribution tests' fake one: a /proc root with named
//! processes of known users, and pods from a fake Kubernetes API.

use std::time::Duration;

use serde_json::Value;

use crate::harness::cluster::{
    self, FakeNode, cgroup_containerd, cgroup_crio, cgroup_v1, team_pods,
};
use crate::harness::*;

#[cfg(feature = "external-tools")]
mod external;
#[cfg(feature = "external-tools")]
mod limits;

const GPU0: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
const GPU1: &str = "GPU-bbbbbbbb-1111-1111-1111-111111111111";
const MIB: u64 = 1 << 20;

/// Before and after: GPU 0's notebook grows from 2 GiB to 6 GiB and an
/// `eval` process appears; GPU 1 stops answering.
fn scenario(changed: bool) -> String {
    if changed {
        scenario_at(6144, 3072, true, true)
    } else {
        scenario_at(2048, 3072, false, false)
    }
}

/// GPU 0: a 10 GiB trainer, a notebook of `notebook` MiB, Xorg without a
/// figure, and (`eval`) a 1 GiB eval; GPU 1: a Triton server of `triton`
/// MiB and a 1000 MiB python3, and 24 MiB of driver overhead; `lost`:
/// GPU 1 stops answering.
fn scenario_at(notebook: u64, triton: u64, eval: bool, lost: bool) -> String {
    let used0 = (10240 + notebook + if eval { 1024 } else { 0 }) * MIB;
    let used1 = (triton + 1000 + 24) * MIB;
    let eval = if eval {
        format!(
            "      - {{pid: 4106, used: {}, type: compute}}\n",
            1024 * MIB
        )
    } else {
        String::new()
    };
    let lost = if lost { "gpu_lost" } else { "null" };
    format!(
        "devices:
  - uuid: {GPU0}
    name: NVIDIA H200
    pci_bus_id: \"00000000:00:06.0\"
    memory: {{total: 150754820096, reserved: 644939776, used: {used0}}}
    utilization: {{gpu: 93, memory: 41}}
    processes:
      - {{pid: 4101, used: {}, type: compute}}
      - {{pid: 4103, used: {}, type: compute}}
      - {{pid: 4104, used: null, type: graphics}}
{eval}  - uuid: {GPU1}
    name: NVIDIA A100-SXM4-80GB
    pci_bus_id: \"00000000:00:07.0\"
    memory: {{total: 85899345920, reserved: 536870912, used: {used1}}}
    error: {lost}
    processes:
      - {{pid: 4102, used: {}, type: compute}}
      - {{pid: 4105, used: {}, type: compute}}
",
        10240 * MIB,
        notebook * MIB,
        triton * MIB,
        1000 * MIB,
    )
}

/// The fake node's processes: (pid, comm, uid, cgroup).
fn node() -> FakeNode {
    let node = FakeNode::start(team_pods());
    let host = "0::/system.slice/display-manager.service\n".to_string();
    for (pid, comm, uid, cgroup) in [
        (4101, "python3", 1000, cgroup_containerd('a')),
        (4102, "tritonserver", 1001, cgroup_crio('b')),
        (4103, "jupyter", 4242, cgroup_v1('c')),
        (4104, "Xorg", 0, host.clone()),
        (4105, "python3", 1001, host.clone()),
        (4106, "eval", 1000, host.clone()),
    ] {
        cluster::write_proc(node.proc_root.path(), pid, comm, uid, &cgroup, &[]);
    }
    node
}

/// The exporter on [`node`] and [`scenario`], full samples every
/// `interval`, with `extra` flags; waits until the pods are resolved.
fn start(node: &FakeNode, sc: &Scenario, interval: &str, extra: &[&str]) -> Exporter {
    let cfg = node.config(sc, "").replace(
        "sample_interval: 100ms",
        &format!("sample_interval: {interval}"),
    );
    let ex = Exporter::with_config(sc, &cfg, extra);
    wait_for(Duration::from_secs(20), "pods resolved", || {
        let r = ex.get("/metrics");
        (r.status == 200
            && cluster::pods_resolved(&Metrics::parse(&r.body), &["trainer-0", "infer-7f9c"]))
        .then_some(())
    });
    ex
}

fn json(ex: &Exporter, path: &str) -> (u16, Value) {
    let r = ex.get(path);
    let v = serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("{path}: {e}: {:?}", r.body));
    (r.status, v)
}

#[test]
fn snapshot_json_is_exact() {
    let node = node();
    let sc = Scenario::new(&scenario(false));
    let ex = start(&node, &sc, "100ms", &[]);
    let (status, v) = json(&ex, "/api/v1/snapshot");
    assert_eq!(status, 200);
    assert_eq!(v["schema_version"], 1);
    assert_eq!(v["sample_interval_seconds"], 0.1);
    assert_eq!(
        v["driver"],
        serde_json::json!({"driver_version": "580.159.04", "nvml_version": "13.580.159.04", "cuda_driver_version": "13.0"})
    );
    let age = unix_now() - v["taken_at"].as_f64().unwrap();
    assert!((0.0..5.0).contains(&age), "taken {age} s ago");
    let g0 = &v["gpus"][0];
    assert_eq!(g0["gpu"], "0");
    assert_eq!(g0["uuid"], GPU0);
    assert_eq!(g0["name"], "NVIDIA H200");
    assert_eq!(g0["pci_bus_id"], "00000000:00:06.0");
    assert_eq!(g0["up"], true);
    assert_eq!(
        g0["memory"],
        serde_json::json!({
            "total_bytes": 150754820096u64,
            "reserved_bytes": 644939776u64,
            "used_bytes": 12288 * MIB,
            "free_bytes": 150754820096u64 - 644939776 - 12288 * MIB,
        })
    );
    assert_eq!(g0["memory_used_peak_bytes"], 12288 * MIB);
    assert_eq!(
        g0["utilization"],
        serde_json::json!({"gpu_ratio": 0.93, "memory_ratio": 0.41, "encoder_ratio": null, "decoder_ratio": null})
    );
    assert_eq!(g0["processes_other"], Value::Null);
    assert_eq!(g0["processes_omitted"], Value::Null);
    assert_eq!(g0["mig"], serde_json::json!([]));
    let p = &g0["processes"];
    assert_eq!(
        p[0],
        serde_json::json!({
            "pid": 4101, "process": "python3", "user": "alice",
            "namespace": "team-a", "pod": "trainer-0", "container": "trainer",
            "container_id": cluster::container_id('a'), "pod_uid": cluster::pod_uid('a'),
            "container_name": null, "container_image": null,
            "compose_project": null, "compose_service": null,
            "slurm_job": null, "slurm_step": null, "slurm_uid": null,
            "cmdline": null, "gpu_instance_id": null, "compute_instance_id": null,
            "memory_used_bytes": 10240 * MIB, "memory_used_peak_bytes": 10240 * MIB,
            "utilization": null, "torch": null, "stale": null, "idle_since": null,
        })
    );
    // Xorg has no figure: nothing can be said of the rest; nothing stale.
    assert_eq!(g0["memory_unattributed_bytes"], Value::Null);
    assert_eq!(
        g0["memory_stale_bytes"],
        serde_json::json!({"exited": 0, "zombie": 0, "uninterruptible": 0, "reparented": 0, "owner_deleted": 0})
    );
    // Nothing idle for processes.idle_after (30m) yet.
    assert_eq!(g0["memory_idle_held_bytes"], 0);
    assert_eq!(p[1]["pid"], 4103);
    assert_eq!(p[1]["user"], "4242");
    assert_eq!(p[1]["memory_used_bytes"], 2048 * MIB);
    assert_eq!(p[2]["pid"], 4104);
    assert_eq!(p[2]["memory_used_bytes"], Value::Null, "NVML has no figure");
    assert_eq!(p[2]["namespace"], "");
    assert_eq!(p.as_array().unwrap().len(), 3);
    let g1 = &v["gpus"][1];
    assert_eq!(g1["memory"]["used_bytes"], 4096 * MIB);
    assert_eq!(g1["memory_unattributed_bytes"], 24 * MIB, "driver overhead");
    assert_eq!(g1["utilization"], Value::Null, "not supported on it");
    let pids: Vec<&Value> = g1["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| &p["pid"])
        .collect();
    assert_eq!(pids, [4102, 4105]);
    assert_eq!(v["nvml_errors"], serde_json::json!([]));
    assert_eq!(v["kubernetes"]["synced"], true);
    assert_eq!(v["kubernetes"]["pods"], 3);

    // The same figures as /metrics.
    let m = ex.metrics();
    let g = [("gpu", "0"), ("uuid", GPU0)];
    assert_eq!(m.get_u64("gpu_memory_total_bytes", &g), Some(150754820096));

    // GPU 1 lost: up false, memory null, an error counted.
    sc.write(&scenario(true));
    let v = wait_for(Duration::from_secs(10), "GPU 1 down", || {
        let (_, v) = json(&ex, "/api/v1/snapshot");
        (v["gpus"][1]["up"] == false).then_some(v)
    });
    assert_eq!(v["gpus"][1]["memory"], Value::Null);
    assert_eq!(
        v["gpus"][1]["name"], "NVIDIA A100-SXM4-80GB",
        "identity kept"
    );
    let errors = v["nvml_errors"].as_array().unwrap();
    assert!(
        errors
            .iter()
            .any(|e| e["error"] == "gpu_lost" && e["count"].as_u64() > Some(0)),
        "{errors:?}"
    );

    // History: one point a second, of the used memory, newest last.
    let (status, h) = json(&ex, "/api/v1/history?seconds=600");
    assert_eq!(status, 200);
    assert_eq!(h["schema_version"], 1);
    assert_eq!(h["seconds"], 600);
    assert_eq!(h["resolution_seconds"], 1);
    assert_eq!(h["gpus"][0]["uuid"], GPU0);
    assert_eq!(h["gpus"][0]["memory_total_bytes"], 150754820096u64);
    let points = h["gpus"][0]["points"].as_array().unwrap();
    assert!(!points.is_empty());
    let last = points.last().unwrap();
    assert_eq!(last[1], 17408 * MIB, "{points:?}");
    for w in points.windows(2) {
        assert!(
            w[0][0].as_u64() < w[1][0].as_u64(),
            "one point a second: {points:?}"
        );
    }
    let values: Vec<u64> = points.iter().map(|p| p[1].as_u64().unwrap()).collect();
    assert!(
        values
            .iter()
            .all(|v| [12288 * MIB, 17408 * MIB].contains(v)),
        "{values:?}"
    );
    assert_eq!(h["gpus"][1]["memory_total_bytes"], Value::Null, "down now");
    let (_, h1) = json(&ex, "/api/v1/history?seconds=1");
    assert!(h1["gpus"][0]["points"].as_array().unwrap().len() <= 1);

    for bad in [
        "seconds=0",
        "seconds=601",
        "seconds=abc",
        "seconds=",
        "seconds=1&seconds=2",
    ] {
        let (status, v) = json(&ex, &format!("/api/v1/history?{bad}"));
        assert_eq!(status, 400, "{bad}");
        assert!(
            v["error"].as_str().unwrap().contains("seconds"),
            "{bad}: {v}"
        );
    }
}

/// `body` label → the encode counter in a /metrics scrape.
fn encodes(m: &Metrics) -> Vec<u64> {
    ["text", "snapshot_json", "history_json"]
        .iter()
        .map(|b| {
            m.get_u64("gpumem_exporter_http_body_encodes_total", &[("body", b)])
                .unwrap_or_else(|| panic!("encodes of {b}"))
        })
        .collect()
}

fn sample_time(m: &Metrics) -> String {
    m.samples["gpumem_exporter_last_sample_timestamp_seconds"].clone()
}

/// Many requests for one snapshot, one encode per body: the counters of
/// the snapshot after it (copied in when that one was published) show
/// exactly one text, one JSON snapshot and one history per `seconds`.
#[test]
fn json_bodies_are_encoded_once_per_snapshot() {
    let sc = Scenario::new(&scenario(false));
    let ex = Exporter::start(
        &sc,
        &["--sample-interval", "2s", "--memory-sample-interval", "2s"],
    );
    wait_for(Duration::from_secs(10), "first sample", || {
        (ex.get("/metrics").status == 200).then_some(())
    });
    let mut tries = 0;
    loop {
        tries += 1;
        assert!(tries <= 5, "the snapshot kept changing during the requests");
        // Wait for a fresh snapshot: its counters are those at its publication.
        let first = ex.metrics();
        let m1 = wait_for(Duration::from_secs(5), "a new snapshot", || {
            let m = ex.metrics();
            (sample_time(&m) != sample_time(&first)).then_some(m)
        });
        let mut taken = std::collections::BTreeSet::new();
        for i in 0..40 {
            let gzip = [("Accept-Encoding", "gzip")];
            let headers: &[(&str, &str)] = if i % 2 == 0 { &gzip } else { &[] };
            let (enc, body) = http_get_bytes(ex.addr, "/api/v1/snapshot", headers);
            let body = if enc.as_deref() == Some("gzip") {
                let mut out = String::new();
                std::io::Read::read_to_string(
                    &mut flate2::read::GzDecoder::new(&body[..]),
                    &mut out,
                )
                .unwrap();
                out
            } else {
                String::from_utf8(body).unwrap()
            };
            let v: Value = serde_json::from_str(&body).unwrap();
            taken.insert(v["taken_at"].to_string());
            for s in ["600", "60"] {
                let (_, h) = json(&ex, &format!("/api/v1/history?seconds={s}"));
                taken.insert(h["taken_at"].to_string());
            }
            assert_eq!(ex.get("/metrics").status, 200);
        }
        let m2 = wait_for(Duration::from_secs(5), "the next snapshot", || {
            let m = ex.metrics();
            (sample_time(&m) != sample_time(&m1)).then_some(m)
        });
        if taken.len() != 1 {
            continue;
        }
        let (e1, e2) = (encodes(&m1), encodes(&m2));
        let delta: Vec<u64> = e1.iter().zip(&e2).map(|(a, b)| b - a).collect();
        // text: the one of the snapshot asked for 40 times (the next
        // one's is encoded after it was published); JSON: one; history:
        // one per `seconds`.
        assert_eq!(delta, [1, 1, 2], "{e1:?} → {e2:?}");
        return;
    }
}

#[test]
fn page_headers_weight_and_auth() {
    let sc = Scenario::new(&scenario(false));
    let hash = bcrypt::hash_with_salt("pw", 4, [7; 16])
        .unwrap()
        .to_string();
    let web = sc.file(
        "web.yml",
        format!("basic_auth_users:\n  ops: {hash}\n").as_bytes(),
    );
    let ex = Exporter::start(
        &sc,
        &[
            "--web.config.file",
            web.to_str().unwrap(),
            "--web.telemetry-path",
            "/gpu/metrics",
        ],
    );
    use base64::Engine;
    let auth = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("ops:pw")
    );
    for path in [
        "/",
        "/page/app.js",
        "/page/style.css",
        "/api/v1/snapshot",
        "/api/v1/history",
    ] {
        assert_eq!(ex.get(path).status, 401, "{path} without credentials");
    }
    let get = |path: &str| http_get(ex.addr, path, &[("Authorization", &auth)]);
    wait_for(Duration::from_secs(10), "first sample", || {
        (get("/api/v1/snapshot").status == 200).then_some(())
    });
    let mut weight = 0;
    for (path, kind) in [
        ("/", "text/html; charset=utf-8"),
        ("/page/app.js", "text/javascript; charset=utf-8"),
        ("/page/style.css", "text/css; charset=utf-8"),
    ] {
        let r = get(path);
        assert_eq!(r.status, 200, "{path}");
        assert_eq!(r.header("content-type"), Some(kind), "{path}");
        assert_eq!(
            r.header("content-security-policy"),
            Some(
                "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                 img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
            ),
            "{path}"
        );
        assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
        weight += r.body.len();
    }
    assert!(weight <= 50 * 1024, "page weight {weight} bytes > 50 KB");
    eprintln!("page weight: {weight} bytes");
    let index = get("/").body;
    assert!(index.contains("href=\"/gpu/metrics\""), "{index}");
    let api = get("/api/v1/snapshot");
    assert_eq!(api.header("content-type"), Some("application/json"));
    assert_eq!(api.header("cache-control"), Some("no-store"));
}
