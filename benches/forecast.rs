//! What the forecasts cost per published sample: the history's record and
//! forecasts at 8 GPUs × 256 processes, 10 memory samples a second (one
//! full sample among them), every GPU's ring full (600 s) of a ramp after
//! a steady period. Beside it, the cost of the forecast this replaced
//! (least-squares slopes over the whole window and each half, worked out
//! at every sample), rebuilt here from `trend::slope`, so the two are
//! measured by one build on one machine.
//!
//!     cargo bench --bench forecast
#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench/test: a panic is the failure report

mod common;

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use gpumem_exporter::testing::history::History;
use gpumem_exporter::testing::model::{ProcessSample, Snapshot};
use gpumem_exporter::testing::trend;

const GIB: u64 = 1 << 30;

/// Used bytes at `ms`: steady for 8 minutes, then 100 MiB/s.
fn used(ms: u64) -> u64 {
    let t = ms / 1000;
    40 * GIB + t.saturating_sub(480) * 100 * (1 << 20)
}

/// The sample at `ms` (since the start). Memory-only samples share the
/// last full sample's processes, as the sampler's do; a full sample (every
/// 1000 ms) makes new ones.
fn at(base: &Snapshot, procs: &mut Vec<Arc<[ProcessSample]>>, ms: u64) -> Snapshot {
    let mut s = base.clone();
    s.taken_at = UNIX_EPOCH + Duration::from_millis(1_764_633_600_000 + ms);
    if procs.len() != s.devices.len() || ms.is_multiple_of(1000) {
        *procs = s
            .devices
            .iter()
            .map(|d| Arc::from(d.processes.to_vec()))
            .collect();
    }
    for (d, p) in s.devices.iter_mut().zip(procs.iter()) {
        if let Some(m) = d.memory.as_mut() {
            m.used = used(ms);
            m.free = m.total - m.used - m.reserved.unwrap_or(0);
        }
        d.processes = Arc::clone(p);
    }
    s
}

/// The forecast the change-point one replaced: the slope of the whole
/// window and of each half, from a copy of the window, at every sample.
fn old_forecast(points: &[(u64, u64)]) -> Option<f64> {
    let (first, last) = (points.first()?.0, points.last()?.0);
    let middle = first + (last - first) / 2;
    let split = points.partition_point(|p| p.0 <= middle);
    let (older, newer) = points.split_at(split);
    let rising = |p: &[(u64, u64)]| trend::slope(p).is_some_and(trend::Slope::rising);
    if !rising(older) || !rising(newer) {
        return None;
    }
    Some(trend::slope(points)?.value())
}

fn main() {
    let mut c = common::criterion();
    let base = common::snapshot(true);
    let mut history = History::new();
    let mut procs = Vec::new();
    let mut ms = 0;
    // Fill every ring: 600 s at 10 Hz.
    while ms < 600_000 {
        let s = at(&base, &mut procs, ms);
        history.record(&s);
        black_box(history.forecasts(&s));
        ms += 100;
    }
    let s = at(&base, &mut procs, ms);
    history.record(&s);
    let f = history.forecasts(&s);
    println!(
        "{} GPUs; GPU 0 after 2 min of growth: {:?}",
        common::GPUS,
        f.gpus[0]
    );
    let mut g = c.benchmark_group("forecast");
    // One published sample: record, then the forecasts (a search once in
    // ten samples, when a second has closed; the cached regime otherwise).
    g.bench_function("per_sample", |b| {
        b.iter(|| {
            ms += 100;
            let s = at(&base, &mut procs, ms);
            history.record(&s);
            black_box(history.forecasts(&s))
        })
    });
    // Every sample in a new second: a search per GPU each time (the cost
    // once a second).
    g.bench_function("per_second", |b| {
        b.iter(|| {
            ms = (ms / 1000 + 1) * 1000 + 100;
            let s = at(&base, &mut procs, ms);
            history.record(&s);
            black_box(history.forecasts(&s))
        })
    });
    // Building the sample alone (the clone above), to subtract.
    // Building the samples alone (ten, one of them full), to subtract.
    g.bench_function("sample_alone", |b| {
        b.iter(|| {
            ms += 100;
            black_box(at(&base, &mut procs, ms))
        })
    });
    // The old forecast's own work per sample: 8 GPUs × (a copy of 600
    // points and three slopes).
    let points: Vec<(u64, u64)> = (0..600u64).map(|t| (t, used(t * 1000 + 600_000))).collect();
    g.bench_function("old_per_sample", |b| {
        b.iter(|| {
            for _ in 0..common::GPUS {
                let copy: Vec<(u64, u64)> = black_box(&points).to_vec();
                black_box(old_forecast(&copy));
            }
        })
    });
    // The search alone over a full history of one GPU: flat (an idle
    // GPU's: answered without the search) and a sawtooth (searched).
    let mut finder = trend::regime::Finder::default();
    let flat: Vec<(u64, u64)> = (0..600u64).map(|t| (t, 40 << 30)).collect();
    g.bench_function("regime_flat_600", |b| {
        b.iter(|| black_box(finder.growth(black_box(&flat))))
    });
    let teeth: Vec<(u64, u64)> = (0..600u64)
        .map(|t| (t, (40 << 30) + (t % 20) * (256 << 20)))
        .collect();
    g.bench_function("regime_sawtooth_600", |b| {
        b.iter(|| black_box(finder.growth(black_box(&teeth))))
    });
    g.finish();
    c.final_summary();
}
