//! The pod watcher of the Kubernetes API: pod UID / container id → (namespace, pod, container).
//!
//! cgroups (see [`crate::attribute::cgroup`]) tell us a process's pod UID and container
//! id, but not the names people query by. This module keeps a cache of the
//! pods on *this* node and answers that mapping from memory.
//!
//! Design:
//! - **kube-rs does the protocol.** The client comes from
//!   `kube::Config::infer()` — `KUBECONFIG` or `~/.kube/config` (current
//!   context; client certificates, tokens, token files, exec plugins), else
//!   the in-cluster service account — with `kubernetes.api_url`,
//!   `token_file` and `ca_file` overriding their parts ([`discovery`] finds
//!   the cluster, at start for config and at run time for [`client`]).
//!   `kube::runtime::watcher` does LIST (paged), WATCH from the list's
//!   resourceVersion with bookmarks, re-watch after a drop and relist after
//!   `410 Gone`; kube-rs refreshes the in-cluster token (projected service
//!   account tokens rotate) and CA every minute; `kubernetes.token_file` is
//!   read at every request ([`bearer`]).
//! - **Node-scoped.** The watcher only asks for
//!   `fieldSelector=spec.nodeName=<node>`, and indexes only pods whose
//!   `spec.nodeName` matches even if the server sends others. One exporter per
//!   node therefore costs the API server one LIST at start and one long-lived
//!   WATCH, with a payload proportional to that node's pods, not the cluster.
//! - **Minimal RBAC.** The service account needs `get`, `list` and `watch` on
//!   `pods`, nothing else (no nodes, no secrets, no cluster-wide writes).
//! - **Cached, never in a scrape path.** [`run_watcher`] runs on its own
//!   task and publishes an immutable index by swapping an `Arc`
//!   ([`arc_swap`]). [`PodIndex::lookup`] is a lock-free hash lookup; a scrape
//!   or a sampler tick never waits on the API server, and an unreachable API
//!   server only makes the names go stale, never the GPU numbers.
//! - **Hostile input is data.** A malformed watch event is counted in
//!   [`KubeState::errors_total`](crate::model::KubeState::errors_total) and
//!   skipped; a watch line over [`MAX_EVENT_LINE_BYTES`] or a LIST page over
//!   [`MAX_LIST_PAGE_BYTES`] ends that response ([`limits`], a layer in
//!   kube-rs's client stack, since its line reader has no bound). Nothing from
//!   the network or from files is unwrapped. Warnings are rate-limited per
//!   kind of error.
//!
//! TLS is rustls with the ring provider (kube's `rustls-tls`), no OpenSSL.
//!
//! Beside it, [`slices`] watches this node's ResourceSlices
//! (`resource.k8s.io/v1`) the same way, so the pod-resources client can
//! tell which GPU a Dynamic Resource Allocation device is.
//!
//! Its settings are its own ([`KubeConfig`], which `crate::config` builds
//! and re-exports); it imports neither `config` nor `attribute`, which sees
//! only [`index`]. (`kube::` in these files is kube-rs; this is
//! `crate::kube`.)

mod bearer;
mod client;
mod config;
pub(crate) mod discovery;
pub(crate) mod index;
mod limits;
pub(crate) mod slices;
mod watch;

pub use config::KubeConfig;
pub use index::{PodIndex, PodRef};
pub(crate) use slices::SliceIndex;
pub(crate) use slices::run_slice_watcher;
pub use watch::run_watcher;
