//! YAML file + command-line flags → validated [`Config`].
//!
//! The serde types (`File*`) live only here; validation turns them into the
//! runtime [`Config`] and is the one place that reports config errors. Every
//! value type validates while it is deserialised, so YAML errors carry the
//! line and column, and flags reuse the same parsers through `FromStr`.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;

/// Default listen address. 9877 is not taken by a well-known exporter
/// (node 9100, dcgm-exporter 9400, nvitop-exporter 9445,
/// nvidia_gpu_exporter 9835).
pub const DEFAULT_LISTEN: &str = ":9877";
pub const DEFAULT_TELEMETRY_PATH: &str = "/metrics";
pub const DEFAULT_SAMPLE_INTERVAL: Duration = Duration::from_secs(1);
pub const DEFAULT_MEMORY_SAMPLE_INTERVAL: Duration = Duration::from_millis(100);
pub const DEFAULT_PEAK_WINDOW: Duration = Duration::from_secs(30);
/// Larger config files are refused before parsing.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Config reloads (SIGHUP) that succeeded / failed, for
/// `gpumem_exporter_config_reloads_total{result}`.
pub static RELOAD_SUCCESS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
pub static RELOAD_FAILURE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Keys whose change needs a restart: they are read once at start (the
/// listener, the NVML library, /proc and passwd paths, the pod watcher,
/// logging).
pub fn restart_needed(old: &Config, new: &Config) -> Vec<&'static str> {
    let mut keys = Vec::new();
    let mut check = |changed: bool, key: &'static str| {
        if changed {
            keys.push(key);
        }
    };
    check(
        old.listen_address != new.listen_address,
        "web.listen_address",
    );
    check(
        old.telemetry_path != new.telemetry_path,
        "web.telemetry_path",
    );
    check(old.nvml_library != new.nvml_library, "nvml.library");
    check(old.log_level != new.log_level, "log.level");
    check(old.log_format != new.log_format, "log.format");
    check(old.procfs != new.procfs, "path.procfs");
    check(
        old.processes.cmdline != new.processes.cmdline,
        "processes.cmdline",
    );
    check(
        old.processes.passwd_file != new.processes.passwd_file,
        "processes.passwd_file",
    );
    check(
        old.processes.torch_bridge != new.processes.torch_bridge,
        "processes.torch_bridge",
    );
    check(old.kubernetes != new.kubernetes, "kubernetes");
    keys
}

/// A config error: one line that names the key and where it came from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

// ---------------------------------------------------------------- values

/// A duration written like Prometheus does: `500ms`, `2s`, `1m30s`, `1h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HumanDuration(pub Duration);

impl FromStr for HumanDuration {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("invalid duration {s:?} (use e.g. 500ms, 2s, 1m30s, 1h)");
        let t = s.trim();
        if t.is_empty() {
            return Err(bad());
        }
        let mut total: u128 = 0;
        let mut rest = t;
        while !rest.is_empty() {
            let digits = rest.bytes().take_while(|b| b.is_ascii_digit()).count();
            if digits == 0 || digits > 12 {
                return Err(bad());
            }
            let (num, tail) = rest.split_at(digits);
            let n: u128 = num.parse().map_err(|_| bad())?;
            let unit_len = tail.bytes().take_while(|b| b.is_ascii_alphabetic()).count();
            let (unit, tail) = tail.split_at(unit_len);
            let ms: u128 = match unit {
                "ms" => 1,
                "s" => 1_000,
                "m" => 60_000,
                "h" => 3_600_000,
                _ => return Err(bad()),
            };
            total = total.saturating_add(n.saturating_mul(ms));
            rest = tail;
        }
        let ms = u64::try_from(total).map_err(|_| bad())?;
        Ok(HumanDuration(Duration::from_millis(ms)))
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        if ms.is_multiple_of(1000) {
            write!(f, "{}s", ms / 1000)
        } else {
            write!(f, "{ms}ms")
        }
    }
}

/// A sampling interval: a duration between 10ms and 1h.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval(pub Duration);

impl FromStr for Interval {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let d = HumanDuration::from_str(s)?.0;
        if d < Duration::from_millis(10) || d > Duration::from_secs(3600) {
            return Err(format!(
                "interval {s:?} out of range (must be between 10ms and 1h)"
            ));
        }
        Ok(Interval(d))
    }
}

/// `host:port`, `:port` (all interfaces) or `[v6]:port`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenAddress(pub SocketAddr);

impl FromStr for ListenAddress {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let full = if s.starts_with(':') {
            format!("0.0.0.0{s}")
        } else if let Some(port) = s.strip_prefix("localhost:") {
            format!("127.0.0.1:{port}")
        } else {
            s.to_string()
        };
        full.parse::<SocketAddr>().map(ListenAddress).map_err(|_| {
            format!("invalid listen address {s:?} (use host:port, :port or [v6]:port)")
        })
    }
}

/// The path that serves metrics: absolute, not clashing with the others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TelemetryPath(pub String);

impl FromStr for TelemetryPath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let ok_chars = s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/-_.~".contains(&b));
        if !s.starts_with('/') || s.len() < 2 || !ok_chars || s.contains("//") {
            return Err(format!(
                "invalid telemetry path {s:?} (must start with / and use only letters, digits and /-_.~)"
            ));
        }
        if matches!(s, "/healthz" | "/readyz") {
            return Err(format!(
                "telemetry path {s:?} clashes with a built-in endpoint"
            ));
        }
        Ok(TelemetryPath(s.to_string()))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl FromStr for LogLevel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "error" => LogLevel::Error,
            "warn" => LogLevel::Warn,
            "info" => LogLevel::Info,
            "debug" => LogLevel::Debug,
            "trace" => LogLevel::Trace,
            _ => {
                return Err(format!(
                    "invalid log level {s:?} (one of error, warn, info, debug, trace)"
                ));
            }
        })
    }
}

impl LogLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Logfmt,
    Json,
}

impl FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "logfmt" => Ok(LogFormat::Logfmt),
            "json" => Ok(LogFormat::Json),
            _ => Err(format!("invalid log format {s:?} (one of logfmt, json)")),
        }
    }
}

/// Deserialize any `FromStr` value type from a YAML string scalar, so the
/// parser's error carries the line and column.
macro_rules! deserialize_via_from_str {
    ($($t:ty),*) => {$(
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    )*};
}
deserialize_via_from_str!(
    Interval,
    ListenAddress,
    TelemetryPath,
    LogLevel,
    LogFormat,
    KubeMode,
    ApiUrl,
    CmdlineLength
);

/// `kubernetes.enabled`: `auto` turns the pod watcher on when running in a
/// cluster (KUBERNETES_SERVICE_HOST set) or when `api_url` is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KubeMode {
    Auto,
    On,
    Off,
}

impl FromStr for KubeMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(KubeMode::Auto),
            "true" => Ok(KubeMode::On),
            "false" => Ok(KubeMode::Off),
            _ => Err(format!("invalid value {s:?} (one of auto, true, false)")),
        }
    }
}

/// The Kubernetes API base URL: `https://host:port` (or `http://` for a
/// local proxy), no path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiUrl(pub String);

impl FromStr for ApiUrl {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.is_empty() {
            // Empty: use the in-cluster address.
            return Ok(ApiUrl(String::new()));
        }
        let rest = s
            .strip_prefix("https://")
            .or_else(|| s.strip_prefix("http://"))
            .ok_or_else(|| {
                format!("invalid API URL {s:?} (must start with https:// or http://)")
            })?;
        let host = rest.trim_end_matches('/');
        if host.is_empty() || host.contains('/') || host.contains(char::is_whitespace) {
            return Err(format!(
                "invalid API URL {s:?} (use scheme://host[:port], no path)"
            ));
        }
        Ok(ApiUrl(s.trim_end_matches('/').to_string()))
    }
}

/// Maximum command-line label length: 16 .. 4096 characters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmdlineLength(pub usize);

impl FromStr for CmdlineLength {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.parse::<usize>() {
            Ok(n) if (16..=4096).contains(&n) => Ok(CmdlineLength(n)),
            _ => Err(format!(
                "invalid length {s:?} (a whole number from 16 to 4096)"
            )),
        }
    }
}

// ---------------------------------------------------------- file (serde)

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileConfig {
    web: FileWeb,
    sample_interval: Option<Interval>,
    memory_sample_interval: Option<Interval>,
    peak_window: Option<Interval>,
    nvml: FileNvml,
    log: FileLog,
    path: FilePath,
    processes: FileProcesses,
    kubernetes: FileKubernetes,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FilePath {
    procfs: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileProcesses {
    enabled: Option<bool>,
    min_bytes: Option<u64>,
    top_n: Option<u32>,
    cmdline: Option<bool>,
    cmdline_max_length: Option<CmdlineLength>,
    passwd_file: Option<String>,
    torch_bridge: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileKubernetes {
    enabled: Option<KubeMode>,
    node_name: Option<String>,
    api_url: Option<ApiUrl>,
    token_file: Option<String>,
    ca_file: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileWeb {
    listen_address: Option<ListenAddress>,
    telemetry_path: Option<TelemetryPath>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileNvml {
    library: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileLog {
    level: Option<LogLevel>,
    format: Option<LogFormat>,
}

// ------------------------------------------------------------------ flags

/// Command-line overrides, already parsed by the caller (clap). Each is
/// `None` when the flag was not given.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Overrides {
    pub listen_address: Option<String>,
    pub telemetry_path: Option<String>,
    pub sample_interval: Option<String>,
    pub memory_sample_interval: Option<String>,
    pub peak_window: Option<String>,
    pub nvml_library: Option<String>,
    pub log_level: Option<String>,
    pub log_format: Option<String>,
    pub procfs: Option<String>,
}

// ---------------------------------------------------------------- runtime

/// The validated configuration the program runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub listen_address: SocketAddr,
    pub telemetry_path: String,
    pub sample_interval: Duration,
    /// Memory-only samples between full samples, for peaks.
    pub memory_sample_interval: Duration,
    /// Peaks are the maximum over this much history.
    pub peak_window: Duration,
    /// `None`: let the dynamic loader find `libnvidia-ml.so.1`.
    pub nvml_library: Option<String>,
    pub log_level: LogLevel,
    pub log_format: LogFormat,
    /// Where /proc is (the host's, e.g. /host/proc, when mounted elsewhere).
    pub procfs: String,
    pub processes: Processes,
    /// `None`: the pod watcher is off.
    pub kubernetes: Option<Kubernetes>,
}

/// Per-process series: cardinality and privacy knobs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Processes {
    pub enabled: bool,
    pub min_bytes: u64,
    /// 0: no limit.
    pub top_n: usize,
    /// `Some(max length)` when the command line is exported.
    pub cmdline: Option<usize>,
    pub passwd_file: String,
    /// Read PyTorch allocator figures published by `gpumem_bridge`.
    pub torch_bridge: bool,
}

impl Default for Processes {
    fn default() -> Self {
        Processes {
            enabled: true,
            min_bytes: 0,
            top_n: 0,
            cmdline: None,
            passwd_file: "/etc/passwd".to_string(),
            torch_bridge: true,
        }
    }
}

/// Where and how to watch this node's pods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kubernetes {
    pub api_url: String,
    pub node_name: String,
    pub token_file: Option<PathBuf>,
    pub ca_file: Option<PathBuf>,
}

/// Default service account files, used when present.
pub const SA_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";
pub const SA_CA: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";

impl Default for Config {
    fn default() -> Self {
        Config {
            listen_address: SocketAddr::from(([0, 0, 0, 0], 9877)),
            telemetry_path: DEFAULT_TELEMETRY_PATH.to_string(),
            sample_interval: DEFAULT_SAMPLE_INTERVAL,
            memory_sample_interval: DEFAULT_MEMORY_SAMPLE_INTERVAL,
            peak_window: DEFAULT_PEAK_WINDOW,
            nvml_library: None,
            log_level: LogLevel::Info,
            log_format: LogFormat::Logfmt,
            procfs: "/proc".to_string(),
            processes: Processes::default(),
            kubernetes: None,
        }
    }
}

/// Read the config file (if any), apply flag overrides, validate.
pub fn load(
    file: Option<&Path>,
    flags: &Overrides,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, ConfigError> {
    match file {
        Some(path) => {
            let text = read_file(path)?;
            let origin = path.display().to_string();
            build(parse_yaml(&text, &origin)?, flags, env).map_err(|e| locate(e, &text, &origin))
        }
        None => build(FileConfig::default(), flags, env).map_err(|e| locate(e, "", "")),
    }
}

/// Errors found after parsing (relations between keys) name a key; add the
/// file and line where that key is written, when it is in the file.
fn locate(e: Located, text: &str, origin: &str) -> ConfigError {
    match e {
        Located::Flag(msg) => ConfigError(msg),
        Located::Key(key, msg) => {
            let line =
                (1..=text.lines().count()).find(|l| key_path_at(text, *l).as_deref() == Some(key));
            match line {
                Some(l) => ConfigError(format!("config file {origin} line {l}: key {key}: {msg}")),
                None => ConfigError(format!("config file {origin}: key {key}: {msg}")),
            }
        }
    }
}

/// An error from [`build`]: about a flag (already complete) or a key.
#[derive(Debug)]
enum Located {
    Flag(String),
    Key(&'static str, String),
}

/// Parse YAML text; `origin` names it in errors.
pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
    build(parse_yaml(text, origin)?, &Overrides::default(), &|_| None)
        .map_err(|e| locate(e, text, origin))
}

fn read_file(path: &Path) -> Result<String, ConfigError> {
    let shown = path.display();
    let meta = std::fs::metadata(path)
        .map_err(|e| ConfigError(format!("config file {shown}: cannot read: {e}")))?;
    if !meta.is_file() {
        return Err(ConfigError(format!(
            "config file {shown}: not a regular file"
        )));
    }
    if meta.len() > MAX_CONFIG_BYTES {
        return Err(ConfigError(format!(
            "config file {shown}: {} bytes is larger than the {MAX_CONFIG_BYTES}-byte limit",
            meta.len()
        )));
    }
    let bytes = std::fs::read(path)
        .map_err(|e| ConfigError(format!("config file {shown}: cannot read: {e}")))?;
    String::from_utf8(bytes).map_err(|e| {
        ConfigError(format!(
            "config file {shown}: not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

fn parse_yaml(text: &str, origin: &str) -> Result<FileConfig, ConfigError> {
    if text.contains('\0') {
        let offset = text.find('\0').unwrap_or(0);
        return Err(ConfigError(format!(
            "config file {origin}: binary data (NUL byte at offset {offset}), expected YAML text"
        )));
    }
    serde_saphyr::from_str::<Option<FileConfig>>(text)
        .map(Option::unwrap_or_default)
        .map_err(|e| ConfigError(yaml_error(&e, text, &format!("config file {origin}"))))
}

/// One line for a YAML error in a file (`what` names it, e.g. "config file
/// /etc/x.yaml"): the line, column and dotted key where the parser stopped,
/// and its message in the user's terms. Shared by every YAML file we read.
pub fn yaml_error(e: &serde_saphyr::Error, text: &str, what: &str) -> String {
    let rendered = e.to_string();
    let first = rendered.lines().next().unwrap_or("invalid YAML");
    let first = first.strip_prefix("error: ").unwrap_or(first);
    let message = plain_words(strip_position(first));
    match e.location() {
        Some(loc) => {
            let line = loc.line() as usize;
            let key = key_path_at(text, line)
                .map(|k| format!(" key {k}:"))
                .unwrap_or_default();
            format!("{what} line {line} column {}:{key} {message}", loc.column())
        }
        None => format!("{what}: {message}"),
    }
}

/// Say the parser's terse messages in the user's terms.
fn plain_words(msg: &str) -> String {
    let msg = msg
        .trim_end_matches(", set DuplicateKeyPolicy in Options if acceptable")
        .to_string();
    match msg.as_str() {
        "invalid u64" => "expected a whole number from 0 to 18446744073709551615".to_string(),
        "invalid u32" => "expected a whole number from 0 to 4294967295".to_string(),
        "invalid boolean" => "expected true or false".to_string(),
        "expected string scalar" => "expected a single value, not a list or a mapping".to_string(),
        "expected mapping start" => "expected a mapping of keys (key: value lines)".to_string(),
        _ => msg,
    }
}

/// Drop a leading "line N column M: " that the YAML parser adds.
fn strip_position(msg: &str) -> &str {
    if let Some(rest) = msg.strip_prefix("line ")
        && let Some(idx) = rest.find(": ")
        && rest[..idx].split(' ').count() == 3
        && rest[..idx].contains("column")
    {
        return &rest[idx + 2..];
    }
    msg
}

/// The dotted key path (e.g. `web.listen_address`) of the mapping entry on
/// 1-based `line`, found by indentation. Good enough for block-style YAML,
/// which is what config files use; `None` when the line holds no key.
pub fn key_path_at(text: &str, line: usize) -> Option<String> {
    let mut stack: Vec<(usize, String)> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if i + 1 > line {
            break;
        }
        let trimmed = raw.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let indent = raw.len() - trimmed.len();
        let Some(colon) = trimmed.find(':') else {
            continue;
        };
        let key = trimmed[..colon]
            .trim()
            .trim_matches(|c| c == '"' || c == '\'');
        if key.is_empty() || key.contains(' ') || key.starts_with('-') {
            continue;
        }
        while stack.last().is_some_and(|(ind, _)| *ind >= indent) {
            stack.pop();
        }
        stack.push((indent, key.to_string()));
        if i + 1 == line {
            let path: Vec<&str> = stack.iter().map(|(_, k)| k.as_str()).collect();
            return Some(path.join("."));
        }
    }
    None
}

fn flag<T: FromStr<Err = String>>(name: &str, v: &Option<String>) -> Result<Option<T>, Located> {
    v.as_deref()
        .map(|s| {
            s.parse::<T>()
                .map_err(|e| Located::Flag(format!("flag --{name}: {e}")))
        })
        .transpose()
}

fn build(
    file: FileConfig,
    o: &Overrides,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, Located> {
    let d = Config::default();
    let listen = flag::<ListenAddress>("web.listen-address", &o.listen_address)?
        .or(file.web.listen_address)
        .map(|a| a.0)
        .unwrap_or(d.listen_address);
    let path = flag::<TelemetryPath>("web.telemetry-path", &o.telemetry_path)?
        .or(file.web.telemetry_path)
        .map(|p| p.0)
        .unwrap_or(d.telemetry_path);
    let interval = flag::<Interval>("sample-interval", &o.sample_interval)?
        .or(file.sample_interval)
        .map(|i| i.0)
        .unwrap_or(d.sample_interval);
    let mem_flag = flag::<Interval>("memory-sample-interval", &o.memory_sample_interval)?;
    let mem_from_flag = mem_flag.is_some();
    let memory_interval = mem_flag
        .or(file.memory_sample_interval)
        .map(|i| i.0)
        .unwrap_or(d.memory_sample_interval)
        .min(if mem_from_flag || file.memory_sample_interval.is_some() {
            Duration::MAX
        } else {
            // Default: never slower than the full samples.
            interval
        });
    if memory_interval > interval {
        let msg = format!(
            "memory_sample_interval {} is longer than sample_interval {}; it must be shorter or equal",
            HumanDuration(memory_interval),
            HumanDuration(interval)
        );
        return Err(if mem_from_flag {
            Located::Flag(format!("flag --memory-sample-interval: {msg}"))
        } else {
            Located::Key("memory_sample_interval", msg)
        });
    }
    let window_flag = flag::<Interval>("peak-window", &o.peak_window)?;
    let window_from_flag = window_flag.is_some();
    let peak_window = window_flag
        .or(file.peak_window)
        .map(|i| i.0)
        // Default: 30s, or one sample interval when that is longer.
        .unwrap_or(d.peak_window.max(interval));
    if peak_window < interval {
        let msg = format!(
            "peak_window {} is shorter than sample_interval {}; it must be at least one sample interval (and should be at least the scrape interval)",
            HumanDuration(peak_window),
            HumanDuration(interval)
        );
        return Err(if window_from_flag {
            Located::Flag(format!("flag --peak-window: {msg}"))
        } else {
            Located::Key("peak_window", msg)
        });
    }
    let library = o
        .nvml_library
        .clone()
        .or(file.nvml.library)
        .filter(|s| !s.is_empty());
    let level = flag::<LogLevel>("log.level", &o.log_level)?
        .or(file.log.level)
        .unwrap_or(d.log_level);
    let format = flag::<LogFormat>("log.format", &o.log_format)?
        .or(file.log.format)
        .unwrap_or(d.log_format);
    Ok(Config {
        listen_address: listen,
        telemetry_path: path,
        sample_interval: interval,
        memory_sample_interval: memory_interval,
        peak_window,
        nvml_library: library,
        log_level: level,
        log_format: format,
        procfs: o
            .procfs
            .clone()
            .or(file.path.procfs)
            .filter(|p| !p.is_empty())
            .unwrap_or(d.procfs),
        processes: processes(file.processes),
        kubernetes: kubernetes(file.kubernetes, env)?,
    })
}

fn processes(f: FileProcesses) -> Processes {
    let d = Processes::default();
    Processes {
        enabled: f.enabled.unwrap_or(d.enabled),
        min_bytes: f.min_bytes.unwrap_or(d.min_bytes),
        top_n: f.top_n.map(|n| n as usize).unwrap_or(d.top_n),
        cmdline: f
            .cmdline
            .unwrap_or(false)
            .then(|| f.cmdline_max_length.map(|l| l.0).unwrap_or(256)),
        passwd_file: f
            .passwd_file
            .filter(|p| !p.is_empty())
            .unwrap_or(d.passwd_file),
        torch_bridge: f.torch_bridge.unwrap_or(d.torch_bridge),
    }
}

/// Resolve the pod watcher's settings: explicit keys first, then the
/// in-cluster environment (KUBERNETES_SERVICE_HOST/PORT, NODE_NAME).
fn kubernetes(
    f: FileKubernetes,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<Kubernetes>, Located> {
    let mode = f.enabled.unwrap_or(KubeMode::Auto);
    if mode == KubeMode::Off {
        return Ok(None);
    }
    let nonempty = |v: Option<String>| v.filter(|s| !s.is_empty());
    let api_url = f
        .api_url
        .map(|u| u.0)
        .filter(|u| !u.is_empty())
        .or_else(|| {
            let host = nonempty(env("KUBERNETES_SERVICE_HOST"))?;
            let port = nonempty(env("KUBERNETES_SERVICE_PORT"))?;
            let host = if host.contains(':') && !host.starts_with('[') {
                format!("[{host}]")
            } else {
                host
            };
            Some(format!("https://{host}:{port}"))
        });
    let Some(api_url) = api_url else {
        return if mode == KubeMode::On {
            Err(Located::Key(
                "kubernetes.enabled",
                "is true but no API is known: set kubernetes.api_url or run in a cluster (KUBERNETES_SERVICE_HOST)".into(),
            ))
        } else {
            Ok(None)
        };
    };
    let Some(node_name) = nonempty(f.node_name).or_else(|| nonempty(env("NODE_NAME"))) else {
        return Err(Located::Key(
            "kubernetes.node_name",
            "is empty and NODE_NAME is not set: the pod watcher needs this node's name (downward API spec.nodeName), or set kubernetes.enabled: false".into(),
        ));
    };
    let existing = |p: &str| Some(PathBuf::from(p)).filter(|p| p.exists());
    Ok(Some(Kubernetes {
        api_url,
        node_name,
        token_file: nonempty(f.token_file)
            .map(PathBuf::from)
            .or_else(|| existing(SA_TOKEN)),
        ca_file: nonempty(f.ca_file)
            .map(PathBuf::from)
            .or_else(|| existing(SA_CA)),
    }))
}

/// Where the config came from, for the startup log line.
pub fn describe(file: Option<&PathBuf>) -> String {
    file.map(|p| p.display().to_string())
        .unwrap_or_else(|| "defaults and flags".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        let ok = [
            ("500ms", 500),
            ("2s", 2_000),
            ("1m30s", 90_000),
            ("1h", 3_600_000),
            ("0s", 0),
        ];
        for (s, ms) in ok {
            assert_eq!(
                HumanDuration::from_str(s).unwrap().0,
                Duration::from_millis(ms),
                "{s}"
            );
        }
        for s in [
            "",
            "5",
            "5x",
            "-1s",
            "1.5s",
            "s",
            "ms",
            "1s2",
            "99999999999999999h",
            " ",
        ] {
            assert!(
                HumanDuration::from_str(s).is_err(),
                "{s:?} should be rejected"
            );
        }
    }

    #[test]
    fn intervals_have_a_range() {
        assert!(Interval::from_str("10ms").is_ok());
        assert!(Interval::from_str("5ms").is_err());
        assert!(Interval::from_str("0s").is_err());
        assert!(Interval::from_str("2h").is_err());
    }

    #[test]
    fn listen_addresses() {
        assert_eq!(ListenAddress::from_str(":9877").unwrap().0.port(), 9877);
        assert!(ListenAddress::from_str("127.0.0.1:1").is_ok());
        assert!(ListenAddress::from_str("[::1]:9877").is_ok());
        assert!(ListenAddress::from_str("localhost:9877").is_ok());
        for bad in ["", "9877", ":99999", "host", "1.2.3.4:", "a:b"] {
            assert!(ListenAddress::from_str(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn telemetry_paths() {
        assert!(TelemetryPath::from_str("/metrics").is_ok());
        assert!(TelemetryPath::from_str("/x/metrics").is_ok());
        for bad in ["metrics", "/", "/healthz", "/a b", "//x", "/a?b"] {
            assert!(TelemetryPath::from_str(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn empty_file_gives_defaults() {
        assert_eq!(parse("", "t").unwrap(), Config::default());
        assert_eq!(parse("# only a comment\n", "t").unwrap(), Config::default());
    }

    #[test]
    fn full_file() {
        let c = parse(
            "web:\n  listen_address: 127.0.0.1:9999\n  telemetry_path: /m\nsample_interval: 500ms\nnvml:\n  library: /x/libnvidia-ml.so.1\nlog:\n  level: debug\n  format: json\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.listen_address, "127.0.0.1:9999".parse().unwrap());
        assert_eq!(c.telemetry_path, "/m");
        assert_eq!(c.sample_interval, Duration::from_millis(500));
        assert_eq!(c.nvml_library.as_deref(), Some("/x/libnvidia-ml.so.1"));
        assert_eq!(c.log_level, LogLevel::Debug);
        assert_eq!(c.log_format, LogFormat::Json);
    }

    #[test]
    fn flags_override_file() {
        let file = parse_yaml("sample_interval: 2s\nlog:\n  level: debug\n", "t").unwrap();
        let o = Overrides {
            sample_interval: Some("250ms".into()),
            ..Default::default()
        };
        let c = build(file, &o, &|_| None).unwrap();
        assert_eq!(c.sample_interval, Duration::from_millis(250));
        assert_eq!(c.log_level, LogLevel::Debug);
    }

    #[test]
    fn memory_interval_defaults_follow_sample_interval() {
        let c = parse("sample_interval: 50ms\n", "t").unwrap();
        assert_eq!(c.memory_sample_interval, Duration::from_millis(50));
        let c = parse("", "t").unwrap();
        assert_eq!(c.memory_sample_interval, Duration::from_millis(100));
        assert_eq!(c.peak_window, Duration::from_secs(30));
    }

    #[test]
    fn bad_flag_names_the_flag() {
        let o = Overrides {
            sample_interval: Some("fast".into()),
            ..Default::default()
        };
        let Err(Located::Flag(e)) = build(FileConfig::default(), &o, &|_| None) else {
            panic!("expected a flag error");
        };
        assert!(
            e.starts_with("flag --sample-interval: invalid duration \"fast\""),
            "{e}"
        );
    }

    /// Each bad file gives one line naming the key and its line.
    #[test]
    fn bad_files_name_key_and_line() {
        let cases = [
            (
                "web:\n  listen_addres: x\n",
                "line 2 column 3: key web.listen_addres: unknown field `listen_addres`",
            ),
            (
                "sample_interval: 5x\n",
                "line 1 column 18: key sample_interval: invalid duration \"5x\"",
            ),
            (
                "log:\n  level: loud\n",
                "line 2 column 10: key log.level: invalid log level \"loud\"",
            ),
            (
                "log:\n  format: xml\n",
                "key log.format: invalid log format \"xml\"",
            ),
            (
                "web:\n  listen_address: nowhere\n",
                "key web.listen_address: invalid listen address \"nowhere\"",
            ),
            (
                "sample_interval: 1ms\n",
                "key sample_interval: interval \"1ms\" out of range",
            ),
            (
                "bogus: 1\n",
                "line 1 column 1: key bogus: unknown field `bogus`",
            ),
            ("web: 3\n", "line 1 column 6: key web:"),
            (
                "sample_interval: 1s\nmemory_sample_interval: 2s\n",
                "line 2: key memory_sample_interval: memory_sample_interval 2s is longer than sample_interval 1s",
            ),
            (
                "sample_interval: 10s\n\npeak_window: 5s\n",
                "line 3: key peak_window: peak_window 5s is shorter than sample_interval 10s",
            ),
        ];
        for (text, want) in cases {
            let e = parse(text, "c.yaml").unwrap_err().0;
            assert!(e.starts_with("config file c.yaml "), "{e}");
            assert!(e.contains(want), "{text:?}: got {e:?}, want {want:?}");
            assert!(!e.contains('\n'), "one line: {e:?}");
        }
    }

    #[test]
    fn kubernetes_settings() {
        let env = |k: &str| match k {
            "KUBERNETES_SERVICE_HOST" => Some("10.0.0.1".to_string()),
            "KUBERNETES_SERVICE_PORT" => Some("443".to_string()),
            "NODE_NAME" => Some("gpu-1".to_string()),
            _ => None,
        };
        let k = kubernetes(FileKubernetes::default(), &env)
            .unwrap()
            .unwrap();
        assert_eq!(k.api_url, "https://10.0.0.1:443");
        assert_eq!(k.node_name, "gpu-1");
        // auto outside a cluster: off.
        assert_eq!(
            kubernetes(FileKubernetes::default(), &|_| None).unwrap(),
            None
        );
        // explicit URL, node from the file.
        let f = parse_yaml(
            "kubernetes:\n  api_url: http://127.0.0.1:8001\n  node_name: n1\n",
            "t",
        )
        .unwrap();
        let k = kubernetes(f.kubernetes, &|_| None).unwrap().unwrap();
        assert_eq!(
            (k.api_url.as_str(), k.node_name.as_str()),
            ("http://127.0.0.1:8001", "n1")
        );
        // on, but nothing known.
        let e = parse("kubernetes:\n  enabled: true\n", "c.yaml")
            .unwrap_err()
            .0;
        assert!(
            e.contains("line 2: key kubernetes.enabled: is true but no API is known"),
            "{e}"
        );
        let e = parse("kubernetes:\n  api_url: http://x:1\n", "c.yaml")
            .unwrap_err()
            .0;
        assert!(e.contains("key kubernetes.node_name: is empty"), "{e}");
        assert_eq!(
            parse("kubernetes:\n  enabled: false\n", "c")
                .unwrap()
                .kubernetes,
            None
        );
    }

    #[test]
    fn process_knobs() {
        let c = parse(
            "processes:\n  enabled: true\n  min_bytes: 1048576\n  top_n: 10\n  cmdline: true\n  cmdline_max_length: 64\n  torch_bridge: false\n",
            "t",
        )
        .unwrap();
        assert_eq!(
            c.processes,
            Processes {
                enabled: true,
                min_bytes: 1 << 20,
                top_n: 10,
                cmdline: Some(64),
                passwd_file: "/etc/passwd".into(),
                torch_bridge: false,
            }
        );
        for (text, want) in [
            (
                "processes:\n  min_bytes: -1\n",
                "line 2 column 14: key processes.min_bytes:",
            ),
            (
                "processes:\n  top_n: many\n",
                "line 2 column 10: key processes.top_n:",
            ),
            (
                "processes:\n  cmdline: yes please\n",
                "key processes.cmdline:",
            ),
            (
                "processes:\n  cmdline_max_length: 3\n",
                "key processes.cmdline_max_length: invalid length",
            ),
            (
                "kubernetes:\n  enabled: maybe\n",
                "key kubernetes.enabled: invalid value \"maybe\"",
            ),
            (
                "kubernetes:\n  api_url: ftp://x\n",
                "key kubernetes.api_url: invalid API URL",
            ),
        ] {
            let e = parse(text, "c.yaml").unwrap_err().0;
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    /// config.example.yaml lists every key with its default.
    #[test]
    fn example_file_is_the_defaults() {
        let text = include_str!("../config.example.yaml");
        assert_eq!(
            parse(text, "config.example.yaml").unwrap(),
            Config::default()
        );
    }

    #[test]
    fn binary_is_rejected() {
        let e = parse("\0\x01\x02", "c.yaml").unwrap_err().0;
        assert!(e.contains("binary data"), "{e}");
    }

    #[test]
    fn key_paths() {
        let t = "a:\n  b: 1\n  c:\n    d: 2\ne: 3\n";
        assert_eq!(key_path_at(t, 2).as_deref(), Some("a.b"));
        assert_eq!(key_path_at(t, 4).as_deref(), Some("a.c.d"));
        assert_eq!(key_path_at(t, 5).as_deref(), Some("e"));
    }
}
