//! The pod watcher (kube-rs's watcher) against a local HTTPS API server
//! that speaks the real list/watch wire format: paged PodList JSON, then a
//! chunked stream of newline-delimited watch events that the test scripts
//! line by line. The watcher runs in this process, so its client is
//! inferred from this process's environment: with no KUBECONFIG, no
//! ~/.kube/config and no in-cluster variables, the keys below are all it
//! has (kubernetes.api_url, token_file, ca_file).

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use gpumem_exporter::testing::config::KubeConfig;
use gpumem_exporter::testing::kube::{PodIndex, PodRef, run_watcher};
use serde_json::{Value, json};

use crate::harness::cluster::{FakeApi, NODE, Request, WatchStream, event, gone, pod};

const UID_A: &str = "6f1c2a4e-3b5d-4c7e-9f10-2a3b4c5d6e7f";
const UID_B: &str = "0b9e8d7c-6a5b-4c3d-8e2f-1a0b9c8d7e6f";
const UID_C: &str = "a1b2c3d4-e5f6-4a7b-8c9d-0e1f2a3b4c5d";
const UID_D: &str = "d4c3b2a1-0f9e-4d8c-b7a6-5f4e3d2c1b0a";
const UID_E: &str = "e5e5e5e5-1111-4222-8333-444455556666";
const UID_F: &str = "f6f6f6f6-1111-4222-8333-444455556666";
const UID_G: &str = "a7a7a7a7-1111-4222-8333-444455556666";
const UID_H: &str = "b8b8b8b8-1111-4222-8333-444455556666";

/// A 64-hex container id, distinct per seed.
fn cid(seed: u8) -> String {
    format!("{seed:02x}").repeat(32)
}

fn pod_a() -> Value {
    let mut p = pod(
        "team-a",
        "trainer-0",
        UID_A,
        NODE,
        "990",
        &[("trainer", Some(format!("containerd://{}", cid(0xa1))))],
    );
    p["status"]["initContainerStatuses"] = json!([{
        "name": "fetch-weights",
        "containerID": format!("containerd://{}", cid(0xa0)),
        "image": "busybox", "imageID": "busybox@sha256:1",
        "ready": true, "restartCount": 0,
        "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}
    }]);
    p
}

fn pod_b() -> Value {
    pod(
        "team-b",
        "infer-0",
        UID_B,
        NODE,
        "991",
        &[
            ("server", Some(format!("cri-o://{}", cid(0xb1)))),
            ("metrics", None),
        ],
    )
}

fn pod_c() -> Value {
    pod(
        "team-a",
        "notebook-7f9c",
        UID_C,
        NODE,
        "992",
        &[("notebook", Some(format!("docker://{}", cid(0xc1))))],
    )
}

/// On another node: the server filters by node, but the watcher must not
/// trust that.
fn pod_d() -> Value {
    pod(
        "team-b",
        "elsewhere",
        UID_D,
        "gpu-node-2",
        "993",
        &[("trainer", Some(format!("containerd://{}", cid(0xd1))))],
    )
}

fn bookmark(rv: &str) -> String {
    event(
        "BOOKMARK",
        json!({"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": rv}}),
    )
}

struct Harness {
    api: FakeApi,
    index: Arc<PodIndex>,
    token_file: tempfile::NamedTempFile,
    watcher: tokio::task::JoinHandle<()>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

async fn start(items: Vec<Value>, rv: &str, page_size: usize) -> Harness {
    let api = FakeApi::start(items, rv, page_size).await;
    let mut token_file = tempfile::NamedTempFile::new().unwrap();
    writeln!(token_file, "test-token").unwrap();
    let index = Arc::new(PodIndex::new());
    let mut cfg = KubeConfig::node(NODE);
    cfg.api_url = Some(api.url());
    cfg.token_file = Some(token_file.path().to_owned());
    cfg.ca_file = Some(api.ca_file());
    let watcher = tokio::spawn(run_watcher(cfg, index.clone()));
    Harness {
        api,
        index,
        token_file,
        watcher,
    }
}

impl Harness {
    async fn next_watch(&mut self) -> (Request, WatchStream) {
        self.api.next_watch().await
    }

    fn lookup(&self, uid: Option<&str>, container: Option<&str>) -> Option<PodRef> {
        self.index.lookup(uid, container)
    }
}

/// Polls `cond` every 5 ms for up to 5 s.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn send(stream: &mut WatchStream, text: impl Into<String>) {
    stream.send_data(Bytes::from(text.into())).await.unwrap();
}

fn r(ns: &str, pod: &str, container: &str) -> Option<PodRef> {
    Some(PodRef {
        namespace: ns.into(),
        pod: pod.into(),
        container: container.into(),
    })
}

/// Every request is node-scoped and carries the token of the token file.
fn check_common(seen: &Request, token: &str) {
    assert_eq!(
        seen.auth.as_deref(),
        Some(format!("Bearer {token}").as_str())
    );
    assert_eq!(
        seen.query.get("fieldSelector").map(String::as_str),
        Some("spec.nodeName=gpu-node-1")
    );
    assert!(
        seen.raw_query
            .contains("fieldSelector=spec.nodeName%3Dgpu-node-1"),
        "{}",
        seen.raw_query
    );
}

fn check_watch(seen: &Request, rv: &str, token: &str) {
    check_common(seen, token);
    let q = |k: &str| seen.query.get(k).map(String::as_str);
    assert_eq!(q("watch"), Some("true"), "{}", seen.raw_query);
    assert_eq!(q("resourceVersion"), Some(rv), "{}", seen.raw_query);
    assert_eq!(q("allowWatchBookmarks"), Some("true"));
    assert_eq!(q("timeoutSeconds"), Some("290"));
}

#[tokio::test]
async fn list_watch_reconnect_and_relist() {
    let mut h = start(vec![pod_a(), pod_b(), pod_c(), pod_d()], "1000", 2).await;

    // LIST: two pages, the other node's pod ignored.
    eventually("first list", || h.index.stats().synced).await;
    let stats = h.index.stats();
    assert_eq!(stats.lists_total, 1);
    assert!(stats.last_sync_unix_seconds > 1_700_000_000);
    assert_eq!(h.index.pods(), 3);
    assert_eq!(
        h.lookup(None, Some(&cid(0xa1))),
        r("team-a", "trainer-0", "trainer")
    );
    assert_eq!(
        h.lookup(None, Some(&cid(0xa0))),
        r("team-a", "trainer-0", "fetch-weights")
    );
    assert_eq!(
        h.lookup(Some(UID_B), Some(&cid(0xb1))),
        r("team-b", "infer-0", "server")
    );
    assert_eq!(h.lookup(Some(UID_B), None), r("team-b", "infer-0", ""));
    assert_eq!(
        h.lookup(None, Some(&cid(0xc1))),
        r("team-a", "notebook-7f9c", "notebook")
    );
    // The container id wins over the pod UID.
    assert_eq!(
        h.lookup(Some(UID_A), Some(&cid(0xc1))),
        r("team-a", "notebook-7f9c", "notebook")
    );
    assert_eq!(h.lookup(Some(UID_D), Some(&cid(0xd1))), None);
    {
        let s = h.api.state.lock().unwrap();
        assert_eq!(s.lists.len(), 2, "two pages");
        for seen in &s.lists {
            check_common(seen, "test-token");
            assert!(!seen.query.contains_key("watch"));
        }
        // From the watch cache (resourceVersion 0, unpaged, as informers
        // ask); a server that pages anyway is followed by its continue token.
        let q0 = |k: &str| s.lists[0].query.get(k).map(String::as_str);
        assert_eq!(
            (
                q0("resourceVersion"),
                q0("resourceVersionMatch"),
                q0("limit")
            ),
            (Some("0"), Some("NotOlderThan"), None)
        );
        assert!(!s.lists[0].query.contains_key("continue"));
        assert_eq!(
            s.lists[1].query.get("continue").map(String::as_str),
            Some("c+/2=")
        );
        assert!(
            s.lists[1].raw_query.contains("continue=c%2B%2F2%3D"),
            "{}",
            s.lists[1].raw_query
        );
    }

    // WATCH from the list's resourceVersion.
    let (seen, mut stream) = h.next_watch().await;
    check_watch(&seen, "1000", "test-token");

    // ADDED (pending: no container id yet) → MODIFIED (started) → DELETED.
    let e_pending = pod(
        "team-b",
        "infer-1",
        UID_E,
        NODE,
        "1001",
        &[("server", None)],
    );
    send(&mut stream, event("ADDED", e_pending)).await;
    eventually("ADDED pod", || h.lookup(Some(UID_E), None).is_some()).await;
    assert_eq!(h.lookup(Some(UID_E), None), r("team-b", "infer-1", ""));
    let e_running = pod(
        "team-b",
        "infer-1",
        UID_E,
        NODE,
        "1002",
        &[("server", Some(format!("containerd://{}", cid(0xe1))))],
    );
    send(&mut stream, event("MODIFIED", e_running.clone())).await;
    eventually("MODIFIED container id", || {
        h.lookup(None, Some(&cid(0xe1))) == r("team-b", "infer-1", "server")
    })
    .await;
    assert_eq!(h.index.pods(), 4);
    let mut e_deleted = e_running;
    e_deleted["metadata"]["resourceVersion"] = json!("1003");
    send(&mut stream, event("DELETED", e_deleted)).await;
    eventually("DELETED pod", || h.lookup(Some(UID_E), None).is_none()).await;
    assert_eq!(h.lookup(None, Some(&cid(0xe1))), None);
    assert_eq!(h.index.pods(), 3);

    // A malformed line between good ones is counted and skipped; a bookmark
    // moves the resourceVersion; another node's pod is ignored.
    let errors_before = h.index.stats().errors_total;
    let events_before = h.index.stats().events_total;
    send(
        &mut stream,
        format!(
            "{{\"type\":\"ADDED\",\"object\":{{not json\n{}",
            bookmark("1010")
        ),
    )
    .await;
    let elsewhere = pod("team-b", "far", UID_G, "gpu-node-2", "1010", &[]);
    send(&mut stream, event("ADDED", elsewhere)).await;
    let f = pod(
        "team-a",
        "eval-0",
        UID_F,
        NODE,
        "1011",
        &[("eval", Some(format!("containerd://{}", cid(0xf1))))],
    );
    // The event split across two chunks still parses.
    let f_line = event("ADDED", f);
    let (head, tail) = f_line.split_at(40);
    send(&mut stream, head).await;
    send(&mut stream, tail).await;
    eventually("pod after malformed line", || {
        h.lookup(Some(UID_F), None).is_some()
    })
    .await;
    let stats = h.index.stats();
    assert_eq!(stats.errors_total, errors_before + 1);
    // Two pod events; the bookmark is kube-rs's own (it moves the
    // resourceVersion, see the 410 test, but is no event of ours).
    assert_eq!(stats.events_total, events_before + 2);
    assert_eq!(h.lookup(Some(UID_G), None), None);
    assert_eq!(h.index.pods(), 4);

    // The server drops the connection mid-event: the watcher re-watches from
    // the last resourceVersion, with a token re-read from the file.
    let restarts_before = h.index.stats().watch_restarts_total;
    std::fs::write(h.token_file.path(), "rotated-token\n").unwrap();
    send(&mut stream, "{\"type\":\"ADDED\",\"obj").await;
    stream.abort(std::io::Error::other("connection reset"));
    let (seen, mut stream) = h.next_watch().await;
    check_watch(&seen, "1011", "rotated-token");
    assert!(h.index.stats().watch_restarts_total > restarts_before);
    assert_eq!(
        h.index.stats().lists_total,
        1,
        "a dropped watch does not relist"
    );
    let g = pod(
        "team-b",
        "infer-2",
        UID_G,
        NODE,
        "1012",
        &[("server", Some(format!("cri-o://{}", cid(0x61))))],
    );
    send(&mut stream, event("ADDED", g)).await;
    eventually("event after re-watch", || {
        h.lookup(None, Some(&cid(0x61))) == r("team-b", "infer-2", "server")
    })
    .await;

    // 410 Gone as an ERROR event: relist and replace the index wholesale.
    {
        let mut s = h.api.state.lock().unwrap();
        let h_pod = pod(
            "team-b",
            "batch-9",
            UID_H,
            NODE,
            "1999",
            &[("job", Some(format!("containerd://{}", cid(0x81))))],
        );
        s.items = vec![pod_a(), pod_c(), h_pod, pod_d()];
        s.rv = "2000".into();
    }
    send(&mut stream, event("ERROR", gone())).await;
    eventually("relist after 410", || h.index.stats().lists_total == 2).await;
    assert_eq!(
        h.lookup(None, Some(&cid(0x81))),
        r("team-b", "batch-9", "job")
    );
    assert_eq!(
        h.lookup(Some(UID_B), Some(&cid(0xb1))),
        None,
        "gone from the new list"
    );
    assert_eq!(h.lookup(Some(UID_F), None), None);
    assert_eq!(h.lookup(Some(UID_G), None), None);
    assert_eq!(h.lookup(Some(UID_A), None), r("team-a", "trainer-0", ""));
    assert_eq!(h.index.pods(), 3);
    let (seen, _stream) = h.next_watch().await;
    check_watch(&seen, "2000", "rotated-token");
    assert!(h.index.stats().synced);
}

#[tokio::test]
async fn watch_410_status_relists_and_oversize_line_reconnects() {
    let mut h = start(vec![pod_a(), pod_d()], "500", 500).await;
    h.api.state.lock().unwrap().next_watch_status = Some(StatusCode::GONE);

    // HTTP 410 on the watch request → relist, then watch again.
    eventually("relist after HTTP 410", || h.index.stats().lists_total == 2).await;
    let (seen, mut stream) = h.next_watch().await;
    check_watch(&seen, "500", "test-token");
    assert_eq!(h.api.state.lock().unwrap().watches.len(), 2);
    assert_eq!(h.index.stats().watch_restarts_total, 0);
    assert_eq!(h.index.pods(), 1);

    // A line over 4 MiB without a newline forces a reconnect, same rv.
    send(&mut stream, bookmark("510")).await;
    let chunk = "x".repeat(256 << 10);
    for _ in 0..17 {
        if stream.send_data(Bytes::from(chunk.clone())).await.is_err() {
            break;
        }
    }
    let (seen, _stream) = h.next_watch().await;
    check_watch(&seen, "510", "test-token");
    let stats = h.index.stats();
    assert_eq!(stats.watch_restarts_total, 1);
    assert!(stats.errors_total >= 1);
    assert_eq!(
        h.lookup(None, Some(&cid(0xa1))),
        r("team-a", "trainer-0", "trainer")
    );
}
