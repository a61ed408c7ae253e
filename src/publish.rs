//! The latest snapshot, and what `/healthz` and `/readyz` say about it.
//!
//! The sampler thread publishes each snapshot here by swapping an `Arc`;
//! readers (HTTP handlers) load it without blocking and never see a
//! half-built one. Before publishing, the exporter's own counters
//! ([`Telemetry`]) and every source's state ([`Sources`]: the pod watcher,
//! the kubelet's pod-resources, the DRA claim reader, the Slurm job map,
//! the container engine, the torch bridge) are copied into the snapshot, so one snapshot is
//! everything a scrape shows, in every format.
//!
//! Architecture invariant: **this is the one route from a source into the
//! snapshot.** A source is its folder, one spawn line in the pipeline and
//! one field of [`Sources`]; nothing else copies a source's state.
//!
//! A recorder (`gpumem-exporter record`) also wants every snapshot, not
//! just the latest: [`Shared::set_sink`] hands each published snapshot to a
//! bounded channel as well. The sampler never waits for it: when the
//! channel is full the snapshot is counted as dropped
//! ([`Shared::sink_dropped`]) instead.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwapOption;

use crate::accounting::Ledger;
use crate::bridge::Bridge;
use crate::containers::ContainerCache;
use crate::history::History;
use crate::jobmap::JobMap;
use crate::kube::{ClaimLimits, PodIndex};
use crate::model::{LimitSources, PodLimit, Snapshot};
use crate::podres::PodResources;
use crate::telemetry::Telemetry;

/// Every source's store, as the pipeline started them (`None`: that source
/// is off). Each is written by its own thread or task alone; publish reads
/// each one's state into every snapshot.
#[derive(Debug, Default, Clone)]
pub(crate) struct Sources {
    /// The pod watcher's index (its counters; attribution reads the pods).
    pub(crate) pods: Option<Arc<PodIndex>>,
    /// The kubelet's pod-resources answers.
    pub(crate) pod_resources: Option<Arc<PodResources>>,
    /// The limits the DRA claims of those answers state.
    pub(crate) claims: Option<Arc<ClaimLimits>>,
    /// The Slurm job-mapping reader's latest read.
    pub(crate) job_mapping: Option<Arc<JobMap>>,
    /// The container engine's lookups (attribution reads the names).
    pub(crate) containers: Option<Arc<ContainerCache>>,
    /// The torch bridge (the sampler reads its per-process figures).
    pub(crate) bridge: Option<Arc<Bridge>>,
    /// Not a source: the pod limits of the pod watcher and the claim
    /// reader as one list, the last snapshot's while neither changed.
    pub(crate) pod_limits: Arc<Mutex<PodLimitsMerge>>,
}

impl Sources {
    /// Copy each source's state into `s`.
    fn copy_into(&self, s: &mut Snapshot) {
        s.kubernetes = self.pods.as_ref().map(|p| p.stats());
        s.pod_resources = self.pod_resources.as_ref().map(|p| p.state());
        s.job_mapping = self.job_mapping.as_ref().map(|j| j.state());
        s.containers = self.containers.as_ref().map(|c| c.lookups());
        s.torch = self.bridge.as_ref().map(|b| b.state());
        self.copy_limits(s);
    }

    /// The pod-keyed limits (HAMi's and KAI's annotations, DRA claims)
    /// and which of their sources were found; the sampler's own sources
    /// already in `s` are kept. Without either source the list is an
    /// empty one, the same in every snapshot.
    fn copy_limits(&self, s: &mut Snapshot) {
        let mut found = LimitSources::default();
        // On the stack: this runs at every sample, ten a second.
        let lists = [
            self.pods.as_ref().map(|p| p.limits()),
            self.claims.as_ref().map(|c| c.limits()),
        ]
        .map(|l| {
            l.map(|(list, sources)| {
                found.merge(&sources);
                list
            })
        });
        // Only publish locks it: a panic there left a whole list.
        let mut merge = self.pod_limits.lock().unwrap_or_else(|e| e.into_inner());
        s.limits.pods = merge.of(&lists);
        s.limits.sources.merge(&found);
    }
}

/// The sources' pod limits as one sorted list, made again only when one
/// of them changed: each source keeps its list while its limits stay the
/// same, and so does this, so a snapshot can tell by the pointer.
#[derive(Debug, Default)]
pub(crate) struct PodLimitsMerge {
    from: Vec<Arc<Vec<PodLimit>>>,
    merged: Arc<Vec<PodLimit>>,
}

impl PodLimitsMerge {
    fn of(&mut self, lists: &[Option<Arc<Vec<PodLimit>>>]) -> Arc<Vec<PodLimit>> {
        let lists = || lists.iter().flatten();
        let same = lists().count() == self.from.len()
            && lists().zip(&self.from).all(|(a, b)| Arc::ptr_eq(a, b));
        if !same {
            let lists: Vec<_> = lists().cloned().collect();
            let mut nonempty = lists.iter().filter(|l| !l.is_empty());
            self.merged = match (nonempty.next(), nonempty.next()) {
                (None, _) => Arc::default(),
                (Some(one), None) => Arc::clone(one),
                (Some(_), Some(_)) => {
                    let mut all: Vec<PodLimit> =
                        lists.iter().flat_map(|l| l.iter().cloned()).collect();
                    crate::kube::sort_limits(&mut all);
                    Arc::new(all)
                }
            };
            self.from = lists;
        }
        Arc::clone(&self.merged)
    }
}

/// How many sample intervals may pass without a tick before `/healthz`
/// reports the sampler as stuck.
pub(crate) const HEALTH_MISSED_TICKS: u32 = 3;

/// State shared between the sampler thread and the HTTP handlers.
#[derive(Debug)]
pub struct Shared {
    published: ArcSwapOption<Snapshot>,
    telemetry: Arc<Telemetry>,
    /// Unix time in ms when the last tick finished; 0 before the first.
    last_tick_ms: AtomicU64,
    alive: AtomicBool,
    /// The full sample interval in ms (changes on config reload).
    interval_ms: AtomicU64,
    /// Where every published snapshot also goes, when a recorder is on.
    sink: Mutex<Option<SyncSender<Arc<Snapshot>>>>,
    /// Snapshots the sink had no room for.
    sink_dropped: AtomicU64,
    /// The sources whose state every snapshot carries (set once, by the
    /// pipeline, after NVML opened).
    sources: OnceLock<Sources>,
    /// The last 10 minutes of used memory per GPU, fed by [`Self::publish`].
    history: Mutex<History>,
    /// The last per-workload limits, joined again only when a process
    /// list or a source's limits changed (a full sample, a source's read).
    limits: Mutex<LimitsCache>,
    /// The memory-time and allocation ledger, fed by [`Self::publish`]
    /// (the only one who locks it).
    ledger: Mutex<Ledger>,
}

impl Shared {
    pub fn new(interval: Duration, telemetry: Arc<Telemetry>) -> Self {
        Shared {
            published: ArcSwapOption::empty(),
            telemetry,
            last_tick_ms: AtomicU64::new(0),
            alive: AtomicBool::new(false),
            interval_ms: AtomicU64::new(interval.as_millis() as u64),
            sink: Mutex::new(None),
            sink_dropped: AtomicU64::new(0),
            sources: OnceLock::new(),
            history: Mutex::new(History::new()),
            limits: Mutex::new(LimitsCache::default()),
            ledger: Mutex::new(Ledger::new()),
        }
    }

    /// Also hand every snapshot published from now on to `sink` (`None`:
    /// stop, which disconnects the receiver once no snapshot is in flight).
    /// Set it before the sampler starts to get the first snapshot too.
    pub fn set_sink(&self, sink: Option<SyncSender<Arc<Snapshot>>>) {
        // A recording wants each process's memory-time (its CSV, its
        // summary), whether /metrics serves the per-process counter or not.
        self.ledger
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keep_processes(sink.is_some());
        if let Ok(mut s) = self.sink.lock() {
            *s = sink;
        }
    }

    /// Whether a sink takes every snapshot (a recording): then each
    /// memory-only sample is published, changed or not.
    pub fn has_sink(&self) -> bool {
        self.sink.lock().is_ok_and(|s| s.is_some())
    }

    /// Snapshots not handed to the sink because its channel was full.
    pub fn sink_dropped(&self) -> u64 {
        self.sink_dropped.load(Ordering::Acquire)
    }

    /// Copy these sources' state into every snapshot published from now
    /// on (the first call counts; the pipeline makes it once).
    pub(crate) fn set_sources(&self, sources: Sources) {
        let _ = self.sources.set(sources);
    }

    /// The sampler thread is alive and not stuck (also while it waits for
    /// NVML to come up).
    pub fn beat(&self) {
        self.last_tick_ms
            .store(unix_ms(SystemTime::now()), Ordering::Release);
    }

    /// The sampler thread runs (`true`) or has ended (`false`).
    pub fn set_alive(&self, alive: bool) {
        self.alive.store(alive, Ordering::Release);
    }

    /// A reloaded config changed the full sample interval.
    pub fn set_interval(&self, d: Duration) {
        self.interval_ms
            .store(d.as_millis() as u64, Ordering::Release);
    }

    /// The latest published snapshot, `None` before the first tick.
    pub fn latest(&self) -> Option<Arc<Snapshot>> {
        self.published.load_full()
    }

    /// The full sample interval now.
    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms.load(Ordering::Acquire))
    }

    /// The exporter's own counters (the HTTP side counts into them).
    pub fn telemetry(&self) -> &Arc<Telemetry> {
        &self.telemetry
    }

    /// The memory history, locked: hold it only to copy points out. It may
    /// already hold the points of a snapshot newer than the one a reader
    /// loaded (readers filter by that snapshot's time).
    pub fn history(&self) -> MutexGuard<'_, History> {
        // A panic while recording leaves a ring in order; keep using it.
        self.history.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publish `s` with the exporter's own counters and every source's
    /// state as of now, after adding its memory figures to the history.
    pub fn publish(&self, mut s: Snapshot) {
        s.exporter = self.telemetry.read();
        if let Some(sources) = self.sources.get() {
            sources.copy_into(&mut s);
        }
        {
            // A panic while recording leaves totals that only grew.
            let mut ledger = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
            s.accounting = ledger.record(&s, Instant::now());
        }
        {
            let mut history = self.history();
            history.record(&s);
            s.forecasts = history.forecasts(&s);
            let mut limits = self.limits.lock().unwrap_or_else(|e| e.into_inner());
            limits.join(&mut s, &mut history);
        }
        self.last_tick_ms
            .store(unix_ms(s.taken_at), Ordering::Release);
        let s = Arc::new(s);
        if let Ok(sink) = self.sink.lock()
            && let Some(tx) = sink.as_ref()
        {
            match tx.try_send(Arc::clone(&s)) {
                Ok(()) | Err(TrySendError::Disconnected(_)) => {}
                Err(TrySendError::Full(_)) => {
                    self.sink_dropped.fetch_add(1, Ordering::AcqRel);
                }
            }
        }
        self.published.store(Some(s));
    }

    /// Ready once NVML is initialised and a snapshot is published in which
    /// at least one GPU answers (or the host has none), while the torch
    /// bridge's listener (when it listens) is not stalled.
    pub fn ready(&self) -> Result<(), &'static str> {
        if self
            .sources
            .get()
            .and_then(|s| s.bridge.as_ref())
            .is_some_and(|b| b.stalled().is_some())
        {
            return Err(
                "the torch bridge socket's listener has made no progress for over 2 s (gpumem_exporter_torch_bridge_stalled_seconds)",
            );
        }
        match &*self.published.load() {
            None => Err("NVML is not initialised yet"),
            Some(s) if !s.devices.is_empty() && s.devices.iter().all(|d| !d.up()) => {
                Err("no GPU answered the last sample")
            }
            Some(_) => Ok(()),
        }
    }

    /// Healthy while the sampler thread is alive and has finished a tick
    /// within [`HEALTH_MISSED_TICKS`] sample intervals of `now`.
    pub fn healthy(&self, now: SystemTime) -> Result<(), String> {
        if !self.alive.load(Ordering::Acquire) {
            return Err("sampler thread is not running".into());
        }
        let last = self.last_tick_ms.load(Ordering::Acquire);
        if last == 0 {
            return Err("no sample taken yet".into());
        }
        let age = unix_ms(now).saturating_sub(last);
        let limit = self.interval_ms.load(Ordering::Acquire) * u64::from(HEALTH_MISSED_TICKS);
        if age > limit {
            return Err(format!(
                "the sampler has not finished a tick for {age} ms, more than {HEALTH_MISSED_TICKS} sample intervals ({limit} ms): an NVML call may hang"
            ));
        }
        Ok(())
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Amount, LimitKind, LimitSource};
    use std::sync::mpsc::sync_channel;

    /// The pod watcher's and the claim reader's limits reach the snapshot
    /// as one sorted list, the same one while neither changed, and their
    /// sources join those the sampler found.
    #[test]
    fn pod_limits_are_merged_into_the_snapshot() {
        const GPU: &str = "GPU-00000000-0000-0000-0000-000000000000";
        let pods = Arc::new(PodIndex::new());
        pods.insert_annotated(
            "uid-b",
            "b",
            &[(
                "hami.io/vgpu-devices-allocated",
                &format!("{GPU},NVIDIA,1024,0:;"),
            )],
        );
        let claims = Arc::new(ClaimLimits::new());
        let dra = |uid: &str, gib: u64| PodLimit {
            pod_uid: Arc::from(uid),
            uuid: Some(Arc::from(GPU)),
            source: LimitSource::Dra,
            kind: LimitKind::Hard,
            amount: Amount::Bytes(gib << 30),
        };
        claims.set(vec![dra("uid-c", 2), dra("uid-a", 1)], true);
        let sources = Sources {
            pods: Some(Arc::clone(&pods)),
            claims: Some(Arc::clone(&claims)),
            ..Sources::default()
        };
        let snapshot = || {
            let mut s = Snapshot::empty(UNIX_EPOCH);
            s.limits.sources.set(LimitSource::Driver, false);
            sources.copy_into(&mut s);
            s
        };
        let s = snapshot();
        let got: Vec<(&str, LimitSource)> = s
            .limits
            .pods
            .iter()
            .map(|l| (&*l.pod_uid, l.source))
            .collect();
        assert_eq!(
            got,
            [
                ("uid-a", LimitSource::Dra),
                ("uid-b", LimitSource::Hami),
                ("uid-c", LimitSource::Dra)
            ]
        );
        let found = s.limits.sources;
        assert_eq!(found.get(LimitSource::Driver), Some(false), "the sampler's");
        assert_eq!(found.get(LimitSource::Hami), Some(true));
        assert_eq!(found.get(LimitSource::Kai), Some(false));
        assert_eq!(found.get(LimitSource::Dra), Some(true));
        assert_eq!(found.get(LimitSource::Torch), None);
        assert!(Arc::ptr_eq(&s.limits.pods, &snapshot().limits.pods));

        // One source changes: a new list; one left alone: its own list.
        claims.set(vec![], false);
        let s = snapshot();
        assert_eq!(s.limits.pods.len(), 1);
        assert!(Arc::ptr_eq(&s.limits.pods, &pods.limits().0));
        assert_eq!(s.limits.sources.get(LimitSource::Dra), Some(false));

        // Neither source on: the same empty list every time, no source set.
        let none = Sources::default();
        let (mut a, mut b) = (Snapshot::empty(UNIX_EPOCH), Snapshot::empty(UNIX_EPOCH));
        none.copy_into(&mut a);
        none.copy_into(&mut b);
        assert!(a.limits.pods.is_empty());
        assert!(Arc::ptr_eq(&a.limits.pods, &b.limits.pods));
        assert_eq!(a.limits.sources, LimitSources::default());
    }

    #[test]
    fn the_sink_gets_every_snapshot_and_counts_what_did_not_fit() {
        let shared = Shared::new(Duration::from_secs(1), Arc::new(Telemetry::new()));
        shared.publish(Snapshot::empty(UNIX_EPOCH));
        let (tx, rx) = sync_channel(2);
        shared.set_sink(Some(tx));
        for s in 1..=3 {
            shared.publish(Snapshot::empty(UNIX_EPOCH + Duration::from_secs(s)));
        }
        assert_eq!(shared.sink_dropped(), 1, "the third did not fit");
        let got: Vec<SystemTime> = rx.try_iter().map(|s| s.taken_at).collect();
        assert_eq!(
            got,
            [1, 2].map(|s| UNIX_EPOCH + Duration::from_secs(s)),
            "from set_sink on, in order"
        );
        assert_eq!(
            shared.latest().map(|s| s.taken_at),
            Some(UNIX_EPOCH + Duration::from_secs(3)),
            "the latest is published whatever the sink"
        );
        shared.set_sink(None);
        assert!(
            rx.recv().is_err(),
            "disconnected once the sink is taken away"
        );
    }
}

/// The per-workload limits of the last full sample: a memory-only sample
/// shares its process lists, so the join (and the limit forecasts, whose
/// figures change only with the lists) is made again only when one of
/// them, or a source's limits, changed.
#[derive(Debug, Default)]
struct LimitsCache {
    processes: Vec<Arc<[crate::model::ProcessSample]>>,
    pods: Arc<Vec<crate::model::PodLimit>>,
    cgroups: Arc<Vec<crate::model::CgroupLimit>>,
    rows: Arc<Vec<crate::model::WorkloadLimits>>,
}

impl LimitsCache {
    fn join(&mut self, s: &mut Snapshot, history: &mut History) {
        if s.torch.is_some() {
            // The bridge is on: a process's own limit can be read.
            s.limits.sources.set(crate::model::LimitSource::Torch, true);
        }
        let same = Arc::ptr_eq(&self.pods, &s.limits.pods)
            && Arc::ptr_eq(&self.cgroups, &s.limits.cgroups)
            && self.processes.len() == s.devices.len()
            && self
                .processes
                .iter()
                .zip(&s.devices)
                .all(|(p, d)| Arc::ptr_eq(p, &d.processes));
        if !same {
            let mut rows = crate::limits::assemble(s);
            history.limits(s, &mut rows);
            self.rows = Arc::new(rows);
            self.pods = Arc::clone(&s.limits.pods);
            self.cgroups = Arc::clone(&s.limits.cgroups);
            self.processes = s.devices.iter().map(|d| Arc::clone(&d.processes)).collect();
        }
        s.limits.workloads = Arc::clone(&self.rows);
    }
}
