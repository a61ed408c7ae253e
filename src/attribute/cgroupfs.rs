//! Who made a process's cgroup: the owner of every directory on its cgroup
//! path, read from the real cgroup filesystem (`path.cgroupfs`, by default
//! `/sys/fs/cgroup`).
//!
//! Architecture invariant: **a cgroup a tenant could create names no job
//! and no pod.** Only root (or the owner of the hierarchy's top directory,
//! which is root on every host) creates the kubelet's, the engines' and
//! slurmd's cgroups; systemd hands a user's manager `user@UID.service`
//! with that uid as its owner (`Delegate=yes`), and so does every other
//! delegation: the kernel lets a non-root uid create cgroups only below a
//! directory it was given. So a directory owned by anyone else, anywhere
//! on the path from the top to the process's own cgroup, means the path's
//! names below it are that uid's choice. A path that cannot be checked
//! (the cgroup filesystem not mounted there, a path still relative to a
//! cgroup namespace that [`super::cgroupns`] could not place, a directory
//! gone) counts for nothing either: the check fails closed.
//!
//! Written by hand (std only): a `stat` per path component.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::cgroup::CgroupLine;

/// What the owners of a path's directories say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ownership {
    /// Every directory from the hierarchy's top to the process's cgroup
    /// belongs to root (or the top's owner).
    Trusted,
    /// This directory on the path belongs to `uid`: everything at or below
    /// it is that uid's making.
    Delegated { uid: u32 },
    /// The path could not be checked (see [`Unverifiable`]).
    Unverified(Unverifiable),
}

/// Why a path could not be checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unverifiable {
    /// No hierarchy for the line's controllers under the cgroup root.
    NoHierarchy,
    /// The path leaves the reader's cgroup namespace (`/../…`: the
    /// exporter runs in a cgroup namespace of its own) or holds `.`.
    OtherNamespace,
    /// A directory on the path is missing, is no directory, or could not
    /// be read.
    Missing,
}

/// The cgroup filesystem's root: `/sys/fs/cgroup` on a host, the host's
/// mounted elsewhere in a container, a directory tree in tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CgroupFs {
    root: PathBuf,
}

impl CgroupFs {
    pub(crate) fn new(root: impl Into<PathBuf>) -> Self {
        CgroupFs { root: root.into() }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.root
    }

    /// The top directory of the hierarchy a line of `/proc/<pid>/cgroup`
    /// is in: cgroup v2 (`0::`) at the root where the root is itself a
    /// cgroup2 mount (it has `cgroup.controllers`), else at `unified/`
    /// (systemd's hybrid layout); a v1 hierarchy at its controllers' name
    /// (`memory`, `cpu,cpuacct`, `name=systemd` at `systemd`).
    pub(crate) fn hierarchy(&self, controllers: &str) -> Option<PathBuf> {
        if controllers.is_empty() {
            if self.root.join("cgroup.controllers").is_file() {
                return Some(self.root.clone());
            }
            return Some(self.root.join("unified"));
        }
        let name = controllers.strip_prefix("name=").unwrap_or(controllers);
        let plain = !name.is_empty()
            && name != "."
            && name != ".."
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b',' | b'_' | b'-' | b'.'));
        plain.then(|| self.root.join(name))
    }

    /// The owners of every directory on `line`'s path, top first; the
    /// first one owned by someone else decides.
    pub(crate) fn check(&self, line: CgroupLine<'_>) -> Ownership {
        let Some(mut dir) = self.hierarchy(line.controllers) else {
            return Ownership::Unverified(Unverifiable::NoHierarchy);
        };
        // The top may be a symlink (`cpu` → `cpu,cpuacct`): followed once.
        let top = match fs::metadata(&dir) {
            Ok(m) if m.is_dir() => m,
            _ => return Ownership::Unverified(Unverifiable::NoHierarchy),
        };
        let trusted = |uid: u32| uid == 0 || uid == top.uid();
        let path = line.path.trim();
        if path.ends_with(" (deleted)") {
            return Ownership::Unverified(Unverifiable::Missing);
        }
        for segment in path.split('/').filter(|s| !s.is_empty()) {
            if segment == "." || segment == ".." {
                return Ownership::Unverified(Unverifiable::OtherNamespace);
            }
            dir.push(segment);
            // Never followed: a cgroup filesystem holds no symlinks.
            let meta = match fs::symlink_metadata(&dir) {
                Ok(m) if m.is_dir() => m,
                _ => return Ownership::Unverified(Unverifiable::Missing),
            };
            if !trusted(meta.uid()) {
                return Ownership::Delegated { uid: meta.uid() };
            }
        }
        Ownership::Trusted
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn line<'a>(controllers: &'a str, path: &'a str) -> CgroupLine<'a> {
        CgroupLine { controllers, path }
    }

    /// A tree owned by whoever runs the test (its top's owner is trusted,
    /// as root is on a host): every directory is trusted, odd paths are
    /// unverified; a hybrid layout puts v2 at `unified/`, a pure one at
    /// the root. A directory of another owner is the e2e area `tenant`'s
    /// (chown needs root), on the real cgroup filesystem.
    #[test]
    fn owners_of_a_tree() {
        let root = tempfile::tempdir().unwrap();
        let fs_ = CgroupFs::new(root.path());
        let mk = |p: &str| std::fs::create_dir_all(root.path().join(p)).unwrap();
        mk("unified/kubepods.slice/kubepods-pod1.slice");
        mk("memory/slurm/uid_0/job_1/step_0");
        mk("cpu,cpuacct/docker");
        symlink("cpu,cpuacct", root.path().join("cpu")).unwrap();
        mk("systemd/system.slice");
        std::fs::write(root.path().join("memory/slurm/uid_0/file"), "").unwrap();
        symlink(
            root.path().join("memory/slurm"),
            root.path().join("memory/link"),
        )
        .unwrap();
        use Ownership::*;
        use Unverifiable::*;
        let cases = [
            ("", "/kubepods.slice/kubepods-pod1.slice", Trusted),
            ("", "/", Trusted),
            ("memory", "/slurm/uid_0/job_1/step_0", Trusted),
            ("cpu", "/docker", Trusted),
            ("cpu,cpuacct", "/docker", Trusted),
            ("name=systemd", "/system.slice", Trusted),
            ("memory", "/slurm/uid_0/job_2", Unverified(Missing)),
            ("memory", "/slurm/uid_0/file", Unverified(Missing)),
            ("memory", "/link/uid_0", Unverified(Missing)),
            (
                "memory",
                "/slurm/uid_0/job_1 (deleted)",
                Unverified(Missing),
            ),
            ("", "/../../kubepods.slice", Unverified(OtherNamespace)),
            ("", "/kubepods.slice/./x", Unverified(OtherNamespace)),
            ("freezer", "/slurm", Unverified(NoHierarchy)),
            ("name=../memory", "/slurm", Unverified(NoHierarchy)),
            ("a/b", "/", Unverified(NoHierarchy)),
        ];
        for (controllers, path, want) in cases {
            assert_eq!(
                fs_.check(line(controllers, path)),
                want,
                "{controllers}:{path}"
            );
        }
        // Pure cgroup v2: the root is the hierarchy.
        std::fs::write(root.path().join("cgroup.controllers"), "").unwrap();
        mk("system.slice");
        assert_eq!(fs_.check(line("", "/system.slice")), Trusted);
        assert_eq!(fs_.check(line("", "/kubepods.slice")), Unverified(Missing));
    }
}
