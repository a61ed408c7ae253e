//! TLS and mTLS for the HTTP server (rustls, ring provider), from the
//! `tls_server_config` of the web config file. A setting that cannot be
//! used is a [`TlsError`] (its cause kept as its source); `web_config.rs`
//! adds the file and line.

use std::path::Path;
use std::sync::Arc;

use rustls::DigitallySignedStruct;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ServerConfig, VerifierBuilderError, WebPkiClientVerifier};
use rustls::{DistinguishedName, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::{self, PemObject};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, UnixTime};

use std::path::PathBuf;

use serde::Deserialize;

/// Larger web config files, certificates and keys are refused unread.
pub(super) const MAX_FILE_BYTES: u64 = 1 << 20;

/// One of the files `tls_server_config` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsFile {
    Cert,
    Key,
    ClientCa,
}

impl TlsFile {
    /// The key that names the file.
    pub fn key(self) -> &'static str {
        match self {
            TlsFile::Cert => "tls_server_config.cert_file",
            TlsFile::Key => "tls_server_config.key_file",
            TlsFile::ClientCa => "tls_server_config.client_ca_file",
        }
    }
}

/// `min_version` or `max_version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    Min,
    Max,
}

impl Bound {
    /// The key that sets the bound.
    pub fn key(self) -> &'static str {
        match self {
            Bound::Min => "tls_server_config.min_version",
            Bound::Max => "tls_server_config.max_version",
        }
    }
}

/// A TLS setting that cannot be used: one variant per failure, each under
/// the key of `tls_server_config` it is about ([`TlsError::key`]).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{name} is required when TLS is configured")]
    Required { name: &'static str },
    #[error("cannot read {}: {source}", path.display())]
    Read {
        file: TlsFile,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is larger than {MAX_FILE_BYTES} bytes", path.display())]
    TooLarge { file: TlsFile, path: PathBuf },
    #[error("invalid PEM in {}: {source}", path.display())]
    Pem {
        file: TlsFile,
        path: PathBuf,
        #[source]
        source: pem::Error,
    },
    #[error("no certificate found in {}", path.display())]
    NoCertificate { file: TlsFile, path: PathBuf },
    #[error("no private key found in {}", path.display())]
    NoKey { path: PathBuf },
    #[error("{version:?} is not supported (TLS12 or TLS13)")]
    UnsupportedVersion { bound: Bound, version: TlsVersion },
    #[error("{min:?} is above max_version {max:?}")]
    VersionsReversed { min: TlsVersion, max: TlsVersion },
    #[error("invalid CA certificate in {}: {source}", path.display())]
    InvalidCa {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error(
        "client_ca_file is set but client_auth_type is NoClientCert (set e.g. RequireAndVerifyClientCert)"
    )]
    CaWithoutClientAuth,
    #[error("{auth:?} needs client_ca_file")]
    NeedsClientCa { auth: ClientAuth },
    #[error("{source}")]
    Verifier {
        #[source]
        source: VerifierBuilderError,
    },
    #[error("{source}")]
    Versions {
        #[source]
        source: rustls::Error,
    },
    #[error(
        "the private key in {} does not belong to the certificate in {}",
        key.display(),
        cert.display()
    )]
    KeyMismatch {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("cannot use {} with {}: {source}", cert.display(), key.display())]
    Certificate {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
}

impl TlsError {
    /// The key under which the failure is reported (and its line found).
    pub fn key(&self) -> &'static str {
        match self {
            TlsError::Required { .. } | TlsError::Versions { .. } => K,
            TlsError::Read { file, .. }
            | TlsError::TooLarge { file, .. }
            | TlsError::Pem { file, .. }
            | TlsError::NoCertificate { file, .. } => file.key(),
            TlsError::NoKey { .. } | TlsError::KeyMismatch { .. } => TlsFile::Key.key(),
            TlsError::Certificate { .. } => TlsFile::Cert.key(),
            TlsError::UnsupportedVersion { bound, .. } => bound.key(),
            TlsError::VersionsReversed { .. } => Bound::Min.key(),
            TlsError::InvalidCa { .. }
            | TlsError::CaWithoutClientAuth
            | TlsError::Verifier { .. } => TlsFile::ClientCa.key(),
            TlsError::NeedsClientCa { .. } => "tls_server_config.client_auth_type",
        }
    }
}

/// The web config key everything here is under.
const K: &str = "tls_server_config";

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileTls {
    pub(super) cert_file: Option<String>,
    pub(super) key_file: Option<String>,
    pub(super) client_ca_file: Option<String>,
    pub(super) client_auth_type: Option<ClientAuth>,
    pub(super) min_version: Option<TlsVersion>,
    pub(super) max_version: Option<TlsVersion>,
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
pub enum TlsVersion {
    TLS10,
    TLS11,
    TLS12,
    TLS13,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The rustls server config `tls_server_config` describes, and its client
/// auth type; checked in the order the settings are read (identity,
/// versions, client CA, client auth), so the first unusable one is the
/// error.
pub(super) fn build_tls(t: &FileTls, base: &Path) -> Result<(ServerConfig, ClientAuth), TlsError> {
    let identity = Identity::read(t, base)?;
    let versions = protocol_versions(t)?;
    let auth = t.client_auth_type.unwrap_or(ClientAuth::NoClientCert);
    let roots = client_roots(t, base)?;
    let provider = provider();
    let verifier = client_verifier(auth, roots, &provider)?;

    let builder = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&versions)
        .map_err(|source| TlsError::Versions { source })?;
    let builder = match verifier {
        Some(v) => builder.with_client_cert_verifier(v),
        None => builder.with_no_client_auth(),
    };
    let mut cfg = identity.install(builder)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok((cfg, auth))
}

/// The server's certificate chain and key, with the paths they came from
/// (the errors name them).
struct Identity {
    cert_path: PathBuf,
    key_path: PathBuf,
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl Identity {
    /// `cert_file` and `key_file` are required; the certificate file must
    /// hold at least one certificate.
    fn read(t: &FileTls, base: &Path) -> Result<Identity, TlsError> {
        let required = |v: &Option<String>, name: &'static str| -> Result<PathBuf, TlsError> {
            match v.as_deref() {
                Some(p) if !p.is_empty() => Ok(base.join(p)),
                _ => Err(TlsError::Required { name }),
            }
        };
        let cert_path = required(&t.cert_file, "cert_file")?;
        let key_path = required(&t.key_file, "key_file")?;

        let certs = read_pem::<CertificateDer<'static>>(TlsFile::Cert, &cert_path)?;
        if certs.is_empty() {
            return Err(TlsError::NoCertificate {
                file: TlsFile::Cert,
                path: cert_path,
            });
        }
        let key = read_key(&key_path)?;
        Ok(Identity {
            cert_path,
            key_path,
            certs,
            key,
        })
    }

    /// The last step of the builder: rustls checks here that the key is
    /// the certificate's, which is said apart from any other refusal.
    fn install(
        self,
        builder: rustls::ConfigBuilder<ServerConfig, rustls::server::WantsServerCert>,
    ) -> Result<ServerConfig, TlsError> {
        match builder.with_single_cert(self.certs, self.key) {
            Ok(cfg) => Ok(cfg),
            Err(source @ rustls::Error::InconsistentKeys(_)) => Err(TlsError::KeyMismatch {
                cert: self.cert_path,
                key: self.key_path,
                source,
            }),
            Err(source) => Err(TlsError::Certificate {
                cert: self.cert_path,
                key: self.key_path,
                source,
            }),
        }
    }
}

/// `min_version` ..= `max_version` (TLS 1.2 and 1.3 by default) as rustls'
/// versions: rustls has nothing older than TLS 1.2, so an older bound is
/// an error rather than a silent raise.
fn protocol_versions(
    t: &FileTls,
) -> Result<Vec<&'static rustls::SupportedProtocolVersion>, TlsError> {
    let min = t.min_version.unwrap_or(TlsVersion::TLS12);
    let max = t.max_version.unwrap_or(TlsVersion::TLS13);
    for (version, bound) in [(min, Bound::Min), (max, Bound::Max)] {
        if version < TlsVersion::TLS12 {
            return Err(TlsError::UnsupportedVersion { bound, version });
        }
    }
    if min > max {
        return Err(TlsError::VersionsReversed { min, max });
    }
    let mut versions: Vec<&'static rustls::SupportedProtocolVersion> = Vec::new();
    if min <= TlsVersion::TLS12 {
        versions.push(&rustls::version::TLS12);
    }
    if max >= TlsVersion::TLS13 {
        versions.push(&rustls::version::TLS13);
    }
    Ok(versions)
}

/// The CAs of `client_ca_file`, when it is set: every certificate in it
/// must be a usable CA, and there must be at least one.
fn client_roots(t: &FileTls, base: &Path) -> Result<Option<Arc<RootCertStore>>, TlsError> {
    let Some(p) = t.client_ca_file.as_deref().filter(|p| !p.is_empty()) else {
        return Ok(None);
    };
    let path = base.join(p);
    let cas = read_pem::<CertificateDer<'static>>(TlsFile::ClientCa, &path)?;
    let mut roots = RootCertStore::empty();
    for ca in cas {
        if let Err(source) = roots.add(ca) {
            return Err(TlsError::InvalidCa { path, source });
        }
    }
    if roots.is_empty() {
        return Err(TlsError::NoCertificate {
            file: TlsFile::ClientCa,
            path,
        });
    }
    Ok(Some(Arc::new(roots)))
}

/// How client certificates are asked for and checked, as Go's
/// `tls.ClientAuthType` does it: a CA without a type that verifies, or a
/// verifying type without a CA, is a mistake in the file, not a default.
fn client_verifier(
    auth: ClientAuth,
    roots: Option<Arc<RootCertStore>>,
    provider: &Arc<CryptoProvider>,
) -> Result<Option<Arc<dyn ClientCertVerifier>>, TlsError> {
    let verifier_error = |source| TlsError::Verifier { source };
    Ok(match (auth, roots) {
        (ClientAuth::NoClientCert, Some(_)) => return Err(TlsError::CaWithoutClientAuth),
        (ClientAuth::NoClientCert, None) => None,
        (ClientAuth::RequestClientCert | ClientAuth::RequireAnyClientCert, _) => {
            Some(Arc::new(AnyClientCert {
                mandatory: auth == ClientAuth::RequireAnyClientCert,
                algorithms: provider.signature_verification_algorithms,
            }))
        }
        (ClientAuth::VerifyClientCertIfGiven | ClientAuth::RequireAndVerifyClientCert, None) => {
            return Err(TlsError::NeedsClientCa { auth });
        }
        (ClientAuth::VerifyClientCertIfGiven, Some(roots)) => Some(
            WebPkiClientVerifier::builder_with_provider(roots, Arc::clone(provider))
                .allow_unauthenticated()
                .build()
                .map_err(verifier_error)?,
        ),
        (ClientAuth::RequireAndVerifyClientCert, Some(roots)) => Some(
            WebPkiClientVerifier::builder_with_provider(roots, Arc::clone(provider))
                .build()
                .map_err(verifier_error)?,
        ),
    })
}

fn read_pem_bytes(file: TlsFile, path: &Path) -> Result<Vec<u8>, TlsError> {
    let unreadable = |source| TlsError::Read {
        file,
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(unreadable)?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(TlsError::TooLarge {
            file,
            path: path.to_path_buf(),
        });
    }
    std::fs::read(path).map_err(unreadable)
}

fn read_pem<T: PemObject>(file: TlsFile, path: &Path) -> Result<Vec<T>, TlsError> {
    let bytes = read_pem_bytes(file, path)?;
    T::pem_slice_iter(&bytes)
        .collect::<Result<Vec<T>, _>>()
        .map_err(|source| TlsError::Pem {
            file,
            path: path.to_path_buf(),
            source,
        })
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read_pem_bytes(TlsFile::Key, path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| match e {
        pem::Error::NoItemsFound => TlsError::NoKey {
            path: path.to_path_buf(),
        },
        source => TlsError::Pem {
            file: TlsFile::Key,
            path: path.to_path_buf(),
            source,
        },
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
