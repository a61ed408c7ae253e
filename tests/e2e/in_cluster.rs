//! kube-rs's own in-cluster path, for real: the exporter runs in a private
//! mount namespace (`unshare -m`, as root) where
//! /var/run/secrets/kubernetes.io/serviceaccount is a bind mount of a
//! folder laid out as the kubelet lays out a projected service-account
//! volume (`token`, `ca.crt`, `namespace` as symlinks into `..data`, which
//! points at a timestamped folder and is swapped atomically on rotation),
//! with `KUBERNETES_SERVICE_HOST`/`_PORT` naming the fake API and no
//! `kubernetes.*` client key. The host's /run is untouched: the namespace
//! gets a tmpfs of its own on /run to make the mount point in.
//!
//! The API server takes only the current token. When it rotates, kube-rs
//! (kube-client 5: `TokenFile`) keeps sending the token it read until that
//! read is 50 s old (it re-reads at the first request from then on), so a
//! server that refuses the old token at once gets 401s for up to about a
//! minute, plus the watcher's backoff; docs/attribution.md says so, and
//! why a real cluster never sees them (the old token stays valid).

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use axum::body::Bytes;

use crate::harness::cluster::{self, Accept, FakeNode};
use crate::harness::*;

const GPU: &str = "GPU-1c1c1c1c-0000-0000-0000-000000000000";
const TOKEN_1: &str = "eyJhbGciOiJSUzI1NiJ9.in-cluster-token-1.sig";
const TOKEN_2: &str = "eyJhbGciOiJSUzI1NiJ9.in-cluster-token-2.sig";
/// Where kube-rs reads the service account (kube-client's
/// `incluster_config.rs`); /var/run is /run on Debian and most others.
const SERVICE_ACCOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// Runs in the new mount namespace, then becomes the exporter (`$0`, its
/// flags `$@`).
const IN_NAMESPACE: &str = r#"set -e
mount -t tmpfs -o size=1m,mode=755 gpumem-e2e-run /run
mkdir -p /run/secrets/kubernetes.io/serviceaccount
mount --bind "$SA_DIR" /run/secrets/kubernetes.io/serviceaccount
exec "$0" "$@"
"#;

/// A projected service-account volume as the kubelet's atomic writer
/// keeps it: each generation in `..<generation>`, `..data` pointing at the
/// current one, the files as symlinks through `..data`.
struct Projection {
    dir: tempfile::TempDir,
    generation: u32,
}

impl Projection {
    fn new(token: &str, ca_pem: &str) -> Projection {
        let mut p = Projection {
            dir: tempfile::tempdir().unwrap(),
            generation: 0,
        };
        p.write(token, ca_pem);
        for file in ["token", "ca.crt", "namespace"] {
            symlink(format!("..data/{file}"), p.dir.path().join(file)).unwrap();
        }
        p
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// A new generation, swapped in with one rename (the old one removed
    /// after, as the kubelet does).
    fn write(&mut self, token: &str, ca_pem: &str) {
        let old = self.generation_dir();
        self.generation += 1;
        let new = self.generation_dir();
        std::fs::create_dir(&new).unwrap();
        // A projected token has no trailing newline.
        std::fs::write(new.join("token"), token).unwrap();
        std::fs::write(new.join("ca.crt"), ca_pem).unwrap();
        std::fs::write(new.join("namespace"), "monitoring").unwrap();
        let tmp = self.dir.path().join("..data_tmp");
        symlink(new.file_name().unwrap(), &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.path().join("..data")).unwrap();
        if self.generation > 1 {
            std::fs::remove_dir_all(old).unwrap();
        }
    }

    fn generation_dir(&self) -> PathBuf {
        self.dir
            .path()
            .join(format!("..2026_12_02_00_00_0{}.000000001", self.generation))
    }
}

fn auth(token: &str) -> Option<String> {
    Some(format!("Bearer {token}"))
}

/// In-cluster with the service account's files and nothing else: kube-rs
/// authenticates with the token, trusts the API by ca.crt, and, once the
/// token rotates and the API takes only the new one, comes back with the
/// new token and keeps watching.
#[test]
fn the_service_account_files_are_all_it_needs_rotation_included() {
    let mut node = FakeNode::start(vec![cluster::seeded_pod(
        "team-a",
        "trainer-0",
        'a',
        "trainer",
        "containerd",
    )]);
    cluster::write_proc(
        node.proc_root.path(),
        4101,
        "python3",
        1000,
        &cluster::cgroup_containerd('a'),
        &[],
    );
    cluster::write_proc(
        node.proc_root.path(),
        4102,
        "tritonserver",
        1001,
        &cluster::cgroup_crio('b'),
        &[],
    );
    let scenario = Scenario::new(&format!(
        "devices:\n  - uuid: {GPU}\n    memory: {{total: 85899345920, reserved: 536870912, used: 30000000000}}\n    processes:\n      - {{pid: 4101, used: 1000000000}}\n      - {{pid: 4102, used: 2000000000}}\n"
    ));
    node.api.state.lock().unwrap().require = Some(Accept {
        tokens: vec![TOKEN_1.into()],
        client_cert: None,
    });
    let mut sa = Projection::new(TOKEN_1, &node.api.pki.ca_pem);
    let host_had_it = Path::new(SERVICE_ACCOUNT).exists();

    // No kubernetes.* client key: api_url, token_file, ca_file unset.
    let config = format!(
        "{}kubernetes:\n  pod_resources_socket: \"\"\n",
        node.base_config(&scenario, "")
    );
    let config = scenario.file("config.yaml", config.as_bytes());
    let mut wrapper = Command::new("unshare");
    wrapper.args([
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        IN_NAMESPACE,
        BIN,
    ]);
    let mut cmd = Exporter::command(
        wrapper,
        &scenario,
        &["--config.file", config.to_str().unwrap()],
    );
    cmd.env("SA_DIR", sa.path())
        .env("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        .env("KUBERNETES_SERVICE_PORT", node.api.addr.port().to_string())
        .env("NODE_NAME", cluster::NODE);
    let ex = Exporter::spawn(cmd);

    let m = wait_for(Duration::from_secs(20), "the pod of pid 4101", || {
        let m = ex.metrics();
        cluster::pods_resolved(&m, &["trainer-0"]).then_some(m)
    });
    assert_eq!(m.get("gpumem_exporter_kubernetes_synced", &[]), Some(1.0));
    let log = ex.stderr();
    assert!(
        log.contains(&format!(
            "api=https://127.0.0.1:{}/ config=\"inferred (KUBECONFIG, ~/.kube/config or in-cluster)\" credentials=\"bearer token file\"",
            node.api.addr.port()
        )),
        "kube-rs's in-cluster config: {log}"
    );
    {
        let s = node.api.state.lock().unwrap();
        assert!(s.refused.is_empty(), "{:?}", s.refused);
        assert!(!s.lists.is_empty());
        assert!(
            s.lists.iter().all(|r| r.auth == auth(TOKEN_1)),
            "{:?}",
            s.lists
        );
    }
    assert_eq!(
        Path::new(SERVICE_ACCOUNT).exists(),
        host_had_it,
        "the host's /run is untouched"
    );

    // Rotation: a new token, and the API takes only that one from now on.
    let (_, watch) = node.rt.block_on(node.api.next_watch());
    let (lists_before, watches_before) = {
        let mut s = node.api.state.lock().unwrap();
        sa.write(TOKEN_2, &node.api.pki.ca_pem);
        s.require = Some(Accept {
            tokens: vec![TOKEN_2.into()],
            client_cert: None,
        });
        (s.lists.len(), s.watches.len())
    };
    let rotated = Instant::now();
    // The open watch ends (as an API server's does): the watcher must ask
    // again.
    drop(watch);
    wait_for(
        Duration::from_secs(150),
        "a watch with the new token",
        || {
            let s = node.api.state.lock().unwrap();
            s.watches[watches_before..]
                .iter()
                .any(|r| r.auth == auth(TOKEN_2))
                .then_some(())
        },
    );
    let recovered = rotated.elapsed();
    let (_, mut watch) = node.rt.block_on(node.api.next_watch());
    {
        let s = node.api.state.lock().unwrap();
        let accepted: Vec<_> = s.lists[lists_before..]
            .iter()
            .chain(&s.watches[watches_before..])
            .collect();
        assert!(
            accepted.iter().all(|r| r.auth == auth(TOKEN_2)),
            "{accepted:?}"
        );
        assert!(
            s.refused.iter().all(|r| r.auth == auth(TOKEN_1)),
            "only the old token was refused: {:?}",
            s.refused
        );
        eprintln!(
            "token rotation: the new token was used {:.1} s after the rotation, {} requests refused before",
            recovered.as_secs_f64(),
            s.refused.len()
        );
    }
    // kube-rs re-reads within a minute of its last read; the watcher's
    // backoff is at most 30 s.
    assert!(recovered < Duration::from_secs(100), "{recovered:?}");

    // The watch with the new token delivers: a pod added now names pid 4102.
    let added = cluster::event(
        "ADDED",
        cluster::seeded_pod("team-b", "infer-7f9c", 'b', "server", "cri-o"),
    );
    node.rt
        .block_on(watch.send_data(Bytes::from(added)))
        .unwrap();
    wait_for(
        Duration::from_secs(10),
        "the pod added after rotation",
        || {
            let m = ex.metrics();
            cluster::pods_resolved(&m, &["trainer-0", "infer-7f9c"]).then_some(())
        },
    );
    let refused = node.api.state.lock().unwrap().refused.len();
    if refused > 0 {
        let m = ex.metrics();
        let errors = m
            .get("gpumem_exporter_kubernetes_errors_total", &[])
            .unwrap_or(0.0);
        assert!(errors >= 1.0, "the 401s are counted: {errors}");
    }
}
