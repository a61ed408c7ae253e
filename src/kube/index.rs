//! The cache of this node's pods: pod UID / container id → namespace, pod,
//! container. Published by swapping an `Arc`, so readers never block.
//!
//! Architecture invariant: this is all attribution sees of the pod watcher
//! (`attribute → kube::index` is the one edge between them), and it
//! imports nothing of attribution, so the container id's form
//! ([`is_container_id`]) is defined here.
//!
//! Beside the names, each pod keeps the memory limits its own annotations
//! state (HAMi's, KAI's: [`super::annotations`]), keyed by its UID, and
//! every publish lists them all for the snapshot ([`PodIndex::limits`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use arc_swap::ArcSwap;
use k8s_openapi::api::core::v1 as k8s;

use super::annotations::{self, Problem};
use crate::model::{KubeState, LimitSource, LimitSources, PodLimit};

/// Who a process belongs to in Kubernetes terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    pub namespace: String,
    pub pod: String,
    /// Empty when only the pod UID was known.
    pub container: String,
}

/// What [`PodIndex::resolve`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodLookup {
    Found(PodRef),
    /// Not indexed (yet): the watcher may learn it later.
    Unknown,
    /// The container belongs to pod `owner`, not to the path's pod (or
    /// the path names no pod).
    Mismatch {
        owner: String,
    },
}

/// The cache of this node's pods. Cheap to share (`Arc<PodIndex>`); readers
/// never block and never see a half-applied relist.
#[derive(Debug, Default)]
pub struct PodIndex {
    pub(super) data: ArcSwap<IndexData>,
    pub(super) lists_total: AtomicU64,
    pub(super) watch_restarts_total: AtomicU64,
    pub(super) events_total: AtomicU64,
    pub(super) errors_total: AtomicU64,
    pub(super) last_sync_unix_seconds: AtomicU64,
    pub(super) synced: AtomicBool,
}

impl PodIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// What the index holds: a container id (64 hex digits; a
    /// `runtime://` prefix is tolerated) wins and gives the container
    /// name; otherwise the pod UID gives the namespace and pod with an
    /// empty container. Attribution asks [`PodIndex::resolve`], which
    /// never takes a container id alone.
    pub fn lookup(&self, pod_uid: Option<&str>, container_id: Option<&str>) -> Option<PodRef> {
        let data = self.data.load();
        if let Some(id) = container_id.and_then(normalize_container_id)
            && let Some(c) = data.containers.get(id)
            && let Some(pod) = data.pods.get(&c.pod_uid)
        {
            return Some(pod.to_ref(&c.name));
        }
        let pod = data.pods.get(pod_uid?)?;
        Some(pod.to_ref(""))
    }

    /// Who a process is, from what its cgroup path says: the pod of
    /// `pod_uid`, named by its container `container_id` where that
    /// container is the pod's own. A container id is never taken alone:
    /// any process that can create cgroups can name one after another
    /// tenant's container, so it must belong to the pod UID of the same
    /// path ([`PodLookup::Mismatch`] otherwise, also when the path names
    /// no pod). A container the index does not know (yet) leaves the pod.
    pub fn resolve(&self, pod_uid: Option<&str>, container_id: Option<&str>) -> PodLookup {
        let data = self.data.load();
        let container = container_id
            .and_then(normalize_container_id)
            .and_then(|id| data.containers.get(id));
        match (pod_uid, container) {
            (Some(uid), Some(c)) if c.pod_uid == uid => match data.pods.get(uid) {
                Some(pod) => PodLookup::Found(pod.to_ref(&c.name)),
                None => PodLookup::Unknown,
            },
            (_, Some(c)) => PodLookup::Mismatch {
                owner: c.pod_uid.clone(),
            },
            (Some(uid), None) => match data.pods.get(uid) {
                Some(pod) => PodLookup::Found(pod.to_ref("")),
                None => PodLookup::Unknown,
            },
            (None, None) => PodLookup::Unknown,
        }
    }

    /// The UID of pod `namespace/name`, when it is indexed (the kubelet's
    /// pod-resources answer names pods, not UIDs). A scan: a node's pods
    /// are a few hundred at most, and this runs once per DRA allocation
    /// per pod-resources answer, never in a scrape.
    pub fn uid_of(&self, namespace: &str, name: &str) -> Option<String> {
        self.data
            .load()
            .pods
            .values()
            .find(|p| p.namespace == namespace && p.name == name)
            .map(|p| p.uid.clone())
    }

    /// The limits this node's pods' annotations state (sorted), and which
    /// of their sources were found: HAMi's and KAI's, once the first LIST
    /// is in (before it, not known).
    pub(crate) fn limits(&self) -> (Arc<Vec<PodLimit>>, LimitSources) {
        let data = self.data.load();
        let mut sources = LimitSources::default();
        if self.synced.load(Ordering::Acquire) {
            sources.set(LimitSource::Hami, data.limits.hami);
            sources.set(LimitSource::Kai, data.limits.kai);
        }
        (Arc::clone(&data.limits.all), sources)
    }

    /// Whether the API deleted the pod of this UID (a tombstone is kept
    /// for [`TOMBSTONE_SECONDS`], at most [`MAX_TOMBSTONES`]).
    pub fn is_deleted(&self, pod_uid: &str) -> bool {
        let data = self.data.load();
        data.tombstones.contains_key(pod_uid) && !data.pods.contains_key(pod_uid)
    }

    /// Pods currently indexed.
    pub fn pods(&self) -> usize {
        self.data.load().pods.len()
    }

    /// The watcher's state and counters now.
    pub fn stats(&self) -> KubeState {
        KubeState {
            pods: self.pods() as u64,
            lists_total: self.lists_total.load(Ordering::Relaxed),
            watch_restarts_total: self.watch_restarts_total.load(Ordering::Relaxed),
            events_total: self.events_total.load(Ordering::Relaxed),
            errors_total: self.errors_total.load(Ordering::Relaxed),
            last_sync_unix_seconds: self.last_sync_unix_seconds.load(Ordering::Relaxed),
            synced: self.synced.load(Ordering::Acquire),
        }
    }

    /// Adds one pod by hand, for tests of code that consumes the index and
    /// for setups without a watcher. With a watcher running, the next relist
    /// replaces it.
    pub fn insert(&self, pod_uid: &str, containers: &[(&str, &str)], namespace: &str, pod: &str) {
        let mut data = IndexData::clone(&self.data.load());
        data.upsert(Pod {
            uid: pod_uid.to_owned(),
            namespace: namespace.to_owned(),
            name: pod.to_owned(),
            node_name: String::new(),
            containers: containers
                .iter()
                .filter_map(|(name, id)| {
                    Some(Container {
                        name: (*name).to_owned(),
                        id: normalize_container_id(id)?.to_owned(),
                    })
                })
                .collect(),
            limits: Vec::new(),
            problems: Vec::new(),
        });
        self.publish(&data);
    }

    /// For tests outside this module: pod `uid` (namespace `team`) with
    /// `annotations`, as if a LIST had brought it.
    #[cfg(test)]
    pub(crate) fn insert_annotated(&self, uid: &str, name: &str, annotations: &[(&str, &str)]) {
        let api: k8s::Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "team", "uid": uid,
                "annotations": annotations.iter().copied().collect::<HashMap<_, _>>()},
        }))
        .unwrap_or_default();
        let mut data = IndexData::clone(&self.data.load());
        if let Ok(pod) = Pod::from_api(&api) {
            data.upsert(pod);
        }
        self.publish(&data);
        self.synced.store(true, Ordering::Release);
    }

    /// Make `data` what readers see, with its pods' limits listed afresh
    /// (the list published before is kept when they did not change, so a
    /// snapshot can tell that they did not by the pointer).
    pub(super) fn publish(&self, data: &IndexData) {
        let mut data = data.clone();
        let old = self.data.load();
        data.limits = PodLimits::of(&data.pods);
        if data.limits.all == old.limits.all {
            data.limits.all = Arc::clone(&old.limits.all);
        }
        self.data.store(Arc::new(data));
    }

    pub(super) fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn touch(&self) {
        self.last_sync_unix_seconds
            .store(unix_now(), Ordering::Relaxed);
    }
}

/// Deleted pods' UIDs kept as tombstones, and for how long: a process
/// whose pod was deleted while it still holds GPU memory is
/// `owner_deleted` (`attribute::liveness`).
pub(crate) const MAX_TOMBSTONES: usize = 4096;
pub(crate) const TOMBSTONE_SECONDS: u64 = 24 * 3600;

/// The published state: pods by UID and container ids pointing at them,
/// and the UIDs of pods deleted since (with when); and, made when
/// published, the limits of all the pods.
#[derive(Debug, Clone, Default)]
pub(super) struct IndexData {
    pub(super) pods: HashMap<String, Arc<Pod>>,
    pub(super) containers: HashMap<String, ContainerSlot>,
    pub(super) tombstones: HashMap<String, u64>,
    pub(super) limits: PodLimits,
}

/// Every indexed pod's limits, and whether any came from each source.
#[derive(Debug, Clone, Default)]
pub(super) struct PodLimits {
    /// Sorted ([`super::sort_limits`]).
    pub(super) all: Arc<Vec<PodLimit>>,
    pub(super) hami: bool,
    pub(super) kai: bool,
}

impl PodLimits {
    fn of(pods: &HashMap<String, Arc<Pod>>) -> PodLimits {
        let mut all: Vec<PodLimit> = pods.values().flat_map(|p| p.limits.clone()).collect();
        super::sort_limits(&mut all);
        PodLimits {
            hami: all.iter().any(|l| l.source == LimitSource::Hami),
            kai: all.iter().any(|l| l.source == LimitSource::Kai),
            all: Arc::new(all),
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct ContainerSlot {
    pub(super) pod_uid: String,
    pub(super) name: String,
}

impl IndexData {
    pub(super) fn upsert(&mut self, pod: Pod) {
        self.remove(&pod.uid);
        for c in &pod.containers {
            self.containers.insert(
                c.id.clone(),
                ContainerSlot {
                    pod_uid: pod.uid.clone(),
                    name: c.name.clone(),
                },
            );
        }
        self.pods.insert(pod.uid.clone(), Arc::new(pod));
    }

    /// A pod the API deleted (or moved off this node): gone, and kept as
    /// a tombstone.
    pub(super) fn delete(&mut self, uid: &str) -> bool {
        if !self.remove(uid) {
            return false;
        }
        self.bury([uid.to_string()].into_iter());
        true
    }

    /// After a relist into `self`: the pods `old` had and `self` has not
    /// were deleted meanwhile; `old`'s tombstones carry over.
    pub(super) fn relisted_from(&mut self, old: &IndexData) {
        self.tombstones = old.tombstones.clone();
        let gone: Vec<String> = old
            .pods
            .keys()
            .filter(|uid| !self.pods.contains_key(*uid))
            .cloned()
            .collect();
        self.bury(gone.into_iter());
    }

    fn bury(&mut self, uids: impl Iterator<Item = String>) {
        let now = unix_now();
        for uid in uids {
            self.tombstones.insert(uid, now);
        }
        self.tombstones
            .retain(|_, at| now.saturating_sub(*at) < TOMBSTONE_SECONDS);
        if self.tombstones.len() > MAX_TOMBSTONES {
            let mut by_age: Vec<(u64, String)> = self
                .tombstones
                .iter()
                .map(|(u, at)| (*at, u.clone()))
                .collect();
            by_age.sort_unstable();
            let extra = by_age.len() - MAX_TOMBSTONES;
            for (_, uid) in by_age.into_iter().take(extra) {
                self.tombstones.remove(&uid);
            }
        }
    }

    pub(super) fn remove(&mut self, uid: &str) -> bool {
        let Some(old) = self.pods.remove(uid) else {
            return false;
        };
        for c in &old.containers {
            if self.containers.get(&c.id).is_some_and(|s| s.pod_uid == uid) {
                self.containers.remove(&c.id);
            }
        }
        true
    }
}

/// The fields of a pod this module uses.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Pod {
    pub(super) uid: String,
    pub(super) namespace: String,
    pub(super) name: String,
    pub(super) node_name: String,
    /// Containers that have an id (started at least once), init and
    /// ephemeral containers included.
    pub(super) containers: Vec<Container>,
    /// What its own annotations state, keyed by its own UID.
    pub(super) limits: Vec<PodLimit>,
    /// Its annotations that gave no limit, and why (the watcher logs them).
    pub(super) problems: Vec<Problem>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Container {
    pub(super) name: String,
    pub(super) id: String,
}

impl Pod {
    pub(super) fn to_ref(&self, container: &str) -> PodRef {
        PodRef {
            namespace: self.namespace.clone(),
            pod: self.name.clone(),
            container: container.to_owned(),
        }
    }
}

/// 64 lowercase hex digits: the full id every runtime here uses in cgroup
/// names and, after its `runtime://` prefix, in a pod's status: the key
/// that joins a process's cgroup to its pod. Anything shorter is a
/// truncated or unrelated name, and reporting it would produce ids that
/// match nothing in `docker ps` or `crictl ps`.
pub(crate) fn is_container_id(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// `containerd://<id>`, `cri-o://<id>`, `docker://<id>` or a bare id →
/// the 64-hex id; `None` for anything else (an empty id of a pending
/// container, a truncated id).
pub(crate) fn normalize_container_id(raw: &str) -> Option<&str> {
    let id = raw.split_once("://").map_or(raw, |(_, id)| id);
    is_container_id(id).then_some(id)
}

/// Why a pod object from the API is not usable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("pod object lacks {0}")]
pub(super) struct MissingField(&'static str);

impl Pod {
    /// The fields used, from the API's pod object: name, namespace and UID
    /// are required; containers (init and ephemeral ones included) count
    /// once they have an id; the limits are its annotations', under its
    /// UID.
    pub(super) fn from_api(pod: &k8s::Pod) -> Result<Pod, MissingField> {
        let meta = &pod.metadata;
        let required = |v: &Option<String>, what| {
            v.clone()
                .filter(|s| !s.is_empty())
                .ok_or(MissingField(what))
        };
        let status = pod.status.as_ref();
        let containers = status
            .into_iter()
            .flat_map(|s| {
                [
                    s.container_statuses.as_deref(),
                    s.init_container_statuses.as_deref(),
                    s.ephemeral_container_statuses.as_deref(),
                ]
            })
            .flatten()
            .flatten()
            .filter_map(|c| {
                let id = normalize_container_id(c.container_id.as_deref()?)?.to_owned();
                Some(Container {
                    name: c.name.clone(),
                    id,
                })
            })
            .collect();
        let uid = required(&meta.uid, "metadata.uid")?;
        let annotated = annotations::limits_of(&Arc::from(uid.as_str()), |name| {
            meta.annotations.as_ref()?.get(name).map(String::as_str)
        });
        Ok(Pod {
            uid,
            namespace: required(&meta.namespace, "metadata.namespace")?,
            name: required(&meta.name, "metadata.name")?,
            node_name: pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default(),
            containers,
            limits: annotated.limits,
            problems: annotated.problems,
        })
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID_A: &str = "3f4e8c2b1a9d7e6f5c4b3a2918273645f6e5d4c3b2a1908f7e6d5c4b3a291807";
    const ID_B: &str = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9";
    const ID_C: &str = "cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc";

    #[test]
    fn container_id_prefixes() {
        let cases: &[(&str, Option<&str>)] = &[
            (&format!("containerd://{ID_A}"), Some(ID_A)),
            (&format!("cri-o://{ID_A}"), Some(ID_A)),
            (&format!("docker://{ID_A}"), Some(ID_A)),
            (ID_A, Some(ID_A)),
            ("", None),
            ("containerd://", None),
            ("containerd://abc123", None),
            (&format!("containerd://{}", ID_A.to_uppercase()), None),
            (&format!("containerd://{ID_A}0"), None),
        ];
        for (raw, want) in cases {
            assert_eq!(normalize_container_id(raw), *want, "{raw}");
        }
    }
    /// A pod as the API serialises it, through k8s-openapi's types.
    #[test]
    fn pod_from_the_api_object() {
        let json = serde_json::json!({
            "kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": "trainer-0", "namespace": "team-a", "uid": "u-1",
                "resourceVersion": "77", "labels": {"app": "x"},
                "managedFields": [{"manager": "kubelet", "operation": "Update"}]},
            "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "trainer", "image": "pytorch"}]},
            "status": {"phase": "Running",
                "containerStatuses": [
                    {"name": "trainer", "containerID": format!("containerd://{ID_A}"), "ready": true,
                     "restartCount": 0, "image": "pytorch", "imageID": ""},
                    {"name": "sidecar", "ready": false, "restartCount": 0, "image": "x", "imageID": ""}],
                "initContainerStatuses": [
                    {"name": "init", "containerID": format!("cri-o://{ID_B}"), "ready": true,
                     "restartCount": 0, "image": "x", "imageID": ""}],
                "ephemeralContainerStatuses": null}
        });
        let api: k8s::Pod = serde_json::from_value(json).unwrap();
        assert_eq!(
            Pod::from_api(&api),
            Ok(Pod {
                uid: "u-1".into(),
                namespace: "team-a".into(),
                name: "trainer-0".into(),
                node_name: "gpu-node-1".into(),
                containers: vec![
                    Container {
                        name: "trainer".into(),
                        id: ID_A.into()
                    },
                    Container {
                        name: "init".into(),
                        id: ID_B.into()
                    },
                ],
                limits: vec![],
                problems: vec![],
            })
        );
        let mut no_uid = api.clone();
        no_uid.metadata.uid = None;
        assert_eq!(Pod::from_api(&no_uid), Err(MissingField("metadata.uid")));
        let mut empty_ns = api;
        empty_ns.metadata.namespace = Some(String::new());
        assert_eq!(
            Pod::from_api(&empty_ns),
            Err(MissingField("metadata.namespace"))
        );
    }

    const GPU_A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
    const GPU_B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000000";

    /// A pod on `gpu-node-1` as the API has it, with `annotations`.
    fn annotated(uid: &str, name: &str, annotations: serde_json::Value) -> k8s::Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "team", "uid": uid,
                "annotations": annotations},
            "spec": {"nodeName": "gpu-node-1", "containers": []},
        }))
        .unwrap()
    }

    fn index_of(pods: &[k8s::Pod]) -> PodIndex {
        let index = PodIndex::new();
        let mut data = IndexData::default();
        for p in pods {
            data.upsert(Pod::from_api(p).unwrap());
        }
        index.publish(&data);
        index
    }

    /// A tenant's annotation speaks only of its own pod: pod A's naming
    /// the GPU that pod B holds gives A a limit on that GPU and B, which
    /// carries none, nothing; A's naming B's UID where a UUID goes is no
    /// limit at all.
    #[test]
    fn an_annotation_names_only_its_own_pod() {
        let b = || annotated("uid-b", "b", serde_json::json!({}));
        let index = index_of(&[
            annotated(
                "uid-a",
                "a",
                serde_json::json!({
                    annotations::HAMI: format!("{GPU_B},NVIDIA,1,0:;"),
                    annotations::KAI_MEMORY: "1",
                }),
            ),
            b(),
        ]);
        let (limits, _) = index.limits();
        assert_eq!(limits.len(), 2, "{limits:?}");
        assert!(limits.iter().all(|l| &*l.pod_uid == "uid-a"), "{limits:?}");
        assert_eq!(
            limits.iter().map(|l| l.uuid.as_deref()).collect::<Vec<_>>(),
            [None, Some(GPU_B)],
            "KAI's names no GPU, HAMi's the one it names"
        );

        let index = index_of(&[
            annotated(
                "uid-a",
                "a",
                serde_json::json!({annotations::HAMI: "uid-b,NVIDIA,1,0:;"}),
            ),
            b(),
        ]);
        assert!(index.limits().0.is_empty());
    }

    /// Every pod's limits, sorted; which sources were found (once synced);
    /// the same list (the same pointer) while nothing changed; a broken
    /// annotation kept as a problem of its pod.
    #[test]
    fn the_index_lists_its_pods_limits() {
        let mut data = IndexData::default();
        for p in [
            annotated(
                "uid-b",
                "b",
                serde_json::json!({annotations::HAMI: format!("{GPU_A},NVIDIA,2048,0:;")}),
            ),
            annotated(
                "uid-a",
                "a",
                serde_json::json!({annotations::HAMI: format!("{GPU_B},NVIDIA,1024,0:{GPU_A},NVIDIA,512,0:;")}),
            ),
            annotated(
                "uid-c",
                "c",
                serde_json::json!({annotations::KAI_MEMORY: "-1"}),
            ),
        ] {
            data.upsert(Pod::from_api(&p).unwrap());
        }
        let index = PodIndex::new();
        index.publish(&data);
        let (limits, sources) = index.limits();
        let got: Vec<(&str, &str, u64)> = limits
            .iter()
            .map(|l| match l.amount {
                crate::model::Amount::Bytes(b) => {
                    (&*l.pod_uid, l.uuid.as_deref().unwrap_or(""), b >> 20)
                }
                crate::model::Amount::Fraction(_) => unreachable!(),
            })
            .collect();
        assert_eq!(
            got,
            [
                ("uid-a", GPU_A, 512),
                ("uid-a", GPU_B, 1024),
                ("uid-b", GPU_A, 2048)
            ]
        );
        assert_eq!(sources, LimitSources::default(), "not synced yet");
        index.synced.store(true, Ordering::Release);
        let (again, sources) = index.limits();
        assert!(Arc::ptr_eq(&limits, &again));
        assert_eq!(sources.get(LimitSource::Hami), Some(true));
        assert_eq!(sources.get(LimitSource::Kai), Some(false));
        assert_eq!(sources.get(LimitSource::Dra), None);

        // Published again with the same pods: the same list.
        index.publish(&data);
        assert!(Arc::ptr_eq(&limits, &index.limits().0));
        assert_eq!(
            data.pods["uid-c"].problems,
            [Problem {
                annotation: annotations::KAI_MEMORY,
                error: annotations::AnnotationError::NotMebibytes("-1".into()),
            }]
        );
        // A pod gone: a new list without it.
        data.delete("uid-b");
        index.publish(&data);
        let (after, _) = index.limits();
        assert_eq!(after.len(), 2);
        assert!(after.iter().all(|l| &*l.pod_uid == "uid-a"));
    }

    /// A container id resolves only with its own pod's UID.
    #[test]
    fn resolve_needs_the_container_of_the_same_pod() {
        let index = PodIndex::new();
        index.insert("uid-a", &[("trainer", ID_A)], "team-a", "trainer-0");
        index.insert("uid-b", &[("server", ID_B)], "team-b", "infer-0");
        let found = |ns: &str, pod: &str, c: &str| {
            PodLookup::Found(PodRef {
                namespace: ns.into(),
                pod: pod.into(),
                container: c.into(),
            })
        };
        let mismatch = |owner: &str| PodLookup::Mismatch {
            owner: owner.into(),
        };
        let cases = [
            (
                Some("uid-a"),
                Some(ID_A),
                found("team-a", "trainer-0", "trainer"),
            ),
            (Some("uid-a"), Some(ID_B), mismatch("uid-b")),
            (None, Some(ID_B), mismatch("uid-b")),
            (Some("uid-a"), None, found("team-a", "trainer-0", "")),
            (Some("uid-a"), Some(ID_C), found("team-a", "trainer-0", "")),
            (Some("uid-x"), None, PodLookup::Unknown),
            (Some("uid-x"), Some(ID_C), PodLookup::Unknown),
            (None, Some(ID_C), PodLookup::Unknown),
            (None, None, PodLookup::Unknown),
        ];
        for (uid, cid, want) in cases {
            assert_eq!(index.resolve(uid, cid), want, "{uid:?} {cid:?}");
        }
    }

    #[test]
    fn index_lookup_and_removal() {
        let index = PodIndex::new();
        index.insert("uid-a", &[("trainer", ID_A)], "team-a", "trainer-0");
        index.insert(
            "uid-b",
            &[("server", &format!("docker://{ID_B}"))],
            "team-b",
            "infer",
        );
        let r = |ns: &str, pod: &str, c: &str| PodRef {
            namespace: ns.into(),
            pod: pod.into(),
            container: c.into(),
        };
        assert_eq!(index.pods(), 2);
        assert_eq!(
            index.lookup(None, Some(ID_A)),
            Some(r("team-a", "trainer-0", "trainer"))
        );
        // The container id wins over a (different) pod UID.
        assert_eq!(
            index.lookup(Some("uid-a"), Some(ID_B)),
            Some(r("team-b", "infer", "server"))
        );
        assert_eq!(
            index.lookup(Some("uid-a"), Some("unknown")),
            Some(r("team-a", "trainer-0", ""))
        );
        assert_eq!(index.lookup(Some("nope"), None), None);
        assert_eq!(index.lookup(None, None), None);

        let mut data = IndexData::clone(&index.data.load());
        assert!(data.remove("uid-a"));
        assert!(!data.remove("uid-a"));
        assert!(!data.containers.contains_key(ID_A));
        assert_eq!(data.containers.len(), 1);
    }
}
