//! LIST then WATCH of this node's pods, reconnecting with backoff, feeding
//! the [`PodIndex`].

use std::fmt::Display;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{ACCEPT, AUTHORIZATION, USER_AGENT};
use hyper::{Request, Response, StatusCode};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::api::*;
use super::index::{IndexData, PodIndex};
use super::warnings::Warnings;
use crate::backoff::Backoff;
use crate::config::KubeConfig;

/// The longest single watch event accepted. A pod object is a few KiB to a
/// few hundred KiB; anything bigger is a broken or hostile stream, and
/// buffering it without bound would let it take the exporter's memory.
pub const MAX_EVENT_LINE_BYTES: usize = 4 << 20;

/// The largest LIST page accepted (500 pods with big specs stay well under).
pub const MAX_LIST_PAGE_BYTES: usize = 64 << 20;

/// No byte at all for this long (bookmarks arrive about every minute) means
/// a half-open connection: reconnect.
const WATCH_IDLE_TIMEOUT: Duration = Duration::from_secs(WATCH_TIMEOUT_SECONDS + 30);

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const RESPONSE_HEADERS_TIMEOUT: Duration = Duration::from_secs(30);
const LIST_TIMEOUT: Duration = Duration::from_secs(60);

const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------
// The watcher

#[derive(Debug, thiserror::Error)]
enum KubeError {
    #[error("reading {path}: {source}")]
    File {
        path: PathBuf,
        #[source]
        source: FileError,
    },
    #[error("TLS setup: https needs a CA file")]
    NoCaFile,
    #[error("TLS setup: {0}")]
    Tls(#[source] rustls::Error),
    #[error("building the request: {0}")]
    Request(#[source] hyper::http::Error),
    #[error("request failed: {0}")]
    Http(#[from] hyper_util::client::legacy::Error),
    #[error("reading the response: {0}")]
    Body(#[source] Box<dyn std::error::Error + Send + Sync>),
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

/// Why a token or CA file could not be used.
#[derive(Debug, thiserror::Error)]
enum FileError {
    #[error("{0}")]
    Io(#[source] std::io::Error),
    #[error("{0}")]
    Pem(#[source] rustls::pki_types::pem::Error),
    #[error("{0}")]
    Certificate(#[source] rustls::Error),
    #[error("no certificate in the file")]
    NoCertificate,
}

/// The bearer token: `token_file` re-read at every (re)connect, so
/// rotated service account tokens keep working; else the fixed `token`.
fn bearer_token(cfg: &KubeConfig) -> Result<Option<String>, KubeError> {
    if let Some(path) = &cfg.token_file {
        let token = std::fs::read_to_string(path).map_err(|e| KubeError::File {
            path: path.clone(),
            source: FileError::Io(e),
        })?;
        return Ok(Some(token.trim().to_owned()));
    }
    Ok(cfg.token.clone())
}

type HttpClient = Client<HttpsConnector<HttpConnector>, Empty<Bytes>>;

fn build_client(cfg: &KubeConfig) -> Result<HttpClient, KubeError> {
    let mut roots = rustls::RootCertStore::empty();
    if let Some(path) = &cfg.ca_file {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let file_error = |source: FileError| KubeError::File {
            path: path.clone(),
            source,
        };
        for cert in
            CertificateDer::pem_file_iter(path).map_err(|e| file_error(FileError::Pem(e)))?
        {
            let cert = cert.map_err(|e| file_error(FileError::Pem(e)))?;
            roots
                .add(cert)
                .map_err(|e| file_error(FileError::Certificate(e)))?;
        }
        if roots.is_empty() {
            return Err(file_error(FileError::NoCertificate));
        }
    } else if cfg.api_url.starts_with("https:") {
        return Err(KubeError::NoCaFile);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(KubeError::Tls)?
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
        backoff: Backoff::jittered(BACKOFF_MIN, BACKOFF_MAX),
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
        if let Some(token) = bearer_token(&self.cfg)? {
            req = req.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        req.body(Empty::new()).map_err(KubeError::Request)
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
                    .map_err(KubeError::Body)?;
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
                        error: Some(KubeError::Body(Box::new(e))),
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
