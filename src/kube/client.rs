//! The pod watcher's API client: the config [`super::discovery`] finds,
//! the keys that override it, and the response bounds of
//! [`super::limits`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::config::{AuthInfo, InferConfigError};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

use super::bearer::BearerFileLayer;
use super::config::KubeConfig;
use super::discovery;
use super::limits::{LimitLayer, OnRewatch};

/// A read stalled this long fails the request. Watches end on the server
/// after 290 s (kube-rs's default) and bookmarks arrive about every minute,
/// so only a dead connection or a hung LIST goes this long without a byte.
const READ_TIMEOUT: Duration = Duration::from_secs(295);

/// Why no client could be made.
#[derive(Debug, thiserror::Error)]
pub(super) enum ClientError {
    #[error(
        "no Kubernetes client config (kubeconfig looked for at {kubeconfig}; set KUBECONFIG, kubernetes.api_url, or run in a cluster): {source}"
    )]
    Infer {
        kubeconfig: String,
        #[source]
        source: InferConfigError,
    },
    #[error("API URL {url:?}: {source}")]
    Url {
        url: String,
        #[source]
        source: hyper::http::uri::InvalidUri,
    },
    #[error("kubernetes.ca_file {}: {source}", path.display())]
    CaFile {
        path: PathBuf,
        #[source]
        source: CaError,
    },
    #[error("{0}")]
    Token(#[source] super::bearer::TokenError),
    #[error("building the client: {0}")]
    Build(#[source] kube::Error),
}

#[derive(Debug, thiserror::Error)]
pub(super) enum CaError {
    #[error("{0}")]
    Pem(#[from] rustls_pki_types::pem::Error),
    #[error("no certificate in the file")]
    Empty,
}

/// A client, and a line saying where its settings came from.
pub(super) struct Built {
    pub(super) client: kube::Client,
    pub(super) server: String,
    pub(super) source: &'static str,
    pub(super) credentials: &'static str,
}

/// The client `cfg` asks for (see [`super::discovery`] for the precedence).
pub(super) async fn build(cfg: &KubeConfig, on_rewatch: OnRewatch) -> Result<Built, ClientError> {
    let (mut config, source) = match kube::Config::infer().await {
        Ok(c) => (c, "inferred (KUBECONFIG, ~/.kube/config or in-cluster)"),
        Err(e) => {
            let Some((url, source)) = discovery::fallback(cfg) else {
                return Err(ClientError::Infer {
                    kubeconfig: discovery::kubeconfig_location(&|k| std::env::var(k).ok()),
                    source: e,
                });
            };
            // Said, since a broken KUBECONFIG would otherwise go unnoticed.
            tracing::info!(
                error = %e,
                "nothing to infer the Kubernetes client from; using the configured API URL"
            );
            (kube::Config::new(parse_url(url)?), source)
        }
    };
    override_config(&mut config, cfg)?;
    config.read_timeout = Some(READ_TIMEOUT);
    config.reset_reader_on_write = true;
    let server = config.cluster_url.to_string();
    let credentials = match &cfg.token_file {
        Some(_) => "bearer token file (kubernetes.token_file)",
        None => credentials(&config.auth_info),
    };
    if let Some(path) = &cfg.token_file {
        // Fail now, with the key's name, rather than at every request.
        super::bearer::header(path).map_err(ClientError::Token)?;
    }
    let bearer = cfg.token_file.as_deref().map(|p| BearerFileLayer {
        path: std::sync::Arc::from(p),
    });
    let client = kube::client::ClientBuilder::try_from(config)
        .map_err(ClientError::Build)?
        .with_layer(&LimitLayer { on_rewatch })
        .with_layer(&tower::util::option_layer(bearer))
        .build();
    Ok(Built {
        client,
        server,
        source,
        credentials,
    })
}

/// Apply the keys that are set over an inferred (or bare) config.
fn override_config(config: &mut kube::Config, cfg: &KubeConfig) -> Result<(), ClientError> {
    if let Some(url) = &cfg.api_url {
        config.cluster_url = parse_url(url)?;
    }
    if cfg.token_file.is_some() {
        // The kubeconfig's user is replaced: the token is set per request
        // by the bearer layer (see `build`).
        config.auth_info = AuthInfo::default();
    }
    if let Some(path) = &cfg.ca_file {
        let ca = |source| ClientError::CaFile {
            path: path.clone(),
            source,
        };
        config.root_cert = Some(read_certificates(path).map_err(ca)?);
        config.root_cert_file = Some(path.clone());
    }
    Ok(())
}

fn parse_url(url: &str) -> Result<hyper::Uri, ClientError> {
    url.parse().map_err(|source| ClientError::Url {
        url: url.to_owned(),
        source,
    })
}

/// The DER certificates of a PEM bundle; at least one.
fn read_certificates(path: &Path) -> Result<Vec<Vec<u8>>, CaError> {
    let mut ders = Vec::new();
    for cert in CertificateDer::pem_file_iter(path)? {
        ders.push(cert?.to_vec());
    }
    if ders.is_empty() {
        return Err(CaError::Empty);
    }
    Ok(ders)
}

/// What kind of credentials a config presents, for the start-up log line.
fn credentials(auth: &AuthInfo) -> &'static str {
    if auth.client_certificate.is_some() || auth.client_certificate_data.is_some() {
        "client certificate"
    } else if auth.token_file.is_some() {
        "bearer token file"
    } else if auth.token.is_some() {
        "bearer token"
    } else if auth.exec.is_some() {
        "exec plugin"
    } else if auth.auth_provider.is_some() {
        "auth provider"
    } else if auth.username.is_some() {
        "basic auth"
    } else {
        "none"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inferred() -> kube::Config {
        let mut c = kube::Config::new("https://10.0.0.1:6443".parse().unwrap());
        c.auth_info = AuthInfo {
            client_certificate: Some("/etc/kubernetes/pki/kubelet.crt".into()),
            client_key: Some("/etc/kubernetes/pki/kubelet.key".into()),
            ..AuthInfo::default()
        };
        c.root_cert = Some(vec![vec![1, 2, 3]]);
        c
    }

    /// No key set: the inferred config is used as it is.
    #[test]
    fn nothing_set_keeps_the_inferred_config() {
        let mut c = inferred();
        override_config(&mut c, &KubeConfig::node("n1")).unwrap();
        assert_eq!(c.cluster_url.to_string(), "https://10.0.0.1:6443/");
        assert_eq!(credentials(&c.auth_info), "client certificate");
        assert_eq!(c.root_cert, Some(vec![vec![1, 2, 3]]));
        assert_eq!(c.root_cert_file, None);
    }

    /// Each key replaces its own part and nothing else.
    #[test]
    fn each_key_overrides_its_part() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        std::fs::write(&ca, cert.pem()).unwrap();

        let mut c = inferred();
        let mut cfg = KubeConfig::node("n1");
        cfg.api_url = Some("https://127.0.0.1:8443".into());
        override_config(&mut c, &cfg).unwrap();
        assert_eq!(c.cluster_url.to_string(), "https://127.0.0.1:8443/");
        assert_eq!(credentials(&c.auth_info), "client certificate");

        cfg.token_file = Some("/var/run/token".into());
        override_config(&mut c, &cfg).unwrap();
        assert_eq!(
            credentials(&c.auth_info),
            "none",
            "the kubeconfig's user is replaced"
        );
        assert_eq!(c.root_cert, Some(vec![vec![1, 2, 3]]));

        cfg.ca_file = Some(ca.clone());
        override_config(&mut c, &cfg).unwrap();
        assert_eq!(c.root_cert, Some(vec![cert.der().to_vec()]));
        assert_eq!(c.root_cert_file, Some(ca));
    }

    #[test]
    fn bad_ca_files_and_urls_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let mut cfg = KubeConfig::node("n1");
        for (path, want) in [
            (empty, "no certificate in the file"),
            (dir.path().join("missing.pem"), "missing.pem"),
        ] {
            cfg.ca_file = Some(path);
            let e = override_config(&mut inferred(), &cfg)
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("kubernetes.ca_file "), "{e}");
            assert!(e.contains(want), "{e}");
        }
        let mut cfg = KubeConfig::node("n1");
        cfg.api_url = Some("https://bad host".into());
        let e = override_config(&mut inferred(), &cfg)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("API URL \"https://bad host\""), "{e}");
    }
}
