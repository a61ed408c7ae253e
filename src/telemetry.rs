//! The exporter's own counters that live outside the sampler: config and
//! web config reloads, HTTP connections, bodies encoded. One [`Telemetry`] is made in
//! `main.rs` and handed (`Arc`) to whoever counts; [`Telemetry::read`]
//! copies it into each snapshot when it is published, so the text and
//! OpenMetrics bodies of one snapshot show the same figures.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::model::{ExporterCounters, HttpBodyCounts};

/// Counters and gauges, updated lock-free by their owners.
#[derive(Debug, Default)]
pub struct Telemetry {
    pub config_reloads_success: AtomicU64,
    pub config_reloads_failure: AtomicU64,
    pub web_config_reloads_success: AtomicU64,
    pub web_config_reloads_failure: AtomicU64,
    /// Open HTTP connections now.
    pub http_connections_open: AtomicU64,
    /// Idle connections closed to make room for a new one at the cap.
    pub http_connections_evicted: AtomicU64,
    /// Connections closed at once: the cap was reached and every
    /// connection was busy with a request.
    pub http_connections_refused: AtomicU64,
    /// Bodies encoded by the HTTP side's cache.
    pub http_body_encodes: HttpBodyCounts<AtomicU64>,
}

impl Telemetry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Count one (`AtomicU64` fields only).
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The figures now, as plain data.
    pub fn read(&self) -> ExporterCounters {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ExporterCounters {
            config_reloads_success: r(&self.config_reloads_success),
            config_reloads_failure: r(&self.config_reloads_failure),
            web_config_reloads_success: r(&self.web_config_reloads_success),
            web_config_reloads_failure: r(&self.web_config_reloads_failure),
            http_connections_open: r(&self.http_connections_open),
            http_connections_evicted: r(&self.http_connections_evicted),
            http_connections_refused: r(&self.http_connections_refused),
            http_body_encodes: self.http_body_encodes.map(r),
        }
    }
}
