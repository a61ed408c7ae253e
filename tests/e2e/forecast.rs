//! The table of histories (`forecast/table.rs`, the same rows the unit
//! test of `src/history.rs` plays) on the fake NVML: one fake GPU a row,
//! its used memory from the fake's `used_timeline`, every row at once,
//! the real binary under `faketime` at 10 times real speed (its wall
//! clock only: samples every 20 ms real are five a fake second). The test reads
//! `gpu_memory_full_in_seconds` from each scrape with the sample's own
//! time (`gpumem_exporter_last_sample_timestamp_seconds`): every ramp's
//! read at 25, 50 and 75 % of the way within 15 % of the truth, no
//! forecast for a step, a sawtooth without a leak or noise, and none a
//! few seconds after a ramp stops. About 270 s.

#[path = "forecast/table.rs"]
mod table;

use std::process::Command;
use std::time::{Duration, Instant};

use crate::harness::tools::require_tool;
use crate::harness::*;
use table::{Expect, Row};

/// Fake seconds per real second.
const SPEED: u32 = 10;
/// The fake clock at the exporter's start: 2030-01-01T00:00:00Z.
const FAKE_START: f64 = 1_893_456_000.0;
/// The plain ramps (three knots: steady, then a line to full) start this
/// long after it, each flat at its first value until then. The exporter
/// must be sampling before such a row begins: its start
/// (exec, the fake NVML parsing this scenario's knots in a debug build,
/// the first sample) is real time, ten times longer in fake time: about
/// 11 fake seconds on an idle 2-core machine, and more under the load of
/// the other tests on CI, where it once took longer than the 5 fake
/// seconds the fastest row leaves (2 GiB/s from second 0, read at 25 %
/// 12.5 s in, a regime needs 7 seconds). The test checks that the first
/// sample came before this lead; the rows "after 0 min steady" are
/// therefore a minute steady here, and the unit test of `src/history.rs`
/// plays them from second 0. The other rows (steps, sawtooth, noise)
/// start with the exporter, as in the unit test: a flat minute before a
/// sawtooth is a step below its mean, which moves its leak's regime, and
/// none of them is read in its first minute.
const LEAD: f64 = 60.0;

/// When row `r` begins, in fake seconds after the exporter's start.
fn lead(r: &Row) -> f64 {
    if r.knots.len() <= 3 { LEAD } else { 0.0 }
}

fn scenario(rows: &[Row]) -> String {
    let mut y = String::from("devices:\n");
    for (i, r) in rows.iter().enumerate() {
        let knots: Vec<String> = r
            .knots
            .iter()
            .map(|&(t, v)| format!("[{:.3}, {v}]", FAKE_START + lead(r) + t))
            .collect();
        y += &format!(
            "  - uuid: GPU-f0{i:06x}-0000-0000-0000-000000000000\n    memory: {{total: {}, reserved: {}, used: {}}}\n    used_timeline: [{}]\n",
            r.total,
            table::RESERVED,
            r.used(0.0),
            knots.join(", ")
        );
    }
    y
}

/// What a row needs to be watched for (row seconds).
fn until(r: &Row) -> f64 {
    match r.expect {
        Expect::Ramp { .. } => r.reads().last().map_or(r.seconds, |x| x.1 + 2.0),
        Expect::Never => r.seconds.min(900.0),
        Expect::Stops { stop, within, .. } => stop + within + 60.0,
    }
}

/// The sample's time and each GPU's `gpu_memory_full_in_seconds` (by
/// the `gpu` label), from an exposition body.
fn scan(body: &str, gpus: usize) -> Option<(f64, Vec<Option<f64>>)> {
    let mut ts = None;
    let mut out = vec![None; gpus];
    for line in body.lines() {
        if let Some(v) = line.strip_prefix("gpumem_exporter_last_sample_timestamp_seconds ") {
            ts = v.trim().parse().ok();
        } else if let Some(rest) = line.strip_prefix("gpu_memory_full_in_seconds{gpu=\"") {
            let (gpu, rest) = rest.split_once('"')?;
            let value = rest.rsplit_once(' ')?.1.parse().ok()?;
            if let Some(slot) = gpu.parse::<usize>().ok().and_then(|g| out.get_mut(g)) {
                *slot = Some(value);
            }
        }
    }
    Some((ts?, out))
}

#[derive(Default)]
struct Seen {
    /// (share, truth, forecast) per read, from the scrape nearest it.
    reads: Vec<(f64, f64, Option<f64>)>,
    /// A forecast seen where there must be none: (row second, value).
    wrong: Option<(f64, f64)>,
    /// A forecast seen while a stopping ramp ran; and the first time
    /// after `start + first_within` had one.
    during: bool,
    first: Option<(f64, bool)>,
}

#[test]
fn the_table_of_histories_on_the_fake_nvml() {
    let faketime = require_tool("faketime");
    let rows = table::rows();
    let sc = Scenario::new(&scenario(&rows));
    let mut cmd = Command::new(faketime);
    cmd.args(["-f", &format!("@2030-01-01 00:00:00 x{SPEED}"), BIN])
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    // Five samples a fake second (two a second at 10 Hz would be the
    // exporter's default): a second's largest figure is near its end.
    let interval = format!("{}ms", 200 / SPEED);
    let ex = Exporter::spawn(Exporter::command(
        cmd,
        &sc,
        &["--memory-sample-interval", &interval],
    ));
    let served = wait_for(Duration::from_secs(10), "every row's GPU served", || {
        let body = ex.get("/metrics").body;
        let (ts, _) = scan(&body, rows.len())?;
        (body.matches("\ngpu_memory_used_bytes{").count() == rows.len()).then_some(ts)
    });
    assert!(
        served - FAKE_START < LEAD,
        "the exporter served its first sample {:.1} fake s after its start, after the plain ramps began ({LEAD} s)",
        served - FAKE_START
    );
    println!(
        "first sample served {:.1} fake s after the start; the plain ramps begin at {LEAD} s",
        served - FAKE_START
    );
    let end = rows.iter().map(|r| lead(r) + until(r)).fold(0.0, f64::max);
    let mut seen: Vec<Seen> = rows.iter().map(|_| Seen::default()).collect();
    // Every scrape: (fake seconds of its sample since the exporter's
    // start, each GPU's forecast).
    let mut scrapes: Vec<(f64, Vec<Option<f64>>)> = Vec::new();
    let started = Instant::now();
    let mut t0 = f64::NEG_INFINITY;
    while t0 < end {
        assert!(
            started.elapsed() < Duration::from_secs_f64(end / f64::from(SPEED) + 60.0),
            "the fake clock does not run at {SPEED}x: at {t0} of {end} s"
        );
        std::thread::sleep(Duration::from_millis(20));
        // A scan of the two families, not a parse of the body: a scrape is
        // a few fake seconds at this speed, the fast rows fill in 50.
        let Some((ts, forecasts)) = scan(&ex.get("/metrics").body, rows.len()) else {
            continue;
        };
        t0 = ts - FAKE_START;
        scrapes.push((t0, forecasts.clone()));
        for (i, (r, s)) in rows.iter().zip(&mut seen).enumerate() {
            let f = forecasts[i];
            // The row's own second.
            let t = t0 - lead(r);
            match r.expect {
                Expect::Ramp {
                    start,
                    first_within,
                    ..
                } => {
                    if t < start && s.wrong.is_none() {
                        s.wrong = f.map(|f| (t, f));
                    }
                    if let Some(w) = first_within
                        && t >= start + w
                        && s.first.is_none()
                    {
                        s.first = Some((t - start, f.is_some()));
                    }
                }
                Expect::Never => {
                    if t >= 0.0 && s.wrong.is_none() {
                        s.wrong = f.map(|f| (t, f));
                        if s.wrong.is_some() && std::env::var_os("FORECAST_DUMP").is_some() {
                            let h = ex.get("/api/v1/history").body;
                            std::fs::write(format!("/tmp/fc-hist-{i}.json"), h).ok();
                        }
                    }
                }
                Expect::Stops {
                    start,
                    stop,
                    within,
                } => {
                    s.during |= t >= start && t < stop && f.is_some();
                    if t >= stop + within && s.wrong.is_none() {
                        s.wrong = f.map(|f| (t, f));
                    }
                }
            }
        }
    }
    // Each read from the scrape nearest its time while the ramp still ran
    // (a loaded machine can hold a scrape back a few fake seconds).
    for (i, (r, s)) in rows.iter().zip(&mut seen).enumerate() {
        let Some(full) = r.full_at() else { continue };
        for (q, at, _) in r.reads() {
            let near = scrapes
                .iter()
                .map(|x| (x.0 - lead(r), &x.1))
                .filter(|x| x.0 >= at - 2.0 && x.0 < full - 0.5)
                .min_by(|a, b| (a.0 - at).abs().total_cmp(&(b.0 - at).abs()));
            if let Some((t, f)) = near {
                s.reads.push((q, full - t, f[i]));
            }
        }
    }
    let mut failures = Vec::new();
    println!("| row | read at | truth s | forecast s | error |");
    println!("|---|---|---|---|---|");
    for (r, s) in rows.iter().zip(&seen) {
        for &(q, truth, f) in &s.reads {
            let error = f.map(|f| (f - truth) / truth);
            println!(
                "| {} | {:.0} % | {truth:.1} | {} | {} |",
                r.name,
                q * 100.0,
                f.map_or("none".into(), |f| format!("{f:.1}")),
                error.map_or("-".into(), |e| format!("{:+.1} %", e * 100.0))
            );
            if !error.is_some_and(|e| e.abs() <= table::TOLERANCE) {
                failures.push(format!(
                    "{}: at {:.0} %: {f:?} against {truth:.1}",
                    r.name,
                    q * 100.0
                ));
            }
        }
        if matches!(r.expect, Expect::Ramp { .. }) && s.reads.len() != table::READS.len() {
            failures.push(format!("{}: read {} times", r.name, s.reads.len()));
        }
        if let Some((t, f)) = s.wrong {
            failures.push(format!("{}: a forecast of {f:.1} s at {t:.1} s", r.name));
        }
        match (&r.expect, s.first) {
            (
                Expect::Ramp {
                    first_within: Some(_),
                    ..
                },
                Some((after, true)),
            ) => {
                println!(
                    "| {} | first forecast | - | there {after:.1} s after the start | - |",
                    r.name
                )
            }
            (
                Expect::Ramp {
                    first_within: Some(_),
                    ..
                },
                other,
            ) => failures.push(format!("{}: no forecast in time: {other:?}", r.name)),
            _ => {}
        }
        match r.expect {
            Expect::Never => println!(
                "| {} | any time | - | {} | - |",
                r.name,
                if s.wrong.is_some() {
                    "a forecast"
                } else {
                    "none (as it should)"
                }
            ),
            Expect::Stops { .. } => {
                println!(
                    "| {} | after the stop | - | {} | - |",
                    r.name,
                    if s.wrong.is_some() {
                        "still one"
                    } else {
                        "gone (as it should)"
                    }
                );
                if !s.during {
                    failures.push(format!("{}: no forecast while it grew", r.name));
                }
            }
            _ => {}
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
