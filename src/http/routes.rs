//! Routes: `/metrics` (or the configured path), `/healthz`, `/readyz`, `/`.
//! Handlers only read the published snapshot and the body cache; none of
//! them calls NVML.

use std::sync::Arc;
use std::time::SystemTime;

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

use super::cache::BodyCache;
use super::negotiate;
use super::web_config::WebConfig;
use crate::publish::Shared;

#[derive(Clone)]
struct App {
    shared: Arc<Shared>,
    bodies: Arc<BodyCache>,
    telemetry_path: Arc<str>,
}

pub fn router(shared: Arc<Shared>, telemetry_path: &str) -> Router {
    let app = App {
        shared,
        bodies: Arc::new(BodyCache::new()),
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

async fn landing(State(app): State<App>) -> Html<String> {
    let p = &app.telemetry_path;
    Html(format!(
        "<!doctype html>\n<html><head><title>gpumem-exporter</title></head><body>\n\
         <h1>gpumem-exporter {}</h1>\n<p>GPU memory per GPU and per process, from NVML.</p>\n<ul>\n\
         <li><a href=\"{p}\">{p}</a> metrics</li>\n\
         <li><a href=\"/healthz\">/healthz</a> liveness</li>\n\
         <li><a href=\"/readyz\">/readyz</a> readiness</li>\n</ul>\n</body></html>\n",
        crate::expose::VERSION
    ))
}

async fn not_found() -> (StatusCode, &'static str) {
    (StatusCode::NOT_FOUND, "not found\n")
}

const UNAUTHORIZED: &str = "Basic realm=\"gpumem-exporter\", charset=\"UTF-8\"";

/// Basic auth, when the web config lists users; every path is covered.
pub async fn require_auth(
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
