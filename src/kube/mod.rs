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
//! Beside the names, the index keeps what each pod's own annotations say
//! of its GPU memory limit ([`annotations`]: HAMi's, KAI's), and
//! [`claims`] reads the DRA claims the kubelet names for theirs.
//!
//! Its settings are its own ([`KubeConfig`], which `crate::config` builds
//! and re-exports); it imports neither `config` nor `attribute`, which sees
//! only [`index`]. (`kube::` in these files is kube-rs; this is
//! `crate::kube`.)

mod annotations;
mod bearer;
pub(crate) mod claims;
mod client;
mod config;
pub(crate) mod discovery;
pub(crate) mod index;
mod limits;
mod quantity;
pub(crate) mod slices;
mod watch;

pub(crate) use claims::{ClaimLimits, ClaimRequests, claim_channel, run_claim_reader};
pub use config::KubeConfig;
pub use index::{PodIndex, PodRef};
pub(crate) use slices::SliceIndex;
pub(crate) use slices::run_slice_watcher;
pub use watch::run_watcher;

use crate::model::{Amount, PodLimit};

/// The one order of a list of pod limits: by pod, GPU, source, kind and
/// amount (the snapshot's lists compare equal when their limits do).
pub(crate) fn sort_limits(limits: &mut [PodLimit]) {
    let amount = |a: &Amount| match *a {
        Amount::Bytes(b) => (0, b, 0.0),
        Amount::Fraction(f) => (1, 0, f),
    };
    limits.sort_by(|x, y| {
        (&x.pod_uid, &x.uuid, x.source, x.kind)
            .cmp(&(&y.pod_uid, &y.uuid, y.source, y.kind))
            .then_with(|| {
                let (xa, ya) = (amount(&x.amount), amount(&y.amount));
                (xa.0, xa.1).cmp(&(ya.0, ya.1)).then(xa.2.total_cmp(&ya.2))
            })
    });
}
