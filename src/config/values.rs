//! Value types of the config file and flags. Each validates while it is
//! deserialised (so a YAML error carries the line and column) and through
//! `FromStr` (so a flag gets the same check and message).

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;

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
pub(crate) struct Interval(pub Duration);

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
pub(crate) struct ListenAddress(pub SocketAddr);

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
pub(crate) struct TelemetryPath(pub String);

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

/// One entry of `web.allowed_hosts`: a host name or an IP address as a
/// client writes it in `Host` (without the port), lower-cased; an IPv6
/// address with or without its brackets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AllowedHost(pub String);

impl FromStr for AllowedHost {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bare = s.strip_prefix('[').and_then(|v| v.strip_suffix(']'));
        if let Some(v6) = bare.or(Some(s)).filter(|v| v.contains(':'))
            && let Ok(ip) = v6.parse::<std::net::Ipv6Addr>()
        {
            return Ok(AllowedHost(format!("[{ip}]")));
        }
        let name_ok = !s.is_empty()
            && s.len() <= 253
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b));
        if !name_ok {
            return Err(format!(
                "invalid allowed host {s:?} (a host name or IP address as clients write it in Host, without a port: letters, digits and -._, or an IPv6 address)"
            ));
        }
        Ok(AllowedHost(s.to_ascii_lowercase()))
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
    HumanDuration,
    Interval,
    ListenAddress,
    TelemetryPath,
    AllowedHost,
    LogLevel,
    LogFormat,
    KubeMode,
    ApiUrl,
    CmdlineLength,
    JobMappingFormat,
    SeriesModeValue
);

/// `processes.series`: `pid`, `workload` or `off` (see
/// [`crate::model::SeriesMode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SeriesModeValue(pub(crate) crate::model::SeriesMode);

impl FromStr for SeriesModeValue {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        use crate::model::SeriesMode;
        match s {
            "pid" => Ok(SeriesModeValue(SeriesMode::Pid)),
            "workload" => Ok(SeriesModeValue(SeriesMode::Workload)),
            "off" => Ok(SeriesModeValue(SeriesMode::Off)),
            _ => Err(format!("invalid value {s:?} (one of pid, workload, off)")),
        }
    }
}

/// `kubernetes.enabled`: `auto` turns the pod watcher on when running in a
/// cluster (KUBERNETES_SERVICE_HOST set) or when `api_url` is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KubeMode {
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

/// `slurm.job_mapping_format`: whose prolog wrote the job-mapping
/// directory (docs/configuration.md has both layouts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobMappingFormat {
    /// dcgm-exporter's `--hpc-job-mapping-dir`: a file per GPU index (or
    /// `<gpu>.<gpu instance>`), one job id per line.
    Dcgm,
    /// Princeton jobstats' `/run/gpustat`: a file per GPU index, GPU UUID
    /// or MIG UUID holding `<jobid> <uid>`.
    Jobstats,
}

impl FromStr for JobMappingFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "dcgm" => Ok(JobMappingFormat::Dcgm),
            "jobstats" => Ok(JobMappingFormat::Jobstats),
            _ => Err(format!(
                "invalid job mapping format {s:?} (one of dcgm, jobstats)"
            )),
        }
    }
}

/// The Kubernetes API base URL: `https://host:port` (or `http://` for a
/// local proxy), no path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ApiUrl(pub String);

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
pub(crate) struct CmdlineLength(pub usize);

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
    fn allowed_hosts() {
        for (good, want) in [
            ("gpu-node-1.example.org", "gpu-node-1.example.org"),
            ("GPU-Node", "gpu-node"),
            ("10.0.0.7", "10.0.0.7"),
            ("localhost", "localhost"),
            ("::1", "[::1]"),
            ("[2001:DB8::1]", "[2001:db8::1]"),
        ] {
            assert_eq!(
                AllowedHost::from_str(good).map(|h| h.0),
                Ok(want.to_string())
            );
        }
        for bad in [
            "",
            "node:9877",
            "http://node",
            "a b",
            "[node]",
            "node/x",
            "*",
        ] {
            assert!(AllowedHost::from_str(bad).is_err(), "{bad:?}");
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
}
