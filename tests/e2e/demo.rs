//! `scripts/demo` as a newcomer runs it, on the binaries this test binary
//! was built with (`GPUMEM_DEMO_BINARY`, `GPUMEM_DEMO_NVML`: the demo's
//! own `cargo build` would build the crate again without this feature and
//! replace the binary other tests are running): the README promises that
//! its processes have names, users and pods. So every process of the
//! example scenario has its name and user, the two in pods their namespace
//! and pod (the demo's fake cgroup filesystem holds their cgroups, so the
//! owner check passes), nothing is refused, and on SIGTERM the demo leaves
//! nothing behind: no process, no temp directory.
//!
//! Needs python3 (the demo's fake Kubernetes API).

use std::process::Command;
use std::time::Duration;

use crate::harness::tools::require_tool;
use crate::harness::*;

/// Namespace and pod.
type Pod = (&'static str, &'static str);

/// (pid, process, user, namespace and pod where it runs in one): what the
/// demo's fake /proc, passwd file and Kubernetes API say.
const PROCESSES: [(&str, &str, &str, Option<Pod>); 5] = [
    ("436", "python3", "alice", Some(("team-1", "trainer-1"))),
    ("1201", "Xorg", "root", None),
    ("1202", "blender", "bob", None),
    ("1203", "ollama", "ollama", None),
    ("2001", "python3", "alice", Some(("team-2", "trainer-2"))),
];

#[test]
fn the_demo_names_its_processes_users_and_pods_and_refuses_nothing() {
    require_tool("python3");
    // The demo's mktemp -d lands here: what it leaves behind is visible.
    let tmp = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(repo_file("scripts/demo"));
    cmd.arg("--web.listen-address=127.0.0.1:0")
        .env("GPUMEM_DEMO_BINARY", BIN)
        .env("GPUMEM_DEMO_NVML", fake_nvml())
        .env("TMPDIR", tmp.path())
        .env("HOME", tmp.path());
    for key in [
        "FAKE_NVML_CONFIG",
        "KUBECONFIG",
        "KUBERNETES_SERVICE_HOST",
        "KUBERNETES_SERVICE_PORT",
        "NODE_NAME",
    ] {
        cmd.env_remove(key);
    }
    let mut demo = Exporter::spawn(cmd);

    let m = wait_for(Duration::from_secs(20), "both pods named", || {
        let m = demo.metrics();
        PROCESSES
            .iter()
            .filter_map(|p| p.3)
            .all(|(namespace, pod)| {
                !m.find(
                    "gpu_process_memory_used_bytes",
                    &[("namespace", namespace), ("pod", pod)],
                )
                .is_empty()
            })
            .then_some(m)
    });
    for (pid, process, user, pod) in PROCESSES {
        let info = m.find(
            "gpu_process_info",
            &[("pid", pid), ("process", process), ("user", user)],
        );
        assert_eq!(info.len(), 1, "pid {pid}: {process} of {user}\n{}", m.text);
        // Ollama's bytes are unavailable in the scenario (NVML's "no
        // value"): it has its info series but no memory series.
        match pod {
            Some((namespace, pod)) => assert_eq!(
                m.find(
                    "gpu_process_memory_used_bytes",
                    &[("pid", pid), ("namespace", namespace), ("pod", pod)],
                )
                .len(),
                1,
                "pid {pid}: namespace {namespace}, pod {pod}\n{}",
                m.text
            ),
            None => assert!(
                !info[0].0.contains_key("pod_uid"),
                "pid {pid} is on the host: {info:?}"
            ),
        }
    }
    let rejected = m.find("gpumem_exporter_attribution_rejected_total", &[]);
    assert!(!rejected.is_empty(), "{}", m.text);
    assert!(
        rejected.iter().all(|(_, v)| *v == 0.0),
        "refused: {rejected:?}"
    );

    // Ctrl-C's signal to the script: it stops the exporter and the fake
    // API and removes its temp directory (fake /proc, cgroups, config).
    let (status, _) = demo.signal("TERM");
    assert_eq!(status.code(), Some(130), "{}", demo.stderr());
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(left.is_empty(), "the demo left {left:?}");
}
