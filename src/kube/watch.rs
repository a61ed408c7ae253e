//! The pod watcher: kube-rs's `watcher` over this node's pods, feeding the
//! [`PodIndex`], with backoff after errors and counters for
//! `gpumem_exporter_kubernetes_*`. A pod annotation that gives no limit
//! (`super::annotations`) is said once per pod and annotation.

use std::collections::HashSet;
use std::fmt::Display;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod as ApiPod;
use kube::runtime::watcher::{self, Event};

use super::client;
use super::config::KubeConfig;
use super::index::{IndexData, Pod, PodIndex};
use crate::backoff::Backoff;
use crate::ratelimit::LogLimiter;

const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A repeated warning of the same kind is logged at most this often, with
/// the number left out in between, so a flapping API server or a stream of
/// bad lines does not flood the log.
const WARN_INTERVAL: Duration = Duration::from_secs(60);
/// The (pod, annotation) pairs remembered as said; past this many, the
/// memory starts over (a pod may then be said again).
const MAX_SAID: usize = 4096;

/// Runs forever on the current tokio runtime: builds the client, then
/// LISTs and WATCHes this node's pods, publishing into `index`. Errors are
/// counted, logged at most once a minute per kind, and retried with a
/// jittered backoff. Returns only when `cfg.node_name` is empty (that
/// selector would match unscheduled pods, never ours).
pub async fn run_watcher(cfg: KubeConfig, index: Arc<PodIndex>) {
    if cfg.node_name.is_empty() {
        tracing::error!("kubernetes pod watcher: no node name given; pod names stay unknown");
        return;
    }
    let mut w = Watcher {
        cfg,
        index,
        local: IndexData::default(),
        fresh: None,
        backoff: Backoff::jittered(BACKOFF_MIN, BACKOFF_MAX),
        warnings: LogLimiter::every(WARN_INTERVAL),
        said: HashSet::new(),
    };
    loop {
        let index = Arc::clone(&w.index);
        let on_rewatch = Arc::new(move || PodIndex::count(&index.watch_restarts_total));
        let built = match client::build(&w.cfg, on_rewatch).await {
            Ok(b) => b,
            Err(e) => {
                w.error("client", &e);
                tokio::time::sleep(w.backoff.next_delay()).await;
                continue;
            }
        };
        tracing::info!(
            api = %built.server,
            config = built.source,
            credentials = built.credentials,
            node = %w.cfg.node_name,
            "kubernetes pod watcher starting"
        );
        // Returns only when the watcher must start over from a LIST.
        w.watch(built.client).await;
    }
}

struct Watcher {
    cfg: KubeConfig,
    index: Arc<PodIndex>,
    /// The authoritative copy; published after each change.
    local: IndexData,
    /// Pods of a LIST in progress (between `Init` and `InitDone`).
    fresh: Option<IndexData>,
    backoff: Backoff,
    /// Per kind of error.
    warnings: LogLimiter<&'static str>,
    /// (pod UID, annotation) whose problem was logged.
    said: HashSet<(String, &'static str)>,
}

impl Watcher {
    /// One `watcher` stream until it asks to be started afresh: a watch
    /// request refused with HTTP 410 Gone (kube-rs would retry it from the
    /// same, expired resourceVersion forever; a new stream relists).
    async fn watch(&mut self, client: kube::Client) {
        let api: kube::Api<ApiPod> = kube::Api::all(client);
        let selector = format!("spec.nodeName={}", self.cfg.node_name);
        // LISTs at resourceVersion 0, unpaged: the API server answers from
        // its watch cache instead of a quorum read of etcd, as client-go's
        // informers ask, which is what a fleet of one watcher per node
        // needs. (A page size would make kube-rs drop the resourceVersion;
        // one node's pods are one small answer anyway.)
        let mut config = watcher::Config::default().fields(&selector).any_semantic();
        config.page_size = None;
        let mut stream = watcher::watcher(api, config).boxed();
        self.fresh = None;
        while let Some(item) = stream.next().await {
            match item {
                Ok(event) => {
                    self.apply(event);
                    self.backoff.reset();
                }
                Err(e) if is_gone_at_watch_start(&e) => {
                    // The resourceVersion expired: not an error, a relist.
                    tracing::info!("pod watch refused with 410 Gone; relisting");
                    tokio::time::sleep(self.backoff.next_delay()).await;
                    return;
                }
                Err(e) => {
                    self.failed(&e);
                    tokio::time::sleep(self.backoff.next_delay()).await;
                }
            }
        }
    }

    fn apply(&mut self, event: Event<ApiPod>) {
        match event {
            Event::Init => self.fresh = Some(IndexData::default()),
            Event::InitApply(p) => {
                if let Some(pod) = self.ours(&p)
                    && let Some(fresh) = &mut self.fresh
                {
                    fresh.upsert(pod);
                }
            }
            Event::InitDone => {
                let mut fresh = self.fresh.take().unwrap_or_default();
                fresh.relisted_from(&self.local);
                self.local = fresh;
                self.index.publish(&self.local);
                PodIndex::count(&self.index.lists_total);
                self.index.touch();
                self.index.synced.store(true, Ordering::Release);
                tracing::info!(
                    pods = self.local.pods.len(),
                    node = %self.cfg.node_name,
                    "pod list synced"
                );
            }
            Event::Apply(p) => {
                self.event();
                let changed = match self.ours(&p) {
                    Some(pod) => {
                        self.local.upsert(pod);
                        true
                    }
                    // Moved off this node (or not usable): forget it.
                    None => p
                        .metadata
                        .uid
                        .as_deref()
                        .is_some_and(|uid| self.local.remove(uid)),
                };
                if changed {
                    self.index.publish(&self.local);
                }
            }
            Event::Delete(p) => {
                self.event();
                if p.metadata
                    .uid
                    .as_deref()
                    .is_some_and(|uid| self.local.delete(uid))
                {
                    self.index.publish(&self.local);
                }
            }
        }
    }

    /// The pod, when it is usable and on this node (the server filters by
    /// node; this does not rely on it).
    fn ours(&mut self, p: &ApiPod) -> Option<Pod> {
        match Pod::from_api(p) {
            Ok(pod) if pod.node_name == self.cfg.node_name => {
                self.say_problems(&pod);
                Some(pod)
            }
            Ok(_) => None,
            Err(e) => {
                self.error("pod object", &e);
                None
            }
        }
    }

    /// One line per pod and annotation that gives it no limit, naming
    /// both and what is wrong (the pod's own series then carry no limit
    /// from it; nothing else changes).
    fn say_problems(&mut self, pod: &Pod) {
        for p in &pod.problems {
            if self.said.len() >= MAX_SAID {
                self.said.clear();
            }
            if self.said.insert((pod.uid.clone(), p.annotation)) {
                tracing::warn!(
                    namespace = %pod.namespace,
                    pod = %pod.name,
                    annotation = p.annotation,
                    error = %p.error,
                    "pod annotation ignored: it gives this pod no GPU memory limit (said once per pod)"
                );
            }
        }
    }

    fn event(&self) {
        PodIndex::count(&self.index.events_total);
        self.index.touch();
    }

    /// Count and log one error of the watcher stream. (Watch restarts are
    /// counted where the requests are seen, in the client's limits layer.)
    fn failed(&mut self, e: &watcher::Error) {
        if let watcher::Error::WatchError(s) = e
            && s.code == 410
        {
            // The resourceVersion expired: kube-rs relists, as it should.
            tracing::info!("pod watch expired (410 Gone); relisting");
            return;
        }
        let kind = match e {
            watcher::Error::InitialListFailed(_) => "list",
            watcher::Error::WatchStartFailed(_) => "watch start",
            watcher::Error::WatchError(_) => "watch error event",
            watcher::Error::WatchFailed(kube::Error::SerdeError(_)) => "watch event",
            watcher::Error::WatchFailed(_) => "watch",
            watcher::Error::NoResourceVersion => "resource version",
        };
        self.error(kind, e);
    }

    fn error(&mut self, kind: &'static str, e: &dyn Display) {
        PodIndex::count(&self.index.errors_total);
        if let Some(suppressed) = self.warnings.check(kind) {
            tracing::warn!(kind, error = %e, suppressed, "kubernetes pod watcher");
        }
    }
}

/// A watch request answered with HTTP 410 (its resourceVersion expired).
fn is_gone_at_watch_start(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::WatchStartFailed(kube::Error::Api(s)) if s.code == 410)
}
