//! What failed logins may cost: CPU time of bcrypt checks that failed,
//! paid for per client address and in total, so a flood of wrong passwords
//! neither takes the exporter's CPU quota nor locks out other clients.
//!
//! Each account is a GCRA ("virtual scheduling") meter: a failed check
//! that took `c` of CPU moves the account's `paid_until` on by `c / rate`
//! (from now, if it lay in the past). A client address may start a check
//! only while its account is paid up; every address together only while
//! the total account is at most [`TOTAL_TOLERANCE`] ahead. Checks that
//! succeed cost nothing. Hand-written: the crates we know of (governor)
//! count requests, not a cost measured after the fact.
//!
//! At the rates below, failed checks use at most 0.5 % of a core per
//! address and 2 % of one in total (plus a burst of 0.5 s of CPU in all,
//! and the one check each account may run over its limit): under the
//! DaemonSet's 100m CPU limit, one address's flood takes at most 5 % of
//! the exporter's quota over time, and every address's together 20 %.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// CPU of failed checks per second of wall time, one client address.
pub(super) const PER_ADDRESS_RATE: f64 = 0.005;
/// CPU of failed checks per second of wall time, all addresses together.
pub(super) const TOTAL_RATE: f64 = 0.02;
/// How far ahead of now the total account may be and still start a check:
/// 25 s at [`TOTAL_RATE`] is 0.5 s of CPU, room for several addresses'
/// first mistakes at once, and more than one check of the dearest
/// realistic cost (bcrypt cost 12: ~0.25 s) puts it ahead, so one address
/// that keeps within its own share never locks the others out.
pub(super) const TOTAL_TOLERANCE: Duration = Duration::from_secs(25);
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
}

/// The accounts of every address that failed lately, and the total one.
#[derive(Debug)]
pub(super) struct Budgets {
    total_paid_until: Instant,
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
            addresses: HashMap::new(),
        }
    }

    /// Whether `client` may start a check now.
    pub(super) fn admits(&self, client: IpAddr, now: Instant) -> Result<(), Refusal> {
        if let Some(a) = self.addresses.get(&client)
            && a.paid_until > now
        {
            return Err(Refusal::Address {
                retry_after: retry(a.paid_until - now),
            });
        }
        let ahead = self.total_paid_until.saturating_duration_since(now);
        if ahead > TOTAL_TOLERANCE {
            return Err(Refusal::Overall {
                retry_after: retry(ahead - TOTAL_TOLERANCE),
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
        if !self.addresses.contains_key(&client) && self.addresses.len() >= MAX_ADDRESSES {
            self.make_room(now);
        }
        let a = self.addresses.entry(client).or_insert(Account {
            paid_until: now,
            last_failure: now,
        });
        a.paid_until = a.paid_until.max(now) + pay_off(cpu, PER_ADDRESS_RATE);
        a.last_failure = now;
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

    #[test]
    fn a_failure_is_paid_off_at_the_address_rate() {
        let t0 = Instant::now();
        let mut b = Budgets::new(t0);
        let a = ip("10.0.0.1");
        assert_eq!(b.admits(a, t0), Ok(()));
        assert!(b.is_clean(a, t0));
        // 50 ms of CPU at 0.5 % of a core: 10 s.
        b.charge(a, Duration::from_millis(50), t0);
        assert!(!b.is_clean(a, t0));
        assert_eq!(
            b.admits(a, t0 + Duration::from_secs(3)),
            Err(Refusal::Address {
                retry_after: Duration::from_secs(7)
            })
        );
        assert_eq!(b.admits(a, t0 + Duration::from_secs(10)), Ok(()));
        // Another address is not held up by this one's debt.
        assert_eq!(b.admits(ip("10.0.0.2"), t0), Ok(()));
        // Clean again only after REMEMBER.
        assert!(!b.is_clean(a, t0 + Duration::from_secs(10)));
        assert!(b.is_clean(a, t0 + REMEMBER));
    }

    #[test]
    fn the_total_bounds_every_address_together() {
        let t0 = Instant::now();
        let mut b = Budgets::new(t0);
        // 400 ms at 2 %: 20 s ahead, still within the tolerance.
        b.charge(ip("10.0.0.1"), Duration::from_millis(400), t0);
        assert_eq!(b.admits(ip("10.0.0.2"), t0), Ok(()));
        // 200 ms more: 30 s ahead, 5 s over.
        b.charge(ip("10.0.0.2"), Duration::from_millis(200), t0);
        assert_eq!(
            b.admits(ip("10.0.0.3"), t0),
            Err(Refusal::Overall {
                retry_after: Duration::from_secs(5)
            })
        );
        assert_eq!(
            b.admits(ip("10.0.0.3"), t0 + Duration::from_secs(5)),
            Ok(())
        );
        // Over CPU time: a long flood of addresses spends at most the rate
        // (plus the tolerance and one check).
        let mut now = t0;
        let mut spent = Duration::ZERO;
        let mut n = 0u32;
        while now < t0 + Duration::from_secs(100) {
            n += 1;
            let client = IpAddr::from([10, 1, (n >> 8) as u8, n as u8]);
            if b.admits(client, now).is_ok() {
                b.charge(client, Duration::from_millis(60), now);
                spent += Duration::from_millis(60);
            }
            now += Duration::from_millis(10);
        }
        // 2 % of 100 s, the 0.5 s burst, the 600 ms charged above, and
        // one check over.
        assert!(
            spent <= Duration::from_millis(2000 + 500 + 600 + 60),
            "{spent:?} in 100 s"
        );
        // And no less than what the rate allows after the debt above.
        assert!(spent >= Duration::from_millis(1800), "{spent:?}");
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
