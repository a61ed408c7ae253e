//! The harness of the end-to-end tests: build the fake NVML, write its
//! scenarios, run the real `gpumem-exporter` binary, scrape it over plain
//! HTTP. Beside it:
//! - `browser`: a headless Chromium driven over the DevTools protocol,
//! - `cluster`: a fake node (/proc root, pods, Kubernetes list/watch API),
//! - `fleet`: VictoriaMetrics, vmagent, vmalert, Prometheus in agent mode,
//!   Alertmanager from the shipped deploy/fleet files, a webhook receiver,
//! - `kubelet`: a fake kubelet's pod-resources gRPC API on a Unix socket,
//! - `podman`: a real Podman with its state in a temp dir,
//! - `prom`: a real Prometheus server, PromQL and Grafana helpers,
//! - `python`: Python children running the torch bridge, the stub torch,
//! - `tools`: the external programs the tests run.
//!
//! `browser`, `fleet`, `podman`, `prom`, `python` and `tools` start programs from outside the
//! Rust toolchain, so they are built only with `--features external-tools`.

#[cfg(feature = "external-tools")]
pub mod browser;
pub mod cluster;
#[cfg(feature = "external-tools")]
pub mod fleet;
pub mod kubelet;
#[cfg(feature = "external-tools")]
pub mod podman;
#[cfg(feature = "external-tools")]
pub mod prom;
#[cfg(feature = "external-tools")]
pub mod python;
#[cfg(feature = "external-tools")]
pub mod tools;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_gpumem-exporter");

/// The repository root.
pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A file of the repository, by its path from the root.
pub fn repo_file(rel: &str) -> PathBuf {
    repo().join(rel)
}

/// Path of the fake `libnvidia-ml` (built once per test binary).
pub fn fake_nvml() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let manifest = repo();
        let status = Command::new(env!("CARGO"))
            .args(["build", "--locked", "-q", "-p", "fake-nvml", "--lib"])
            .current_dir(manifest)
            .status()
            .expect("run cargo build -p fake-nvml");
        assert!(status.success(), "cargo build -p fake-nvml failed");
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| manifest.join("target"));
        let lib = target.join("debug").join("libfake_nvml.so");
        assert!(lib.exists(), "{} not built", lib.display());
        lib
    })
}

/// Make `cmd` start as the leader of a process group of its own, so that
/// [`kill_group`] ends whatever it starts too. A wrapper (`faketime`,
/// which forks the exporter and waits; a shell that does not `exec`) does
/// not pass a SIGKILL on to its child: killing the wrapper alone left an
/// exporter running, reparented to init, long after its test.
pub fn own_group(cmd: &mut Command) -> &mut Command {
    std::os::unix::process::CommandExt::process_group(cmd, 0)
}

/// SIGKILL to the process group `child` leads (started with
/// [`own_group`]), then reap `child`. Only while the leader is unreaped
/// (running, or exited and not waited for): until then its pid, the
/// group's id, cannot be given to another process, whose group a late
/// kill would hit (pids wrap at 32,768 on some machines).
pub fn kill_group(child: &mut Child) {
    if let Some(pgid) = unreaped(child, false) {
        // SAFETY: kill(2) on the group of a child we started as its leader
        // and have not reaped; a valid signal number.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// `child`'s pid while it is not reaped yet, without reaping it
/// (`waitid` with `WNOWAIT`); with `block`, once it has exited.
fn unreaped(child: &Child, block: bool) -> Option<libc::pid_t> {
    let pid = libc::pid_t::try_from(child.id()).ok()?;
    let id = libc::id_t::try_from(pid).ok()?;
    let flags = libc::WEXITED | libc::WNOWAIT | if block { 0 } else { libc::WNOHANG };
    // SAFETY: a zeroed siginfo_t is a valid out-parameter for waitid(2).
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: waitid(2) on our own child, with a valid out-pointer;
        // WNOWAIT leaves it for `Child::wait` to reap.
        let rc = unsafe { libc::waitid(libc::P_PID, id, &mut info, flags) };
        if rc == 0 {
            return Some(pid);
        }
        // ECHILD: reaped already (by `Child::wait`).
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return None;
        }
    }
}

/// A scenario file the fake NVML re-reads when it changes.
pub struct Scenario {
    pub dir: tempfile::TempDir,
    pub path: PathBuf,
}

impl Scenario {
    pub fn new(yaml: &str) -> Scenario {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("scenario.yaml");
        let s = Scenario { dir, path };
        s.write(yaml);
        s
    }

    /// Replace the scenario atomically (write + rename).
    pub fn write(&self, yaml: &str) {
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, yaml).expect("write scenario");
        std::fs::rename(&tmp, &self.path).expect("rename scenario");
    }

    pub fn file(&self, name: &str, content: &[u8]) -> PathBuf {
        let p = self.dir.path().join(name);
        std::fs::write(&p, content).expect("write file");
        p
    }
}

/// A running exporter; killed on drop.
pub struct Exporter {
    pub child: Child,
    pub addr: SocketAddr,
    pub stderr: Arc<Mutex<Vec<String>>>,
}

impl Exporter {
    /// Start on the fake NVML with `scenario`, listening on a free port.
    pub fn start(scenario: &Scenario, extra: &[&str]) -> Exporter {
        Self::spawn(Self::command(Command::new(BIN), scenario, extra))
    }

    /// Start with `yaml` as its config file (`config.yaml` beside the
    /// scenario, where a test may rewrite it) and `extra` flags.
    pub fn with_config(scenario: &Scenario, yaml: &str, extra: &[&str]) -> Exporter {
        let cfg = scenario.file("config.yaml", yaml.as_bytes());
        let mut args = vec!["--config.file", cfg.to_str().expect("utf-8 path")];
        args.extend(extra);
        Self::start(scenario, &args)
    }

    /// `cmd` (the exporter, or a wrapper whose last argument is the
    /// exporter) with what runs the exporter on the fake NVML with
    /// `scenario`, listening on a free port, then `extra`.
    /// The Kubernetes environment is the test's, not the machine's: no
    /// KUBECONFIG, no in-cluster variables, no NODE_NAME, and a HOME (the
    /// scenario's folder) without a ~/.kube/config; a test that wants
    /// them sets them on the command.
    pub fn command(cmd: Command, scenario: &Scenario, extra: &[&str]) -> Command {
        Self::command_with_library(cmd, fake_nvml(), scenario, extra)
    }

    /// [`Exporter::command`] with `library` as the fake NVML (one built for
    /// another architecture, say).
    pub fn command_with_library(
        mut cmd: Command,
        library: &Path,
        scenario: &Scenario,
        extra: &[&str],
    ) -> Command {
        cmd.arg("--nvml.library")
            .arg(library)
            .args(["--web.listen-address", "127.0.0.1:0"])
            .args(extra)
            .env("FAKE_NVML_CONFIG", &scenario.path);
        for key in [
            "KUBECONFIG",
            "KUBERNETES_SERVICE_HOST",
            "KUBERNETES_SERVICE_PORT",
            "NODE_NAME",
        ] {
            cmd.env_remove(key);
        }
        cmd.env("HOME", scenario.dir.path());
        cmd
    }

    /// Run `cmd` (the exporter, possibly behind a wrapper such as setpriv)
    /// and wait until it logs the address it listens on.
    /// It leads a process group of its own ([`own_group`]): dropping the
    /// `Exporter` kills the group, the exporter behind a wrapper too.
    pub fn spawn(mut cmd: Command) -> Exporter {
        own_group(&mut cmd);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn gpumem-exporter");
        let stderr = child.stderr.take().expect("stderr");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel::<SocketAddr>();
        let sink = Arc::clone(&lines);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("msg=listening")
                    && let Some(a) = field(&line, "address").and_then(|a| a.parse().ok())
                {
                    let _ = tx.send(a);
                }
                sink.lock().unwrap().push(line);
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(a) => a,
            Err(_) => {
                kill_group(&mut child);
                panic!(
                    "exporter did not start listening; stderr:\n{}",
                    lines.lock().unwrap().join("\n")
                );
            }
        };
        Exporter {
            child,
            addr,
            stderr: lines,
        }
    }

    pub fn get(&self, path: &str) -> Response {
        http_get(self.addr, path, &[])
    }

    pub fn metrics(&self) -> Metrics {
        let r = self.get("/metrics");
        assert_eq!(r.status, 200, "/metrics: {}", r.body);
        Metrics::parse(&r.body)
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    /// `needle` is in the log exactly once (a condition logged once, not
    /// once per sample).
    pub fn assert_logged_once(&self, needle: &str) {
        let log = self.stderr();
        assert_eq!(
            log.matches(needle).count(),
            1,
            "{needle:?} logged once:\n{log}"
        );
    }

    /// Send a signal and wait for the exit status.
    pub fn signal(&mut self, sig: &str) -> (std::process::ExitStatus, Duration) {
        let t = Instant::now();
        self.signal_only(sig);
        // Exited, not yet reaped: what it started behind a wrapper goes
        // with its group, while the group's id is still its own.
        let waited = unreaped(&self.child, true);
        let took = t.elapsed();
        if let Some(pgid) = waited {
            // SAFETY: kill(2) on the group of our unreaped child; a valid
            // signal number.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
        }
        let status = self.child.wait().expect("wait");
        (status, took)
    }

    /// Send a signal without waiting for an exit.
    pub fn signal_only(&self, sig: &str) {
        send_signal(&self.child, sig);
    }
}

/// Send `sig` (its name without `SIG`: "TERM", "INT" or "HUP") to
/// `child`. Through libc rather than the `kill` program, so the fast loop
/// needs no procps on PATH.
pub fn send_signal(child: &Child, sig: &str) {
    let signo = match sig {
        "TERM" => libc::SIGTERM,
        "INT" => libc::SIGINT,
        "HUP" => libc::SIGHUP,
        other => panic!("send_signal: no signal named {other:?} here"),
    };
    let pid = libc::pid_t::try_from(child.id()).expect("pid fits pid_t");
    // SAFETY: kill(2) with a pid we spawned and a valid signal number.
    let rc = unsafe { libc::kill(pid, signo) };
    assert_eq!(
        rc,
        0,
        "kill -{sig} {pid}: {}",
        std::io::Error::last_os_error()
    );
}

impl Drop for Exporter {
    fn drop(&mut self) {
        kill_group(&mut self.child);
    }
}

/// Value of `key=value` in a logfmt line.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let pat = format!(" {key}=");
    let start = line.find(&pat)? + pat.len();
    let rest = &line[start..];
    Some(rest.split(' ').next().unwrap_or(rest).trim_matches('"'))
}

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Send a GET (the connection closes after it) and read the whole answer.
fn get_raw(addr: SocketAddr, path: &str, version: &str, headers: &[(&str, &str)]) -> Vec<u8> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let mut req = format!("GET {path} {version}\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).expect("send");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    raw
}

/// A minimal HTTP/1.1 GET (Connection: close), std only.
pub fn http_get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Response {
    parse_response(&get_raw(addr, path, "HTTP/1.1", headers))
}

/// How long [`scrape_within`] gives a scrape.
#[cfg(feature = "external-tools")]
#[derive(Clone, Copy, Debug)]
pub enum Deadline {
    /// Connect to last byte within this: the connect, the send and every
    /// read get what is left of it, and once it has passed no step starts.
    Whole(Duration),
    /// The connect within `connect`, then every read within `read`; no
    /// bound on the send or on the answer as a whole (a caller that wants
    /// one checks [`Scraped::took`]).
    Steps { connect: Duration, read: Duration },
}

/// An answer [`scrape_within`] read to its end.
#[cfg(feature = "external-tools")]
pub struct Scraped {
    /// Connect to last byte.
    pub took: Duration,
    /// The answer as it came: [`parse_response`] or [`parse_head`] it.
    pub raw: Vec<u8>,
}

#[cfg(feature = "external-tools")]
impl Scraped {
    /// Status, headers and (de-chunked) text body.
    pub fn response(&self) -> Response {
        parse_response(&self.raw)
    }
}

/// Why [`scrape_within`] has no answer.
#[cfg(feature = "external-tools")]
#[derive(Debug)]
pub enum ScrapeError {
    /// The connect failed, or did not finish in time.
    Connect(std::io::Error),
    /// Sending the request failed `after` the start.
    Send {
        after: Duration,
        err: std::io::Error,
    },
    /// A read failed (or timed out) `after` the start, `bytes` in.
    Read {
        after: Duration,
        bytes: usize,
        err: std::io::Error,
    },
    /// A [`Deadline::Whole`] passed before the answer ended.
    Deadline(Duration),
}

#[cfg(feature = "external-tools")]
impl std::fmt::Display for ScrapeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ScrapeError::Connect(e) => write!(f, "connect: {e}"),
            ScrapeError::Send { after, err } => write!(f, "send after {after:?}: {err}"),
            ScrapeError::Read { after, bytes, err } => {
                write!(f, "read after {after:?} ({bytes} bytes): {err}")
            }
            ScrapeError::Deadline(d) => write!(f, "no answer within {d:?}"),
        }
    }
}

/// A scrape as a scraper under test makes it: a GET of `path` (with
/// `headers`, `Connection: close`) on a new connection, read to its end
/// under `deadline`; a failure or a timeout is an error, never a panic.
///
/// Why it exists: the heavy tests (the attack floods, the chaos soak, the
/// memory ceiling) count failed scrapes and how long the good ones took,
/// under a bound each chooses, so a scrape there must come back as a
/// value: the answer and its time, or why there was none. [`http_get`]
/// panics on a failure and times nothing.
#[cfg(feature = "external-tools")]
pub fn scrape_within(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    deadline: Deadline,
) -> Result<Scraped, ScrapeError> {
    let start = Instant::now();
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: scraper\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    let send_failed = |err| ScrapeError::Send {
        after: start.elapsed(),
        err,
    };
    let mut raw = Vec::new();
    match deadline {
        Deadline::Whole(whole) => {
            // What is left of it; an error once it has passed (to std a
            // zero timeout would mean none).
            let left = || {
                whole
                    .checked_sub(start.elapsed())
                    .filter(|d| !d.is_zero())
                    .ok_or(ScrapeError::Deadline(whole))
            };
            let mut s = TcpStream::connect_timeout(&addr, left()?).map_err(ScrapeError::Connect)?;
            s.set_write_timeout(Some(left()?)).ok();
            s.write_all(req.as_bytes()).map_err(send_failed)?;
            let mut buf = [0u8; 16384];
            loop {
                s.set_read_timeout(Some(left()?)).ok();
                match s.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => raw.extend_from_slice(&buf[..n]),
                    Err(err) => {
                        return Err(ScrapeError::Read {
                            after: start.elapsed(),
                            bytes: raw.len(),
                            err,
                        });
                    }
                }
            }
        }
        Deadline::Steps { connect, read } => {
            let mut s = TcpStream::connect_timeout(&addr, connect).map_err(ScrapeError::Connect)?;
            s.set_read_timeout(Some(read)).ok();
            s.write_all(req.as_bytes()).map_err(send_failed)?;
            if let Err(err) = s.read_to_end(&mut raw) {
                return Err(ScrapeError::Read {
                    after: start.elapsed(),
                    bytes: raw.len(),
                    err,
                });
            }
        }
    }
    Ok(Scraped {
        took: start.elapsed(),
        raw,
    })
}

/// Status, headers and (de-chunked) text body of a raw HTTP/1.x answer.
pub fn parse_response(raw: &[u8]) -> Response {
    let Some((mut r, body)) = parse_head(raw) else {
        // No blank line: all of it is head, and there is no body.
        return head_of(&String::from_utf8_lossy(raw));
    };
    let body = String::from_utf8_lossy(body);
    let chunked = r
        .headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    r.body = if chunked {
        dechunk(&body)
    } else {
        body.into_owned()
    };
    r
}

/// The head of a raw HTTP/1.x answer (status and headers, `body` left
/// empty) and its body's bytes as they came: not de-chunked, not taken
/// for text (a gzip body is none). None when no blank line ends the head.
pub fn parse_head(raw: &[u8]) -> Option<(Response, &[u8])> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    Some((
        head_of(&String::from_utf8_lossy(&raw[..end])),
        &raw[end + 4..],
    ))
}

/// Status line and header lines, as text.
fn head_of(head: &str) -> Response {
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    Response {
        status,
        headers,
        body: String::new(),
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// Parsed exposition: `name{labels}` (labels as served) → value text.
/// Label lookups treat an empty label value as an absent label, as
/// Prometheus does.
#[derive(Debug, Clone)]
pub struct Metrics {
    pub text: String,
    pub samples: BTreeMap<String, String>,
}

impl Metrics {
    pub fn parse(text: &str) -> Metrics {
        let mut samples = BTreeMap::new();
        for line in text.lines() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            if let Some((series, value)) = line.rsplit_once(' ') {
                samples.insert(series.to_string(), value.to_string());
            }
        }
        Metrics {
            text: text.to_string(),
            samples,
        }
    }

    /// The value of the series with this name and exactly these labels.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.find(name, labels)
            .into_iter()
            .find(|(l, _)| l.len() == present(labels))
            .map(|(_, v)| v)
    }

    /// All series of `name` whose labels include `labels`. As in PromQL, a
    /// wanted `("pod", "")` matches a series without `pod`.
    pub fn find(
        &self,
        name: &str,
        labels: &[(&str, &str)],
    ) -> Vec<(BTreeMap<String, String>, f64)> {
        let mut out = Vec::new();
        for (series, value) in &self.samples {
            let (n, ls) = split_series(series);
            if n == name && has_labels(&ls, labels) {
                out.push((ls, value.parse::<f64>().unwrap_or(f64::NAN)));
            }
        }
        out
    }

    /// The exact integer value (bytes are exact up to 2^53 as f64 text).
    pub fn get_u64(&self, name: &str, labels: &[(&str, &str)]) -> Option<u64> {
        self.samples.iter().find_map(|(series, v)| {
            let (n, ls) = split_series(series);
            (n == name && ls.len() == present(labels) && has_labels(&ls, labels))
                .then(|| v.parse::<u64>().ok())
                .flatten()
        })
    }
}

/// Number of wanted labels with a value: an empty one means "absent".
fn present(labels: &[(&str, &str)]) -> usize {
    labels.iter().filter(|(_, v)| !v.is_empty()).count()
}

/// `ls` has every wanted label; a wanted empty value means the label is
/// absent (Prometheus makes no difference between the two).
fn has_labels(ls: &BTreeMap<String, String>, labels: &[(&str, &str)]) -> bool {
    labels
        .iter()
        .all(|(k, v)| ls.get(*k).map_or("", String::as_str) == *v)
}

fn split_series(series: &str) -> (&str, BTreeMap<String, String>) {
    let Some((name, rest)) = series.split_once('{') else {
        return (series, BTreeMap::new());
    };
    let body = rest.strip_suffix('}').unwrap_or(rest);
    let mut labels = BTreeMap::new();
    let mut chars = body.chars().peekable();
    loop {
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if key.is_empty() {
            break;
        }
        if chars.next() != Some('"') {
            break;
        }
        let mut val = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => {
                    if let Some(n) = chars.next() {
                        val.push(if n == 'n' { '\n' } else { n });
                    }
                }
                '"' => break,
                c => val.push(c),
            }
        }
        // An empty value is no label, as Prometheus stores it.
        if !val.is_empty() {
            labels.insert(key.trim_start_matches(',').to_string(), val);
        }
        if chars.peek() == Some(&',') {
            chars.next();
        }
    }
    (name, labels)
}

/// Run the binary to completion: (exit code, stderr).
pub fn run_to_exit(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(BIN)
        .args(args)
        .output()
        .expect("run gpumem-exporter");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// The binary, given `flag` with `path` and `extra`, refuses that file:
/// exit code 2 and one line on stderr that says `want` and names the file.
pub fn assert_file_refused(flag: &str, path: &Path, extra: &[&str], want: &str) {
    let file = path.to_str().expect("utf-8 path");
    let mut args = vec![flag, file];
    args.extend(extra);
    let (code, err) = run_to_exit(&args);
    assert_eq!(code, Some(2), "{file}: {err}");
    assert_eq!(err.lines().count(), 1, "{file}: one line: {err}");
    assert!(err.contains(want), "{file}: got {err:?} want {want:?}");
    assert!(err.contains(file), "{file}: names the file: {err}");
}

/// One heavy test at a time (the attack floods, the chaos soak, the
/// memory ceiling, the arm64 build and image under qemu-user): each loads
/// the cores of a CI machine for minutes, and beside another one a scrape
/// deadline would measure the neighbour.
#[cfg(feature = "external-tools")]
pub fn heavy() -> std::sync::MutexGuard<'static, ()> {
    static HEAVY: Mutex<()> = Mutex::new(());
    HEAVY.lock().unwrap_or_else(|e| e.into_inner())
}

/// A `kB` figure of /proc/<pid>/status (`key` with its colon, e.g.
/// `"VmRSS:"`); None once the process is gone.
#[cfg(feature = "external-tools")]
pub fn status_kib(pid: u32, key: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// The environment variable `name` as a number (a long run's length, a
/// seed), else `default`.
#[cfg(feature = "external-tools")]
pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Now, in Unix seconds.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64()
}

/// Poll `f` until it returns Some, or panic after `timeout`.
pub fn wait_for<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// GET returning (Content-Encoding, raw body bytes), for compressed bodies.
pub fn http_get_bytes(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> (Option<String>, Vec<u8>) {
    let raw = get_raw(addr, path, "HTTP/1.0", headers);
    let (head, body) = parse_head(&raw).expect("header end");
    (
        head.header("content-encoding").map(str::to_string),
        body.to_vec(),
    )
}

/// The series lines of an exposition that carry a label with an empty
/// value. A plain `=""` search is exact: inside a label value every `"`
/// is escaped, so `=""` can only be a label whose value is empty.
pub fn empty_label_lines(exposition: &str) -> Vec<&str> {
    exposition
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains("=\"\""))
        .collect()
}

/// stdout then stderr of a finished program, as text.
pub fn output_text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
