//! End-to-end: windowed peaks from fast memory samples, and the encoding
//! cache with gzip.

use std::io::Read;
use std::time::{Duration, Instant};

use crate::harness::*;

const G0: [(&str, &str); 2] = [
    ("gpu", "0"),
    ("uuid", "GPU-cccccccc-0000-0000-0000-000000000000"),
];

fn scenario(used: u64, proc_used: u64) -> String {
    format!(
        r#"devices:
  - uuid: GPU-cccccccc-0000-0000-0000-000000000000
    memory: {{total: 150754820096, reserved: 644939776, used: {used}}}
    processes: [{{pid: 3999997, used: {proc_used}}}]
"#
    )
}

/// A spike shorter than the full sample interval, between two scrapes, is
/// caught by the fast memory samples and held for peak_window.
#[test]
fn a_short_spike_between_scrapes_shows_in_the_peak() {
    let base = 10 << 30;
    let spike = 60 << 30;
    let sc = Scenario::new(&scenario(base, 1 << 30));
    let ex = Exporter::start(
        &sc,
        &[
            "--sample-interval",
            "5s",
            "--memory-sample-interval",
            "50ms",
            "--peak-window",
            "20s",
        ],
    );
    let before = ex.metrics();
    assert_eq!(
        before.get_u64("gpu_memory_used_peak_bytes", &G0),
        Some(base)
    );
    sc.write(&scenario(spike, 1 << 30));
    let t = Instant::now();
    std::thread::sleep(Duration::from_millis(300));
    sc.write(&scenario(base, 1 << 30));
    let spike_ms = t.elapsed().as_millis();
    // Let a couple of fast samples see the end of the spike.
    std::thread::sleep(Duration::from_millis(200));
    let after = ex.metrics();
    assert_eq!(
        after.get_u64("gpu_memory_used_bytes", &G0),
        Some(base),
        "spike lasted {spike_ms} ms"
    );
    assert_eq!(
        after.get_u64("gpu_memory_used_peak_bytes", &G0),
        Some(spike)
    );
    // Two scrapers at once see the same value: it is the sampler's, not the scrape's.
    let again = ex.metrics();
    assert_eq!(
        again.get_u64("gpu_memory_used_peak_bytes", &G0),
        Some(spike)
    );
    assert!(
        after
            .get("gpumem_exporter_memory_samples_total", &[])
            .unwrap()
            >= 3.0
    );
}

/// The peak leaves once the window has passed.
#[test]
fn peaks_expire_after_the_window() {
    let sc = Scenario::new(&scenario(1 << 30, 1 << 20));
    let ex = Exporter::start(
        &sc,
        &[
            "--sample-interval",
            "100ms",
            "--memory-sample-interval",
            "20ms",
            "--peak-window",
            "500ms",
        ],
    );
    sc.write(&scenario(5 << 30, 4 << 20));
    wait_for(Duration::from_secs(3), "peak to rise", || {
        let m = ex.metrics();
        let procs = m.find("gpu_process_memory_used_peak_bytes", &[("pid", "3999997")]);
        (m.get_u64("gpu_memory_used_peak_bytes", &G0) == Some(5 << 30)
            && procs.first().map(|p| p.1) == Some((4 << 20) as f64))
        .then_some(())
    });
    sc.write(&scenario(1 << 30, 1 << 20));
    wait_for(
        Duration::from_secs(3),
        "peak to fall back after the window",
        || {
            let m = ex.metrics();
            let procs = m.find("gpu_process_memory_used_peak_bytes", &[("pid", "3999997")]);
            (m.get_u64("gpu_memory_used_peak_bytes", &G0) == Some(1 << 30)
                && procs.first().map(|p| p.1) == Some((1 << 20) as f64))
            .then_some(())
        },
    );
}

#[test]
fn gzip_when_accepted_and_identical_to_plain() {
    let sc = Scenario::new(&scenario(1 << 30, 1 << 20));
    // A long interval so both scrapes see the same snapshot.
    let ex = Exporter::start(
        &sc,
        &["--sample-interval", "1h", "--memory-sample-interval", "1h"],
    );
    let plain = http_get(ex.addr, "/metrics", &[]);
    assert_eq!(plain.header("content-encoding"), None);
    let zipped = http_get_bytes(ex.addr, "/metrics", &[("Accept-Encoding", "gzip")]);
    assert_eq!(zipped.0.as_deref(), Some("gzip"));
    let mut text = String::new();
    flate2::read::GzDecoder::new(&zipped.1[..])
        .read_to_string(&mut text)
        .unwrap();
    assert_eq!(text, plain.body);
}
