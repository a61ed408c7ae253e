//! The RSS floor of any NVML exporter written in Rust: a process that
//! opens NVML (nvml-wrapper, as the exporter does), reads one GPU's
//! identity and memory, and then only waits. Whatever the exporter holds
//! above this figure is its own (the lean pass's target: idle RSS at most
//! this plus 6 MiB; BENCHMARKS.md, "H200: peers after the lean pass").
//!
//!     cargo run --release --example nvml_floor -- [seconds] [path/to/libnvidia-ml.so.1]
//!
//! Prints one line, `rss_kib=… hwm_kib=… gpu_memory_total=…`, after the
//! read and again after `seconds` (default 2) of idling, so the figure is
//! taken where the exporter's is: once startup is over. Runs against the
//! fake NVML too (`target/release/libnvidia_ml.so` with its scenario in
//! `FAKE_NVML_SCENARIO`), which shows the floor of the Rust side alone.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a measurement: a panic is the failure report

use std::time::Duration;

use nvml_wrapper::Nvml;

fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("field in /proc/self/status")
}

fn main() {
    let mut args = std::env::args().skip(1);
    let seconds: f64 = args.next().map_or(2.0, |s| s.parse().expect("seconds"));
    let nvml = match args.next() {
        Some(lib) => Nvml::builder().lib_path(lib.as_ref()).init(),
        None => Nvml::init(),
    }
    .expect("open NVML");
    let device = nvml.device_by_index(0).expect("GPU 0");
    let uuid = device.uuid().expect("uuid");
    let memory = device.memory_info().expect("memory");
    let report = |when: &str| {
        println!(
            "{when}: rss_kib={} hwm_kib={} gpu={uuid} gpu_memory_total={}",
            status_kib("VmRSS:"),
            status_kib("VmHWM:"),
            memory.total
        );
    };
    report("after the read");
    std::thread::sleep(Duration::from_secs_f64(seconds));
    // Read again, as an exporter does, so NVML's per-call state is counted.
    let again = device.memory_info().expect("memory");
    assert_eq!(again.total, memory.total);
    report("idle");
}
