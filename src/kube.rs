//! Kubernetes attribution: pod UID / container id → (namespace, pod, container).
//!
//! cgroups (see [`crate::procfs`]) tell us a process's pod UID and container
//! id, but not the names people query by. This module keeps a cache of the
//! pods on *this* node and answers that mapping from memory.
//!
//! Design:
//! - **Node-scoped.** The watcher only asks for
//!   `fieldSelector=spec.nodeName=<node>`, and indexes only pods whose
//!   `spec.nodeName` matches even if the server sends others. One exporter per
//!   node therefore costs the API server one LIST at start and one long-lived
//!   WATCH, with a payload proportional to that node's pods, not the cluster.
//! - **Minimal RBAC.** The service account needs `get`, `list` and `watch` on
//!   `pods`, nothing else (no nodes, no secrets, no cluster-wide writes).
//! - **Cached, never in a scrape path.** [`run_watcher`] runs LIST, then WATCH,
//!   on its own task and publishes an immutable index by swapping an `Arc`
//!   ([`arc_swap`]). [`PodIndex::lookup`] is a lock-free hash lookup; a scrape
//!   or a sampler tick never waits on the API server, and an unreachable API
//!   server only makes the names go stale, never the GPU numbers.
//! - **The real wire protocol.** LIST pages with `limit`/`continue`; WATCH
//!   from the list's `resourceVersion` with bookmarks. Stream end or an I/O
//!   error re-watches from the last seen `resourceVersion` after a jittered
//!   exponential backoff; `410 Gone` (as an HTTP status or an `ERROR` event)
//!   relists and replaces the whole index at once.
//! - **Hostile input is data.** A malformed watch line is counted in
//!   [`WatchStats::errors_total`] and skipped; a line over
//!   [`MAX_EVENT_LINE_BYTES`] forces a reconnect. Nothing from the network or
//!   from files is unwrapped. Warnings are deduplicated per kind of error.
//!
//! The client is hyper 1 + rustls (ring provider), trusting only the cluster
//! CA file; plain `http://` is accepted so tests can run a local server.

use std::collections::HashMap;
use std::fmt::Display;
use std::hash::{BuildHasher, Hasher};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{ACCEPT, AUTHORIZATION, USER_AGENT};
use hyper::{Request, Response, StatusCode};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;

use crate::procfs::is_container_id;

/// Where Kubernetes mounts a pod's service account credentials.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The longest single watch event accepted. A pod object is a few KiB to a
/// few hundred KiB; anything bigger is a broken or hostile stream, and
/// buffering it without bound would let it take the exporter's memory.
pub const MAX_EVENT_LINE_BYTES: usize = 4 << 20;

/// The largest LIST page accepted (500 pods with big specs stay well under).
pub const MAX_LIST_PAGE_BYTES: usize = 64 << 20;

/// Pods per LIST page: a node rarely runs more than the kubelet's default of
/// 110, so one page is the normal case.
const LIST_PAGE_SIZE: u32 = 500;

/// Server-side watch timeout; the stream then ends cleanly and is re-opened.
const WATCH_TIMEOUT_SECONDS: u64 = 300;

/// No byte at all for this long (bookmarks arrive about every minute) means
/// a half-open connection: reconnect.
const WATCH_IDLE_TIMEOUT: Duration = Duration::from_secs(WATCH_TIMEOUT_SECONDS + 30);

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const RESPONSE_HEADERS_TIMEOUT: Duration = Duration::from_secs(30);
const LIST_TIMEOUT: Duration = Duration::from_secs(60);

const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// A repeated warning of the same kind is logged at most this often.
const WARN_INTERVAL: Duration = Duration::from_secs(60);

/// Who a process belongs to in Kubernetes terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    pub namespace: String,
    pub pod: String,
    /// Empty when only the pod UID was known.
    pub container: String,
}

/// Counters of the watcher, for the exporter's own metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WatchStats {
    /// Completed LISTs (all pages), the first one included.
    pub lists_total: u64,
    /// Watches re-opened without a relist (stream end, drop, error).
    pub watch_restarts_total: u64,
    /// Well-formed watch events, bookmarks and `ERROR` events included.
    pub events_total: u64,
    /// Failed requests, bad statuses, malformed or oversize lines, `ERROR`
    /// events other than 410.
    pub errors_total: u64,
    /// When the API server last confirmed the index: a completed LIST or any
    /// watch event (bookmarks included). 0 before the first LIST.
    pub last_sync_unix_seconds: u64,
    /// A LIST has completed: the index reflects the API server, not just
    /// an empty start.
    pub synced: bool,
}

/// The cache of this node's pods. Cheap to share (`Arc<PodIndex>`); readers
/// never block and never see a half-applied relist.
#[derive(Debug, Default)]
pub struct PodIndex {
    data: ArcSwap<IndexData>,
    lists_total: AtomicU64,
    watch_restarts_total: AtomicU64,
    events_total: AtomicU64,
    errors_total: AtomicU64,
    last_sync_unix_seconds: AtomicU64,
    synced: AtomicBool,
}

impl PodIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// A container id (64 hex digits; a `runtime://` prefix is tolerated)
    /// wins and gives the container name; otherwise the pod UID gives the
    /// namespace and pod with an empty container.
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

    /// Pods currently indexed.
    pub fn pods(&self) -> usize {
        self.data.load().pods.len()
    }

    pub fn stats(&self) -> WatchStats {
        WatchStats {
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
            resource_version: String::new(),
            containers: containers
                .iter()
                .filter_map(|(name, id)| {
                    Some(Container {
                        name: (*name).to_owned(),
                        id: normalize_container_id(id)?.to_owned(),
                    })
                })
                .collect(),
        });
        self.data.store(Arc::new(data));
    }

    fn publish(&self, data: &IndexData) {
        self.data.store(Arc::new(data.clone()));
    }

    fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn touch(&self) {
        self.last_sync_unix_seconds
            .store(unix_now(), Ordering::Relaxed);
    }
}

/// The published state: pods by UID and container ids pointing at them.
#[derive(Debug, Clone, Default)]
struct IndexData {
    pods: HashMap<String, Arc<Pod>>,
    containers: HashMap<String, ContainerSlot>,
}

#[derive(Debug, Clone)]
struct ContainerSlot {
    pod_uid: String,
    name: String,
}

impl IndexData {
    fn upsert(&mut self, pod: Pod) {
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

    fn remove(&mut self, uid: &str) -> bool {
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
#[derive(Debug, Clone, PartialEq, Eq)]
struct Pod {
    uid: String,
    namespace: String,
    name: String,
    node_name: String,
    resource_version: String,
    /// Containers that have an id (started at least once), init and
    /// ephemeral containers included.
    containers: Vec<Container>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Container {
    name: String,
    id: String,
}

impl Pod {
    fn to_ref(&self, container: &str) -> PodRef {
        PodRef {
            namespace: self.namespace.clone(),
            pod: self.name.clone(),
            container: container.to_owned(),
        }
    }
}

/// `containerd://<id>`, `cri-o://<id>`, `docker://<id>` or a bare id →
/// the 64-hex id; `None` for anything else (an empty id of a pending
/// container, a truncated id).
pub fn normalize_container_id(raw: &str) -> Option<&str> {
    let id = raw.split_once("://").map_or(raw, |(_, id)| id);
    is_container_id(id).then_some(id)
}

// ---------------------------------------------------------------------------
// Wire format

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    #[serde(rename = "resourceVersion")]
    resource_version: Option<String>,
    #[serde(rename = "continue")]
    continue_token: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawPod {
    metadata: RawMeta,
    spec: RawSpec,
    status: RawPodStatus,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawSpec {
    #[serde(rename = "nodeName")]
    node_name: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawPodStatus {
    #[serde(rename = "containerStatuses")]
    containers: Option<Vec<RawContainerStatus>>,
    #[serde(rename = "initContainerStatuses")]
    init_containers: Option<Vec<RawContainerStatus>>,
    #[serde(rename = "ephemeralContainerStatuses")]
    ephemeral_containers: Option<Vec<RawContainerStatus>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawContainerStatus {
    name: Option<String>,
    #[serde(rename = "containerID")]
    container_id: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawPodList {
    metadata: RawMeta,
    items: Option<Vec<serde_json::Value>>,
}

#[derive(Debug, Deserialize)]
struct RawEvent {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    object: serde_json::Value,
}

/// A `metav1.Status`, as sent in `ERROR` events and error responses.
#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize)]
#[serde(default)]
struct ApiStatus {
    code: Option<u16>,
    reason: Option<String>,
    message: Option<String>,
}

impl Display for ApiStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.code.unwrap_or(0),
            self.reason.as_deref().unwrap_or("-"),
            self.message.as_deref().unwrap_or("-")
        )
    }
}

impl ApiStatus {
    fn is_expired(&self) -> bool {
        self.code == Some(410) || matches!(self.reason.as_deref(), Some("Expired" | "Gone"))
    }
}

/// Why a pod object or an event was not usable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
enum ParseError {
    #[error("invalid JSON: {0}")]
    Json(String),
    #[error("pod object lacks {0}")]
    Missing(&'static str),
    #[error("unknown watch event type {0:?}")]
    UnknownType(String),
}

impl From<serde_json::Error> for ParseError {
    fn from(e: serde_json::Error) -> Self {
        ParseError::Json(e.to_string())
    }
}

fn pod_from_value(value: serde_json::Value) -> Result<Pod, ParseError> {
    let raw: RawPod = serde_json::from_value(value)?;
    let non_empty = |s: Option<String>, what| s.filter(|s| !s.is_empty()).ok_or(what);
    let uid = non_empty(raw.metadata.uid, "metadata.uid").map_err(ParseError::Missing)?;
    let name = non_empty(raw.metadata.name, "metadata.name").map_err(ParseError::Missing)?;
    let namespace =
        non_empty(raw.metadata.namespace, "metadata.namespace").map_err(ParseError::Missing)?;
    let status = raw.status;
    let containers = [
        status.containers,
        status.init_containers,
        status.ephemeral_containers,
    ]
    .into_iter()
    .flatten()
    .flatten()
    .filter_map(|c| {
        let id = normalize_container_id(c.container_id.as_deref()?)?.to_owned();
        Some(Container {
            name: c.name.unwrap_or_default(),
            id,
        })
    })
    .collect();
    Ok(Pod {
        uid,
        namespace,
        name,
        node_name: raw.spec.node_name.unwrap_or_default(),
        resource_version: raw.metadata.resource_version.unwrap_or_default(),
        containers,
    })
}

/// One LIST page.
#[derive(Debug)]
struct PodListPage {
    resource_version: String,
    continue_token: String,
    pods: Vec<Pod>,
    /// Items that were not usable pods.
    skipped: Vec<ParseError>,
}

fn parse_pod_list(body: &[u8]) -> Result<PodListPage, ParseError> {
    let raw: RawPodList = serde_json::from_slice(body)?;
    let mut pods = Vec::new();
    let mut skipped = Vec::new();
    for item in raw.items.into_iter().flatten() {
        match pod_from_value(item) {
            Ok(p) => pods.push(p),
            Err(e) => skipped.push(e),
        }
    }
    Ok(PodListPage {
        resource_version: raw.metadata.resource_version.unwrap_or_default(),
        continue_token: raw.metadata.continue_token.unwrap_or_default(),
        pods,
        skipped,
    })
}

#[derive(Debug, PartialEq, Eq)]
enum WatchEvent {
    Added(Pod),
    Modified(Pod),
    Deleted(Pod),
    Bookmark { resource_version: String },
    Error(ApiStatus),
}

fn parse_watch_event(line: &[u8]) -> Result<WatchEvent, ParseError> {
    let raw: RawEvent = serde_json::from_slice(line)?;
    Ok(match raw.kind.as_str() {
        "ADDED" => WatchEvent::Added(pod_from_value(raw.object)?),
        "MODIFIED" => WatchEvent::Modified(pod_from_value(raw.object)?),
        "DELETED" => WatchEvent::Deleted(pod_from_value(raw.object)?),
        "BOOKMARK" => {
            let raw: RawPod = serde_json::from_value(raw.object)?;
            WatchEvent::Bookmark {
                resource_version: raw.metadata.resource_version.unwrap_or_default(),
            }
        }
        "ERROR" => WatchEvent::Error(serde_json::from_value(raw.object)?),
        other => return Err(ParseError::UnknownType(other.to_owned())),
    })
}

/// Percent-encodes a query value (RFC 3986 unreserved characters pass).
fn encode_query(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

// ---------------------------------------------------------------------------
// Configuration

/// Where the API server is and how to authenticate to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeConfig {
    /// `https://host:port` (or `http://` for tests), no trailing path.
    pub api_url: String,
    /// The node whose pods are watched (the downward API's `spec.nodeName`).
    pub node_name: String,
    /// A fixed bearer token; `token_file` wins when both are set.
    pub token: Option<String>,
    /// Read at every (re)connect, so projected service account tokens,
    /// which the kubelet rotates, keep working.
    pub token_file: Option<PathBuf>,
    /// PEM bundle of the cluster CA; required for `https://`.
    pub ca_file: Option<PathBuf>,
}

impl KubeConfig {
    /// In-cluster settings from `KUBERNETES_SERVICE_HOST`/`_PORT` and the
    /// service account files under [`SERVICE_ACCOUNT_DIR`]; `None` when not in
    /// a cluster. `env` is the environment lookup (`|k| std::env::var(k).ok()`
    /// in production, a map in tests).
    pub fn in_cluster(env: impl Fn(&str) -> Option<String>, node_name: String) -> Option<Self> {
        let host = env("KUBERNETES_SERVICE_HOST").filter(|h| !h.is_empty())?;
        let port = env("KUBERNETES_SERVICE_PORT").filter(|p| !p.is_empty())?;
        let host = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]")
        } else {
            host
        };
        let dir = PathBuf::from(SERVICE_ACCOUNT_DIR);
        Some(KubeConfig {
            api_url: format!("https://{host}:{port}"),
            node_name,
            token: None,
            token_file: Some(dir.join("token")),
            ca_file: Some(dir.join("ca.crt")),
        })
    }

    fn base(&self) -> &str {
        self.api_url.trim_end_matches('/')
    }

    fn selector(&self) -> String {
        encode_query(&format!("spec.nodeName={}", self.node_name))
    }

    fn list_uri(&self, continue_token: &str) -> String {
        let mut uri = format!(
            "{}/api/v1/pods?fieldSelector={}&limit={LIST_PAGE_SIZE}",
            self.base(),
            self.selector()
        );
        if !continue_token.is_empty() {
            uri.push_str("&continue=");
            uri.push_str(&encode_query(continue_token));
        }
        uri
    }

    fn watch_uri(&self, resource_version: &str) -> String {
        format!(
            "{}/api/v1/pods?fieldSelector={}&watch=1&resourceVersion={}\
             &allowWatchBookmarks=true&timeoutSeconds={WATCH_TIMEOUT_SECONDS}",
            self.base(),
            self.selector(),
            encode_query(resource_version)
        )
    }

    fn bearer_token(&self) -> Result<Option<String>, KubeError> {
        if let Some(path) = &self.token_file {
            let token = std::fs::read_to_string(path).map_err(|e| KubeError::File {
                path: path.clone(),
                error: e.to_string(),
            })?;
            return Ok(Some(token.trim().to_owned()));
        }
        Ok(self.token.clone())
    }
}

// ---------------------------------------------------------------------------
// The watcher

#[derive(Debug, thiserror::Error)]
enum KubeError {
    #[error("reading {path}: {error}")]
    File { path: PathBuf, error: String },
    #[error("TLS setup: {0}")]
    Tls(String),
    #[error("building the request: {0}")]
    Request(String),
    #[error("request failed: {0}")]
    Http(#[from] hyper_util::client::legacy::Error),
    #[error("reading the response: {0}")]
    Body(String),
    #[error("API server answered {status}: {message}")]
    Status { status: StatusCode, message: String },
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("unusable PodList: {0}")]
    List(ParseError),
    #[error("watch event longer than {MAX_EVENT_LINE_BYTES} bytes")]
    LineTooLong,
    #[error("watch ERROR event: {0}")]
    ApiError(ApiStatus),
}

type HttpClient = Client<HttpsConnector<HttpConnector>, Empty<Bytes>>;

fn build_client(cfg: &KubeConfig) -> Result<HttpClient, KubeError> {
    let mut roots = rustls::RootCertStore::empty();
    if let Some(path) = &cfg.ca_file {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let file_error = |e: &dyn Display| KubeError::File {
            path: path.clone(),
            error: e.to_string(),
        };
        for cert in CertificateDer::pem_file_iter(path).map_err(|e| file_error(&e))? {
            let cert = cert.map_err(|e| file_error(&e))?;
            roots.add(cert).map_err(|e| file_error(&e))?;
        }
        if roots.is_empty() {
            return Err(file_error(&"no certificate in the file"));
        }
    } else if cfg.api_url.starts_with("https:") {
        return Err(KubeError::Tls("https needs a CA file".into()));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| KubeError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(CONNECT_TIMEOUT));
    http.set_keepalive(Some(Duration::from_secs(30)));
    http.set_nodelay(true);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new()).build(https))
}

/// Runs forever on the current tokio runtime: LIST, then WATCH, reconnecting
/// with backoff, publishing into `index`. Returns only when `cfg.node_name`
/// is empty (that selector would match unscheduled pods, never ours).
pub async fn run_watcher(cfg: KubeConfig, index: Arc<PodIndex>) {
    if cfg.node_name.is_empty() {
        tracing::error!("kubernetes pod watcher: no node name given; pod names stay unknown");
        return;
    }
    tracing::info!(api = %cfg.api_url, node = %cfg.node_name, "kubernetes pod watcher starting");
    Watcher {
        cfg,
        index,
        local: IndexData::default(),
        resource_version: String::new(),
        backoff: Backoff::new(BACKOFF_MIN, BACKOFF_MAX),
        warnings: Warnings::default(),
    }
    .run()
    .await
}

/// How one watch request ended.
enum WatchEnd {
    /// The stream ended or broke; re-watch from the last resourceVersion.
    Reconnect {
        error: Option<KubeError>,
        progressed: bool,
    },
    /// 410 Gone: the resourceVersion is too old; relist.
    Expired,
}

/// What applying one watch line did.
enum Applied {
    /// A malformed line, counted and skipped.
    Skipped,
    Nothing,
    Changed,
    Expired,
    Failed(KubeError),
}

struct Watcher {
    cfg: KubeConfig,
    index: Arc<PodIndex>,
    /// The authoritative copy; published after each batch of events.
    local: IndexData,
    resource_version: String,
    backoff: Backoff,
    warnings: Warnings,
}

impl Watcher {
    async fn run(mut self) {
        loop {
            let client = match build_client(&self.cfg) {
                Ok(c) => c,
                Err(e) => {
                    self.error("client", &e);
                    tokio::time::sleep(self.backoff.next_delay()).await;
                    continue;
                }
            };
            if let Err(e) = self.list(&client).await {
                self.error("list", &e);
                tokio::time::sleep(self.backoff.next_delay()).await;
                continue;
            }
            self.backoff.reset();
            loop {
                match self.watch(&client).await {
                    WatchEnd::Expired => {
                        tracing::info!(
                            resource_version = %self.resource_version,
                            "pod watch expired (410 Gone); relisting"
                        );
                        break;
                    }
                    WatchEnd::Reconnect { error, progressed } => {
                        if progressed {
                            self.backoff.reset();
                        }
                        match error {
                            Some(e) => self.error("watch", &e),
                            None => tracing::debug!("pod watch stream ended; re-watching"),
                        }
                    }
                }
                PodIndex::count(&self.index.watch_restarts_total);
                tokio::time::sleep(self.backoff.next_delay()).await;
            }
        }
    }

    fn error(&mut self, kind: &'static str, e: &dyn Display) {
        PodIndex::count(&self.index.errors_total);
        self.warnings.warn(kind, e);
    }

    fn request(&self, uri: &str) -> Result<Request<Empty<Bytes>>, KubeError> {
        let mut req = Request::get(uri).header(ACCEPT, "application/json").header(
            USER_AGENT,
            concat!("gpumem-exporter/", env!("CARGO_PKG_VERSION")),
        );
        if let Some(token) = self.cfg.bearer_token()? {
            req = req.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        req.body(Empty::new())
            .map_err(|e| KubeError::Request(e.to_string()))
    }

    async fn send(&self, client: &HttpClient, uri: &str) -> Result<Response<Incoming>, KubeError> {
        let req = self.request(uri)?;
        let resp = tokio::time::timeout(RESPONSE_HEADERS_TIMEOUT, client.request(req))
            .await
            .map_err(|_| KubeError::Timeout(RESPONSE_HEADERS_TIMEOUT))??;
        Ok(resp)
    }

    /// LISTs every page, then replaces the index in one swap.
    async fn list(&mut self, client: &HttpClient) -> Result<(), KubeError> {
        let mut fresh = IndexData::default();
        let mut continue_token = String::new();
        let resource_version = loop {
            let uri = self.cfg.list_uri(&continue_token);
            let body = tokio::time::timeout(LIST_TIMEOUT, async {
                let resp = self.send(client, &uri).await?;
                if !resp.status().is_success() {
                    return Err(status_error(resp).await);
                }
                let body = Limited::new(resp.into_body(), MAX_LIST_PAGE_BYTES)
                    .collect()
                    .await
                    .map_err(|e| KubeError::Body(e.to_string()))?;
                Ok(body.to_bytes())
            })
            .await
            .map_err(|_| KubeError::Timeout(LIST_TIMEOUT))??;
            let page = parse_pod_list(&body).map_err(KubeError::List)?;
            for e in &page.skipped {
                self.error("list item", e);
            }
            for pod in page.pods {
                if pod.node_name == self.cfg.node_name {
                    fresh.upsert(pod);
                }
            }
            if page.continue_token.is_empty() {
                break page.resource_version;
            }
            continue_token = page.continue_token;
        };
        self.local = fresh;
        self.resource_version = resource_version;
        self.index.publish(&self.local);
        PodIndex::count(&self.index.lists_total);
        self.index.touch();
        self.index.synced.store(true, Ordering::Release);
        tracing::info!(
            pods = self.local.pods.len(),
            resource_version = %self.resource_version,
            node = %self.cfg.node_name,
            "pod list synced"
        );
        Ok(())
    }

    /// One WATCH request, applied line by line until it ends.
    async fn watch(&mut self, client: &HttpClient) -> WatchEnd {
        let uri = self.cfg.watch_uri(&self.resource_version);
        let resp = match self.send(client, &uri).await {
            Ok(r) => r,
            Err(error) => {
                return WatchEnd::Reconnect {
                    error: Some(error),
                    progressed: false,
                };
            }
        };
        if resp.status() == StatusCode::GONE {
            return WatchEnd::Expired;
        }
        if !resp.status().is_success() {
            return WatchEnd::Reconnect {
                error: Some(status_error(resp).await),
                progressed: false,
            };
        }
        let mut body = resp.into_body();
        let mut buf: Vec<u8> = Vec::new();
        let mut progressed = false;
        loop {
            let frame = match tokio::time::timeout(WATCH_IDLE_TIMEOUT, body.frame()).await {
                Err(_) => {
                    return WatchEnd::Reconnect {
                        error: Some(KubeError::Timeout(WATCH_IDLE_TIMEOUT)),
                        progressed,
                    };
                }
                Ok(None) => {
                    if !buf.iter().all(u8::is_ascii_whitespace) {
                        self.error("watch event", &"stream ended inside an event");
                    }
                    return WatchEnd::Reconnect {
                        error: None,
                        progressed,
                    };
                }
                Ok(Some(Err(e))) => {
                    return WatchEnd::Reconnect {
                        error: Some(KubeError::Body(e.to_string())),
                        progressed,
                    };
                }
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else {
                continue; // trailers
            };
            let scanned = buf.len();
            buf.extend_from_slice(&data);
            let mut changed = false;
            let mut start = 0;
            let mut from = scanned;
            while let Some(nl) = buf[from..].iter().position(|&b| b == b'\n') {
                let end = from + nl;
                let applied = self.apply_line(&buf[start..end]);
                start = end + 1;
                from = start;
                match applied {
                    Applied::Skipped => continue,
                    Applied::Nothing => {}
                    Applied::Changed => changed = true,
                    Applied::Expired | Applied::Failed(_) => {
                        if changed {
                            self.index.publish(&self.local);
                        }
                        return match applied {
                            Applied::Failed(e) => WatchEnd::Reconnect {
                                error: Some(e),
                                progressed,
                            },
                            _ => WatchEnd::Expired,
                        };
                    }
                }
                progressed = true;
            }
            buf.drain(..start);
            if changed {
                self.index.publish(&self.local);
            }
            if buf.len() > MAX_EVENT_LINE_BYTES {
                return WatchEnd::Reconnect {
                    error: Some(KubeError::LineTooLong),
                    progressed,
                };
            }
        }
    }

    fn apply_line(&mut self, line: &[u8]) -> Applied {
        if line.iter().all(u8::is_ascii_whitespace) {
            return Applied::Nothing;
        }
        let event = match parse_watch_event(line) {
            Ok(e) => e,
            Err(e) => {
                self.error("watch event", &e);
                return Applied::Skipped;
            }
        };
        PodIndex::count(&self.index.events_total);
        self.index.touch();
        match event {
            WatchEvent::Added(pod) | WatchEvent::Modified(pod) => {
                self.advance(&pod.resource_version);
                if pod.node_name == self.cfg.node_name {
                    self.local.upsert(pod);
                    Applied::Changed
                } else if self.local.remove(&pod.uid) {
                    Applied::Changed
                } else {
                    Applied::Nothing
                }
            }
            WatchEvent::Deleted(pod) => {
                self.advance(&pod.resource_version);
                if self.local.remove(&pod.uid) {
                    Applied::Changed
                } else {
                    Applied::Nothing
                }
            }
            WatchEvent::Bookmark { resource_version } => {
                self.advance(&resource_version);
                Applied::Nothing
            }
            WatchEvent::Error(status) if status.is_expired() => Applied::Expired,
            WatchEvent::Error(status) => Applied::Failed(KubeError::ApiError(status)),
        }
    }

    fn advance(&mut self, resource_version: &str) {
        if !resource_version.is_empty() {
            resource_version.clone_into(&mut self.resource_version);
        }
    }
}

/// A non-2xx response as an error, with the Status message when there is one.
async fn status_error(resp: Response<Incoming>) -> KubeError {
    let status = resp.status();
    let body = tokio::time::timeout(
        Duration::from_secs(5),
        Limited::new(resp.into_body(), 64 << 10).collect(),
    )
    .await;
    let message = match body {
        Ok(Ok(body)) => {
            let bytes = body.to_bytes();
            serde_json::from_slice::<ApiStatus>(&bytes)
                .ok()
                .and_then(|s| s.message)
                .unwrap_or_else(|| String::from_utf8_lossy(&bytes).chars().take(200).collect())
        }
        _ => String::new(),
    };
    KubeError::Status { status, message }
}

/// Exponential backoff with "equal jitter": each delay is uniform in
/// [d/2, d], d doubling from `min` to `max`.
#[derive(Debug)]
struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    fn new(min: Duration, max: Duration) -> Self {
        Backoff {
            min,
            max,
            next: min,
        }
    }

    fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).min(self.max);
        let half = d / 2;
        half + half.mul_f64(random_unit())
    }

    fn reset(&mut self) {
        self.next = self.min;
    }
}

/// A uniform number in [0, 1) from std's randomly seeded hasher: jitter
/// needs spread between exporters, not cryptographic quality.
fn random_unit() -> f64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// Logs each kind of warning at most once per [`WARN_INTERVAL`], with the
/// number suppressed in between, so a flapping API server or a stream of
/// bad lines does not flood the log.
#[derive(Debug, Default)]
struct Warnings {
    last: HashMap<&'static str, (Instant, u64)>,
}

impl Warnings {
    fn warn(&mut self, kind: &'static str, e: &dyn Display) {
        let now = Instant::now();
        match self.last.get_mut(kind) {
            Some((at, suppressed)) if now.duration_since(*at) < WARN_INTERVAL => {
                *suppressed += 1;
            }
            slot => {
                let suppressed = slot.map_or(0, |(_, n)| *n);
                tracing::warn!(kind, error = %e, suppressed, "kubernetes pod watcher");
                self.last.insert(kind, (now, 0));
            }
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID_A: &str = "3f4e8c2b1a9d7e6f5c4b3a2918273645f6e5d4c3b2a1908f7e6d5c4b3a291807";
    const ID_B: &str = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9";

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

    fn pod_json(uid: &str, name: &str, ns: &str, node: &str, statuses: &str) -> String {
        format!(
            r#"{{"metadata":{{"name":"{name}","namespace":"{ns}","uid":"{uid}","resourceVersion":"77",
                "labels":{{"app":"x"}},"managedFields":[{{"manager":"kubelet"}}]}},
               "spec":{{"nodeName":"{node}","containers":[{{"name":"trainer","image":"pytorch"}}]}},
               "status":{{"phase":"Running",{statuses}}}}}"#
        )
    }

    #[test]
    fn pod_list_page() {
        let statuses = format!(
            r#""containerStatuses":[{{"name":"trainer","containerID":"containerd://{ID_A}","ready":true}},
                                     {{"name":"sidecar","ready":false}}],
               "initContainerStatuses":[{{"name":"init","containerID":"cri-o://{ID_B}"}}],
               "ephemeralContainerStatuses":null"#
        );
        let body = format!(
            r#"{{"kind":"PodList","apiVersion":"v1","metadata":{{"resourceVersion":"123","continue":"tok=="}},
                "items":[{},{{"metadata":{{"name":"no-uid"}}}},17]}}"#,
            pod_json("u-1", "trainer-0", "team-a", "gpu-node-1", &statuses)
        );
        let page = parse_pod_list(body.as_bytes()).unwrap();
        assert_eq!(page.resource_version, "123");
        assert_eq!(page.continue_token, "tok==");
        assert_eq!(page.skipped.len(), 2);
        assert_eq!(
            page.pods,
            vec![Pod {
                uid: "u-1".into(),
                namespace: "team-a".into(),
                name: "trainer-0".into(),
                node_name: "gpu-node-1".into(),
                resource_version: "77".into(),
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
            }]
        );
        assert!(parse_pod_list(br#"{"kind":"PodList","metadata":{},"items":null}"#).is_ok());
        assert!(parse_pod_list(b"<html>").is_err());
        assert!(parse_pod_list(br#"{"items":{}}"#).is_err());
    }

    #[test]
    fn watch_events() {
        let pod = pod_json("u-2", "p", "team-b", "n1", r#""containerStatuses":[]"#);
        for (kind, ctor) in [
            ("ADDED", WatchEvent::Added as fn(Pod) -> WatchEvent),
            ("MODIFIED", WatchEvent::Modified),
            ("DELETED", WatchEvent::Deleted),
        ] {
            let line = format!(r#"{{"type":"{kind}","object":{pod}}}"#).replace('\n', " ");
            let ev = parse_watch_event(line.as_bytes()).unwrap();
            let want = ctor(pod_from_value(serde_json::from_str(&pod).unwrap()).unwrap());
            assert_eq!(ev, want);
        }
        assert_eq!(
            parse_watch_event(
                br#"{"type":"BOOKMARK","object":{"kind":"Pod","apiVersion":"v1","metadata":{"resourceVersion":"999","annotations":{"k8s.io/initial-events-end":"true"}}}}"#
            )
            .unwrap(),
            WatchEvent::Bookmark {
                resource_version: "999".into()
            }
        );
        let gone = parse_watch_event(
            br#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too old resource version: 1 (2)","reason":"Expired","code":410}}"#,
        )
        .unwrap();
        let WatchEvent::Error(status) = gone else {
            panic!("{gone:?}")
        };
        assert!(status.is_expired());
        let other = ApiStatus {
            code: Some(500),
            reason: Some("InternalError".into()),
            message: None,
        };
        assert!(!other.is_expired());
    }

    #[test]
    fn malformed_events() {
        let cases: &[&[u8]] = &[
            b"",
            b"{",
            b"null",
            b"[]",
            b"{\"object\":{}}",
            b"{\"type\":\"ADDED\"}",
            b"{\"type\":\"ADDED\",\"object\":{\"metadata\":{\"name\":\"a\",\"namespace\":\"b\"}}}",
            b"{\"type\":\"ADDED\",\"object\":{\"metadata\":{\"uid\":1}}}",
            b"{\"type\":\"ADDED\",\"object\":\"x\"}",
            b"{\"type\":\"SOMETHING\",\"object\":{}}",
            b"{\"type\":\"ERROR\",\"object\":{\"code\":\"x\"}}",
            b"\xff\xfe",
        ];
        for line in cases {
            assert!(
                parse_watch_event(line).is_err(),
                "{}",
                String::from_utf8_lossy(line)
            );
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

    #[test]
    fn in_cluster_from_env() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(key, _)| *key == k)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        let cfg = KubeConfig::in_cluster(
            env(&[
                ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
                ("KUBERNETES_SERVICE_PORT", "443"),
            ]),
            "gpu-node-1".into(),
        )
        .unwrap();
        assert_eq!(cfg.api_url, "https://10.96.0.1:443");
        assert_eq!(
            cfg.token_file.as_deref(),
            Some(std::path::Path::new(
                "/var/run/secrets/kubernetes.io/serviceaccount/token"
            ))
        );
        assert_eq!(
            cfg.ca_file.as_deref(),
            Some(std::path::Path::new(
                "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
            ))
        );
        let v6 = KubeConfig::in_cluster(
            env(&[
                ("KUBERNETES_SERVICE_HOST", "fd00::1"),
                ("KUBERNETES_SERVICE_PORT", "6443"),
            ]),
            "n".into(),
        )
        .unwrap();
        assert_eq!(v6.api_url, "https://[fd00::1]:6443");
        assert!(KubeConfig::in_cluster(env(&[]), "n".into()).is_none());
        assert!(
            KubeConfig::in_cluster(env(&[("KUBERNETES_SERVICE_HOST", "10.96.0.1")]), "n".into())
                .is_none()
        );
    }

    #[test]
    fn request_uris() {
        let cfg = KubeConfig {
            api_url: "http://127.0.0.1:8080/".into(),
            node_name: "gpu-node-1".into(),
            token: None,
            token_file: None,
            ca_file: None,
        };
        assert_eq!(
            cfg.list_uri(""),
            "http://127.0.0.1:8080/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-node-1&limit=500"
        );
        assert_eq!(
            cfg.list_uri("a+b/c="),
            "http://127.0.0.1:8080/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-node-1&limit=500&continue=a%2Bb%2Fc%3D"
        );
        assert_eq!(
            cfg.watch_uri("123"),
            "http://127.0.0.1:8080/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-node-1&watch=1&resourceVersion=123&allowWatchBookmarks=true&timeoutSeconds=300"
        );
    }

    #[test]
    fn backoff_doubles_with_jitter_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        let mut ceiling = Duration::from_millis(200);
        for _ in 0..12 {
            let d = b.next_delay();
            assert!(d >= ceiling / 2 && d <= ceiling, "{d:?} vs {ceiling:?}");
            ceiling = (ceiling * 2).min(Duration::from_secs(30));
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(200));
    }
}
