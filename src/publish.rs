//! The latest snapshot, and what `/healthz` and `/readyz` say about it.
//!
//! The sampler thread publishes each snapshot here by swapping an `Arc`;
//! readers (HTTP handlers) load it without blocking and never see a
//! half-built one. Before publishing, the exporter's own counters
//! ([`Telemetry`]) are copied into the snapshot, so one snapshot is
//! everything a scrape shows, in every format.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwapOption;

use crate::history::History;
use crate::model::Snapshot;
use crate::telemetry::Telemetry;

/// How many sample intervals may pass without a tick before `/healthz`
/// reports the sampler as stuck.
pub const HEALTH_MISSED_TICKS: u32 = 3;

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
    /// The last 10 minutes of used memory per GPU, fed by [`Self::publish`].
    history: Mutex<History>,
}

impl Shared {
    pub fn new(interval: Duration, telemetry: Arc<Telemetry>) -> Self {
        Shared {
            published: ArcSwapOption::empty(),
            telemetry,
            last_tick_ms: AtomicU64::new(0),
            alive: AtomicBool::new(false),
            interval_ms: AtomicU64::new(interval.as_millis() as u64),
            history: Mutex::new(History::new()),
        }
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

    /// Publish `s` with the exporter's own counters as of now, after adding
    /// its memory figures to the history.
    pub fn publish(&self, mut s: Snapshot) {
        s.exporter = self.telemetry.read();
        self.history().record(&s);
        self.last_tick_ms
            .store(unix_ms(s.taken_at), Ordering::Release);
        self.published.store(Some(Arc::new(s)));
    }

    /// Ready once NVML is initialised and a snapshot is published in which
    /// at least one GPU answers (or the host has none).
    pub fn ready(&self) -> Result<(), &'static str> {
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
