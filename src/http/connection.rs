//! Driving one admitted connection: TLS first when configured (within the
//! header deadline, plain HTTP on the TLS port refused as Go does), then
//! HTTP/1.1 with header count and size limits and the header read
//! timeout; a request with a body (or another method than GET and HEAD)
//! is answered and the connection closed. The connection ends when the
//! client leaves, a deadline passes, admission evicts it
//! ([`super::admission`]), or the server stops.
//!
//! Hand-written with hyper instead of `axum::serve`, which has none of
//! these limits. Measured with slowhttptest (3,000 connections, slow
//! headers, slow body, slow read, range header) in RELIABILITY.md; the e2e
//! module `attack` repeats those runs.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderValue, Method, header};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::admission::Registration;
use super::web_config::{Limits, WebConfig};

/// Request headers allowed at most (Prometheus sends about 6).
pub(crate) const MAX_HEADERS: usize = 64;
/// Bytes of request line and headers allowed at most; more is a 431.
pub(crate) const MAX_HEADER_BYTES: usize = 16 * 1024;
/// How long an evicted connection may take to finish a response it is
/// writing (a slow reader) before it is dropped.
const EVICT_GRACE: Duration = Duration::from_millis(200);

const PLAIN_HTTP_REFUSED: &[u8] = b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\nContent-Length: 48\r\n\r\nClient sent an HTTP request to an HTTPS server.\n";

/// Serve one connection (TLS first when configured) until the client
/// leaves, a deadline passes, it is evicted, or the server stops.
pub(super) async fn serve(
    stream: TcpStream,
    app: Router,
    web: Arc<WebConfig>,
    conn: Registration,
    mut stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let limits = web.limits;
    let Some(tls) = web.tls.clone() else {
        return http1(TokioIo::new(stream), app, limits, &conn, stop).await;
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
        () = closing(&mut stop, &conn) => return,
    };
    http1(TokioIo::new(stream), app, limits, &conn, stop).await
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
    conn: &Registration,
    mut stop: watch::Receiver<bool>,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let requests = conn.requests();
    let service =
        hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            let mut app = app.clone();
            let busy = requests.start();
            // For the auth middleware: the client's address (its budget) and
            // the connection's marks (waiting, authorized).
            req.extensions_mut().insert(requests.clone());
            // Only GET and HEAD are served, and they have no body: a request
            // with one (or another method) is answered, then the connection is
            // closed rather than drained, so a body trickled in (slowhttptest
            // -B, "R-U-Dead-Yet") holds nothing.
            let close_after =
                has_body(&req) || !matches!(*req.method(), Method::GET | Method::HEAD);
            async move {
                let _busy = busy;
                // Router is always ready, so `call` needs no `poll_ready` first.
                let mut response = tower_service::Service::call(&mut app, req).await;
                if let Ok(r) = &mut response
                    && close_after
                {
                    r.headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                response
            }
        });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_headers(MAX_HEADERS)
        .max_header_size(MAX_HEADER_BYTES)
        .keep_alive(true);
    let served = builder.serve_connection(io, service);
    tokio::pin!(served);
    tokio::select! {
        r = served.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "connection closed");
            }
        }
        () = closing(&mut stop, conn) => {
            // Idle: closes now. Mid-request: the response is finished first
            // (within the shutdown grace when the server stops; within
            // EVICT_GRACE when evicted, so a slow reader cannot keep the
            // slot it lost). Evicted while its request only waits for a
            // password check: nothing is being written, so it closes now
            // (its place in the check queue is given up).
            if !*stop.borrow() && conn.only_waiting() {
                return;
            }
            served.as_mut().graceful_shutdown();
            if *stop.borrow() {
                let _ = served.await;
            } else {
                let _ = tokio::time::timeout(EVICT_GRACE, served).await;
            }
        }
    }
}

/// Whether a request announces a body (a length above 0, or chunks).
fn has_body<B>(req: &hyper::Request<B>) -> bool {
    let headers = req.headers();
    headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get(header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() != b"0")
}

/// Resolves when the server stops or this connection is evicted.
async fn closing(stop: &mut watch::Receiver<bool>, conn: &Registration) {
    tokio::select! {
        _ = stop.wait_for(|s| *s) => {}
        () = conn.evicted() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_requests_with_a_body_have_one() {
        let req = |headers: &[(&str, &str)]| {
            let mut b = hyper::Request::builder();
            for (k, v) in headers {
                b = b.header(*k, *v);
            }
            has_body(&b.body(()).unwrap())
        };
        assert!(!req(&[]));
        assert!(!req(&[("content-length", "0")]));
        assert!(req(&[("content-length", "8192")]));
        assert!(req(&[("transfer-encoding", "chunked")]));
    }
}
