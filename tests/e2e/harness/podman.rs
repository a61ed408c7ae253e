//! A real Podman (Debian's podman 4.3 with runc) whose whole state lives in
//! one temp dir: storage (`--root`, `--storage-driver vfs`), run state
//! (`--runroot`), and a containers.conf holding `default_ulimits = []`
//! (crun, and runc's defaults, refuse this machine's hybrid cgroups). The
//! same flags drive buildah (scripts/ci/build-image `--storage`), so an
//! image it builds is there to run. The guard removes every container on
//! drop; the temp dir takes the images with it.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use super::output_text;
use super::tools::require_tool;

/// containers.conf for this machine: runc, cgroupfs, file events, and no
/// default ulimits.
const CONTAINERS_CONF: &str = "[containers]\ndefault_ulimits = []\n[engine]\nruntime = \"runc\"\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\n";

pub struct Podman {
    dir: tempfile::TempDir,
}

impl Podman {
    pub fn new() -> Podman {
        require_tool("podman");
        require_tool("runc");
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("containers.conf"), CONTAINERS_CONF)
            .expect("write containers.conf");
        Podman { dir }
    }

    /// The state directory (`--storage` of scripts/ci/build-image).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `podman` with its state in the temp dir.
    pub fn cmd(&self, args: &[&str]) -> Command {
        let d = self.dir.path();
        let mut c = Command::new("podman");
        c.env("CONTAINERS_CONF", d.join("containers.conf"))
            .arg("--root")
            .arg(d.join("root"))
            .arg("--runroot")
            .arg(d.join("run"))
            .arg("--tmpdir")
            .arg(d.join("tmp"))
            .args(["--storage-driver", "vfs", "--runtime", "runc"])
            .args(["--cgroup-manager", "cgroupfs", "--events-backend", "file"])
            .args(args)
            .stdin(Stdio::null());
        c
    }

    /// Run `podman args`, whatever its exit status.
    pub fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().expect("run podman")
    }

    /// Run `podman args`; its stdout, trimmed. Fails the test on error.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "podman {args:?}: {}",
            output_text(&out)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self
            .cmd(&["rm", "--all", "--force", "--time", "0"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}
