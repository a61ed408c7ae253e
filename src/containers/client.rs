//! One Docker Engine API request over a Unix socket:
//! `GET /v1.41/containers/{id}/json`, the answer parsed into a
//! [`ContainerInfo`]. Docker and Podman's `podman system service` both
//! answer it (v1.41 is Docker 20.10's API, which both serve).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::StatusCode;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::net::UnixStream;

use crate::model::ContainerInfo;

/// The most of an inspect answer read (a container's full inspect is a
/// few KiB; its labels and environment are bounded by the engine only).
pub(crate) const MAX_BODY_BYTES: usize = 1 << 20;
/// Longest label value kept, in characters.
pub(crate) const MAX_VALUE_CHARS: usize = 256;

const COMPOSE_PROJECT: &str = "com.docker.compose.project";
const COMPOSE_SERVICE: &str = "com.docker.compose.service";

/// What the engine said about an id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    Found(ContainerInfo),
    /// 404: the engine does not know this id.
    NotFound,
}

/// Why there was no answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LookupError {
    #[error("container id {0:?} is not hex")]
    BadId(String),
    #[error("connect to {socket}: {source}")]
    Connect {
        socket: String,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP: {0}")]
    Http(#[from] hyper::Error),
    #[error("request: {0}")]
    Request(#[from] hyper::http::Error),
    #[error("the engine answered {0}")]
    Status(StatusCode),
    #[error("reading the answer: {0}")]
    Body(String),
    #[error("malformed answer: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error("no answer within the timeout")]
    Timeout,
}

impl LookupError {
    /// A stable key for rate-limited logging, one per kind.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            LookupError::BadId(_) => "bad_id",
            LookupError::Connect { .. } => "connect",
            LookupError::Http(_) | LookupError::Request(_) => "http",
            LookupError::Status(_) => "status",
            LookupError::Body(_) => "body",
            LookupError::Malformed(_) => "malformed",
            LookupError::Timeout => "timeout",
        }
    }
}

/// Ask the engine at `socket` about container `id` (one connection).
pub(crate) async fn inspect(socket: &Path, id: &str) -> Result<Answer, LookupError> {
    if id.is_empty() || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(LookupError::BadId(id.to_string()));
    }
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|source| LookupError::Connect {
            socket: socket.display().to_string(),
            source,
        })?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    // The connection is driven beside the request; it ends when `sender`
    // is dropped at the end of this function.
    let conn = tokio::spawn(conn);
    let req = hyper::Request::get(format!("/v1.41/containers/{id}/json"))
        .header(hyper::header::HOST, "localhost")
        .body(Empty::<Bytes>::new())?;
    let resp = sender.send_request(req).await?;
    let status = resp.status();
    let answer = match status {
        StatusCode::NOT_FOUND => Ok(Answer::NotFound),
        StatusCode::OK => {
            let body = Limited::new(resp.into_body(), MAX_BODY_BYTES)
                .collect()
                .await
                .map_err(|e| LookupError::Body(e.to_string()))?
                .to_bytes();
            parse(&body).map(Answer::Found)
        }
        other => Err(LookupError::Status(other)),
    };
    drop(sender);
    conn.abort();
    answer
}

#[derive(Deserialize)]
struct Inspect {
    #[serde(rename = "Name", default)]
    name: Option<String>,
    #[serde(rename = "Config", default)]
    config: Option<InspectConfig>,
}

#[derive(Deserialize)]
struct InspectConfig {
    #[serde(rename = "Image", default)]
    image: Option<String>,
    #[serde(rename = "Labels", default)]
    labels: Option<HashMap<String, String>>,
}

/// The fields we export from an inspect answer; the rest is ignored.
pub(crate) fn parse(body: &[u8]) -> Result<ContainerInfo, LookupError> {
    let doc: Inspect = serde_json::from_slice(body)?;
    let value = |v: Option<&str>| -> Arc<str> {
        let v = v.unwrap_or("");
        match v.char_indices().nth(MAX_VALUE_CHARS) {
            Some((cut, _)) => Arc::from(&v[..cut]),
            None => Arc::from(v),
        }
    };
    let name = doc
        .name
        .as_deref()
        .map(|n| n.strip_prefix('/').unwrap_or(n));
    let config = doc.config.as_ref();
    let labels = config.and_then(|c| c.labels.as_ref());
    let label = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
    Ok(ContainerInfo {
        name: value(name),
        image: value(config.and_then(|c| c.image.as_deref())),
        compose_project: value(label(COMPOSE_PROJECT)),
        compose_service: value(label(COMPOSE_SERVICE)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Trimmed from real answers: Docker 24 for a compose service, and
    /// Podman 4.3's compatible API (null labels).
    #[test]
    fn parses_docker_and_podman_answers() {
        let docker = br#"{"Id":"f07636cd","Name":"/shop-web-1","State":{"Pid":4242},
            "Config":{"Hostname":"f07636cd","Image":"nginx:1.25","Labels":{
            "com.docker.compose.project":"shop","com.docker.compose.service":"web",
            "com.docker.compose.version":"2.21.0"}}}"#;
        let info = parse(docker).unwrap();
        assert_eq!(&*info.name, "shop-web-1");
        assert_eq!(&*info.image, "nginx:1.25");
        assert_eq!(&*info.compose_project, "shop");
        assert_eq!(&*info.compose_service, "web");

        let podman = br#"{"Id":"aa","Name":"/trainer-a","Config":{"Image":"localhost/busybox:e2e","Labels":null}}"#;
        let info = parse(podman).unwrap();
        assert_eq!(&*info.name, "trainer-a");
        assert_eq!(&*info.image, "localhost/busybox:e2e");
        assert_eq!(&*info.compose_project, "");
        // Fields missing altogether are empty, not an error.
        assert_eq!(parse(b"{}").unwrap(), ContainerInfo::default());
    }

    #[test]
    fn refuses_what_is_not_an_inspect_document_and_cuts_long_values() {
        for bad in [&b"7"[..], b"not json", b"{\"Name\": 7}", b""] {
            assert!(matches!(parse(bad), Err(LookupError::Malformed(_))));
        }
        let long = format!(r#"{{"Name":"/{}"}}"#, "é".repeat(1000));
        assert_eq!(
            parse(long.as_bytes()).unwrap().name.chars().count(),
            MAX_VALUE_CHARS
        );
    }

    /// An id is never put in a URL unless it is hex.
    #[tokio::test]
    async fn an_id_that_is_not_hex_is_refused_before_connecting() {
        for id in ["", "../../info", "abc/def", "abc?x=1"] {
            let e = inspect(Path::new("/nonexistent.sock"), id).await;
            assert!(matches!(e, Err(LookupError::BadId(_))), "{id}: {e:?}");
        }
        let e = inspect(Path::new("/nonexistent.sock"), "abc123").await;
        assert!(matches!(e, Err(LookupError::Connect { .. })), "{e:?}");
    }
}
