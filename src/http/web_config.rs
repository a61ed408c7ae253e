//! `--web.config.file`: TLS, basic auth and connection limits of the HTTP
//! server, in the Prometheus exporter-toolkit format (plus three limits
//! under `http_server_config`). Read at start (a bad file: exit 2) and again on
//! SIGHUP (a bad file keeps the running one).
//!
//! The web config is its own file, apart from `--config.file`, so the same
//! file can be shared with other Prometheus exporters.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use rustls::server::ServerConfig;
use serde::Deserialize;

use super::auth::{self, Users};
use super::tls::{FileTls, MAX_FILE_BYTES, TlsError, build_tls};

pub use super::tls::ClientAuth;
use crate::config::HumanDuration;
use crate::config::yaml::{self, ReadError, YamlError};

/// Default cap on open connections; beyond it the slowest one that is not
/// being answered is closed.
pub(crate) const DEFAULT_MAX_CONNECTIONS: usize = 2048;
/// Default cap on open connections from one client address (an IPv6 /64),
/// so one client cannot fill the whole cap. Prometheus keeps one or two
/// connections per target; 256 leaves room for many clients behind one NAT.
pub(crate) const DEFAULT_MAX_CONNECTIONS_PER_IP: usize = 256;
/// Default time a client has to send a request's headers (TLS handshake
/// included), and the most a keep-alive connection may sit idle. Prometheus
/// sends its ~6 headers in one packet right after connecting, so 5 s leaves
/// a wide margin even over a slow link, and a slowloris connection is gone
/// twice as fast as with Go's customary 10 s.
pub(crate) const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// A web config error: one line naming the file, line and key.
#[derive(Debug, thiserror::Error)]
pub enum WebConfigError {
    #[error("web config file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: ReadError,
    },
    #[error("{0}")]
    Yaml(#[from] YamlError),
    #[error("web config file {origin}{}: key {key}: {reason}", line.map(|l| format!(" line {l}")).unwrap_or_default())]
    Key {
        origin: String,
        line: Option<usize>,
        key: String,
        reason: String,
    },
    #[error("web config file {origin}{}: key {}: {source}", line.map(|l| format!(" line {l}")).unwrap_or_default(), source.key())]
    Tls {
        origin: String,
        line: Option<usize>,
        /// Boxed: the largest variant by far, and rare.
        #[source]
        source: Box<TlsError>,
    },
}

// ------------------------------------------------------------ file format

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileWebConfig {
    tls_server_config: Option<FileTls>,
    basic_auth_users: Option<BTreeMap<String, BcryptHash>>,
    http_server_config: Option<FileHttp>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileHttp {
    /// Accepted for exporter-toolkit compatibility; only HTTP/1.1 is served.
    http2: Option<bool>,
    max_connections: Option<MaxConnections>,
    max_connections_per_ip: Option<MaxConnections>,
    header_read_timeout: Option<HeaderTimeout>,
}

/// A bcrypt hash (`$2a$`, `$2b$`, `$2x$` or `$2y$`), checked when read.
#[derive(Debug, Clone)]
struct BcryptHash(String);

impl<'de> Deserialize<'de> for BcryptHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match bcrypt::HashParts::from_str(&s) {
            Ok(_) => Ok(BcryptHash(s)),
            Err(e) => Err(serde::de::Error::custom(format!(
                "not a bcrypt hash ({e}); make one with e.g. `htpasswd -nBC 10 \"\" | tr -d ':\\n'`"
            ))),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct MaxConnections(usize);

impl<'de> Deserialize<'de> for MaxConnections {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = MaxConnections;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a whole number from 1 to 1000000")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<MaxConnections, E> {
                match usize::try_from(n) {
                    Ok(n) if (1..=1_000_000).contains(&n) => Ok(MaxConnections(n)),
                    _ => Err(E::custom(format!("{n} out of range (1 to 1000000)"))),
                }
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<MaxConnections, E> {
                match u64::try_from(n) {
                    Ok(n) => self.visit_u64(n),
                    Err(_) => Err(E::custom(format!("{n} out of range (1 to 1000000)"))),
                }
            }
        }
        d.deserialize_any(Visitor)
    }
}

#[derive(Debug, Clone, Copy)]
struct HeaderTimeout(Duration);

impl<'de> Deserialize<'de> for HeaderTimeout {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let d = HumanDuration::from_str(&s)
            .map_err(serde::de::Error::custom)?
            .0;
        if d < Duration::from_millis(100) || d > Duration::from_secs(3600) {
            return Err(serde::de::Error::custom(format!(
                "header_read_timeout {s:?} out of range (100ms to 1h)"
            )));
        }
        Ok(HeaderTimeout(d))
    }
}

// ------------------------------------------------------------ runtime form

/// Limits of the HTTP server; the defaults apply without a web config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Open connections at most; at the cap the slowest connection that is
    /// not being answered is closed to make room (one that never sent a
    /// whole request first, oldest first), and a new one is refused only
    /// when every one is busy.
    pub max_connections: usize,
    /// Open connections from one client address (IPv4, or IPv6 /64) at
    /// most; at this cap the same choice is made among that client's own
    /// connections, so a flood from one address only churns itself.
    /// Never above `max_connections`.
    pub max_connections_per_ip: usize,
    /// Time to send a request's headers (and to finish the TLS handshake);
    /// also how long a keep-alive connection may wait for its next request.
    pub header_read_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_ip: DEFAULT_MAX_CONNECTIONS_PER_IP,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
        }
    }
}

/// A validated web config.
#[derive(Default)]
pub struct WebConfig {
    pub tls: Option<Arc<ServerConfig>>,
    /// `None`: no authentication.
    pub users: Option<Arc<Users>>,
    pub limits: Limits,
    /// The client certificate policy, for the startup log.
    pub client_auth: Option<ClientAuth>,
}

impl fmt::Debug for WebConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WebConfig")
            .field("tls", &self.tls.is_some())
            .field("client_auth", &self.client_auth)
            .field("users", &self.users.as_ref().map(|u| u.hashes.len()))
            .field("limits", &self.limits)
            .finish()
    }
}

/// The web config file (if any) and what it held when last read well.
#[derive(Debug)]
pub struct Web {
    pub path: Option<PathBuf>,
    pub config: WebConfig,
}

impl Web {
    /// Read `path` (or take the defaults when `None`).
    pub fn load(path: Option<PathBuf>) -> Result<Web, WebConfigError> {
        let config = match &path {
            Some(p) => WebConfig::load(p)?,
            None => WebConfig::default(),
        };
        Ok(Web { path, config })
    }
}

impl WebConfig {
    /// Read and validate a web config file. Relative paths in it are
    /// relative to the file's directory, as in exporter-toolkit.
    pub fn load(path: &Path) -> Result<WebConfig, WebConfigError> {
        let origin = path.display().to_string();
        let text = read_text(path).map_err(|source| WebConfigError::Read {
            path: origin.clone(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        parse(&text, &origin, base)
    }
}

/// Parse web config `text`; `origin` names it in errors, `base` is where
/// relative file paths start.
pub(crate) fn parse(text: &str, origin: &str, base: &Path) -> Result<WebConfig, WebConfigError> {
    let file = parse_yaml(text, origin)?;
    let at = |key: &str, msg: String| locate(text, origin, key, msg);

    let limits = match &file.http_server_config {
        None => Limits::default(),
        Some(h) => {
            if h.http2 == Some(true) {
                tracing::info!(
                    "web config: http_server_config.http2 is ignored; HTTP/1.1 is served"
                );
            }
            let max_connections = h
                .max_connections
                .map(|m| m.0)
                .unwrap_or(DEFAULT_MAX_CONNECTIONS);
            let max_connections_per_ip = match h.max_connections_per_ip {
                Some(p) if p.0 > max_connections => {
                    return Err(at(
                        "http_server_config.max_connections_per_ip",
                        format!("{} is above max_connections {max_connections}", p.0),
                    ));
                }
                Some(p) => p.0,
                None => DEFAULT_MAX_CONNECTIONS_PER_IP.min(max_connections),
            };
            Limits {
                max_connections,
                max_connections_per_ip,
                header_read_timeout: h
                    .header_read_timeout
                    .map(|t| t.0)
                    .unwrap_or(DEFAULT_HEADER_READ_TIMEOUT),
            }
        }
    };

    let users = match &file.basic_auth_users {
        None => None,
        Some(map) if map.is_empty() => None,
        Some(map) => {
            for (user, hash) in map {
                if user.is_empty() || user.contains(':') {
                    return Err(at(
                        &format!("basic_auth_users.{user}"),
                        format!("user name {user:?} must be non-empty and without ':'"),
                    ));
                }
                if let Ok(parts) = bcrypt::HashParts::from_str(&hash.0)
                    && parts.get_cost() > 12
                {
                    tracing::warn!(
                        user = %user,
                        cost = parts.get_cost(),
                        "web config: bcrypt cost above 12 makes each first login slow (successful logins are cached)"
                    );
                }
            }
            let costs: Vec<u32> = map.values().map(|h| auth::cost(&h.0)).collect();
            if let (Some(lo), Some(hi)) = (costs.iter().min(), costs.iter().max())
                && lo != hi
            {
                tracing::warn!(
                    lowest = lo,
                    highest = hi,
                    "web config: basic_auth_users have different bcrypt costs; an unknown user name costs what the highest does, so a user of lower cost can be told from an unknown name by timing: give every user the same cost"
                );
            }
            Some(Arc::new(Users::new(
                map.iter().map(|(u, h)| (u.clone(), h.0.clone())).collect(),
            )))
        }
    };

    let (tls, client_auth) = match &file.tls_server_config {
        None => (None, None),
        Some(t) => {
            let (cfg, auth) = build_tls(t, base).map_err(|source| WebConfigError::Tls {
                origin: origin.to_string(),
                line: yaml::line_of_key(text, source.key()),
                source: Box::new(source),
            })?;
            (Some(Arc::new(cfg)), Some(auth))
        }
    };
    Ok(WebConfig {
        tls,
        users,
        limits,
        client_auth,
    })
}

fn read_text(path: &Path) -> Result<String, ReadError> {
    let bytes = yaml::read_limited(path, MAX_FILE_BYTES)?;
    yaml::no_nul(&bytes)?;
    yaml::utf8(bytes)
}

fn parse_yaml(text: &str, origin: &str) -> Result<FileWebConfig, WebConfigError> {
    serde_saphyr::from_str::<Option<FileWebConfig>>(text)
        .map(Option::unwrap_or_default)
        .map_err(|e| YamlError::new(&e, text, &format!("web config file {origin}")).into())
}

/// An error about `key`, with the line where it is written when found.
fn locate(text: &str, origin: &str, key: &str, reason: String) -> WebConfigError {
    WebConfigError::Key {
        origin: origin.to_string(),
        line: yaml::line_of_key(text, key),
        key: key.to_string(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::http::auth::tests::hash;

    fn err(text: &str) -> String {
        match parse(text, "w.yml", Path::new("/nonexistent")) {
            Ok(_) => panic!("accepted: {text}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn empty_file_is_no_tls_no_auth_default_limits() {
        for text in ["", "---\n", "# nothing\n"] {
            let c = parse(text, "w.yml", Path::new(".")).unwrap();
            assert!(c.tls.is_none() && c.users.is_none());
            assert_eq!(c.limits, Limits::default());
        }
    }

    /// Each bad file gives one line naming the key and where it is.
    #[test]
    fn bad_files_name_key_and_line() {
        let h = hash("pw");
        let cases: Vec<(String, &str)> = vec![
            (
                "tls_server_config:\n  cert_fil: a.pem\n".into(),
                "line 2 column 3: key tls_server_config.cert_fil: unknown field `cert_fil`",
            ),
            (
                "basic_auth: {}\n".into(),
                "line 1 column 1: key basic_auth: unknown field `basic_auth`",
            ),
            (
                "tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: Sometimes\n"
                    .into(),
                "line 4 column 21: key tls_server_config.client_auth_type: unknown variant `Sometimes`",
            ),
            (
                "tls_server_config:\n  min_version: TLS14\n".into(),
                "line 2 column 16: key tls_server_config.min_version: unknown variant `TLS14`",
            ),
            (
                "basic_auth_users:\n  alice: secret\n".into(),
                "line 2 column 10: key basic_auth_users.alice: not a bcrypt hash",
            ),
            (
                format!("basic_auth_users:\n  \"a:b\": {h}\n"),
                "key basic_auth_users.a:b: user name \"a:b\" must be non-empty",
            ),
            (
                "http_server_config:\n  max_connections: 0\n".into(),
                "line 2 column 20: key http_server_config.max_connections: 0 out of range",
            ),
            (
                "http_server_config:\n  max_connections: lots\n".into(),
                "line 2 column 3: key http_server_config.max_connections: invalid type: string \"lots\", expected a whole number from 1 to 1000000",
            ),
            (
                "http_server_config:\n  max_connections: -5\n".into(),
                "key http_server_config.max_connections: -5 out of range",
            ),
            (
                "http_server_config:\n  max_connections_per_ip: 0\n".into(),
                "line 2 column 27: key http_server_config.max_connections_per_ip: 0 out of range (1 to 1000000)",
            ),
            (
                "http_server_config:\n  max_connections: 100\n  max_connections_per_ip: 101\n".into(),
                "line 3: key http_server_config.max_connections_per_ip: 101 is above max_connections 100",
            ),
            (
                "http_server_config:\n  header_read_timeout: soon\n".into(),
                "key http_server_config.header_read_timeout: invalid duration \"soon\"",
            ),
            (
                "tls_server_config:\n  key_file: k.pem\n".into(),
                "line 1: key tls_server_config: cert_file is required",
            ),
            (
                "tls_server_config:\n  cert_file: c.pem\n  key_file: k.pem\n".into(),
                "line 2: key tls_server_config.cert_file: cannot read /nonexistent/c.pem: No such file",
            ),
        ];
        for (text, want) in cases {
            let got = err(&text);
            assert!(got.contains(want), "{text:?}\n got  {got}\n want {want}");
            assert!(got.starts_with("web config file w.yml"), "{got}");
            assert_eq!(got.lines().count(), 1, "{got}");
        }
    }

    /// A TLS error keeps its cause: the I/O error of a missing file.
    #[test]
    fn tls_errors_keep_their_source() {
        let text = "tls_server_config:\n  cert_file: c.pem\n  key_file: k.pem\n";
        let Err(e) = parse(text, "w.yml", Path::new("/nonexistent")) else {
            panic!("accepted");
        };
        let tls = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<Box<TlsError>>());
        assert!(
            matches!(tls.map(|t| &**t), Some(TlsError::Read { path, .. }) if path == Path::new("/nonexistent/c.pem")),
            "{e:?}"
        );
        let io = tls
            .and_then(|t| std::error::Error::source(&**t))
            .and_then(|s| s.downcast_ref::<std::io::Error>());
        assert_eq!(
            io.map(std::io::Error::kind),
            Some(std::io::ErrorKind::NotFound)
        );
    }

    #[test]
    fn limits_and_users_are_read() {
        let text = format!(
            "basic_auth_users:\n  alice: {}\nhttp_server_config:\n  http2: false\n  max_connections: 3000\n  header_read_timeout: 2s\n",
            hash("pw")
        );
        let c = parse(&text, "w.yml", Path::new(".")).unwrap();
        assert_eq!(
            c.limits,
            Limits {
                max_connections: 3000,
                max_connections_per_ip: DEFAULT_MAX_CONNECTIONS_PER_IP,
                header_read_timeout: Duration::from_secs(2)
            }
        );
        assert_eq!(c.users.map(|u| u.hashes.len()), Some(1));
        let limits = |text: &str| parse(text, "w.yml", Path::new(".")).unwrap().limits;
        // The per-address cap follows a smaller global cap, and can be set.
        let small = limits("http_server_config:\n  max_connections: 100\n");
        assert_eq!(
            (small.max_connections, small.max_connections_per_ip),
            (100, 100)
        );
        let set = limits("http_server_config:\n  max_connections_per_ip: 2048\n");
        assert_eq!(
            (set.max_connections, set.max_connections_per_ip),
            (2048, 2048)
        );
    }
}
