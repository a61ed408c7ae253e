//! End-to-end: the exporter under real attack tools, on loopback.
//!
//! - slowhttptest floods the plain-HTTP listener with 3,000 connections
//!   (slow headers `-H`, slow body `-B`, slow read `-X`, range header `-R`)
//!   while a well-behaved scraper, on the attacker's own address (the worst
//!   case for the per-address cap), fetches /metrics five times a second on
//!   a new connection each time with a 1 s deadline for connect and answer.
//!   Not one scrape may fail. slowhttptest stops once the server has closed
//!   all of its connections (which the exporter does within seconds), so it
//!   is started again until the flood has lasted its time.
//! - sslscan against the TLS listener: only TLS 1.2 and 1.3, only AEAD
//!   suites; with `min_version: TLS13` only TLS 1.3. The same check run on
//!   an `openssl s_server` that offers TLS 1.0 and CBC suites must fail (so
//!   the check can fail), and a web config asking for TLS 1.0 or 1.1 is
//!   refused at start (exit 2, one line).
//! - a wrong-password flood of 300 keep-alive connections against basic
//!   auth inside a 100m CPU cgroup, as root ([`login_flood`]).
//!
//! The figures of a run are printed (`--nocapture`) and recorded in
//! RELIABILITY.md. The tools are installed by scripts/ci/test; a missing one
//! fails the test.

use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::harness::tools::{require_on_path, require_tool};
use crate::harness::*;

mod login_flood;

const SCENARIO: &str = r#"devices:
  - uuid: GPU-aaaaaaaa-1717-0000-0000-000000000000
    memory: {total: 150754820096, reserved: 644939776, used: 1048576}
    processes: []
"#;

/// A scrape's deadline, connect to last byte (Prometheus' default scrape
/// timeout is 10 s; this is ten times stricter).
const SCRAPE_DEADLINE: Duration = Duration::from_secs(1);
/// How often the scraper scrapes (Prometheus: every 15–60 s).
const SCRAPE_EVERY: Duration = Duration::from_millis(200);

/// What the scraper saw during a flood.
#[derive(Default)]
struct Scrapes {
    latencies: Vec<Duration>,
    failures: Vec<String>,
    /// The most open connections the exporter reported meanwhile.
    max_open: f64,
}

impl Scrapes {
    fn percentile(&self, q: f64) -> Duration {
        let mut l = self.latencies.clone();
        l.sort();
        let i = ((l.len() as f64 * q).ceil() as usize).clamp(1, l.len().max(1)) - 1;
        l.get(i).copied().unwrap_or_default()
    }
}

/// One scrape on a new connection: the whole answer within the deadline,
/// 200, and the exposition complete (it ends with its last family).
fn scrape_once(addr: SocketAddr) -> Result<(Duration, String), String> {
    let scrape = scrape_within(addr, "/metrics", &[], Deadline::Whole(SCRAPE_DEADLINE))
        .map_err(|e| e.to_string())?;
    let took = scrape.took;
    let r = scrape.response();
    if r.status != 200 {
        return Err(format!("status {} after {took:?}: {:?}", r.status, r.body));
    }
    let complete = r
        .header("content-length")
        .and_then(|l| l.parse::<usize>().ok())
        .is_some_and(|l| l == r.body.len());
    if !complete || !r.body.contains("gpu_memory_used_bytes{") {
        return Err(format!("incomplete exposition ({} bytes)", r.body.len()));
    }
    Ok((took, r.body))
}

/// Scrape every [`SCRAPE_EVERY`] until `stop`.
fn scraper(addr: SocketAddr, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Scrapes> {
    std::thread::spawn(move || {
        let mut seen = Scrapes::default();
        while !stop.load(Ordering::Relaxed) {
            let t = Instant::now();
            match scrape_once(addr) {
                Ok((took, body)) => {
                    seen.latencies.push(took);
                    let open = Metrics::parse(&body)
                        .get("gpumem_exporter_http_connections", &[])
                        .unwrap_or(0.0);
                    seen.max_open = seen.max_open.max(open);
                }
                Err(e) => seen.failures.push(format!("at {:?}: {e}", t.elapsed())),
            }
            std::thread::sleep(SCRAPE_EVERY.saturating_sub(t.elapsed()));
        }
        seen
    })
}

/// The counts slowhttptest printed last (its status block), colours
/// stripped: connections that got connected, errors and closed.
fn slowhttptest_counts(output: &str) -> u64 {
    let mut plain = String::new();
    let mut in_escape = false;
    for c in output.chars() {
        match (in_escape, c) {
            (false, '\u{1b}') => in_escape = true,
            (true, 'm') => in_escape = false,
            (true, _) => {}
            (false, c) => plain.push(c),
        }
    }
    let last = |key: &str| {
        plain
            .lines()
            .filter_map(|l| l.trim().strip_prefix(key))
            .filter_map(|v| v.trim().parse::<u64>().ok())
            .next_back()
            .unwrap_or(0)
    };
    last("connected:") + last("error:") + last("closed:")
}

/// Run slowhttptest (`mode` and `extra` flags, 3,000 connections at 500 a
/// second) against `addr` until `secs` have passed; the connections it
/// made in all, and its runs.
fn flood(addr: SocketAddr, mode: &str, extra: &str, secs: u64) -> (u64, u32) {
    require_on_path("slowhttptest");
    let start = Instant::now();
    let (mut connections, mut runs) = (0, 0);
    while start.elapsed() < Duration::from_secs(secs) {
        let left = secs.saturating_sub(start.elapsed().as_secs()).max(1);
        // 3,000 connections need that many descriptors, and the tool says
        // nothing when it cannot open them.
        let script = format!(
            "ulimit -n 8192 && exec slowhttptest -c 3000 {mode} -i 5 -r 500 -l {left} -p 1 {extra} -u http://{addr}/metrics"
        );
        let out = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .output()
            .expect("run slowhttptest");
        let text = output_text(&out);
        assert!(
            out.status.success() && text.contains("Exit status"),
            "slowhttptest {mode} failed ({}):\n{text}",
            out.status
        );
        connections += slowhttptest_counts(&text);
        runs += 1;
    }
    (connections, runs)
}

/// The exporter (debug build, as every e2e test runs it) with `web_yml` as
/// its web config, if any.
fn exporter(sc: &Scenario, web_yml: Option<&str>) -> Exporter {
    let mut args = vec!["--sample-interval", "1s"];
    let web;
    if let Some(text) = web_yml {
        web = sc.file("web.yml", text.as_bytes());
        args.extend(["--web.config.file", web.to_str().unwrap()]);
    }
    let ex = Exporter::start(sc, &args);
    wait_for(Duration::from_secs(5), "first sample", || {
        scrape_once(ex.addr).ok()
    });
    ex
}

/// Flood an exporter with slowhttptest `mode` for `secs` while scraping it;
/// every scrape must succeed within the deadline.
fn attack(name: &str, web_yml: Option<&str>, mode: &str, extra: &str, secs: u64) {
    // One flood at a time: each holds thousands of sockets and a core.
    let _one = heavy();
    let sc = Scenario::new(SCENARIO);
    let ex = exporter(&sc, web_yml);
    let stop = Arc::new(AtomicBool::new(false));
    let scraping = scraper(ex.addr, Arc::clone(&stop));
    let started = Instant::now();
    let (connections, runs) = flood(ex.addr, mode, extra, secs);
    let lasted = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let seen = scraping.join().expect("scraper thread");
    let after = ex.metrics();
    let counter = |n: &str| after.get(n, &[]).unwrap_or(-1.0);
    eprintln!(
        "attack {name}: slowhttptest {mode} {extra} for {lasted:.1?} ({runs} runs, {connections} connections); \
         exporter held at most {} connections, evicted {}, refused {}; \
         {} scrapes, {} failed, p50 {:?}, p99 {:?}, max {:?}",
        seen.max_open,
        counter("gpumem_exporter_http_connections_evicted_total"),
        counter("gpumem_exporter_http_connections_refused_total"),
        seen.latencies.len() + seen.failures.len(),
        seen.failures.len(),
        seen.percentile(0.5),
        seen.percentile(0.99),
        seen.percentile(1.0),
    );
    assert!(
        seen.failures.is_empty(),
        "{name}: {} of {} scrapes failed during the flood: {:#?}",
        seen.failures.len(),
        seen.latencies.len() + seen.failures.len(),
        seen.failures
    );
    // The flood was real: at least the 3,000 connections asked for...
    assert!(
        connections >= 3000,
        "{name}: slowhttptest made only {connections} connections"
    );
    // ...and the scraper kept at it the whole time.
    let expected = (lasted.as_secs_f64() / SCRAPE_EVERY.as_secs_f64() * 0.8) as usize;
    assert!(
        seen.latencies.len() >= expected,
        "{name}: {} scrapes in {lasted:?}",
        seen.latencies.len()
    );
    assert!(seen.percentile(0.99) < SCRAPE_DEADLINE);
}

/// Slowloris: headers trickled (a line every 5 s), default limits.
#[test]
fn slow_headers_3000_connections_lose_no_scrape() {
    attack("slow headers", None, "-H", "", 30);
}

/// R-U-Dead-Yet: a POST whose 8 KiB body is trickled, default limits.
#[test]
fn slow_body_3000_connections_lose_no_scrape() {
    attack("slow body", None, "-B", "-s 8192", 30);
}

/// Slow read: three pipelined GETs read a byte a second through a window
/// of 1–16 bytes, default limits.
#[test]
fn slow_read_3000_connections_lose_no_scrape() {
    attack("slow read", None, "-X", "-k 3 -n 1 -w 1 -y 16 -z 1", 30);
}

/// Apache killer: a Range header of many overlapping ranges (ignored: the
/// whole body is sent), default limits.
#[test]
fn range_header_3000_connections_lose_no_scrape() {
    attack("range header", None, "-R", "-a 5 -b 2000", 15);
}

/// Slowloris with the per-address cap out of the way, so the flood fills
/// the global cap (1,024 here) and the global eviction is what protects the
/// scraper.
#[test]
fn slow_headers_at_the_global_cap_lose_no_scrape() {
    attack(
        "slow headers, global cap",
        Some("http_server_config:\n  max_connections: 1024\n  max_connections_per_ip: 1024\n"),
        "-H",
        "",
        15,
    );
}

// ------------------------------------------------------------ sslscan

/// What sslscan's XML report says about a server: the protocol versions it
/// found enabled and the suites accepted, as (version, suite).
struct Scan {
    protocols: Vec<String>,
    ciphers: Vec<(String, String)>,
}

/// The value of `attr="…"` in one XML element.
fn attr<'a>(element: &'a str, attr: &str) -> Option<&'a str> {
    let at = element.find(&format!(" {attr}=\""))? + attr.len() + 3;
    element[at..].split('"').next()
}

fn parse_sslscan_xml(xml: &str) -> Scan {
    let elements = |tag: &str| -> Vec<&str> {
        xml.split('<')
            .filter(|e| e.starts_with(&format!("{tag} ")))
            .collect()
    };
    let protocols = elements("protocol")
        .into_iter()
        .filter(|e| attr(e, "enabled") == Some("1"))
        .filter_map(|e| Some(format!("{}{}", attr(e, "type")?, attr(e, "version")?)))
        .collect();
    let ciphers = elements("cipher")
        .into_iter()
        .filter_map(|e| Some((attr(e, "sslversion")?.into(), attr(e, "cipher")?.into())))
        .collect();
    Scan { protocols, ciphers }
}

/// AEAD suites: AES-GCM, ChaCha20-Poly1305 (AES-CCM too, which rustls does
/// not offer).
fn is_aead(suite: &str) -> bool {
    ["GCM", "CHACHA20-POLY1305", "CHACHA20_POLY1305", "CCM"]
        .iter()
        .any(|a| suite.contains(a))
}

/// What is wrong with a scan, given the protocol versions allowed.
fn scan_problems(scan: &Scan, allowed: &[&str]) -> Vec<String> {
    let mut problems = Vec::new();
    for p in &scan.protocols {
        if !allowed.contains(&p.as_str()) {
            problems.push(format!("protocol {p} enabled"));
        }
    }
    for want in allowed {
        if !scan.protocols.iter().any(|p| p == want) {
            problems.push(format!("protocol {want} not offered"));
        }
    }
    if scan.ciphers.is_empty() {
        problems.push("no cipher suite accepted".into());
    }
    for (version, suite) in &scan.ciphers {
        if !is_aead(suite) {
            problems.push(format!("{version} suite {suite} is not AEAD"));
        }
    }
    problems
}

/// sslscan on `addr`, its XML report parsed.
fn sslscan(addr: SocketAddr) -> Scan {
    require_tool("sslscan");
    let dir = tempfile::tempdir().expect("tempdir");
    let xml = dir.path().join("scan.xml");
    let out = Command::new("sslscan")
        .args([
            "--no-colour",
            &format!("--xml={}", xml.display()),
            &addr.to_string(),
        ])
        .stdin(Stdio::null())
        .output()
        .expect("run sslscan");
    let report = std::fs::read_to_string(&xml).unwrap_or_default();
    assert!(
        out.status.success() && report.contains("<ssltest"),
        "sslscan {addr} failed ({}):\n{}",
        out.status,
        output_text(&out)
    );
    parse_sslscan_xml(&report)
}

/// A self-signed certificate for localhost and 127.0.0.1, written as
/// cert.pem and key.pem into `dir`.
fn write_cert(dir: &std::path::Path) {
    let key = rcgen::KeyPair::generate().expect("key");
    let params = rcgen::CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()])
        .expect("params");
    let cert = params.self_signed(&key).expect("self-signed");
    std::fs::write(dir.join("cert.pem"), cert.pem()).expect("write");
    std::fs::write(dir.join("key.pem"), key.serialize_pem()).expect("write");
}

fn tls_exporter(sc: &Scenario, extra_tls: &str) -> Exporter {
    write_cert(sc.dir.path());
    let web = sc.file(
        "web.yml",
        format!("tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n{extra_tls}")
            .as_bytes(),
    );
    let ex = Exporter::start(sc, &["--web.config.file", web.to_str().unwrap()]);
    // Listening is logged after the TLS config loaded: the port answers.
    wait_for(Duration::from_secs(5), "the TLS port", || {
        TcpStream::connect(ex.addr).ok()
    });
    ex
}

/// The default TLS settings: TLS 1.2 and 1.3, AEAD suites only.
#[test]
fn sslscan_finds_only_tls12_tls13_and_aead_suites() {
    let sc = Scenario::new(SCENARIO);
    let ex = tls_exporter(&sc, "");
    let scan = sslscan(ex.addr);
    eprintln!(
        "sslscan default TLS: protocols {:?}, suites {:?}",
        scan.protocols, scan.ciphers
    );
    let problems = scan_problems(&scan, &["tls1.2", "tls1.3"]);
    assert!(problems.is_empty(), "{problems:#?}");
    // Both versions have suites of their own.
    for v in ["TLSv1.2", "TLSv1.3"] {
        assert!(scan.ciphers.iter().any(|(sv, _)| sv == v), "no {v} suite");
    }
}

/// `min_version: TLS13`: TLS 1.2 is no longer offered.
#[test]
fn sslscan_with_min_version_tls13_finds_only_tls13() {
    let sc = Scenario::new(SCENARIO);
    let ex = tls_exporter(&sc, "  min_version: TLS13\n");
    let scan = sslscan(ex.addr);
    eprintln!(
        "sslscan min_version TLS13: protocols {:?}, suites {:?}",
        scan.protocols, scan.ciphers
    );
    let problems = scan_problems(&scan, &["tls1.3"]);
    assert!(problems.is_empty(), "{problems:#?}");
    assert!(scan.ciphers.iter().all(|(v, _)| v == "TLSv1.3"));
}

/// The check can fail: on a server that offers TLS 1.0 with CBC suites
/// (`openssl s_server -tls1`), the same check finds it.
#[test]
fn sslscan_check_fails_on_a_server_offering_tls10() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_cert(dir.path());
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let mut server = Command::new(require_on_path("openssl"))
        .args([
            "s_server",
            "-quiet",
            "-www",
            "-tls1",
            "-cipher",
            "ALL:@SECLEVEL=0",
            "-accept",
            &format!("127.0.0.1:{port}"),
        ])
        .arg("-cert")
        .arg(dir.path().join("cert.pem"))
        .arg("-key")
        .arg(dir.path().join("key.pem"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("openssl s_server (apt-get install -y openssl)");
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    wait_for(Duration::from_secs(5), "openssl s_server", || {
        TcpStream::connect(addr).ok()
    });
    let scan = sslscan(addr);
    let _ = server.kill();
    let _ = server.wait();
    let problems = scan_problems(&scan, &["tls1.2", "tls1.3"]);
    eprintln!("sslscan on a TLS 1.0 server: {problems:?}");
    assert!(
        problems.iter().any(|p| p == "protocol tls1.0 enabled"),
        "{problems:?}"
    );
    assert!(
        problems.iter().any(|p| p.contains("is not AEAD")),
        "{problems:?}"
    );
}

/// A web config asking for TLS 1.0 or 1.1 never serves: exit 2 at start,
/// one line naming the key.
#[test]
fn tls10_and_tls11_are_refused_at_start() {
    let sc = Scenario::new(SCENARIO);
    write_cert(sc.dir.path());
    for (key, version) in [
        ("min_version", "TLS10"),
        ("min_version", "TLS11"),
        ("max_version", "TLS11"),
    ] {
        let web = sc.file(
            "old.yml",
            format!(
                "tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n  {key}: {version}\n"
            )
            .as_bytes(),
        );
        assert_file_refused(
            "--web.config.file",
            &web,
            &["--web.listen-address", "127.0.0.1:0"],
            &format!("line 4: key tls_server_config.{key}: {version} is not supported"),
        );
    }
}
