//! TLS and mTLS for the HTTP server (rustls, ring provider), from the
//! `tls_server_config` of the web config file.

use std::path::Path;
use std::sync::Arc;

use rustls::DigitallySignedStruct;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ServerConfig, WebPkiClientVerifier};
use rustls::{DistinguishedName, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, UnixTime};

use std::path::PathBuf;

use serde::Deserialize;

/// Larger web config files, certificates and keys are refused unread.
pub(super) const MAX_FILE_BYTES: u64 = 1 << 20;

/// A TLS setting that cannot be used: the key under `tls_server_config`
/// and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("key {key}: {reason}")]
pub struct TlsError {
    pub key: String,
    pub reason: String,
}

fn at(key: &str, reason: String) -> TlsError {
    TlsError {
        key: key.to_string(),
        reason,
    }
}

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
pub(super) enum TlsVersion {
    TLS10,
    TLS11,
    TLS12,
    TLS13,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

pub(super) fn build_tls(t: &FileTls, base: &Path) -> Result<(ServerConfig, ClientAuth), TlsError> {
    const K: &str = "tls_server_config";
    let required = |v: &Option<String>, name: &str| -> Result<PathBuf, TlsError> {
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
