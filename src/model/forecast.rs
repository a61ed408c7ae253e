//! A forecast of when a figure reaches its ceiling (a GPU full, a torch
//! or workload limit), shared by the snapshot's forecasts and the limits.

/// "Full in about N minutes at the present growth", from the exporter's
/// one-second history (see `history`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Forecast {
    /// Seconds until the figure reaches its ceiling (free memory 0, or the
    /// torch limit) at `growth_bytes_per_second`.
    pub full_in_seconds: f64,
    /// Least-squares slope of the present regime, bytes per second.
    pub growth_bytes_per_second: f64,
    /// Seconds of history the regime covers.
    pub window_seconds: u64,
}
