//! End-to-end: the HTTP server under idle, slowloris and over-the-cap
//! connections; methods and header limits; `--web.config.file` (TLS, mTLS,
//! basic auth, SIGHUP reload, bad files). Certificates are made here.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use gpumem_exporter::testing::http::web_config::{ClientAuth, Limits, WebConfig};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::harness::*;

const SCENARIO: &str = r#"devices:
  - uuid: GPU-dddddddd-0000-0000-0000-000000000000
    memory: {total: 150754820096, reserved: 644939776, used: 1048576}
    processes: []
"#;

/// Let this test open a few thousand sockets (the exporter it starts
/// inherits the limit, and raises its own to the hard limit anyway).
fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain libc calls on a struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max.min(1 << 16);
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
    }
    assert!(
        lim.rlim_cur >= 2500,
        "open-file limit {} too low for this test (ulimit -n 4096)",
        lim.rlim_cur
    );
}

/// Send `request` as is and read the answer until the server closes.
fn raw(addr: SocketAddr, request: &[u8]) -> Response {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).ok();
    s.write_all(request).expect("send");
    parse_response(&read_all(&mut s))
}

/// Read until EOF or an error (a TLS peer may close without close_notify).
fn read_all(s: &mut impl Read) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
}

fn basic(user: &str, password: &str) -> String {
    let creds = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    format!("Basic {creds}")
}

fn get_with(addr: SocketAddr, path: &str, auth: Option<&str>) -> Response {
    match auth {
        Some(a) => http_get(addr, path, &[("Authorization", a)]),
        None => http_get(addr, path, &[]),
    }
}

/// `send` again after the `Retry-After` of a 429 (an address that failed a
/// password check waits until that check's CPU is paid off), at most 3
/// times: the answer once the budget allows a check.
fn after_retry(mut send: impl FnMut() -> Response) -> Response {
    for _ in 0..3 {
        let r = send();
        if r.status != 429 {
            return r;
        }
        assert!(!r.body.contains("gpu_memory"), "{}", r.body);
        let wait: u64 = r
            .header("retry-after")
            .and_then(|s| s.parse().ok())
            .expect("429 with Retry-After");
        std::thread::sleep(Duration::from_secs(wait));
    }
    send()
}

/// A cheap bcrypt hash (cost 4) so debug builds verify it quickly.
fn bcrypt_hash(password: &str) -> String {
    bcrypt::hash_with_salt(password, 4, [42; 16])
        .expect("bcrypt")
        .to_string()
}

fn scrape_counter(
    addr: SocketAddr,
    auth: Option<&str>,
    name: &str,
    labels: &[(&str, &str)],
) -> f64 {
    let r = get_with(addr, "/metrics", auth);
    assert_eq!(r.status, 200, "{}", r.body);
    Metrics::parse(&r.body).get(name, labels).unwrap_or(-1.0)
}

/// The exporter on SCENARIO, a sample every 100 ms, with `web_yml` as its
/// web config (`web.yml` beside the scenario, where a test may rewrite it;
/// relative paths in it are relative to that folder).
fn start_with_web_config(sc: &Scenario, web_yml: &str) -> Exporter {
    let web = sc.file("web.yml", web_yml.as_bytes());
    Exporter::start(
        sc,
        &[
            "--sample-interval",
            "100ms",
            "--web.config.file",
            web.to_str().unwrap(),
        ],
    )
}

/// Wait until a plain-HTTP /metrics answers 200.
fn first_sample(ex: &Exporter) {
    wait_for(Duration::from_secs(5), "first sample", || {
        (ex.get("/metrics").status == 200).then_some(())
    });
}

// ------------------------------------------------------------ limits

#[test]
fn only_get_and_head_and_bounded_headers() {
    let sc = Scenario::new(SCENARIO);
    let ex = Exporter::start(&sc, &["--sample-interval", "100ms"]);
    first_sample(&ex);
    let host = ex.addr.to_string();

    for (method, path) in [
        ("POST", "/metrics"),
        ("PUT", "/metrics"),
        ("DELETE", "/"),
        ("PATCH", "/healthz"),
        ("OPTIONS", "/readyz"),
    ] {
        let r = raw(
            ex.addr,
            format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        );
        assert_eq!(r.status, 405, "{method} {path}");
        let allow = r.header("allow").unwrap_or_default().replace(' ', "");
        assert_eq!(allow, "GET,HEAD", "{method} {path}");
    }

    let head = raw(
        ex.addr,
        format!("HEAD /metrics HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
    );
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty(), "HEAD has no body: {:?}", head.body);

    // 64 headers pass, 65 do not.
    let many = |n: usize| {
        let mut req = format!("GET /healthz HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
        for i in 0..n - 2 {
            req.push_str(&format!("X-H{i}: v\r\n"));
        }
        req.push_str("\r\n");
        raw(ex.addr, req.as_bytes()).status
    };
    assert_eq!(many(64), 200);
    assert_eq!(many(65), 431);
    // 16 KiB of headers in all.
    let big = |len: usize| {
        let req = format!(
            "GET /healthz HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nX-Big: {}\r\n\r\n",
            "a".repeat(len)
        );
        raw(ex.addr, req.as_bytes()).status
    };
    assert_eq!(big(8 * 1024), 200);
    assert_eq!(big(20 * 1024), 431);
}

/// 1,000 idle connections and a slowloris client are held while a scraper
/// keeps getting /metrics; the header deadline then closes them all.
#[test]
fn idle_and_slowloris_connections_do_not_starve_the_scraper() {
    raise_fd_limit();
    let sc = Scenario::new(SCENARIO);
    // The per-address cap out of the way: all 1,001 come from 127.0.0.1.
    let ex = start_with_web_config(
        &sc,
        "http_server_config:\n  header_read_timeout: 4s\n  max_connections_per_ip: 2048\n",
    );
    first_sample(&ex);

    let opened = Instant::now();
    let idle: Vec<TcpStream> = (0..1000)
        .map(|i| {
            TcpStream::connect_timeout(&ex.addr, Duration::from_secs(5))
                .unwrap_or_else(|e| panic!("idle connection {i}: {e}"))
        })
        .collect();
    let open_took = opened.elapsed();

    // Slowloris: a request whose headers never end, one byte per 100 ms.
    let addr = ex.addr;
    let slowloris = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_millis(100))).ok();
        let start = Instant::now();
        let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ");
        let mut sent = 0;
        let mut buf = [0u8; 256];
        while start.elapsed() < Duration::from_secs(15) {
            if s.write_all(b"a").is_err() {
                break;
            }
            sent += 1;
            match s.read(&mut buf) {
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                _ => break, // closed (or answered) by the server
            }
        }
        (start.elapsed(), sent)
    });

    // The server holds all of them...
    let open_now = || {
        let r = ex.get("/metrics");
        assert_eq!(r.status, 200, "scrape under load");
        Metrics::parse(&r.body)
            .get("gpumem_exporter_http_connections", &[])
            .unwrap_or(0.0)
    };
    let held = wait_for(Duration::from_secs(2), "1001 connections held", || {
        let n = open_now();
        (n >= 1001.0).then_some(n)
    });
    // ...while the scraper keeps getting /metrics.
    let mut latencies = Vec::new();
    let scraping = Instant::now();
    while scraping.elapsed() < Duration::from_secs(1) {
        let t = Instant::now();
        let r = ex.get("/metrics");
        latencies.push(t.elapsed());
        assert_eq!(r.status, 200, "scrape under load");
        std::thread::sleep(Duration::from_millis(20));
    }
    latencies.sort();
    let p50 = latencies[latencies.len() / 2];
    let max = latencies[latencies.len() - 1];
    eprintln!(
        "1000 idle connections opened in {open_took:?}, server held {held}; {} scrapes under load: p50 {p50:?}, max {max:?}",
        latencies.len()
    );
    assert!(
        max < Duration::from_secs(2),
        "scrape latency under load {max:?}"
    );

    // The header deadline (4 s) closes every idle connection...
    for (i, mut s) in idle.into_iter().enumerate() {
        let left = Duration::from_secs(9).saturating_sub(opened.elapsed());
        s.set_read_timeout(Some(left.max(Duration::from_millis(10))))
            .ok();
        let mut b = [0u8; 16];
        // Seen once: the read interrupted (EINTR, cause not found); a
        // retry is the same check.
        let read = loop {
            match s.read(&mut b) {
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                other => break other,
            }
        };
        match read {
            Ok(0) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
            other => panic!("idle connection {i} still open after 9 s: {other:?}"),
        }
    }
    let closed_after = opened.elapsed();
    assert!(
        closed_after >= Duration::from_millis(3500),
        "closed too early: {closed_after:?}"
    );
    // ...and the slowloris one, however busy it keeps the socket.
    let (lasted, sent) = slowloris.join().expect("slowloris thread");
    eprintln!(
        "idle connections closed after {closed_after:?}; slowloris closed after {lasted:?} ({sent} bytes)"
    );
    assert!(
        lasted >= Duration::from_millis(3500) && lasted < Duration::from_secs(7),
        "slowloris lasted {lasted:?}"
    );
    assert_eq!(ex.get("/metrics").status, 200);
}

/// At the cap, the connection that has waited longest for a request is
/// closed to make room: the scraper still gets in.
#[test]
fn at_the_cap_the_oldest_idle_connection_makes_room() {
    let sc = Scenario::new(SCENARIO);
    let ex = start_with_web_config(
        &sc,
        "http_server_config:\n  max_connections: 20\n  header_read_timeout: 30s\n",
    );
    first_sample(&ex);
    let mut idle: Vec<TcpStream> = Vec::new();
    for _ in 0..20 {
        idle.push(TcpStream::connect(ex.addr).expect("connect"));
        // Accepted in this order, so the first is the oldest.
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(100));
    for round in 0..3 {
        let t = Instant::now();
        let r = ex.get("/metrics");
        assert_eq!(r.status, 200, "scrape {round} at the cap");
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    }
    // Each scrape that found no free slot evicted the oldest idle
    // connection (a scrape may also find the slot the previous one freed).
    let closed = |s: &mut TcpStream| {
        s.set_read_timeout(Some(Duration::from_millis(100))).ok();
        let mut b = [0u8; 16];
        match s.read(&mut b) {
            Ok(0) => true,
            Err(e) => e.kind() == ErrorKind::ConnectionReset,
            Ok(_) => false,
        }
    };
    let gone: Vec<bool> = idle.iter_mut().map(closed).collect();
    let evicted = gone.iter().take_while(|g| **g).count();
    assert!((1..=3).contains(&evicted), "oldest first: {gone:?}");
    assert!(gone[evicted..].iter().all(|g| !g), "oldest first: {gone:?}");
    let counted = wait_for(Duration::from_secs(3), "evicted counter", || {
        let v = scrape_counter(
            ex.addr,
            None,
            "gpumem_exporter_http_connections_evicted_total",
            &[],
        );
        (v >= evicted as f64).then_some(v)
    });
    // This scrape may have evicted one more.
    assert!(counted <= evicted as f64 + 1.0, "{counted} vs {evicted}");
}

/// A connection to `addr` from the loopback address `from` (any of
/// 127.0.0.0/8 is this machine), as a plain std stream.
fn connect_from(from: &str, addr: SocketAddr) -> TcpStream {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let s = tokio::net::TcpSocket::new_v4().expect("socket");
        s.bind(format!("{from}:0").parse().expect("addr"))
            .expect("bind");
        let stream = s.connect(addr).await.expect("connect");
        let stream = stream.into_std().expect("into std");
        // tokio hands the socket over non-blocking; the tests read blocking.
        stream.set_nonblocking(false).expect("blocking");
        stream
    })
}

/// GET /metrics from the loopback address `from`.
fn get_from(from: &str, addr: SocketAddr) -> Response {
    let mut s = connect_from(from, addr);
    s.set_read_timeout(Some(Duration::from_secs(5))).ok();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("send");
    parse_response(&read_all(&mut s))
}

fn is_closed(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_millis(100))).ok();
    let mut b = [0u8; 16];
    match s.read(&mut b) {
        Ok(0) => true,
        Err(e) => e.kind() == ErrorKind::ConnectionReset,
        Ok(_) => false,
    }
}

/// At `max_connections_per_ip`, a new connection from that address closes
/// that address's oldest idle one: the flood churns only itself, and other
/// clients keep theirs.
#[test]
fn the_per_address_cap_churns_only_that_address() {
    let sc = Scenario::new(SCENARIO);
    let ex = start_with_web_config(
        &sc,
        "http_server_config:\n  max_connections_per_ip: 10\n  header_read_timeout: 30s\n",
    );
    first_sample(&ex);
    let mut other: Vec<TcpStream> = (0..5).map(|_| connect_from("127.0.0.2", ex.addr)).collect();
    let mut flood: Vec<TcpStream> = Vec::new();
    for _ in 0..10 {
        flood.push(connect_from("127.0.0.1", ex.addr));
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(100));
    for round in 0..3 {
        let r = get_from("127.0.0.1", ex.addr);
        assert_eq!(r.status, 200, "scrape {round} from the flooding address");
    }
    let gone: Vec<bool> = flood.iter_mut().map(is_closed).collect();
    let evicted = gone.iter().take_while(|g| **g).count();
    assert!((1..=3).contains(&evicted), "oldest first: {gone:?}");
    assert!(gone[evicted..].iter().all(|g| !g), "oldest first: {gone:?}");
    // The other address lost nothing, and gets in without evicting.
    assert!(
        other.iter_mut().all(|s| !is_closed(s)),
        "127.0.0.2 kept its connections"
    );
    let before = scrape_counter(
        ex.addr,
        None,
        "gpumem_exporter_http_connections_evicted_total",
        &[],
    );
    assert_eq!(get_from("127.0.0.2", ex.addr).status, 200);
    assert!(other.iter_mut().all(|s| !is_closed(s)));
    let after = scrape_counter(
        ex.addr,
        None,
        "gpumem_exporter_http_connections_evicted_total",
        &[],
    );
    // Only the plain scrapes (from 127.0.0.1) may have evicted meanwhile.
    assert!(after - before <= 2.0, "{before} -> {after}");
}

// ------------------------------------------------------------ TLS

struct Pki {
    ca_pem: String,
    server_cert: String,
    server_key: String,
    client: (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>),
    stranger: (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>),
    stranger_key: String,
    ca_der: CertificateDer<'static>,
}

fn ca(name: &str) -> (String, CertificateDer<'static>, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::new(Vec::new()).expect("params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().expect("key");
    let cert = params.self_signed(&key).expect("self-signed");
    (cert.pem(), cert.der().clone(), Issuer::new(params, key))
}

fn leaf(
    issuer: &Issuer<'static, KeyPair>,
    names: &[&str],
    usage: ExtendedKeyUsagePurpose,
) -> (String, String) {
    let mut params =
        CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .expect("params");
    params.distinguished_name.push(DnType::CommonName, names[0]);
    params.extended_key_usages = vec![usage];
    let key = KeyPair::generate().expect("key");
    let cert = params.signed_by(&key, issuer).expect("sign");
    (cert.pem(), key.serialize_pem())
}

fn der_pair(
    cert_pem: &str,
    key_pem: &str,
) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
    use rustls::pki_types::pem::PemObject;
    let certs = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .expect("cert pem");
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).expect("key pem");
    (certs, key)
}

fn pki() -> Pki {
    let (ca_pem, ca_der, issuer) = ca("gpumem test CA");
    let (server_cert, server_key) = leaf(
        &issuer,
        &["localhost", "127.0.0.1"],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (c, k) = leaf(&issuer, &["scraper"], ExtendedKeyUsagePurpose::ClientAuth);
    let (_, _, other) = ca("some other CA");
    let (sc, sk) = leaf(&other, &["stranger"], ExtendedKeyUsagePurpose::ClientAuth);
    Pki {
        ca_pem,
        server_cert,
        server_key,
        client: der_pair(&c, &k),
        stranger: der_pair(&sc, &sk),
        stranger_key: sk,
        ca_der,
    }
}

impl Pki {
    /// Write cert.pem, key.pem, ca.pem into `dir`.
    fn write(&self, dir: &Path) {
        std::fs::write(dir.join("cert.pem"), &self.server_cert).expect("write");
        std::fs::write(dir.join("key.pem"), &self.server_key).expect("write");
        std::fs::write(dir.join("ca.pem"), &self.ca_pem).expect("write");
        std::fs::write(dir.join("other-key.pem"), &self.stranger_key).expect("write");
    }

    fn client_config(
        &self,
        cert: Option<&(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
        versions: &[&'static rustls::SupportedProtocolVersion],
    ) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca_der.clone()).expect("root");
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(versions)
        .expect("versions")
        .with_root_certificates(roots);
        Arc::new(match cert {
            Some((c, k)) => builder
                .with_client_auth_cert(c.clone(), k.clone_key())
                .expect("client cert"),
            None => builder.with_no_client_auth(),
        })
    }
}

const BOTH: &[&rustls::SupportedProtocolVersion] =
    &[&rustls::version::TLS13, &rustls::version::TLS12];

/// GET over TLS; `Err` when the handshake or the exchange fails.
fn tls_get(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    path: &str,
    auth: Option<&str>,
) -> Result<Response, String> {
    let tcp =
        TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    tcp.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let name = ServerName::try_from("localhost").map_err(|e| e.to_string())?;
    let conn = rustls::ClientConnection::new(config, name).map_err(|e| e.to_string())?;
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if let Some(a) = auth {
        req.push_str(&format!("Authorization: {a}\r\n"));
    }
    req.push_str("\r\n");
    tls.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match tls.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if out.is_empty() => return Err(e.to_string()),
            Err(_) => break,
        }
    }
    if out.is_empty() {
        return Err("no answer".to_string());
    }
    Ok(parse_response(&out))
}

#[test]
fn tls_with_basic_auth() {
    let sc = Scenario::new(SCENARIO);
    let pki = pki();
    pki.write(sc.dir.path());
    // Relative paths are relative to the web config file.
    let ex = start_with_web_config(
        &sc,
        &format!(
            "tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\nbasic_auth_users:\n  alice: {}\n",
            bcrypt_hash("s3cret")
        ),
    );
    let client = pki.client_config(None, BOTH);
    let alice = basic("alice", "s3cret");
    let ok = wait_for(Duration::from_secs(5), "a TLS scrape", || {
        tls_get(ex.addr, Arc::clone(&client), "/metrics", Some(&alice))
            .ok()
            .filter(|r| r.status == 200)
    });
    assert!(ok.body.contains("gpu_memory_used_bytes{"), "{}", ok.body);

    // Plain HTTP on the TLS port: refused, no metrics.
    let plain = http_get(ex.addr, "/metrics", &[("Authorization", &alice)]);
    assert_eq!(plain.status, 400, "{}", plain.body);
    assert!(
        plain.body.contains("HTTP request to an HTTPS server"),
        "{}",
        plain.body
    );
    assert!(!plain.body.contains("gpu_memory"));

    for auth in [
        None,
        Some(basic("alice", "wrong")),
        Some(basic("mallory", "s3cret")),
        Some("Bearer abc".to_string()),
    ] {
        let r = after_retry(|| {
            tls_get(ex.addr, Arc::clone(&client), "/metrics", auth.as_deref()).expect("TLS")
        });
        assert_eq!(r.status, 401, "{auth:?}");
        assert_eq!(
            r.header("www-authenticate"),
            Some("Basic realm=\"gpumem-exporter\", charset=\"UTF-8\""),
            "{auth:?}"
        );
        assert!(!r.body.contains("gpu_memory"));
    }
    // Every path is behind the password, unknown ones included.
    for path in ["/", "/healthz", "/nope"] {
        let r = tls_get(ex.addr, Arc::clone(&client), path, None).expect("TLS");
        assert_eq!(r.status, 401, "{path}");
    }
    // The right password again (now from the cache), and TLS 1.2 works too.
    let tls12 = pki.client_config(None, &[&rustls::version::TLS12]);
    let r = tls_get(ex.addr, tls12, "/healthz", Some(&alice)).expect("TLS 1.2");
    assert_eq!(r.status, 200);
}

#[test]
fn mtls_require_and_verify_client_cert() {
    let sc = Scenario::new(SCENARIO);
    let pki = pki();
    pki.write(sc.dir.path());
    let dir = sc.dir.path().display();
    let ex = start_with_web_config(
        &sc,
        &format!(
            "tls_server_config:\n  cert_file: {dir}/cert.pem\n  key_file: {dir}/key.pem\n  client_ca_file: {dir}/ca.pem\n  client_auth_type: RequireAndVerifyClientCert\n  min_version: TLS13\n"
        ),
    );
    let with_cert = pki.client_config(Some(&pki.client), BOTH);
    let r = wait_for(Duration::from_secs(5), "an mTLS scrape", || {
        tls_get(ex.addr, Arc::clone(&with_cert), "/metrics", None)
            .ok()
            .filter(|r| r.status == 200)
    });
    assert!(r.body.contains("gpu_memory_used_bytes{"));

    let no_cert = tls_get(ex.addr, pki.client_config(None, BOTH), "/metrics", None);
    assert!(
        no_cert.is_err(),
        "no client cert: {:?}",
        no_cert.map(|r| r.status)
    );
    let stranger = tls_get(
        ex.addr,
        pki.client_config(Some(&pki.stranger), BOTH),
        "/metrics",
        None,
    );
    assert!(
        stranger.is_err(),
        "cert from another CA: {:?}",
        stranger.map(|r| r.status)
    );
    let old = tls_get(
        ex.addr,
        pki.client_config(Some(&pki.client), &[&rustls::version::TLS12]),
        "/metrics",
        None,
    );
    assert!(
        old.is_err(),
        "TLS 1.2 below min_version: {:?}",
        old.map(|r| r.status)
    );
    // The server is fine after all those failures.
    let r = tls_get(ex.addr, with_cert, "/healthz", None).expect("mTLS");
    assert_eq!(r.status, 200);
}

// ------------------------------------------------------------ reload

#[test]
fn sighup_reloads_users_and_a_bad_file_keeps_the_old_one() {
    let sc = Scenario::new(SCENARIO);
    let web_text =
        |user: &str, pw: &str| format!("basic_auth_users:\n  {user}: {}\n", bcrypt_hash(pw));
    let ex = start_with_web_config(&sc, &web_text("alice", "a-pass"));
    let alice = basic("alice", "a-pass");
    let bob = basic("bob", "b-pass");
    wait_for(Duration::from_secs(5), "alice's scrape", || {
        (get_with(ex.addr, "/metrics", Some(&alice)).status == 200).then_some(())
    });
    assert_eq!(get_with(ex.addr, "/metrics", Some(&bob)).status, 401);

    sc.file("web.yml", web_text("bob", "b-pass").as_bytes());
    ex.signal_only("HUP");
    wait_for(Duration::from_secs(5), "bob to get in", || {
        (get_with(ex.addr, "/metrics", Some(&bob)).status == 200).then_some(())
    });
    let r = get_with(ex.addr, "/metrics", Some(&alice));
    assert_eq!(r.status, 401);
    assert!(r.header("www-authenticate").is_some());

    sc.file("web.yml", b"basic_auth_users:\n  bob: [not, a, hash\n");
    ex.signal_only("HUP");
    let failures = |v: &str| {
        scrape_counter(
            ex.addr,
            Some(&bob),
            "gpumem_exporter_web_config_reloads_total",
            &[("result", v)],
        )
    };
    wait_for(Duration::from_secs(5), "the failure counter", || {
        (failures("failure") == 1.0).then_some(())
    });
    assert_eq!(failures("success"), 1.0);
    assert_eq!(get_with(ex.addr, "/metrics", Some(&bob)).status, 200);
    assert_eq!(
        after_retry(|| get_with(ex.addr, "/metrics", Some(&alice))).status,
        401
    );
    let log = ex.stderr();
    let line = log
        .lines()
        .find(|l| l.contains("web config reload failed"))
        .unwrap_or_else(|| panic!("no failure logged:\n{log}"));
    assert!(
        line.contains("level=error") && line.contains("web.yml"),
        "{line}"
    );
}

/// A typo, then the right password, from the same address (bcrypt cost 8
/// in this debug build, as dear as web-config.example.yml's 10 in a
/// release one): the right one answers 200 at once (it
/// answered 429 with `Retry-After: 13` when one failed check spent the
/// address's whole budget). Twice, 3 s apart, with two users, so a second
/// typo a little later is a token too.
#[test]
fn a_wrong_password_then_the_right_one_answers_200() {
    let sc = Scenario::new(SCENARIO);
    // Cost 8 in this debug build costs about what cost 10 does in a
    // release one (0.1-0.2 s a check): two typos fit the burst there as
    // they do in the shipped binary, whatever the machine's load.
    let hash = bcrypt::hash_with_salt("s3cret", 8, [42; 16])
        .expect("bcrypt")
        .to_string();
    let bob = bcrypt::hash_with_salt("b0bpw", 8, [43; 16])
        .expect("bcrypt")
        .to_string();
    let ex = start_with_web_config(
        &sc,
        &format!("basic_auth_users:\n  alice: {hash}\n  bob: {bob}\n"),
    );
    wait_for(Duration::from_secs(5), "the listener", || {
        (get_with(ex.addr, "/healthz", None).status == 401).then_some(())
    });
    for (round, (user, password, typo)) in
        [("alice", "s3cret", "s3cert"), ("bob", "b0bpw", "bobpw")]
            .into_iter()
            .enumerate()
    {
        let t = std::time::Instant::now();
        let typo = get_with(ex.addr, "/metrics", Some(&basic(user, typo)));
        let typo_took = t.elapsed();
        assert_eq!(typo.status, 401, "round {round}: {}", typo.body);
        // A fresh connection each time (http_get), as a scraper retries.
        let right = get_with(ex.addr, "/metrics", Some(&basic(user, password)));
        assert_eq!(
            (right.status, right.header("retry-after")),
            (200, None),
            "round {round}: {}",
            right.body
        );
        assert!(right.body.contains("gpu_memory_used_bytes{"));
        eprintln!(
            "round {round}: typo 401 in {typo_took:?}, right password 200 after {:?}",
            t.elapsed()
        );
        // Three seconds later (when the old code still said 429), another
        // user's typo and right password: both checked.
        std::thread::sleep(Duration::from_secs(3));
    }
}

// ------------------------------------------------------------ bad files

#[test]
fn bad_web_config_files_exit_2_with_one_line_naming_the_key() {
    let sc = Scenario::new(SCENARIO);
    let pki = pki();
    pki.write(sc.dir.path());
    let cases: [(&str, String, &str); 8] = [
        (
            "typo.yml",
            "tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n  client_auth: RequireAnyClientCert\n".into(),
            "line 4 column 3: key tls_server_config.client_auth: unknown field `client_auth`",
        ),
        (
            "auth-type.yml",
            "tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n  client_auth_type: Always\n".into(),
            "line 4 column 21: key tls_server_config.client_auth_type: unknown variant `Always`",
        ),
        (
            "missing-cert.yml",
            "tls_server_config:\n  cert_file: nope.pem\n  key_file: key.pem\n".into(),
            "line 2: key tls_server_config.cert_file: cannot read",
        ),
        (
            "key-is-cert.yml",
            "tls_server_config:\n  cert_file: cert.pem\n  key_file: cert.pem\n".into(),
            "line 3: key tls_server_config.key_file: no private key found in",
        ),
        (
            "mismatch.yml",
            "tls_server_config:\n  cert_file: cert.pem\n  key_file: other-key.pem\n".into(),
            "line 3: key tls_server_config.key_file: the private key in",
        ),
        (
            "ca-needs-auth.yml",
            "tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n  client_ca_file: ca.pem\n".into(),
            "line 4: key tls_server_config.client_ca_file: client_ca_file is set but client_auth_type is NoClientCert",
        ),
        (
            "tls10.yml",
            "tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n  min_version: TLS10\n".into(),
            "line 4: key tls_server_config.min_version: TLS10 is not supported",
        ),
        (
            "hash.yml",
            "basic_auth_users:\n  alice: plaintext\n".into(),
            "line 2 column 10: key basic_auth_users.alice: not a bcrypt hash",
        ),
    ];
    for (name, text, want) in cases {
        assert_file_refused(
            "--web.config.file",
            &sc.file(name, text.as_bytes()),
            &["--web.listen-address", "127.0.0.1:0"],
            want,
        );
    }
    assert_file_refused(
        "--web.config.file",
        Path::new("/nonexistent/web.yml"),
        &[],
        "cannot read",
    );
}

/// `web-config.example.yml` is valid as shipped (given its certificate
/// files), and its example password is the one it names.
#[test]
fn the_example_web_config_loads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = pki();
    std::fs::write(dir.path().join("server.crt"), &pki.server_cert).expect("write");
    std::fs::write(dir.path().join("server.key"), &pki.server_key).expect("write");
    std::fs::write(dir.path().join("client-ca.crt"), &pki.ca_pem).expect("write");
    let example = repo_file("web-config.example.yml");
    let path = dir.path().join("web-config.yml");
    std::fs::copy(&example, &path).expect("copy example");
    let cfg = WebConfig::load(&path).expect("example loads");
    assert!(cfg.tls.is_some());
    assert_eq!(
        cfg.client_auth,
        Some(ClientAuth::RequireAndVerifyClientCert)
    );
    assert_eq!(cfg.limits, Limits::default());
    let users = cfg.users.expect("users");
    let t = Instant::now();
    let header = basic("prometheus", "example-password");
    assert!(users.check_header(header.as_bytes()));
    eprintln!("bcrypt cost 10 check (debug build): {:?}", t.elapsed());
    assert!(!users.check_header(basic("prometheus", "nope").as_bytes()));
}

// ------------------------------------------------------------ Host check

/// GET `path` with `host` as the Host header (or none).
fn get_with_host(addr: SocketAddr, path: &str, host: Option<&str>) -> Response {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).ok();
    let host = host.map(|h| format!("Host: {h}\r\n")).unwrap_or_default();
    s.write_all(format!("GET {path} HTTP/1.1\r\n{host}Connection: close\r\n\r\n").as_bytes())
        .expect("send");
    parse_response(&read_all(&mut s))
}

/// `web.allowed_hosts`: the page and API answer only to the listed names
/// (421 otherwise, or without Host); /metrics, /healthz and /readyz to any.
/// Without the key, any Host is answered.
#[test]
fn allowed_hosts_guard_the_page_and_api_but_not_metrics() {
    let sc = Scenario::new(SCENARIO);
    let ex = Exporter::with_config(
        &sc,
        "web:\n  allowed_hosts: [gpu-node-1.example.org, \"::1\", 127.0.0.1]\n",
        &["--sample-interval", "100ms"],
    );
    wait_for(Duration::from_secs(5), "a sample", || {
        (ex.get("/metrics").status == 200).then_some(())
    });
    for host in [
        "gpu-node-1.example.org:9877",
        "GPU-NODE-1.example.org",
        "[::1]:9877",
        "127.0.0.1",
    ] {
        for path in ["/", "/api/v1/snapshot", "/api/v1/history"] {
            let r = get_with_host(ex.addr, path, Some(host));
            assert_eq!(r.status, 200, "{host} {path}: {}", r.body);
        }
    }
    for host in [
        Some("evil.example"),
        Some("evil.example:9877"),
        Some("127.0.0.2"),
        None,
    ] {
        for path in ["/", "/api/v1/snapshot", "/api/v1/history", "/nope"] {
            let r = get_with_host(ex.addr, path, host);
            assert_eq!(r.status, 421, "{host:?} {path}: {}", r.body);
            assert!(
                !r.body.contains("gpu_memory") && !r.body.contains("GPU-"),
                "{}",
                r.body
            );
        }
        for path in ["/metrics", "/healthz", "/readyz"] {
            assert_eq!(
                get_with_host(ex.addr, path, host).status,
                200,
                "{host:?} {path}"
            );
        }
    }
    // Off by default: any Host.
    let open = Exporter::start(&sc, &["--sample-interval", "100ms"]);
    wait_for(Duration::from_secs(5), "a sample", || {
        (get_with_host(open.addr, "/api/v1/snapshot", Some("evil.example")).status == 200)
            .then_some(())
    });
    assert_eq!(
        get_with_host(open.addr, "/", Some("evil.example")).status,
        200
    );
}

#[test]
fn a_bad_allowed_host_is_refused_with_its_key() {
    let sc = Scenario::new(SCENARIO);
    assert_file_refused(
        "--config.file",
        &sc.file("bad.yaml", b"web:\n  allowed_hosts: [\"node:9877\"]\n"),
        &[],
        "key web.allowed_hosts",
    );
}
