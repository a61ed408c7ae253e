//! The HTTP side: the accept loop ([`serve`]) on the listening socket
//! ([`listener`]), admission of each connection under the global and
//! per-address caps ([`admission`]), driving one connection with its header
//! limits and TLS handshake deadline ([`connection`]), routes
//! ([`routes`]), content negotiation ([`negotiate`]), the per-snapshot body
//! cache ([`cache`]), the live page and its JSON ([`page`]), the opt-in
//! `Host` check ([`host`]), the web config file ([`web_config`]) with TLS
//! ([`tls`]) and basic auth ([`auth`]). Nothing here calls NVML; a scrape is
//! a cache lookup, or one encode per new snapshot and format.

pub(crate) mod admission;
pub(crate) mod auth;
pub(crate) mod cache;
pub(crate) mod connection;
pub(crate) mod host;
pub(crate) mod listener;
pub(crate) mod negotiate;
pub(crate) mod page;
pub(crate) mod routes;
pub(crate) mod tls;
pub(crate) mod web_config;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::config::Http;
use crate::publish::Shared;
use crate::ratelimit::LogLimiter;
use crate::signals::Signals;
use crate::telemetry::Telemetry;
use admission::Conns;
use web_config::{Web, WebConfig};

/// How long in-flight scrapes may take to finish after SIGTERM/SIGINT.
pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_millis(800);

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {address} (web.listen_address): {source}")]
    Listen {
        address: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the basic-auth check threads: {0}")]
    AuthThreads(#[source] std::io::Error),
}

/// Serve HTTP(S) until SIGTERM or SIGINT; then let in-flight requests finish
/// (at most [`SHUTDOWN_GRACE`]). SIGHUP re-reads the web config file.
pub async fn serve(
    cfg: &Http,
    shared: Arc<Shared>,
    web: Web,
    telemetry: Arc<Telemetry>,
    mut signals: Signals,
) -> Result<(), ServeError> {
    let Web { path, config } = web;
    let limits = config.limits;
    let max = limits.max_connections;
    listener::raise_fd_limit(max + admission::reserve(max));
    let listen = |source| ServeError::Listen {
        address: cfg.listen_address,
        source,
    };
    let listener = listener::bind(cfg.listen_address).map_err(listen)?;
    let address = listener.local_addr().map_err(listen)?;
    tracing::info!(
        address = %address,
        path = %cfg.telemetry_path,
        tls = config.tls.is_some(),
        basic_auth = config.users.is_some(),
        allowed_hosts = ?cfg.allowed_hosts,
        max_connections = max,
        max_connections_per_ip = limits.max_connections_per_ip,
        header_read_timeout = ?limits.header_read_timeout,
        "listening"
    );
    let current = Arc::new(ArcSwap::from_pointee(config));
    let auth = routes::Auth {
        web: Arc::clone(&current),
        checks: Arc::new(auth::checks::Checks::start().map_err(ServeError::AuthThreads)?),
    };
    let hosts = Arc::new(host::AllowedHosts::new(
        cfg.allowed_hosts.clone(),
        &cfg.telemetry_path,
    ));
    // The last layer runs first: the Host check, then basic auth.
    let app = routes::router(shared, &cfg.telemetry_path)
        .layer(axum::middleware::from_fn_with_state(
            auth,
            routes::require_auth,
        ))
        .layer(axum::middleware::from_fn_with_state(
            hosts,
            host::check_host,
        ));
    let conns = Arc::new(Conns::new(limits, Arc::clone(&telemetry)));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut hangups = signals.clone();
    let mut accept_warnings = LogLimiter::every(Duration::from_secs(10));
    loop {
        tokio::select! {
            biased;
            () = signals.stopped() => break,
            () = hangups.hangup() => reload(path.as_deref(), &current, &conns, max, &telemetry),
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    // Never waits: a refused connection is dropped (counted).
                    let Some(registration) = conns.admit(peer.ip()) else {
                        continue;
                    };
                    tokio::spawn(connection::serve(
                        stream,
                        app.clone(),
                        current.load_full(),
                        registration,
                        stop_rx.clone(),
                    ));
                }
                Err(e) => {
                    use std::io::ErrorKind::{ConnectionAborted, ConnectionReset, Interrupted};
                    if matches!(e.kind(), ConnectionAborted | ConnectionReset | Interrupted) {
                        continue;
                    }
                    // Usually out of file descriptors: make room, retry soon.
                    if accept_warnings.check(()).is_some() {
                        tracing::warn!(error = %e, open = conns.open(), "cannot accept connections");
                    }
                    conns.evict_one();
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    if tokio::time::timeout(SHUTDOWN_GRACE, conns.drained())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after the shutdown grace period; closing them");
    }
    Ok(())
}

/// Re-read the web config file; a bad one keeps the running config.
fn reload(
    path: Option<&Path>,
    current: &ArcSwap<WebConfig>,
    conns: &Conns,
    max_connections: usize,
    telemetry: &Telemetry,
) {
    let Some(path) = path else {
        tracing::debug!("SIGHUP: no --web.config.file to re-read");
        return;
    };
    match WebConfig::load(path) {
        Ok(new) => {
            Telemetry::bump(&telemetry.web_config_reloads_success);
            // Logins that still hold stay cached (see auth).
            if let (Some(new_users), Some(old_users)) = (&new.users, &current.load().users) {
                new_users.inherit(old_users);
            }
            if new.limits.max_connections != max_connections {
                tracing::warn!(
                    "web config: a new http_server_config.max_connections takes effect only after a restart"
                );
            }
            conns.set_per_ip(new.limits.max_connections_per_ip);
            tracing::info!(
                tls = new.tls.is_some(),
                basic_auth = new.users.is_some(),
                "web config reloaded"
            );
            current.store(Arc::new(new));
        }
        Err(e) => {
            Telemetry::bump(&telemetry.web_config_reloads_failure);
            tracing::error!("web config reload failed, keeping the running one: {e}");
        }
    }
}
