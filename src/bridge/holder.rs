//! Who pays for a bridge connection: its budget holder.
//!
//! A uid alone is a poor budget on a Kubernetes node: most containers run
//! as uid 0 without user namespaces, so one pod's connections would use up
//! every other uid-0 pod's. So the holder is what the kernel vouches for
//! beyond the uid: the pod, else the container, else the Slurm job of the
//! peer's cgroup path, each only where attribution would accept it (the
//! name at its real place, [`crate::attribute::cgroup`], on a path of
//! root-owned directories, [`crate::attribute::cgroupfs`], made absolute
//! where the exporter runs in a cgroup namespace,
//! [`crate::attribute::cgroupns`]); else the uid. A tenant that creates
//! cgroups (a delegated `user@UID.service`) stays its uid: the owner
//! check refuses the names it made.
//!
//! Resolving costs a read of `/proc/<pid>/cgroup` and a `stat` per path
//! component, so it is cached per process. Where pidfds are pidfs files
//! (Linux ≥ 6.9) the cache key is the pidfd's inode number, unique to one
//! process for the boot: a process that reconnects costs one `fstat`, not
//! a /proc read, and a recycled pid can never find another's entry.

use std::collections::HashMap;
use std::os::fd::BorrowedFd;

use crate::attribute::cgroup;
use crate::attribute::cgroupfs::{CgroupFs, Ownership};
use crate::attribute::cgroupns::{Namespaces, OwnView};
use crate::attribute::procfs::ProcRoot;
use crate::attribute::slurm;

/// A budget holder.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Holder {
    Pod(String),
    Container(String),
    Job(String),
    Uid(u32),
}

impl Holder {
    /// For a log line.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Holder::Pod(_) => "pod",
            Holder::Container(_) => "container",
            Holder::Job(_) => "slurm job",
            Holder::Uid(_) => "uid",
        }
    }
}

/// Processes cached at most (entries of exited processes go first).
const CACHE: usize = 4096;

/// `PID_FS_MAGIC`: pidfds are files of their own (Linux ≥ 6.9).
const PIDFS_MAGIC: i64 = 0x5049_4446;

/// Resolves peers to holders, with the cache.
pub(crate) struct Holders {
    root: ProcRoot,
    cgroupfs: CgroupFs,
    namespaces: Namespaces,
    /// pidfs inode → (start time, holder).
    cache: HashMap<u64, (u64, Holder)>,
    pidfs: bool,
}

impl std::fmt::Debug for Holders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holders")
            .field("cached", &self.cache.len())
            .finish()
    }
}

/// The inode of a pidfd, where pidfds are pidfs files.
pub(crate) fn pidfd_inode(pidfd: BorrowedFd<'_>) -> Option<u64> {
    rustix::fs::fstat(pidfd).ok().map(|s| s.st_ino)
}

fn is_pidfs(pidfd: BorrowedFd<'_>) -> bool {
    // `f_type`'s C type differs between targets (i64 here, u32 or i32 on
    // others): the cast is the portable comparison.
    #[allow(clippy::unnecessary_cast)]
    rustix::fs::fstatfs(pidfd).is_ok_and(|s| s.f_type as i64 == PIDFS_MAGIC)
}

impl Holders {
    pub(crate) fn new(root: ProcRoot, cgroupfs: &str) -> Holders {
        let cgroupfs = CgroupFs::new(cgroupfs);
        let own = OwnView::read(root.path()).ok();
        let pidfs = rustix::process::pidfd_open(
            rustix::process::getpid(),
            rustix::process::PidfdFlags::empty(),
        )
        .is_ok_and(|fd| is_pidfs(std::os::fd::AsFd::as_fd(&fd)));
        Holders {
            namespaces: Namespaces::new(cgroupfs.clone(), own),
            root,
            cgroupfs,
            cache: HashMap::new(),
            pidfs,
        }
    }

    /// The start time and holder of the live process behind `pidfd`, when
    /// it was resolved before.
    pub(crate) fn cached(&self, pidfd: BorrowedFd<'_>) -> Option<(u64, Holder)> {
        if !self.pidfs {
            return None;
        }
        self.cache.get(&pidfd_inode(pidfd)?).cloned()
    }

    /// Remember what `pidfd`'s process resolved to.
    pub(crate) fn remember(&mut self, pidfd: BorrowedFd<'_>, start: u64, holder: &Holder) {
        if !self.pidfs {
            return;
        }
        let Some(ino) = pidfd_inode(pidfd) else {
            return;
        };
        if self.cache.len() >= CACHE {
            // Inode numbers only grow; the oldest half are the likeliest
            // gone. Cheap and bounded; a dropped entry is only resolved
            // again.
            let mut keys: Vec<u64> = self.cache.keys().copied().collect();
            keys.sort_unstable();
            for k in &keys[..keys.len() / 2] {
                self.cache.remove(k);
            }
        }
        self.cache.insert(ino, (start, holder.clone()));
    }

    /// The holder of process `pid` of real uid `uid`.
    pub(crate) fn resolve(&mut self, pid: u32, uid: u32) -> Holder {
        let Some(text) = self.root.cgroup(pid) else {
            return Holder::Uid(uid);
        };
        let (abs, _) = self.namespaces.absolute(&text, pid);
        of_cgroup(&abs, uid, &self.cgroupfs)
    }
}

/// The holder `text` (an absolute `/proc/<pid>/cgroup`) vouches for, with
/// each directory's owner read from `cgroupfs`.
pub(crate) fn of_cgroup(text: &str, uid: u32, cgroupfs: &CgroupFs) -> Holder {
    let trusted = |line| cgroupfs.check(line) == Ownership::Trusted;
    let parsed = cgroup::parse_cgroup_lines(text);
    let id = parsed.identity;
    if let Some(line) = parsed.line.filter(|_| id.names_workload())
        && trusted(line)
    {
        if let Some(pod) = id.pod_uid {
            return Holder::Pod(pod);
        }
        if let Some(c) = id.container_id {
            return Holder::Container(c);
        }
    }
    let parsed = slurm::parse_slurm_cgroup_lines(text);
    if let (Some(job), Some(line)) = (parsed.job, parsed.line)
        && trusted(line)
    {
        return Holder::Job(job.job);
    }
    Holder::Uid(uid)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a tree owned by whoever runs the test (trusted, as root is on a
    /// host): the pod, container and job where they stand, else the uid.
    /// Directories of another owner are the e2e area's (chown needs root).
    #[test]
    fn holders_of_paths() {
        let root = tempfile::tempdir().unwrap();
        let fs_ = CgroupFs::new(root.path());
        let pod = "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0a1b2c3d_0000_4000_8000_000000000001.slice/cri-containerd-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa.scope";
        let docker = "/system.slice/docker-bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb.scope";
        for p in [pod, docker] {
            std::fs::create_dir_all(root.path().join("unified").join(&p[1..])).unwrap();
        }
        std::fs::create_dir_all(root.path().join("freezer/slurm/uid_0/job_42/step_0")).unwrap();
        let cases = [
            (
                format!("0::{pod}\n"),
                Holder::Pod("0a1b2c3d-0000-4000-8000-000000000001".into()),
            ),
            (format!("0::{docker}\n"), Holder::Container("b".repeat(64))),
            (
                "4:freezer:/slurm/uid_0/job_42/step_0\n0::/\n".into(),
                Holder::Job("42".into()),
            ),
            ("0::/user.slice\n".into(), Holder::Uid(7)),
            // Named, but not there to be checked: the uid.
            (
                "0::/kubepods.slice/kubepods-podffffffff_0000_4000_8000_000000000009.slice\n"
                    .into(),
                Holder::Uid(7),
            ),
            ("".into(), Holder::Uid(7)),
        ];
        for (text, want) in cases {
            assert_eq!(of_cgroup(&text, 7, &fs_), want, "{text}");
        }
    }
}
