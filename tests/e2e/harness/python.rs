//! Python children for the torch bridge tests: `python3` with the bridge
//! (python/) and the stub `torch` (tests/torch_stub) on its path, and the
//! stub's state file, which says what `torch.cuda` reports.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{Value, json};

use super::repo;
use super::tools::require_tool;

/// How long a child may take to say it is ready.
const READY: Duration = Duration::from_secs(20);
/// PATH for children of other uids: the machine's own programs.
pub const SYSTEM_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

pub fn python3() -> &'static str {
    require_tool("python3")
}

/// The stub torch's state file, rewritten atomically (the stub re-reads it
/// on every call).
pub struct StubState {
    dir: tempfile::TempDir,
}

impl StubState {
    pub fn new(devices: &[(&str, Value)]) -> StubState {
        Self::new_with(devices, json!({}))
    }

    /// With more top-level keys of the state (e.g. `snapshot_pad`).
    pub fn new_with(devices: &[(&str, Value)], extra: Value) -> StubState {
        let s = StubState {
            dir: tempfile::tempdir().expect("tempdir"),
        };
        s.write_with(devices, extra);
        s
    }

    pub fn path(&self) -> PathBuf {
        self.dir.path().join("torch-state.json")
    }

    /// Let other users (tenants' processes) read the state.
    pub fn share(&self) {
        use std::os::unix::fs::PermissionsExt;
        let open = std::fs::Permissions::from_mode(0o755);
        std::fs::set_permissions(self.dir.path(), open).expect("chmod stub state dir");
    }

    /// Devices in CUDA order (`CUDA_VISIBLE_DEVICES` may differ from
    /// NVML's): each CUDA UUID (bare, without `GPU-`) with what
    /// `torch.cuda.memory_stats()` returns for it.
    pub fn write(&self, devices: &[(&str, Value)]) {
        self.write_with(devices, json!({}));
    }

    /// `write`, with more top-level keys.
    pub fn write_with(&self, devices: &[(&str, Value)], extra: Value) {
        let devs: Vec<Value> = devices
            .iter()
            .map(|(uuid, stats)| json!({"uuid": uuid, "stats": stats}))
            .collect();
        let mut state = json!({"initialized": true, "devices": devs});
        if let (Some(state), Value::Object(extra)) = (state.as_object_mut(), extra) {
            state.extend(extra);
        }
        let tmp = self.dir.path().join("torch-state.tmp");
        std::fs::write(&tmp, state.to_string()).expect("write stub state");
        std::fs::rename(&tmp, self.path()).expect("rename stub state");
    }
}

/// A Python child; killed on drop. It prints `ready <pid>` once set up and
/// then waits for its stdin to close.
pub struct Py {
    child: Child,
    pub pid: u32,
}

impl Py {
    /// `python3 -c code` with PYTHONPATH=python:tests/torch_stub, the
    /// bridge publishing every 0.1 s, and `env`. `code` must print
    /// `ready <pid>`.
    pub fn spawn(code: &str, env: &[(&str, &str)]) -> Py {
        Py::spawn_to(code, env, None)
    }

    /// `spawn`, the child's stderr into the file `stderr` (else inherited).
    pub fn spawn_to(code: &str, env: &[(&str, &str)], stderr: Option<&Path>) -> Py {
        Py::spawn_with(None, code, env, stderr)
    }

    /// `spawn_to` as `uid` (its gid the same, no supplementary groups, no
    /// capabilities): a tenant. The machine's python3 (PATH without
    /// root's own folders, which other users cannot enter).
    pub fn spawn_as(uid: u32, code: &str, env: &[(&str, &str)], stderr: Option<&Path>) -> Py {
        Py::spawn_with(Some(uid), code, env, stderr)
    }

    fn spawn_with(uid: Option<u32>, code: &str, env: &[(&str, &str)], stderr: Option<&Path>) -> Py {
        let pythonpath = format!(
            "{}:{}",
            repo().join("python").display(),
            repo().join("tests/torch_stub").display()
        );
        let mut cmd = match uid {
            None => Command::new(python3()),
            Some(uid) => {
                let id = uid.to_string();
                let mut c = Command::new(require_tool("setpriv"));
                c.args(["--reuid", &id, "--regid", &id, "--clear-groups"])
                    .args(["--inh-caps=-all", "--bounding-set=-all", "--", "python3"])
                    .env("PATH", SYSTEM_PATH);
                c
            }
        };
        cmd.args(["-u", "-c", code])
            .env("PYTHONPATH", pythonpath)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("GPUMEM_BRIDGE_INTERVAL", "0.1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(match stderr {
                Some(path) => {
                    Stdio::from(std::fs::File::create(path).expect("child's stderr file"))
                }
                None => Stdio::inherit(),
            });
        // What the test does not set, the child does not inherit.
        for k in [
            "PYTORCH_ALLOC_CONF",
            "PYTORCH_CUDA_ALLOC_CONF",
            "GPUMEM_BRIDGE_OOM_SNAPSHOT_DIR",
            "GPUMEM_BRIDGE_OOM_SNAPSHOT_MAX_FILES",
            "GPUMEM_BRIDGE_OOM_SNAPSHOT_MAX_BYTES",
            "GPUMEM_BRIDGE_OOM_HISTORY",
            "GPUMEM_BRIDGE_OOM_HISTORY_ENTRIES",
            "GPUMEM_BRIDGE_WARN_AT",
        ] {
            cmd.env_remove(k);
        }
        // The socket only where a test listens on one (never a socket of
        // the machine's own exporter).
        cmd.env("GPUMEM_BRIDGE_SOCKET", "off");
        for (k, v) in env {
            cmd.env(k, v);
        }
        // setpriv before python3, and whatever the code starts: one group.
        super::own_group(&mut cmd);
        let mut child = cmd.spawn().expect("spawn python3");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(READY).unwrap_or_default();
        let pid = line
            .strip_prefix("ready ")
            .and_then(|p| p.trim().parse().ok());
        let Some(pid) = pid else {
            super::kill_group(&mut child);
            let err = stderr
                .map(|p| std::fs::read_to_string(p).unwrap_or_default())
                .unwrap_or_default();
            panic!("python child did not get ready (said {line:?}); stderr:\n{err}");
        };
        Py { child, pid }
    }

    /// The code of a process running the bridge: `extra` runs after it
    /// started, then it says ready and waits.
    fn bridge_code(extra: &str) -> String {
        format!(
            "import os, sys, torch, gpumem_bridge\nassert gpumem_bridge.start()\n{extra}\nprint('ready', os.getpid(), flush=True)\nsys.stdin.read()\n"
        )
    }

    /// A process running the bridge (`extra`: more Python run after it
    /// started), its figures from the stub's state file.
    pub fn bridge(state: &StubState, extra: &str) -> Py {
        Py::spawn(
            &Py::bridge_code(extra),
            &[("TORCH_STUB_STATE", state.path().to_str().unwrap())],
        )
    }

    /// `bridge_to` as `uid` (see [`Py::spawn_as`]); `state` must be
    /// [`StubState::share`]d.
    pub fn bridge_as(
        uid: u32,
        state: &StubState,
        extra: &str,
        env: &[(&str, &str)],
        stderr: Option<&Path>,
    ) -> Py {
        let path = state.path();
        let mut all = vec![("TORCH_STUB_STATE", path.to_str().unwrap())];
        all.extend_from_slice(env);
        Py::spawn_as(uid, &Py::bridge_code(extra), &all, stderr)
    }

    /// `bridge` with more environment (`env`), its stderr into `stderr`.
    pub fn bridge_to(state: &StubState, extra: &str, env: &[(&str, &str)], stderr: &Path) -> Py {
        let path = state.path();
        let mut all = vec![("TORCH_STUB_STATE", path.to_str().unwrap())];
        all.extend_from_slice(env);
        Py::spawn_to(&Py::bridge_code(extra), &all, Some(stderr))
    }

    /// A process that publishes `payload` itself, as a hostile or broken
    /// client would: a memfd with the bridge's name, sealed unless asked.
    /// The payload's file lives in the returned directory.
    pub fn raw(payload: &[u8], seal: bool) -> (Py, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("payload");
        std::fs::write(&file, payload).expect("payload");
        let code = format!(
            "import fcntl, os, sys\n\
             data = open({file:?}, 'rb').read()\n\
             fd = os.memfd_create('gpumem-bridge', os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)\n\
             view = memoryview(data)\n\
             while view:\n    view = view[os.write(fd, view):]\n\
             if {seal}:\n    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)\n\
             print('ready', os.getpid(), flush=True)\n\
             sys.stdin.read()\n",
            file = file.to_str().unwrap(),
            seal = if seal { "True" } else { "False" },
        );
        (Py::spawn(&code, &[]), dir)
    }

    /// A GPU process without the bridge.
    pub fn plain() -> Py {
        Py::spawn(
            "import os, sys\nprint('ready', os.getpid(), flush=True)\nsys.stdin.read()\n",
            &[],
        )
    }

    pub fn pid_str(&self) -> String {
        self.pid.to_string()
    }
}

impl Drop for Py {
    fn drop(&mut self) {
        super::kill_group(&mut self.child);
    }
}
