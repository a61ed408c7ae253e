//! The fleet path's programs for end-to-end tests: VictoriaMetrics
//! single-node, vmagent, vmalert, Prometheus in agent mode and
//! Alertmanager, each started from its Debian binary on a free loopback
//! port with its state in a temporary directory and killed on drop; and a
//! webhook receiver (hyper, in the test) that keeps what Alertmanager posts.
//!
//! The flags come from the shipped files under deploy/fleet (`*.flags`, one
//! flag a line): a test replaces the example hosts in them with the
//! loopback addresses ([`shipped_flags`]) and overrides only what it must
//! (listen addresses, paths, intervals), so the shipped files are what runs.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::prom::{QueryResult, free_port, urlencode};
use super::{http_get, repo_file};

fn install_hint(program: &str) -> &'static str {
    match program {
        "victoria-metrics" | "vmagent" | "vmalert" => {
            "install it: `apt-get install -y victoria-metrics` (Debian/Ubuntu; scripts/ci/test does)"
        }
        "prometheus-alertmanager" | "amtool" => {
            "install it: `apt-get install -y prometheus-alertmanager` (Debian/Ubuntu; scripts/ci/test does)"
        }
        _ => "install it and put it on PATH",
    }
}

/// `program` if it is on PATH, else a loud failure saying how to install
/// it (the VictoriaMetrics binaries of Debian print no version, so
/// `--version` cannot be the check).
pub fn require(program: &'static str) -> &'static str {
    let found = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()));
    assert!(
        found,
        "`{program}` is not on PATH; {}",
        install_hint(program)
    );
    program
}

/// The flags of a shipped `deploy/fleet/<name>.flags` file (comments and
/// blank lines left out), with each `(from, to)` replaced in every flag
/// (the example hosts by loopback URLs), then `overrides` (`-name=value`)
/// put in place of the shipped flag of the same name or added.
pub fn shipped_flags(name: &str, replace: &[(&str, &str)], overrides: &[String]) -> Vec<String> {
    let path = repo_file(&format!("deploy/fleet/{name}.flags"));
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let flag_name = |f: &str| f.split('=').next().unwrap_or(f).to_string();
    let mut flags: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            replace
                .iter()
                .fold(l.to_string(), |acc, (from, to)| acc.replace(from, to))
        })
        .collect();
    assert!(!flags.is_empty(), "{} holds no flag", path.display());
    for o in overrides {
        let n = flag_name(o);
        match flags.iter_mut().find(|f| flag_name(f) == n) {
            Some(f) => *f = o.clone(),
            None => flags.push(o.clone()),
        }
    }
    flags
}

/// A running program; killed (and reaped) on drop.
pub struct Proc {
    pub name: &'static str,
    pub child: Child,
    pub addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    /// Start `program` with the arguments `args` makes for a free loopback
    /// address, in `dir`, and wait until GET `ready` there answers 200
    /// (within 30 s). The port is picked before the program binds it:
    /// another port if it was taken in between.
    pub fn start(
        program: &'static str,
        dir: &Path,
        ready: &str,
        args: impl Fn(SocketAddr) -> Vec<String>,
    ) -> Proc {
        let mut last = String::new();
        for _ in 0..3 {
            let addr = loopback();
            match Self::try_start(program, &args(addr), dir, addr, ready) {
                Ok(p) => return p,
                Err(log) if log.contains("address already in use") => last = log,
                Err(log) => panic!("{program} exited:\n{log}"),
            }
        }
        panic!("{program} could not bind a free port:\n{last}")
    }

    fn try_start(
        program: &'static str,
        args: &[String],
        dir: &Path,
        addr: SocketAddr,
        ready: &str,
    ) -> Result<Proc, String> {
        let mut child = Command::new(require(program))
            .args(args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
        let log = Arc::new(Mutex::new(Vec::new()));
        for pipe in [
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let sink = Arc::clone(&log);
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    sink.lock().unwrap().push(line);
                }
            });
        }
        let mut p = Proc {
            name: program,
            child,
            addr,
            log,
        };
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = p.child.try_wait() {
                std::thread::sleep(Duration::from_millis(100));
                return Err(format!("exit {status}\n{}", p.log()));
            }
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
                && http_get(addr, ready, &[]).status == 200
            {
                // Ours, not another program's that took the port first.
                std::thread::sleep(Duration::from_millis(100));
                if p.child.try_wait().ok().flatten().is_none() {
                    return Ok(p);
                }
                continue;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{program} not ready at {addr}{ready} after 30 s:\n{}",
                p.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// GET a JSON API path.
    pub fn api(&self, path: &str) -> Value {
        let r = http_get(self.addr, path, &[]);
        serde_json::from_str(&r.body).unwrap_or_else(|e| {
            panic!(
                "{} GET {path}: HTTP {} and no JSON ({e}): {}\nlog:\n{}",
                self.name,
                r.status,
                r.body,
                self.log()
            )
        })
    }

    /// An instant query through the Prometheus query API (VictoriaMetrics
    /// answers it), now or at `time` (Unix seconds).
    pub fn query(&self, expr: &str, time: Option<f64>) -> QueryResult {
        let mut path = format!("/api/v1/query?query={}", urlencode(expr));
        if let Some(t) = time {
            path.push_str(&format!("&time={t:.3}"));
        }
        let v = self.api(&path);
        QueryResult {
            status: v["status"].as_str().unwrap_or("").to_string(),
            error: v["error"].as_str().map(str::to_string),
            result: match &v["data"]["result"] {
                Value::Array(a) => a.clone(),
                Value::Null => Vec::new(),
                scalar => vec![scalar.clone()],
            },
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback address on a port that was free a moment ago.
pub fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// VictoriaMetrics single-node with the shipped flags
/// (deploy/fleet/victoria-metrics.flags), its storage in `dir`, and
/// `-search.latencyOffset=1s` so a query sees samples a second after they
/// arrive (the shipped default, 30 s, would make every wait 30 s longer).
pub fn victoria_metrics(dir: &Path) -> Proc {
    Proc::start("victoria-metrics", dir, "/health", |addr| {
        shipped_flags(
            "victoria-metrics",
            &[],
            &[
                format!("-storageDataPath={}", dir.join("vm-data").display()),
                format!("-httpListenAddr={addr}"),
                "-search.latencyOffset=1s".into(),
                "-loggerLevel=WARN".into(),
            ],
        )
    })
}

/// The example hosts of the shipped flag files, replaced by these URLs.
pub fn hosts<'a>(vm: &'a str, alertmanager: &'a str) -> [(&'static str, &'a str); 2] {
    [
        ("http://victoriametrics:8428", vm),
        ("http://alertmanager:9093", alertmanager),
    ]
}

/// A shipped scrape config (deploy/fleet/`file`) made runnable here: the
/// jobs that discover Kubernetes pods are left out (no cluster), the
/// static job's targets are `targets`, every interval is `interval`, and
/// `remote_write` URLs (Prometheus agent) point at `remote_write`. Written
/// as JSON (YAML's subset) to `out`.
pub fn scrape_config(
    file: &str,
    targets: &[String],
    interval: &str,
    remote_write: Option<&str>,
    out: &Path,
) -> PathBuf {
    let path = repo_file(&format!("deploy/fleet/{file}"));
    let text = std::fs::read_to_string(&path).expect("read the shipped scrape config");
    let mut cfg: Value = serde_saphyr::from_str(&text).expect("parse the shipped scrape config");
    cfg["global"]["scrape_interval"] = interval.into();
    cfg["global"]["scrape_timeout"] = interval.into();
    let jobs = cfg["scrape_configs"]
        .as_array_mut()
        .expect("scrape_configs");
    jobs.retain(|j| j.get("kubernetes_sd_configs").is_none());
    assert_eq!(jobs.len(), 1, "{file}: one static job besides Kubernetes");
    jobs[0]["static_configs"] = serde_json::json!([{ "targets": targets }]);
    if let Some(url) = remote_write {
        for rw in cfg["remote_write"].as_array_mut().expect("remote_write") {
            rw["url"] = format!("{url}/api/v1/write").into();
        }
    }
    let file = out.join(file);
    std::fs::write(&file, cfg.to_string()).expect("write scrape config");
    file
}

/// vmagent with the shipped flags and deploy/fleet/vmagent.yml (see
/// [`scrape_config`]), writing to `vm`.
pub fn vmagent(dir: &Path, vm: &Proc, targets: &[String], interval: &str) -> Proc {
    let config = scrape_config("vmagent.yml", targets, interval, None, dir);
    let vm_url = vm.url();
    Proc::start("vmagent", dir, "/health", |addr| {
        shipped_flags(
            "vmagent",
            &hosts(&vm_url, ""),
            &[
                format!("-promscrape.config={}", config.display()),
                format!(
                    "-remoteWrite.tmpDataPath={}",
                    dir.join("vmagent-buffer").display()
                ),
                format!("-httpListenAddr={addr}"),
                "-loggerLevel=WARN".into(),
            ],
        )
    })
}

/// vmalert with the shipped flags (deploy/fleet/vmalert.flags): `rules`
/// (deploy/prometheus/rules.yml, or its copy with every group at the
/// global interval: `prom::rules_at_global_interval`) against `vm`, alerts to
/// `notifier` (Alertmanager's URL, or any receiver of its API), evaluated
/// every `interval`, what it records written within 500 ms.
pub fn vmalert(dir: &Path, rules: &Path, vm: &Proc, notifier: &str, interval: &str) -> Proc {
    let vm_url = vm.url();
    Proc::start("vmalert", dir, "/health", |addr| {
        shipped_flags(
            "vmalert",
            &hosts(&vm_url, notifier),
            &[
                format!("-rule={}", rules.display()),
                format!("-evaluationInterval={interval}"),
                // Recorded series and ALERTS_FOR_STATE in VictoriaMetrics half
                // a second after an evaluation, not up to 5 s (the default).
                "-remoteWrite.flushInterval=500ms".into(),
                format!("-httpListenAddr={addr}"),
                format!("-external.url=http://{addr}"),
                "-loggerLevel=WARN".into(),
            ],
        )
    })
}

/// POST `body` to `path` on `addr` (Connection: close); the HTTP status.
pub fn http_post(addr: SocketAddr, path: &str, body: &str) -> u16 {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    super::parse_response(&raw).status
}

/// What a webhook receiver got: each POSTed JSON body, in order.
pub struct Webhook {
    pub addr: SocketAddr,
    pub received: Arc<Mutex<Vec<Value>>>,
    _runtime: tokio::runtime::Runtime,
}

impl Webhook {
    /// A receiver on a free loopback port: every POST's body is parsed as
    /// JSON and kept; the answer is 200 (a body that is no JSON: 400).
    pub fn start() -> Webhook {
        use http_body_util::BodyExt;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind the webhook receiver");
        let addr = listener.local_addr().expect("local addr");
        let received = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&received);
        runtime.spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let sink = Arc::clone(&sink);
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        move |req: hyper::Request<hyper::body::Incoming>| {
                            let sink = Arc::clone(&sink);
                            async move {
                                let body = req.into_body().collect().await?.to_bytes();
                                let status = match serde_json::from_slice::<Value>(&body) {
                                    Ok(v) => {
                                        sink.lock().unwrap().push(v);
                                        200
                                    }
                                    Err(_) => 400,
                                };
                                let mut resp = hyper::Response::new(http_body_util::Full::new(
                                    bytes::Bytes::new(),
                                ));
                                *resp.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
                                Ok::<_, hyper::Error>(resp)
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Webhook {
            addr,
            received,
            _runtime: runtime,
        }
    }

    pub fn received(&self) -> Vec<Value> {
        self.received.lock().unwrap().clone()
    }
}

/// Alertmanager with deploy/fleet/alertmanager.yml: every webhook URL
/// pointed at `hook`, and `group_wait`, `group_interval` set to 1s (the
/// shipped 30s and 5m would make a test wait minutes for the first and the
/// resolved message). Clustering off; its state in `dir`.
pub fn alertmanager(dir: &Path, hook: &Webhook) -> Proc {
    let path = repo_file("deploy/fleet/alertmanager.yml");
    let text = std::fs::read_to_string(&path).expect("read alertmanager.yml");
    let mut cfg: Value = serde_saphyr::from_str(&text).expect("parse alertmanager.yml");
    cfg["route"]["group_wait"] = "1s".into();
    cfg["route"]["group_interval"] = "1s".into();
    let mut hooks = 0;
    for r in cfg["receivers"].as_array_mut().expect("receivers") {
        for w in r["webhook_configs"].as_array_mut().into_iter().flatten() {
            let url = w["url"].as_str().expect("webhook url").to_string();
            let path = url
                .split_once("://")
                .and_then(|(_, rest)| rest.find('/').map(|i| rest[i..].to_string()))
                .unwrap_or_else(|| "/".into());
            w["url"] = format!("http://{}{path}", hook.addr).into();
            hooks += 1;
        }
    }
    assert!(hooks > 0, "alertmanager.yml has no webhook receiver");
    let file = dir.join("alertmanager.yml");
    std::fs::write(&file, cfg.to_string()).expect("write alertmanager.yml");
    Proc::start("prometheus-alertmanager", dir, "/-/ready", |addr| {
        vec![
            format!("--config.file={}", file.display()),
            format!("--storage.path={}", dir.join("am-data").display()),
            format!("--web.listen-address={addr}"),
            // No gossip port: one Alertmanager, nothing to peer with.
            "--cluster.listen-address=".to_string(),
            "--log.level=warn".to_string(),
        ]
    })
}

/// VictoriaMetrics fed by remote write (a Prometheus's: [`remote_write_to`])
/// and vmalert evaluating the shipped rules against it every `interval`
/// (every group: `prom::rules_at_global_interval`, as the Prometheus beside it),
/// its alerts sent to a receiver in the test; all stopped on drop.
pub struct VmStack {
    pub vmalert: Proc,
    pub vm: Proc,
    _notifier: Webhook,
    _dir: tempfile::TempDir,
}

impl VmStack {
    pub fn start(interval: &str) -> VmStack {
        let dir = tempfile::tempdir().expect("tempdir");
        let vm = victoria_metrics(dir.path());
        let notifier = Webhook::start();
        let vmalert = vmalert(
            dir.path(),
            super::prom::rules_at_global_interval(),
            &vm,
            &format!("http://{}", notifier.addr),
            interval,
        );
        VmStack {
            vmalert,
            vm,
            _notifier: notifier,
            _dir: dir,
        }
    }

    /// The `remote_write:` section of a Prometheus config that sends every
    /// scraped sample here as it is appended (a batch at least every
    /// 200 ms). Recorded series (a `:` in the name) and ALERTS* are not
    /// sent: those in VictoriaMetrics are vmalert's own.
    pub fn remote_write_to(&self) -> String {
        format!(
            "remote_write:
  - url: {}/api/v1/write
    queue_config: {{batch_send_deadline: 200ms}}
    write_relabel_configs:
      - source_labels: [__name__]
        regex: '.*:.*|ALERTS|ALERTS_FOR_STATE'
        action: drop
",
            self.vm.url()
        )
    }
}

impl super::prom::QueryApi for VmStack {
    fn name(&self) -> &'static str {
        "VictoriaMetrics"
    }
    fn query(&self, expr: &str) -> QueryResult {
        self.vm.query(expr, None)
    }
    fn query_at(&self, expr: &str, time: f64) -> QueryResult {
        self.vm.query(expr, Some(time))
    }
    fn rules_api(&self, path: &str) -> Value {
        self.vmalert.api(path)
    }
    fn log(&self) -> String {
        format!(
            "--- victoria-metrics:\n{}\n--- vmalert:\n{}",
            self.vm.log(),
            self.vmalert.log()
        )
    }
}
