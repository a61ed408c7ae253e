//! The exporter's own counters as published: config and web-config
//! reloads, HTTP bodies, the pod watcher's state.

/// Counters of the config reloads and the HTTP server (see
/// `crate::telemetry`), as of publication.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExporterCounters {
    pub config_reloads_success: u64,
    pub config_reloads_failure: u64,
    pub web_config_reloads_success: u64,
    pub web_config_reloads_failure: u64,
    pub http_connections_open: u64,
    pub http_connections_evicted: u64,
    pub http_connections_refused: u64,
    /// Response bodies encoded, by body: each at most once per snapshot,
    /// however many requests ask.
    pub http_body_encodes: HttpBodyCounts,
}

/// A body the HTTP side encodes from a snapshot: the `body` label of
/// `gpumem_exporter_http_body_encodes_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpBody {
    Text,
    OpenMetrics,
    SnapshotJson,
    HistoryJson,
}

impl HttpBody {
    /// Every body, in exposition order.
    pub const ALL: [HttpBody; 4] = [
        HttpBody::Text,
        HttpBody::OpenMetrics,
        HttpBody::SnapshotJson,
        HttpBody::HistoryJson,
    ];

    pub fn label(self) -> &'static str {
        match self {
            HttpBody::Text => "text",
            HttpBody::OpenMetrics => "openmetrics",
            HttpBody::SnapshotJson => "snapshot_json",
            HttpBody::HistoryJson => "history_json",
        }
    }
}

/// One count per [`HttpBody`]: `u64` as published, `AtomicU64` where
/// counted (`crate::telemetry`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HttpBodyCounts<T = u64> {
    pub text: T,
    pub openmetrics: T,
    pub snapshot_json: T,
    pub history_json: T,
}

impl<T> HttpBodyCounts<T> {
    /// The count of `body`.
    pub fn get(&self, body: HttpBody) -> &T {
        match body {
            HttpBody::Text => &self.text,
            HttpBody::OpenMetrics => &self.openmetrics,
            HttpBody::SnapshotJson => &self.snapshot_json,
            HttpBody::HistoryJson => &self.history_json,
        }
    }

    /// Each count through `f`.
    pub fn map<U>(&self, mut f: impl FnMut(&T) -> U) -> HttpBodyCounts<U> {
        HttpBodyCounts {
            text: f(&self.text),
            openmetrics: f(&self.openmetrics),
            snapshot_json: f(&self.snapshot_json),
            history_json: f(&self.history_json),
        }
    }
}

/// The pod watcher's state and counters, read from its index and copied
/// into each full snapshot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KubeState {
    /// Pods of this node in the index.
    pub pods: u64,
    /// A LIST has completed: the index reflects the API server, not just
    /// an empty start.
    pub synced: bool,
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
}
