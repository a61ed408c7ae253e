//! Routes: `/metrics` (or the configured path), `/healthz`, `/readyz`, the
//! live page `/` with its script and style ([`page`]), and the JSON API
//! `/api/v1/snapshot` and `/api/v1/history`. Handlers only read the
//! published snapshot, the history and the body cache; none of them calls
//! NVML.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use axum::Router;
use axum::extract::{RawQuery, Request, State};
use axum::http::header::{
    ACCEPT, ACCEPT_ENCODING, AUTHORIZATION, CACHE_CONTROL, CONTENT_ENCODING,
    CONTENT_SECURITY_POLICY, CONTENT_TYPE, REFERRER_POLICY, RETRY_AFTER, VARY, WWW_AUTHENTICATE,
    X_CONTENT_TYPE_OPTIONS,
};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use super::admission::Requests;
use super::auth::Verdict;
use super::auth::checks::Checks;
use super::cache::BodyCache;
use super::negotiate;
use super::page;
use super::web_config::WebConfig;
use crate::expose::json;
use crate::model::Snapshot;
use crate::publish::Shared;
use bytes::Bytes;

#[derive(Clone)]
struct App {
    shared: Arc<Shared>,
    bodies: Arc<BodyCache>,
    /// The page's HTML, with the metrics path filled in once.
    index: Bytes,
}

pub(crate) fn router(shared: Arc<Shared>, telemetry_path: &str) -> Router {
    let app = App {
        bodies: Arc::new(BodyCache::counting(Arc::clone(shared.telemetry()))),
        shared,
        index: page::index(telemetry_path),
    };
    Router::new()
        .route(telemetry_path, get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/", get(index))
        .route(page::SCRIPT_PATH, get(script))
        .route(page::STYLE_PATH, get(style))
        .route("/api/v1/snapshot", get(api_snapshot))
        .route("/api/v1/history", get(api_history))
        .fallback(not_found)
        .with_state(app)
}

async fn metrics(State(app): State<App>, headers: HeaderMap) -> Response {
    let Some(snapshot) = app.shared.latest() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "no GPU sample taken yet\n").into_response();
    };
    let format = negotiate::format(headers.get(ACCEPT).and_then(|v| v.to_str().ok()));
    let gzip = negotiate::accepts_gzip(headers.get(ACCEPT_ENCODING).and_then(|v| v.to_str().ok()));
    let Some(body) = app.bodies.body(&snapshot, format, gzip) else {
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

/// A static part of the page, with the headers every part carries.
fn asset(content_type: &'static str, body: Bytes) -> Response {
    (
        [
            (CONTENT_TYPE, content_type),
            (CONTENT_SECURITY_POLICY, page::CSP),
            (X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (REFERRER_POLICY, "no-referrer"),
            // Small, and must follow an upgrade at once.
            (CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

async fn index(State(app): State<App>) -> Response {
    asset("text/html; charset=utf-8", app.index.clone())
}

async fn script() -> Response {
    asset(
        "text/javascript; charset=utf-8",
        Bytes::from_static(page::SCRIPT.as_bytes()),
    )
}

async fn style() -> Response {
    asset(
        "text/css; charset=utf-8",
        Bytes::from_static(page::STYLE.as_bytes()),
    )
}

/// `{"schema_version": 1, "error": why}` with `status`.
fn json_error(status: StatusCode, why: &str) -> Response {
    let body = serde_json::json!({
        "schema_version": json::SCHEMA_VERSION,
        "error": why,
    });
    (
        status,
        [
            (CONTENT_TYPE, json::JSON_CONTENT_TYPE),
            (CACHE_CONTROL, "no-store"),
        ],
        body.to_string(),
    )
        .into_response()
}

/// A cached JSON body, gzipped when the client accepts it.
fn json_body(body: Option<Bytes>, gzip: bool) -> Response {
    let Some(body) = body else {
        return json_error(StatusCode::INTERNAL_SERVER_ERROR, "encoding failed");
    };
    let mut response = (
        [
            (CONTENT_TYPE, json::JSON_CONTENT_TYPE),
            (VARY, "Accept-Encoding"),
            (CACHE_CONTROL, "no-store"),
            (X_CONTENT_TYPE_OPTIONS, "nosniff"),
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

/// The latest snapshot, or why there is none (a 503).
fn latest(app: &App) -> Result<Arc<Snapshot>, String> {
    app.shared.latest().ok_or_else(|| match app.shared.ready() {
        Err(why) => format!("no sample yet: {why}"),
        Ok(()) => "no sample yet".to_string(),
    })
}

async fn api_snapshot(State(app): State<App>, headers: HeaderMap) -> Response {
    let snapshot = match latest(&app) {
        Ok(s) => s,
        Err(why) => return json_error(StatusCode::SERVICE_UNAVAILABLE, &why),
    };
    let gzip = negotiate::accepts_gzip(headers.get(ACCEPT_ENCODING).and_then(|v| v.to_str().ok()));
    let body = app
        .bodies
        .snapshot_json(&snapshot, app.shared.interval(), gzip);
    json_body(body, gzip)
}

async fn api_history(
    State(app): State<App>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Response {
    let seconds = match page::history_seconds(query.as_deref()) {
        Ok(s) => s,
        Err(why) => return json_error(StatusCode::BAD_REQUEST, &why),
    };
    let snapshot = match latest(&app) {
        Ok(s) => s,
        Err(why) => return json_error(StatusCode::SERVICE_UNAVAILABLE, &why),
    };
    let gzip = negotiate::accepts_gzip(headers.get(ACCEPT_ENCODING).and_then(|v| v.to_str().ok()));
    let history = || app.shared.history();
    let body = app.bodies.history_json(&snapshot, seconds, &history, gzip);
    json_body(body, gzip)
}

async fn not_found() -> (StatusCode, &'static str) {
    (StatusCode::NOT_FOUND, "not found\n")
}

const UNAUTHORIZED: &str = "Basic realm=\"gpumem-exporter\", charset=\"UTF-8\"";

/// How long a refused login attempt (429, 503) is held before it is
/// answered: a keep-alive flood then costs one cheap answer per connection
/// per second, not as many as it can send. Meanwhile the connection is
/// idle to admission (evictable).
const REFUSAL_PAUSE: Duration = Duration::from_secs(1);

/// What the basic-auth middleware reads: the web config (its users) and the
/// password checks' queue, which outlives reloads.
#[derive(Clone)]
pub(crate) struct Auth {
    pub(crate) web: Arc<ArcSwap<WebConfig>>,
    pub(crate) checks: Arc<Checks>,
}

/// Basic auth, when the web config lists users; every path is covered. A
/// request waiting for its password check is not busy (admission may
/// evict its connection); one that passes marks its connection authorized.
pub(crate) async fn require_auth(State(auth): State<Auth>, req: Request, next: Next) -> Response {
    let Some(users) = auth.web.load().users.clone() else {
        return next.run(req).await;
    };
    let conn = req.extensions().get::<Requests>().cloned();
    let client = conn
        .as_ref()
        .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), Requests::client);
    let verdict = {
        let _waiting = conn.as_ref().map(Requests::waiting);
        let header = req.headers().get(AUTHORIZATION).map(HeaderValue::as_bytes);
        let verdict = users.authorize(&auth.checks, header, client).await;
        if let Some(conn) = &conn
            && matches!(verdict, Verdict::Denied | Verdict::TooMany { .. })
        {
            conn.refused_login();
        }
        if matches!(
            verdict,
            Verdict::TooMany { .. } | Verdict::Unavailable { .. }
        ) {
            tokio::time::sleep(REFUSAL_PAUSE).await;
        }
        verdict
    };
    let (status, retry_after) = match verdict {
        Verdict::Allowed => {
            if let Some(conn) = &conn {
                conn.authorized();
            }
            return next.run(req).await;
        }
        Verdict::Denied => {
            return (
                StatusCode::UNAUTHORIZED,
                [(WWW_AUTHENTICATE, UNAUTHORIZED)],
                "unauthorized\n",
            )
                .into_response();
        }
        Verdict::TooMany { retry_after } => (StatusCode::TOO_MANY_REQUESTS, retry_after),
        Verdict::Unavailable { retry_after } => (StatusCode::SERVICE_UNAVAILABLE, retry_after),
    };
    let seconds = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
    (
        status,
        [(RETRY_AFTER, seconds.max(1).to_string())],
        "too many failed logins; try again later\n",
    )
        .into_response()
}
