//! The workloads ranked by memory-time, over the last hour and since
//! start, for `/api/v1/snapshot` and the page (the memory-time accounting).
//!
//! The ledger's per-workload totals only say "since the account was
//! made", and an account goes 300 s after the workload's last process. So
//! at each whole minute of the ledger's clock (the first sample at or
//! after it) this takes every account's totals, keeps what each workload
//! gained in the minute just ended (a ring of [`RANK_MINUTES`] − 1
//! minutes), and moves the accounts the ledger dropped into a table of
//! ended workloads. A snapshot's ranking is that base (published in
//! `Accounts::ranking`, changed once a minute) plus the live totals since
//! the last whole minute, worked out when the JSON is encoded.
//!
//! Bounded whatever a tenant does: the ring holds at most
//! [`RANK_WORKLOADS_PER_MINUTE`] workloads per minute (the largest; the
//! rest summed as omitted), the ended table at most
//! [`RANK_ENDED_WORKLOADS`] (the smallest forgotten first, summed as
//! omitted); the last whole minute's copy is as large as the ledger's own
//! accounts (live workloads and those within the grace). Hand-written:
//! a few sums over maps.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use super::workload_totals_of;
use crate::model::{
    Accounts, DeviceSample, RANK_ENDED_WORKLOADS, RANK_MINUTES, RANK_WORKLOADS_PER_MINUTE,
    RankBase, Snapshot, Workload, WorkloadTotals,
};

/// Seconds of one ring slot.
const MINUTE: f64 = 60.0;

/// What one workload gained in one minute.
#[derive(Debug)]
struct Minute {
    /// Ledger seconds the minute began (the whole minute's sample).
    start: f64,
    totals: HashMap<Workload, WorkloadTotals>,
    omitted: WorkloadTotals,
}

/// The ranking's state, owned by the ledger.
#[derive(Debug, Default)]
pub(crate) struct Ranking {
    /// Ledger seconds of the last whole minute taken; `None` before the
    /// first sample.
    last: Option<f64>,
    minutes: VecDeque<Minute>,
    base: Arc<RankBase>,
}

fn minus(a: WorkloadTotals, b: WorkloadTotals) -> WorkloadTotals {
    WorkloadTotals {
        used_byte_seconds: (a.used_byte_seconds - b.used_byte_seconds).max(0.0),
        busy_seconds: (a.busy_seconds - b.busy_seconds).max(0.0),
    }
}

fn is_zero(t: &WorkloadTotals) -> bool {
    t.used_byte_seconds == 0.0 && t.busy_seconds == 0.0
}

/// The largest first by memory-time, then busy time, then the workload.
fn order(a: &(Workload, WorkloadTotals), b: &(Workload, WorkloadTotals)) -> std::cmp::Ordering {
    b.1.used_byte_seconds
        .total_cmp(&a.1.used_byte_seconds)
        .then(b.1.busy_seconds.total_cmp(&a.1.busy_seconds))
        .then_with(|| a.0.cmp(&b.0))
}

/// `map` cut to its `keep` largest, largest first; the rest summed.
fn largest(
    map: HashMap<Workload, WorkloadTotals>,
    keep: usize,
) -> (Vec<(Workload, WorkloadTotals)>, WorkloadTotals) {
    let mut all: Vec<(Workload, WorkloadTotals)> = map.into_iter().collect();
    all.sort_by(order);
    let mut rest = WorkloadTotals::default();
    for (_, t) in all.iter().skip(keep) {
        rest.add(*t);
    }
    all.truncate(keep);
    (all, rest)
}

impl Ranking {
    /// At the ledger's first sample at or after a whole minute (`t`
    /// seconds since start, after `a` took in `devices`): the new base to
    /// publish; `None` within a minute.
    pub(super) fn minute(
        &mut self,
        t: f64,
        a: &Accounts,
        devices: &[DeviceSample],
    ) -> Option<Arc<RankBase>> {
        if self
            .last
            .is_some_and(|l| (t / MINUTE).floor() <= (l / MINUTE).floor())
        {
            return None;
        }
        let old = &self.base;
        let mut gained: HashMap<Workload, WorkloadTotals> = HashMap::new();
        let mut boundary = HashMap::with_capacity(old.boundary.len());
        for (key, (bytes, busy)) in workload_totals_of(a, devices) {
            let since = a.workloads.get(&key).map_or(t, |w| w.since);
            let now = WorkloadTotals {
                used_byte_seconds: bytes,
                busy_seconds: busy,
            };
            let d = match old.boundary.get(&key) {
                Some((then, s)) if *s == since => minus(now, *then),
                _ => now,
            };
            if !is_zero(&d) {
                gained.entry(key.0.clone()).or_default().add(d);
            }
            boundary.insert(key, (now, since));
        }
        let mut ended = old.ended.clone();
        let mut ended_omitted = old.ended_omitted;
        for (key, (then, since)) in &old.boundary {
            // Dropped by the ledger, or dropped and made anew since.
            let gone = boundary.get(key).is_none_or(|(_, s)| s != since);
            if gone && !is_zero(then) {
                ended.entry(key.0.clone()).or_default().add(*then);
            }
        }
        if ended.len() > RANK_ENDED_WORKLOADS {
            let (kept, rest) = largest(ended, RANK_ENDED_WORKLOADS);
            ended_omitted.add(rest);
            ended = kept.into_iter().collect();
        }
        if let Some(start) = self.last {
            let (kept, omitted) = largest(gained, RANK_WORKLOADS_PER_MINUTE);
            self.minutes.push_back(Minute {
                start,
                totals: kept.into_iter().collect(),
                omitted,
            });
        }
        while self.minutes.len() > RANK_MINUTES - 1 {
            self.minutes.pop_front();
        }
        let mut hour: HashMap<Workload, WorkloadTotals> = HashMap::new();
        let mut hour_omitted = WorkloadTotals::default();
        for m in &self.minutes {
            for (w, g) in &m.totals {
                hour.entry(w.clone()).or_default().add(*g);
            }
            hour_omitted.add(m.omitted);
        }
        self.last = Some(t);
        self.base = Arc::new(RankBase {
            window_start: self.minutes.front().map_or(t, |m| m.start),
            hour,
            hour_omitted,
            boundary,
            ended,
            ended_omitted,
        });
        Some(Arc::clone(&self.base))
    }
}

/// One window's ranking.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Ranked {
    /// Seconds the window covers (up to the snapshot).
    pub(crate) seconds: f64,
    /// The largest workloads, largest first.
    pub(crate) workloads: Vec<(Workload, WorkloadTotals)>,
    /// Workloads not listed (past `limit`, or left out of the ring or
    /// the ended table to keep them bounded): their sum.
    pub(crate) omitted: WorkloadTotals,
}

/// Snapshot `s`'s ranking (last hour, since start), at most `limit`
/// workloads each.
pub(crate) fn rank(s: &Snapshot, limit: usize) -> (Ranked, Ranked) {
    let a = &s.accounting;
    let base = &a.ranking;
    let mut hour: HashMap<Workload, WorkloadTotals> = base.hour.clone();
    let mut since: HashMap<Workload, WorkloadTotals> = base.ended.clone();
    for (key, (bytes, busy)) in workload_totals_of(a, &s.devices) {
        let now = WorkloadTotals {
            used_byte_seconds: bytes,
            busy_seconds: busy,
        };
        let made = a.workloads.get(&key).map(|w| w.since);
        let partial = match base.boundary.get(&key) {
            Some((then, s)) if Some(*s) == made => minus(now, *then),
            _ => now,
        };
        if !is_zero(&partial) {
            hour.entry(key.0.clone()).or_default().add(partial);
        }
        if !is_zero(&now) {
            since.entry(key.0).or_default().add(now);
        }
    }
    // Dropped by the ledger since the last whole minute: not yet in the
    // ended table.
    for (key, (then, made)) in &base.boundary {
        let gone = a.workloads.get(key).is_none_or(|w| w.since != *made);
        if gone && !is_zero(then) {
            since.entry(key.0.clone()).or_default().add(*then);
        }
    }
    // A pod named since its totals were kept (by UID alone): listed under
    // the names its live account carries now.
    let live: HashSet<&Workload> = a.workloads.keys().map(|(w, _)| w).collect();
    let named = |w: Workload| match live.get(&w) {
        Some(l) if !l.same_names(&w) => (*l).clone(),
        _ => w,
    };
    let window = |start: f64, map, omitted: WorkloadTotals| {
        let (workloads, mut rest) = largest(map, limit);
        let workloads = workloads.into_iter().map(|(w, t)| (named(w), t)).collect();
        rest.add(omitted);
        Ranked {
            seconds: (a.seconds - start).max(0.0),
            workloads,
            omitted: rest,
        }
    };
    (
        window(base.window_start, hour, base.hour_omitted),
        window(0.0, since, base.ended_omitted),
    )
}
