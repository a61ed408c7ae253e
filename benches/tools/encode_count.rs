//! Encode the benches' 8 GPU × 256 process snapshot (benches/common) N
//! times, and gzip each body as the body cache does (`gzip`), and print the
//! sizes: a target for valgrind's callgrind, whose instruction counts do
//! not move with the other load on a shared machine the way criterion's
//! times do. BENCHMARKS.md ("Encode and gzip: instructions") has the
//! commands and the figures.
//!
//!     cargo build --release --example encode_count
//!     valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!         --toggle-collect='gpumem_exporter::testing::expose::encode' \
//!         target/release/examples/encode_count k8s text 10
//!     valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!         --toggle-collect='encode_count::gzip' \
//!         target/release/examples/encode_count k8s text 10 gzip
#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench/test: a panic is the failure report

#[path = "../common/mod.rs"]
mod common;

use std::hint::black_box;
use std::io::Write as _;
use std::sync::Arc;

use gpumem_exporter::testing::expose::{self, Format};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: encode_count k8s|bare text|openmetrics N [gzip]";
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
    let zip = args.get(4).map(String::as_str) == Some("gzip");
    let (mut bytes, mut gzipped) = (0, 0);
    for _ in 0..n {
        let body = black_box(expose::encode(black_box(&snapshot), format).expect("encode"));
        bytes = body.len();
        if zip {
            gzipped = gzip(body.as_bytes()).len();
        }
    }
    println!("{n} encodes of {bytes} bytes, gzip {gzipped} bytes");
}

/// What `http::cache` does to a body: flate2 at its fast level.
#[inline(never)]
fn gzip(plain: &[u8]) -> Vec<u8> {
    let mut z = flate2::write::GzEncoder::new(
        Vec::with_capacity(plain.len() / 4),
        flate2::Compression::fast(),
    );
    z.write_all(plain).expect("gzip");
    z.finish().expect("gzip")
}
