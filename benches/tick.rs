//! One sampler tick at 8 GPUs × 256 processes against the fake NVML, and
//! the NVML part of it measured alone, so the exporter's own share shows.
//!
//!     cargo bench --bench tick
//!
//! The bench builds the fake (`cargo build --release -p fake-nvml`), starts
//! 256 sleeping processes whose pids the scenario lists on every GPU (so
//! the /proc lookups read real files: 2048 lookups per tick, one read of
//! /proc/<pid>/stat per pid, so 256), and opens the fake
//! through the production `NvmlSource`.
//!
//! Under `cargo bench` it then prints each stage of a full and of a
//! memory-only sample, as the sampler thread runs them (the tick, then
//! `Shared::publish`: the ledger, the ranking at a whole minute, the
//! history and its forecasts), and the series count of the bodies a
//! scrape would encode: 130 simulated seconds of samples at the defaults
//! (a full sample each second, nine memory-only ones between), each stage
//! timed on its own.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench/test: a panic is the failure report

mod common;

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use gpumem_exporter::testing::accounting::Ledger;
use gpumem_exporter::testing::attribute::procfs::ProcRoot;
use gpumem_exporter::testing::attribute::{ProcCache, ProcessLookup};
use gpumem_exporter::testing::config::{SamplerConfig, Timing};
use gpumem_exporter::testing::expose::{self, Format, Reuse};
use gpumem_exporter::testing::gpu::NvmlSource;
use gpumem_exporter::testing::gpu::{GpuSource, RawProcess};
use gpumem_exporter::testing::history::History;
use gpumem_exporter::testing::model::{DurationHistogram, Snapshot};
use gpumem_exporter::testing::publish::{Shared, Telemetry};
use gpumem_exporter::testing::sample::Sampler;
use nvml_wrapper::Nvml;

/// The defaults of the binary.
const TIMING: Timing = Timing {
    sample_interval: Duration::from_secs(1),
    memory_sample_interval: Duration::from_millis(100),
    peak_window: Duration::from_secs(30),
    mig_rescan_interval: Duration::from_secs(10),
    limits_interval: Duration::from_secs(10),
};

fn main() {
    let lib = common::fake_nvml();
    let lib = lib.to_str().expect("utf-8 path").to_string();
    let sleepers = common::Sleepers::spawn(common::PROCESSES);
    let pids = sleepers.pids();
    let scenario = common::ScenarioFile::new(&common::scenario_yaml(&pids));
    // SAFETY: single-threaded so far; the fake reads it at nvmlInit.
    unsafe { std::env::set_var("FAKE_NVML_CONFIG", &scenario.path) };

    // Raw nvml-wrapper calls: the driver alone (here: the fake's cost).
    let nvml = Nvml::builder()
        .lib_path(std::ffi::OsStr::new(&lib))
        .init()
        .expect("nvml init on the fake");
    let devices: Vec<_> = (0..common::GPUS as u32)
        .map(|i| nvml.device_by_index(i).expect("device"))
        .collect();
    let driver_full = || {
        for d in &devices {
            black_box(d.memory_info().expect("memory_info"));
            black_box(d.running_compute_processes().expect("compute"));
            black_box(d.running_graphics_processes().expect("graphics"));
            black_box(d.mps_running_compute_processes().expect("mps"));
        }
    };
    let driver_memory = || {
        for d in &devices {
            black_box(d.memory_info().expect("memory_info"));
        }
    };

    // The GpuSource calls the sampler times as "NVML" (driver + conversion
    // + merging compute and graphics lists by pid).
    let mut source = NvmlSource::open(Some(&lib)).expect("open fake NVML");
    // Handles are made when a GPU is identified, as the sampler does first.
    for i in 0..common::GPUS {
        source.identify(i).expect("identify");
    }
    let mut scratch: Vec<RawProcess> = Vec::with_capacity(2 * common::PROCESSES);
    let mut source_full = move || {
        for i in 0..common::GPUS {
            black_box(source.memory(i).expect("memory"));
            scratch.clear();
            source.processes(i, &mut scratch).expect("processes");
            black_box(&scratch);
        }
    };

    // Startup: NVML open (the fake parses its 2048-process scenario here)
    // and the first tick with a cold /proc cache, as the binary does
    // before it listens.
    let t = Instant::now();
    let gpu = NvmlSource::open(Some(&lib)).expect("open fake NVML");
    let open_time = t.elapsed();
    assert_eq!(gpu.device_count(), common::GPUS);
    let config = SamplerConfig {
        timing: TIMING,
        selection: Default::default(),
        collectors: Default::default(),
        procfs: "/proc".into(),
        cgroupfs: "/sys/fs/cgroup".into(),
    };
    let mut sampler = Sampler::new(gpu, ProcCache::new(ProcRoot::default()), config);
    let t = Instant::now();
    let first = sampler.tick();
    let first_tick = t.elapsed();
    let listed: usize = first.devices.iter().map(|d| d.processes.len()).sum();
    assert_eq!(listed, common::GPUS * common::PROCESSES);
    assert!(
        first.devices[0]
            .processes
            .iter()
            .all(|p| &*p.ident.comm == "sleep"),
        "/proc lookups did not find the sleepers"
    );

    // /proc alone: the cached lookup per (GPU, pid), as a tick does it:
    // one read of /proc/<pid>/stat for the first GPU that lists a pid, a
    // hit for the other seven (begin_tick starts a new sample).
    let mut procs = ProcCache::new(ProcRoot::default());
    let mut proc_lookups = || {
        procs.begin_tick();
        for _ in 0..common::GPUS {
            for &pid in &pids {
                black_box(procs.identify(pid));
            }
        }
    };

    let mut c = common::criterion();
    let mut g = c.benchmark_group("nvml_driver");
    g.bench_function("full_8gpu", |b| b.iter(driver_full));
    g.bench_function("memory_8gpu", |b| b.iter(driver_memory));
    g.finish();
    let mut g = c.benchmark_group("gpu_source");
    g.bench_function("full_8gpu", |b| b.iter(&mut source_full));
    g.finish();
    let mut g = c.benchmark_group("procfs");
    g.bench_function("comm_cached_2048", |b| b.iter(&mut proc_lookups));
    g.finish();
    let mut g = c.benchmark_group("sampler");
    g.bench_function("tick", |b| b.iter(|| sampler.tick()));
    g.bench_function("tick_memory", |b| b.iter(|| sampler.tick_memory()));
    // The fake's memory does not move: every sample after the first
    // changes nothing, as on an idle GPU (at most one a second publishes).
    g.bench_function("tick_memory_if_changed_unchanged", |b| {
        b.iter(|| sampler.tick_memory_if_changed())
    });
    g.finish();
    c.final_summary();

    if common::benching() {
        // Interleaved medians, so a noisy neighbour hits all alike, and the
        // sampler's own histograms (what /metrics would show).
        let rounds = 200;
        let mut t = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        for _ in 0..rounds {
            t[0].push(time(|| drop(sampler.tick())));
            t[1].push(time(&mut source_full));
            t[2].push(time(driver_full));
            t[3].push(time(&mut proc_lookups));
        }
        let m: Vec<f64> = t.iter_mut().map(|v| median_us(v)).collect();
        let last = sampler.tick();
        let mean = |h: &DurationHistogram| h.sum / h.count.max(1) as f64 * 1e6;
        let (tick_mean, nvml_mean) = (
            mean(&last.sample_duration),
            mean(&last.sample_nvml_duration),
        );
        println!("\n## tick summary ({rounds} interleaved rounds, medians)\n");
        println!("| what | µs | × NVML driver |");
        println!("|---|---:|---:|");
        for (name, v) in [
            ("sampler.tick()", m[0]),
            ("GpuSource memory+processes ×8", m[1]),
            ("nvml-wrapper calls alone ×8", m[2]),
            ("/proc lookups (2048, 256 reads, cached)", m[3]),
        ] {
            println!("| {name} | {v:.0} | {:.2} |", v / m[2]);
        }
        println!(
            "\nstartup: NvmlSource::open {:.1} ms, first tick (cold /proc cache) {:.1} ms",
            open_time.as_secs_f64() * 1e3,
            first_tick.as_secs_f64() * 1e3
        );
        println!(
            "sampler histograms over {} ticks: mean tick {tick_mean:.0} µs, mean NVML {nvml_mean:.0} µs, tick/NVML {:.2}",
            last.sample_duration.count,
            tick_mean / nvml_mean
        );
    }
    if common::benching() {
        stages(
            &mut sampler,
            &mut source_full,
            &mut proc_lookups,
            &driver_memory,
        );
    }
    drop(sleepers);
}

/// Times of one stage, µs: in full samples and in memory-only ones.
#[derive(Default)]
struct Stage {
    full: Vec<f64>,
    memory: Vec<f64>,
}

impl Stage {
    fn push(&mut self, full: bool, d: Duration) {
        let v = d.as_secs_f64() * 1e6;
        if full {
            self.full.push(v);
        } else {
            self.memory.push(v);
        }
    }
}

fn median(v: &[f64]) -> Option<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

fn cell(v: Option<f64>) -> String {
    v.map_or_else(|| "—".to_string(), |v| format!("{v:.1}"))
}

/// Seconds of samples the stage table covers: two whole minutes of the
/// ledger's clock, so the ranking runs twice.
const STAGE_SECONDS: u32 = 130;

/// Each stage of a full sample and of a memory-only one, in the order the
/// sampler thread runs them, over [`STAGE_SECONDS`] simulated seconds at
/// the default intervals (the ledger and the history are given the
/// simulated times; the sampler and `publish` read the real clock), then
/// what a scrape of each snapshot would encode and count.
fn stages(
    sampler: &mut Sampler<NvmlSource, ProcCache>,
    source_full: &mut dyn FnMut(),
    proc_lookups: &mut dyn FnMut(),
    driver_memory: &dyn Fn(),
) {
    let mut nvml = Stage::default();
    let mut attribution = Stage::default();
    let mut tick = Stage::default();
    let mut ledger = Stage::default();
    let mut ranking = Stage::default();
    let mut history_forecast = Stage::default();
    let mut publish = Stage::default();
    let mut encode = Stage::default();
    let mut count = Stage::default();
    let shared = Shared::new(Duration::from_secs(1), Arc::new(Telemetry::new()));
    let mut led = Ledger::new();
    let mut history = History::new();
    let reuse = Reuse::new();
    let (t0, wall0) = (Instant::now(), SystemTime::now());
    for step in 0..STAGE_SECONDS * 10 {
        let full = step % 10 == 0;
        let at = Duration::from_millis(100 * u64::from(step));
        // The NVML calls and the /proc lookups alone, beside the tick.
        if full {
            nvml.push(true, time(&mut *source_full));
            attribution.push(true, time(&mut *proc_lookups));
        } else {
            nvml.push(false, time(driver_memory));
        }
        let t = Instant::now();
        let mut s: Snapshot = if full {
            sampler.tick()
        } else {
            sampler.tick_memory()
        };
        tick.push(full, t.elapsed());
        s.taken_at = wall0 + at;
        let t = Instant::now();
        let accounts = led.record(&s, t0 + at);
        let spent = t.elapsed();
        // The ledger's first sample at or after a whole minute ranks.
        if step % 600 == 0 && step > 0 {
            ranking.push(full, spent);
        } else {
            ledger.push(full, spent);
        }
        s.accounting = accounts;
        let t = Instant::now();
        history.record(&s);
        s.forecasts = history.forecasts(&s);
        let spent = t.elapsed();
        // A full sample is the first of its second: the regime is found
        // anew; the nine memory-only ones after it move the kept line.
        history_forecast.push(full, spent);
        let published = s.clone();
        let t = Instant::now();
        shared.publish(published);
        publish.push(full, t.elapsed());
        let s = Arc::new(s);
        let t = Instant::now();
        let body = expose::encode_reusing(&s, Format::Text, &reuse).unwrap_or_default();
        encode.push(full, t.elapsed());
        if full {
            count.push(
                true,
                time(|| {
                    black_box(expose::count_series(&body));
                }),
            );
        }
    }
    let rows: [(&str, &Stage); 8] = [
        (
            "NVML calls (`GpuSource`: memory; on a full sample also the process lists)",
            &nvml,
        ),
        (
            "attribution: /proc lookups (2048 cached, 256 stat reads) and stale detection",
            &attribution,
        ),
        (
            "`Sampler::tick` / `tick_memory` whole (NVML, attribution, selection, peaks, idle detection, the snapshot)",
            &tick,
        ),
        ("ledger (`Ledger::record`, within a minute)", &ledger),
        (
            "ranking (the ledger at a whole minute, once a minute)",
            &ranking,
        ),
        (
            "history and forecasts (a full sample is the first of its second: the regime found anew; a memory-only one moves the kept line)",
            &history_forecast,
        ),
        (
            "`Shared::publish` whole (counters, sources, ledger, ranking, history, forecasts, `Arc` swap)",
            &publish,
        ),
        (
            "scrape after it: `/metrics` text encode (reusing the full-sample segments)",
            &encode,
        ),
    ];
    println!("\n## stages ({STAGE_SECONDS} simulated seconds, medians, µs)\n");
    println!("| stage | full sample | memory-only sample |");
    println!("|---|---:|---:|");
    for (name, st) in rows {
        println!(
            "| {name} | {} | {} |",
            cell(median(&st.full)),
            cell(median(&st.memory))
        );
    }
    println!(
        "| of that encode: the series count of a whole body (a memory-only sample's body counts only its per-publish segments) | {} | {} |",
        cell(median(&count.full)),
        cell(median(&count.memory))
    );
    let whole = |st: &Stage| median(&st.full).zip(median(&st.memory));
    if let (Some((tf, tm)), Some((pf, pm))) = (whole(&tick), whole(&publish)) {
        println!(
            "\nA sample as the sampler thread takes it (tick + publish): full {:.1} µs, memory-only {:.1} µs",
            tf + pf,
            tm + pm
        );
    }
}

fn time(mut f: impl FnMut()) -> Duration {
    let t = Instant::now();
    f();
    t.elapsed()
}

fn median_us(v: &mut [Duration]) -> f64 {
    v.sort_unstable();
    v[v.len() / 2].as_secs_f64() * 1e6
}
