//! HTTP: `/metrics` (or the configured path), `/healthz`, `/readyz`, `/`.
//! Handlers only read the published snapshot; none of them calls NVML.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use axum::Router;
use axum::extract::{Request, State};
use axum::http::header::{
    ACCEPT, ACCEPT_ENCODING, AUTHORIZATION, CONTENT_ENCODING, CONTENT_TYPE, VARY, WWW_AUTHENTICATE,
};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};

use crate::config::Config;
use crate::metrics::{Format, accepts_gzip};
use crate::sampler::Shared;
use crate::web::{self, Limits, Web, WebConfig};

#[derive(Clone)]
struct App {
    shared: Arc<Shared>,
    telemetry_path: Arc<str>,
}

pub fn router(shared: Arc<Shared>, telemetry_path: &str) -> Router {
    let app = App {
        shared,
        telemetry_path: Arc::from(telemetry_path),
    };
    Router::new()
        .route(telemetry_path, get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/", get(landing))
        .fallback(not_found)
        .with_state(app)
}

async fn metrics(State(app): State<App>, headers: HeaderMap) -> Response {
    let Some(published) = app.shared.latest() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "no GPU sample taken yet\n").into_response();
    };
    let format = Format::negotiate(headers.get(ACCEPT).and_then(|v| v.to_str().ok()));
    let gzip = accepts_gzip(headers.get(ACCEPT_ENCODING).and_then(|v| v.to_str().ok()));
    let Some(body) = published.body(format, gzip) else {
        return (StatusCode::INTERNAL_SERVER_ERROR, "encoding failed\n").into_response();
    };
    let mut response = (
        [
            (CONTENT_TYPE, format.content_type()),
            (VARY, "Accept, Accept-Encoding"),
        ],
        body,
    )
        .into_response();
    if gzip {
        response
            .headers_mut()
            .insert(CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    response
}

async fn healthz(State(app): State<App>) -> Response {
    match app.shared.healthy(SystemTime::now()) {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("unhealthy: {why}\n"),
        )
            .into_response(),
    }
}

async fn readyz(State(app): State<App>) -> Response {
    match app.shared.ready() {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        )
            .into_response(),
    }
}

async fn landing(State(app): State<App>) -> Html<String> {
    let p = &app.telemetry_path;
    Html(format!(
        "<!doctype html>\n<html><head><title>gpumem-exporter</title></head><body>\n\
         <h1>gpumem-exporter {}</h1>\n<p>GPU memory per GPU and per process, from NVML.</p>\n<ul>\n\
         <li><a href=\"{p}\">{p}</a> metrics</li>\n\
         <li><a href=\"/healthz\">/healthz</a> liveness</li>\n\
         <li><a href=\"/readyz\">/readyz</a> readiness</li>\n</ul>\n</body></html>\n",
        crate::metrics::VERSION
    ))
}

async fn not_found() -> (StatusCode, &'static str) {
    (StatusCode::NOT_FOUND, "not found\n")
}

// ------------------------------------------------------------ serving
//
// A hand-written accept loop instead of `axum::serve`, for what that lacks:
// a cap on open connections (the oldest idle one makes room, so idle or
// slowloris clients cannot starve a scraper), header count/size limits, a
// deadline for headers and the TLS handshake, TLS and basic auth from
// `--web.config.file`, and SIGHUP reloads of that file.

/// How long in-flight scrapes may take to finish after SIGTERM/SIGINT.
pub const SHUTDOWN_GRACE: Duration = Duration::from_millis(800);
/// Request headers allowed at most (Prometheus sends about 6).
pub const MAX_HEADERS: usize = 64;
/// Bytes of request line and headers allowed at most; more is a 431.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
/// Pending connections the kernel may queue (capped by `net.core.somaxconn`).
const LISTEN_BACKLOG: u32 = 4096;
/// At the cap, how long a new connection waits for an evicted one to close.
const ADMIT_WAIT: Duration = Duration::from_millis(500);

/// Open connections now.
pub static CONNECTIONS_OPEN: AtomicU64 = AtomicU64::new(0);
/// Idle connections closed to make room for a new one at the cap.
pub static CONNECTIONS_EVICTED: AtomicU64 = AtomicU64::new(0);
/// Connections closed at once: the cap was reached and every connection
/// was busy with a request.
pub static CONNECTIONS_REFUSED: AtomicU64 = AtomicU64::new(0);

const PLAIN_HTTP_REFUSED: &[u8] = b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\nContent-Length: 48\r\n\r\nClient sent an HTTP request to an HTTPS server.\n";
const UNAUTHORIZED: &str = "Basic realm=\"gpumem-exporter\", charset=\"UTF-8\"";

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {address} (web.listen_address): {source}")]
    Listen {
        address: SocketAddr,
        source: std::io::Error,
    },
}

/// Serve HTTP(S) until SIGTERM or SIGINT; then let in-flight requests finish
/// (at most [`SHUTDOWN_GRACE`]). SIGHUP re-reads the web config file.
pub async fn serve(cfg: Config, shared: Arc<Shared>, web: Web) -> Result<(), ServeError> {
    // Install the signal handlers before announcing the listener, so a
    // signal that arrives right after startup is handled too.
    let (mut stop, mut hangup) = Signals::install();
    let Web { path, config } = web;
    let max = config.limits.max_connections;
    raise_fd_limit(max);
    let listen = |source| ServeError::Listen {
        address: cfg.listen_address,
        source,
    };
    let listener = bind(cfg.listen_address).map_err(listen)?;
    let address = listener.local_addr().map_err(listen)?;
    tracing::info!(
        address = %address,
        path = %cfg.telemetry_path,
        tls = config.tls.is_some(),
        basic_auth = config.users.is_some(),
        max_connections = max,
        "listening"
    );
    let current = Arc::new(ArcSwap::from_pointee(config));
    let app = router(shared, &cfg.telemetry_path).layer(axum::middleware::from_fn_with_state(
        Arc::clone(&current),
        require_auth,
    ));
    let conns = Arc::new(Conns::new(max));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut accept_warned: Option<Instant> = None;
    loop {
        tokio::select! {
            biased;
            () = stop.recv() => break,
            () = hangup.recv() => reload(path.as_deref(), &current, max),
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    let Some(permit) = conns.admit().await else {
                        CONNECTIONS_REFUSED.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!("connection refused: {max} connections open, all busy");
                        continue;
                    };
                    let registration = conns.register();
                    tokio::spawn(connection(
                        stream,
                        app.clone(),
                        current.load_full(),
                        registration,
                        stop_rx.clone(),
                        permit,
                    ));
                }
                Err(e) => {
                    use std::io::ErrorKind::{ConnectionAborted, ConnectionReset, Interrupted};
                    if matches!(e.kind(), ConnectionAborted | ConnectionReset | Interrupted) {
                        continue;
                    }
                    // Usually out of file descriptors: make room, retry soon.
                    if accept_warned.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                        tracing::warn!(error = %e, open = CONNECTIONS_OPEN.load(Ordering::Relaxed), "cannot accept connections");
                        accept_warned = Some(Instant::now());
                    }
                    conns.evict_oldest_idle();
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    // Every connection holds a slot; all slots back means all are closed.
    let drained = conns
        .slots
        .acquire_many(u32::try_from(max).unwrap_or(u32::MAX));
    if tokio::time::timeout(SHUTDOWN_GRACE, drained).await.is_err() {
        tracing::warn!("connections still open after the shutdown grace period; closing them");
    }
    Ok(())
}

/// Listen with a backlog as deep as the kernel allows (`somaxconn`, as Go
/// does), so a burst of connections waits in the queue rather than in SYN
/// retransmits.
fn bind(address: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if address.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(address)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Basic auth, when the web config lists users; every path is covered.
async fn require_auth(
    State(web): State<Arc<ArcSwap<WebConfig>>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(users) = web.load().users.clone() else {
        return next.run(req).await;
    };
    let header = req.headers().get(AUTHORIZATION).map(HeaderValue::as_bytes);
    if users.authorize(header).await {
        return next.run(req).await;
    }
    (
        StatusCode::UNAUTHORIZED,
        [(WWW_AUTHENTICATE, UNAUTHORIZED)],
        "unauthorized\n",
    )
        .into_response()
}

/// Re-read the web config file; a bad one keeps the running config.
fn reload(path: Option<&Path>, current: &ArcSwap<WebConfig>, max_connections: usize) {
    let Some(path) = path else {
        tracing::debug!("SIGHUP: no --web.config.file to re-read");
        return;
    };
    match WebConfig::load(path) {
        Ok(new) => {
            web::RELOAD_SUCCESS.fetch_add(1, Ordering::Relaxed);
            if new.limits.max_connections != max_connections {
                tracing::warn!(
                    "web config: a new http_server_config.max_connections takes effect only after a restart"
                );
            }
            tracing::info!(
                tls = new.tls.is_some(),
                basic_auth = new.users.is_some(),
                "web config reloaded"
            );
            current.store(Arc::new(new));
        }
        Err(e) => {
            web::RELOAD_FAILURE.fetch_add(1, Ordering::Relaxed);
            tracing::error!("web config reload failed, keeping the running one: {e}");
        }
    }
}

/// One connection: optional TLS handshake, then HTTP/1.1 until the client
/// leaves, a deadline passes, it is evicted, or the server stops.
async fn connection(
    stream: TcpStream,
    app: Router,
    web: Arc<WebConfig>,
    conn: Registration,
    mut stop: watch::Receiver<bool>,
    _slot: OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let limits = web.limits;
    let state = Arc::clone(&conn.state);
    let Some(tls) = web.tls.clone() else {
        return http1(TokioIo::new(stream), app, limits, state, stop).await;
    };
    let handshake = async move {
        let mut first = [0u8; 1];
        if !matches!(stream.peek(&mut first).await, Ok(1..)) {
            return None;
        }
        // Every TLS connection starts with a handshake record (0x16).
        if first[0] != 0x16 {
            refuse_plain_http(stream).await;
            return None;
        }
        match tokio_rustls::TlsAcceptor::from(tls).accept(stream).await {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::debug!(error = %e, "TLS handshake failed");
                None
            }
        }
    };
    let stream = tokio::select! {
        r = tokio::time::timeout(limits.header_read_timeout, handshake) => match r {
            Ok(Some(s)) => s,
            _ => return,
        },
        () = closing(&mut stop, &state) => return,
    };
    http1(TokioIo::new(stream), app, limits, state, stop).await
}

/// Answer plain HTTP on the TLS port with a 400, as Go's server does.
async fn refuse_plain_http(mut stream: TcpStream) {
    let _ = stream.write_all(PLAIN_HTTP_REFUSED).await;
    let _ = stream.shutdown().await;
    // Read what the client sent, so closing does not reset the connection
    // before it has read the answer.
    let mut sink = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        while matches!(stream.read(&mut sink).await, Ok(1..)) {}
    })
    .await;
}

async fn http1<I>(
    io: I,
    app: Router,
    limits: Limits,
    state: Arc<ConnState>,
    mut stop: watch::Receiver<bool>,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let tracked = Arc::clone(&state);
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let mut app = app.clone();
        let busy = Busy::new(Arc::clone(&tracked));
        async move {
            let _busy = busy;
            // Router is always ready, so `call` needs no `poll_ready` first.
            tower_service::Service::call(&mut app, req).await
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_headers(MAX_HEADERS)
        .max_header_size(MAX_HEADER_BYTES)
        .keep_alive(true);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "connection closed");
            }
        }
        () = closing(&mut stop, &state) => {
            // Idle: closes now. Mid-request: the response is finished first.
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

/// Resolves when the server stops or this connection is evicted.
async fn closing(stop: &mut watch::Receiver<bool>, state: &ConnState) {
    tokio::select! {
        _ = stop.wait_for(|s| *s) => {}
        () = state.close.notified() => {}
    }
}

/// The open connections: a slot each, and what eviction needs to know.
struct Conns {
    slots: Arc<Semaphore>,
    next_id: AtomicU64,
    open: Mutex<HashMap<u64, Arc<ConnState>>>,
}

struct ConnState {
    /// Requests being handled now.
    busy: AtomicUsize,
    /// When the connection last became idle (accepted, or answered).
    idle_since: Mutex<Instant>,
    closing: AtomicBool,
    close: Notify,
}

impl Conns {
    fn new(max: usize) -> Conns {
        Conns {
            slots: Arc::new(Semaphore::new(max)),
            next_id: AtomicU64::new(0),
            open: Mutex::new(HashMap::new()),
        }
    }

    /// A slot for a new connection. At the cap, close the connection that
    /// has waited longest for a request and take its slot; `None` when
    /// every connection is busy.
    async fn admit(&self) -> Option<OwnedSemaphorePermit> {
        if let Ok(p) = Arc::clone(&self.slots).try_acquire_owned() {
            return Some(p);
        }
        if !self.evict_oldest_idle() {
            return None;
        }
        tokio::time::timeout(ADMIT_WAIT, Arc::clone(&self.slots).acquire_owned())
            .await
            .ok()?
            .ok()
    }

    fn evict_oldest_idle(&self) -> bool {
        let Ok(open) = self.open.lock() else {
            return false;
        };
        let victim = open
            .values()
            .filter(|c| c.busy.load(Ordering::Acquire) == 0 && !c.closing.load(Ordering::Acquire))
            .filter_map(|c| c.idle_since.lock().ok().map(|t| (*t, c)))
            .min_by_key(|(t, _)| *t);
        match victim {
            Some((_, c)) => {
                c.closing.store(true, Ordering::Release);
                c.close.notify_one();
                CONNECTIONS_EVICTED.fetch_add(1, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    fn register(self: &Arc<Self>) -> Registration {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ConnState {
            busy: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
            closing: AtomicBool::new(false),
            close: Notify::new(),
        });
        if let Ok(mut open) = self.open.lock() {
            open.insert(id, Arc::clone(&state));
        }
        CONNECTIONS_OPEN.fetch_add(1, Ordering::Relaxed);
        Registration {
            conns: Arc::clone(self),
            id,
            state,
        }
    }
}

/// A connection's entry in [`Conns`], removed when the connection ends.
struct Registration {
    conns: Arc<Conns>,
    id: u64,
    state: Arc<ConnState>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Ok(mut open) = self.conns.open.lock() {
            open.remove(&self.id);
        }
        CONNECTIONS_OPEN.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Marks a connection busy while one request is handled (also when the
/// handler is dropped half-way).
struct Busy(Arc<ConnState>);

impl Busy {
    fn new(state: Arc<ConnState>) -> Busy {
        state.busy.fetch_add(1, Ordering::AcqRel);
        Busy(state)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Ok(mut t) = self.0.idle_since.lock() {
            *t = Instant::now();
        }
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Let this process open as many files as its hard limit allows (as Go
/// programs do), and say so when that is below the connection cap.
fn raise_fd_limit(max_connections: usize) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    let want = lim.rlim_max.min(1 << 20);
    if lim.rlim_cur < want {
        let raised = libc::rlimit {
            rlim_cur: want,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit only reads the struct we pass.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = want;
        }
    }
    let needed = (max_connections + 64) as libc::rlim_t;
    if lim.rlim_cur < needed {
        tracing::warn!(
            limit = lim.rlim_cur,
            max_connections,
            "the open-file limit is below http_server_config.max_connections; raise it (ulimit -n, LimitNOFILE=)"
        );
    }
}

/// SIGTERM and SIGINT (stop) and SIGHUP (reload), registered at creation.
struct Signals;

/// SIGTERM or SIGINT.
struct Stop(Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>);

/// SIGHUP.
struct Hangup(Option<tokio::signal::unix::Signal>);

impl Signals {
    fn install() -> (Stop, Hangup) {
        use tokio::signal::unix::{SignalKind, signal};
        let stop = match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(term), Ok(int)) => Stop(Some((term, int))),
            _ => {
                tracing::warn!(
                    "cannot install signal handlers; only SIGKILL will stop the exporter"
                );
                Stop(None)
            }
        };
        let hup = signal(SignalKind::hangup())
            .map_err(|e| tracing::warn!(error = %e, "cannot install the SIGHUP handler"))
            .ok();
        (stop, Hangup(hup))
    }
}

impl Stop {
    async fn recv(&mut self) {
        match &mut self.0 {
            Some((term, int)) => {
                tokio::select! {
                    _ = term.recv() => tracing::info!(signal = "SIGTERM", "shutting down"),
                    _ = int.recv() => tracing::info!(signal = "SIGINT", "shutting down"),
                }
            }
            None => std::future::pending::<()>().await,
        }
    }
}

impl Hangup {
    async fn recv(&mut self) {
        let received = match &mut self.0 {
            Some(hup) => hup.recv().await.is_some(),
            None => false,
        };
        if !received {
            std::future::pending::<()>().await;
        }
    }
}
