//! Cgroup paths read from inside a cgroup namespace, made absolute in the
//! host's tree (`path.cgroupfs`), with the kernel vouching for each step.
//!
//! The kernel writes `/proc/<pid>/cgroup` relative to the *reader's*
//! cgroup namespace root: where the exporter runs in a namespace of its
//! own (containerd and CRI-O give one to every non-privileged container
//! on a cgroup v2 node), another pod's path reads
//! `/../../kubepods-besteffort.slice/…` and one below the exporter's own
//! root reads `/sub`. Both are relative to that root, `R`, and only its
//! place in the host's tree makes them absolute. So, per hierarchy:
//!
//! 1. **Where the exporter is.** `R` is found once, in the tree mounted
//!    at `path.cgroupfs`: the directory whose `cgroup.procs` lists the
//!    exporter's own pid (the kernel's list; no tenant writes it) is the
//!    exporter's cgroup, and its path minus the exporter's own relative
//!    path (`/proc/self/cgroup`, `/` in a container) is `R`. A cgroup
//!    namespace's root never moves, so a found `R` is kept for the
//!    process's life. The cheap case first: where the exporter's own path
//!    already lists it, there is no namespace (nothing changes). Else a
//!    walk (breadth-first, at most [`MAX_WALK_DIRS`] directories) at the
//!    first process seen, tried again at most once every [`RETRY`] when
//!    it found nothing (meanwhile paths are taken as the kernel wrote
//!    them: those leaving the namespace, `/..`, fail closed).
//! 2. **Where the process is.** A path is `R` joined with it (each `..`
//!    one level up; above the top fails), and counts only when that
//!    directory's `cgroup.procs` lists the process's pid. Then the owner
//!    and placement checks run on the absolute path as on a host
//!    ([`super::cgroupfs`], [`super::cgroup`], [`super::slurm`]). A path
//!    that fails stays relative (`/..…`) and so fails closed
//!    (`cgroup_unverified`). The caller caches the result per (pid, start
//!    time): one read of `cgroup.procs` per line per new process.
//!
//! Assumption (checked): `cgroup.procs` numbers pids in the reader's pid
//! namespace, `/proc/<pid>` in the namespace of the procfs mount
//! (`path.procfs`). They agree when the exporter shares the pid namespace
//! `path.procfs` shows (the DaemonSet's `hostPID: true` with `/proc`):
//! `<procfs>/self` must name the exporter's own pid, else no path is
//! resolved (and relative ones fail closed, as without this module).
//!
//! A cgroup v2 tree whose top has `cgroup.type` is a namespace's view, not
//! the host's root (the root cgroup has no such file): every v2 path is
//! then refused as unverified, since none can be placed in it.
//!
//! cgroup v1 hierarchies are handled the same way, each on its own (a
//! namespace's root is the exporter's cgroup in each hierarchy at the
//! time it was made).
//!
//! Written by hand (std only): a breadth-first walk of directories and a
//! line search in `cgroup.procs`; no crate does either for cgroups.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::cgroupfs::CgroupFs;
use crate::ratelimit::LogLimiter;

/// Directories one walk for the exporter's own cgroup looks at, at most
/// (a node with a few hundred pods has a few thousand cgroups).
pub(crate) const MAX_WALK_DIRS: usize = 16_384;
/// A hierarchy whose namespace root was not found is looked for again
/// after this long, not before.
pub(crate) const RETRY: Duration = Duration::from_secs(60);

/// The exporter as the kernel shows it to itself through `path.procfs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OwnView {
    /// The exporter's pid, in the pid namespace both `cgroup.procs` (read
    /// by the exporter) and `path.procfs` number pids in.
    pub pid: u32,
    /// `/proc/self/cgroup`: the exporter's own paths, relative to its
    /// cgroup namespace root.
    pub cgroup: String,
    /// Where `cgroup` is read again before each look for a root (the
    /// exporter may have been moved since); `None` in tests.
    pub procfs: Option<PathBuf>,
}

impl OwnView {
    /// From `<procfs>/self`. An error (a line for the log) when procfs
    /// numbers pids in another pid namespace than the exporter's, or
    /// cannot be read.
    pub(crate) fn read(procfs: &Path) -> Result<OwnView, String> {
        let own = std::process::id();
        let link = fs::read_link(procfs.join("self"))
            .map_err(|e| format!("{}/self: {e}", procfs.display()))?;
        let seen: Option<u32> = link.to_str().and_then(|s| s.parse().ok());
        if seen != Some(own) {
            return Err(format!(
                "{}/self is {} but the exporter's pid is {own}: that procfs shows another pid namespace than the one cgroup.procs numbers pids in (run with hostPID: true and path.procfs at /proc)",
                procfs.display(),
                link.display()
            ));
        }
        let cgroup = fs::read_to_string(procfs.join("self/cgroup"))
            .map_err(|e| format!("{}/self/cgroup: {e}", procfs.display()))?;
        Ok(OwnView {
            pid: own,
            cgroup,
            procfs: Some(procfs.to_path_buf()),
        })
    }

    /// `cgroup` read again, where it came from a procfs.
    fn refresh(&mut self) {
        if let Some(text) = self
            .procfs
            .as_ref()
            .and_then(|p| fs::read_to_string(p.join("self/cgroup")).ok())
        {
            self.cgroup = text;
        }
    }

    /// The exporter's own path in the hierarchy of `controllers`.
    fn path(&self, controllers: &str) -> Option<&str> {
        self.cgroup.lines().find_map(|l| {
            let mut p = l.splitn(3, ':');
            let (_, c, path) = (p.next()?, p.next()?, p.next()?);
            (c == controllers).then_some(path.trim())
        })
    }
}

/// Where a hierarchy's namespace root is, once looked for.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Place {
    /// No namespace: paths are absolute already.
    Host,
    /// The namespace root, as directories below the hierarchy's top.
    Below { top: PathBuf, root: Vec<String> },
    /// The tree at `path.cgroupfs` is a namespace's view, not the host's.
    View,
    /// Not found; looked for again at `retry_at`.
    NotFound { retry_at: Instant },
}

/// What a hierarchy's lines are turned into.
enum Frame<'a> {
    /// Left as they are.
    AsIs,
    /// Joined with this namespace root, then checked.
    Root(PathBuf, &'a [String]),
    /// Refused (made relative, so they fail closed).
    Refused,
}

/// The namespace roots found so far, per hierarchy, and how many walks
/// looked for them.
#[derive(Debug)]
pub(crate) struct Namespaces {
    cgroupfs: CgroupFs,
    own: Option<OwnView>,
    places: HashMap<String, Place>,
    walks: u64,
    log: LogLimiter<String>,
}

/// One walk's answer: the exporter's cgroup, as directories below the top.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Walked {
    pub found: Option<Vec<String>>,
    pub dirs: usize,
}

/// Whether `dir/cgroup.procs` lists `pid` (the kernel's list).
pub(crate) fn lists(dir: &Path, pid: u32) -> bool {
    let Ok(file) = fs::File::open(dir.join("cgroup.procs")) else {
        return false;
    };
    let want = pid.to_string();
    let mut reader = BufReader::new(file);
    let mut line = Vec::with_capacity(16);
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return false,
            Ok(_) => {
                if line.strip_suffix(b"\n").unwrap_or(&line) == want.as_bytes() {
                    return true;
                }
            }
        }
    }
}

/// Breadth-first from `top`, the directory whose `cgroup.procs` lists
/// `pid`; at most `max` directories are looked at. Directories whose name
/// is not UTF-8 (no engine makes such) and symlinks are not entered.
pub(crate) fn walk(top: &Path, pid: u32, max: usize) -> Walked {
    let mut queue: VecDeque<Vec<String>> = VecDeque::from([Vec::new()]);
    let mut dirs = 0;
    while let Some(segs) = queue.pop_front() {
        if dirs >= max {
            break;
        }
        dirs += 1;
        let dir: PathBuf = segs.iter().fold(top.to_path_buf(), |d, s| d.join(s));
        if lists(&dir, pid) {
            return Walked {
                found: Some(segs),
                dirs,
            };
        }
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
            if let (true, Some(name)) = (is_dir, e.file_name().to_str()) {
                let mut child = segs.clone();
                child.push(name.to_owned());
                queue.push_back(child);
            }
        }
    }
    Walked { found: None, dirs }
}

/// A path's segments, `None` when it holds `.` or `..` (or is a removed
/// cgroup's).
fn plain_segments(path: &str) -> Option<Vec<String>> {
    let path = path.trim();
    if path.ends_with(" (deleted)") {
        return None;
    }
    let segs: Vec<String> = path
        .split('/')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    (!segs.iter().any(|s| s == "." || s == "..")).then_some(segs)
}

/// `root` joined with the relative `path` (`..` one level up), `None`
/// above the top, on `.` or on a removed cgroup.
fn join(root: &[String], path: &str) -> Option<Vec<String>> {
    let path = path.trim();
    if path.ends_with(" (deleted)") {
        return None;
    }
    let mut abs = root.to_vec();
    for seg in path.split('/').filter(|s| !s.is_empty()) {
        match seg {
            ".." => {
                abs.pop()?;
            }
            "." => return None,
            s => abs.push(s.to_owned()),
        }
    }
    Some(abs)
}

/// A path that fails closed: relative to a namespace root not placed.
fn refused(path: &str) -> String {
    if path.starts_with("/..") {
        path.to_owned()
    } else {
        format!("/..{path}")
    }
}

impl Namespaces {
    /// Paths read by a process that sees itself as `own` (`None`: not
    /// known, paths are taken as they are), checked in `cgroupfs`.
    pub(crate) fn new(cgroupfs: CgroupFs, own: Option<OwnView>) -> Self {
        Namespaces {
            cgroupfs,
            own,
            places: HashMap::new(),
            walks: 0,
            log: LogLimiter::every(RETRY),
        }
    }

    /// Walks for the exporter's own cgroup so far.
    #[cfg(test)]
    pub(crate) fn walks(&self) -> u64 {
        self.walks
    }

    /// `text` (`/proc/<pid>/cgroup` as the exporter reads it) with every
    /// path of a namespaced hierarchy made absolute where the kernel
    /// vouches for it (`cgroup.procs` of the directory lists `pid`), and
    /// made to fail closed where not; `true` when some path failed that
    /// check (the process may have moved: the caller may read again).
    pub(crate) fn absolute<'t>(&mut self, text: &'t str, pid: u32) -> (Cow<'t, str>, bool) {
        let mut out = String::with_capacity(text.len() + 64);
        let mut changed = false;
        let mut failed = false;
        for raw in text.lines() {
            let mut parts = raw.splitn(3, ':');
            let (Some(id), Some(controllers), Some(path)) =
                (parts.next(), parts.next(), parts.next())
            else {
                out.push_str(raw);
                out.push('\n');
                continue;
            };
            let line = match self.frame(controllers) {
                Frame::AsIs => None,
                Frame::Refused => Some(refused(path)),
                Frame::Root(top, root) => match join(root, path) {
                    Some(abs) if lists(&abs.iter().fold(top, |d, s| d.join(s)), pid) => {
                        Some(format!("/{}", abs.join("/")))
                    }
                    _ => {
                        failed = true;
                        Some(refused(path))
                    }
                },
            };
            match line {
                Some(p) => {
                    changed |= p != path;
                    out.push_str(&format!("{id}:{controllers}:{p}\n"));
                }
                None => {
                    out.push_str(raw);
                    out.push('\n');
                }
            }
        }
        if changed {
            (Cow::Owned(out), failed)
        } else {
            (Cow::Borrowed(text), failed)
        }
    }

    /// How the lines of `controllers`' hierarchy are read.
    fn frame(&mut self, controllers: &str) -> Frame<'_> {
        let known = match self.places.get(controllers) {
            Some(Place::NotFound { retry_at }) => *retry_at > Instant::now(),
            Some(_) => true,
            None => false,
        };
        if !known
            && let Some(top) = self.cgroupfs.hierarchy(controllers)
            && let Some(place) = self.locate(controllers, &top)
        {
            self.places.insert(controllers.to_owned(), place);
        }
        match self.places.get(controllers) {
            Some(Place::Below { top, root }) => Frame::Root(top.clone(), root),
            Some(Place::View) => Frame::Refused,
            _ => Frame::AsIs,
        }
    }

    /// Where the namespace root of `controllers`' hierarchy is; `None`
    /// when the exporter's own view is not known.
    fn locate(&mut self, controllers: &str, top: &Path) -> Option<Place> {
        if let Some(own) = &mut self.own {
            own.refresh();
        }
        let own = self.own.as_ref()?;
        if !top.is_dir() {
            // Not mounted there: nothing to place (the owner check says
            // so for any line that names something).
            return Some(Place::Host);
        }
        let key = if controllers.is_empty() {
            "0::"
        } else {
            controllers
        };
        if controllers.is_empty() && top.join("cgroup.type").exists() {
            if self.log.check(key.to_owned()).is_some() {
                tracing::warn!(
                    cgroupfs = %self.cgroupfs.path().display(),
                    "the cgroup v2 tree at path.cgroupfs is a cgroup namespace's view, not the host's (its top has cgroup.type): no pod, container or Slurm job can be placed in it and all are refused as cgroup_unverified; mount the host's /sys/fs/cgroup there"
                );
            }
            return Some(Place::View);
        }
        let Some(own_path) = own.path(controllers) else {
            return Some(Place::Host);
        };
        let Some(own_segs) = plain_segments(own_path) else {
            // The exporter itself outside its namespace's root: its
            // root's place cannot be told from its own.
            return Some(self.not_found(
                key,
                top,
                0,
                "the exporter's own path leaves its namespace",
            ));
        };
        let own_dir = own_segs.iter().fold(top.to_path_buf(), |d, s| d.join(s));
        if lists(&own_dir, own.pid) {
            return Some(Place::Host);
        }
        let started = Instant::now();
        self.walks += 1;
        let walked = walk(top, own.pid, MAX_WALK_DIRS);
        let root = walked.found.as_ref().and_then(|found| {
            let keep = found.len().checked_sub(own_segs.len())?;
            (found[keep..] == own_segs[..]).then(|| found[..keep].to_vec())
        });
        match root {
            Some(root) if root.is_empty() => Some(Place::Host),
            Some(root) => {
                tracing::info!(
                    hierarchy = key,
                    root = %format!("/{}", root.join("/")),
                    cgroupfs = %self.cgroupfs.path().display(),
                    dirs = walked.dirs,
                    took = ?started.elapsed(),
                    "the exporter runs in a cgroup namespace of its own: its root placed in the host's tree (the directory whose cgroup.procs lists the exporter); other processes' paths are read relative to it, each checked against its directory's cgroup.procs"
                );
                Some(Place::Below {
                    top: top.to_path_buf(),
                    root,
                })
            }
            None => {
                let why = match &walked.found {
                    Some(found) => format!(
                        "the exporter is at /{} there, which does not end in its own path {own_path}",
                        found.join("/")
                    ),
                    None => format!(
                        "no directory's cgroup.procs lists the exporter (pid {}) in {} directories",
                        own.pid, walked.dirs
                    ),
                };
                Some(self.not_found(key, top, walked.dirs, &why))
            }
        }
    }

    fn not_found(&mut self, key: &str, top: &Path, dirs: usize, why: &str) -> Place {
        if self.log.check(key.to_owned()).is_some() {
            tracing::warn!(
                hierarchy = key,
                top = %top.display(),
                dirs,
                why,
                "the exporter runs in a cgroup namespace of its own but its root was not found in the tree at path.cgroupfs: paths relative to it stay unverified (counted as cgroup_unverified); looked for again in a minute"
            );
        }
        Place::NotFound {
            retry_at: Instant::now() + RETRY,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake tree: directories with a `cgroup.procs` listing pids.
    fn procs(root: &Path, dir: &str, pids: &[u32]) {
        let d = root.join(dir.trim_start_matches('/'));
        fs::create_dir_all(&d).unwrap();
        let text: String = pids.iter().map(|p| format!("{p}\n")).collect();
        fs::write(d.join("cgroup.procs"), text).unwrap();
    }

    fn own(pid: u32, cgroup: &str) -> Option<OwnView> {
        Some(OwnView {
            pid,
            cgroup: cgroup.into(),
            procfs: None,
        })
    }

    const POD: &str = "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice";

    /// The exporter in its pod's container (pid 10), the namespace root;
    /// a victim (20) in another pod, a process (30) below the exporter's
    /// root: their paths made absolute, each only where its directory
    /// lists it.
    #[test]
    fn relative_paths_are_made_absolute_where_the_kernel_lists_them() {
        let t = tempfile::tempdir().unwrap();
        let top = t.path().join("unified");
        procs(&top, "", &[1]);
        procs(&top, &format!("{POD}/cri-containerd-a.scope"), &[10]);
        procs(&top, &format!("{POD}/cri-containerd-a.scope/sub"), &[30]);
        procs(
            &top,
            "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod2.slice/cri-containerd-b.scope",
            &[20],
        );
        let mut ns = Namespaces::new(CgroupFs::new(t.path()), own(10, "0::/\n"));
        let victim = "0::/../../../kubepods-besteffort.slice/kubepods-besteffort-pod2.slice/cri-containerd-b.scope\n";
        let (abs, failed) = ns.absolute(victim, 20);
        assert_eq!(
            (&*abs, failed),
            (
                "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod2.slice/cri-containerd-b.scope\n",
                false
            )
        );
        assert_eq!(ns.walks(), 1);
        // Below the exporter's root: made absolute too, no second walk.
        let (abs, _) = ns.absolute("0::/sub\n", 30);
        assert_eq!(&*abs, format!("0::/{POD}/cri-containerd-a.scope/sub\n"));
        // The same path claimed for a pid the directory does not list,
        // above the top, `.`, removed: fail closed (stay relative).
        for (text, pid, want) in [
            (victim, 30, victim.to_string()),
            (
                "0::/../../../../../../x\n",
                20,
                "0::/../../../../../../x\n".into(),
            ),
            ("0::/./x\n", 20, "0::/.././x\n".into()),
            ("0::/sub (deleted)\n", 30, "0::/../sub (deleted)\n".into()),
            ("0::/\n", 20, "0::/../\n".into()),
        ] {
            let (abs, failed) = ns.absolute(text, pid);
            assert_eq!((&*abs, failed), (want.as_str(), true), "{text}");
        }
        // Init at the host's root.
        assert_eq!(&*ns.absolute("0::/../../../..\n", 1).0, "0::/\n");
        assert_eq!(ns.walks(), 1);
    }

    /// No namespace (the exporter's own path lists it): nothing changes
    /// and nothing is walked; a v1 hierarchy is placed on its own.
    #[test]
    fn host_paths_stay_and_v1_hierarchies_are_placed_apart() {
        let t = tempfile::tempdir().unwrap();
        procs(&t.path().join("unified"), "system.slice/x.service", &[10]);
        procs(&t.path().join("memory"), "", &[]);
        procs(&t.path().join("memory"), "box/ns", &[10]);
        procs(&t.path().join("memory"), "slurm/uid_5/job_7/step_0", &[40]);
        let mut ns = Namespaces::new(
            CgroupFs::new(t.path()),
            own(10, "4:memory:/\n0::/system.slice/x.service\n"),
        );
        let text = "4:memory:/../../slurm/uid_5/job_7/step_0\n0::/system.slice/y.service\n";
        let (abs, failed) = ns.absolute(text, 40);
        assert_eq!(
            (&*abs, failed),
            (
                "4:memory:/slurm/uid_5/job_7/step_0\n0::/system.slice/y.service\n",
                false
            )
        );
        assert_eq!(ns.walks(), 1);
        // Unknown own view (tests, another pid namespace): as they are.
        let mut blind = Namespaces::new(CgroupFs::new(t.path()), None);
        assert!(matches!(blind.absolute(text, 40).0, Cow::Borrowed(_)));
    }

    /// Not found: relative paths stay unverified, the walk is bounded and
    /// not repeated before the retry time; a v2 tree that is a
    /// namespace's view refuses every v2 path.
    #[test]
    fn a_root_not_found_fails_closed_and_is_not_walked_per_process() {
        let t = tempfile::tempdir().unwrap();
        let top = t.path().join("unified");
        for i in 0..50 {
            procs(&top, &format!("d{i}/e"), &[]);
        }
        let mut ns = Namespaces::new(CgroupFs::new(t.path()), own(10, "0::/\n"));
        for pid in 0..20 {
            let (abs, _) = ns.absolute("0::/../kubepods.slice/x\n", pid);
            assert_eq!(&*abs, "0::/../kubepods.slice/x\n");
        }
        assert_eq!(ns.walks(), 1);
        assert_eq!(walk(&top, 10, 7).dirs, 7);
        assert_eq!(walk(&top, 10, MAX_WALK_DIRS).dirs, 101);

        fs::write(top.join("cgroup.type"), "domain\n").unwrap();
        let mut view = Namespaces::new(CgroupFs::new(t.path()), own(10, "0::/\n"));
        assert_eq!(
            &*view.absolute("0::/kubepods.slice\n", 1).0,
            "0::/../kubepods.slice\n"
        );
    }

    #[test]
    fn own_view_needs_the_same_pid_namespace() {
        let t = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("4242", t.path().join("self")).unwrap();
        let err = OwnView::read(t.path()).unwrap_err();
        assert!(err.contains("another pid namespace"), "{err}");
        let real = OwnView::read(Path::new("/proc")).unwrap();
        assert_eq!(real.pid, std::process::id());
    }
}
