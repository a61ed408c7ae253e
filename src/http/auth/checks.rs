//! Where bcrypt checks wait and run: a bounded queue in three lanes and two
//! threads of their own, so a flood of wrong passwords neither delays a
//! scraper's login nor holds more than a bounded amount of anything.
//!
//! - **Lanes.** *Previously good*: a (user, password) that passed before the
//!   last reload, against a hash that has changed since (the scraper's
//!   credentials, most likely): first, outside the budgets. *Clean*: from a
//!   client address with no failed check within [`budget::REMEMBER`],
//!   the address that asked least first: an address that keeps asking
//!   while its check waits (a flood's many connections) goes behind one
//!   that asked once (a scraper), so after a restart, when every address
//!   is clean, a scraper's first login waits for at most the check that
//!   is running, not for every flooding address's first one. An address
//!   whose check failed meanwhile moves its waiting check to the dirty
//!   lane. *Dirty*: from an address that failed lately, first in first
//!   out with at most [`PER_ADDRESS`] waiting per address, so one
//!   address's flood is at most that many checks ahead of another's
//!   attempt.
//! - **Threads.** One thread at normal priority runs only the first two
//!   lanes, and of the clean one only the checks of addresses that asked
//!   at most [`PER_ADDRESS`] times; the other, at `SCHED_IDLE`, runs all
//!   three (the first two first). Inside a CPU limit (the DaemonSet's
//!   100m) a check of the flood's that is running takes almost no CPU
//!   from a scraper's that starts meanwhile, and none from the sampler;
//!   and the checks of addresses that failed run one at a time, so they
//!   can overshoot the total budget by one check at most (see
//!   [`budget`]).
//! - **Bounds.** At most [`QUEUED`] checks wait ([`PREVIOUSLY_GOOD`] in the
//!   first lane); beyond it, or past an address's or the total CPU budget
//!   ([`budget`]), an attempt is refused at once, and the caller answers
//!   429 or 503 with `Retry-After`. A waiting caller gives up after
//!   [`WAIT_MAX`]; a check whose caller left (evicted, gone) is skipped.
//!
//! The thread priority and thread CPU time are two `libc` calls (no crate
//! we use wraps them); a failure of either is harmless (normal priority;
//! wall time charged instead of CPU time).

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::budget::{Budgets, Refusal};

/// Checks waiting at most, all lanes together.
pub(super) const QUEUED: usize = 64;
/// Checks waiting at most in the previously-good lane.
pub(super) const PREVIOUSLY_GOOD: usize = 16;
/// Checks waiting or running at most per client address (clean and dirty
/// lanes): before the first of them has failed (and been charged), no more
/// can start, so one address cannot put the total budget out of reach of
/// the others.
pub(super) const PER_ADDRESS: usize = 2;
/// The longest a caller waits for its check's answer.
pub(super) const WAIT_MAX: Duration = Duration::from_secs(10);

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Passed,
    Failed,
    Refused(Refusal),
}

/// Which lane a check waits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    PreviouslyGood,
    Clean,
    Dirty,
}

struct Job {
    client: IpAddr,
    /// Order of arrival (the clean lane is not first in first out).
    seq: u64,
    lane: Lane,
    run: Box<dyn FnOnce() -> bool + Send>,
    reply: oneshot::Sender<Outcome>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Worker {
    /// Normal priority: previously-good and clean lanes only, and of the
    /// clean lane only addresses that asked at most [`PER_ADDRESS`] times.
    Scrapers,
    /// `SCHED_IDLE`: every lane.
    Everyone,
}

struct State {
    previously_good: VecDeque<Job>,
    clean: VecDeque<Job>,
    dirty: VecDeque<Job>,
    /// Checks waiting or running per client address (clean and dirty
    /// lanes), and how often it asked meanwhile.
    per_address: HashMap<IpAddr, Pending>,
    budgets: Budgets,
    /// The next job's [`Job::seq`].
    seq: u64,
    stopping: bool,
}

/// One address's checks waiting or running.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Pending {
    /// Checks waiting or running.
    waiting: usize,
    /// Attempts that needed a check (admitted or refused) since the
    /// address had none waiting or running.
    asked: u32,
}

struct Shared {
    state: Mutex<State>,
    work: Condvar,
}

/// The queue and its two threads; one per server, kept across reloads (so
/// a SIGHUP gives a flood no fresh budget).
pub(crate) struct Checks {
    shared: Arc<Shared>,
}

impl Checks {
    /// The queue, and its threads started.
    pub(crate) fn start() -> std::io::Result<Checks> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                previously_good: VecDeque::new(),
                clean: VecDeque::new(),
                dirty: VecDeque::new(),
                per_address: HashMap::new(),
                budgets: Budgets::new(Instant::now()),
                seq: 0,
                stopping: false,
            }),
            work: Condvar::new(),
        });
        for (name, worker) in [
            ("auth-check", Worker::Scrapers),
            ("auth-check-idle", Worker::Everyone),
        ] {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(name.to_string())
                .spawn(move || work(&shared, worker))?;
        }
        Ok(Checks { shared })
    }

    /// Run `check` (true: the password is right) for `client`, in its lane;
    /// `previously_good`: the credentials passed before the last reload.
    pub(crate) async fn check(
        &self,
        client: IpAddr,
        previously_good: bool,
        check: impl FnOnce() -> bool + Send + 'static,
    ) -> Outcome {
        let (reply, answer) = oneshot::channel();
        {
            let Ok(mut st) = self.shared.state.lock() else {
                return Outcome::Refused(Refusal::Overall {
                    retry_after: Duration::from_secs(1),
                });
            };
            if let Err(refused) = st.enqueue(client, previously_good, Box::new(check), reply) {
                return Outcome::Refused(refused);
            }
        }
        self.shared.work.notify_all();
        match tokio::time::timeout(WAIT_MAX, answer).await {
            Ok(Ok(outcome)) => outcome,
            // Timed out (the job is skipped once its turn comes), or the
            // threads are gone.
            _ => Outcome::Refused(Refusal::Overall {
                retry_after: Duration::from_secs(1),
            }),
        }
    }
}

impl Drop for Checks {
    fn drop(&mut self) {
        if let Ok(mut st) = self.shared.state.lock() {
            st.stopping = true;
        }
        self.shared.work.notify_all();
    }
}

/// Refused because the queue (or its lane) is full.
const FULL: Refusal = Refusal::Overall {
    retry_after: Duration::from_secs(1),
};

impl State {
    fn queued(&self) -> usize {
        self.previously_good.len() + self.clean.len() + self.dirty.len()
    }

    fn enqueue(
        &mut self,
        client: IpAddr,
        previously_good: bool,
        run: Box<dyn FnOnce() -> bool + Send>,
        reply: oneshot::Sender<Outcome>,
    ) -> Result<(), Refusal> {
        let now = Instant::now();
        if self.queued() >= QUEUED {
            return Err(FULL);
        }
        let lane = if previously_good {
            if self.previously_good.len() >= PREVIOUSLY_GOOD {
                return Err(FULL);
            }
            Lane::PreviouslyGood
        } else {
            if let Some(p) = self.per_address.get_mut(&client) {
                p.asked = p.asked.saturating_add(1);
            }
            self.budgets.admits(client, now)?;
            let pending = self.per_address.entry(client).or_default();
            if pending.waiting >= PER_ADDRESS {
                return Err(Refusal::Address {
                    retry_after: Duration::from_secs(1),
                });
            }
            pending.waiting += 1;
            pending.asked = pending.asked.max(1);
            if self.budgets.is_clean(client, now) {
                Lane::Clean
            } else {
                Lane::Dirty
            }
        };
        self.seq += 1;
        let job = Job {
            client,
            seq: self.seq,
            lane,
            run,
            reply,
        };
        match lane {
            Lane::PreviouslyGood => self.previously_good.push_back(job),
            Lane::Clean => self.clean.push_back(job),
            Lane::Dirty => self.dirty.push_back(job),
        }
        Ok(())
    }

    /// How often `client` asked while its checks wait.
    fn asked(&self, client: IpAddr) -> u32 {
        self.per_address.get(&client).map_or(0, |p| p.asked)
    }

    /// The clean check `worker` is to run next: of the addresses that
    /// asked least, the one that came first; for [`Worker::Scrapers`],
    /// only of addresses that asked at most [`PER_ADDRESS`] times.
    fn take_clean(&mut self, worker: Worker) -> Option<Job> {
        let (at, _) = self
            .clean
            .iter()
            .enumerate()
            .map(|(i, j)| (i, (self.asked(j.client), j.seq)))
            .filter(|(_, (asked, _))| worker == Worker::Everyone || *asked as usize <= PER_ADDRESS)
            .min_by_key(|(_, key)| *key)?;
        self.clean.remove(at)
    }

    /// The next check `worker` is to run: its lanes in order, skipping
    /// checks whose caller left, moving clean checks whose address failed
    /// meanwhile to the dirty lane, and refusing those whose address (or
    /// the total) ran out of budget while they waited.
    fn next(&mut self, worker: Worker) -> Option<Job> {
        loop {
            let job = match self.previously_good.pop_front() {
                Some(job) => job,
                None => match self.take_clean(worker) {
                    Some(job) if !self.budgets.is_clean(job.client, Instant::now()) => {
                        let at = self.dirty.partition_point(|d| d.seq < job.seq);
                        self.dirty.insert(
                            at,
                            Job {
                                lane: Lane::Dirty,
                                ..job
                            },
                        );
                        continue;
                    }
                    Some(job) => job,
                    None => match worker {
                        Worker::Everyone => self.dirty.pop_front()?,
                        Worker::Scrapers => return None,
                    },
                },
            };
            if job.lane != Lane::PreviouslyGood {
                if job.reply.is_closed() {
                    self.done(job.lane, job.client);
                    continue;
                }
                if let Err(refused) = self.budgets.admits(job.client, Instant::now()) {
                    self.done(job.lane, job.client);
                    let _ = job.reply.send(Outcome::Refused(refused));
                    continue;
                }
            } else if job.reply.is_closed() {
                continue;
            }
            return Some(job);
        }
    }

    /// `job` no longer waits or runs.
    fn done(&mut self, lane: Lane, client: IpAddr) {
        if lane == Lane::PreviouslyGood {
            return;
        }
        if let Some(p) = self.per_address.get_mut(&client) {
            p.waiting = p.waiting.saturating_sub(1);
            if p.waiting == 0 {
                self.per_address.remove(&client);
            }
        }
    }
}

/// One check thread: take the next check, run it, charge a failure's CPU
/// time, answer.
fn work(shared: &Shared, worker: Worker) {
    if worker == Worker::Everyone {
        lower_priority();
    }
    loop {
        let job = {
            let Ok(mut st) = shared.state.lock() else {
                return;
            };
            loop {
                if st.stopping {
                    return;
                }
                if let Some(job) = st.next(worker) {
                    break job;
                }
                st = match wait(shared, st) {
                    Some(st) => st,
                    None => return,
                };
            }
        };
        let Job {
            client,
            lane,
            run,
            reply,
            ..
        } = job;
        let (wall, cpu) = (Instant::now(), thread_cpu());
        let passed = run();
        let spent = match (cpu, thread_cpu()) {
            (Some(before), Some(after)) => after.saturating_sub(before),
            _ => wall.elapsed(),
        };
        if let Ok(mut st) = shared.state.lock() {
            if !passed {
                st.budgets.charge(client, spent, Instant::now());
            }
            st.done(lane, client);
        }
        let _ = reply.send(if passed {
            Outcome::Passed
        } else {
            Outcome::Failed
        });
    }
}

fn wait<'a>(shared: &'a Shared, st: MutexGuard<'a, State>) -> Option<MutexGuard<'a, State>> {
    shared.work.wait(st).ok()
}

/// This thread's CPU time so far.
fn thread_cpu() -> Option<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the call only writes it.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return None;
    }
    Some(Duration::new(
        u64::try_from(ts.tv_sec).ok()?,
        u32::try_from(ts.tv_nsec).ok()?,
    ))
}

/// Run this thread at `SCHED_IDLE`: it gets CPU only when no other thread
/// of the exporter (or of its cgroup) wants it.
fn lower_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param
    // (priority 0, as SCHED_IDLE requires) that the call only reads.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    if rc != 0 {
        tracing::debug!(
            error = %std::io::Error::last_os_error(),
            "auth checks of flooding addresses run at normal priority"
        );
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// This thread's CPU time, for the tests of [`super::super`].
    pub(in crate::http::auth) fn cpu() -> Duration {
        thread_cpu().unwrap_or_default()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn job(
        st: &mut State,
        client: &str,
        previously_good: bool,
    ) -> Result<oneshot::Receiver<Outcome>, Refusal> {
        let (tx, rx) = oneshot::channel();
        st.enqueue(ip(client), previously_good, Box::new(|| true), tx)?;
        Ok(rx)
    }

    fn state() -> State {
        State {
            previously_good: VecDeque::new(),
            clean: VecDeque::new(),
            dirty: VecDeque::new(),
            per_address: HashMap::new(),
            budgets: Budgets::new(Instant::now()),
            seq: 0,
            stopping: false,
        }
    }

    #[test]
    fn lanes_order_and_which_thread_takes_what() {
        let mut st = state();
        let now = Instant::now();
        st.budgets.charge(ip("10.0.0.9"), Duration::ZERO, now);
        // A dirty address (failed lately, but paid up) waits behind.
        let _d = job(&mut st, "10.0.0.9", false).unwrap();
        let _c = job(&mut st, "10.0.0.1", false).unwrap();
        let _p = job(&mut st, "10.0.0.9", true).unwrap();
        let order: Vec<Lane> = std::iter::from_fn(|| st.next(Worker::Scrapers))
            .map(|j| j.lane)
            .collect();
        assert_eq!(order, [Lane::PreviouslyGood, Lane::Clean]);
        assert!(st.next(Worker::Scrapers).is_none());
        let dirty = st.next(Worker::Everyone);
        assert_eq!(dirty.as_ref().map(|j| j.lane), Some(Lane::Dirty));
        // Taken, but still running: it counts until done.
        assert_eq!(
            st.per_address.get(&ip("10.0.0.9")).map(|p| p.waiting),
            Some(1)
        );
        st.done(Lane::Dirty, ip("10.0.0.9"));
        assert_eq!(st.per_address.get(&ip("10.0.0.9")), None);
    }

    /// After a restart every address is clean: eight flooding addresses
    /// each have two checks waiting and keep asking; a scraper that asks
    /// once, last, is the next check either thread runs.
    #[test]
    fn a_scraper_waits_behind_no_flooding_address() {
        let mut st = state();
        let mut held = Vec::new();
        for n in 2..10 {
            let flood = format!("127.0.0.{n}");
            for _ in 0..10 {
                if let Ok(rx) = job(&mut st, &flood, false) {
                    held.push(rx);
                }
            }
            assert_eq!(st.asked(ip(&flood)), 10);
        }
        assert_eq!(held.len(), 16);
        held.push(job(&mut st, "127.0.0.1", false).unwrap());
        for worker in [Worker::Scrapers, Worker::Everyone] {
            let next = st.next(worker).map(|j| (j.client, j.lane));
            assert_eq!(next, Some((ip("127.0.0.1"), Lane::Clean)), "{worker:?}");
            st.done(Lane::Clean, ip("127.0.0.1"));
            held.push(job(&mut st, "127.0.0.1", false).unwrap());
        }
        // The normal-priority thread leaves the flood's checks to the idle
        // one; and once an address has failed, its waiting check is dirty.
        let _ = st.next(Worker::Scrapers);
        st.done(Lane::Clean, ip("127.0.0.1"));
        assert!(st.next(Worker::Scrapers).is_none());
        st.budgets
            .charge(ip("127.0.0.2"), Duration::from_millis(1), Instant::now());
        let first = st.next(Worker::Everyone).map(|j| (j.client, j.lane));
        assert_eq!(first, Some((ip("127.0.0.3"), Lane::Clean)));
        assert_eq!(st.dirty.len(), 2);
    }

    #[test]
    fn bounds_refuse_at_once() {
        let mut st = state();
        let _a = job(&mut st, "10.0.0.1", false).unwrap();
        let _b = job(&mut st, "10.0.0.1", false).unwrap();
        assert!(matches!(
            job(&mut st, "10.0.0.1", false),
            Err(Refusal::Address { .. })
        ));
        // Another address still gets in; then the whole queue fills.
        let mut held = Vec::new();
        for n in 0..(QUEUED - 2) {
            held.push(job(&mut st, &format!("10.0.1.{n}"), false).unwrap());
        }
        assert_eq!(job(&mut st, "10.0.2.1", false).err(), Some(FULL));
        assert_eq!(job(&mut st, "10.0.2.1", true).err(), Some(FULL));
    }

    #[test]
    fn a_check_whose_caller_left_is_skipped_and_budgets_are_checked_again() {
        let mut st = state();
        let gone = job(&mut st, "10.0.0.1", false).unwrap();
        drop(gone);
        let stays = job(&mut st, "10.0.0.2", false).unwrap();
        // 10.0.0.2 fails meanwhile (others of its checks): over budget.
        for _ in 0..2 {
            st.budgets
                .charge(ip("10.0.0.2"), Duration::from_millis(300), Instant::now());
        }
        assert!(st.next(Worker::Everyone).is_none());
        let mut stays = stays;
        assert!(matches!(
            stays.try_recv(),
            Ok(Outcome::Refused(Refusal::Address { .. }))
        ));
        assert!(st.per_address.is_empty());
    }

    #[tokio::test]
    async fn the_threads_run_checks_and_charge_failures() {
        let checks = Checks::start().unwrap();
        let c = ip("10.0.0.1");
        assert_eq!(checks.check(c, false, || true).await, Outcome::Passed);
        let spin = || {
            let t = Instant::now();
            while t.elapsed() < Duration::from_millis(20) {}
            false
        };
        assert_eq!(checks.check(c, false, spin).await, Outcome::Failed);
        // A typo costs a token: the next attempt is checked.
        assert_eq!(checks.check(c, false, || true).await, Outcome::Passed);
        // Past the burst (0.5 s of CPU), 20 ms at 0.5 %: about 4 s before
        // this address may try again.
        let mut failures = 1;
        let refused = loop {
            match checks.check(c, false, spin).await {
                Outcome::Failed if failures < 200 => failures += 1,
                other => break other,
            }
        };
        match refused {
            Outcome::Refused(Refusal::Address { retry_after }) => {
                assert!(retry_after >= Duration::from_secs(1), "{retry_after:?}");
            }
            other => panic!("{other:?} after {failures} failures"),
        }
        assert!(failures >= 20, "{failures}");
        // Previously-good credentials are not held up by it.
        assert_eq!(checks.check(c, true, || true).await, Outcome::Passed);
        assert_eq!(
            checks.check(ip("10.0.0.2"), false, || true).await,
            Outcome::Passed
        );
    }
}
