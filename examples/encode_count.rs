//! Encode the benches' 8 GPU × 256 process snapshot (benches/common) N
//! times and print the body size: a target for valgrind's callgrind, whose
//! instruction counts do not move with the other load on a shared machine
//! the way criterion's times do. BENCHMARKS.md ("Encode: instructions")
//! has the command and the figures.
//!
//!     cargo build --release --example encode_count
//!     valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!         --toggle-collect='gpumem_exporter::expose::encode' \
//!         target/release/examples/encode_count k8s text 10
#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench/test: a panic is the failure report

#[path = "../benches/common/mod.rs"]
mod common;

use std::hint::black_box;
use std::sync::Arc;

use gpumem_exporter::expose::{self, Format};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: encode_count k8s|bare text|openmetrics N";
    let pods = match args.get(1).map(String::as_str) {
        Some("k8s") => true,
        Some("bare") => false,
        _ => panic!("{usage}"),
    };
    let format = match args.get(2).map(String::as_str) {
        Some("text") => Format::Text,
        Some("openmetrics") => Format::OpenMetrics,
        _ => panic!("{usage}"),
    };
    let n: usize = args.get(3).and_then(|n| n.parse().ok()).expect(usage);
    let snapshot = Arc::new(common::snapshot(pods));
    let mut bytes = 0;
    for _ in 0..n {
        bytes = black_box(expose::encode(black_box(&snapshot), format).expect("encode")).len();
    }
    println!("{n} encodes of {bytes} bytes");
}
