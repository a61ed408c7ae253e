//! The accept loop's parts: a hand-written listener instead of
//! `axum::serve`, for what that lacks: a cap on open connections (the
//! oldest idle one makes room, so idle or slowloris clients cannot starve a
//! scraper), header count/size limits, a deadline for headers and the TLS
//! handshake, and plain HTTP refused on the TLS port.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};

use super::web_config::{Limits, WebConfig};
use crate::telemetry::Telemetry;

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

const PLAIN_HTTP_REFUSED: &[u8] = b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\nContent-Length: 48\r\n\r\nClient sent an HTTP request to an HTTPS server.\n";
/// Listen with a backlog as deep as the kernel allows (`somaxconn`, as Go
/// does), so a burst of connections waits in the queue rather than in SYN
/// retransmits.
pub(super) fn bind(address: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if address.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(address)?;
    socket.listen(LISTEN_BACKLOG)
}

/// leaves, a deadline passes, it is evicted, or the server stops.
pub(super) async fn connection(
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
pub(super) struct Conns {
    slots: Arc<Semaphore>,
    max: usize,
    telemetry: Arc<Telemetry>,
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
    pub(super) fn new(max: usize, telemetry: Arc<Telemetry>) -> Conns {
        Conns {
            slots: Arc::new(Semaphore::new(max)),
            max,
            telemetry,
            next_id: AtomicU64::new(0),
            open: Mutex::new(HashMap::new()),
        }
    }

    /// A slot for a new connection. At the cap, close the connection that
    /// has waited longest for a request and take its slot; `None` when
    /// every connection is busy.
    pub(super) async fn admit(&self) -> Option<OwnedSemaphorePermit> {
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

    pub(super) fn evict_oldest_idle(&self) -> bool {
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
                Telemetry::bump(&self.telemetry.http_connections_evicted);
                true
            }
            None => false,
        }
    }

    /// Open connections now.
    pub(super) fn open(&self) -> u64 {
        self.telemetry.http_connections_open.load(Ordering::Relaxed)
    }

    /// Resolves once every connection has closed (every slot is back).
    pub(super) async fn drained(&self) {
        let _ = self
            .slots
            .acquire_many(u32::try_from(self.max).unwrap_or(u32::MAX))
            .await;
    }

    pub(super) fn register(self: &Arc<Self>) -> Registration {
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
        Telemetry::bump(&self.telemetry.http_connections_open);
        Registration {
            conns: Arc::clone(self),
            id,
            state,
        }
    }
}

/// A connection's entry in [`Conns`], removed when the connection ends.
pub(super) struct Registration {
    conns: Arc<Conns>,
    id: u64,
    state: Arc<ConnState>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Ok(mut open) = self.conns.open.lock() {
            open.remove(&self.id);
        }
        self.conns
            .telemetry
            .http_connections_open
            .fetch_sub(1, Ordering::Relaxed);
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
pub(super) fn raise_fd_limit(max_connections: usize) {
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
