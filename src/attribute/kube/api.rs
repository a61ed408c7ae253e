//! The Kubernetes wire format this watcher reads: pods, pod lists, watch
//! events and `Status` objects, parsed strictly into the few fields used.

use std::fmt::Display;

use serde::Deserialize;

use super::index::{Container, Pod, normalize_container_id};
use crate::config::KubeConfig;

/// Server-side watch timeout; the stream then ends cleanly and is re-opened.
pub(super) const WATCH_TIMEOUT_SECONDS: u64 = 300;

/// Pods per LIST page: a node rarely runs more than the kubelet's default of
/// 110, so one page is the normal case.
pub(super) const LIST_PAGE_SIZE: u32 = 500;

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    #[serde(rename = "resourceVersion")]
    resource_version: Option<String>,
    #[serde(rename = "continue")]
    continue_token: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawPod {
    metadata: RawMeta,
    spec: RawSpec,
    status: RawPodStatus,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawSpec {
    #[serde(rename = "nodeName")]
    node_name: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawPodStatus {
    #[serde(rename = "containerStatuses")]
    containers: Option<Vec<RawContainerStatus>>,
    #[serde(rename = "initContainerStatuses")]
    init_containers: Option<Vec<RawContainerStatus>>,
    #[serde(rename = "ephemeralContainerStatuses")]
    ephemeral_containers: Option<Vec<RawContainerStatus>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawContainerStatus {
    name: Option<String>,
    #[serde(rename = "containerID")]
    container_id: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RawPodList {
    metadata: RawMeta,
    items: Option<Vec<serde_json::Value>>,
}

#[derive(Debug, Deserialize)]
pub(super) struct RawEvent {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    object: serde_json::Value,
}

/// A `metav1.Status`, as sent in `ERROR` events and error responses.
#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub(super) struct ApiStatus {
    code: Option<u16>,
    reason: Option<String>,
    pub(super) message: Option<String>,
}

impl Display for ApiStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.code.unwrap_or(0),
            self.reason.as_deref().unwrap_or("-"),
            self.message.as_deref().unwrap_or("-")
        )
    }
}

impl ApiStatus {
    pub(super) fn is_expired(&self) -> bool {
        self.code == Some(410) || matches!(self.reason.as_deref(), Some("Expired" | "Gone"))
    }
}

/// Why a pod object or an event was not usable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(super) enum ParseError {
    #[error("invalid JSON: {0}")]
    Json(String),
    #[error("pod object lacks {0}")]
    Missing(&'static str),
    #[error("unknown watch event type {0:?}")]
    UnknownType(String),
}

impl From<serde_json::Error> for ParseError {
    fn from(e: serde_json::Error) -> Self {
        ParseError::Json(e.to_string())
    }
}

pub(super) fn pod_from_value(value: serde_json::Value) -> Result<Pod, ParseError> {
    let raw: RawPod = serde_json::from_value(value)?;
    let non_empty = |s: Option<String>, what| s.filter(|s| !s.is_empty()).ok_or(what);
    let uid = non_empty(raw.metadata.uid, "metadata.uid").map_err(ParseError::Missing)?;
    let name = non_empty(raw.metadata.name, "metadata.name").map_err(ParseError::Missing)?;
    let namespace =
        non_empty(raw.metadata.namespace, "metadata.namespace").map_err(ParseError::Missing)?;
    let status = raw.status;
    let containers = [
        status.containers,
        status.init_containers,
        status.ephemeral_containers,
    ]
    .into_iter()
    .flatten()
    .flatten()
    .filter_map(|c| {
        let id = normalize_container_id(c.container_id.as_deref()?)?.to_owned();
        Some(Container {
            name: c.name.unwrap_or_default(),
            id,
        })
    })
    .collect();
    Ok(Pod {
        uid,
        namespace,
        name,
        node_name: raw.spec.node_name.unwrap_or_default(),
        resource_version: raw.metadata.resource_version.unwrap_or_default(),
        containers,
    })
}

/// One LIST page.
#[derive(Debug)]
pub(super) struct PodListPage {
    pub(super) resource_version: String,
    pub(super) continue_token: String,
    pub(super) pods: Vec<Pod>,
    /// Items that were not usable pods.
    pub(super) skipped: Vec<ParseError>,
}

pub(super) fn parse_pod_list(body: &[u8]) -> Result<PodListPage, ParseError> {
    let raw: RawPodList = serde_json::from_slice(body)?;
    let mut pods = Vec::new();
    let mut skipped = Vec::new();
    for item in raw.items.into_iter().flatten() {
        match pod_from_value(item) {
            Ok(p) => pods.push(p),
            Err(e) => skipped.push(e),
        }
    }
    Ok(PodListPage {
        resource_version: raw.metadata.resource_version.unwrap_or_default(),
        continue_token: raw.metadata.continue_token.unwrap_or_default(),
        pods,
        skipped,
    })
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum WatchEvent {
    Added(Pod),
    Modified(Pod),
    Deleted(Pod),
    Bookmark { resource_version: String },
    Error(ApiStatus),
}

pub(super) fn parse_watch_event(line: &[u8]) -> Result<WatchEvent, ParseError> {
    let raw: RawEvent = serde_json::from_slice(line)?;
    Ok(match raw.kind.as_str() {
        "ADDED" => WatchEvent::Added(pod_from_value(raw.object)?),
        "MODIFIED" => WatchEvent::Modified(pod_from_value(raw.object)?),
        "DELETED" => WatchEvent::Deleted(pod_from_value(raw.object)?),
        "BOOKMARK" => {
            let raw: RawPod = serde_json::from_value(raw.object)?;
            WatchEvent::Bookmark {
                resource_version: raw.metadata.resource_version.unwrap_or_default(),
            }
        }
        "ERROR" => WatchEvent::Error(serde_json::from_value(raw.object)?),
        other => return Err(ParseError::UnknownType(other.to_owned())),
    })
}

/// Percent-encodes a query value (RFC 3986 unreserved characters pass).
pub(super) fn encode_query(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Request URIs and credentials of the watched API server.
impl KubeConfig {
    pub(super) fn base(&self) -> &str {
        self.api_url.trim_end_matches('/')
    }

    pub(super) fn selector(&self) -> String {
        encode_query(&format!("spec.nodeName={}", self.node_name))
    }

    pub(super) fn list_uri(&self, continue_token: &str) -> String {
        let mut uri = format!(
            "{}/api/v1/pods?fieldSelector={}&limit={LIST_PAGE_SIZE}",
            self.base(),
            self.selector()
        );
        if !continue_token.is_empty() {
            uri.push_str("&continue=");
            uri.push_str(&encode_query(continue_token));
        }
        uri
    }

    pub(super) fn watch_uri(&self, resource_version: &str) -> String {
        format!(
            "{}/api/v1/pods?fieldSelector={}&watch=1&resourceVersion={}\
             &allowWatchBookmarks=true&timeoutSeconds={WATCH_TIMEOUT_SECONDS}",
            self.base(),
            self.selector(),
            encode_query(resource_version)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID_A: &str = "3f4e8c2b1a9d7e6f5c4b3a2918273645f6e5d4c3b2a1908f7e6d5c4b3a291807";
    const ID_B: &str = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9";

    fn pod_json(uid: &str, name: &str, ns: &str, node: &str, statuses: &str) -> String {
        format!(
            r#"{{"metadata":{{"name":"{name}","namespace":"{ns}","uid":"{uid}","resourceVersion":"77",
                "labels":{{"app":"x"}},"managedFields":[{{"manager":"kubelet"}}]}},
               "spec":{{"nodeName":"{node}","containers":[{{"name":"trainer","image":"pytorch"}}]}},
               "status":{{"phase":"Running",{statuses}}}}}"#
        )
    }

    #[test]
    fn pod_list_page() {
        let statuses = format!(
            r#""containerStatuses":[{{"name":"trainer","containerID":"containerd://{ID_A}","ready":true}},
                                     {{"name":"sidecar","ready":false}}],
               "initContainerStatuses":[{{"name":"init","containerID":"cri-o://{ID_B}"}}],
               "ephemeralContainerStatuses":null"#
        );
        let body = format!(
            r#"{{"kind":"PodList","apiVersion":"v1","metadata":{{"resourceVersion":"123","continue":"tok=="}},
                "items":[{},{{"metadata":{{"name":"no-uid"}}}},17]}}"#,
            pod_json("u-1", "trainer-0", "team-a", "gpu-node-1", &statuses)
        );
        let page = parse_pod_list(body.as_bytes()).unwrap();
        assert_eq!(page.resource_version, "123");
        assert_eq!(page.continue_token, "tok==");
        assert_eq!(page.skipped.len(), 2);
        assert_eq!(
            page.pods,
            vec![Pod {
                uid: "u-1".into(),
                namespace: "team-a".into(),
                name: "trainer-0".into(),
                node_name: "gpu-node-1".into(),
                resource_version: "77".into(),
                containers: vec![
                    Container {
                        name: "trainer".into(),
                        id: ID_A.into()
                    },
                    Container {
                        name: "init".into(),
                        id: ID_B.into()
                    },
                ],
            }]
        );
        assert!(parse_pod_list(br#"{"kind":"PodList","metadata":{},"items":null}"#).is_ok());
        assert!(parse_pod_list(b"<html>").is_err());
        assert!(parse_pod_list(br#"{"items":{}}"#).is_err());
    }

    #[test]
    fn watch_events() {
        let pod = pod_json("u-2", "p", "team-b", "n1", r#""containerStatuses":[]"#);
        for (kind, ctor) in [
            ("ADDED", WatchEvent::Added as fn(Pod) -> WatchEvent),
            ("MODIFIED", WatchEvent::Modified),
            ("DELETED", WatchEvent::Deleted),
        ] {
            let line = format!(r#"{{"type":"{kind}","object":{pod}}}"#).replace('\n', " ");
            let ev = parse_watch_event(line.as_bytes()).unwrap();
            let want = ctor(pod_from_value(serde_json::from_str(&pod).unwrap()).unwrap());
            assert_eq!(ev, want);
        }
        assert_eq!(
            parse_watch_event(
                br#"{"type":"BOOKMARK","object":{"kind":"Pod","apiVersion":"v1","metadata":{"resourceVersion":"999","annotations":{"k8s.io/initial-events-end":"true"}}}}"#
            )
            .unwrap(),
            WatchEvent::Bookmark {
                resource_version: "999".into()
            }
        );
        let gone = parse_watch_event(
            br#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too old resource version: 1 (2)","reason":"Expired","code":410}}"#,
        )
        .unwrap();
        let WatchEvent::Error(status) = gone else {
            panic!("{gone:?}")
        };
        assert!(status.is_expired());
        let other = ApiStatus {
            code: Some(500),
            reason: Some("InternalError".into()),
            message: None,
        };
        assert!(!other.is_expired());
    }

    #[test]
    fn malformed_events() {
        let cases: &[&[u8]] = &[
            b"",
            b"{",
            b"null",
            b"[]",
            b"{\"object\":{}}",
            b"{\"type\":\"ADDED\"}",
            b"{\"type\":\"ADDED\",\"object\":{\"metadata\":{\"name\":\"a\",\"namespace\":\"b\"}}}",
            b"{\"type\":\"ADDED\",\"object\":{\"metadata\":{\"uid\":1}}}",
            b"{\"type\":\"ADDED\",\"object\":\"x\"}",
            b"{\"type\":\"SOMETHING\",\"object\":{}}",
            b"{\"type\":\"ERROR\",\"object\":{\"code\":\"x\"}}",
            b"\xff\xfe",
        ];
        for line in cases {
            assert!(
                parse_watch_event(line).is_err(),
                "{}",
                String::from_utf8_lossy(line)
            );
        }
    }
}
