//! The torch bridge on a shared node, with real unprivileged uids (the
//! tests run as root and drop to them with setpriv): the exporter as its
//! own uid with no capability at all reads two tenants' bridges over the
//! socket; a tenant cannot make its figures another's (the kernel's
//! credentials decide); the fd fallback, even with every capability, never
//! opens a file a process swaps onto its bridge fd (attack 4); forty
//! processes of 4,100 fds each cost the fallback a bounded budget (attack
//! 5); a lock another uid holds on a shared OOM directory neither hangs an
//! OOM nor loses another uid's snapshots (attack 9).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::*;

/// The exporter's own uid, and two tenants' (no passwd entries needed).
const EXPORTER_UID: u32 = 64_001;
const TENANT_A: u32 = 64_002;
const TENANT_B: u32 = 64_003;

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn chown(path: &Path, uid: u32) {
    std::os::unix::fs::chown(path, Some(uid), Some(uid)).unwrap();
}

/// A directory for the socket, owned by the exporter's uid (mode 0755),
/// and the socket's path in it.
fn socket_dir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    chown(dir.path(), EXPORTER_UID);
    chmod(dir.path(), 0o755);
    let path = dir.path().join("bridge.sock");
    (dir, path)
}

/// The exporter as `uid`, no groups, no capabilities (bounding set empty),
/// listening on `socket`, with `extra` config lines under `processes:`.
fn start_as(uid: u32, scenario: &Scenario, socket: &Path, extra: &str) -> Exporter {
    chmod(scenario.dir.path(), 0o755);
    let yaml = config(&format!(
        "processes:\n  torch_bridge_socket: {}\n{extra}",
        socket.display()
    ));
    let cfg = scenario.file("config.yaml", yaml.as_bytes());
    let id = uid.to_string();
    let mut cmd = Command::new(crate::harness::tools::require_tool("setpriv"));
    cmd.args(["--reuid", &id, "--regid", &id, "--clear-groups"])
        .args(["--inh-caps=-all", "--bounding-set=-all", "--", BIN]);
    let ex = Exporter::spawn(Exporter::command(
        cmd,
        scenario,
        &["--config.file", cfg.to_str().unwrap()],
    ));
    wait_for(WAIT, "the bridge socket", || socket.exists().then_some(()));
    ex
}

/// `Uid:` and `CapEff:` of a process's status.
fn uid_and_caps(pid: u32) -> (String, String) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    };
    (field("Uid:"), field("CapEff:"))
}

fn socket_env(socket: &Path) -> [(&'static str, &str); 1] {
    [("GPUMEM_BRIDGE_SOCKET", socket.to_str().unwrap())]
}

fn limited(m: &Metrics, reason: &str) -> u64 {
    m.get_u64(
        "gpumem_exporter_torch_bridge_limited_total",
        &[("reason", reason)],
    )
    .unwrap_or(0)
}

/// The exporter as a uid of its own with no capability (CapEff 0) reads
/// the figures of two other uids' bridged processes, exactly, over the
/// socket; they vanish with the process; a bridge older than the socket
/// (memfd only) is counted once and the log says what to change.
#[test]
fn an_exporter_without_capabilities_reads_two_tenants_over_the_socket() {
    let (fa, fb) = (Figures(21_000_000_003), Figures(22_000_000_007));
    let (sa, sb) = (
        StubState::new(&[(U0, fa.stats())]),
        StubState::new(&[(U0, fb.stats())]),
    );
    sa.share();
    sb.share();
    let scenario = Scenario::new(&scenario_yaml(&[(U0, &[])]));
    let (_dir, socket) = socket_dir();
    let ex = start_as(EXPORTER_UID, &scenario, &socket, "");
    let (uid, caps) = uid_and_caps(ex.child.id());
    println!("exporter pid {}: Uid {uid}, CapEff {caps}", ex.child.id());
    assert!(uid.starts_with(&EXPORTER_UID.to_string()), "Uid: {uid}");
    assert_eq!(caps, "0000000000000000", "CapEff");

    let env = socket_env(&socket);
    let a = Py::bridge_as(TENANT_A, &sa, "", &env, None);
    let b = Py::bridge_as(TENANT_B, &sb, "", &env, None);
    // An old bridge: memfd only (what gpumem_bridge before 0.4 did).
    let old = Py::bridge_as(TENANT_A, &sa, "", &[("GPUMEM_BRIDGE_SOCKET", "off")], None);
    scenario.write(&scenario_yaml(&[(
        U0,
        &[(a.pid, 3 << 30), (b.pid, 4 << 30), (old.pid, 1 << 30)],
    )]));
    let m = wait_for(WAIT, "both tenants' figures", || {
        let m = ex.metrics();
        (exported(&m, "0", &a.pid_str()) == Some(fa.values())
            && exported(&m, "0", &b.pid_str()) == Some(fb.values()))
        .then_some(m)
    });
    assert_eq!(
        m.get_u64("gpumem_exporter_torch_bridge_connections", &[]),
        Some(2),
        "{}",
        m.text
    );
    assert_eq!(dropped(&m, "identity"), 0, "{}", m.text);
    assert_eq!((limited(&m, "connections"), limited(&m, "rate")), (0, 0));
    assert_promtool_check_metrics_clean(&m.text);

    // The old bridge cannot be read by an exporter without privileges: one
    // count, one plain line on what to change. The socket-bridged ones are
    // never scanned (no permission count for them).
    let m = wait_for(WAIT, "the old bridge counted once", || {
        let m = ex.metrics();
        (dropped(&m, "permission") == 1).then_some(m)
    });
    assert_eq!(torch_series_of(&m, &old.pid_str()), 0, "{}", m.text);
    ex.assert_logged_once("older than 0.4");
    assert!(
        ex.stderr().contains("upgrade the bridge"),
        "{}",
        ex.stderr()
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(dropped(&ex.metrics(), "permission"), 1);

    // A's figures follow it; gone when it exits, B's stay.
    let fa2 = Figures(23_000_000_011);
    sa.write(&[(U0, fa2.stats())]);
    wait_for(WAIT, "A's new figures", || {
        (exported(&ex.metrics(), "0", &a.pid_str()) == Some(fa2.values())).then_some(())
    });
    let a_pid = a.pid_str();
    drop(a);
    let m = wait_for(WAIT, "A's torch series gone", || {
        let m = ex.metrics();
        (torch_series_of(&m, &a_pid) == 0).then_some(m)
    });
    assert_eq!(exported(&m, "0", &b.pid_str()), Some(fb.values()));
    assert_eq!(
        m.get_u64("gpumem_exporter_torch_bridge_connections", &[]),
        Some(1)
    );
}

/// A tenant tries to speak for another process: with the victim's pid in
/// the kernel's credentials (refused by the kernel: EPERM), with it in the
/// document (ignored), and from a forked child on its own connection
/// (dropped, `identity`). The victim's series stay its own.
#[test]
fn a_forged_sender_cannot_claim_another_pid() {
    let fv = Figures(31_000_000_013);
    let state = StubState::new(&[(U0, fv.stats())]);
    state.share();
    let scenario = Scenario::new(&scenario_yaml(&[(U0, &[])]));
    let (_dir, socket) = socket_dir();
    let ex = start_as(EXPORTER_UID, &scenario, &socket, "");
    let victim = Py::bridge_as(TENANT_B, &state, "", &socket_env(&socket), None);

    let forged = Figures(39_000_000_001);
    let mut entry = forged.entry(&gpu(U0));
    entry["pid"] = json!(victim.pid);
    let doc = json!({"v": 1, "pid": victim.pid, "devices": [entry]});
    let results = tempfile::tempdir().unwrap();
    chmod(results.path(), 0o777);
    let result = results.path().join("result");
    let code = format!(
        "import os, socket, struct, sys\n\
         victim = {victim}\n\
         msg = b'gpumem-bridge 1\\n' + {doc:?}.encode()\n\
         s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n\
         s.connect({socket:?})\n\
         said = []\n\
         try:\n\
         \x20   s.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack('iII', victim, os.getuid(), os.getgid()))])\n\
         \x20   said.append('forged credentials accepted')\n\
         except PermissionError as e:\n\
         \x20   said.append('EPERM')\n\
         child = os.fork()\n\
         if child == 0:\n\
         \x20   s.send(msg)\n\
         \x20   os._exit(0)\n\
         os.waitpid(child, 0)\n\
         s.send(msg)\n\
         open({result:?}, 'w').write(' '.join(said))\n\
         print('ready', os.getpid(), flush=True)\n\
         sys.stdin.read()\n",
        victim = victim.pid,
        doc = doc.to_string(),
        socket = socket.to_str().unwrap(),
        result = result.to_str().unwrap(),
    );
    let forger = Py::spawn_as(TENANT_A, &code, &[], None);
    assert_eq!(std::fs::read_to_string(&result).unwrap(), "EPERM");
    scenario.write(&scenario_yaml(&[(
        U0,
        &[(victim.pid, 4 << 30), (forger.pid, 2 << 30)],
    )]));
    let m = wait_for(
        WAIT,
        "the forger's own figures and the child's drop",
        || {
            let m = ex.metrics();
            (exported(&m, "0", &forger.pid_str()) == Some(forged.values())
                && exported(&m, "0", &victim.pid_str()) == Some(fv.values())
                && dropped(&m, "identity") == 1)
                .then_some(m)
        },
    );
    // A few more samples: the victim's figures are its own throughout.
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(150));
        let m = ex.metrics();
        assert_eq!(
            exported(&m, "0", &victim.pid_str()),
            Some(fv.values()),
            "{}",
            m.text
        );
    }
    println!(
        "forged credentials: EPERM; claimed pid ignored; the child's message dropped (identity {})",
        dropped(&m, "identity")
    );
    ex.assert_logged_once("another process than the one that connected");
}

/// A fanotify watch of one file: the pids that opened it.
struct OpenWatch {
    fd: std::os::fd::OwnedFd,
}

impl OpenWatch {
    fn new(path: &Path) -> OpenWatch {
        use std::os::fd::FromRawFd;
        // SAFETY: plain syscalls; the fd is owned by the returned value.
        let fd = unsafe {
            libc::fanotify_init(
                libc::FAN_CLASS_NOTIF | libc::FAN_CLOEXEC | libc::FAN_NONBLOCK,
                libc::O_RDONLY as u32,
            )
        };
        assert!(
            fd >= 0,
            "fanotify_init: {}",
            std::io::Error::last_os_error()
        );
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a valid fanotify fd and a NUL-terminated path.
        let r = unsafe {
            libc::fanotify_mark(
                std::os::fd::AsRawFd::as_raw_fd(&fd),
                libc::FAN_MARK_ADD,
                libc::FAN_OPEN,
                libc::AT_FDCWD,
                c.as_ptr(),
            )
        };
        assert_eq!(r, 0, "fanotify_mark: {}", std::io::Error::last_os_error());
        OpenWatch { fd }
    }

    /// The pids of the opens seen since the last call.
    fn openers(&self) -> Vec<i32> {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: reading into a buffer of its length.
            let n = unsafe {
                libc::read(
                    std::os::fd::AsRawFd::as_raw_fd(&self.fd),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                )
            };
            if n <= 0 {
                return out;
            }
            let mut at = 0;
            let size = std::mem::size_of::<libc::fanotify_event_metadata>();
            while at + size <= n as usize {
                // SAFETY: within the bytes read; read_unaligned copes with
                // the buffer's alignment.
                let ev: libc::fanotify_event_metadata =
                    unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
                if ev.fd >= 0 {
                    // SAFETY: the event's own fd, ours to close.
                    unsafe { libc::close(ev.fd) };
                }
                out.push(ev.pid);
                at += (ev.event_len as usize).max(size);
            }
        }
    }
}

/// Attack 4: a process keeps swapping an `O_PATH` fd of a root-only file
/// onto its bridge fd number while the exporter (root, every capability:
/// the worst case) reads it through the fd fallback. The exporter reads
/// the real document between swaps, and never opens the file.
#[test]
fn a_swapped_o_path_fd_never_makes_the_exporter_open_a_path() {
    let dir = tempfile::tempdir().unwrap();
    chmod(dir.path(), 0o755);
    let secret = dir.path().join("root-only");
    std::fs::write(&secret, "secret\n").unwrap();
    chmod(&secret, 0o600);
    let watch = OpenWatch::new(&secret);
    // The watch sees opens: the test's own.
    drop(std::fs::File::open(&secret).unwrap());
    let seen = watch.openers();
    assert!(
        seen.contains(&(std::process::id() as i32)),
        "the watch missed an open: {seen:?}"
    );

    let f = Figures(41_000_000_017);
    let doc = json!({"v": 1, "devices": [f.entry(&gpu(U0))]}).to_string();
    let results = tempfile::tempdir().unwrap();
    chmod(results.path(), 0o777);
    let result = results.path().join("swaps");
    let code = format!(
        "import fcntl, os, sys, time\n\
         fd = os.memfd_create('gpumem-bridge', os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)\n\
         os.write(fd, {doc:?}.encode())\n\
         fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)\n\
         keep = os.dup(fd)\n\
         path = os.open({secret:?}, os.O_PATH | os.O_CLOEXEC)\n\
         print('ready', os.getpid(), flush=True)\n\
         time.sleep(3)\n\
         swaps, end = 0, time.time() + 6\n\
         while time.time() < end:\n\
         \x20   os.dup2(path, fd)\n\
         \x20   time.sleep(0.002)\n\
         \x20   os.dup2(keep, fd)\n\
         \x20   time.sleep(0.002)\n\
         \x20   swaps += 1\n\
         open({result:?}, 'w').write(str(swaps))\n\
         sys.stdin.read()\n",
        secret = secret.to_str().unwrap(),
        result = result.to_str().unwrap(),
    );
    let attacker = Py::spawn_as(TENANT_A, &code, &[], None);
    let scenario = Scenario::new(&scenario_yaml(&[(U0, &[(attacker.pid, 1 << 30)])]));
    // Root with every capability, the fallback only.
    let ex = start(&scenario, "processes:\n  torch_bridge_socket: \"\"\n");
    wait_for(WAIT, "the attacker's document read", || {
        (exported(&ex.metrics(), "0", &attacker.pid_str()) == Some(f.values())).then_some(())
    });
    let reports = |m: &Metrics| {
        m.get_u64("gpumem_exporter_torch_reports_total", &[])
            .unwrap_or(0)
    };
    let before = reports(&ex.metrics());
    wait_for(Duration::from_secs(15), "the swapping to end", || {
        std::fs::read_to_string(&result).ok()
    });
    let swaps = std::fs::read_to_string(&result).unwrap();
    let m = ex.metrics();
    let during = reports(&m) - before;
    let exporter = ex.child.id() as i32;
    let openers = watch.openers();
    println!(
        "attack 4: {swaps} swaps in 6 s; the exporter read the real document {during} times meanwhile; opens of the root-only file by the exporter: {}",
        openers.iter().filter(|p| **p == exporter).count()
    );
    assert!(during >= 10, "the exporter was not reading: {during}");
    assert!(
        !openers.contains(&exporter),
        "the exporter opened the swapped file: {openers:?}"
    );
}

/// CPU seconds (user + system) a process used so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 (utime, stime); `after` starts at field 3.
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks as f64 / hz
}

/// Attack 5: forty processes holding 4,100 fds each, none a bridge, on the
/// GPU beside an old bridge (its memfd among 4,100 fds too), under an
/// exporter (root, every capability) that scans fds. The old bridge is
/// still found; the exporter's CPU over 10 s stays within a bound.
#[test]
fn forty_processes_of_4100_fds_cost_the_fd_scan_a_bounded_budget() {
    let _heavy = heavy();
    let fds = "import os, resource, sys\n\
               soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n\
               resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))\n\
               held = [os.open('/dev/null', os.O_RDONLY) for _ in range(4100)]\n";
    let hog = format!("{fds}print('ready', os.getpid(), flush=True)\nsys.stdin.read()\n");
    let hogs: Vec<Py> = (0..40)
        .map(|_| Py::spawn_as(TENANT_A, &hog, &[], None))
        .collect();
    let f = Figures(51_000_000_019);
    let state = StubState::new(&[(U0, f.stats())]);
    state.share();
    let old = Py::bridge_as(
        TENANT_B,
        &state,
        fds,
        &[("GPUMEM_BRIDGE_SOCKET", "off")],
        None,
    );
    let mut procs: Vec<(u32, u64)> = hogs.iter().map(|p| (p.pid, 1 << 30)).collect();
    procs.push((old.pid, 1 << 30));
    let scenario = Scenario::new(&scenario_yaml(&[(U0, &procs)]));
    // The default sample interval (1 s), the fallback only.
    let ex = Exporter::with_config(&scenario, "processes:\n  torch_bridge_socket: \"\"\n", &[]);
    let began = Instant::now();
    wait_for(Duration::from_secs(30), "the old bridge found", || {
        (exported(&ex.metrics(), "0", &old.pid_str()) == Some(f.values())).then_some(())
    });
    let found_after = began.elapsed().as_secs_f64();
    let pid = ex.child.id();
    let (c0, t0) = (cpu_seconds(pid), Instant::now());
    std::thread::sleep(Duration::from_secs(10));
    let (c1, t1) = (cpu_seconds(pid), Instant::now());
    let share = (c1 - c0) / (t1 - t0).as_secs_f64();
    println!(
        "attack 5: 40 processes x 4100 fds + an old bridge: found after {found_after:.1} s; exporter CPU {:.3} s in {:.1} s = {:.2} % of a core (bound 5 %)",
        c1 - c0,
        (t1 - t0).as_secs_f64(),
        share * 100.0
    );
    assert!(
        share < 0.05,
        "the fd scan cost {:.2} % of a core",
        share * 100.0
    );
    // Still reading the old bridge, and every hog is still exported.
    let m = ex.metrics();
    assert_eq!(exported(&m, "0", &old.pid_str()), Some(f.values()));
    assert_eq!(m.find("gpu_process_memory_used_bytes", &[]).len(), 41);
}

/// Attack 9: another uid holds a blocking flock on a shared (sticky) OOM
/// snapshot directory and has snapshot-named files in it. A bridged
/// process's OOMs each wait at most the bridge's bound, write their
/// snapshots, prune only the process's own, and are counted by the
/// exporter over the socket.
#[test]
fn a_lock_held_by_another_uid_does_not_hang_an_oom_nor_cost_its_files() {
    let shared = tempfile::tempdir().unwrap();
    chmod(shared.path(), 0o755);
    let dir = shared.path().join("oom");
    std::fs::create_dir(&dir).unwrap();
    chmod(&dir, 0o1777);
    // Tenant A: three old snapshot-named files, then the lock, held.
    let theirs: Vec<String> = (0..3)
        .map(|i| format!("gpumem-oom-99{i}-20200101T00000{i}.000000Z.pickle"))
        .collect();
    let holder = Py::spawn_as(
        TENANT_A,
        &format!(
            "import fcntl, os, sys\n\
             for n in {theirs:?}:\n\
             \x20   open(os.path.join({dir:?}, n), 'wb').write(b'x' * 100)\n\
             fd = os.open({dir:?}, os.O_RDONLY | os.O_DIRECTORY)\n\
             fcntl.flock(fd, fcntl.LOCK_EX)\n\
             print('ready', os.getpid(), flush=True)\n\
             sys.stdin.read()\n",
            dir = dir.to_str().unwrap(),
        ),
        &[],
        None,
    );
    let state = StubState::new(&[(U0, Figures(61_000_000_005).stats())]);
    state.share();
    let scenario = Scenario::new(&scenario_yaml(&[(U0, &[])]));
    let (_sock_dir, socket) = socket_dir();
    let ex = start_as(EXPORTER_UID, &scenario, &socket, "");
    let results = tempfile::tempdir().unwrap();
    chmod(results.path(), 0o777);
    let timing = results.path().join("timing");
    let err = results.path().join("stderr");
    let timed = format!(
        "import time\n\
         took = []\n\
         for _ in range(3):\n\
         \x20   t = time.monotonic()\n\
         \x20   try:\n\
         \x20       torch.cuda.stub_out_of_memory(0)\n\
         \x20   except torch.cuda.OutOfMemoryError:\n\
         \x20       took.append(time.monotonic() - t)\n\
         open({timing:?}, 'w').write(' '.join('%.3f' % s for s in took))\n",
        timing = timing.to_str().unwrap()
    );
    let dir_s = dir.to_str().unwrap().to_string();
    let mut env = socket_env(&socket).to_vec();
    env.extend([
        ("GPUMEM_BRIDGE_OOM_SNAPSHOT_DIR", dir_s.as_str()),
        ("GPUMEM_BRIDGE_OOM_SNAPSHOT_MAX_FILES", "1"),
    ]);
    let began = Instant::now();
    let py = Py::bridge_as(TENANT_B, &state, &timed, &env, Some(&err));
    let total = began.elapsed().as_secs_f64();
    let took: Vec<f64> = std::fs::read_to_string(&timing)
        .unwrap()
        .split_whitespace()
        .map(|s| s.parse().unwrap())
        .collect();
    println!(
        "attack 9: three OOMs under another uid's flock took {took:?} s (bound 2 s each); the process was ready after {total:.1} s"
    );
    assert_eq!(took.len(), 3);
    for t in &took {
        assert!(*t < 2.0, "an OOM waited {t} s for the lock");
    }
    // Tenant A's files are all there; B kept one snapshot of its own.
    let (files, _) = snapshot_files(&dir);
    for n in &theirs {
        assert!(files.contains(n), "{n} was deleted: {files:?}");
    }
    let own: Vec<&String> = files
        .iter()
        .filter(|n| snapshot_name_pid(n) == Some(py.pid))
        .collect();
    assert_eq!(own.len(), 1, "{files:?}");
    let warned = lines_with(&err, "stayed locked");
    assert_eq!(warned.len(), 1, "{warned:?}");
    // Counted by the exporter, over the socket.
    scenario.write(&scenario_yaml(&[(U0, &[(py.pid, 1 << 30)])]));
    wait_for(WAIT, "the snapshots counted", || {
        (value_with(&ex.metrics(), SNAPSHOTS, "0", &py.pid_str(), &[]) == Some(3)).then_some(())
    });
    drop(holder);
}

/// A raw bridge sender whose allocated figure is the time it sent it (ms
/// since the epoch), every 0.1 s: its exported figure tells how old the
/// exporter's copy is.
fn clock_sender(socket: &Path) -> String {
    format!(
        "import json, os, socket, sys, threading, time\n\
         s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n\
         s.connect({socket:?})\n\
         def doc():\n\
         \x20   ms = int(time.time() * 1000)\n\
         \x20   d = dict(uuid={uuid:?}, allocated=ms, reserved=ms, allocated_peak=0, reserved_peak=0, active=0, inactive_split=0, alloc_retries=0, ooms=0)\n\
         \x20   return b'gpumem-bridge 1\\n' + json.dumps(dict(v=1, devices=[d])).encode()\n\
         def run():\n\
         \x20   while True:\n\
         \x20       s.send(doc())\n\
         \x20       time.sleep(0.1)\n\
         threading.Thread(target=run, daemon=True).start()\n\
         print('ready', os.getpid(), flush=True)\n\
         sys.stdin.read()\n",
        socket = socket.to_str().unwrap(),
        uuid = gpu(U0),
    )
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The age of the victim's exported figure over `for_`, sampled every
/// 200 ms: the oldest seen, in seconds.
fn oldest_figure(ex: &Exporter, victim: &Py, for_: Duration) -> f64 {
    let end = Instant::now() + for_;
    let mut oldest = 0.0f64;
    while Instant::now() < end {
        let m = ex.metrics();
        let age = match exported(&m, "0", &victim.pid_str()) {
            Some(v) => now_ms().saturating_sub(v[0]) as f64 / 1000.0,
            None => f64::INFINITY,
        };
        oldest = oldest.max(age);
        std::thread::sleep(Duration::from_millis(200));
    }
    oldest
}

/// The exporter (its own uid), a victim sending its clock, both on the
/// GPU; returns once the victim's figure is exported.
fn victim_setup() -> (Scenario, tempfile::TempDir, PathBuf, Exporter, Py) {
    let scenario = Scenario::new(&scenario_yaml(&[(U0, &[])]));
    let (dir, socket) = socket_dir();
    let ex = start_as(EXPORTER_UID, &scenario, &socket, "");
    let victim = Py::spawn_as(TENANT_B, &clock_sender(&socket), &[], None);
    scenario.write(&scenario_yaml(&[(U0, &[(victim.pid, 1 << 30)])]));
    wait_for(WAIT, "the victim's figure", || {
        exported(&ex.metrics(), "0", &victim.pid_str()).map(|_| ())
    });
    (scenario, dir, socket, ex, victim)
}

fn socket_gauge(m: &Metrics, name: &str) -> f64 {
    m.get(name, &[]).unwrap_or(f64::NAN)
}

/// The code of an attacker that sends an ordinary document with `fd_expr`
/// (a Python expression opening a file or socket, after `setup`) attached
/// (`SCM_RIGHTS`), closes its own copy where the send went through, writes
/// what the kernel said into `result` and holds on. It floods another
/// connection of its own for half a second first, so that an exporter
/// that pauses a budget past its rate reads the fd only after the
/// attacker's copy is closed: the exporter's close is then the last.
fn fd_sender(socket: &Path, result: &Path, setup: &str, fd_expr: &str) -> String {
    let doc = json!({"v": 1, "devices": [Figures(71_000_000_001).entry(&gpu(U0))]}).to_string();
    format!(
        "import array, errno, os, socket, struct, sys\n\
         {setup}\n\
         fd = {fd_expr}\n\
         msg = b'gpumem-bridge 1\\n' + {doc:?}.encode()\n\
         flood = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n\
         flood.connect({socket:?})\n\
         flood.setblocking(False)\n\
         import time\n\
         end = time.time() + 0.5\n\
         while time.time() < end:\n\
         \x20   try:\n\
         \x20       flood.send(msg)\n\
         \x20   except BlockingIOError:\n\
         \x20       time.sleep(0.001)\n\
         b = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n\
         b.connect({socket:?})\n\
         try:\n\
         \x20   b.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', [fd]))])\n\
         \x20   said = 'sent'\n\
         \x20   os.close(fd)\n\
         except OSError as e:\n\
         \x20   said = 'refused: ' + errno.errorcode.get(e.errno, str(e.errno))\n\
         open({result:?}, 'w').write(said)\n\
         print('ready', os.getpid(), flush=True)\n\
         sys.stdin.read()\n",
        socket = socket.to_str().unwrap(),
        result = result.to_str().unwrap(),
    )
}

/// The SCM_RIGHTS linger freeze: a tenant attaches a TCP socket with 60 s
/// of linger and unsent data its peer never reads, and closes its copy.
/// The exporter's copy must never be closed on the listener: the victim's
/// figure stays under 3 s old while the attacker holds, nothing stalls.
/// (Linux ≥ 6.16 refuses the fd at the socket, EPERM; before, the closing
/// thread waits instead, see the unit test
/// `a_lingering_fd_is_closed_apart_from_the_listener`.)
#[test]
fn a_lingering_socket_passed_along_freezes_no_one() {
    let (_scenario, _dir, socket, ex, victim) = victim_setup();
    let results = tempfile::tempdir().unwrap();
    chmod(results.path(), 0o777);
    let result = results.path().join("said");
    let setup = "l = socket.socket(); l.bind(('127.0.0.1', 0)); l.listen(1)\n\
                 c = socket.socket(); c.connect(l.getsockname()); peer, _ = l.accept()\n\
                 c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 60))\n\
                 c.setblocking(False)\n\
                 try:\n\
                 \x20   while True: c.send(b'x' * 65536)\n\
                 except BlockingIOError:\n\
                 \x20   pass";
    let attacker = Py::spawn_as(
        TENANT_A,
        &fd_sender(&socket, &result, setup, "c.fileno()"),
        &[],
        None,
    );
    let said = std::fs::read_to_string(&result).unwrap();
    let oldest = oldest_figure(&ex, &victim, Duration::from_secs(6));
    let m = ex.metrics();
    let stalled = socket_gauge(&m, "gpumem_exporter_torch_bridge_stalled_seconds");
    let ready = ex.get("/readyz").status;
    println!(
        "linger attack: the kernel said {said:?} to the attacker; the victim's figure was at most {oldest:.2} s old over 6 s; stalled_seconds {stalled}, /readyz {ready}, limited{{fds}} {}",
        limited(&m, "fds")
    );
    assert!(oldest < 3.0, "the victim's figure aged {oldest:.2} s");
    assert_eq!(stalled, 0.0, "{}", m.text);
    assert_eq!(ready, 200);
    drop(attacker);
}

/// The FUSE variant: a file on a FUSE mount whose daemon never answers
/// `FLUSH` from anyone but itself (a raw FUSE server over /dev/fuse,
/// mounted by a root attacker; no FUSE package needed). Same bound.
#[test]
fn a_fuse_file_passed_along_freezes_no_one() {
    if !Path::new("/dev/fuse").exists() {
        panic!("the FUSE variant needs /dev/fuse (and root to mount)");
    }
    let (_scenario, _dir, socket, ex, victim) = victim_setup();
    let results = tempfile::tempdir().unwrap();
    chmod(results.path(), 0o777);
    let result = results.path().join("said");
    let mnt = tempfile::tempdir().unwrap();
    let setup = format!(
        "import ctypes, threading\n\
         mnt = {mnt:?}\n\
         dev = os.open('/dev/fuse', os.O_RDWR)\n\
         libc = ctypes.CDLL(None, use_errno=True)\n\
         opts = ('fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other' % dev).encode()\n\
         if libc.mount(b'gpumem-test', mnt.encode(), b'fuse', 0, opts) != 0:\n\
         \x20   raise OSError(ctypes.get_errno(), 'mount')\n\
         def attr(ino, mode):\n\
         \x20   return struct.pack('<QQQQQQIIIIIIIIII', ino, 0, 0, 0, 0, 0, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)\n\
         def reply(unique, err=0, body=b''):\n\
         \x20   os.write(dev, struct.pack('<IiQ', 16 + len(body), -err, unique) + body)\n\
         held = []\n\
         def serve():\n\
         \x20   while True:\n\
         \x20       try:\n\
         \x20           buf = os.read(dev, 1 << 20)\n\
         \x20       except OSError:\n\
         \x20           return\n\
         \x20       ln, op, unique, node, uid, gid, pid = struct.unpack_from('<IIQQIII', buf)\n\
         \x20       if op == 26: reply(unique, 0, struct.pack('<IIIIHHI', 7, 22, 0, 0, 0, 0, 4096))\n\
         \x20       elif op == 1: reply(unique, 0, struct.pack('<QQQQII', 2, 0, 60, 60, 0, 0) + attr(2, 0o100666))\n\
         \x20       elif op == 3: reply(unique, 0, struct.pack('<QII', 60, 0, 0) + attr(node, 0o40755 if node == 1 else 0o100666))\n\
         \x20       elif op == 14: reply(unique, 0, struct.pack('<QII', 0, 0, 0))\n\
         \x20       elif op == 25 and pid != os.getpid(): held.append(unique)\n\
         \x20       elif op == 2: pass\n\
         \x20       elif op in (25, 18): reply(unique)\n\
         \x20       else: reply(unique, errno.ENOSYS)\n\
         threading.Thread(target=serve, daemon=True).start()",
        mnt = mnt.path().to_str().unwrap(),
    );
    let attacker = Py::spawn(
        &fd_sender(
            &socket,
            &result,
            &setup,
            "os.open(mnt + '/file', os.O_RDONLY)",
        ),
        &[],
    );
    let said = std::fs::read_to_string(&result).unwrap();
    let oldest = oldest_figure(&ex, &victim, Duration::from_secs(6));
    let m = ex.metrics();
    let stalled = socket_gauge(&m, "gpumem_exporter_torch_bridge_stalled_seconds");
    let ready = ex.get("/readyz").status;
    println!(
        "FUSE attack: the kernel said {said:?} to the attacker; the victim's figure was at most {oldest:.2} s old over 6 s; stalled_seconds {stalled}, /readyz {ready}"
    );
    abort_fuse(mnt.path());
    drop(attacker);
    let _ = Command::new("umount")
        .args(["-l", mnt.path().to_str().unwrap()])
        .status();
    assert!(oldest < 3.0, "the victim's figure aged {oldest:.2} s");
    assert_eq!(stalled, 0.0, "{}", m.text);
    assert_eq!(ready, 200);
}

/// Abort the FUSE connection mounted at `mnt` (fusectl), so that no
/// process, the attacker's own exit included, waits on its daemon.
fn abort_fuse(mnt: &Path) {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(mnt).unwrap().dev();
    let minor = (dev & 0xff) | ((dev >> 12) & 0xfff00);
    let ctl = Path::new("/sys/fs/fuse/connections");
    if std::fs::read_dir(ctl).is_ok_and(|mut d| d.next().is_none()) {
        let _ = Command::new("mount")
            .args(["-t", "fusectl", "none", ctl.to_str().unwrap()])
            .status();
    }
    let _ = std::fs::write(ctl.join(minor.to_string()).join("abort"), "1");
}

/// The thread of `pid` named `name`.
fn thread_named(pid: u32, name: &str) -> i32 {
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let t = t.unwrap();
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim() == name {
            return t.file_name().to_str().unwrap().parse().unwrap();
        }
    }
    panic!("no thread {name} in {pid}");
}

/// A stall forced another way: the listener thread alone is stopped
/// (ptrace interrupts one thread; the sampler goes on). The stall gauge
/// rises past 2 s and /readyz says why; resumed, the gauge is 0 again and
/// the stall is counted.
#[test]
fn a_stalled_listener_is_a_gauge_readiness_and_a_count() {
    let (_scenario, _dir, _socket, ex, _victim) = victim_setup();
    let tid = thread_named(ex.child.id(), "torch-bridge");
    // SAFETY: ptrace of one thread of a child process we (root) started;
    // seized, interrupted, waited for, then detached, all from this thread.
    unsafe {
        assert_eq!(
            libc::ptrace(libc::PTRACE_SEIZE, tid, 0, 0),
            0,
            "PTRACE_SEIZE: {}",
            std::io::Error::last_os_error()
        );
        assert_eq!(libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0), 0);
        let mut status = 0;
        assert_eq!(libc::waitpid(tid, &mut status, libc::__WALL), tid);
    }
    let m = wait_for(Duration::from_secs(10), "the stall seen", || {
        let m = ex.metrics();
        (socket_gauge(&m, "gpumem_exporter_torch_bridge_stalled_seconds") > 2.0).then_some(m)
    });
    let r = ex.get("/readyz");
    // SAFETY: as above.
    unsafe { libc::ptrace(libc::PTRACE_DETACH, tid, 0, 0) };
    let stalled = socket_gauge(&m, "gpumem_exporter_torch_bridge_stalled_seconds");
    println!(
        "forced stall: stalled_seconds {stalled}; /readyz {} {:?}",
        r.status,
        r.body.trim()
    );
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("torch bridge"), "{}", r.body);
    let m = wait_for(WAIT, "the stall over and counted", || {
        let m = ex.metrics();
        (socket_gauge(&m, "gpumem_exporter_torch_bridge_stalled_seconds") == 0.0
            && m.get_u64("gpumem_exporter_torch_bridge_stalls_total", &[]) == Some(1))
        .then_some(m)
    });
    assert_eq!(ex.get("/readyz").status, 200, "{}", m.text);
}
