//! The pod watcher's own config, built by `crate::config` (which composes
//! the top `Config` of each component's own) and read by the watcher.

use std::path::PathBuf;

/// The pod watcher: which node, and how to reach the API server. The client
/// itself comes from kube-rs's `Config::infer()` (KUBECONFIG, else
/// `~/.kube/config`, else the in-cluster service account); the `Some`
/// fields below override parts of it (see docs/configuration.md,
/// "Kubernetes client: precedence").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeConfig {
    /// The node whose pods are watched (the downward API's `spec.nodeName`).
    pub node_name: String,
    /// `kubernetes.api_url`: replaces the inferred server URL.
    pub api_url: Option<String>,
    /// The in-cluster URL (`KUBERNETES_SERVICE_HOST`/`_PORT`), used only
    /// when nothing could be inferred and `api_url` is not set.
    pub in_cluster_url: Option<String>,
    /// `kubernetes.token_file`: replaces the inferred credentials with this
    /// bearer token file (re-read every minute, so rotated tokens work).
    pub token_file: Option<PathBuf>,
    /// `kubernetes.ca_file`: replaces the inferred CA bundle (PEM).
    pub ca_file: Option<PathBuf>,
}

impl KubeConfig {
    /// A watcher of `node_name`'s pods with nothing but inferred settings.
    pub fn node(node_name: &str) -> KubeConfig {
        KubeConfig {
            node_name: node_name.to_owned(),
            api_url: None,
            in_cluster_url: None,
            token_file: None,
            ca_file: None,
        }
    }
}
