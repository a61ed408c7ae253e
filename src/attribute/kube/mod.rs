//! Kubernetes attribution: pod UID / container id → (namespace, pod, container).
//!
//! cgroups (see [`super::cgroup`]) tell us a process's pod UID and container
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
//!   [`KubeState::errors_total`](crate::model::KubeState::errors_total) and skipped; a line over
//!   [`MAX_EVENT_LINE_BYTES`] forces a reconnect. Nothing from the network or
//!   from files is unwrapped. Warnings are deduplicated per kind of error.
//!
//! The client is hyper 1 + rustls (ring provider), trusting only the cluster
//! CA file; plain `http://` is accepted so tests can run a local server.

mod api;
mod index;
mod warnings;
mod watch;

pub use index::{PodIndex, PodRef, normalize_container_id};
pub use watch::{MAX_EVENT_LINE_BYTES, MAX_LIST_PAGE_BYTES, run_watcher};
