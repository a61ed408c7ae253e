//! A hostile tenant tries to forge attribution (issue 36, attacks 1 and
//! 8), as root on the real cgroup filesystem with a real unprivileged uid
//! (65534, `nobody`): the exporter reads the real /proc and
//! /sys/fs/cgroup, the fake NVML lists the processes on a GPU, and a local
//! Kubernetes API knows the victim's pod.
//!
//! - Attack 1: a uid-65534 process in cgroups it made itself, below a
//!   `user@65534.service` that root delegated to it as systemd does
//!   (chowned), names a Slurm job and another pod's pod UID and container
//!   id; one names them at the kubelet's real place below a directory an
//!   admin chowned to it; root places one in a real Slurm v1 job of
//!   another uid; a root process nests a victim's pod below its own
//!   container. None of them gets the victim's labels, each refusal is
//!   counted by reason, while the victim's own process, in the kubelet's
//!   real cgroup, and a real job of uid 65534 keep theirs.
//! - Attack 1 from inside a cgroup namespace (the DaemonSet on a cgroup
//!   v2 node): the exporter in a child cgroup and `unshare --cgroup`, so
//!   other paths read `/../…`; the victim keeps its pod, a real v2 Slurm
//!   job its job, the tenant's copy of the victim's path is still refused.
//! - Attack 8: the job-mapping directory with a symlink `0` to a
//!   root-only file, a FIFO `1` and a good `2`: no label from the symlink,
//!   allocations keep updating past the FIFO; a directory others may
//!   write is refused.
//!
//! Needs root (cgroups, chown, setpriv, unshare, nsenter); v2 at `/sys/fs/cgroup` or
//! `/sys/fs/cgroup/unified`, v1's freezer at `/sys/fs/cgroup/freezer`.

use std::os::unix::fs::{MetadataExt, PermissionsExt, chown};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::harness::cluster::{FakeApi, NODE, pod};
use crate::harness::python::Py;
use crate::harness::tools::require_tool;
use crate::harness::*;

const GPU: &str = "GPU-7e4a0000-0000-0000-0000-000000000036";
const NOBODY: u32 = 65534;

/// Where cgroup v2 is on this host: the root on a pure v2 host, `unified/`
/// on systemd's hybrid layout.
fn v2_root() -> PathBuf {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.controllers").is_file() {
        return root.to_path_buf();
    }
    let unified = root.join("unified");
    assert!(
        unified.join("cgroup.controllers").is_file(),
        "the tenant tests need cgroup v2 at /sys/fs/cgroup or /sys/fs/cgroup/unified (and root)"
    );
    unified
}

const FREEZER: &str = "/sys/fs/cgroup/freezer";

/// Cgroups made for the test, removed (deepest first) on drop, with the
/// processes in them killed first.
#[derive(Default)]
struct Cgroups {
    made: Vec<PathBuf>,
    children: Vec<Child>,
}

impl Cgroups {
    /// `path` and its missing ancestors, as root.
    fn make(&mut self, path: &Path) {
        let mut missing = Vec::new();
        let mut p = path.to_path_buf();
        while !p.exists() {
            missing.push(p.clone());
            p.pop();
        }
        for dir in missing.into_iter().rev() {
            std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
            self.made.push(dir);
        }
    }

    /// What systemd does for `Delegate=yes` with `User=`: the directory
    /// and its `cgroup.procs`, `cgroup.subtree_control` and
    /// `cgroup.threads` belong to `uid`.
    fn delegate(&mut self, path: &Path, uid: u32) {
        self.make(path);
        chown(path, Some(uid), Some(uid)).unwrap();
        for f in ["cgroup.procs", "cgroup.subtree_control", "cgroup.threads"] {
            let f = path.join(f);
            if f.exists() {
                chown(&f, Some(uid), Some(uid)).unwrap();
            }
        }
    }

    /// A process that starts as root in `start` (v2, or `None`) and, for
    /// v1, in `v1` too, then drops to `uid` (setpriv) and, as that uid,
    /// makes `own` (a v2 cgroup below `start`, the tenant's own doing) and
    /// moves itself there before it sleeps. Returns its pid once it sits
    /// where it asked to.
    fn spawn(
        &mut self,
        start: Option<&Path>,
        v1: Option<&Path>,
        uid: u32,
        own: Option<&Path>,
    ) -> u32 {
        let mut root_part = String::new();
        for dir in start.iter().chain(v1.iter()) {
            root_part.push_str(&format!("echo $$ > '{}/cgroup.procs' && ", dir.display()));
        }
        let tenant_part = match own {
            Some(own) => {
                // Recorded for removal; made by the tenant below.
                let mut p = own.to_path_buf();
                let mut mine = Vec::new();
                while !p.exists() {
                    mine.push(p.clone());
                    p.pop();
                }
                self.made.extend(mine.into_iter().rev());
                format!(
                    "mkdir -p '{o}' && echo $$ > '{o}/cgroup.procs' && ",
                    o = own.display()
                )
            }
            None => String::new(),
        };
        let script = format!(
            "{root_part}exec setpriv --reuid={uid} --regid={uid} --clear-groups sh -c \"{tenant_part}echo ready && exec sleep 600\""
        );
        let mut cmd = Command::new("sh");
        // sh, setpriv, sh, sleep: one group, killed together.
        own_group(&mut cmd);
        let mut child = cmd
            .arg("-c")
            .arg(&script)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        use std::io::BufRead;
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "{script}");
        let pid = child.id();
        self.children.push(child);
        pid
    }
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        for c in &mut self.children {
            kill_group(c);
        }
        for dir in self.made.iter().rev() {
            // A cgroup empties a moment after its last process exits.
            for _ in 0..50 {
                if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// A pod UID made of one repeated hex digit, and its systemd-escaped form.
fn uid(seed: char) -> (String, String) {
    let u = crate::harness::cluster::pod_uid(seed);
    let escaped = u.replace('-', "_");
    (u, escaped)
}

fn scenario(pids: &[u32]) -> String {
    let mut y = format!(
        "devices:\n  - uuid: {GPU}\n    memory: {{total: 85899345920, reserved: 536870912, used: 30000000000}}\n    processes:\n"
    );
    for (i, pid) in pids.iter().enumerate() {
        y.push_str(&format!(
            "      - {{pid: {pid}, used: {}}}\n",
            (i as u64 + 1) << 30
        ));
    }
    y
}

fn info(m: &Metrics, pid: u32) -> std::collections::BTreeMap<String, String> {
    let found = m.find("gpu_process_info", &[("pid", &pid.to_string())]);
    assert_eq!(found.len(), 1, "pid {pid}:\n{}", m.text);
    found[0].0.clone()
}

fn rejected(m: &Metrics, reason: &str) -> f64 {
    m.get(
        "gpumem_exporter_attribution_rejected_total",
        &[("reason", reason)],
    )
    .unwrap_or_else(|| panic!("no rejection counter {reason}:\n{}", m.text))
}

/// Attack 1: every forged path loses its job and pod labels, each refusal
/// is counted once by reason, and the legitimate processes beside them
/// keep theirs.
#[test]
fn forged_cgroups_give_no_job_and_no_pod() {
    let started = Instant::now();
    let v2 = v2_root();
    assert!(
        Path::new(FREEZER).join("cgroup.procs").is_file(),
        "the tenant tests need cgroup v1's freezer at {FREEZER} (and root)"
    );
    let tag = std::process::id();
    let (victim, victim_) = uid('7');
    let (own, own_) = uid('8');
    let victim_cid = "7".repeat(64);
    let own_cid = "8".repeat(64);
    let mut cg = Cgroups::default();

    // The victim's own process, where the kubelet puts it (root's).
    let kubepods = v2.join("kubepods.slice");
    let victim_scope = kubepods
        .join("kubepods-burstable.slice")
        .join(format!("kubepods-burstable-pod{victim_}.slice"))
        .join(format!("cri-containerd-{victim_cid}.scope"));
    cg.make(&victim_scope);
    let victim_pid = cg.spawn(Some(&victim_scope), None, 0, None);

    // A: uid 65534 in its own delegated subtree names Slurm job 4242.
    let user = v2
        .join("user.slice")
        .join(format!("user-{NOBODY}.slice"))
        .join(format!("user@{NOBODY}.service"));
    cg.delegate(&user, NOBODY);
    let forged_job = user.join("app.slice/slurmstepd.scope/job_4242/step_0");
    let pid_a = cg.spawn(Some(&user), None, NOBODY, Some(&forged_job));

    // B: the same subtree, the victim's pod UID and container id.
    let forged_pod = user
        .join("app.slice/kubepods.slice/kubepods-burstable.slice")
        .join(format!("kubepods-burstable-pod{victim_}.slice"))
        .join(format!("cri-containerd-{victim_cid}.scope"));
    let pid_b = cg.spawn(Some(&user), None, NOBODY, Some(&forged_pod));

    // C: the kubelet's real place, but below a QoS slice an admin handed
    // to uid 65534 (chowned): the tenant makes the victim's pod there.
    let besteffort = kubepods.join("kubepods-besteffort.slice");
    cg.delegate(&besteffort, NOBODY);
    let forged_at_place = besteffort
        .join(format!("kubepods-besteffort-pod{victim_}.slice"))
        .join(format!("cri-containerd-{victim_cid}.scope"));
    let pid_c = cg.spawn(Some(&besteffort), None, NOBODY, Some(&forged_at_place));

    // D: a real Slurm v1 job of uid 1000 (root-made), a uid-65534
    // process in it; S: a real job of uid 65534 itself, which counts.
    let slurm_root = Path::new(FREEZER).join(format!("slurm_tenant{tag}"));
    let other_job = slurm_root.join("uid_1000/job_4301/step_0");
    let own_job = slurm_root.join(format!("uid_{NOBODY}/job_4300/step_0"));
    cg.make(&other_job);
    cg.make(&own_job);
    let pid_d = cg.spawn(None, Some(&other_job), NOBODY, None);
    let pid_s = cg.spawn(None, Some(&own_job), NOBODY, None);

    // E: root in its own pod's container (a privileged pod) nests the
    // victim's pod below it.
    let own_scope = kubepods
        .join("kubepods-burstable.slice")
        .join(format!("kubepods-burstable-pod{own_}.slice"))
        .join(format!("cri-containerd-{own_cid}.scope"));
    let nested = own_scope
        .join("kubepods.slice")
        .join(format!("kubepods-pod{victim_}.slice"))
        .join(format!("cri-containerd-{victim_cid}.scope"));
    cg.make(&nested);
    let pid_e = cg.spawn(Some(&nested), None, 0, None);

    // The API knows both pods.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(FakeApi::start(
        vec![
            pod(
                "team-b",
                "victim-0",
                &victim,
                NODE,
                "10",
                &[("trainer", Some(format!("containerd://{victim_cid}")))],
            ),
            pod(
                "team-a",
                "attacker-0",
                &own,
                NODE,
                "10",
                &[("shell", Some(format!("containerd://{own_cid}")))],
            ),
        ],
        "10",
        0,
    ));
    let pids = [victim_pid, pid_a, pid_b, pid_c, pid_d, pid_s, pid_e];
    let scn = Scenario::new(&scenario(&pids));
    let config = format!(
        "sample_interval: 100ms\nkubernetes:\n  enabled: true\n  api_url: {}\n  ca_file: {}\n  node_name: {NODE}\n  pod_resources_socket: \"\"\n",
        api.url(),
        api.ca_file().display()
    );
    let ex = Exporter::with_config(&scn, &config, &[]);
    let m = wait_for(Duration::from_secs(10), "the victim's pod resolved", || {
        let m = ex.metrics();
        (m.find("gpu_process_memory_used_bytes", &[("pod", "victim-0")])
            .len()
            == 1
            && m.find("gpu_process_memory_used_bytes", &[("pod", "attacker-0")])
                .len()
                == 1)
            .then_some(m)
    });

    // The victim keeps its pod; the real job of uid 65534 keeps its job.
    let v = info(&m, victim_pid);
    assert_eq!(
        (v["pod_uid"].as_str(), v["container_id"].as_str()),
        (victim.as_str(), victim_cid.as_str())
    );
    let s = info(&m, pid_s);
    assert_eq!(
        (
            s["slurm_job"].as_str(),
            s["slurm_uid"].as_str(),
            s["user"].as_str()
        ),
        ("4300", "65534", "nobody")
    );
    // The forgeries: the pid series stays, without job or pod labels.
    for (name, pid) in [("A", pid_a), ("B", pid_b), ("C", pid_c), ("D", pid_d)] {
        let l = info(&m, pid);
        for label in [
            "slurm_job",
            "slurm_step",
            "slurm_uid",
            "pod_uid",
            "container_id",
        ] {
            assert!(
                !l.contains_key(label),
                "{name} (pid {pid}) has {label}: {l:?}"
            );
        }
        assert_eq!(l["process"], "sleep", "{name}");
        assert_eq!(l["user"], "nobody", "{name}");
        let value = m.find(
            "gpu_process_memory_used_bytes",
            &[("pid", &pid.to_string())],
        );
        assert_eq!(value.len(), 1, "{name}");
        assert!(!value[0].0.contains_key("pod"), "{name}: {:?}", value[0].0);
    }
    // E is its own pod's, not the victim's.
    let e = info(&m, pid_e);
    assert_eq!(
        (e["pod_uid"].as_str(), e["container_id"].as_str()),
        (own.as_str(), own_cid.as_str())
    );
    // Only the victim's own series carry the victim's ids.
    only_the_victims_series_carry_its_ids(&m.text, &victim, &victim_cid, victim_pid);
    assert!(!m.text.contains("slurm_job=\"4242\""), "{}", m.text);
    assert!(!m.text.contains("slurm_job=\"4301\""), "{}", m.text);

    // Counted once per process and reason, also over later samples.
    std::thread::sleep(Duration::from_millis(500));
    let m = ex.metrics();
    let counts: Vec<(&str, f64)> = [
        "cgroup_owner",
        "cgroup_unverified",
        "cgroup_misplaced",
        "container_pod_mismatch",
        "slurm_owner",
    ]
    .into_iter()
    .map(|r| (r, rejected(&m, r)))
    .collect();
    assert_eq!(
        counts,
        vec![
            ("cgroup_owner", 3.0),
            ("cgroup_unverified", 0.0),
            ("cgroup_misplaced", 0.0),
            ("container_pod_mismatch", 0.0),
            ("slurm_owner", 1.0),
        ]
    );
    let log = ex.stderr();
    assert!(
        log.contains("reason=cgroup_owner") && log.contains("owned by uid 65534"),
        "{log}"
    );
    assert!(log.contains("reason=slurm_owner"), "{log}");
    eprintln!(
        "tenant: 4 forged processes refused ({counts:?}), victim {victim_pid} and job 4300 kept theirs, in {:.2?}",
        started.elapsed()
    );
    drop(ex);
    drop(cg);
}

/// The job-mapping directory of the exporter: files as a prolog writes
/// them, root's, mode 0755.
fn mapping_dir(scn: &Scenario) -> PathBuf {
    let dir = scn.dir.path().join("slurm-jobs");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

fn alloc_jobs(m: &Metrics) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = m
        .find("gpu_allocation_info", &[])
        .into_iter()
        .filter_map(|(l, _)| Some((l.get("uuid")?.clone(), l.get("slurm_job")?.clone())))
        .collect();
    v.sort();
    v
}

/// Attack 8: a symlink `0` to a root-only file puts nothing in a label, a
/// FIFO `1` nobody writes does not stall the reader (GPU 2's allocation
/// follows the prolog within a few reads), both counted as not_regular;
/// a directory others may write is refused whole, with a clear line.
#[test]
fn the_job_mapping_follows_no_symlink_and_waits_on_no_fifo() {
    let started = Instant::now();
    let yaml = |n: usize| {
        let mut y = String::from("devices:\n");
        for i in 0..n {
            y.push_str(&format!(
                "  - uuid: GPU-7e4a0000-0000-0000-0000-00000000080{i}\n    memory: {{total: 85899345920, reserved: 536870912, used: 1000000}}\n    processes: []\n"
            ));
        }
        y
    };
    let scn = Scenario::new(&yaml(3));
    let dir = mapping_dir(&scn);
    // A root-only file whose content would be a valid job id.
    let secret = scn.dir.path().join("secret");
    std::fs::write(&secret, "s3cr3t\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::symlink(&secret, dir.join("0")).unwrap();
    let fifo = std::ffi::CString::new(dir.join("1").to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0, "mkfifo");
    std::fs::write(dir.join("2"), "5001\n").unwrap();
    let config = format!(
        "sample_interval: 100ms\nkubernetes:\n  enabled: false\nslurm:\n  job_mapping_dir: {}\n  job_mapping_interval: 100ms\n",
        dir.display()
    );
    let ex = Exporter::with_config(&scn, &config, &[]);
    let gpu2 = "GPU-7e4a0000-0000-0000-0000-000000000802".to_string();
    let m = wait_for(Duration::from_secs(10), "GPU 2's job", || {
        let m = ex.metrics();
        (alloc_jobs(&m) == vec![(gpu2.clone(), "5001".into())]).then_some(m)
    });
    assert!(!m.text.contains("s3cr3t"), "{}", m.text);
    // The prolog moves the job on while the FIFO is still there: the
    // reader is not stuck on it.
    let moved = Instant::now();
    let tmp = dir.join(".2.tmp");
    std::fs::write(&tmp, "5002\n").unwrap();
    std::fs::rename(&tmp, dir.join("2")).unwrap();
    let m = wait_for(Duration::from_secs(5), "GPU 2's next job", || {
        let m = ex.metrics();
        (alloc_jobs(&m) == vec![(gpu2.clone(), "5002".into())]).then_some(m)
    });
    let followed = moved.elapsed();
    let not_regular = m
        .get(
            "gpumem_exporter_slurm_job_mapping_errors_total",
            &[("reason", "not_regular")],
        )
        .unwrap();
    let reads = m
        .get("gpumem_exporter_slurm_job_mapping_reads_total", &[])
        .unwrap();
    // Two entries refused on every read.
    assert!(not_regular >= 2.0 * (reads - 1.0), "{not_regular} {reads}");
    assert!(!m.text.contains("s3cr3t"), "{}", m.text);

    // World-writable: refused whole, no rows, one clear line.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let m = wait_for(Duration::from_secs(5), "the directory refused", || {
        let m = ex.metrics();
        (m.get(
            "gpumem_exporter_slurm_job_mapping_errors_total",
            &[("reason", "unsafe_dir")],
        )
        .unwrap_or(0.0)
            >= 1.0
            && alloc_jobs(&m).is_empty())
        .then_some(m)
    });
    assert!(alloc_jobs(&m).is_empty());
    ex.assert_logged_once(
        "Slurm job-mapping directory refused: mode 0777 lets group or others write",
    );
    // Owned by uid 65534: refused too.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    chown(&dir, Some(NOBODY), Some(NOBODY)).unwrap();
    let before = m
        .get(
            "gpumem_exporter_slurm_job_mapping_errors_total",
            &[("reason", "unsafe_dir")],
        )
        .unwrap();
    wait_for(
        Duration::from_secs(5),
        "the user's directory refused",
        || {
            let m = ex.metrics();
            (m.get(
                "gpumem_exporter_slurm_job_mapping_errors_total",
                &[("reason", "unsafe_dir")],
            )
            .unwrap_or(0.0)
                > before + 1.0
                && alloc_jobs(&m).is_empty())
            .then_some(())
        },
    );
    // Back to root's: read again.
    chown(&dir, Some(0), Some(0)).unwrap();
    wait_for(Duration::from_secs(5), "the directory read again", || {
        (alloc_jobs(&ex.metrics()) == vec![(gpu2.clone(), "5002".into())]).then_some(())
    });
    eprintln!(
        "tenant: job mapping: symlink and FIFO refused ({not_regular} times in {reads} reads), a new job followed in {followed:.2?} past the FIFO, unsafe directories refused; {:.2?}",
        started.elapsed()
    );
}

/// The exporter in a cgroup namespace of its own, as containerd and CRI-O
/// run a non-privileged DaemonSet pod on a cgroup v2 node: it starts in a
/// child cgroup of its own, then `unshare --cgroup`, so every other
/// process's v2 path reads `/../…`. The victim's process, in the kubelet's
/// real root-owned cgroup, keeps its pod; a real (root-made) Slurm v2
/// job keeps its job; uid 65534's copy of the victim's pod path in its own
/// delegated subtree is still refused, as `cgroup_owner` (placed, then
/// found the tenant's), not merely `cgroup_unverified`.
#[test]
fn a_namespaced_exporter_places_paths_in_the_host_tree() {
    let started = Instant::now();
    let unshare = require_tool("unshare");
    let nsenter = require_tool("nsenter");
    let v2 = v2_root();
    let tag = std::process::id();
    let (victim, victim_) = uid('6');
    let victim_cid = "6".repeat(64);
    let mut cg = Cgroups::default();

    // The exporter's own cgroup, the root of its namespace-to-be.
    let exporter_cg = v2.join(format!("gpumem-exporter-ns{tag}.scope"));
    cg.make(&exporter_cg);

    // The victim, where the kubelet puts a Guaranteed pod (root's).
    let victim_scope = v2
        .join("kubepods.slice")
        .join(format!("kubepods-pod{victim_}.slice"))
        .join(format!("cri-containerd-{victim_cid}.scope"));
    cg.make(&victim_scope);
    let victim_pid = cg.spawn(Some(&victim_scope), None, 0, None);

    // A real Slurm v2 job of uid 65534 (slurmd's cgroup, root-made).
    let job = v2.join(format!("system.slice/slurmstepd.scope/job_44{tag}/step_0"));
    cg.make(&job);
    let job_pid = cg.spawn(Some(&job), None, NOBODY, None);

    // The tenant: the victim's pod path in its own delegated subtree.
    let user = v2
        .join("user.slice")
        .join(format!("user-{NOBODY}.slice"))
        .join(format!("user@{NOBODY}.service"));
    cg.delegate(&user, NOBODY);
    let forged = user
        .join(format!("ns{tag}.slice/kubepods.slice"))
        .join(format!("kubepods-pod{victim_}.slice"))
        .join(format!("cri-containerd-{victim_cid}.scope"));
    let forged_pid = cg.spawn(Some(&user), None, NOBODY, Some(&forged));

    let rt = tokio::runtime::Runtime::new().unwrap();
    let api = rt.block_on(FakeApi::start(
        vec![pod(
            "team-b",
            "victim-0",
            &victim,
            NODE,
            "10",
            &[("trainer", Some(format!("containerd://{victim_cid}")))],
        )],
        "10",
        0,
    ));
    let scn = Scenario::new(&scenario(&[victim_pid, job_pid, forged_pid]));
    let config = format!(
        "sample_interval: 100ms\nkubernetes:\n  enabled: true\n  api_url: {}\n  ca_file: {}\n  node_name: {NODE}\n  pod_resources_socket: \"\"\n",
        api.url(),
        api.ca_file().display()
    );
    let cfg = scn.file("config.yaml", config.as_bytes());
    // Into its own cgroup, then a cgroup namespace rooted there.
    let mut wrapper = Command::new("sh");
    wrapper
        .arg("-c")
        .arg(format!(
            "echo $$ > '{}/cgroup.procs' && exec {unshare} --cgroup \"$@\"",
            exporter_cg.display()
        ))
        .arg("sh")
        .arg(BIN);
    let ex = Exporter::spawn(Exporter::command(
        wrapper,
        &scn,
        &["--config.file", cfg.to_str().unwrap()],
    ));

    // What the exporter reads really is relative: from inside its
    // namespace the victim's v2 path leaves it.
    let seen = Command::new(nsenter)
        .args(["-t", &ex.child.id().to_string(), "-C", "cat"])
        .arg(format!("/proc/{victim_pid}/cgroup"))
        .output()
        .unwrap();
    let seen = String::from_utf8_lossy(&seen.stdout).into_owned();
    let v2_line = seen.lines().find(|l| l.starts_with("0::")).unwrap_or("");
    assert!(
        v2_line.starts_with("0::/../kubepods.slice/"),
        "the exporter's view: {seen}"
    );

    let m = wait_for(Duration::from_secs(10), "the victim's pod resolved", || {
        let m = ex.metrics();
        (m.find("gpu_process_memory_used_bytes", &[("pod", "victim-0")])
            .len()
            == 1)
            .then_some(m)
    });
    let resolved = started.elapsed();
    let v = info(&m, victim_pid);
    assert_eq!(
        (v["pod_uid"].as_str(), v["container_id"].as_str()),
        (victim.as_str(), victim_cid.as_str())
    );
    let j = info(&m, job_pid);
    let want_job = format!("44{tag}");
    assert_eq!(
        (j["slurm_job"].as_str(), j["slurm_step"].as_str()),
        (want_job.as_str(), "0")
    );
    let f = info(&m, forged_pid);
    for label in ["slurm_job", "pod_uid", "container_id"] {
        assert!(!f.contains_key(label), "forged pid has {label}: {f:?}");
    }
    assert_eq!(f["user"], "nobody");
    only_the_victims_series_carry_its_ids(&m.text, &victim, &victim_cid, victim_pid);

    std::thread::sleep(Duration::from_millis(500));
    let m = ex.metrics();
    let counts: Vec<(&str, f64)> = ["cgroup_owner", "cgroup_unverified", "cgroup_misplaced"]
        .into_iter()
        .map(|r| (r, rejected(&m, r)))
        .collect();
    assert_eq!(
        counts,
        vec![
            ("cgroup_owner", 1.0),
            ("cgroup_unverified", 0.0),
            ("cgroup_misplaced", 0.0)
        ]
    );
    let log = ex.stderr();
    // One line per hierarchy placed: v2 at the exporter's own cgroup
    // (v1 hierarchies where the test runner's cgroups are, if not at
    // their tops).
    let placed_lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("runs in a cgroup namespace of its own: its root placed"))
        .collect();
    let v2_placed: Vec<&&str> = placed_lines
        .iter()
        .filter(|l| field(l, "hierarchy") == Some("0::"))
        .collect();
    assert_eq!(
        v2_placed.len(),
        1,
        "the v2 namespace root is looked for and placed once:\n{log}"
    );
    let placed = *v2_placed[0];
    let root = format!("root=/gpumem-exporter-ns{tag}.scope");
    assert!(placed.contains(&root), "{placed}");
    let v1_placed: Vec<String> = placed_lines
        .iter()
        .filter(|l| field(l, "hierarchy") != Some("0::"))
        .map(|l| {
            format!(
                "{} at {}",
                field(l, "hierarchy").unwrap_or("?"),
                field(l, "root").unwrap_or("?")
            )
        })
        .collect();
    eprintln!(
        "tenant: namespaced exporter sees {v2_line:?}; v2 root placed, {} {}; v1 roots placed: {v1_placed:?}; victim {victim_pid} kept pod victim-0, job {want_job} kept, forged pid {forged_pid} refused ({counts:?}); pods resolved after {resolved:.2?}, test {:.2?}",
        field(placed, "dirs").map_or("?".into(), |d| format!("walked dirs={d}")),
        field(placed, "took").map_or("".into(), |t| format!("took={t}")),
        started.elapsed()
    );
    drop(ex);
    drop(cg);
}

/// Every process series naming the victim's pod uid, container id or pod
/// name is the victim process's own (at least two of them). The workload
/// counters (`gpu_workload_*`) carry the pod's ids and no pid: they are the
/// victim's pod's own, not a process's.
fn only_the_victims_series_carry_its_ids(
    text: &str,
    victim: &str,
    victim_cid: &str,
    victim_pid: impl std::fmt::Display,
) {
    let series: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with("gpu_workload_"))
        .filter(|l| l.contains(victim) || l.contains(victim_cid) || l.contains("victim-0"))
        .collect();
    let own = format!("pid=\"{victim_pid}\"");
    assert!(
        series.len() >= 2 && series.iter().all(|l| l.contains(&own)),
        "{series:#?}"
    );
}

/// The torch bridge's budgets per pod: a socket the exporter (root)
/// listens on, in a root-owned directory.
fn bridge_socket() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.path().join("bridge.sock");
    (dir, path)
}

/// [`scenario`], with an empty list where there are no pids.
fn bridge_scenario(pids: &[u32]) -> String {
    if pids.is_empty() {
        return scenario(pids).replace("processes:\n", "processes: []\n");
    }
    scenario(pids)
}

fn bridge_exporter(scn: &Scenario, socket: &Path) -> Exporter {
    let config = format!(
        "sample_interval: 100ms\nmemory_sample_interval: 100ms\nprocesses:\n  torch_bridge_socket: {}\n",
        socket.display()
    );
    let ex = Exporter::with_config(scn, &config, &[]);
    wait_for(
        Duration::from_secs(20),
        "the bridge socket and a sample",
        || (socket.exists() && ex.get("/metrics").status == 200).then_some(()),
    );
    ex
}

/// A Guaranteed pod's container cgroup where the kubelet puts it (root's):
/// straight below `kubepods.slice`, so no QoS slice is shared with the
/// forging test, which hands `kubepods-besteffort.slice` to uid 65534
/// while the tests run in parallel.
fn pod_scope(cg: &mut Cgroups, seed: char) -> PathBuf {
    let (_, escaped) = uid(seed);
    let v2 = v2_root();
    let scope = v2
        .join("kubepods.slice")
        .join(format!("kubepods-pod{escaped}.slice"))
        .join(format!(
            "cri-containerd-{}.scope",
            seed.to_string().repeat(64)
        ));
    cg.make(&scope);
    // Every directory on the way must be root's, or the exporter rightly
    // refuses the pod and the test would fail for the wrong reason.
    for dir in scope.ancestors().take_while(|d| d.starts_with(&v2)) {
        let owner = std::fs::metadata(dir).unwrap().uid();
        assert_eq!(
            owner,
            0,
            "{} is owned by uid {owner}, not root: a leftover of an earlier run? (remove it)",
            dir.display()
        );
    }
    scope
}

/// Python that moves itself into `scope` (as root), then runs `then`.
fn in_scope(scope: &Path, then: &str) -> String {
    format!(
        "import json, os, socket, sys, time\n\
         open({procs:?}, 'w').write(str(os.getpid()))\n\
         {then}",
        procs = scope.join("cgroup.procs").to_str().unwrap(),
    )
}

fn a_doc(allocated: u64) -> String {
    format!(
        "b'gpumem-bridge 1\\n' + json.dumps(dict(v=1, devices=[dict(uuid={GPU:?}, allocated={allocated}, reserved={allocated}, allocated_peak=0, reserved_peak=0, active=0, inactive_split=0, alloc_retries=0, ooms=0)])).encode()"
    )
}

fn bridge_limited(m: &Metrics, reason: &str) -> u64 {
    m.get_u64(
        "gpumem_exporter_torch_bridge_limited_total",
        &[("reason", reason)],
    )
    .unwrap_or(0)
}

/// 64 connections of one uid-0 pod do not lock out a new uid-0 bridge of
/// another pod: the budget holder is the pod (its root-owned cgroup
/// path), not uid 0. The first pod's 65th connection is refused.
#[test]
fn one_uid_0_pod_cannot_lock_out_another() {
    let mut cg = Cgroups::default();
    let (a, b) = (pod_scope(&mut cg, 'a'), pod_scope(&mut cg, 'b'));
    let (_dir, socket) = bridge_socket();
    let scn = Scenario::new(&bridge_scenario(&[]));
    let ex = bridge_exporter(&scn, &socket);
    let sock = socket.to_str().unwrap();
    let hog = Py::spawn(
        &in_scope(
            &a,
            &format!(
                "conns = []\n\
                 for i in range(64):\n\
                 \x20   s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n\
                 \x20   s.connect({sock:?})\n\
                 \x20   conns.append(s)\n\
                 print('ready', os.getpid(), flush=True)\n\
                 sys.stdin.read()\n"
            ),
        ),
        &[],
    );
    wait_for(Duration::from_secs(20), "64 connections open", || {
        (ex.metrics()
            .get_u64("gpumem_exporter_torch_bridge_connections", &[])
            == Some(64))
        .then_some(())
    });
    // One more of the same pod: refused.
    let extra = Py::spawn(
        &in_scope(
            &a,
            &format!(
                "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n\
                 s.connect({sock:?})\n\
                 print('ready', os.getpid(), flush=True)\n\
                 sys.stdin.read()\n"
            ),
        ),
        &[],
    );
    wait_for(Duration::from_secs(20), "the 65th refused", || {
        (bridge_limited(&ex.metrics(), "connections") == 1).then_some(())
    });
    // Another pod's bridge, uid 0 too: its figures arrive.
    let other = Py::spawn(
        &in_scope(
            &b,
            &format!(
                "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n\
                 s.connect({sock:?})\n\
                 s.send({doc})\n\
                 print('ready', os.getpid(), flush=True)\n\
                 sys.stdin.read()\n",
                doc = a_doc(5_000_000_017)
            ),
        ),
        &[],
    );
    scn.write(&scenario(&[other.pid]));
    let m = wait_for(Duration::from_secs(20), "the other pod's figures", || {
        let m = ex.metrics();
        let found = m.find(
            "gpu_process_torch_allocated_bytes",
            &[("pid", &other.pid.to_string())],
        );
        (found.first().map(|(_, v)| *v) == Some(5_000_000_017.0)).then_some(m)
    });
    println!(
        "uid-0 pods: pod A holds 64 connections (its 65th refused: limited{{connections}} {}); pod B's bridge accepted, connections {:?}",
        bridge_limited(&m, "connections"),
        m.get_u64("gpumem_exporter_torch_bridge_connections", &[])
    );
    assert_eq!(bridge_limited(&m, "connections"), 1, "{}", m.text);
    drop((hog, extra, other));
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// The DaemonSet's memory limit (deploy/kubernetes/base/daemonset.yaml).
const DAEMONSET_LIMIT_MIB: f64 = 160.0;

/// 512 connections, each of its own process (8 pods of 64, all on the
/// GPU), each holding a 64 KiB document of as many devices as fit: the
/// documents kept stay within their bounds and the exporter's RSS well
/// within the DaemonSet's limit.
#[test]
fn five_hundred_twelve_big_documents_keep_rss_bounded() {
    let _heavy = heavy();
    let mut cg = Cgroups::default();
    let seeds = ['0', '1', '2', '3', '4', '5', '6', '9'];
    let scopes: Vec<PathBuf> = seeds.iter().map(|s| pod_scope(&mut cg, *s)).collect();
    let (_dir, socket) = bridge_socket();
    let scn = Scenario::new(&bridge_scenario(&[]));
    let ex = bridge_exporter(&scn, &socket);
    std::thread::sleep(Duration::from_secs(1));
    let base = rss_kib(ex.child.id());
    let sock = socket.to_str().unwrap();
    let out = tempfile::tempdir().unwrap();
    let mut pods = Vec::new();
    let mut pids: Vec<u32> = Vec::new();
    for (i, scope) in scopes.iter().enumerate() {
        let list = out.path().join(format!("pids-{i}"));
        let code = in_scope(
            scope,
            &format!(
                "devs, n = [], 0\n\
                 while True:\n\
                 \x20   d = dict(uuid='GPU-%d' % n, allocated=0, reserved=0, allocated_peak=0, reserved_peak=0, active=0, inactive_split=0, alloc_retries=0, ooms=0)\n\
                 \x20   if len(json.dumps(dict(v=1, devices=devs + [d]))) > 65536: break\n\
                 \x20   devs.append(d); n += 1\n\
                 msg = b'gpumem-bridge 1\\n' + json.dumps(dict(v=1, devices=devs)).encode()\n\
                 r, w = os.pipe()\n\
                 kids = []\n\
                 for i in range(64):\n\
                 \x20   pid = os.fork()\n\
                 \x20   if pid == 0:\n\
                 \x20       os.close(w)\n\
                 \x20       s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n\
                 \x20       s.connect({sock:?})\n\
                 \x20       s.send(msg)\n\
                 \x20       time.sleep(4)\n\
                 \x20       s.send(msg)\n\
                 \x20       os.read(r, 1)\n\
                 \x20       os._exit(0)\n\
                 \x20   kids.append(pid)\n\
                 open({list:?}, 'w').write(' '.join(map(str, kids)))\n\
                 print('ready', os.getpid(), flush=True)\n\
                 sys.stdin.read()\n",
                list = list.to_str().unwrap(),
            ),
        );
        pods.push(Py::spawn(&code, &[]));
        pids.extend(
            std::fs::read_to_string(&list)
                .unwrap()
                .split_whitespace()
                .map(|p| p.parse::<u32>().unwrap()),
        );
    }
    assert_eq!(pids.len(), 512);
    scn.write(&scenario(&pids));
    let m = wait_for(Duration::from_secs(60), "every first document read", || {
        let m = ex.metrics();
        (m.get_u64("gpumem_exporter_torch_bridge_connections", &[]) == Some(512)
            && m.get_u64("gpumem_exporter_torch_reports_total", &[]) >= Some(512))
        .then_some(m)
    });
    // Each sends again once on the GPU (after 4 s): then the bounds of
    // documents of processes on a GPU hold.
    std::thread::sleep(Duration::from_secs(6));
    let m2 = ex.metrics();
    let rss = rss_kib(ex.child.id());
    let held = m2
        .get_u64("gpumem_exporter_torch_bridge_held_bytes", &[])
        .unwrap();
    let rss_mib = rss as f64 / 1024.0;
    println!(
        "512 connections x 64 KiB documents (8 pods of 64 processes, all on the GPU): RSS {:.1} -> {rss_mib:.1} MiB (+{:.1}); documents kept {:.1} MiB; limited{{memory}} {}; headroom to the DaemonSet's {DAEMONSET_LIMIT_MIB} MiB: {:.1} MiB",
        base as f64 / 1024.0,
        (rss - base) as f64 / 1024.0,
        held as f64 / (1 << 20) as f64,
        bridge_limited(&m2, "memory"),
        DAEMONSET_LIMIT_MIB - rss_mib
    );
    assert!(held <= 24 << 20, "{held}");
    assert!(bridge_limited(&m2, "memory") > 0, "{}", m.text);
    assert!(
        rss_mib < 100.0,
        "RSS {rss_mib:.1} MiB: less than 60 MiB of headroom to the DaemonSet's limit"
    );
    drop(pods);
}
