//! A fake node for attribution tests: a /proc root laid out like the
//! kernel's, and a local HTTP server speaking the Kubernetes list/watch wire
//! format (PodList JSON, a watch event stream the test can push to).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http_body_util::channel::{Channel, Sender};
use serde_json::{Value, json};

use super::{fake_container_id, fake_pod_uid};

/// One process in a fake /proc root: comm, stat (start time = 1000 + pid),
/// status (uid), cgroup and cmdline.
pub fn write_proc(root: &Path, pid: u32, comm: &str, uid: u32, cgroup: &str, cmdline: &[&str]) {
    let dir = root.join(pid.to_string());
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("comm"), format!("{comm}\n")).unwrap();
    // Field 22 (start time) is the last one here.
    std::fs::write(
        dir.join("stat"),
        format!(
            "{pid} ({comm}) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {}\n",
            1000 + pid
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("status"),
        format!("Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"),
    )
    .unwrap();
    std::fs::write(dir.join("cgroup"), cgroup).unwrap();
    let mut cmd = if cmdline.is_empty() {
        comm.to_string()
    } else {
        cmdline.join("\0")
    };
    cmd.push('\0');
    std::fs::write(dir.join("cmdline"), cmd).unwrap();
}

/// A running pod on `node` with one container, its ids made from `seed`.
pub fn pod_json(
    node: &str,
    ns: &str,
    name: &str,
    seed: char,
    container: &str,
    runtime: &str,
) -> Value {
    json!({
        "metadata": {"name": name, "namespace": ns, "uid": fake_pod_uid(seed), "resourceVersion": "10"},
        "spec": {"nodeName": node, "containers": [{"name": container}]},
        "status": {"phase": "Running", "containerStatuses": [
            {"name": container, "containerID": format!("{runtime}://{}", fake_container_id(seed)), "ready": true}
        ]}
    })
}

/// The local Kubernetes API: LIST answers a PodList of `items`, WATCH keeps
/// a stream open that [`FakeApi::delete`] pushes events to.
#[derive(Clone, Default)]
pub struct FakeApi {
    pub items: Arc<Mutex<Vec<Value>>>,
    pub watchers: Arc<Mutex<Vec<Sender<Bytes, std::io::Error>>>>,
    /// The query of every LIST request.
    pub lists: Arc<Mutex<Vec<BTreeMap<String, String>>>>,
}

async fn pods_handler(
    State(api): State<FakeApi>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    if q.get("watch").map(String::as_str) == Some("1") {
        let (tx, body) = Channel::<Bytes, std::io::Error>::new(64);
        api.watchers.lock().unwrap().push(tx);
        return Response::builder()
            .header(CONTENT_TYPE, "application/json")
            .body(Body::new(body))
            .unwrap();
    }
    api.lists.lock().unwrap().push(q);
    let items = api.items.lock().unwrap().clone();
    axum::Json(json!({
        "kind": "PodList", "apiVersion": "v1",
        "metadata": {"resourceVersion": "10"},
        "items": items
    }))
    .into_response()
}

impl FakeApi {
    pub fn with_pods(items: Vec<Value>) -> FakeApi {
        let api = FakeApi::default();
        *api.items.lock().unwrap() = items;
        api
    }

    pub fn router(&self) -> Router {
        Router::new()
            .route("/api/v1/pods", get(pods_handler))
            .with_state(self.clone())
    }

    /// Remove a pod and tell every watcher, as the API server does.
    pub async fn delete(&self, name: &str) {
        let gone = {
            let mut items = self.items.lock().unwrap();
            let i = items
                .iter()
                .position(|p| p["metadata"]["name"] == name)
                .unwrap();
            items.remove(i)
        };
        let line = format!("{}\n", json!({"type": "DELETED", "object": gone}));
        let senders: Vec<_> = self.watchers.lock().unwrap().drain(..).collect();
        for mut tx in senders {
            if tx.send_data(Bytes::from(line.clone())).await.is_ok() {
                self.watchers.lock().unwrap().push(tx);
            }
        }
    }
}
