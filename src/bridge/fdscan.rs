//! The fd fallback, for bridges older than the socket (gpumem_bridge
//! before 0.4 publish only a memfd) where the exporter may look at a
//! process's fds: its own uid, or `CAP_SYS_PTRACE` (which no shipped
//! deployment grants any more).
//!
//! Such a process holds a memfd named `gpumem-bridge`, so its
//! `/proc/<pid>/fd/<n>` link reads [`LINK_TARGET`]. Each document is
//! written into a fresh memfd, sealed (no write, grow or shrink), then
//! `dup2`-ed onto the published fd number, so a reader sees one whole
//! document or the previous one; an unsealed file is one still being
//! written and is skipped.
//!
//! **Never reopened by path.** The link only says where to look: the file
//! itself is taken with `pidfd_getfd` (a duplicate of the process's own fd,
//! through a pidfd whose start time was checked), then its name is read
//! from the exporter's own `/proc/self/fd`, it must be a sealed memfd, and
//! it is read with `pread` (the offset is the process's). So a process that
//! swaps another file onto that number between the check and the read can
//! at most hand over a file it already had open, which is not opened again:
//! an `O_PATH` fd cannot even be read, and no path, device node or FIFO is
//! ever opened on its behalf.
//!
//! **A budget per sample, shared fairly.** The fds of a process without a
//! known bridge fd are probed by number (`readlinkat` on its fd directory:
//! no listing), at most [`PROBES_PER_SAMPLE`] in all per full sample. The
//! probing happens at the end of the sample, for every process that is due,
//! the least recently served first, each a share of the budget (at least
//! [`MIN_SLICE`]), resuming where its last share stopped; a found fd is read
//! from the next sample on. At most [`MAX_FDS_SCANNED`] fds per process
//! (fewer when its fd table is smaller, `FDSize` in its status). A process
//! found without one is scanned again after [`RESCAN_AFTER`], doubling up
//! to [`MAX_RESCAN_AFTER`]; one first seen less than [`GRACE`] ago waits,
//! so a bridge that sends over the socket is not scanned at all. What
//! processes with thousands of fds cost is the budget's, not their choice,
//! and they cannot keep another process's scan from its turn.

use std::collections::HashMap;
use std::fs::File;
use std::io::ErrorKind;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags};

use super::document::{self, Document, DropReason, MAX_DOCUMENT_BYTES};
use crate::attribute::procfs::ProcRoot;

/// What `/proc/<pid>/fd/<n>` reads for the bridge's memfd.
pub(crate) const LINK_TARGET: &str = "/memfd:gpumem-bridge (deleted)";
/// Fd numbers probed per process, at most.
pub(crate) const MAX_FDS_SCANNED: u32 = 4096;
/// Fd links probed per full sample, for all processes together.
pub(crate) const PROBES_PER_SAMPLE: u32 = 512;
/// A due process gets at least this many probes when it is served.
pub(crate) const MIN_SLICE: u32 = 16;
/// A process without the bridge's memfd is scanned again after this long
/// (a process may start the bridge after it started using the GPU)...
pub(crate) const RESCAN_AFTER: Duration = Duration::from_secs(5);
/// ...doubling each time it is still without one, up to this.
pub(crate) const MAX_RESCAN_AFTER: Duration = Duration::from_secs(300);
/// A process is not scanned before it has been seen for this long: a
/// bridge that talks over the socket has sent its first document by then.
pub(crate) const GRACE: Duration = Duration::from_secs(2);

/// Seals a published document must carry: it can no longer change.
pub(crate) const REQUIRED_SEALS: libc::c_int =
    libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK;

/// The result of reading one process.
#[derive(Debug, PartialEq)]
pub(crate) enum Outcome {
    Document(Document),
    Dropped(DropReason),
    /// Nothing this sample: no bridge (yet), not ready, gone, out of budget.
    Nothing,
}

/// Per process: where its memfd is, keyed by start time so a reused pid
/// starts afresh.
#[derive(Debug)]
struct Tracked {
    start: u64,
    first_seen: Instant,
    fd: Option<u32>,
    /// The next fd number to probe.
    cursor: u32,
    next_scan: Instant,
    backoff: Duration,
    /// Permission denials are counted once per process.
    denied: bool,
    /// Due for probing in this sample (marked by `read`).
    due: bool,
    /// When its fds were last probed.
    served: Option<Instant>,
    /// A denial seen while probing, to be reported by the next `read`.
    denied_pending: bool,
}

impl Tracked {
    fn new(start: u64, now: Instant) -> Tracked {
        Tracked {
            start,
            first_seen: now,
            fd: None,
            cursor: 0,
            next_scan: now,
            backoff: RESCAN_AFTER,
            denied: false,
            due: false,
            served: None,
            denied_pending: false,
        }
    }

    /// Scanned to the end (or refused): again after the backoff.
    fn back_off(&mut self, now: Instant) {
        self.cursor = 0;
        self.next_scan = now + self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_RESCAN_AFTER);
    }
}

/// The fallback reader: owned by the sampler thread; its state across
/// ticks is the fd number (or the scan's place) per (pid, start time).
#[derive(Debug)]
pub(crate) struct FdScan {
    root: ProcRoot,
    tracked: HashMap<u32, Tracked>,
    /// Fd links probed so far (for tests and benchmarks).
    probes: u64,
    grace: Duration,
}

/// A probe's answer.
enum Probe {
    Found(u32),
    /// Scanned to the end without finding it.
    None,
    /// The budget ran out first: go on next sample.
    Later,
    Denied,
}

impl FdScan {
    pub(crate) fn new(root: ProcRoot) -> FdScan {
        FdScan {
            root,
            tracked: HashMap::new(),
            probes: 0,
            grace: GRACE,
        }
    }

    /// Without the grace period (tests of this process's own fds).
    #[cfg(test)]
    pub(crate) fn without_grace(mut self) -> FdScan {
        self.grace = Duration::ZERO;
        self
    }

    /// End of a full sample: forget the processes no longer on any GPU,
    /// then probe the fds of those due, within the sample's budget.
    pub(crate) fn end_tick(&mut self, live: &dyn Fn(u32) -> bool) {
        self.tracked.retain(|pid, _| live(*pid));
        self.scan_due();
    }

    /// Share [`PROBES_PER_SAMPLE`] among the due processes, the least
    /// recently served first.
    fn scan_due(&mut self) {
        let now = Instant::now();
        let mut due: Vec<(Option<Instant>, u32)> = self
            .tracked
            .iter()
            .filter(|(_, t)| t.due)
            .map(|(pid, t)| (t.served, *pid))
            .collect();
        if due.is_empty() {
            return;
        }
        due.sort();
        let mut budget = PROBES_PER_SAMPLE;
        let slice = (budget / due.len() as u32).max(MIN_SLICE);
        for (_, pid) in due {
            let Some(t) = self.tracked.get_mut(&pid) else {
                continue;
            };
            t.due = false;
            if budget == 0 {
                continue;
            }
            let dir = self.root.path().join(pid.to_string()).join("fd");
            let Ok(dirfd) = rustix::fs::open(
                &dir,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            ) else {
                continue;
            };
            t.served = Some(now);
            let limit = fd_table_size(&self.root, pid).min(MAX_FDS_SCANNED);
            let mut share = slice.min(budget);
            let before = share;
            let found = probe(&dirfd, t, limit, &mut share, &mut self.probes);
            budget -= before - share;
            match found {
                Probe::Found(fd) => {
                    t.fd = Some(fd);
                    t.backoff = RESCAN_AFTER;
                }
                Probe::Later => {}
                Probe::None => t.back_off(now),
                Probe::Denied => {
                    t.back_off(now);
                    t.denied_pending = true;
                }
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn probes(&self) -> u64 {
        self.probes
    }

    /// The document process (`pid`, `start`) published, if it is found
    /// within the budget. `Dropped(Permission)` comes once per process.
    pub(crate) fn read(&mut self, pid: u32, start: u64) -> Outcome {
        let now = Instant::now();
        let t = self
            .tracked
            .entry(pid)
            .or_insert_with(|| Tracked::new(start, now));
        if t.start != start {
            *t = Tracked::new(start, now);
        }
        if now.saturating_duration_since(t.first_seen) < self.grace {
            return Outcome::Nothing;
        }
        if std::mem::take(&mut t.denied_pending) {
            return denied_once(t);
        }
        let dir = self.root.path().join(pid.to_string()).join("fd");
        let Ok(dirfd) = rustix::fs::open(
            &dir,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        ) else {
            return Outcome::Nothing;
        };
        // The cached fd still names the bridge's memfd? (Checked each tick:
        // fd numbers are reused.)
        if let Some(fd) = t.fd
            && !matches!(link_is_bridge(&dirfd, fd), Ok(true))
        {
            t.fd = None;
            t.cursor = 0;
            t.next_scan = now;
        }
        let Some(fd) = t.fd else {
            // Probed at the end of this sample, if its turn has come.
            t.due = now >= t.next_scan;
            return Outcome::Nothing;
        };
        match take_fd(&self.root, pid, start, fd) {
            Ok(file) => read_document(file),
            Err(Errno::PERM | Errno::ACCESS) => denied_once(t),
            Err(_) => Outcome::Nothing,
        }
    }
}

fn denied_once(t: &mut Tracked) -> Outcome {
    if t.denied {
        return Outcome::Nothing;
    }
    t.denied = true;
    Outcome::Dropped(DropReason::Permission)
}

/// Probe `t`'s fds from its cursor, within `limit` and `budget` (what is
/// left of it is left in it).
fn probe(
    dirfd: &OwnedFd,
    t: &mut Tracked,
    limit: u32,
    budget: &mut u32,
    probes: &mut u64,
) -> Probe {
    while t.cursor < limit {
        if *budget == 0 {
            return Probe::Later;
        }
        *budget -= 1;
        *probes += 1;
        let fd = t.cursor;
        t.cursor += 1;
        match link_is_bridge(dirfd, fd) {
            Ok(true) => return Probe::Found(fd),
            Ok(false) => {}
            // Listing allowed but reading links not (another uid, or a
            // non-dumpable process): nothing more to learn from it.
            Err(Errno::ACCESS | Errno::PERM) => return Probe::Denied,
            Err(_) => {}
        }
    }
    Probe::None
}

/// `Ok(true)` when fd `fd` (under the process's fd directory `dirfd`)
/// names the bridge's memfd.
fn link_is_bridge(dirfd: &OwnedFd, fd: u32) -> Result<bool, Errno> {
    let mut buf = Vec::with_capacity(64);
    let link = rustix::fs::readlinkat(dirfd, fd.to_string(), std::mem::take(&mut buf))?;
    Ok(link.as_bytes() == LINK_TARGET.as_bytes())
}

/// The size of the process's fd table (`FDSize:` in its status): no fd
/// is at or above it.
fn fd_table_size(root: &ProcRoot, pid: u32) -> u32 {
    let path = root.path().join(pid.to_string()).join("status");
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("FDSize:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(MAX_FDS_SCANNED)
}

/// A duplicate of the process's fd `fd`, taken through a pidfd of the
/// process started at `start` (never the path reopened).
fn take_fd(root: &ProcRoot, pid: u32, start: u64, fd: u32) -> Result<File, Errno> {
    let p = Pid::from_raw(pid as i32).ok_or(Errno::SRCH)?;
    let pidfd = rustix::process::pidfd_open(p, PidfdFlags::empty())?;
    // The pidfd names the process we looked up, not a new one with its pid.
    if root.start_time(pid) != Some(start) {
        return Err(Errno::SRCH);
    }
    let ours = rustix::process::pidfd_getfd(&pidfd, fd as i32, PidfdGetfdFlags::empty())?;
    // Its name, from our own fd table: no privilege, no reopen.
    let own = format!("/proc/self/fd/{}", ours.as_raw_fd());
    match rustix::fs::readlink(own.as_str(), Vec::new()) {
        Ok(name) if name.as_bytes() == LINK_TARGET.as_bytes() => Ok(File::from(ours)),
        _ => Err(Errno::BADF),
    }
}

/// Read the document from the bridge's memfd (a duplicate of the
/// process's fd: positioned reads, the offset is the process's).
pub(crate) fn read_document(file: File) -> Outcome {
    let Ok(meta) = file.metadata() else {
        return Outcome::Nothing;
    };
    if !meta.is_file() {
        return Outcome::Dropped(DropReason::Malformed);
    }
    let seals = rustix::fs::fcntl_get_seals(file.as_fd());
    let Ok(seals) = seals else {
        // Not a memfd (sealing is only possible on memfds), or an O_PATH fd.
        return Outcome::Dropped(DropReason::Malformed);
    };
    if (seals.bits() as libc::c_int) & REQUIRED_SEALS != REQUIRED_SEALS {
        return Outcome::Nothing;
    }
    if meta.len() > MAX_DOCUMENT_BYTES {
        return Outcome::Dropped(DropReason::Oversized);
    }
    let mut buf = vec![0; meta.len() as usize];
    let mut at = 0;
    while at < buf.len() {
        match file.read_at(&mut buf[at..], at as u64) {
            Ok(0) => break,
            Ok(n) => at += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Outcome::Nothing,
        }
    }
    buf.truncate(at);
    match document::parse(&buf) {
        Ok(doc) => Outcome::Document(doc),
        Err(r) => Outcome::Dropped(r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake /proc root of `n` processes, each with `fds` fd links named
    /// like ordinary files, and a bridge memfd link at `bridge` in the last.
    fn fake_root(n: u32, fds: u32, bridge: Option<u32>) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for pid in 1..=n {
            let dir = root.path().join(pid.to_string());
            std::fs::create_dir_all(dir.join("fd")).unwrap();
            std::fs::write(dir.join("status"), format!("FDSize:\t{fds}\n")).unwrap();
            for fd in 0..fds {
                let target = if pid == n && Some(fd) == bridge {
                    LINK_TARGET.to_string()
                } else {
                    format!("/dev/null-{fd}")
                };
                std::os::unix::fs::symlink(target, dir.join("fd").join(fd.to_string())).unwrap();
            }
        }
        root
    }

    /// Forty processes with thousands of fds cost the budget per sample,
    /// no more, and cannot keep a later process (an old bridge) from being
    /// found within a few samples; a process found without one backs off.
    #[test]
    fn the_budget_is_shared_and_bounds_the_probes() {
        let root = fake_root(41, 200, Some(5));
        let mut scan = FdScan::new(ProcRoot::new(root.path())).without_grace();
        let mut found_at = None;
        for sample in 0..6 {
            let before = scan.probes();
            for pid in 1..=41 {
                // The fake root has no stat file: the start time is 7.
                let _ = scan.read(pid, 7);
            }
            scan.end_tick(&|_| true);
            let spent = scan.probes() - before;
            assert!(
                spent <= u64::from(PROBES_PER_SAMPLE),
                "sample {sample}: {spent} probes"
            );
            if found_at.is_none() && scan.tracked[&41].fd == Some(5) {
                found_at = Some(sample);
            }
        }
        assert!(
            matches!(found_at, Some(s) if s <= 2),
            "found at {found_at:?}"
        );
        // Fully scanned, found nothing: not due again before the backoff.
        let small_root = fake_root(1, 10, None);
        let mut small = FdScan::new(ProcRoot::new(small_root.path())).without_grace();
        let _ = small.read(1, 7);
        small.end_tick(&|_| true);
        let t = &small.tracked[&1];
        assert!(t.next_scan > Instant::now() + RESCAN_AFTER / 2);
        assert_eq!(t.backoff, RESCAN_AFTER * 2);
        assert_eq!(small.probes(), 10, "no probe past the fd table's size");
    }
}
