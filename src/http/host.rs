//! The opt-in `Host` check (`web.allowed_hosts`): the live page and its JSON
//! API answer only to the names they are meant to be reached by, so a web
//! page elsewhere cannot read them through a name it controls that
//! resolves to this node (DNS rebinding), and a request meant for another
//! site is not answered with this node's data. Any other `Host` (or none)
//! gets 421 Misdirected Request.
//!
//! The metrics path, `/healthz` and `/readyz` are not checked: Prometheus
//! and the kubelet's probes reach a target by its IP address, whatever the
//! list says, and a browser script cannot read them cross-origin without
//! the credentials a scrape needs anyway.

use std::str::FromStr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::http::header::HOST;
use axum::http::uri::Authority;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The names the page and API answer to, and the paths left unchecked.
#[derive(Debug)]
pub(crate) struct AllowedHosts {
    /// Lower-cased; IPv6 in brackets. Empty: no check.
    hosts: Vec<String>,
    /// The metrics path, `/healthz`, `/readyz`.
    unchecked: [String; 3],
}

impl AllowedHosts {
    pub(crate) fn new(hosts: Vec<String>, telemetry_path: &str) -> AllowedHosts {
        AllowedHosts {
            hosts,
            unchecked: [
                telemetry_path.to_string(),
                "/healthz".to_string(),
                "/readyz".to_string(),
            ],
        }
    }

    /// Whether a request for `path` with this `Host` value may be answered.
    fn allows(&self, path: &str, host: Option<&[u8]>) -> bool {
        if self.hosts.is_empty() || self.unchecked.iter().any(|p| p == path) {
            return true;
        }
        host.and_then(host_name)
            .is_some_and(|name| self.hosts.contains(&name))
    }
}

/// The host of a `Host` value, lower-cased, without its port; an IPv6
/// address in brackets, as written.
fn host_name(value: &[u8]) -> Option<String> {
    let value = std::str::from_utf8(value).ok()?.trim();
    // The authority parser takes host[:port] and [v6][:port], and refuses
    // paths; user info it takes, so that is refused here.
    let authority = Authority::from_str(value).ok()?;
    if authority.as_str().contains('@') {
        return None;
    }
    let host = authority.host().to_ascii_lowercase();
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6
            .parse::<std::net::Ipv6Addr>()
            .ok()
            .map(|ip| format!("[{ip}]")),
        None => Some(host.trim_end_matches('.').to_string()),
    }
}

/// The check as a middleware (before basic auth: a misdirected request
/// costs no password check).
pub(crate) async fn check_host(
    State(allowed): State<Arc<AllowedHosts>>,
    req: Request,
    next: Next,
) -> Response {
    let host = req.headers().get(HOST).map(|v| v.as_bytes());
    if allowed.allows(req.uri().path(), host) {
        return next.run(req).await;
    }
    (
        StatusCode::MISDIRECTED_REQUEST,
        "this server does not answer to that Host (web.allowed_hosts)\n",
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_values() {
        for (value, want) in [
            ("Node-1.example.org:9877", Some("node-1.example.org")),
            ("node-1.example.org.", Some("node-1.example.org")),
            ("10.0.0.7", Some("10.0.0.7")),
            ("[2001:DB8::1]:9877", Some("[2001:db8::1]")),
            ("user@node", None),
            ("node/x", None),
            ("", None),
        ] {
            assert_eq!(host_name(value.as_bytes()).as_deref(), want, "{value:?}");
        }
    }

    #[test]
    fn only_the_page_and_api_are_checked() {
        let a = AllowedHosts::new(vec!["node-1".into(), "[::1]".into()], "/metrics");
        assert!(a.allows("/", Some(b"node-1:9877")));
        assert!(a.allows("/api/v1/snapshot", Some(b"[::1]:9877")));
        assert!(!a.allows("/", Some(b"evil.example:9877")));
        assert!(!a.allows("/api/v1/history", None));
        assert!(!a.allows("/nope", Some(b"evil.example")));
        for path in ["/metrics", "/healthz", "/readyz"] {
            assert!(a.allows(path, Some(b"evil.example")), "{path}");
        }
        let off = AllowedHosts::new(Vec::new(), "/metrics");
        assert!(off.allows("/", Some(b"anything")));
    }
}
