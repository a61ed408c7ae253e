//! `--web.config.file`: TLS, basic auth and connection limits of the HTTP
//! server, in the Prometheus exporter-toolkit format (plus two limits under
//! `http_server_config`). Read at start (a bad file: exit 2) and again on
//! SIGHUP (a bad file keeps the running one).
//!
//! The web config is its own file, apart from `--config.file`, so the same
//! file can be shared with other Prometheus exporters.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use rustls::DigitallySignedStruct;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ServerConfig, WebPkiClientVerifier};
use rustls::{DistinguishedName, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::config::{HumanDuration, key_path_at};

/// Web config reloads (SIGHUP) that succeeded / failed, for
/// `gpumem_exporter_web_config_reloads_total{result}`.
pub static RELOAD_SUCCESS: AtomicU64 = AtomicU64::new(0);
pub static RELOAD_FAILURE: AtomicU64 = AtomicU64::new(0);

/// Default cap on open connections; beyond it the oldest idle one is closed.
pub const DEFAULT_MAX_CONNECTIONS: usize = 2048;
/// Default time a client has to send a request's headers (TLS handshake
/// included), and the most a keep-alive connection may sit idle.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Larger web config files, certificates and keys are refused unread.
const MAX_FILE_BYTES: u64 = 1 << 20;
/// Successful (user, password) checks remembered, so a scrape does not pay
/// for bcrypt each time.
const AUTH_CACHE_ENTRIES: usize = 1024;
/// bcrypt runs at most this many at once (each takes ~50–250 ms of CPU at
/// cost 10), so a flood of wrong passwords cannot take every core.
static BCRYPT_SLOTS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// A web config error: one line naming the file, line and key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct WebConfigError(pub String);

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
struct FileTls {
    cert_file: Option<String>,
    key_file: Option<String>,
    client_ca_file: Option<String>,
    client_auth_type: Option<ClientAuth>,
    min_version: Option<TlsVersion>,
    max_version: Option<TlsVersion>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileHttp {
    /// Accepted for exporter-toolkit compatibility; only HTTP/1.1 is served.
    http2: Option<bool>,
    max_connections: Option<MaxConnections>,
    header_read_timeout: Option<HeaderTimeout>,
}

/// Go's `tls.ClientAuthType` names, as exporter-toolkit spells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum ClientAuth {
    NoClientCert,
    RequestClientCert,
    #[serde(alias = "RequireClientCert")]
    RequireAnyClientCert,
    VerifyClientCertIfGiven,
    RequireAndVerifyClientCert,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[allow(clippy::upper_case_acronyms)]
enum TlsVersion {
    TLS10,
    TLS11,
    TLS12,
    TLS13,
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
                    _ => Err(E::custom(format!(
                        "max_connections {n} out of range (1 to 1000000)"
                    ))),
                }
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<MaxConnections, E> {
                match u64::try_from(n) {
                    Ok(n) => self.visit_u64(n),
                    Err(_) => Err(E::custom(format!(
                        "max_connections {n} out of range (1 to 1000000)"
                    ))),
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
    /// Open connections at most; at the cap the oldest idle one is closed to
    /// make room, and a new one is refused only when every one is busy.
    pub max_connections: usize,
    /// Time to send a request's headers (and to finish the TLS handshake);
    /// also how long a keep-alive connection may wait for its next request.
    pub header_read_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
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
        let text = read_text(path)
            .map_err(|e| WebConfigError(format!("web config file {origin}: {e}")))?;
        let base = path.parent().unwrap_or(Path::new("."));
        parse(&text, &origin, base)
    }
}

/// Parse web config `text`; `origin` names it in errors, `base` is where
/// relative file paths start.
pub fn parse(text: &str, origin: &str, base: &Path) -> Result<WebConfig, WebConfigError> {
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
            Limits {
                max_connections: h
                    .max_connections
                    .map(|m| m.0)
                    .unwrap_or(DEFAULT_MAX_CONNECTIONS),
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
            Some(Arc::new(Users::new(
                map.iter().map(|(u, h)| (u.clone(), h.0.clone())).collect(),
            )))
        }
    };

    let (tls, client_auth) = match &file.tls_server_config {
        None => (None, None),
        Some(t) => {
            let (cfg, auth) = build_tls(t, base, &at)?;
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

fn read_text(path: &Path) -> Result<String, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read: {e}"))?;
    if !meta.is_file() {
        return Err("not a regular file".to_string());
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(format!(
            "{} bytes is larger than the {MAX_FILE_BYTES}-byte limit",
            meta.len()
        ));
    }
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read: {e}"))?;
    if let Some(offset) = bytes.iter().position(|b| *b == 0) {
        return Err(format!(
            "binary data (NUL byte at offset {offset}), expected YAML text"
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        format!(
            "not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })
}

fn parse_yaml(text: &str, origin: &str) -> Result<FileWebConfig, WebConfigError> {
    serde_saphyr::from_str::<Option<FileWebConfig>>(text)
        .map(Option::unwrap_or_default)
        .map_err(|e| {
            WebConfigError(crate::config::yaml_error(
                &e,
                text,
                &format!("web config file {origin}"),
            ))
        })
}

/// An error about `key`, with the line where it is written when found.
fn locate(text: &str, origin: &str, key: &str, msg: String) -> WebConfigError {
    let line = (1..=text.lines().count()).find(|l| key_path_at(text, *l).as_deref() == Some(key));
    match line {
        Some(l) => WebConfigError(format!(
            "web config file {origin} line {l}: key {key}: {msg}"
        )),
        None => WebConfigError(format!("web config file {origin}: key {key}: {msg}")),
    }
}

// ------------------------------------------------------------------- TLS

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn build_tls(
    t: &FileTls,
    base: &Path,
    at: &dyn Fn(&str, String) -> WebConfigError,
) -> Result<(ServerConfig, ClientAuth), WebConfigError> {
    const K: &str = "tls_server_config";
    let required = |v: &Option<String>, name: &str| -> Result<PathBuf, WebConfigError> {
        match v.as_deref() {
            Some(p) if !p.is_empty() => Ok(base.join(p)),
            _ => Err(at(K, format!("{name} is required when TLS is configured"))),
        }
    };
    let cert_path = required(&t.cert_file, "cert_file")?;
    let key_path = required(&t.key_file, "key_file")?;
    let cert_key = format!("{K}.cert_file");
    let key_key = format!("{K}.key_file");

    let certs = read_pem::<CertificateDer<'static>>(&cert_path).map_err(|e| at(&cert_key, e))?;
    if certs.is_empty() {
        return Err(at(
            &cert_key,
            format!("no certificate found in {}", cert_path.display()),
        ));
    }
    let key = read_key(&key_path).map_err(|e| at(&key_key, e))?;

    let min = t.min_version.unwrap_or(TlsVersion::TLS12);
    let max = t.max_version.unwrap_or(TlsVersion::TLS13);
    for (v, name) in [(min, "min_version"), (max, "max_version")] {
        if v < TlsVersion::TLS12 {
            return Err(at(
                &format!("{K}.{name}"),
                format!("{v:?} is not supported (TLS12 or TLS13)"),
            ));
        }
    }
    if min > max {
        return Err(at(
            &format!("{K}.min_version"),
            format!("{min:?} is above max_version {max:?}"),
        ));
    }
    let mut versions: Vec<&'static rustls::SupportedProtocolVersion> = Vec::new();
    if min <= TlsVersion::TLS12 {
        versions.push(&rustls::version::TLS12);
    }
    if max >= TlsVersion::TLS13 {
        versions.push(&rustls::version::TLS13);
    }

    let auth = t.client_auth_type.unwrap_or(ClientAuth::NoClientCert);
    let ca_key = format!("{K}.client_ca_file");
    let auth_key = format!("{K}.client_auth_type");
    let roots = match t.client_ca_file.as_deref() {
        Some(p) if !p.is_empty() => {
            let path = base.join(p);
            let cas = read_pem::<CertificateDer<'static>>(&path).map_err(|e| at(&ca_key, e))?;
            let mut roots = RootCertStore::empty();
            for ca in cas {
                roots.add(ca).map_err(|e| {
                    at(
                        &ca_key,
                        format!("invalid CA certificate in {}: {e}", path.display()),
                    )
                })?;
            }
            if roots.is_empty() {
                return Err(at(
                    &ca_key,
                    format!("no certificate found in {}", path.display()),
                ));
            }
            Some(Arc::new(roots))
        }
        _ => None,
    };
    let provider = provider();
    let verifier: Option<Arc<dyn ClientCertVerifier>> = match (auth, roots) {
        (ClientAuth::NoClientCert, Some(_)) => {
            return Err(at(
                &ca_key,
                "client_ca_file is set but client_auth_type is NoClientCert (set e.g. RequireAndVerifyClientCert)".to_string(),
            ));
        }
        (ClientAuth::NoClientCert, None) => None,
        (ClientAuth::RequestClientCert | ClientAuth::RequireAnyClientCert, _) => {
            Some(Arc::new(AnyClientCert {
                mandatory: auth == ClientAuth::RequireAnyClientCert,
                algorithms: provider.signature_verification_algorithms,
            }))
        }
        (ClientAuth::VerifyClientCertIfGiven | ClientAuth::RequireAndVerifyClientCert, None) => {
            return Err(at(&auth_key, format!("{auth:?} needs client_ca_file")));
        }
        (ClientAuth::VerifyClientCertIfGiven, Some(roots)) => Some(
            WebPkiClientVerifier::builder_with_provider(roots, Arc::clone(&provider))
                .allow_unauthenticated()
                .build()
                .map_err(|e| at(&ca_key, format!("{e}")))?,
        ),
        (ClientAuth::RequireAndVerifyClientCert, Some(roots)) => Some(
            WebPkiClientVerifier::builder_with_provider(roots, Arc::clone(&provider))
                .build()
                .map_err(|e| at(&ca_key, format!("{e}")))?,
        ),
    };

    let builder = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&versions)
        .map_err(|e| at(K, format!("{e}")))?;
    let builder = match verifier {
        Some(v) => builder.with_client_cert_verifier(v),
        None => builder.with_no_client_auth(),
    };
    let mut cfg = builder.with_single_cert(certs, key).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => at(
            &key_key,
            format!(
                "the private key in {} does not belong to the certificate in {}",
                key_path.display(),
                cert_path.display()
            ),
        ),
        e => at(
            &cert_key,
            format!(
                "cannot use {} with {}: {e}",
                cert_path.display(),
                key_path.display()
            ),
        ),
    })?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok((cfg, auth))
}

fn read_pem_bytes(path: &Path) -> Result<Vec<u8>, String> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(format!("{shown} is larger than {MAX_FILE_BYTES} bytes"));
    }
    std::fs::read(path).map_err(|e| format!("cannot read {shown}: {e}"))
}

fn read_pem<T: PemObject>(path: &Path) -> Result<Vec<T>, String> {
    let bytes = read_pem_bytes(path)?;
    T::pem_slice_iter(&bytes)
        .collect::<Result<Vec<T>, _>>()
        .map_err(|e| format!("invalid PEM in {}: {e}", path.display()))
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let bytes = read_pem_bytes(path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => {
            format!("no private key found in {}", path.display())
        }
        e => format!("invalid PEM in {}: {e}", path.display()),
    })
}

/// `RequestClientCert` / `RequireAnyClientCert`: ask for a certificate and
/// check that the client holds its key, but trust any issuer (as Go does).
#[derive(Debug)]
struct AnyClientCert {
    mandatory: bool,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ClientCertVerifier for AnyClientCert {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        self.mandatory
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

// ------------------------------------------------------------ basic auth

/// Users and their bcrypt hashes, with a cache of successful checks.
pub struct Users {
    hashes: BTreeMap<String, String>,
    /// sha256(user, password) of checks that succeeded against this file.
    ok: Mutex<HashSet<[u8; 32]>>,
}

impl Users {
    fn new(hashes: BTreeMap<String, String>) -> Users {
        Users {
            hashes,
            ok: Mutex::new(HashSet::new()),
        }
    }

    /// Whether an `Authorization` header value names a user and its
    /// password. Unknown users cost a bcrypt run too, so timing does not
    /// tell which user names exist.
    pub async fn authorize(self: &Arc<Self>, header: Option<&[u8]>) -> bool {
        let Some((user, password)) = header.and_then(parse_basic) else {
            return false;
        };
        let key = cache_key(&user, &password);
        if self.ok.lock().map(|s| s.contains(&key)).unwrap_or(false) {
            return true;
        }
        let Ok(_slot) = BCRYPT_SLOTS.acquire().await else {
            return false;
        };
        let users = Arc::clone(self);
        let checked = tokio::task::spawn_blocking(move || users.verify(&user, &password)).await;
        let ok = checked.unwrap_or(false);
        if ok && let Ok(mut set) = self.ok.lock() {
            if set.len() >= AUTH_CACHE_ENTRIES {
                set.clear();
            }
            set.insert(key);
        }
        ok
    }

    fn verify(&self, user: &str, password: &[u8]) -> bool {
        match self.hashes.get(user) {
            Some(hash) => bcrypt::verify(password, hash).unwrap_or(false),
            None => {
                // Same work as for a known user, then refuse.
                if let Some(any) = self.hashes.values().next() {
                    let _ = bcrypt::verify(password, any);
                }
                false
            }
        }
    }
}

fn cache_key(user: &str, password: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update((user.len() as u64).to_le_bytes());
    h.update(user.as_bytes());
    h.update(password);
    h.finalize().into()
}

/// `Basic base64(user:password)` → (user, password).
fn parse_basic(value: &[u8]) -> Option<(String, Vec<u8>)> {
    let value = std::str::from_utf8(value).ok()?.trim();
    let (scheme, creds) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(creds.trim())
        .ok()?;
    let colon = decoded.iter().position(|b| *b == b':')?;
    let user = String::from_utf8(decoded[..colon].to_vec()).ok()?;
    Some((user, decoded[colon + 1..].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(password: &str) -> String {
        bcrypt::hash_with_salt(password, 4, [7; 16])
            .map(|h| h.to_string())
            .unwrap_or_default()
    }

    fn err(text: &str) -> String {
        match parse(text, "w.yml", Path::new("/nonexistent")) {
            Ok(_) => panic!("accepted: {text}"),
            Err(e) => e.0,
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
                "line 2 column 20: key http_server_config.max_connections: max_connections 0 out of range",
            ),
            (
                "http_server_config:\n  max_connections: lots\n".into(),
                "line 2 column 3: key http_server_config.max_connections: invalid type: string \"lots\", expected a whole number from 1 to 1000000",
            ),
            (
                "http_server_config:\n  max_connections: -5\n".into(),
                "key http_server_config.max_connections: max_connections -5 out of range",
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
                header_read_timeout: Duration::from_secs(2)
            }
        );
        assert_eq!(c.users.map(|u| u.hashes.len()), Some(1));
    }

    #[test]
    fn basic_header_parsing() {
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let cases: [(String, Option<(&str, &str)>); 6] = [
            (format!("Basic {}", b64("alice:pw")), Some(("alice", "pw"))),
            (
                format!("basic {}", b64("alice:p:w")),
                Some(("alice", "p:w")),
            ),
            (format!("Basic {}", b64("alice:")), Some(("alice", ""))),
            (format!("Basic {}", b64("alice")), None),
            (format!("Bearer {}", b64("alice:pw")), None),
            ("Basic !!!".to_string(), None),
        ];
        for (header, want) in cases {
            let got = parse_basic(header.as_bytes());
            let got = got
                .as_ref()
                .map(|(u, p)| (u.as_str(), std::str::from_utf8(p).unwrap_or("?")));
            assert_eq!(got, want, "{header}");
        }
    }

    #[tokio::test]
    async fn right_password_passes_and_is_cached() {
        let users = Arc::new(Users::new(BTreeMap::from([(
            "alice".to_string(),
            hash("pw"),
        )])));
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let good = format!("Basic {}", b64("alice:pw"));
        assert!(users.authorize(Some(good.as_bytes())).await);
        assert_eq!(users.ok.lock().unwrap().len(), 1);
        assert!(users.authorize(Some(good.as_bytes())).await);
        for bad in ["alice:nope", "bob:pw", "alice:pw2"] {
            let h = format!("Basic {}", b64(bad));
            assert!(!users.authorize(Some(h.as_bytes())).await, "{bad}");
        }
        assert!(!users.authorize(None).await);
        assert_eq!(users.ok.lock().unwrap().len(), 1, "failures are not cached");
    }
}
