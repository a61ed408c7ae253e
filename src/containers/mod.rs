//! Container names on plain Docker and Podman hosts: the container id a
//! process's cgroup names ([`super::cgroup`]) → the engine's Docker Engine
//! API over its Unix socket (`GET /v1.41/containers/{id}/json`) → name,
//! image and the compose project and service labels.
//!
//! Design (the pod watcher's shape, [`crate::kube`]):
//! - **Off the sampler thread, never in a scrape.** [`ContainerCache::get`]
//!   is all the sampler does: a hash lookup under a mutex that no I/O ever
//!   holds. A miss is queued (bounded channel) to the lookup thread
//!   ([`lookup`]), which asks the engine and fills the cache; the process
//!   gets its names in a later tick. A scrape reads the snapshot only.
//! - **Cached by container id**, at most [`MAX_ENTRIES`] ids, each kept
//!   while some process of that container is on a GPU (the sampler's
//!   `retain` drops the others). A container the engine answers 404 for
//!   (another runtime's, or gone) is not asked again for
//!   [`NOT_FOUND_RETRY`]; a failed lookup (socket missing, refused, timed
//!   out, a malformed answer) is retried after a backoff from
//!   [`ERROR_RETRY_MIN`] doubling to [`ERROR_RETRY_MAX`], reset by any
//!   answer — so names come back within seconds of the engine returning.
//! - **Counted and rate-limited.** Every request's outcome is counted
//!   ([`crate::model::ContainerLookups`],
//!   `gpumem_exporter_container_lookups_total{result}`); errors are logged
//!   through [`crate::ratelimit::LogLimiter`], one line per kind backing off.
//! - **Kubernetes wins.** The sampler does not ask for a process whose pod
//!   the pod watcher knows, nor, while the watcher runs, for one whose
//!   cgroup names a pod (see `ProcCache`).
//! - **Hostile input is data.** Ids are checked (hex only) before they are
//!   put in a URL; the body is read up to [`client::MAX_BODY_BYTES`]; label
//!   values are cut to [`client::MAX_VALUE_CHARS`].
//!
//! The client is hyper's HTTP/1 connection over a tokio `UnixStream` (both
//! already here for the server and kube-rs), one connection per lookup: a
//! lookup happens once per new container, so there is nothing to pool.

pub(crate) mod cache;
pub(crate) mod client;
pub(crate) mod lookup;

use std::time::Duration;

pub(crate) use cache::ContainerCache;

/// Container ids the cache holds at most; a new id beyond it is not asked
/// for (its processes keep their container id, without names).
pub(crate) const MAX_ENTRIES: usize = 4096;
/// Ids waiting for the lookup thread at most; a miss that finds the queue
/// full is asked for again in the next tick.
pub(crate) const QUEUE_LEN: usize = 1024;
/// A 404 is believed this long.
pub(crate) const NOT_FOUND_RETRY: Duration = Duration::from_secs(60);
/// The first retry after a failed lookup.
pub(crate) const ERROR_RETRY_MIN: Duration = Duration::from_secs(1);
/// The longest wait between retries while lookups keep failing.
pub(crate) const ERROR_RETRY_MAX: Duration = Duration::from_secs(30);
/// One lookup (connect, request, body) takes at most this long.
pub(crate) const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
