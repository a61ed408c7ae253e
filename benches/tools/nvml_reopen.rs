//! Open NVML, read every GPU's identity, MIG layout and memory, close it
//! (handles dropped, nvmlShutdown, library unloaded) and open it again, the
//! way the sampler re-opens NVML after a driver upgrade or reload. Run on a
//! GPU host to check that this cycle is safe with the real libnvidia-ml:
//!
//!     cargo run --release --example nvml_reopen -- [rounds] [path/to/libnvidia-ml.so.1]
//!
//! Prints one line per round and the mean cost of a whole round; exits 1 on
//! the first failure.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a check: a panic is the failure report

use std::time::Instant;

use gpumem_exporter::testing::gpu::GpuSource;
use gpumem_exporter::testing::gpu::NvmlSource;

fn main() {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().map_or(20, |s| s.parse().expect("rounds"));
    let library = args.next();
    let started = Instant::now();
    let mut first = Vec::new();
    for round in 0..rounds {
        let t = Instant::now();
        let mut source = NvmlSource::open(library.as_deref()).unwrap_or_else(|e| {
            eprintln!("round {round}: open failed: {e}");
            std::process::exit(1)
        });
        let mut seen = Vec::new();
        for i in 0..source.device_count() {
            let info = source.identify(i).expect("identify");
            let mig = source.mig_layout(i).expect("mig layout");
            let mem = source.memory(i).expect("memory");
            seen.push((info.uuid, mig.len(), mem.total));
        }
        source.close();
        assert!(source.memory(0).is_err(), "a closed source answers nothing");
        drop(source);
        if round == 0 {
            first = seen.clone();
        }
        assert_eq!(seen, first, "round {round}: same GPUs as round 0");
        println!(
            "round {round}: {} GPU(s) {:?}, open+identify+close {:.2} ms",
            seen.len(),
            seen.iter().map(|s| &s.0).collect::<Vec<_>>(),
            t.elapsed().as_secs_f64() * 1e3
        );
    }
    // Threads still start and exit cleanly after the library was unloaded.
    std::thread::spawn(|| ()).join().expect("thread");
    println!(
        "PASS {rounds} open/identify/close rounds, mean {:.2} ms per round",
        started.elapsed().as_secs_f64() * 1e3 / rounds as f64
    );
}
