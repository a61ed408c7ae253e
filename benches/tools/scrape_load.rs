//! A small scrape-load client: N keep-alive connections, each in its own
//! thread, request `/metrics` back to back for a while and record every
//! request's latency. Prints p50 / p90 / p99 / max and requests per second.
//! Used by BENCHMARKS.md where `wrk` is not available (the GPU host).
//!
//!     cargo run --release --example scrape_load -- ADDR [connections] [seconds] [gzip]
//!     e.g. scrape_load 127.0.0.1:9877 50 10
#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench/test: a panic is the failure report

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn one(s: &mut TcpStream, req: &[u8], buf: &mut Vec<u8>) -> std::io::Result<usize> {
    s.write_all(req)?;
    buf.clear();
    let mut chunk = [0u8; 65536];
    let (head_end, len) = loop {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..i]).to_ascii_lowercase();
            if !head.starts_with("http/1.1 200") {
                return Err(std::io::Error::other(head));
            }
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .ok_or_else(|| std::io::Error::other("no content-length"))?;
            break (i + 4, len);
        }
    };
    while buf.len() < head_end + len {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(len)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(addr) = args.get(1).cloned() else {
        eprintln!("usage: scrape_load ADDR [connections] [seconds] [gzip]");
        std::process::exit(2);
    };
    let conns: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1);
    let secs: f64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(10.0);
    let gzip = args.get(4).is_some_and(|s| s == "gzip");
    let req = format!(
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n{}\r\n",
        if gzip {
            "Accept-Encoding: gzip\r\n"
        } else {
            ""
        }
    )
    .into_bytes();
    let until = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let threads: Vec<_> = (0..conns)
        .map(|_| {
            let (addr, req) = (addr.clone(), req.clone());
            std::thread::spawn(move || {
                let mut lat = Vec::with_capacity(100_000);
                let mut errors = 0u64;
                let mut bytes = 0usize;
                let mut buf = Vec::with_capacity(1 << 20);
                let mut s = match TcpStream::connect(&addr) {
                    Ok(s) => s,
                    Err(_) => return (lat, 1, 0),
                };
                let _ = s.set_nodelay(true);
                while Instant::now() < until {
                    let t = Instant::now();
                    match one(&mut s, &req, &mut buf) {
                        Ok(n) => {
                            lat.push(t.elapsed());
                            bytes = n;
                        }
                        Err(_) => {
                            errors += 1;
                            match TcpStream::connect(&addr) {
                                Ok(n) => s = n,
                                Err(_) => break,
                            }
                        }
                    }
                }
                (lat, errors, bytes)
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut errors = 0;
    let mut body = 0;
    for t in threads {
        if let Ok((l, e, b)) = t.join() {
            all.extend(l);
            errors += e;
            body = body.max(b);
        }
    }
    let wall = start.elapsed().as_secs_f64();
    all.sort_unstable();
    let pct = |p: f64| {
        all.get(((all.len() as f64 * p) as usize).min(all.len().saturating_sub(1)))
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
    };
    println!(
        "connections={conns} gzip={gzip} requests={} errors={errors} body={body}B rps={:.0} p50={:.3}ms p90={:.3}ms p99={:.3}ms max={:.3}ms",
        all.len(),
        all.len() as f64 / wall,
        pct(0.50),
        pct(0.90),
        pct(0.99),
        all.last().map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
    );
}
