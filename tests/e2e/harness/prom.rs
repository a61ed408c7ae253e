//! A real Prometheus server for end-to-end tests: started from the
//! `prometheus` binary on a free loopback port with a temporary TSDB, asked
//! through its HTTP API, killed on drop. Plus the PromQL helpers the tests
//! need: metric names of an expression, Grafana variable substitution.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::http_get;

/// `prometheus`, or a loud failure naming the package to install. Never a
/// skip: a missing server would silently turn the test into a no-op.
pub fn prometheus_binary() -> &'static str {
    super::tools::require_tool("prometheus")
}

/// The shipped rules (deploy/prometheus/rules.yml) as a test's server
/// loads them: the same file without its groups' own `interval:` lines, so
/// every group runs at the config's global interval. A group with an
/// interval of its own (the hourly accounting tiles: 1h) first runs up to
/// that interval after the server starts (Prometheus and vmalert both wait
/// for the group's slot), far beyond a test; its expressions are the same
/// either way. Written once per test process, under Cargo's
/// CARGO_TARGET_TMPDIR (a temporary name, then renamed: two test processes
/// write the same bytes).
pub fn rules_at_global_interval() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let src = super::repo_file("deploy/prometheus/rules.yml");
        let text = std::fs::read_to_string(&src).expect("read rules.yml");
        let kept: String = text
            .lines()
            .filter(|l| !l.starts_with("    interval: "))
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(
            kept.len() < text.len(),
            "rules.yml has no group with an interval of its own: \
             rules_at_global_interval has nothing to do"
        );
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let path = dir.join("rules-at-global-interval.yml");
        let tmp = dir.join(format!(
            "rules-at-global-interval.{}.tmp",
            std::process::id()
        ));
        std::fs::write(&tmp, kept).expect("write the rules copy");
        std::fs::rename(&tmp, &path).expect("rename the rules copy");
        path
    })
}

/// A Prometheus config that scrapes and evaluates every second, loads the
/// shipped rules ([`rules_at_global_interval`]: every group every second),
/// and scrapes `groups` (each a static_configs entry: target addresses
/// and, optionally, an `instance` label) as job `gpumem-exporter`.
pub fn config_with_rules(groups: &[(&[String], Option<&str>)]) -> String {
    let groups: String = groups
        .iter()
        .map(|(targets, instance)| {
            let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
            let mut g = format!("      - targets: [{}]\n", targets.join(", "));
            if let Some(instance) = instance {
                g.push_str(&format!("        labels: {{instance: '{instance}'}}\n"));
            }
            g
        })
        .collect();
    format!(
        "global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - {}
scrape_configs:
  - job_name: gpumem-exporter
    static_configs:
{groups}",
        rules_at_global_interval().display()
    )
}

/// A port that was free a moment ago (the caller retries if it is taken).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a free port")
        .port()
}

/// A running Prometheus; killed on drop, its TSDB removed with `_dir`.
pub struct Prometheus {
    pub child: Child,
    pub addr: SocketAddr,
    _dir: tempfile::TempDir,
    pub log: Arc<Mutex<Vec<String>>>,
}

/// One answer of `/api/v1/query`.
#[derive(Debug, Clone)]
pub struct QueryResult {
    /// `success` or `error`.
    pub status: String,
    pub error: Option<String>,
    /// The series (or the one scalar) answered.
    pub result: Vec<Value>,
}

impl QueryResult {
    pub fn ok(&self) -> bool {
        self.status == "success"
    }

    /// The labels of each answered series (empty for a scalar).
    pub fn labels(&self) -> Vec<serde_json::Map<String, Value>> {
        self.result
            .iter()
            .map(|r| r["metric"].as_object().cloned().unwrap_or_default())
            .collect()
    }

    /// The value of each answered series, as Prometheus formats it.
    pub fn values(&self) -> Vec<f64> {
        self.result
            .iter()
            .filter_map(|r| r["value"][1].as_str())
            .map(|v| v.parse().unwrap_or(f64::NAN))
            .collect()
    }
}

impl Prometheus {
    /// Start with this configuration (YAML; relative paths in it resolve
    /// against the temporary directory) and wait until `/-/ready`.
    pub fn start(config: &str) -> Prometheus {
        Self::start_with(config, None, &[])
    }

    /// Like [`Prometheus::start`], on the TSDB at `tsdb` when given (e.g.
    /// blocks made by `promtool tsdb create-blocks-from`, which a server
    /// loads only at startup) and with `extra` flags.
    pub fn start_with(config: &str, tsdb: Option<&std::path::Path>, extra: &[&str]) -> Prometheus {
        let bin = prometheus_binary();
        let dir = tempfile::tempdir().expect("tempdir");
        let data = tsdb
            .map(std::path::Path::to_path_buf)
            .unwrap_or_else(|| dir.path().join("data"));
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).expect("write prometheus.yml");
        // The port is picked before the server binds it: retry if another
        // process took it in between.
        let mut last_log = String::new();
        for _ in 0..3 {
            let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            let mut child = Command::new(bin)
                .arg(format!("--config.file={}", config_path.display()))
                .arg(format!("--storage.tsdb.path={}", data.display()))
                .arg(format!("--web.listen-address={addr}"))
                .args(extra)
                .current_dir(dir.path())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn prometheus");
            let log = Arc::new(Mutex::new(Vec::new()));
            let sink = Arc::clone(&log);
            let stderr = child.stderr.take().expect("stderr");
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    sink.lock().unwrap().push(line);
                }
            });
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(30) {
                if let Some(status) = child.try_wait().expect("try_wait") {
                    // Exited: give the log thread a moment to read the end.
                    std::thread::sleep(Duration::from_millis(100));
                    last_log = format!("exit {status}\n{}", log.lock().unwrap().join("\n"));
                    break;
                }
                if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
                    && http_get(addr, "/-/ready", &[]).status == 200
                {
                    return Prometheus {
                        child,
                        addr,
                        _dir: dir,
                        log,
                    };
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
            if !last_log.contains("address already in use") {
                panic!(
                    "prometheus did not become ready at {addr}:\n{last_log}{}",
                    log.lock().unwrap().join("\n")
                );
            }
        }
        panic!("prometheus could not bind a free port:\n{last_log}")
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// GET a JSON API path.
    pub fn api(&self, path: &str) -> Value {
        let r = http_get(self.addr, path, &[]);
        serde_json::from_str(&r.body).unwrap_or_else(|e| {
            panic!(
                "GET {path}: HTTP {} and no JSON ({e}): {}\nprometheus log:\n{}",
                r.status,
                r.body,
                self.log()
            )
        })
    }

    /// An instant query, evaluated now.
    pub fn query(&self, expr: &str) -> QueryResult {
        self.query_path(&format!("/api/v1/query?query={}", urlencode(expr)))
    }

    /// An instant query evaluated at `time` (Unix seconds). A time in the
    /// future is answered from the latest samples within the lookback
    /// window (5 minutes), as if nothing changed until then.
    pub fn query_at(&self, expr: &str, time: f64) -> QueryResult {
        self.query_path(&format!(
            "/api/v1/query?query={}&time={time:.3}",
            urlencode(expr)
        ))
    }

    fn query_path(&self, path: &str) -> QueryResult {
        let v = self.api(path);
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

/// Where a test sends its PromQL and reads rule state: a [`Prometheus`]
/// (which evaluates the rules itself), or VictoriaMetrics with vmalert
/// (`fleet::VmStack`). Queries go to the query API, `rules_api` paths
/// (`/api/v1/rules`, `/api/v1/alerts`) to whoever evaluates the rules.
pub trait QueryApi {
    /// Which server answers, for messages.
    fn name(&self) -> &'static str;
    /// An instant query, evaluated now.
    fn query(&self, expr: &str) -> QueryResult;
    /// An instant query evaluated at `time` (Unix seconds).
    fn query_at(&self, expr: &str, time: f64) -> QueryResult;
    /// GET a JSON path of the rule evaluator's API.
    fn rules_api(&self, path: &str) -> Value;
    /// What the servers logged.
    fn log(&self) -> String;
    /// Number of series named `name` (0 when there is none).
    fn series_count(&self, name: &str) -> usize {
        let q = self.query(&format!("count({{__name__=\"{name}\"}})"));
        assert!(q.ok(), "{}: count of {name}: {:?}", self.name(), q.error);
        q.values().first().map(|v| *v as usize).unwrap_or(0)
    }
}

impl QueryApi for Prometheus {
    fn name(&self) -> &'static str {
        "Prometheus"
    }
    fn query(&self, expr: &str) -> QueryResult {
        Prometheus::query(self, expr)
    }
    fn query_at(&self, expr: &str, time: f64) -> QueryResult {
        Prometheus::query_at(self, expr, time)
    }
    fn rules_api(&self, path: &str) -> Value {
        self.api(path)
    }
    fn log(&self) -> String {
        Prometheus::log(self)
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percent-encoding for a query string value (RFC 3986 unreserved kept).
pub fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// PromQL words that look like metric names but are not. (A metric really
/// named like one of them would have to be written `{__name__="sum"}`.)
const KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "atan2",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "inf",
    "nan",
    // Aggregation operators: followed by `by (...)` / `without (...)`
    // rather than by their parenthesis.
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
];

/// The metric names an expression selects: identifiers outside strings,
/// label matchers, ranges and grouping lists that are neither a function
/// call nor a keyword. Enough for the rules and dashboard of this project,
/// not a PromQL parser.
pub fn metric_names(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut out = BTreeSet::new();
    let mut i = 0;
    // Set after a grouping keyword: the next parenthesised list holds label
    // names, not metrics.
    let mut label_list_next = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    if chars[i] == '\\' && c != '`' {
                        i += 1;
                    }
                    i += 1;
                }
                i += 1;
            }
            '{' | '[' => {
                let close = if c == '{' { '}' } else { ']' };
                while i < chars.len() && chars[i] != close {
                    if chars[i] == '"' {
                        i += 1;
                        while i < chars.len() && chars[i] != '"' {
                            if chars[i] == '\\' {
                                i += 1;
                            }
                            i += 1;
                        }
                    }
                    i += 1;
                }
                i += 1;
            }
            '(' if label_list_next => {
                label_list_next = false;
                while i < chars.len() && chars[i] != ')' {
                    i += 1;
                }
                i += 1;
            }
            c if c.is_ascii_digit() || c == '.' => {
                // A number or a duration (30m, 1.5e3): not a name.
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let mut j = i;
                while j < chars.len() && chars[j].is_whitespace() {
                    j += 1;
                }
                let call = chars.get(j) == Some(&'(');
                let lower = word.to_ascii_lowercase();
                if matches!(
                    lower.as_str(),
                    "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
                ) {
                    label_list_next = call;
                } else if !call && !KEYWORDS.contains(&lower.as_str()) {
                    out.insert(word);
                }
            }
            _ => i += 1,
        }
    }
    out
}

/// Grafana's interpolation of dashboard variables into a query: `$name`,
/// `${name}` and `[[name]]` replaced by the given values (longest names
/// first, so `$pod` does not eat `$pods`). The values are what Grafana
/// would write: the variable's "All" value, or an escaped regex of the
/// selected values.
pub fn grafana_substitute(expr: &str, vars: &[(&str, &str)]) -> String {
    let mut vars: Vec<&(&str, &str)> = vars.iter().collect();
    vars.sort_by_key(|(name, _)| std::cmp::Reverse(name.len()));
    let mut out = expr.to_string();
    for (name, value) in vars {
        out = out
            .replace(&format!("${{{name}}}"), value)
            .replace(&format!("[[{name}]]"), value)
            .replace(&format!("${name}"), value);
    }
    out
}

/// What Grafana's Prometheus data source writes for a multi-value variable
/// with these values inside a `=~"..."` matcher: each value regex-escaped
/// (and the backslash escaped again for the PromQL string), joined as
/// `(a|b)`; a single value stands alone.
pub fn grafana_regex(values: &[&str]) -> String {
    let escaped: Vec<String> = values
        .iter()
        .map(|v| {
            let mut s = String::new();
            for c in v.chars() {
                if "\\^$.|?*+()[]{}".contains(c) {
                    s.push_str("\\\\");
                }
                s.push(c);
            }
            s
        })
        .collect();
    if escaped.len() == 1 {
        escaped[0].clone()
    } else {
        format!("({})", escaped.join("|"))
    }
}
