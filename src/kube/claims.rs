//! DRA limits: the memory a ResourceClaim's allocation consumed of a
//! shared device (`status.allocation.devices.results[].consumedCapacity`,
//! `memory`; DRA consumable capacity, `resource.k8s.io/v1`), for the
//! claims the kubelet's pod-resources answer names on this node.
//!
//! - **Only the claims the kubelet names.** The pod-resources client hands
//!   over each answer's DRA devices (pod UID, claim, driver, pool, device,
//!   the device's UUID from this node's ResourceSlices); this reader GETs
//!   those claims by namespace and name. No list, no watch: claims carry
//!   no node to select by, so a watch would bring every node the whole
//!   cluster's claims; RBAC `get` on `resourceclaims` is all it needs.
//! - **Its own task, at most once per answer.** It wakes when an answer
//!   comes (once per `kubernetes.pod_resources_interval`) and reads a
//!   claim when it is first named, when the pods naming it change, after a
//!   failed read, and otherwise every [`REFRESH`] (an allocation does not
//!   change while pods use the claim); at most [`MAX_CLAIMS`] claims, at
//!   most [`CONCURRENT_READS`] at a time, each within [`CALL_TIMEOUT`]. A
//!   sample or a scrape only copies the published list.
//! - **Keyed by the pod UID and the device's UUID.** The kubelet says which
//!   pod holds the claim; a claim shared by several pods gives each the
//!   capacity it consumed. A pod's limit on a GPU or MIG device is the sum
//!   over its claims there (each counted once, however many of its
//!   containers name it), and there is none where one of them consumed no
//!   stated memory (an exclusive device). Devices the slices did not place
//!   on a UUID (the fallback by name) get none.
//! - **Trust.** A claim's allocation is written by the scheduler through
//!   the status subresource, which tenants are not normally granted; what
//!   it says only ever applies to the pods the kubelet says hold it.
//! - **Failure is data.** A failed read keeps the last good one and is
//!   tried again at the next answer; errors are logged at most once a
//!   minute per kind, 403 with the RBAC rule to add.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use futures_util::StreamExt;
use k8s_openapi::api::resource::v1::ResourceClaim;
use tokio::sync::watch;

use super::client;
use super::config::KubeConfig;
use super::slices::DeviceKey;
use crate::model::{
    AllocatedDevice, Amount, DraAllocation, LimitKind, LimitSource, LimitSources, PodLimit,
};
use crate::ratelimit::LogLimiter;

/// The most claims read for one node.
pub(crate) const MAX_CLAIMS: usize = 256;
/// The most allocation results read of one claim (the API allows 32).
const MAX_RESULTS: usize = 64;
/// A claim read this long ago is read again (while it is still named).
pub(crate) const REFRESH: Duration = Duration::from_secs(300);
/// One GET must finish within this, or count as failed.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// GETs in flight at once.
const CONCURRENT_READS: usize = 4;
/// A repeated warning of the same kind is logged at most this often.
const WARN_INTERVAL: Duration = Duration::from_secs(60);

/// What the pod-resources client sends: the DRA devices of its latest
/// answer (empty when it has none, or its answers went stale).
pub(crate) type ClaimRequests = watch::Sender<Arc<[DraAllocation]>>;

/// The channel between the pod-resources client and [`run_claim_reader`].
pub(crate) fn claim_channel() -> (ClaimRequests, watch::Receiver<Arc<[DraAllocation]>>) {
    watch::channel(Arc::from(Vec::new()))
}

/// The limits the claims state, as last read. Written by the reader's task
/// alone; cheap to read.
#[derive(Debug, Default)]
pub(crate) struct ClaimLimits {
    state: ArcSwap<ClaimState>,
}

#[derive(Debug, Default)]
struct ClaimState {
    /// Sorted ([`super::sort_limits`]).
    limits: Arc<Vec<PodLimit>>,
    /// Whether a claim named now states a consumed memory; `None` before
    /// the first answer was gone through.
    present: Option<bool>,
}

impl ClaimLimits {
    pub(crate) fn new() -> ClaimLimits {
        ClaimLimits::default()
    }

    /// The claims' limits (sorted; the same list while they did not
    /// change), and whether DRA limits were found (once looked for).
    pub(crate) fn limits(&self) -> (Arc<Vec<PodLimit>>, LimitSources) {
        let state = self.state.load();
        let mut sources = LimitSources::default();
        if let Some(present) = state.present {
            sources.set(LimitSource::Dra, present);
        }
        (Arc::clone(&state.limits), sources)
    }

    /// For tests outside this module: as if a pass had found `limits`.
    #[cfg(test)]
    pub(crate) fn set(&self, limits: Vec<PodLimit>, present: bool) {
        self.publish(limits, present);
    }

    fn publish(&self, mut limits: Vec<PodLimit>, present: bool) {
        super::sort_limits(&mut limits);
        let old = self.state.load();
        let limits = if *old.limits == limits {
            Arc::clone(&old.limits)
        } else {
            Arc::new(limits)
        };
        self.state.store(Arc::new(ClaimState {
            limits,
            present: Some(present),
        }));
    }
}

/// A claim by namespace and name.
type ClaimKey = (String, String);

/// One device of one claim a pod holds (each once, whichever containers
/// name it).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Use {
    pod_uid: String,
    claim: ClaimKey,
    device: DeviceKey,
    uuid: String,
}

/// What the reader knows of one claim.
#[derive(Debug)]
struct Cached {
    /// Its allocated devices and the memory each consumed, summed over
    /// its results (`None`: one of them states none).
    devices: HashMap<DeviceKey, Option<u64>>,
    /// The pods that named it when it was read.
    pods: BTreeSet<String>,
    read_at: Instant,
    /// The last read failed: read again at the next answer.
    failed: bool,
}

/// Runs forever on the current tokio runtime: after each pod-resources
/// answer, reads the claims it names that are due, and publishes the
/// limits into `store`.
pub(crate) async fn run_claim_reader(
    cfg: KubeConfig,
    store: Arc<ClaimLimits>,
    mut answers: watch::Receiver<Arc<[DraAllocation]>>,
) {
    let mut reader = Reader {
        cfg,
        client: None,
        cache: HashMap::new(),
        warnings: LogLimiter::every(WARN_INTERVAL),
    };
    while answers.changed().await.is_ok() {
        let dra = Arc::clone(&answers.borrow_and_update());
        reader.pass(&dra, &store).await;
    }
}

struct Reader {
    cfg: KubeConfig,
    client: Option<kube::Client>,
    cache: HashMap<ClaimKey, Cached>,
    /// Per kind of error.
    warnings: LogLimiter<&'static str>,
}

/// Why a claim could not be read.
#[derive(Debug, thiserror::Error)]
enum ReadError {
    #[error("{0}")]
    Api(#[source] kube::Error),
    #[error("no answer within {CALL_TIMEOUT:?}")]
    Timeout,
}

impl Reader {
    /// One answer: read the claims due, then publish what they state.
    async fn pass(&mut self, dra: &[DraAllocation], store: &ClaimLimits) {
        let uses = uses_of(dra);
        let mut wanted: BTreeMap<ClaimKey, BTreeSet<String>> = BTreeMap::new();
        for u in &uses {
            if wanted.len() >= MAX_CLAIMS && !wanted.contains_key(&u.claim) {
                self.warn(
                    "too many claims",
                    &format!("more than {MAX_CLAIMS} claims named; the rest are not read"),
                );
                continue;
            }
            wanted
                .entry(u.claim.clone())
                .or_default()
                .insert(u.pod_uid.clone());
        }
        self.cache.retain(|k, _| wanted.contains_key(k));
        let now = Instant::now();
        let due: Vec<(ClaimKey, BTreeSet<String>)> = wanted
            .into_iter()
            .filter(|(k, pods)| {
                self.cache.get(k).is_none_or(|c| {
                    c.failed || &c.pods != pods || now.duration_since(c.read_at) >= REFRESH
                })
            })
            .collect();
        if !due.is_empty() {
            self.read(due).await;
        }
        let (limits, present) = limits_of(&uses, &self.cache);
        store.publish(limits, present);
    }

    /// Read `due` claims, at most [`CONCURRENT_READS`] at a time.
    async fn read(&mut self, due: Vec<(ClaimKey, BTreeSet<String>)>) {
        let Some(client) = self.client().await else {
            for (key, _) in due {
                if let Some(c) = self.cache.get_mut(&key) {
                    c.failed = true;
                }
            }
            return;
        };
        let reads = futures_util::stream::iter(due)
            .map(|(key, pods)| {
                let client = client.clone();
                async move {
                    let api: kube::Api<ResourceClaim> = kube::Api::namespaced(client, &key.0);
                    let got = match tokio::time::timeout(CALL_TIMEOUT, api.get_opt(&key.1)).await {
                        Ok(Ok(claim)) => Ok(claim),
                        Ok(Err(e)) => Err(ReadError::Api(e)),
                        Err(_) => Err(ReadError::Timeout),
                    };
                    (key, pods, got)
                }
            })
            .buffer_unordered(CONCURRENT_READS)
            .collect::<Vec<_>>()
            .await;
        let now = Instant::now();
        for (key, pods, got) in reads {
            match got {
                Ok(claim) => {
                    // A claim gone (404) states nothing.
                    let (devices, unreadable) = claim.as_ref().map(devices_of).unwrap_or_default();
                    for q in unreadable {
                        self.warn(
                            "consumed capacity",
                            &format!(
                                "claim {}/{}: consumed memory {q:?} is not a quantity of bytes",
                                key.0, key.1
                            ),
                        );
                    }
                    self.cache.insert(
                        key,
                        Cached {
                            devices,
                            pods,
                            read_at: now,
                            failed: false,
                        },
                    );
                }
                Err(e) => {
                    self.failed(&key, &e);
                    // The last good read stands until one succeeds.
                    let c = self.cache.entry(key).or_insert_with(|| Cached {
                        devices: HashMap::new(),
                        pods: BTreeSet::new(),
                        read_at: now,
                        failed: true,
                    });
                    c.failed = true;
                }
            }
        }
    }

    /// The API client, built on first use (and again after a failure).
    async fn client(&mut self) -> Option<kube::Client> {
        if self.client.is_none() {
            match client::build(&self.cfg, Arc::new(|| {})).await {
                Ok(built) => self.client = Some(built.client),
                Err(e) => self.warn("client", &e),
            }
        }
        self.client.clone()
    }

    fn failed(&mut self, key: &ClaimKey, e: &ReadError) {
        let forbidden = matches!(e, ReadError::Api(kube::Error::Api(s)) if s.code == 403);
        if forbidden {
            self.warn(
                "forbidden",
                &format!(
                    "claim {}/{}: {e} (is get on resourceclaims granted? deploy/kubernetes/base/rbac.yaml)",
                    key.0, key.1
                ),
            );
        } else {
            self.warn("read", &format!("claim {}/{}: {e}", key.0, key.1));
        }
    }

    fn warn(&mut self, kind: &'static str, e: &dyn std::fmt::Display) {
        if let Some(suppressed) = self.warnings.check(kind) {
            tracing::warn!(kind, error = %e, suppressed, "kubernetes ResourceClaim reader");
        }
    }
}

/// A claim's allocated devices, with the memory each consumed (summed
/// over its results: several shares of one device), and the consumed
/// memories that are no quantity (that device then states none).
fn devices_of(claim: &ResourceClaim) -> (HashMap<DeviceKey, Option<u64>>, Vec<String>) {
    let results = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_deref())
        .unwrap_or_default();
    let mut devices: HashMap<DeviceKey, Option<u64>> = HashMap::new();
    let mut unreadable = Vec::new();
    for r in results.iter().take(MAX_RESULTS) {
        // `memory`, or qualified with the driver's domain (the same name
        // to the API).
        let stated = r.consumed_capacity.as_ref().and_then(|c| {
            c.get("memory")
                .or_else(|| c.get(&format!("{}/memory", r.driver)))
        });
        let memory = stated.and_then(|q| {
            let bytes = super::quantity::bytes(&q.0);
            if bytes.is_none() {
                unreadable.push(q.0.chars().take(64).collect());
            }
            bytes
        });
        let device = (r.driver.clone(), r.pool.clone(), r.device.clone());
        let sum = devices.entry(device).or_insert(Some(0));
        *sum = sum.zip(memory).map(|(a, b)| a.saturating_add(b));
    }
    (devices, unreadable)
}

/// The devices of an answer that name a pod and a GPU or MIG UUID, each
/// (pod, claim, device) once.
fn uses_of(dra: &[DraAllocation]) -> Vec<Use> {
    let set: BTreeSet<Use> = dra
        .iter()
        .filter_map(|d| {
            let uuid = match &d.device {
                AllocatedDevice::Gpu { uuid } => uuid,
                AllocatedDevice::Mig { mig_uuid }
                | AllocatedDevice::MigOfParent { mig_uuid, .. } => mig_uuid,
                _ => return None,
            };
            Some(Use {
                pod_uid: d.pod_uid.clone()?,
                claim: (d.claim_namespace.clone(), d.claim_name.clone()),
                device: (d.driver.clone(), d.pool.clone(), d.device_name.clone()),
                uuid: uuid.clone(),
            })
        })
        .collect();
    set.into_iter().collect()
}

/// Per pod and device UUID, the memory its claims consumed there (none
/// where one of them states none, or was never read), and whether any
/// claim states a consumed memory.
fn limits_of(uses: &[Use], cache: &HashMap<ClaimKey, Cached>) -> (Vec<PodLimit>, bool) {
    let mut per: BTreeMap<(&str, &str), Option<u64>> = BTreeMap::new();
    for u in uses {
        let memory = cache
            .get(&u.claim)
            .and_then(|c| c.devices.get(&u.device).copied().flatten());
        let sum = per.entry((&u.pod_uid, &u.uuid)).or_insert(Some(0));
        *sum = sum.zip(memory).map(|(a, b)| a.saturating_add(b));
    }
    let present = cache
        .values()
        .any(|c| c.devices.values().any(Option::is_some));
    let limits = per
        .into_iter()
        .filter_map(|((pod, uuid), bytes)| {
            Some(PodLimit {
                pod_uid: Arc::from(pod),
                uuid: Some(Arc::from(uuid)),
                source: LimitSource::Dra,
                kind: LimitKind::Hard,
                amount: Amount::Bytes(bytes?),
            })
        })
        .collect();
    (limits, present)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use bytes::Bytes;
    use serde_json::{Value, json};

    use super::*;

    const DRIVER: &str = "gpu.nvidia.com";
    const GPU0: &str = "GPU-00000000-0000-0000-0000-000000000000";
    const GPU1: &str = "GPU-11111111-0000-0000-0000-000000000000";
    const MIG: &str = "MIG-22222222-0000-0000-0000-000000000000";
    const GI: u64 = 1 << 30;

    /// A claim as the API serialises it, allocated: per result its
    /// device and its `consumedCapacity` (JSON, or none).
    fn claim(ns: &str, name: &str, results: &[(&str, Option<Value>)]) -> Value {
        json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": ns, "uid": "c0ffee00-0000-4000-8000-000000000001",
                "resourceVersion": "41"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.nvidia.com",
                "capacity": {"requests": {"memory": "20Gi"}}}}]}},
            "status": {
                "allocation": {"devices": {"results": results.iter().enumerate().map(|(i, (device, consumed))| {
                    let mut r = json!({"request": "gpu", "driver": DRIVER, "pool": "node-1",
                        "device": device, "shareID": format!("5e1f0000-0000-4000-8000-00000000000{i}")});
                    if let Some(c) = consumed {
                        r["consumedCapacity"] = c.clone();
                    }
                    r
                }).collect::<Vec<_>>()}},
                "reservedFor": [{"resource": "pods", "name": "trainer-0", "uid": "pod-a"}]
            }
        })
    }

    fn key(device: &str) -> DeviceKey {
        (DRIVER.into(), "node-1".into(), device.into())
    }

    /// Each claim's results → (device, memory consumed) and the
    /// quantities that are none.
    #[test]
    fn claim_results_to_devices() {
        let mem = |q: &str| Some(json!({"memory": q}));
        type Want = (Vec<(&'static str, Option<u64>)>, Vec<&'static str>);
        let cases: Vec<(Value, Want)> = vec![
            (
                claim("a", "one", &[("gpu-0", mem("20Gi"))]),
                (vec![("gpu-0", Some(20 * GI))], vec![]),
            ),
            // Two shares of one device; another device in bytes.
            (
                claim(
                    "a",
                    "shares",
                    &[
                        ("gpu-0", mem("10Gi")),
                        ("gpu-0", mem("5Gi")),
                        ("gpu-1", mem("1073741824")),
                    ],
                ),
                (vec![("gpu-0", Some(15 * GI)), ("gpu-1", Some(GI))], vec![]),
            ),
            // The name qualified with the driver's domain; other
            // capacities beside it.
            (
                claim(
                    "a",
                    "qualified",
                    &[(
                        "gpu-0",
                        Some(json!({"gpu.nvidia.com/memory": "8Gi", "cores": "10"})),
                    )],
                ),
                (vec![("gpu-0", Some(8 * GI))], vec![]),
            ),
            // No consumed memory (an exclusive device): states none, also
            // for a share of the same device that does.
            (
                claim(
                    "a",
                    "exclusive",
                    &[
                        ("gpu-0", None),
                        ("gpu-1", Some(json!({"cores": "10"}))),
                        ("gpu-1", mem("1Gi")),
                    ],
                ),
                (vec![("gpu-0", None), ("gpu-1", None)], vec![]),
            ),
            (
                claim("a", "bad", &[("gpu-0", mem("-1Gi")), ("gpu-1", mem("2Gi"))]),
                (vec![("gpu-0", None), ("gpu-1", Some(2 * GI))], vec!["-1Gi"]),
            ),
        ];
        for (json, (devices, unreadable)) in cases {
            let c: ResourceClaim = serde_json::from_value(json).unwrap();
            let name = c.metadata.name.clone();
            let want: HashMap<DeviceKey, Option<u64>> =
                devices.into_iter().map(|(d, m)| (key(d), m)).collect();
            assert_eq!(
                devices_of(&c),
                (want, unreadable.iter().map(|s| s.to_string()).collect()),
                "{name:?}"
            );
        }
        // Not allocated (yet): no device.
        let pending: ResourceClaim = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "pending", "namespace": "a"},
            "spec": {"devices": {"requests": []}}
        }))
        .unwrap();
        assert_eq!(devices_of(&pending), (HashMap::new(), vec![]));
    }

    fn dra(
        pod: &str,
        uid: Option<&str>,
        claim: &str,
        device: &str,
        at: AllocatedDevice,
    ) -> DraAllocation {
        DraAllocation {
            namespace: "team".into(),
            pod: pod.into(),
            container: "c".into(),
            pod_uid: uid.map(Into::into),
            claim_namespace: "team".into(),
            claim_name: claim.into(),
            driver: DRIVER.into(),
            pool: "node-1".into(),
            device_name: device.into(),
            device: at,
        }
    }

    fn gpu(uuid: &str) -> AllocatedDevice {
        AllocatedDevice::Gpu { uuid: uuid.into() }
    }

    fn cached(devices: &[(&str, Option<u64>)]) -> Cached {
        Cached {
            devices: devices.iter().map(|(d, m)| (key(d), *m)).collect(),
            pods: BTreeSet::new(),
            read_at: Instant::now(),
            failed: false,
        }
    }

    /// The pod-resources answer and the claims read → per pod and device
    /// UUID, the bytes its claims consumed there.
    #[test]
    fn limits_per_pod_and_device() {
        let cache: HashMap<ClaimKey, Cached> = [
            ("shared", cached(&[("gpu-0", Some(20 * GI))])),
            (
                "mine",
                cached(&[("gpu-1", Some(4 * GI)), ("mig-0", Some(GI))]),
            ),
            ("more", cached(&[("gpu-1", Some(2 * GI))])),
            ("whole", cached(&[("gpu-1", None)])),
        ]
        .into_iter()
        .map(|(n, c)| (("team".to_string(), n.to_string()), c))
        .collect();
        let mig = AllocatedDevice::MigOfParent {
            mig_uuid: MIG.into(),
            gpu_uuid: GPU1.into(),
        };
        let answer = vec![
            // One claim shared by two pods: each has its capacity.
            dra("a", Some("uid-a"), "shared", "gpu-0", gpu(GPU0)),
            dra("b", Some("uid-b"), "shared", "gpu-0", gpu(GPU0)),
            // Named by two of b's containers: counted once.
            dra("b", Some("uid-b"), "shared", "gpu-0", gpu(GPU0)),
            // Two claims of c on one GPU: their sum; a MIG device by its UUID.
            dra("c", Some("uid-c"), "mine", "gpu-1", gpu(GPU1)),
            dra("c", Some("uid-c"), "more", "gpu-1", gpu(GPU1)),
            dra("c", Some("uid-c"), "mine", "mig-0", mig),
            // d's second claim on the GPU states no memory: no limit there.
            dra("d", Some("uid-d"), "more", "gpu-1", gpu(GPU1)),
            dra("d", Some("uid-d"), "whole", "gpu-1", gpu(GPU1)),
            // No UID (the pod watcher does not know it yet), a device
            // placed by its name only, a claim not read: nothing.
            dra("e", None, "shared", "gpu-0", gpu(GPU0)),
            dra(
                "f",
                Some("uid-f"),
                "shared",
                "gpu-0",
                AllocatedDevice::GpuIndex { gpu: "0".into() },
            ),
            dra("g", Some("uid-g"), "unread", "gpu-0", gpu(GPU0)),
            // A device the claim's results do not have.
            dra("h", Some("uid-h"), "mine", "gpu-7", gpu(GPU0)),
        ];
        let (limits, present) = limits_of(&uses_of(&answer), &cache);
        assert!(present);
        let got: Vec<(&str, &str, Amount)> = limits
            .iter()
            .map(|l| {
                assert_eq!((l.source, l.kind), (LimitSource::Dra, LimitKind::Hard));
                (&*l.pod_uid, l.uuid.as_deref().unwrap_or("-"), l.amount)
            })
            .collect();
        assert_eq!(
            got,
            [
                ("uid-a", GPU0, Amount::Bytes(20 * GI)),
                ("uid-b", GPU0, Amount::Bytes(20 * GI)),
                ("uid-c", GPU1, Amount::Bytes(6 * GI)),
                ("uid-c", MIG, Amount::Bytes(GI)),
            ]
        );
        let (none, present) = limits_of(&[], &HashMap::new());
        assert!(none.is_empty() && !present);
    }

    /// The API as a function: what each GET path answers (status, body),
    /// and the paths asked.
    #[derive(Default)]
    struct FakeApi {
        claims: Mutex<HashMap<String, (u16, Value)>>,
        asked: Mutex<Vec<String>>,
    }

    fn client(api: &Arc<FakeApi>) -> kube::Client {
        let api = Arc::clone(api);
        let svc = tower::service_fn(move |req: hyper::Request<kube::client::Body>| {
            let path = req.uri().path().to_string();
            api.asked.lock().unwrap().push(path.clone());
            let (status, body) = api.claims.lock().unwrap().get(&path).cloned().unwrap_or((
                404,
                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": "NotFound", "code": 404, "message": "not found"}),
            ));
            async move {
                hyper::Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(http_body_util::Full::new(Bytes::from(body.to_string())))
                    .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
            }
        });
        kube::Client::new(svc, "default")
    }

    fn path(name: &str) -> String {
        format!("/apis/resource.k8s.io/v1/namespaces/team/resourceclaims/{name}")
    }

    /// Each claim is read when first named, again only when the pods
    /// naming it change or a read failed, and a failed read keeps the last
    /// good one; a claim gone states nothing.
    #[tokio::test]
    async fn claims_are_read_when_due_and_kept() {
        let api = Arc::new(FakeApi::default());
        let serve = |name: &str, status: u16, body: Value| {
            api.claims
                .lock()
                .unwrap()
                .insert(path(name), (status, body));
        };
        serve(
            "shared",
            200,
            claim(
                "team",
                "shared",
                &[("gpu-0", Some(json!({"memory": "20Gi"})))],
            ),
        );
        serve(
            "other",
            200,
            claim(
                "team",
                "other",
                &[("gpu-1", Some(json!({"memory": "1Gi"})))],
            ),
        );
        let mut reader = Reader {
            cfg: KubeConfig::node("node-1"),
            client: Some(client(&api)),
            cache: HashMap::new(),
            warnings: LogLimiter::every(WARN_INTERVAL),
        };
        let store = ClaimLimits::new();
        assert_eq!(
            store.limits().1.get(LimitSource::Dra),
            None,
            "not looked yet"
        );
        let asked = || std::mem::take(&mut *api.asked.lock().unwrap());
        let bytes = |store: &ClaimLimits| -> Vec<(String, u64)> {
            store
                .limits()
                .0
                .iter()
                .map(|l| match l.amount {
                    Amount::Bytes(b) => (l.pod_uid.to_string(), b),
                    Amount::Fraction(_) => unreachable!(),
                })
                .collect()
        };

        let one = [dra("a", Some("uid-a"), "shared", "gpu-0", gpu(GPU0))];
        reader.pass(&one, &store).await;
        assert_eq!(asked(), [path("shared")]);
        assert_eq!(bytes(&store), [("uid-a".to_string(), 20 * GI)]);
        assert_eq!(store.limits().1.get(LimitSource::Dra), Some(true));
        let first = store.limits().0;

        // The same answer again: nothing asked, the same list.
        reader.pass(&one, &store).await;
        assert!(asked().is_empty());
        assert!(Arc::ptr_eq(&first, &store.limits().0));

        // Another pod names the claim: read again (its pods changed).
        let two = [
            one[0].clone(),
            dra("b", Some("uid-b"), "shared", "gpu-0", gpu(GPU0)),
        ];
        reader.pass(&two, &store).await;
        assert_eq!(asked(), [path("shared")]);
        assert_eq!(
            bytes(&store),
            [
                ("uid-a".to_string(), 20 * GI),
                ("uid-b".to_string(), 20 * GI)
            ]
        );

        // A read fails: the last good one stands, and the claim is asked
        // again at the next answer.
        serve(
            "shared",
            500,
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": "InternalError", "code": 500, "message": "etcd timeout"}),
        );
        reader.cache.values_mut().for_each(|c| c.pods.clear());
        reader.pass(&two, &store).await;
        assert_eq!(asked(), [path("shared")]);
        assert_eq!(bytes(&store).len(), 2);
        reader.pass(&two, &store).await;
        assert_eq!(asked(), [path("shared")], "failed: asked again");

        // Gone from the API (404): no limit; gone from the answer: forgotten.
        api.claims.lock().unwrap().remove(&path("shared"));
        reader.pass(&two, &store).await;
        assert_eq!(asked(), [path("shared")]);
        assert!(bytes(&store).is_empty());
        assert_eq!(store.limits().1.get(LimitSource::Dra), Some(false));
        reader.pass(&[], &store).await;
        assert!(asked().is_empty());
        assert!(reader.cache.is_empty());

        // Due again after REFRESH.
        let other = [dra("c", Some("uid-c"), "other", "gpu-1", gpu(GPU1))];
        reader.pass(&other, &store).await;
        assert_eq!(asked(), [path("other")]);
        reader.pass(&other, &store).await;
        assert!(asked().is_empty());
        for c in reader.cache.values_mut() {
            c.read_at = Instant::now() - REFRESH;
        }
        reader.pass(&other, &store).await;
        assert_eq!(asked(), [path("other")]);
        assert_eq!(bytes(&store), [("uid-c".to_string(), GI)]);
    }

    /// At most MAX_CLAIMS claims are read for one answer.
    #[tokio::test]
    async fn the_claims_read_are_bounded() {
        let api = Arc::new(FakeApi::default());
        let mut reader = Reader {
            cfg: KubeConfig::node("node-1"),
            client: Some(client(&api)),
            cache: HashMap::new(),
            warnings: LogLimiter::every(WARN_INTERVAL),
        };
        let answer: Vec<DraAllocation> = (0..MAX_CLAIMS + 10)
            .map(|i| {
                dra(
                    "p",
                    Some("uid-p"),
                    &format!("claim-{i:04}"),
                    "gpu-0",
                    gpu(GPU0),
                )
            })
            .collect();
        reader.pass(&answer, &ClaimLimits::new()).await;
        assert_eq!(api.asked.lock().unwrap().len(), MAX_CLAIMS);
        assert_eq!(reader.cache.len(), MAX_CLAIMS);
    }
}
