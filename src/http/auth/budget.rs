//! What failed logins may cost: CPU time of bcrypt checks that failed,
//! paid for per client address and in total, so a flood of wrong passwords
//! neither takes the exporter's CPU quota nor locks out other clients.
//!
//! Each account is a GCRA ("virtual scheduling") meter: a failed check
//! that took `c` of CPU moves the account's `paid_until` on by `c / rate`
//! (from now, if it lay in the past). Checks that succeed cost nothing.
//! Hand-written: the crates we know of (governor) count requests, not a
//! cost measured after the fact.
//!
//! - **Per address, with a burst.** An address may start a check while its
//!   unpaid CPU is at most [`PER_ADDRESS_BURST`], or at most its dearest
//!   single failure when that is more: a typo costs a token, never the
//!   address, so the right password that follows it is checked at once.
//! - **In total, by who asks.** Every failure is charged to the total too.
//!   An address with failures of its own (within [`REMEMBER`]) may start a
//!   check only while the total is at most [`TOTAL_TOLERANCE`] ahead; a
//!   *clean* address (none of its own) while it is at most that plus
//!   [`NEWCOMERS`] of the dearest check seen. The dirty addresses are
//!   refused long before they reach the clean threshold (the queue runs at
//!   most one of their checks at a time, see [`super::checks`]), so a
//!   flood from addresses that failed never refuses an address that did
//!   not: after a restart (budgets and login cache empty) a clean
//!   scraper's first login is admitted, whatever the flood did. Only
//!   fresh addresses, each failing for the first time, can spend the
//!   clean headroom, [`NEWCOMERS`] checks' worth at once and then the
//!   total rate.
//!
//! At the rates below, failed checks use at most 0.5 % of a core per
//! address and 2 % of one in total, over time: under the DaemonSet's 100m
//! CPU limit, one address's flood takes at most 5 % of the exporter's
//! quota, and every address's together 20 %; plus, once, the bursts (0.5 s
//! of CPU in all for addresses that failed, and [`NEWCOMERS`] checks for
//! fresh addresses) and the one check each account may run over its
//! limit.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// CPU of failed checks per second of wall time, one client address.
pub(super) const PER_ADDRESS_RATE: f64 = 0.005;
/// Unpaid CPU of failed checks an address may have and still start a
/// check: 0.5 s, seven typos at bcrypt cost 10 in a release build, one
/// at cost 12 (and always one, whatever the cost: see [`Budgets::admits`]).
pub(super) const PER_ADDRESS_BURST: Duration = Duration::from_millis(500);
/// CPU of failed checks per second of wall time, all addresses together.
pub(super) const TOTAL_RATE: f64 = 0.02;
/// How far ahead of now the total account may be and still start a check
/// of an address that failed lately: 25 s at [`TOTAL_RATE`] is 0.5 s of
/// CPU, room for several addresses' mistakes at once, and more than one
/// check of the dearest realistic cost (bcrypt cost 12: ~0.25 s in a
/// release build; where the dearest check seen is dearer, one of it).
pub(super) const TOTAL_TOLERANCE: Duration = Duration::from_secs(25);
/// How many first failures of fresh addresses the total account may be
/// ahead by, beyond [`TOTAL_TOLERANCE`], and still start a clean
/// address's check: every address of a flood fails once while clean (with
/// at most [`super::checks::PER_ADDRESS`] checks at a time), so 32 is 16
/// addresses' worth.
pub(super) const NEWCOMERS: u32 = 32;
/// An address whose last failed check is older than this is clean again:
/// its next attempt is checked beside the scrapers' (see
/// [`super::checks`]), not behind the floods.
pub(super) const REMEMBER: Duration = Duration::from_secs(300);
/// Addresses remembered at most; beyond it the one whose last failure is
/// oldest is forgotten (the total account still bounds them all).
pub(super) const MAX_ADDRESSES: usize = 4096;
/// The longest `Retry-After` given.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(600);

/// Why a check may not start now, and when to try again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// This client address has spent its share (429).
    Address { retry_after: Duration },
    /// Every address together has, or the queue is full (503).
    Overall { retry_after: Duration },
}

#[derive(Debug, Clone, Copy)]
struct Account {
    paid_until: Instant,
    last_failure: Instant,
    /// The CPU of this address's dearest failed check.
    dearest: Duration,
}

/// The accounts of every address that failed lately, and the total one.
#[derive(Debug)]
pub(super) struct Budgets {
    total_paid_until: Instant,
    /// The CPU of the dearest failed check so far (what a newcomer's first
    /// failure is reckoned at).
    dearest: Duration,
    addresses: HashMap<IpAddr, Account>,
}

/// `after`, between 1 s and [`MAX_RETRY_AFTER`].
fn retry(after: Duration) -> Duration {
    after.clamp(Duration::from_secs(1), MAX_RETRY_AFTER)
}

/// `cpu / rate`: how long CPU time `cpu` takes to pay off.
fn pay_off(cpu: Duration, rate: f64) -> Duration {
    Duration::try_from_secs_f64(cpu.as_secs_f64() / rate).unwrap_or(MAX_RETRY_AFTER)
}

impl Budgets {
    pub(super) fn new(now: Instant) -> Budgets {
        Budgets {
            total_paid_until: now,
            dearest: Duration::ZERO,
            addresses: HashMap::new(),
        }
    }

    /// Whether `client` may start a check now: its own account within its
    /// burst, and the total within the threshold of an address like it
    /// (with failures of its own, or clean).
    pub(super) fn admits(&self, client: IpAddr, now: Instant) -> Result<(), Refusal> {
        let clean = self.is_clean(client, now);
        if let Some(a) = self.addresses.get(&client) {
            let burst = pay_off(PER_ADDRESS_BURST.max(a.dearest), PER_ADDRESS_RATE);
            let ahead = a.paid_until.saturating_duration_since(now);
            if ahead > burst {
                return Err(Refusal::Address {
                    retry_after: retry(ahead - burst),
                });
            }
        }
        // At least one check of the dearest cost, so that one typo of a
        // user of cost 12 or more is not refused by the total either.
        let dirty = TOTAL_TOLERANCE.max(pay_off(self.dearest, TOTAL_RATE));
        let tolerance = if clean {
            dirty + pay_off(self.dearest * NEWCOMERS, TOTAL_RATE)
        } else {
            dirty
        };
        let ahead = self.total_paid_until.saturating_duration_since(now);
        if ahead > tolerance {
            return Err(Refusal::Overall {
                retry_after: retry(ahead - tolerance),
            });
        }
        Ok(())
    }

    /// Whether no check of `client`'s failed within [`REMEMBER`].
    pub(super) fn is_clean(&self, client: IpAddr, now: Instant) -> bool {
        self.addresses
            .get(&client)
            .is_none_or(|a| now.saturating_duration_since(a.last_failure) >= REMEMBER)
    }

    /// A check of `client`'s failed after taking `cpu`.
    pub(super) fn charge(&mut self, client: IpAddr, cpu: Duration, now: Instant) {
        self.total_paid_until = self.total_paid_until.max(now) + pay_off(cpu, TOTAL_RATE);
        self.dearest = self.dearest.max(cpu);
        if !self.addresses.contains_key(&client) && self.addresses.len() >= MAX_ADDRESSES {
            self.make_room(now);
        }
        let a = self.addresses.entry(client).or_insert(Account {
            paid_until: now,
            last_failure: now,
            dearest: Duration::ZERO,
        });
        a.paid_until = a.paid_until.max(now) + pay_off(cpu, PER_ADDRESS_RATE);
        a.last_failure = now;
        a.dearest = a.dearest.max(cpu);
    }

    /// Forget every paid-up clean address, or else the one whose last
    /// failure is oldest.
    fn make_room(&mut self, now: Instant) {
        self.addresses.retain(|_, a| {
            a.paid_until > now || now.saturating_duration_since(a.last_failure) < REMEMBER
        });
        if self.addresses.len() < MAX_ADDRESSES {
            return;
        }
        if let Some(oldest) = self
            .addresses
            .iter()
            .min_by_key(|(_, a)| a.last_failure)
            .map(|(ip, _)| *ip)
        {
            self.addresses.remove(&oldest);
        }
    }

    #[cfg(test)]
    pub(super) fn remembered(&self) -> usize {
        self.addresses.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    const SEC: Duration = Duration::from_secs(1);

    /// A typo costs a token: the next attempt is admitted at once, at any
    /// bcrypt cost; failures past the burst are refused and paid off at
    /// the address rate.
    #[test]
    fn one_typo_costs_a_token_not_the_address() {
        let t0 = Instant::now();
        for check in [
            Duration::from_millis(65),   // cost 10, release
            Duration::from_millis(160),  // cost 10, debug
            Duration::from_millis(1000), // cost 12, debug: over the burst alone
        ] {
            let mut b = Budgets::new(t0);
            let a = ip("10.0.0.1");
            assert!(b.is_clean(a, t0));
            b.charge(a, check, t0);
            assert!(!b.is_clean(a, t0));
            assert_eq!(b.admits(a, t0), Ok(()), "one {check:?} typo");
            // Typos until refused: as many as the burst holds, and more
            // than one.
            let mut failures = 1;
            while b.admits(a, t0).is_ok() {
                b.charge(a, check, t0);
                failures += 1;
            }
            let burst = PER_ADDRESS_BURST.max(check);
            let want = (burst.as_secs_f64() / check.as_secs_f64()).floor() as u32 + 1;
            assert_eq!(failures, want, "{check:?}");
            // Refused until the excess is paid off at 0.5 % of a core.
            let Err(Refusal::Address { retry_after }) = b.admits(a, t0) else {
                panic!("{check:?}: {:?}", b.admits(a, t0));
            };
            let excess = check * failures - burst;
            let want = pay_off(excess, PER_ADDRESS_RATE);
            assert!(
                retry_after.abs_diff(retry(want)) <= SEC,
                "{retry_after:?} vs {want:?}"
            );
            assert_eq!(b.admits(a, t0 + want), Ok(()));
            // Another address is not held up by this one's debt.
            assert_eq!(b.admits(ip("10.0.0.2"), t0), Ok(()));
            // Clean again only after REMEMBER.
            assert!(!b.is_clean(a, t0 + want.min(REMEMBER - SEC)));
            assert!(b.is_clean(a, t0 + REMEMBER));
        }
    }

    /// Eight addresses that failed keep failing as fast as their budgets
    /// and the queue let them (one of their checks at a time): an address
    /// that never failed is admitted throughout, while the flood spends at
    /// most the total rate.
    #[test]
    fn addresses_that_failed_never_refuse_a_clean_one() {
        let t0 = Instant::now();
        let mut b = Budgets::new(t0);
        let check = Duration::from_millis(160);
        let flood: Vec<IpAddr> = (2..10).map(|n| IpAddr::from([127, 0, 0, n])).collect();
        let clean = ip("127.0.0.1");
        let mut now = t0;
        let mut spent = Duration::ZERO;
        let mut refused_dirty = 0;
        // Restart: every flooding address is clean for its first check.
        while now < t0 + Duration::from_secs(200) {
            for a in &flood {
                if b.admits(*a, now).is_ok() {
                    b.charge(*a, check, now);
                    spent += check;
                    // One check at a time: it takes its CPU.
                    now += check;
                } else {
                    refused_dirty += 1;
                }
            }
            assert_eq!(b.admits(clean, now), Ok(()), "at {:?}", now - t0);
            now += Duration::from_millis(50);
        }
        assert!(refused_dirty > 0);
        let secs = (now - t0).as_secs_f64();
        // The rate, the total tolerance, the newcomers' first failures and
        // one check over.
        let bound = TOTAL_RATE * secs
            + (TOTAL_TOLERANCE.as_secs_f64() * TOTAL_RATE)
            + 8.0 * check.as_secs_f64()
            + check.as_secs_f64();
        assert!(
            spent.as_secs_f64() <= bound,
            "{spent:?} in {secs} s > {bound}"
        );
        assert!(spent.as_secs_f64() >= TOTAL_RATE * secs * 0.8, "{spent:?}");
    }

    /// Fresh addresses, each failing once, are what can spend the clean
    /// headroom (then a clean address is refused), and no more than the
    /// total rate with it.
    #[test]
    fn fresh_addresses_spend_the_newcomers_headroom_then_the_rate() {
        let t0 = Instant::now();
        let mut b = Budgets::new(t0);
        let check = Duration::from_millis(60);
        let mut now = t0;
        let mut spent = Duration::ZERO;
        let mut n = 0u32;
        let mut clean_refused = false;
        while now < t0 + Duration::from_secs(100) {
            n += 1;
            let client = IpAddr::from([10, 1, (n >> 8) as u8, n as u8]);
            match b.admits(client, now) {
                Ok(()) => {
                    b.charge(client, check, now);
                    spent += check;
                }
                Err(Refusal::Overall { .. }) => clean_refused = true,
                Err(r) => panic!("{r:?}"),
            }
            now += Duration::from_millis(10);
        }
        assert!(clean_refused);
        let bound = Duration::from_millis(2000 + 500 + 60) + check * NEWCOMERS;
        assert!(spent <= bound, "{spent:?} in 100 s > {bound:?}");
        assert!(spent >= Duration::from_millis(2000), "{spent:?}");
    }

    #[test]
    fn the_table_is_bounded() {
        let t0 = Instant::now();
        let mut b = Budgets::new(t0);
        for n in 0..(MAX_ADDRESSES as u32 + 10) {
            let client = IpAddr::from(n.to_be_bytes());
            b.charge(client, Duration::from_micros(1), t0);
        }
        assert_eq!(b.remembered(), MAX_ADDRESSES);
    }
}
