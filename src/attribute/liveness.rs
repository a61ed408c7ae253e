//! Whether a process NVML lists is still alive and still has an owner,
//! from what the kernel says (`/proc/<pid>/stat`: state, parent pid, start
//! time) and what the API says (a deleted pod, a finished Slurm job, a
//! removed container), never from what the process says about itself.
//!
//! Per pid on a GPU, at each full sample, [`Liveness`] keeps what it saw:
//! the start time and parent pid it was first seen with, the identity it
//! had then (so a pid that exited still says whose it was), how many full
//! samples it has been missing from /proc, and since when it has been in
//! `D`. The reasons ([`StaleReason`]) and their precedence: `exited` (seen
//! alive, then missing for [`EXITED_AFTER_SAMPLES`] full samples; a pid
//! never seen in /proc — another pid namespace — is never `exited`), then
//! `zombie` (`Z`), `uninterruptible` (`D` for `uninterruptible_after`),
//! `owner_deleted`, `reparented` (its parent pid changed: the kernel
//! changes a parent only when the parent dies).
//!
//! Bounded: an entry leaves with its pid from every GPU (`retain`), and at
//! most [`MAX_EXITED`] exited pids keep their identity (the oldest give it
//! up first; they stay `exited`, by pid alone).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use super::procfs::Stat;
use crate::model::{ProcIdentity, Stale, StaleReason};

/// Full samples a seen pid must be missing from /proc to be `exited`: one
/// missing sample raises nothing (a read can race the process's exit).
pub(crate) const EXITED_AFTER_SAMPLES: u32 = 2;

/// Exited pids that keep the identity they had.
pub(crate) const MAX_EXITED: usize = 4096;

/// What one pid was seen as.
#[derive(Debug)]
struct Track {
    start: u64,
    first_ppid: u32,
    ident: Arc<ProcIdentity>,
    /// Since when it has been a zombie.
    zombie_since: Option<SystemTime>,
    /// Since when it has been in `D` (this run of `D`).
    in_d_since: Option<(Instant, SystemTime)>,
    /// When its parent pid was first seen changed.
    reparented_at: Option<SystemTime>,
    /// Consecutive full samples without a /proc entry, and when the first
    /// of them was taken.
    missing: u32,
    gone_at: Option<SystemTime>,
    /// When an owner (pod, job) was first seen deleted.
    owner_deleted_at: Option<SystemTime>,
    /// Its Slurm job was listed by the job mapping at some point.
    job_was_listed: bool,
}

/// What the sources say of a process's owners in one sample.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Owner {
    /// Its pod's UID is a tombstone of the pod watcher.
    pub(crate) pod_deleted: bool,
    /// Whether the job mapping lists its Slurm job (`None`: no job, or no
    /// mapping).
    pub(crate) job_listed: Option<bool>,
}

/// The liveness of every pid on a GPU; owned by attribution (the sampler
/// thread).
#[derive(Debug)]
pub(crate) struct Liveness {
    pids: HashMap<u32, Track>,
    uninterruptible_after: Duration,
}

impl Liveness {
    pub(crate) fn new(uninterruptible_after: Duration) -> Self {
        Liveness {
            pids: HashMap::new(),
            uninterruptible_after,
        }
    }

    /// `pid` is in /proc with `stat`, identified as `ident`, in the full
    /// sample taken at `now` (`wall`). A new start time is a new process.
    pub(crate) fn alive(
        &mut self,
        pid: u32,
        stat: &Stat,
        ident: &Arc<ProcIdentity>,
        now: Instant,
        wall: SystemTime,
    ) {
        let t = match self.pids.get_mut(&pid) {
            Some(t) if t.start == stat.start => t,
            _ => {
                self.pids.insert(
                    pid,
                    Track {
                        start: stat.start,
                        first_ppid: stat.ppid,
                        ident: Arc::clone(ident),
                        zombie_since: None,
                        in_d_since: None,
                        reparented_at: None,
                        missing: 0,
                        gone_at: None,
                        owner_deleted_at: None,
                        job_was_listed: false,
                    },
                );
                match self.pids.get_mut(&pid) {
                    Some(t) => t,
                    None => return,
                }
            }
        };
        if !Arc::ptr_eq(&t.ident, ident) {
            t.ident = Arc::clone(ident);
        }
        t.missing = 0;
        t.gone_at = None;
        t.zombie_since = match stat.state {
            b'Z' => Some(t.zombie_since.unwrap_or(wall)),
            _ => None,
        };
        t.in_d_since = match (stat.state, t.in_d_since) {
            (b'D', Some(since)) => Some(since),
            (b'D', None) => Some((now, wall)),
            _ => None,
        };
        if stat.ppid != t.first_ppid && t.reparented_at.is_none() {
            t.reparented_at = Some(wall);
        }
    }

    /// `pid` has no /proc entry in the full sample taken at `wall`.
    /// Returns the identity it had when last seen alive, if it was.
    pub(crate) fn missing(&mut self, pid: u32, wall: SystemTime) -> Option<Arc<ProcIdentity>> {
        let t = self.pids.get_mut(&pid)?;
        t.missing = t.missing.saturating_add(1);
        t.gone_at.get_or_insert(wall);
        Some(Arc::clone(&t.ident))
    }

    /// The identity `pid` had when last seen, if it was seen.
    pub(crate) fn last_identity(&self, pid: u32) -> Option<Arc<ProcIdentity>> {
        self.pids.get(&pid).map(|t| Arc::clone(&t.ident))
    }

    /// What the sources say of `pid`'s owners, as of `wall`: its pod
    /// deleted, or its Slurm job gone from the job mapping after it was
    /// listed there.
    pub(crate) fn owner(&mut self, pid: u32, owner: Owner, wall: SystemTime) {
        if let Some(t) = self.pids.get_mut(&pid) {
            if owner.job_listed == Some(true) {
                t.job_was_listed = true;
            }
            let deleted =
                owner.pod_deleted || (t.job_was_listed && owner.job_listed == Some(false));
            t.owner_deleted_at = match (deleted, t.owner_deleted_at) {
                (true, at) => Some(at.unwrap_or(wall)),
                (false, _) => None,
            };
        }
    }

    /// Why `pid` is stale as of `now`, if it is.
    pub(crate) fn stale(&self, pid: u32, now: Instant) -> Option<Stale> {
        let t = self.pids.get(&pid)?;
        let stale = |reason, since| Some(Stale { reason, since });
        if t.missing >= EXITED_AFTER_SAMPLES {
            return stale(StaleReason::Exited, t.gone_at?);
        }
        if t.missing > 0 {
            return None;
        }
        if let Some(at) = t.zombie_since {
            return stale(StaleReason::Zombie, at);
        }
        if let Some((at, wall)) = t.in_d_since
            && now.saturating_duration_since(at) >= self.uninterruptible_after
        {
            return stale(StaleReason::Uninterruptible, wall);
        }
        if let Some(at) = t.owner_deleted_at {
            return stale(StaleReason::OwnerDeleted, at);
        }
        t.reparented_at
            .and_then(|at| stale(StaleReason::Reparented, at))
    }

    /// Keep the pids still on a GPU; past [`MAX_EXITED`] exited pids, the
    /// oldest give up their identity.
    pub(crate) fn retain(&mut self, live: &dyn Fn(u32) -> bool) {
        self.pids.retain(|pid, _| live(*pid));
        let mut exited: Vec<(SystemTime, u32)> = self
            .pids
            .iter()
            .filter(|(_, t)| t.missing > 0)
            .filter_map(|(pid, t)| Some((t.gone_at?, *pid)))
            .collect();
        if exited.len() <= MAX_EXITED {
            return;
        }
        exited.sort_unstable();
        let unknown = Arc::new(ProcIdentity::default());
        for (_, pid) in &exited[..exited.len() - MAX_EXITED] {
            if let Some(t) = self.pids.get_mut(pid) {
                t.ident = Arc::clone(&unknown);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(state: u8, ppid: u32, start: u64) -> Stat {
        Stat { state, ppid, start }
    }

    fn named(comm: &str) -> Arc<ProcIdentity> {
        Arc::new(ProcIdentity {
            comm: Arc::from(comm),
            ..ProcIdentity::default()
        })
    }

    fn reason(l: &Liveness, pid: u32, now: Instant) -> Option<StaleReason> {
        l.stale(pid, now).map(|s| s.reason)
    }

    #[test]
    fn exited_after_two_missing_samples_never_one_and_keeps_its_identity() {
        let mut l = Liveness::new(Duration::from_secs(30));
        let (t0, w0) = (Instant::now(), SystemTime::now());
        let me = named("trainer");
        l.alive(7, &stat(b'S', 1, 100), &me, t0, w0);
        assert_eq!(reason(&l, 7, t0), None);
        assert_eq!(
            l.missing(7, w0).map(|i| i.comm.clone()),
            Some(Arc::from("trainer"))
        );
        assert_eq!(reason(&l, 7, t0), None, "one missing sample raises nothing");
        l.missing(7, w0 + Duration::from_secs(1));
        let s = l.stale(7, t0);
        assert_eq!(s.map(|s| s.reason), Some(StaleReason::Exited));
        assert_eq!(
            s.map(|s| s.since),
            Some(w0),
            "since the first missing sample"
        );
        // Back (a read raced, or a new process with that pid): alive again.
        l.alive(7, &stat(b'S', 1, 100), &me, t0, w0);
        assert_eq!(reason(&l, 7, t0), None);
        // Never seen: never exited.
        assert_eq!(l.missing(8, w0), None);
        l.missing(8, w0);
        assert_eq!(reason(&l, 8, t0), None);
    }

    #[test]
    fn zombie_uninterruptible_after_its_time_and_reparented() {
        let mut l = Liveness::new(Duration::from_secs(30));
        let (t0, w0) = (Instant::now(), SystemTime::now());
        let p = named("p");
        l.alive(1, &stat(b'Z', 5, 1), &p, t0, w0);
        assert_eq!(reason(&l, 1, t0), Some(StaleReason::Zombie));
        // Since the first sample that saw it a zombie, not since now.
        let later = w0 + Duration::from_secs(5);
        l.alive(1, &stat(b'Z', 5, 1), &p, t0 + Duration::from_secs(5), later);
        assert_eq!(l.stale(1, t0).map(|s| s.since), Some(w0));
        l.alive(2, &stat(b'D', 5, 1), &p, t0, w0);
        assert_eq!(reason(&l, 2, t0 + Duration::from_secs(29)), None);
        l.alive(2, &stat(b'D', 5, 1), &p, t0 + Duration::from_secs(10), w0);
        assert_eq!(
            reason(&l, 2, t0 + Duration::from_secs(30)),
            Some(StaleReason::Uninterruptible)
        );
        // Out of D: the run of D starts over.
        l.alive(2, &stat(b'S', 5, 1), &p, t0 + Duration::from_secs(31), w0);
        l.alive(2, &stat(b'D', 5, 1), &p, t0 + Duration::from_secs(32), w0);
        assert_eq!(reason(&l, 2, t0 + Duration::from_secs(40)), None);
        l.alive(3, &stat(b'S', 5, 1), &p, t0, w0);
        l.alive(3, &stat(b'S', 1, 1), &p, t0, w0);
        assert_eq!(reason(&l, 3, t0), Some(StaleReason::Reparented));
        // A new process with the same pid starts over.
        l.alive(3, &stat(b'S', 1, 2), &p, t0, w0);
        assert_eq!(reason(&l, 3, t0), None);
    }

    #[test]
    fn a_deleted_owner_wins_over_reparenting_and_clears_when_back() {
        let mut l = Liveness::new(Duration::from_secs(30));
        let (t0, w0) = (Instant::now(), SystemTime::now());
        let p = named("p");
        l.alive(4, &stat(b'S', 9, 1), &p, t0, w0);
        l.alive(4, &stat(b'S', 1, 1), &p, t0, w0);
        let pod_gone = Owner {
            pod_deleted: true,
            job_listed: None,
        };
        l.owner(4, pod_gone, w0);
        assert_eq!(reason(&l, 4, t0), Some(StaleReason::OwnerDeleted));
        l.owner(4, Owner::default(), w0);
        assert_eq!(reason(&l, 4, t0), Some(StaleReason::Reparented));
        // A job is deleted only once the mapping had listed it.
        let job = |listed| Owner {
            pod_deleted: false,
            job_listed: Some(listed),
        };
        l.alive(5, &stat(b'S', 9, 1), &p, t0, w0);
        l.owner(5, job(false), w0);
        assert_eq!(reason(&l, 5, t0), None, "never listed: no mapping for it");
        l.owner(5, job(true), w0);
        l.owner(5, job(false), w0);
        assert_eq!(reason(&l, 5, t0), Some(StaleReason::OwnerDeleted));
    }

    #[test]
    fn entries_leave_with_their_pid() {
        let mut l = Liveness::new(Duration::from_secs(30));
        let (t0, w0) = (Instant::now(), SystemTime::now());
        l.alive(4, &stat(b'S', 9, 1), &named("p"), t0, w0);
        l.retain(&|pid| pid != 4);
        assert_eq!(l.last_identity(4), None);
    }
}
