//! Where the pod watcher finds the API server: the one place that looks
//! at `KUBECONFIG`, `~/.kube/config` and the kubelet's in-cluster
//! variables.
//!
//! Precedence (docs/configuration.md, "Kubernetes client: precedence"):
//! 1. `kube::Config::infer()`: `KUBECONFIG` (its current context), else
//!    `~/.kube/config`, else the in-cluster service account
//!    (`KUBERNETES_SERVICE_HOST`/`_PORT` and
//!    /var/run/secrets/kubernetes.io/serviceaccount).
//! 2. When nothing can be inferred: `kubernetes.api_url`, else the
//!    in-cluster URL ([`fallback`]), with no credentials but those of
//!    step 3.
//! 3. Each key set overrides its part ([`super::client`]): `api_url` the
//!    server URL, `token_file` the credentials (a bearer token read at
//!    every request, [`super::bearer`]), `ca_file` the CA bundle (re-read
//!    every minute).
//!
//! kube-rs infers at run time; at start, config asks [`discover`] whether
//! there is a cluster to infer from at all, looking where kube-rs will.

use std::path::Path;

use super::config::KubeConfig;

/// How the environment is read: `std::env::var` in the exporter, a table
/// in tests.
pub(crate) type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// What start-up sees of a cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Discovered {
    /// The in-cluster URL, in a pod ([`in_cluster_api_url`]).
    pub in_cluster_url: Option<String>,
    /// The API server is named: by `kubernetes.api_url` or, in a pod, by
    /// the kubelet's variables.
    pub named: bool,
    /// A kubeconfig is there to be read ([`kubeconfig_present`]); looked
    /// for only when nothing names the server.
    pub kubeconfig: bool,
}

impl Discovered {
    /// Whether kube-rs (or the fallback) has anything to build a client
    /// from.
    pub(crate) fn any(&self) -> bool {
        self.named || self.kubeconfig
    }
}

/// What start-up sees, `api_url` being `kubernetes.api_url` when it is set.
pub(crate) fn discover(api_url: Option<&str>, env: Env<'_>) -> Discovered {
    let in_cluster_url = in_cluster_api_url(env);
    let named = api_url.is_some() || in_cluster_url.is_some();
    Discovered {
        in_cluster_url,
        named,
        kubeconfig: !named && kubeconfig_present(env),
    }
}

/// The API server's URL in a pod: `KUBERNETES_SERVICE_HOST`/`_PORT`, as
/// the kubelet sets them; `None` outside a cluster. The one place the
/// in-cluster API is discovered.
pub(crate) fn in_cluster_api_url(env: Env<'_>) -> Option<String> {
    let host = nonempty(env("KUBERNETES_SERVICE_HOST"))?;
    let port = nonempty(env("KUBERNETES_SERVICE_PORT"))?;
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host
    };
    Some(format!("https://{host}:{port}"))
}

/// Whether a kubeconfig is there to be read, as kube-rs would look for it:
/// `KUBECONFIG`, else `$HOME/.kube/config` when that file exists.
pub(crate) fn kubeconfig_present(env: Env<'_>) -> bool {
    nonempty(env("KUBECONFIG")).is_some()
        || nonempty(env("HOME")).is_some_and(|home| Path::new(&home).join(".kube/config").is_file())
}

/// Where kube-rs looks for a kubeconfig, for the error when none works.
pub(super) fn kubeconfig_location(env: Env<'_>) -> String {
    match nonempty(env("KUBECONFIG")) {
        Some(v) => format!("KUBECONFIG={v}"),
        None => "~/.kube/config (KUBECONFIG is not set)".into(),
    }
}

/// Step 2 of the precedence, when kube-rs inferred nothing: the URL to use
/// and what named it; `None` when nothing does.
pub(super) fn fallback(cfg: &KubeConfig) -> Option<(&str, &'static str)> {
    match (&cfg.api_url, &cfg.in_cluster_url) {
        (Some(url), _) => Some((url, "kubernetes.api_url")),
        (None, Some(url)) => Some((url, "KUBERNETES_SERVICE_HOST/PORT")),
        (None, None) => None,
    }
}

fn nonempty(v: Option<String>) -> Option<String> {
    v.filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_cluster_from_env() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(key, _)| *key == k)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        type Vars = &'static [(&'static str, &'static str)];
        let cases: [(Vars, Option<&str>); 4] = [
            (
                &[
                    ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
                    ("KUBERNETES_SERVICE_PORT", "443"),
                ],
                Some("https://10.96.0.1:443"),
            ),
            (
                &[
                    ("KUBERNETES_SERVICE_HOST", "fd00::1"),
                    ("KUBERNETES_SERVICE_PORT", "6443"),
                ],
                Some("https://[fd00::1]:6443"),
            ),
            (&[], None),
            (&[("KUBERNETES_SERVICE_HOST", "10.96.0.1")], None),
        ];
        for (vars, want) in cases {
            assert_eq!(in_cluster_api_url(&env(vars)).as_deref(), want, "{vars:?}");
        }
    }

    #[test]
    fn kubeconfig_is_looked_for_as_kube_rs_does() {
        let home = tempfile::tempdir().unwrap();
        let home_path = home.path().to_str().unwrap().to_owned();
        let vars = |pairs: Vec<(&'static str, String)>| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(key, _)| *key == k)
                    .map(|(_, v)| v.clone())
            }
        };
        let kubeconfig = vars(vec![("KUBECONFIG", "/etc/k.yaml".into())]);
        assert!(kubeconfig_present(&kubeconfig));
        assert_eq!(kubeconfig_location(&kubeconfig), "KUBECONFIG=/etc/k.yaml");
        let empty = vars(vec![("KUBECONFIG", String::new())]);
        assert!(!kubeconfig_present(&empty));
        assert_eq!(
            kubeconfig_location(&empty),
            "~/.kube/config (KUBECONFIG is not set)"
        );
        let home_env = vars(vec![("HOME", home_path)]);
        assert!(!kubeconfig_present(&home_env));
        std::fs::create_dir_all(home.path().join(".kube")).unwrap();
        std::fs::write(home.path().join(".kube/config"), "apiVersion: v1\n").unwrap();
        assert!(kubeconfig_present(&home_env));
    }

    /// A named server wins over a kubeconfig, which is then not looked for.
    #[test]
    fn what_start_up_sees() {
        let in_cluster = |k: &str| match k {
            "KUBERNETES_SERVICE_HOST" => Some("10.0.0.1".to_string()),
            "KUBERNETES_SERVICE_PORT" => Some("443".to_string()),
            "KUBECONFIG" => Some("/etc/k.yaml".to_string()),
            _ => None,
        };
        let cases = [
            (
                None,
                &in_cluster as Env<'_>,
                Some("https://10.0.0.1:443"),
                true,
                false,
            ),
            (Some("https://x:1"), &|_| None, None, true, false),
            (
                None,
                &|k| (k == "KUBECONFIG").then(|| "/k".into()),
                None,
                false,
                true,
            ),
            (None, &|_| None, None, false, false),
        ];
        for (api_url, env, in_cluster_url, named, kubeconfig) in cases {
            let found = discover(api_url, env);
            let want = Discovered {
                in_cluster_url: in_cluster_url.map(str::to_owned),
                named,
                kubeconfig,
            };
            assert_eq!(found, want, "{api_url:?}");
            assert_eq!(found.any(), named || kubeconfig);
        }
    }

    #[test]
    fn fallback_order() {
        let mut cfg = KubeConfig::node("n1");
        assert_eq!(fallback(&cfg), None);
        cfg.in_cluster_url = Some("https://10.0.0.1:443".into());
        assert_eq!(
            fallback(&cfg),
            Some(("https://10.0.0.1:443", "KUBERNETES_SERVICE_HOST/PORT"))
        );
        cfg.api_url = Some("https://127.0.0.1:8443".into());
        assert_eq!(
            fallback(&cfg),
            Some(("https://127.0.0.1:8443", "kubernetes.api_url"))
        );
    }
}
