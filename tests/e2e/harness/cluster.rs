//! A fake node: a /proc root laid out like the kernel's, pods as the API
//! server serialises them, and a local HTTPS server speaking the Kubernetes
//! list/watch wire format as kube-rs uses it (paged PodList JSON, then
//! watch streams of newline-delimited events that the test writes to;
//! ResourceSlices listed and watched, ResourceClaims read by name), with
//! a CA of its own and, when asked, bearer-token or client-certificate
//! authentication.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, Query, RawQuery, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use http_body_util::channel::{Channel, Sender};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::{Metrics, Scenario};

/// The node the exporter and the pod watcher run on.
pub const NODE: &str = "gpu-node-1";

/// The node's /etc/passwd: alice is uid 1000, bob 1001.
pub const PASSWD: &[u8] = b"root:x:0:0:root:/root:/bin/bash\nalice:x:1000:1000::/home/alice:/bin/sh\nbob:x:1001:1001::/home/bob:/bin/sh\n";

/// A container id (64 hex) made of one repeated hex digit.
pub fn container_id(seed: char) -> String {
    std::iter::repeat_n(seed, 64).collect()
}

/// A pod UID (8-4-4-4-12 hex) made of one repeated hex digit.
pub fn pod_uid(seed: char) -> String {
    let s: String = std::iter::repeat_n(seed, 32).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &s[..8],
        &s[8..12],
        &s[12..16],
        &s[16..20],
        &s[20..]
    )
}

// ------------------------------------------------------------------ /proc

/// The fake cgroup filesystem beside a fake /proc root (`path.cgroupfs`):
/// a hybrid layout, cgroup v2 at `unified/`, each v1 hierarchy at its
/// controllers' name.
pub fn cgroupfs_of(proc_root: &Path) -> std::path::PathBuf {
    proc_root.join("cgroupfs")
}

/// The directories of every line of a `/proc/<pid>/cgroup` in the fake
/// cgroup filesystem of `proc_root`, made by whoever runs the test (root
/// on CI, as the kubelet, the engines and slurmd make theirs), so the
/// exporter's owner check finds them.
pub fn write_cgroup_dirs(proc_root: &Path, cgroup: &str) {
    for line in cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let hierarchy = match controllers {
            "" => "unified",
            c => c.strip_prefix("name=").unwrap_or(c),
        };
        let path = path.trim().trim_start_matches('/');
        if path.split('/').any(|s| s == ".." || s == ".") {
            continue;
        }
        std::fs::create_dir_all(cgroupfs_of(proc_root).join(hierarchy).join(path)).unwrap();
    }
}

/// One process in a fake /proc root: comm, stat (start time = 1000 + pid),
/// status (uid), cgroup and cmdline (`comm` when `cmdline` is empty); its
/// cgroup's directories in the fake cgroup filesystem beside it
/// ([`write_cgroup_dirs`]).
pub fn write_proc(root: &Path, pid: u32, comm: &str, uid: u32, cgroup: &str, cmdline: &[&str]) {
    write_cgroup_dirs(root, cgroup);
    let dir = root.join(pid.to_string());
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("comm"), format!("{comm}\n")).unwrap();
    // Field 22 (start time) is the last one here.
    std::fs::write(
        dir.join("stat"),
        format!(
            "{pid} ({comm}) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {}\n",
            1000 + pid
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("status"),
        format!("Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"),
    )
    .unwrap();
    std::fs::write(dir.join("cgroup"), cgroup).unwrap();
    let mut cmd = if cmdline.is_empty() {
        comm.to_string()
    } else {
        cmdline.join("\0")
    };
    cmd.push('\0');
    std::fs::write(dir.join("cmdline"), cmd).unwrap();
}

/// The cgroup file of a container of pod `pod_uid(seed)` under containerd,
/// systemd cgroup driver, cgroup v2.
pub fn cgroup_containerd(seed: char) -> String {
    containerd_cgroup(&pod_uid(seed), &container_id(seed))
}

/// The cgroup file of container `container_id` of the pod with UID
/// `pod_uid` under containerd, systemd cgroup driver, cgroup v2.
pub fn containerd_cgroup(pod_uid: &str, container_id: &str) -> String {
    format!(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{container_id}.scope\n",
        pod_uid.replace('-', "_"),
    )
}

/// The same under CRI-O, systemd driver, cgroup v2.
pub fn cgroup_crio(seed: char) -> String {
    format!(
        "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/crio-{}.scope\n",
        pod_uid(seed).replace('-', "_"),
        container_id(seed)
    )
}

/// The same under the cgroupfs driver, cgroup v1.
pub fn cgroup_v1(seed: char) -> String {
    format!(
        "12:memory:/kubepods/burstable/pod{u}/{c}\n11:cpu,cpuacct:/kubepods/burstable/pod{u}/{c}\n1:name=systemd:/kubepods/burstable/pod{u}/{c}\n",
        u = pod_uid(seed),
        c = container_id(seed)
    )
}

// ------------------------------------------------------------------ pods

/// A pod as the API server serialises it (trimmed, but with the noise real
/// objects carry: labels, owner references, managed fields, image ids).
/// `containers`: (name, containerID with runtime prefix, or None while
/// pending).
pub fn pod(
    ns: &str,
    name: &str,
    uid: &str,
    node: &str,
    rv: &str,
    containers: &[(&str, Option<String>)],
) -> Value {
    let statuses: Vec<Value> = containers
        .iter()
        .map(|(c, id)| {
            let mut s = json!({
                "name": c,
                "image": "nvcr.io/nvidia/pytorch:24.01-py3",
                "imageID": "nvcr.io/nvidia/pytorch@sha256:4f2e",
                "ready": id.is_some(),
                "restartCount": 0,
                "started": id.is_some(),
            });
            match id {
                Some(id) => {
                    s["containerID"] = json!(id);
                    s["state"] = json!({"running": {"startedAt": "2025-06-01T10:00:00Z"}});
                }
                None => s["state"] = json!({"waiting": {"reason": "ContainerCreating"}}),
            }
            s
        })
        .collect();
    json!({
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": uid,
            "resourceVersion": rv,
            "creationTimestamp": "2025-06-01T09:59:58Z",
            "labels": {"app.kubernetes.io/name": name},
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": "0000", "controller": true}],
            "managedFields": [{"manager": "kubelet", "operation": "Update", "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {}}}]
        },
        "spec": {
            "nodeName": node,
            "containers": containers.iter().map(|(c, _)| json!({
                "name": c,
                "image": "nvcr.io/nvidia/pytorch:24.01-py3",
                "resources": {"limits": {"nvidia.com/gpu": "1"}}
            })).collect::<Vec<_>>(),
            "restartPolicy": "Never",
            "schedulerName": "default-scheduler"
        },
        "status": {
            "phase": "Running",
            "hostIP": "10.0.0.5",
            "podIP": "10.244.1.17",
            "qosClass": "Burstable",
            "containerStatuses": statuses
        }
    })
}

/// A running pod on [`NODE`] with one container, its UID and container id
/// made from `seed` (see [`pod_uid`], [`container_id`]).
pub fn seeded_pod(ns: &str, name: &str, seed: char, container: &str, runtime: &str) -> Value {
    pod(
        ns,
        name,
        &pod_uid(seed),
        NODE,
        "10",
        &[(
            container,
            Some(format!("{runtime}://{}", container_id(seed))),
        )],
    )
}

/// Three pods of two teams, each with another runtime: their processes'
/// cgroups are [`cgroup_containerd`]`('a')`, [`cgroup_crio`]`('b')` and
/// [`cgroup_v1`]`('c')`.
pub fn team_pods() -> Vec<Value> {
    vec![
        seeded_pod("team-a", "trainer-0", 'a', "trainer", "containerd"),
        seeded_pod("team-b", "infer-7f9c", 'b', "server", "cri-o"),
        seeded_pod("team-a", "notebook", 'c', "jupyter", "containerd"),
    ]
}

/// Each of `pods` names exactly one process series: the watcher has
/// resolved them.
pub fn pods_resolved(m: &Metrics, pods: &[&str]) -> bool {
    assert!(!pods.is_empty(), "which pods?");
    pods.iter().all(|pod| {
        m.find("gpu_process_memory_used_bytes", &[("pod", pod)])
            .len()
            == 1
    })
}

/// One line of a watch stream.
pub fn event(kind: &str, object: Value) -> String {
    format!("{}\n", json!({"type": kind, "object": object}))
}

// ------------------------------------------------------------------ API server

/// What the API server saw of one request.
#[derive(Debug, Clone)]
pub struct Request {
    pub query: BTreeMap<String, String>,
    pub raw_query: String,
    pub auth: Option<String>,
    /// The client certificate (DER) the TLS handshake verified, if any.
    pub client_cert: Option<Vec<u8>>,
}

/// Credentials the API server accepts; anything else gets 401.
#[derive(Debug, Clone, Default)]
pub struct Accept {
    /// `Authorization: Bearer <token>` with one of these.
    pub tokens: Vec<String>,
    /// A verified client certificate (signed by [`Pki`]'s CA) with this DER.
    pub client_cert: Option<Vec<u8>>,
}

/// The API server's pods and what it was asked.
#[derive(Default)]
pub struct ApiState {
    pub items: Vec<Value>,
    pub rv: String,
    /// Pods per LIST page, so pagination is exercised; 0: all in one.
    pub page_size: usize,
    pub lists: Vec<Request>,
    pub watches: Vec<Request>,
    /// Requests refused with 401.
    pub refused: Vec<Request>,
    /// Answer the next watch request with this status instead of a stream.
    pub next_watch_status: Option<StatusCode>,
    /// Watch requests answered with [`ApiState::next_watch_status`].
    pub watches_refused: u64,
    /// `None`: any request is served (no authentication).
    pub require: Option<Accept>,
    /// ResourceSlices (`resource.k8s.io/v1`) served at
    /// `/apis/resource.k8s.io/v1/resourceslices`, filtered by the
    /// `spec.nodeName` field selector as the API server does.
    pub slices: Vec<Value>,
    /// Refuse every ResourceSlice request with 403 Forbidden (no RBAC).
    pub slices_forbidden: bool,
    /// ResourceSlice requests (lists and watches), refused ones included.
    pub slice_requests: Vec<Request>,
    /// Open ResourceSlice watch streams (silent; kept so they stay open).
    pub slice_watches: Vec<WatchStream>,
    /// ResourceClaims (`resource.k8s.io/v1`), each served by GET at
    /// `/apis/resource.k8s.io/v1/namespaces/<ns>/resourceclaims/<name>`
    /// (404 for any other name).
    pub claims: Vec<Value>,
    /// Refuse every ResourceClaim request with 403 Forbidden (no RBAC).
    pub claims_forbidden: bool,
    /// ResourceClaim requests as `<ns>/<name>`, refused ones included.
    pub claim_requests: Vec<String>,
}

/// The body of one watch response: what the test sends is what the
/// watcher reads.
pub type WatchStream = Sender<Bytes, std::io::Error>;

#[derive(Clone)]
struct Shared {
    state: Arc<Mutex<ApiState>>,
    new_watches: mpsc::UnboundedSender<(Request, WatchStream)>,
}

/// The client certificate of one TLS connection, handed to the handler.
#[derive(Clone)]
struct Peer(Option<Vec<u8>>);

/// 410 Gone, as the API server says it for a resourceVersion too old.
pub fn gone() -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "too old resource version: 1011 (1500)", "reason": "Expired", "code": 410
    })
}

fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        axum::Json(json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "Unauthorized", "reason": "Unauthorized", "code": 401
        })),
    )
        .into_response()
}

async fn pods_handler(
    State(api): State<Shared>,
    Extension(Peer(client_cert)): Extension<Peer>,
    RawQuery(raw): RawQuery,
    Query(query): Query<BTreeMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let seen = Request {
        query: query.clone(),
        raw_query: raw.unwrap_or_default(),
        auth: headers
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        client_cert,
    };
    let mut state = api.state.lock().unwrap();
    if let Some(accept) = &state.require {
        let token_ok = seen.auth.as_deref().is_some_and(|a| {
            accept
                .tokens
                .iter()
                .any(|t| a == format!("Bearer {t}").as_str())
        });
        let cert_ok = seen.client_cert.is_some() && seen.client_cert == accept.client_cert;
        if !token_ok && !cert_ok {
            state.refused.push(seen);
            return unauthorized();
        }
    }
    if matches!(query.get("watch").map(String::as_str), Some("1" | "true")) {
        state.watches.push(seen.clone());
        if let Some(status) = state.next_watch_status.take() {
            state.watches_refused += 1;
            return (status, axum::Json(gone())).into_response();
        }
        let (tx, body) = Channel::<Bytes, std::io::Error>::new(64);
        // The test may be gone already; the stream then just stays silent.
        let _ = api.new_watches.send((seen, tx));
        return Response::builder()
            .header(CONTENT_TYPE, "application/json")
            .body(Body::new(body))
            .unwrap();
    }
    state.lists.push(seen);
    // Continue tokens are opaque; this one needs percent-encoding.
    let offset: usize = query
        .get("continue")
        .and_then(|c| c.strip_prefix("c+/"))
        .and_then(|c| c.strip_suffix('='))
        .map_or(0, |n| n.parse().unwrap());
    let page = if state.page_size == 0 {
        state.items.len()
    } else {
        state.page_size
    };
    let end = (offset + page).min(state.items.len());
    let token = if end < state.items.len() {
        format!("c+/{end}=")
    } else {
        String::new()
    };
    let items = &state.items[offset..end];
    axum::Json(json!({
        "kind": "PodList",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": state.rv, "continue": token},
        "items": items
    }))
    .into_response()
}

/// A ResourceSlice of `driver` on `node` (pool named after the node, as
/// NVIDIA's DRA driver does), with `devices`: (name, attributes as the
/// API serialises them, e.g. `{"uuid": {"string": "GPU-…"}}`).
pub fn resource_slice(node: &str, driver: &str, devices: &[(&str, Value)]) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "name": format!("{node}-{driver}-x7k2p"),
            "resourceVersion": "10",
            "uid": "5f0c1d2e-0000-4000-8000-000000000001",
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": "0000", "controller": true}]
        },
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices.iter().map(|(name, attributes)| json!({
                "name": name,
                "attributes": attributes,
                "capacity": {"memory": {"value": "80Gi"}}
            })).collect::<Vec<_>>()
        }
    })
}

async fn slices_handler(
    State(api): State<Shared>,
    RawQuery(raw): RawQuery,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    let seen = Request {
        query: query.clone(),
        raw_query: raw.unwrap_or_default(),
        auth: None,
        client_cert: None,
    };
    let mut state = api.state.lock().unwrap();
    state.slice_requests.push(seen);
    if state.slices_forbidden {
        return (
            StatusCode::FORBIDDEN,
            axum::Json(json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "resourceslices.resource.k8s.io is forbidden: User \"system:serviceaccount:monitoring:gpumem-exporter\" cannot list resource \"resourceslices\" in API group \"resource.k8s.io\" at the cluster scope",
                "reason": "Forbidden", "details": {"group": "resource.k8s.io", "kind": "resourceslices"}, "code": 403
            })),
        )
            .into_response();
    }
    if matches!(query.get("watch").map(String::as_str), Some("1" | "true")) {
        let (tx, body) = Channel::<Bytes, std::io::Error>::new(64);
        state.slice_watches.push(tx);
        return Response::builder()
            .header(CONTENT_TYPE, "application/json")
            .body(Body::new(body))
            .unwrap();
    }
    let node = query
        .get("fieldSelector")
        .and_then(|f| f.strip_prefix("spec.nodeName="));
    let items: Vec<&Value> = state
        .slices
        .iter()
        .filter(|s| node.is_none_or(|n| s["spec"]["nodeName"] == n))
        .collect();
    axum::Json(json!({
        "kind": "ResourceSliceList",
        "apiVersion": "resource.k8s.io/v1",
        "metadata": {"resourceVersion": state.rv},
        "items": items
    }))
    .into_response()
}

/// A ResourceClaim in `ns`, allocated on this node's pool of `driver`
/// with DRA consumable capacity: per result, the device and the memory it
/// consumed (`None`: no `consumedCapacity`, an exclusive device).
pub fn resource_claim(
    ns: &str,
    name: &str,
    driver: &str,
    results: &[(&str, Option<&str>)],
) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": "7c1a0000-0000-4000-8000-000000000001",
            "resourceVersion": "12",
            "creationTimestamp": "2025-06-01T09:59:50Z"
        },
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": driver,
            "allocationMode": "ExactCount",
            "count": 1,
            "capacity": {"requests": {"memory": "20Gi"}}
        }}]}},
        "status": {
            "allocation": {
                "devices": {"results": results.iter().enumerate().map(|(i, (device, memory))| {
                    let mut r = json!({
                        "request": "gpu", "driver": driver, "pool": NODE, "device": device,
                        "shareID": format!("0e5c0000-0000-4000-8000-00000000000{i}")
                    });
                    if let Some(m) = memory {
                        r["consumedCapacity"] = json!({"memory": m});
                    }
                    r
                }).collect::<Vec<_>>()},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]},
                "allocationTimestamp": "2025-06-01T09:59:55Z"
            },
            "reservedFor": [{"resource": "pods", "name": "x", "uid": "0000"}]
        }
    })
}

async fn claims_handler(
    State(api): State<Shared>,
    UrlPath((ns, name)): UrlPath<(String, String)>,
) -> Response {
    let mut state = api.state.lock().unwrap();
    state.claim_requests.push(format!("{ns}/{name}"));
    if state.claims_forbidden {
        return (
            StatusCode::FORBIDDEN,
            axum::Json(json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": format!("resourceclaims.resource.k8s.io \"{name}\" is forbidden: User \"system:serviceaccount:monitoring:gpumem-exporter\" cannot get resource \"resourceclaims\" in API group \"resource.k8s.io\" in the namespace \"{ns}\""),
                "reason": "Forbidden", "details": {"name": name, "group": "resource.k8s.io", "kind": "resourceclaims"}, "code": 403
            })),
        )
            .into_response();
    }
    match state
        .claims
        .iter()
        .find(|c| c["metadata"]["namespace"] == ns.as_str() && c["metadata"]["name"] == name.as_str())
    {
        Some(c) => axum::Json(c.clone()).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            axum::Json(json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": format!("resourceclaims.resource.k8s.io \"{name}\" not found"),
                "reason": "NotFound", "details": {"name": name, "group": "resource.k8s.io", "kind": "resourceclaims"}, "code": 404
            })),
        )
            .into_response(),
    }
}

/// A CA made for one test, and what it signs: the API server's certificate
/// (localhost, 127.0.0.1) and client certificates.
pub struct Pki {
    pub ca_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Pki {
    pub fn new(name: &str) -> Pki {
        let mut params = CertificateParams::new(Vec::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Pki {
            ca_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// (certificate PEM, key PEM, certificate DER) for `names`.
    pub fn leaf(
        &self,
        names: &[&str],
        usage: ExtendedKeyUsagePurpose,
    ) -> (String, String, Vec<u8>) {
        let mut params =
            CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.distinguished_name.push(DnType::CommonName, names[0]);
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem(), cert.der().to_vec())
    }

    /// A client certificate for user `name` (as a kubelet's kubeconfig has).
    pub fn client(&self, name: &str) -> (String, String, Vec<u8>) {
        self.leaf(&[name], ExtendedKeyUsagePurpose::ClientAuth)
    }
}

/// rustls server config: the server certificate of `pki`, client
/// certificates of `pki`'s CA verified when presented (not required).
fn tls_config(pki: &Pki) -> rustls::ServerConfig {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let (cert, key, _) = pki.leaf(
        &["localhost", "127.0.0.1"],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(pki.ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::clone(&provider),
    )
    .allow_unauthenticated()
    .build()
    .unwrap();
    rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            CertificateDer::pem_slice_iter(cert.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .unwrap(),
            PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
        )
        .unwrap()
}

/// The local Kubernetes API, serving `/api/v1/pods` over TLS (a CA made
/// for it, [`FakeApi::ca_file`]) on a loopback port of the tokio runtime
/// it was started on. LIST answers pages of [`ApiState::items`]; each WATCH
/// opens a stream the test takes with [`FakeApi::next_watch`] (or
/// [`FakeApi::delete`] writes to). With [`ApiState::require`] set, only
/// those credentials are served.
pub struct FakeApi {
    pub state: Arc<Mutex<ApiState>>,
    pub addr: SocketAddr,
    pub pki: Pki,
    /// Holds ca.pem, and kubeconfig files the tests write.
    pub dir: tempfile::TempDir,
    new_watches: mpsc::UnboundedReceiver<(Request, WatchStream)>,
    /// Watch streams taken by `delete`, still open.
    open: Vec<WatchStream>,
    /// Read by [`FakeApi::restart`], which only the chaos soak (built with
    /// the external-tools feature) calls.
    #[cfg_attr(not(feature = "external-tools"), allow(dead_code))]
    server: Server,
}

/// The listening side of [`FakeApi`]: its accept loop and the tasks of
/// its open connections, so a restart can drop them all.
#[cfg_attr(not(feature = "external-tools"), allow(dead_code))]
struct Server {
    acceptor: tokio_rustls::TlsAcceptor,
    app: Router,
    accept: tokio::task::JoinHandle<()>,
    conns: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

/// Accept TLS connections on `listener` and serve `app` on each, every
/// connection's task kept in `conns`.
fn serve(
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    app: Router,
    conns: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let (acceptor, app) = (acceptor.clone(), app.clone());
            let conn = tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let cert = tls
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .map(|c| c.to_vec());
                let svc = hyper_util::service::TowerToHyperService::new(
                    app.layer(axum::Extension(Peer(cert))),
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                    .await;
            });
            let mut open = conns.lock().unwrap();
            open.retain(|c| !c.is_finished());
            open.push(conn.abort_handle());
        }
    })
}

impl FakeApi {
    /// Serve `items` at resourceVersion `rv`, `page_size` pods per LIST
    /// page (0: all in one).
    pub async fn start(items: Vec<Value>, rv: &str, page_size: usize) -> FakeApi {
        let state = Arc::new(Mutex::new(ApiState {
            items,
            rv: rv.into(),
            page_size,
            ..Default::default()
        }));
        let (tx, new_watches) = mpsc::unbounded_channel();
        let app = Router::new()
            .route("/api/v1/pods", get(pods_handler))
            .route(
                "/apis/resource.k8s.io/v1/resourceslices",
                get(slices_handler),
            )
            .route(
                "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}",
                get(claims_handler),
            )
            .with_state(Shared {
                state: Arc::clone(&state),
                new_watches: tx,
            });
        let pki = Pki::new("fake kubernetes CA");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls_config(&pki)));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let conns = Arc::new(Mutex::new(Vec::new()));
        let accept = serve(listener, acceptor.clone(), app.clone(), Arc::clone(&conns));
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.pem"), &pki.ca_pem).unwrap();
        FakeApi {
            state,
            addr,
            pki,
            dir,
            new_watches,
            open: Vec::new(),
            server: Server {
                acceptor,
                app,
                accept,
                conns,
            },
        }
    }

    /// The API server restarts: every connection (watch streams included)
    /// is dropped and the port refuses connections for `down`; then it
    /// serves the same objects on the same address, and answers the first
    /// watch after the restart with 410 Gone (its watch cache is new, the
    /// client's resourceVersion too old), so the client must list again.
    #[cfg_attr(not(feature = "external-tools"), allow(dead_code))]
    pub async fn restart(&mut self, down: Duration) {
        self.server.accept.abort();
        for conn in self.server.conns.lock().unwrap().drain(..) {
            conn.abort();
        }
        self.open.clear();
        while self.new_watches.try_recv().is_ok() {}
        self.state.lock().unwrap().slice_watches.clear();
        tokio::time::sleep(down).await;
        self.state.lock().unwrap().next_watch_status = Some(StatusCode::GONE);
        let listener = tokio::net::TcpListener::bind(self.addr).await.unwrap();
        self.server.accept = serve(
            listener,
            self.server.acceptor.clone(),
            self.server.app.clone(),
            Arc::clone(&self.server.conns),
        );
    }

    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// The CA bundle (PEM) that signed the server's certificate.
    pub fn ca_file(&self) -> std::path::PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A kubeconfig whose current context is this API server with `user`
    /// (the YAML under `user:`, e.g. `token: x`), beside a context of
    /// another cluster that must not be used; written to `name` in
    /// [`FakeApi::dir`].
    pub fn kubeconfig(&self, name: &str, user: &str) -> std::path::PathBuf {
        use base64::Engine;
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let user: String = user.lines().map(|l| format!("      {l}\n")).collect();
        let text = format!(
            "apiVersion: v1
kind: Config
clusters:
  - name: elsewhere
    cluster:
      server: https://127.0.0.1:1
  - name: fake
    cluster:
      server: {}
      certificate-authority-data: {}
users:
  - name: nobody
    user:
      token: not-this-one
  - name: exporter
    user:
{user}contexts:
  - name: elsewhere
    context: {{cluster: elsewhere, user: nobody}}
  - name: gpu-node
    context: {{cluster: fake, user: exporter}}
current-context: gpu-node
",
            self.url(),
            b64(&self.pki.ca_pem),
        );
        let path = self.dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// A kubeconfig with a client certificate made for `user` (and the
    /// server set to accept exactly that certificate).
    pub fn kubeconfig_with_client_cert(&self, name: &str, user: &str) -> std::path::PathBuf {
        use base64::Engine;
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let (cert, key, der) = self.pki.client(user);
        self.state.lock().unwrap().require = Some(Accept {
            tokens: Vec::new(),
            client_cert: Some(der),
        });
        self.kubeconfig(
            name,
            &format!(
                "client-certificate-data: {}\nclient-key-data: {}",
                b64(&cert),
                b64(&key)
            ),
        )
    }

    /// The next watch request and its stream (they queue up in order).
    pub async fn next_watch(&mut self) -> (Request, WatchStream) {
        tokio::time::timeout(Duration::from_secs(5), self.new_watches.recv())
            .await
            .expect("no watch request within 5 s")
            .unwrap()
    }

    /// Remove a pod and tell every open watch, as the API server does.
    pub async fn delete(&mut self, name: &str) {
        let gone = {
            let mut state = self.state.lock().unwrap();
            let i = state
                .items
                .iter()
                .position(|p| p["metadata"]["name"] == name)
                .unwrap_or_else(|| panic!("no pod {name}"));
            let mut pod = state.items.remove(i);
            // A DELETED event carries a newer resourceVersion.
            pod["metadata"]["resourceVersion"] = json!("99999");
            pod
        };
        while let Ok((_, stream)) = self.new_watches.try_recv() {
            self.open.push(stream);
        }
        if self.open.is_empty() {
            // The watcher lists first, then watches: let it get there.
            let (_, stream) = self.next_watch().await;
            self.open.push(stream);
        }
        let line = event("DELETED", gone);
        let mut still_open = Vec::new();
        for mut stream in self.open.drain(..) {
            if stream.send_data(Bytes::from(line.clone())).await.is_ok() {
                still_open.push(stream);
            }
        }
        self.open = still_open;
    }
}

// ------------------------------------------------------------------ node

/// A node for the real exporter: the fake API, on a runtime of its own,
/// serving `pods`, and an empty /proc root to fill with [`write_proc`].
pub struct FakeNode {
    pub rt: tokio::runtime::Runtime,
    pub api: FakeApi,
    pub proc_root: tempfile::TempDir,
}

impl FakeNode {
    pub fn start(pods: Vec<Value>) -> FakeNode {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let api = rt.block_on(FakeApi::start(pods, "10", 0));
        FakeNode {
            rt,
            api,
            proc_root: tempfile::tempdir().unwrap(),
        }
    }

    /// The config of an exporter on this node: a sample every 100 ms,
    /// this /proc root and [`PASSWD`] (written beside `scenario`),
    /// `processes` (lines under `processes:`, each indented two spaces),
    /// the pod watcher on this API (its URL and CA as keys) and [`NODE`].
    pub fn config(&self, scenario: &Scenario, processes: &str) -> String {
        self.config_with(scenario, processes, "  pod_resources_socket: \"\"\n")
    }

    /// [`FakeNode::config`] with `kubernetes` (more lines under
    /// `kubernetes:`, e.g. the pod-resources socket) instead of the
    /// pod-resources client turned off.
    pub fn config_with(&self, scenario: &Scenario, processes: &str, kubernetes: &str) -> String {
        format!(
            "{}kubernetes:\n  enabled: true\n  api_url: {}\n  ca_file: {}\n  node_name: {NODE}\n{kubernetes}",
            self.base_config(scenario, processes),
            self.api.url(),
            self.api.ca_file().display(),
        )
    }

    /// [`FakeNode::config`] without the `kubernetes:` keys.
    pub fn base_config(&self, scenario: &Scenario, processes: &str) -> String {
        let passwd = scenario.file("passwd", PASSWD);
        format!(
            "sample_interval: 100ms\npath:\n  procfs: {}\n  cgroupfs: {}\nprocesses:\n  passwd_file: {}\n{processes}",
            self.proc_root.path().display(),
            cgroupfs_of(self.proc_root.path()).display(),
            passwd.display(),
        )
    }

    /// Delete a pod from the API (see [`FakeApi::delete`]).
    pub fn delete(&mut self, name: &str) {
        self.rt.block_on(self.api.delete(name));
    }
}
