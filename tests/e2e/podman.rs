//! Container names from a real Podman (Debian's podman 4.3 with runc): its
//! Docker-compatible API (`podman system service`) on a socket in a temp
//! dir, containers made from a local image (a static busybox imported from
//! a tarball: no registry), their host pids listed by the fake NVML, the
//! exporter on the real /proc with Kubernetes off.
//!
//! Everything Podman keeps (storage, run state, the socket) is under one
//! temp dir ([`Podman`]); the [`Engine`] guard stops the service on drop,
//! and the Podman guard then removes the containers.

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::harness::podman::Podman;
use crate::harness::*;

const GPU: &str = "GPU-cccccccc-0000-0000-0000-000000000000";
const IMAGE: &str = "localhost/gpumem-e2e:busybox";
const BUSYBOX: &str = "/bin/busybox";

/// A Podman of its own ([`Podman`]) holding the busybox
/// image, and its API service.
struct Engine {
    podman: Podman,
    socket: PathBuf,
    service: Option<Child>,
}

impl Engine {
    fn new() -> Engine {
        let busybox = std::fs::read(BUSYBOX).unwrap_or_default();
        assert!(
            is_static_elf(&busybox),
            "{BUSYBOX} is missing or not static; install it: `apt-get install -y busybox-static` (scripts/ci/test does)"
        );
        let podman = Podman::new();
        let rootfs = podman.dir().join("rootfs");
        std::fs::create_dir_all(rootfs.join("bin")).unwrap();
        std::fs::copy(BUSYBOX, rootfs.join("bin/busybox")).unwrap();
        for applet in ["sh", "sleep"] {
            std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
        }
        let tar = podman.dir().join("rootfs.tar");
        let out = Command::new("tar")
            .arg("-C")
            .arg(&rootfs)
            .arg("-cf")
            .arg(&tar)
            .arg(".")
            .output()
            .expect("run tar");
        assert!(out.status.success(), "tar: {}", output_text(&out));
        podman.ok(&["import", tar.to_str().unwrap(), IMAGE]);
        let socket = podman.dir().join("api.sock");
        Engine {
            podman,
            socket,
            service: None,
        }
    }

    fn ok(&self, args: &[&str]) -> String {
        self.podman.ok(args)
    }

    /// Start the API service and wait until its socket accepts.
    fn start_service(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
        let uri = format!("unix://{}", self.socket.display());
        let child = self
            .podman
            .cmd(&["system", "service", "--time=0", &uri])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn podman system service");
        self.service = Some(child);
        wait_for(Duration::from_secs(20), "the podman API socket", || {
            UnixStream::connect(&self.socket).ok()
        });
    }

    fn stop_service(&mut self) {
        if let Some(mut c) = self.service.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(&self.socket);
    }

    /// Run `sleep` in a new container; its full id and host pid.
    fn container(&self, name: &str, labels: &[&str]) -> (String, u32) {
        let mut args = vec!["run", "-d", "--network", "none", "--name", name];
        for l in labels {
            args.extend(["--label", l]);
        }
        args.extend([IMAGE, "sleep", "600"]);
        let id = self.ok(&args);
        let pid = self.ok(&["inspect", "-f", "{{.State.Pid}}", name]);
        (id, pid.parse().expect("a pid"))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop_service();
    }
}

/// A 64-bit ELF without a PT_INTERP program header (runs without a
/// dynamic loader, so alone in an image).
fn is_static_elf(b: &[u8]) -> bool {
    let u16_at = |o: usize| {
        b.get(o..o + 2)
            .map(|s| u16::from_le_bytes([s[0], s[1]]) as usize)
    };
    let u64_at = |o: usize| {
        b.get(o..o + 8)
            .map(|s| u64::from_le_bytes(s.try_into().unwrap()) as usize)
    };
    if !b.starts_with(b"\x7fELF\x02") {
        return false;
    }
    let (Some(phoff), Some(size), Some(count)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38)) else {
        return false;
    };
    (0..count).all(|i| b.get(phoff + i * size..phoff + i * size + 4) != Some(&[3, 0, 0, 0][..]))
}

fn scenario_yaml(pids: &[u32]) -> String {
    let mut y = format!(
        "devices:\n  - uuid: {GPU}\n    memory: {{total: 85899345920, reserved: 536870912, used: 30000000000}}\n    processes:\n"
    );
    for (i, pid) in pids.iter().enumerate() {
        y.push_str(&format!(
            "      - {{pid: {pid}, used: {}}}\n",
            (i + 1) << 30
        ));
    }
    y
}

/// The labels of `gpu_process_info` for `pid`, once there is one.
fn info_of(m: &Metrics, pid: u32) -> std::collections::BTreeMap<String, String> {
    let found = m.find("gpu_process_info", &[("pid", &pid.to_string())]);
    assert_eq!(found.len(), 1, "gpu_process_info pid {pid}:\n{}", m.text);
    found[0].0.clone()
}

fn lookups(m: &Metrics, result: &str) -> u64 {
    m.get_u64(
        "gpumem_exporter_container_lookups_total",
        &[("result", result)],
    )
    .unwrap_or(0)
}

fn named(ex: &Exporter, pid: u32, name: &str) -> Option<Metrics> {
    let m = ex.metrics();
    let l = info_of(&m, pid);
    (l.get("container_name").map(String::as_str) == Some(name)).then_some(m)
}

#[test]
fn podman_containers_are_named_and_lookups_survive_the_engine_going_away() {
    let started = Instant::now();
    let mut podman = Engine::new();
    podman.start_service();
    let (a_id, a_pid) = podman.container("trainer-a", &[]);
    let (b_id, b_pid) = podman.container(
        "shop-trainer-1",
        &[
            "com.docker.compose.project=shop",
            "com.docker.compose.service=trainer",
        ],
    );
    let cgroup = std::fs::read_to_string(format!("/proc/{a_pid}/cgroup")).unwrap();
    assert!(
        cgroup.contains(&format!("libpod-{a_id}")),
        "trainer-a's cgroup:\n{cgroup}"
    );
    let setup = started.elapsed();

    let scenario = Scenario::new(&scenario_yaml(&[a_pid, b_pid]));
    let socket = podman.socket.to_str().unwrap().to_string();
    let ex = Exporter::start(
        &scenario,
        &[
            "--containers.engine-socket",
            &socket,
            "--sample-interval",
            "100ms",
        ],
    );
    let m = wait_for(Duration::from_secs(10), "trainer-a named", || {
        named(&ex, a_pid, "trainer-a")
    });
    let m = if info_of(&m, b_pid).contains_key("container_name") {
        m
    } else {
        wait_for(Duration::from_secs(10), "shop-trainer-1 named", || {
            named(&ex, b_pid, "shop-trainer-1")
        })
    };
    let a = info_of(&m, a_pid);
    assert_eq!(a["container_id"], a_id);
    assert_eq!(a["container_name"], "trainer-a");
    assert_eq!(a["container_image"], IMAGE);
    assert!(!a.contains_key("compose_project"), "{a:?}");
    assert!(!a.contains_key("compose_service"), "{a:?}");
    let b = info_of(&m, b_pid);
    assert_eq!(b["container_id"], b_id);
    assert_eq!(b["container_name"], "shop-trainer-1");
    assert_eq!(b["container_image"], IMAGE);
    assert_eq!(b["compose_project"], "shop");
    assert_eq!(b["compose_service"], "trainer");
    assert_eq!(
        (
            lookups(&m, "found"),
            lookups(&m, "not_found"),
            lookups(&m, "error")
        ),
        (2, 0, 0),
        "one lookup per container"
    );
    // The JSON API carries them too.
    let json = ex.get("/api/v1/snapshot").body;
    assert!(
        json.contains("\"container_name\":\"shop-trainer-1\""),
        "{json}"
    );
    assert!(json.contains("\"compose_service\":\"trainer\""), "{json}");

    // 1,000 scrapes (and the ticks meanwhile) ask the engine nothing.
    let t = Instant::now();
    for _ in 0..1000 {
        assert_eq!(ex.get("/metrics").status, 200);
    }
    let scrapes = t.elapsed();
    let m = ex.metrics();
    assert_eq!(
        (
            lookups(&m, "found"),
            lookups(&m, "not_found"),
            lookups(&m, "error")
        ),
        (2, 0, 0),
        "an API call during 1,000 scrapes"
    );

    // The engine goes away; a new container appears on the GPU.
    podman.stop_service();
    let (c_id, c_pid) = podman.container("trainer-c", &[]);
    scenario.write(&scenario_yaml(&[a_pid, b_pid, c_pid]));
    let m = wait_for(Duration::from_secs(10), "a failed lookup counted", || {
        let m = ex.metrics();
        (lookups(&m, "error") >= 1
            && !m
                .find("gpu_process_info", &[("pid", &c_pid.to_string())])
                .is_empty())
        .then_some(m)
    });
    let c = info_of(&m, c_pid);
    assert_eq!(c["container_id"], c_id, "still attributed by its cgroup");
    assert!(!c.contains_key("container_name"), "{c:?}");
    assert_eq!(info_of(&m, a_pid)["container_name"], "trainer-a");
    assert_eq!(info_of(&m, b_pid)["compose_project"], "shop");
    let used = m.find(
        "gpu_process_memory_used_bytes",
        &[("pid", &c_pid.to_string())],
    );
    assert_eq!(used.len(), 1, "{}", m.text);
    assert_eq!(used[0].1, f64::from(3u32 << 30));
    assert_eq!(ex.get("/readyz").status, 200);
    ex.assert_logged_once("container engine lookup failed");

    // It comes back: the failed id is retried within seconds.
    let t = Instant::now();
    podman.start_service();
    let m = wait_for(Duration::from_secs(40), "trainer-c named", || {
        named(&ex, c_pid, "trainer-c")
    });
    let back = t.elapsed();
    assert_eq!(info_of(&m, c_pid)["container_image"], IMAGE);
    assert_eq!(lookups(&m, "found"), 3);
    eprintln!(
        "podman e2e: setup {setup:?}, 1,000 scrapes {scrapes:?}, names back {back:?} after the service returned, total {:?}",
        started.elapsed()
    );
}
