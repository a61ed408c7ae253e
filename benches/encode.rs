//! What one scrape costs at 8 GPUs × 256 processes: encoding a snapshot in
//! each format, a cached hit (what every scrape after the first of a
//! snapshot pays), the first encode of a snapshot from a memory-only
//! sample (`text_after_memory_sample`: only what that sample changes), and
//! gzip. Two shapes: `k8s` (every process in a pod of
//! its own, all labels filled: the largest body) and `bare` (a host without
//! Kubernetes: namespace, pod and container empty).
//!
//! `{shape}/ledger`: what the memory-time ledger adds to each published
//! sample (`memory_sample`: the same process lists, `full_sample`: every
//! list new, 2,048 processes folded), and the body with its families.
//!
//!     cargo bench --bench encode
#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench/test: a panic is the failure report

mod common;

use std::hint::black_box;
use std::io::Write as _;
use std::sync::Arc;

use criterion::{BatchSize, Throughput};
use gpumem_exporter::testing::accounting::Ledger;
use gpumem_exporter::testing::expose::{self, Format};
use gpumem_exporter::testing::http::BodyCache;

fn main() {
    let mut c = common::criterion();
    for (shape, pods) in [("k8s", true), ("bare", false)] {
        let snapshot = Arc::new(common::snapshot(pods));
        let text = expose::encode(&snapshot, Format::Text).expect("encode text");
        let om = expose::encode(&snapshot, Format::OpenMetrics).expect("encode openmetrics");
        let published = BodyCache::new();
        let gz = published
            .body(&snapshot, Format::Text, true)
            .expect("gzip body");
        println!(
            "{shape}: {} GPUs x {} processes; text {} bytes, openmetrics {} bytes, gzip(text) {} bytes",
            common::GPUS,
            common::PROCESSES,
            text.len(),
            om.len(),
            gz.len()
        );

        let mut g = c.benchmark_group(format!("{shape}/encode"));
        g.throughput(Throughput::Bytes(text.len() as u64));
        g.bench_function("text", |b| {
            b.iter(|| expose::encode(black_box(&snapshot), Format::Text))
        });
        g.throughput(Throughput::Bytes(om.len() as u64));
        g.bench_function("openmetrics", |b| {
            b.iter(|| expose::encode(black_box(&snapshot), Format::OpenMetrics))
        });
        // The scrape right after a memory-only sample: the snapshot shares
        // the last full sample's Arcs, so only the memory, allocation and
        // exporter families are encoded (expose::Reuse).
        let reuse = expose::Reuse::new();
        expose::encode_reusing(&snapshot, Format::Text, &reuse).expect("encode");
        g.bench_function("text_after_memory_sample", |b| {
            b.iter_batched(
                || Arc::new((*snapshot).clone()),
                |s| expose::encode_reusing(&s, Format::Text, &reuse),
                BatchSize::SmallInput,
            )
        });
        assert!(reuse.reused() > 0, "the full-sample segments were reused");
        g.finish();

        // The ledger: a memory-only sample (the very same process lists)
        // and a full one (every list a new Arc), 100 ms apart.
        let mut g = c.benchmark_group(format!("{shape}/ledger"));
        let mut ledger = Ledger::new();
        let mut at = std::time::Instant::now();
        ledger.record(&snapshot, at);
        g.bench_function("memory_sample", |b| {
            b.iter(|| {
                at += std::time::Duration::from_millis(100);
                black_box(ledger.record(&snapshot, at))
            })
        });
        g.bench_function("full_sample", |b| {
            b.iter_batched(
                || {
                    let mut s = (*snapshot).clone();
                    for d in &mut s.devices {
                        d.processes = Arc::from(d.processes.to_vec());
                    }
                    s
                },
                |s| {
                    at += std::time::Duration::from_millis(100);
                    ledger.record(&s, at)
                },
                BatchSize::SmallInput,
            )
        });
        g.finish();
        let mut accounted = (*snapshot).clone();
        accounted.accounting = ledger.record(&snapshot, at + std::time::Duration::from_secs(1));
        let accounted = Arc::new(accounted);
        let with = expose::encode(&accounted, Format::Text).expect("encode text");
        let series = |t: &str| t.lines().filter(|l| !l.starts_with('#')).count();
        println!(
            "{shape}: with the ledger's families text {} bytes (+{}), {} series (+{})",
            with.len(),
            with.len() - text.len(),
            series(&with),
            series(&with) - series(&text)
        );

        let mut g = c.benchmark_group(format!("{shape}/published"));
        // Every scrape of a snapshot after the first: a OnceLock read and a
        // refcount increment.
        g.bench_function("body_cached_hit_text", |b| {
            b.iter(|| black_box(&published).body(&snapshot, Format::Text, false))
        });
        g.bench_function("body_cached_hit_gzip", |b| {
            b.iter(|| black_box(&published).body(&snapshot, Format::Text, true))
        });
        // The first gzip scrape of a fresh snapshot: encode and gzip once.
        g.bench_function("body_first_gzip", |b| {
            b.iter_batched(
                || (BodyCache::new(), Arc::new((*snapshot).clone())),
                |(cache, s)| cache.body(&s, Format::Text, true),
                BatchSize::SmallInput,
            )
        });
        // /api/v1/snapshot: the first request of a snapshot from a full
        // sample (everything serialized), and of one from a memory-only
        // sample (the process lists copied from the last one).
        let interval = std::time::Duration::from_secs(1);
        g.bench_function("snapshot_json_first", |b| {
            b.iter_batched(
                || (BodyCache::new(), Arc::new((*snapshot).clone())),
                |(cache, s)| cache.snapshot_json(&s, interval, false),
                BatchSize::SmallInput,
            )
        });
        let json_cache = BodyCache::new();
        json_cache.snapshot_json(&snapshot, interval, false);
        g.bench_function("snapshot_json_after_memory_sample", |b| {
            b.iter_batched(
                || Arc::new((*snapshot).clone()),
                |s| json_cache.snapshot_json(&s, interval, false),
                BatchSize::SmallInput,
            )
        });
        g.finish();

        // gzip alone, at the level the body cache uses (fast).
        let mut g = c.benchmark_group(format!("{shape}/gzip"));
        g.throughput(Throughput::Bytes(text.len() as u64));
        g.bench_function("text_fast", |b| {
            b.iter(|| {
                let mut z = flate2::write::GzEncoder::new(
                    Vec::with_capacity(text.len() / 4),
                    flate2::Compression::fast(),
                );
                z.write_all(black_box(text.as_bytes())).expect("gzip");
                z.finish().expect("gzip")
            })
        });
        g.finish();
    }
    c.final_summary();
}
