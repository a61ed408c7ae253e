//! Basic auth under a wrong-password flood, inside the DaemonSet's CPU
//! limit (issue 36, attack 2): the exporter in a cgroup held to 100m
//! (cgroup v1 `cpu.cfs_quota_us` 10000 of `cpu.cfs_period_us` 100000, or
//! v2 `cpu.max`; made by the test, as root), basic auth at bcrypt cost 10
//! (web-config.example.yml's), and 300 keep-alive connections from
//! 127.0.0.2 sending wrong passwords (and unknown user names) as fast as
//! they are answered, reconnecting 20 ms after the server closes one.
//! From 127.0.0.1 meanwhile:
//!
//! - a scraper with cached credentials on one keep-alive connection, every
//!   250 ms: every scrape answered, complete, within 2 s;
//! - after a SIGHUP (the web config re-read, a user added): ten correct
//!   logins, each on a new connection, each answered within 0.5 s;
//! - the added user's first login and, after a second SIGHUP that rotates
//!   that user's hash, its first login again (each one bcrypt check):
//!   within twice the time one check takes alone in the same cgroup, plus
//!   0.5 s;
//! - the flood's failed checks within the per-address budget.
//!
//! Then the same flood with `max_connections: 32`: the keep-alive scraper
//! sees no reset, nor do logins with cached credentials on new connections. The figures are printed (`--nocapture`).
//!
//! The binary is `GPUMEM_IMAGE_BINARY` when set (scripts/ci/test: the
//! release binary the image ships), else the debug build (each check
//! 2.5 times dearer, so a harder test).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use crate::harness::*;

const SCENARIO: &str = r#"devices:
  - uuid: GPU-aaaaaaaa-3636-0000-0000-000000000000
    memory: {total: 150754820096, reserved: 644939776, used: 1048576}
    processes: []
"#;

/// Prometheus' documented cost (web-config.example.yml's).
const COST: u32 = 10;
const FLOOD_CONNECTIONS: usize = 300;
const FLOOD_FROM: &str = "127.0.0.2";
const GOOD_FROM: &str = "127.0.0.1";
const LOGIN_BOUND: Duration = Duration::from_millis(500);
/// A cached scrape's deadline (Prometheus' default timeout is 10 s).
const SCRAPE_DEADLINE: Duration = Duration::from_secs(2);
/// What one address's failed checks may cost per second
/// (src/http/auth/budget.rs, PER_ADDRESS_RATE).
const PER_ADDRESS_RATE: f64 = 0.005;
/// The CPU of failed checks an address may owe and still be checked
/// (src/http/auth/budget.rs, PER_ADDRESS_BURST), in seconds.
const PER_ADDRESS_BURST: f64 = 0.5;

fn basic(user: &str, password: &str) -> String {
    let creds = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    format!("Basic {creds}")
}

fn hash(password: &str, salt: u8) -> String {
    bcrypt::hash_with_salt(password, COST, [salt; 16])
        .expect("bcrypt")
        .to_string()
}

/// A CPU cgroup of its own at 100m, removed on drop.
struct CpuCgroup(PathBuf);

impl CpuCgroup {
    fn new() -> CpuCgroup {
        let name = format!("gpumem-login-flood-{}", std::process::id());
        let v1 = Path::new("/sys/fs/cgroup/cpu");
        let v2 = Path::new("/sys/fs/cgroup");
        let write = |dir: &Path, file: &str, value: &str| {
            std::fs::write(dir.join(file), value)
                .unwrap_or_else(|e| panic!("write {value} to {}/{file}: {e}", dir.display()));
        };
        if v1.join("cpu.cfs_quota_us").exists() {
            let dir = v1.join(name);
            std::fs::create_dir(&dir)
                .unwrap_or_else(|e| panic!("mkdir {}: {e} (root needed)", dir.display()));
            write(&dir, "cpu.cfs_period_us", "100000");
            write(&dir, "cpu.cfs_quota_us", "10000");
            return CpuCgroup(dir);
        }
        let controllers =
            std::fs::read_to_string(v2.join("cgroup.controllers")).unwrap_or_default();
        assert!(
            controllers.split_whitespace().any(|c| c == "cpu"),
            "the login flood needs cgroup v1's cpu controller at {} or v2's at {} (and root)",
            v1.display(),
            v2.display()
        );
        let dir = v2.join(name);
        std::fs::create_dir(&dir)
            .unwrap_or_else(|e| panic!("mkdir {}: {e} (root needed)", dir.display()));
        write(&dir, "cpu.max", "10000 100000");
        CpuCgroup(dir)
    }

    /// Times the cgroup was throttled (v1 `nr_throttled`, v2 the same key).
    fn throttled(&self) -> u64 {
        std::fs::read_to_string(self.0.join("cpu.stat"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("nr_throttled ")?.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for CpuCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn binary() -> PathBuf {
    std::env::var_os("GPUMEM_IMAGE_BINARY")
        .filter(|b| !b.is_empty())
        .map_or_else(|| PathBuf::from(BIN), PathBuf::from)
}

/// The exporter inside `cg`, with `web.yml` as its web config.
fn start_in(cg: &CpuCgroup, sc: &Scenario, web: &Path) -> Exporter {
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        &format!(
            "echo $$ > {}/cgroup.procs && exec \"$0\" \"$@\"",
            cg.0.display()
        ),
    ])
    .arg(binary());
    Exporter::spawn(Exporter::command(
        cmd,
        sc,
        &["--web.config.file", web.to_str().unwrap()],
    ))
}

/// The exporter's CPU time so far (utime + stime of /proc/<pid>/stat).
fn cpu_of(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<u64> = after
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|f| f.parse().ok())
        .collect();
    // SAFETY: sysconf with a valid name.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_millis(fields.iter().sum::<u64>() * 1000 / hz)
}

fn connect_from(from: &str, addr: SocketAddr) -> std::io::Result<TcpStream> {
    let s = socket(from)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let stream = rt.block_on(s.connect(addr))?.into_std()?;
    stream.set_nonblocking(false)?;
    Ok(stream)
}

fn socket(from: &str) -> std::io::Result<tokio::net::TcpSocket> {
    let s = tokio::net::TcpSocket::new_v4()?;
    s.bind(SocketAddr::new(from.parse().expect("address"), 0))?;
    Ok(s)
}

/// Read one response (head and Content-Length body) from `s`: the status.
fn read_response(s: &mut TcpStream) -> Result<(u16, String), String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        if let Some((r, body)) = parse_head(&buf) {
            let want: usize = r
                .header("content-length")
                .and_then(|l| l.parse().ok())
                .ok_or("no content-length")?;
            if body.len() >= want {
                return Ok((
                    r.status,
                    String::from_utf8_lossy(&body[..want]).into_owned(),
                ));
            }
        }
        match s.read(&mut chunk) {
            Ok(0) => return Err(format!("closed after {} bytes", buf.len())),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(e.to_string()),
        }
    }
}

fn request(auth: &str, close: bool) -> String {
    format!(
        "GET /metrics HTTP/1.1\r\nHost: node\r\nAuthorization: {auth}\r\n{}\r\n",
        if close { "Connection: close\r\n" } else { "" }
    )
}

/// One login on a new connection from `from`: status and time to the
/// whole answer.
fn login(addr: SocketAddr, from: &str, auth: &str) -> (u16, Duration) {
    let t = Instant::now();
    let mut s = connect_from(from, addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).ok();
    s.write_all(request(auth, true).as_bytes()).expect("send");
    let (status, _) = read_response(&mut s).unwrap_or_else(|e| panic!("login: {e}"));
    (status, t.elapsed())
}

/// What the flood got back.
#[derive(Default)]
struct FloodCounts {
    by_status: Mutex<std::collections::BTreeMap<u16, u64>>,
    reconnects: AtomicU64,
}

/// 300 keep-alive connections from [`FLOOD_FROM`], wrong passwords and
/// unknown users, until `stop`.
fn flood(
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    counts: Arc<FloodCounts>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let mut tasks = Vec::new();
            for i in 0..FLOOD_CONNECTIONS {
                let (stop, counts) = (Arc::clone(&stop), Arc::clone(&counts));
                let auth = if i % 3 == 0 {
                    basic(&format!("nobody{i}"), "guess")
                } else {
                    basic("alice", &format!("wrong{i}"))
                };
                let req = request(&auth, false);
                tasks.push(tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let Ok(s) = socket(FLOOD_FROM) else { break };
                        if let Ok(stream) = s.connect(addr).await {
                            let (r, mut w) = stream.into_split();
                            let mut r = BufReader::new(r);
                            while !stop.load(Ordering::Relaxed) {
                                if w.write_all(req.as_bytes()).await.is_err() {
                                    break;
                                }
                                let Some(status) = read_async(&mut r).await else {
                                    break;
                                };
                                *counts.by_status.lock().unwrap().entry(status).or_insert(0) += 1;
                            }
                        }
                        counts.reconnects.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }));
            }
            for t in tasks {
                let _ = t.await;
            }
        });
    })
}

/// One response's status, its body skipped; None when the connection ended.
async fn read_async(r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>) -> Option<u16> {
    let mut line = String::new();
    r.read_line(&mut line).await.ok().filter(|n| *n > 0)?;
    let status = line.split_whitespace().nth(1)?.parse().ok()?;
    let mut length = 0usize;
    loop {
        line.clear();
        r.read_line(&mut line).await.ok().filter(|n| *n > 0)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            length = v.trim().parse().ok()?;
        }
    }
    let mut body = vec![0u8; length];
    r.read_exact(&mut body).await.ok()?;
    Some(status)
}

/// What the keep-alive scraper saw.
#[derive(Default)]
struct Scrapes {
    latencies: Vec<Duration>,
    failures: Vec<String>,
}

fn percentile(l: &[Duration], q: f64) -> Duration {
    let mut l = l.to_vec();
    l.sort();
    let i = ((l.len() as f64 * q).ceil() as usize).clamp(1, l.len().max(1)) - 1;
    l.get(i).copied().unwrap_or_default()
}

/// Scrape every 250 ms on one keep-alive connection with cached
/// credentials; a failure (reset, close, timeout, not 200) is counted and
/// the connection made again.
fn scraper(
    addr: SocketAddr,
    auth: String,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Scrapes> {
    std::thread::spawn(move || {
        let mut seen = Scrapes::default();
        let mut conn: Option<TcpStream> = None;
        let started = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            let t = Instant::now();
            let result = (|| -> Result<Duration, String> {
                if conn.is_none() {
                    let s = connect_from(GOOD_FROM, addr).map_err(|e| format!("connect: {e}"))?;
                    s.set_read_timeout(Some(SCRAPE_DEADLINE)).ok();
                    conn = Some(s);
                }
                let s = conn.as_mut().ok_or("no connection")?;
                s.write_all(request(&auth, false).as_bytes())
                    .map_err(|e| format!("send: {e}"))?;
                let (status, body) = read_response(s)?;
                let took = t.elapsed();
                if status != 200 || !body.contains("gpu_memory_used_bytes{") {
                    return Err(format!("status {status}: {:.80}", body));
                }
                if took > SCRAPE_DEADLINE {
                    return Err(format!("took {took:?}"));
                }
                Ok(took)
            })();
            match result {
                Ok(took) => seen.latencies.push(took),
                Err(e) => {
                    conn = None;
                    seen.failures
                        .push(format!("at {:?}: {e}", started.elapsed()));
                }
            }
            std::thread::sleep(Duration::from_millis(250).saturating_sub(t.elapsed()));
        }
        seen
    })
}

fn print_scrapes(what: &str, s: &Scrapes) {
    eprintln!(
        "{what}: {} scrapes, p50 {:?}, worst {:?}, {} failed",
        s.latencies.len(),
        percentile(&s.latencies, 0.5),
        s.latencies.iter().max().copied().unwrap_or_default(),
        s.failures.len()
    );
}

fn web_text(users: &[(&str, &str)], extra: &str) -> String {
    let mut t = String::from("basic_auth_users:\n");
    for (u, h) in users {
        t.push_str(&format!("  {u}: {h}\n"));
    }
    t.push_str(extra);
    t
}

fn wait_reloads(ex: &Exporter, auth: &str, n: f64) {
    wait_for(Duration::from_secs(10), "the web config reload", || {
        let mut s = connect_from(GOOD_FROM, ex.addr).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok();
        s.write_all(request(auth, true).as_bytes()).ok()?;
        let (_, body) = read_response(&mut s).ok()?;
        let m = Metrics::parse(&body);
        (m.get(
            "gpumem_exporter_web_config_reloads_total",
            &[("result", "success")],
        )? >= n)
            .then_some(())
    });
}

#[test]
fn a_wrong_password_flood_at_100m_cpu_delays_no_correct_login() {
    let _heavy = heavy();
    let sc = Scenario::new(SCENARIO);
    let cg = CpuCgroup::new();
    let alice_hash = hash("s3cret", 1);
    let carol_hash = hash("c4rol", 2);
    // All 300 flood connections stay open (the per-address cap is 256 by
    // default: churn at a cap is the next test's).
    let limits = "http_server_config:\n  max_connections_per_ip: 300\n";
    let web = sc.file(
        "web.yml",
        web_text(&[("alice", &alice_hash)], limits).as_bytes(),
    );
    let ex = start_in(&cg, &sc, &web);
    let pid = ex.child.id();
    let alice = basic("alice", "s3cret");
    eprintln!("binary: {}", binary().display());

    // One check alone in the cgroup: the scraper's first login.
    let cpu0 = cpu_of(pid);
    let (status, solo) = login(ex.addr, GOOD_FROM, &alice);
    let check_cpu = cpu_of(pid)
        .saturating_sub(cpu0)
        .max(Duration::from_millis(10));
    assert_eq!(status, 200);
    eprintln!("one bcrypt check (cost {COST}) alone at 100m: {solo:?}, about {check_cpu:?} of CPU");
    let bound = solo * 2 + LOGIN_BOUND;

    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(FloodCounts::default());
    let scraping = scraper(ex.addr, alice.clone(), Arc::clone(&stop));
    let flood_started = Instant::now();
    let (cpu_flood0, throttled0) = (cpu_of(pid), cg.throttled());
    let flooding = flood(ex.addr, Arc::clone(&stop), Arc::clone(&counts));
    std::thread::sleep(Duration::from_secs(4));

    // SIGHUP: the file re-read with a user added; alice's hash unchanged.
    sc.file(
        "web.yml",
        web_text(&[("alice", &alice_hash), ("carol", &carol_hash)], limits).as_bytes(),
    );
    ex.signal_only("HUP");
    let reloaded = Instant::now();
    wait_reloads(&ex, &alice, 1.0);
    let mut logins = Vec::new();
    for _ in 0..10 {
        let (status, took) = login(ex.addr, GOOD_FROM, &alice);
        assert_eq!(status, 200, "a correct login after SIGHUP");
        logins.push(took);
        std::thread::sleep(Duration::from_millis(200));
    }
    let worst = logins.iter().max().copied().unwrap_or_default();
    eprintln!(
        "correct logins after SIGHUP (from {:?} after it): {} logins, p50 {:?}, worst {worst:?}",
        reloaded.elapsed(),
        logins.len(),
        percentile(&logins, 0.5)
    );
    assert!(worst <= LOGIN_BOUND, "worst login {worst:?}: {logins:?}");

    // A user never seen before: one check, from a clean address.
    let carol = basic("carol", "c4rol");
    let (carol_status, carol_took) = login(ex.addr, GOOD_FROM, &carol);
    // A SIGHUP that rotates carol's hash (same password, new salt): her
    // cached login no longer holds; it is checked first.
    sc.file(
        "web.yml",
        web_text(
            &[("alice", &alice_hash), ("carol", &hash("c4rol", 3))],
            limits,
        )
        .as_bytes(),
    );
    ex.signal_only("HUP");
    wait_reloads(&ex, &alice, 2.0);
    let (rotated_status, rotated_took) = login(ex.addr, GOOD_FROM, &carol);
    eprintln!(
        "first logins that need a check under the flood: new user {carol_status} in {carol_took:?}, rotated hash {rotated_status} in {rotated_took:?} (bound {bound:?})"
    );
    std::thread::sleep(Duration::from_secs(3));

    stop.store(true, Ordering::Relaxed);
    let flood_secs = flood_started.elapsed().as_secs_f64();
    let flood_cpu = cpu_of(pid).saturating_sub(cpu_flood0);
    let throttled = cg.throttled() - throttled0;
    let seen = scraping.join().expect("scraper");
    flooding.join().expect("flood");
    let by_status = counts.by_status.lock().unwrap().clone();
    eprintln!(
        "flood: {FLOOD_CONNECTIONS} connections for {flood_secs:.1} s: answers {by_status:?}, {} reconnects; exporter CPU {:.0}m of 100m ({flood_cpu:?}), throttled {throttled} periods",
        counts.reconnects.load(Ordering::Relaxed),
        flood_cpu.as_secs_f64() / flood_secs * 1000.0,
    );
    print_scrapes("cached scraper during the flood", &seen);
    for f in seen.failures.iter().take(5) {
        eprintln!("  scrape failure {f}");
    }
    assert_eq!((carol_status, rotated_status), (200, 200));
    assert!(
        carol_took <= bound && rotated_took <= bound,
        "{carol_took:?}, {rotated_took:?} > {bound:?}"
    );
    assert!(seen.failures.is_empty(), "{:?}", seen.failures);
    assert!(
        seen.latencies.len() >= 40,
        "{} scrapes",
        seen.latencies.len()
    );
    // The flood's failed checks (its 401s) within its address's budget:
    // the first, its burst, then one per check's CPU / rate, and one over.
    let failed = by_status.get(&401).copied().unwrap_or(0);
    let allowed = 2
        + ((flood_secs * PER_ADDRESS_RATE + PER_ADDRESS_BURST) / check_cpu.as_secs_f64()).ceil()
            as u64;
    eprintln!("flood's failed checks: {failed} (budget allows {allowed})");
    assert!(
        failed >= 1 && failed <= allowed,
        "{failed} failed checks > {allowed}"
    );
    assert!(
        by_status.get(&429).copied().unwrap_or(0) > 0,
        "{by_status:?}"
    );
    assert_eq!(by_status.get(&200), None, "{by_status:?}");
}

#[test]
fn a_wrong_password_flood_at_the_connection_cap_resets_no_scraper() {
    let _heavy = heavy();
    let sc = Scenario::new(SCENARIO);
    let cg = CpuCgroup::new();
    let web = sc.file(
        "web.yml",
        web_text(
            &[("alice", &hash("s3cret", 1))],
            "http_server_config:\n  max_connections: 32\n",
        )
        .as_bytes(),
    );
    let ex = start_in(&cg, &sc, &web);
    let alice = basic("alice", "s3cret");
    assert_eq!(login(ex.addr, GOOD_FROM, &alice).0, 200);

    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(FloodCounts::default());
    let scraping = scraper(ex.addr, alice.clone(), Arc::clone(&stop));
    let flooding = flood(ex.addr, Arc::clone(&stop), Arc::clone(&counts));
    // Meanwhile logins with cached credentials, each on a new connection.
    let mut fresh = Scrapes::default();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(8) {
        let t = Instant::now();
        let once = || -> Result<u16, String> {
            let mut s = connect_from(GOOD_FROM, ex.addr).map_err(|e| e.to_string())?;
            s.set_read_timeout(Some(SCRAPE_DEADLINE)).ok();
            s.write_all(request(&alice, true).as_bytes())
                .map_err(|e| e.to_string())?;
            read_response(&mut s).map(|(status, _)| status)
        };
        match once() {
            Ok(200) => fresh.latencies.push(t.elapsed()),
            other => fresh
                .failures
                .push(format!("at {:?}: {other:?}", t0.elapsed())),
        }
        std::thread::sleep(Duration::from_millis(400));
    }
    stop.store(true, Ordering::Relaxed);
    let seen = scraping.join().expect("scraper");
    flooding.join().expect("flood");
    let m = Metrics::parse(&login_body(ex.addr, &alice));
    eprintln!(
        "max_connections 32: flood answers {:?}, {} reconnects; evicted {:?}, refused {:?}",
        counts.by_status.lock().unwrap(),
        counts.reconnects.load(Ordering::Relaxed),
        m.get("gpumem_exporter_http_connections_evicted_total", &[]),
        m.get("gpumem_exporter_http_connections_refused_total", &[]),
    );
    print_scrapes("keep-alive scraper at the cap", &seen);
    print_scrapes("logins on new connections at the cap", &fresh);
    assert!(seen.failures.is_empty(), "{:?}", seen.failures);
    assert!(fresh.failures.is_empty(), "{:?}", fresh.failures);
    assert!(
        seen.latencies.len() >= 20,
        "{} scrapes",
        seen.latencies.len()
    );
}

fn login_body(addr: SocketAddr, auth: &str) -> String {
    let mut s = connect_from(GOOD_FROM, addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).ok();
    s.write_all(request(auth, true).as_bytes()).expect("send");
    read_response(&mut s).map(|(_, b)| b).unwrap_or_default()
}

// ------------------------------------------------------------ restart

/// Addresses of the restart flood (127.0.0.2 to 127.0.0.9), and the
/// keep-alive connections each holds.
const RESTART_FLOOD_ADDRESSES: u8 = 8;
const RESTART_FLOOD_CONNECTIONS: usize = 10;
/// How long the clean scraper is watched after the restart, and the share
/// of its scrapes that must succeed.
const RESTART_WATCH: Duration = Duration::from_secs(35);
const RESTART_SUCCESS: f64 = 0.90;
/// The first correct scrape after the restart is answered within this
/// (where one check takes less than half of it).
const RESTART_FIRST: Duration = Duration::from_secs(3);
/// When the clean scraper starts after the restart: once every flooding
/// address has failed and the total budget is over (a scraper that came
/// first was checked before the flood had failed, even before).
const RESTART_SCRAPER_AFTER: Duration = Duration::from_secs(5);

/// The exporter at `listen` (to come back on the port the flood knows),
/// inside `cg` when given, with `web` as its web config.
fn start_at(cg: Option<&CpuCgroup>, sc: &Scenario, web: &Path, listen: &str) -> Exporter {
    let mut cmd = match cg {
        Some(cg) => {
            let mut c = Command::new("sh");
            c.args([
                "-c",
                &format!(
                    "echo $$ > {}/cgroup.procs && exec \"$0\" \"$@\"",
                    cg.0.display()
                ),
            ])
            .arg(binary());
            c
        }
        None => Command::new(binary()),
    };
    cmd.arg("--nvml.library")
        .arg(fake_nvml())
        .args(["--web.listen-address", listen])
        .args(["--web.config.file", web.to_str().unwrap()])
        .env("FAKE_NVML_CONFIG", &sc.path)
        .env("HOME", sc.dir.path());
    for key in [
        "KUBECONFIG",
        "KUBERNETES_SERVICE_HOST",
        "KUBERNETES_SERVICE_PORT",
        "NODE_NAME",
    ] {
        cmd.env_remove(key);
    }
    Exporter::spawn(cmd)
}

/// [`RESTART_FLOOD_CONNECTIONS`] keep-alive connections from each of
/// [`RESTART_FLOOD_ADDRESSES`] addresses, a third of them unknown users,
/// every request a new wrong password, reconnecting 20 ms after a close
/// (and through the restart), until `stop`.
fn flood_from_addresses(
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    counts: Arc<FloodCounts>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let mut tasks = Vec::new();
            for a in 0..RESTART_FLOOD_ADDRESSES {
                let from = format!("127.0.0.{}", a + 2);
                for i in 0..RESTART_FLOOD_CONNECTIONS {
                    let (stop, counts, from) =
                        (Arc::clone(&stop), Arc::clone(&counts), from.clone());
                    tasks.push(tokio::spawn(async move {
                        let mut n = 0u64;
                        while !stop.load(Ordering::Relaxed) {
                            let Ok(s) = socket(&from) else { break };
                            if let Ok(stream) = s.connect(addr).await {
                                let (r, mut w) = stream.into_split();
                                let mut r = BufReader::new(r);
                                while !stop.load(Ordering::Relaxed) {
                                    n += 1;
                                    let auth = if i % 3 == 0 {
                                        basic(&format!("nobody{a}x{i}"), &format!("guess{n}"))
                                    } else {
                                        basic("alice", &format!("wrong{a}x{i}x{n}"))
                                    };
                                    if w.write_all(request(&auth, false).as_bytes()).await.is_err()
                                    {
                                        break;
                                    }
                                    let Some(status) = read_async(&mut r).await else {
                                        break;
                                    };
                                    *counts.by_status.lock().unwrap().entry(status).or_insert(0) +=
                                        1;
                                }
                            }
                            counts.reconnects.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }));
                }
            }
            for t in tasks {
                let _ = t.await;
            }
        });
    })
}

/// What the clean scraper saw after the restart: when each scrape was
/// sent (from its first) and its status, or why it failed.
struct AfterRestart {
    first_ok: Option<Duration>,
    results: Vec<(Duration, Result<Duration, String>)>,
}

/// From [`GOOD_FROM`], a scrape every 500 ms on one keep-alive connection
/// (made again after a failure) for [`RESTART_WATCH`]: each answered 200
/// within `deadline`, or failed.
fn scrape_after_restart(addr: SocketAddr, auth: &str, deadline: Duration) -> AfterRestart {
    let up = Instant::now();
    let mut conn: Option<TcpStream> = None;
    let mut seen = AfterRestart {
        first_ok: None,
        results: Vec::new(),
    };
    while up.elapsed() < RESTART_WATCH {
        let t = Instant::now();
        let result = (|| -> Result<Duration, String> {
            if conn.is_none() {
                let s = connect_from(GOOD_FROM, addr).map_err(|e| format!("connect: {e}"))?;
                s.set_read_timeout(Some(deadline)).ok();
                conn = Some(s);
            }
            let s = conn.as_mut().ok_or("no connection")?;
            s.write_all(request(auth, false).as_bytes())
                .map_err(|e| format!("send: {e}"))?;
            let (status, body) = read_response(s)?;
            let took = t.elapsed();
            if status != 200 || !body.contains("gpu_memory_used_bytes{") {
                return Err(format!("status {status}: {:.60}", body.trim()));
            }
            if took > deadline {
                return Err(format!("took {took:?}"));
            }
            Ok(took)
        })();
        if result.is_ok() && seen.first_ok.is_none() {
            seen.first_ok = Some(up.elapsed());
        }
        if result.is_err() {
            conn = None;
        }
        seen.results.push((t - up, result));
        std::thread::sleep(Duration::from_millis(500).saturating_sub(t.elapsed()));
    }
    seen
}

/// A restart (its login cache and budgets empty) during a flood of wrong
/// passwords from 8 addresses: a clean address's correct scrape, 5 s
/// after the exporter listens again, is answered within `first`, and at
/// least 90 % of its scrapes over 35 s. Before, the flood's failures kept the
/// total budget over and every such scrape was answered 503.
fn restart_during_a_flood(cg: Option<&CpuCgroup>, first: Duration) {
    let sc = Scenario::new(SCENARIO);
    let web = sc.file(
        "web.yml",
        web_text(
            &[("alice", &hash("s3cret", 1))],
            "http_server_config:\n  max_connections_per_ip: 64\n",
        )
        .as_bytes(),
    );
    let alice = basic("alice", "s3cret");
    let mut ex = start_at(cg, &sc, &web, "127.0.0.1:0");
    let addr = ex.addr;
    assert_eq!(login(addr, GOOD_FROM, &alice).0, 200);
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(FloodCounts::default());
    let flooding = flood_from_addresses(addr, Arc::clone(&stop), Arc::clone(&counts));
    std::thread::sleep(Duration::from_secs(5));

    let (status, _) = ex.signal("TERM");
    assert!(status.success(), "{status}");
    let ex = start_at(cg, &sc, &web, &addr.to_string());
    std::thread::sleep(RESTART_SCRAPER_AFTER);
    let seen = scrape_after_restart(addr, &alice, first.max(SCRAPE_DEADLINE));
    stop.store(true, Ordering::Relaxed);
    flooding.join().expect("flood");
    let ok: Vec<Duration> = seen
        .results
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok().copied())
        .collect();
    let share = ok.len() as f64 / seen.results.len().max(1) as f64;
    eprintln!(
        "restart during a flood from {RESTART_FLOOD_ADDRESSES} addresses x {RESTART_FLOOD_CONNECTIONS} connections{}: \
         first correct scrape {:?} after its first attempt, {RESTART_SCRAPER_AFTER:?} after listening (bound {first:?}); {} of {} scrapes over {RESTART_WATCH:?} ({:.0} %), p50 {:?}, worst {:?}; flood answers {:?}, {} reconnects",
        if cg.is_some() { " at 100m CPU" } else { "" },
        seen.first_ok,
        ok.len(),
        seen.results.len(),
        share * 100.0,
        percentile(&ok, 0.5),
        ok.iter().max().copied().unwrap_or_default(),
        counts.by_status.lock().unwrap(),
        counts.reconnects.load(Ordering::Relaxed),
    );
    for (at, r) in seen.results.iter().filter(|(_, r)| r.is_err()).take(8) {
        eprintln!("  scrape at {at:?}: {r:?}");
    }
    drop(ex);
    let first_ok = seen.first_ok.unwrap_or(Duration::MAX);
    assert!(first_ok <= first, "first correct scrape after {first_ok:?}");
    assert!(
        share >= RESTART_SUCCESS,
        "{:.0} % of scrapes",
        share * 100.0
    );
    let failed = counts.by_status.lock().unwrap().get(&401).copied();
    assert!(failed.unwrap_or(0) > 0, "the flood was checked");
}

/// Without a CPU limit: the debug build's check is as slow as the
/// release build's under the DaemonSet's 100m.
#[test]
fn a_restart_during_a_flood_from_8_addresses_answers_a_clean_scraper_within_3s() {
    let _heavy = heavy();
    restart_during_a_flood(None, RESTART_FIRST);
}

/// The same inside a 100m CPU cgroup (root), with the release binary
/// (`GPUMEM_IMAGE_BINARY`, as scripts/ci/test sets it): the first scrape
/// within 3 s. The debug build's check takes about 0.5 s of CPU, 5 s at
/// 100m, so the running check and the scraper's own are past the 3 s and
/// the 10 s a check may wait (measured: one check alone 5.3 s, the first
/// scrape 9.0 s): without the release binary the test says so and stops.
#[test]
fn a_restart_during_a_flood_from_8_addresses_at_100m_cpu_answers_a_clean_scraper_within_3s() {
    if std::env::var_os("GPUMEM_IMAGE_BINARY").is_none_or(|b| b.is_empty()) {
        eprintln!(
            "the restart flood at 100m needs the release binary (GPUMEM_IMAGE_BINARY): a debug check takes 5 s there"
        );
        return;
    }
    let _heavy = heavy();
    let cg = CpuCgroup::new();
    let solo = {
        let sc = Scenario::new(SCENARIO);
        let web = sc.file(
            "web.yml",
            web_text(&[("alice", &hash("s3cret", 1))], "").as_bytes(),
        );
        let ex = start_at(Some(&cg), &sc, &web, "127.0.0.1:0");
        let (status, took) = login(ex.addr, GOOD_FROM, &basic("alice", "s3cret"));
        assert_eq!(status, 200);
        took
    };
    eprintln!("one check (cost {COST}) alone at 100m: {solo:?}");
    restart_during_a_flood(Some(&cg), RESTART_FIRST);
}
