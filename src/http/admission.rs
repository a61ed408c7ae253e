//! Admission: which connections may stay open. The accept loop takes
//! connections as fast as the kernel hands them over and asks [`Conns`]
//! about each; admission never waits, and at a cap (overall, or per client
//! address) the slowest connection makes room, so idle, slowloris or
//! slow-reading clients cannot starve a scraper. The connection driver
//! ([`super::connection`]) marks requests busy and closes when told to;
//! the auth middleware marks a request that only waits for a password check
//! as waiting (not busy: evictable at once) and a connection whose request
//! passed auth as authorized (evicted after every unauthorized one).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use super::web_config::Limits;
use crate::telemetry::Telemetry;

/// A connection that has not sent a whole request this long after it was
/// accepted is slow (a real client sends its headers within a round trip);
/// younger ones are ranked with the rest, so a scraper that has just
/// connected is never the first to go.
const HALF_OPEN_SLOW: Duration = Duration::from_secs(1);

/// The open connections, and what admission and eviction need to know of
/// each. Admission never waits: the accept loop takes connections as fast
/// as the kernel hands them over, so a scraper's connection is not queued
/// behind a flood.
///
/// - At `max_connections` (or at `max_connections_per_ip` for the new
///   connection's address), the new connection is admitted and the slowest
///   connection that is not being answered (of that address, for the
///   per-address cap) is told to close: first those that have not sent a
///   whole request within [`HALF_OPEN_SLOW`] of connecting (slowloris,
///   idle, a stalled TLS handshake), oldest first, then those that never
///   passed basic auth (a wrong-password flood, a request waiting for its
///   password check), then any other; within each group, of the address
///   holding the most connections, longest idle first (slow readers,
///   keep-alive). So the newest connection, a
///   scraper's that has just connected, is the last candidate of its
///   group, and a scraper that logged in is closed only after every
///   connection that did not. A scrape being answered is never closed; a
///   request waiting for its password check is not being answered. With no
///   candidate the new one is refused.
/// - Evicted connections take a moment to close, so admission keeps a
///   reserve above the cap ([`reserve`]) for the connections admitted
///   meanwhile; beyond cap + reserve a new connection is refused. Once half
///   the reserve is taken by connections still closing, an address that
///   holds half its per-address cap or more, none of them authorized and
///   some refused by basic auth (a wrong-password flood), is refused, so a
///   reconnecting flood cannot fill the reserve and lock out another
///   address's new connection.
pub(super) struct Conns {
    slots: Arc<Semaphore>,
    total_slots: usize,
    max: usize,
    per_ip: AtomicUsize,
    telemetry: Arc<Telemetry>,
    epoch: Instant,
    next_id: AtomicU64,
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    conns: HashMap<u64, Entry>,
    /// Connections per client address, not counting those already told to
    /// close.
    per_ip: HashMap<IpAddr, usize>,
    /// All connections, not counting those already told to close.
    live: usize,
}

struct Entry {
    ip: IpAddr,
    state: Arc<ConnState>,
}

struct ConnState {
    /// Requests being handled now, not counting those that only wait for
    /// their password check.
    busy: AtomicUsize,
    /// Requests waiting for their password check (or its refusal's pause):
    /// nothing is being written, so an evicted connection closes at once.
    waiting: AtomicUsize,
    /// A request of this connection passed basic auth.
    authorized: AtomicBool,
    /// A request of this connection was refused by basic auth (401, 429,
    /// 503).
    refused_login: AtomicBool,
    /// Requests received whole so far; 0: half-open (headers or the TLS
    /// handshake never finished).
    served: AtomicU64,
    /// Nanoseconds after [`Conns::epoch`] when the connection last became
    /// idle (accepted, or answered).
    idle_since: AtomicU64,
    closing: AtomicBool,
    close: Notify,
}

fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Connections admitted above the cap while the ones they evicted close:
/// 1/8 of the cap, at least 16.
pub(super) fn reserve(max_connections: usize) -> usize {
    (max_connections / 8).max(16)
}

/// The address a per-client limit counts: IPv4 as is (IPv4-mapped IPv6
/// too), IPv6 by its /64, which is what one host or one customer gets.
pub(super) fn client_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(
                u128::from(v6) & 0xffff_ffff_ffff_ffff_0000_0000_0000_0000,
            )),
        },
    }
}

impl Conns {
    pub(super) fn new(limits: Limits, telemetry: Arc<Telemetry>) -> Conns {
        let max = limits.max_connections;
        let total_slots = max + reserve(max);
        Conns {
            slots: Arc::new(Semaphore::new(total_slots)),
            total_slots,
            max,
            per_ip: AtomicUsize::new(limits.max_connections_per_ip.min(max)),
            telemetry,
            epoch: Instant::now(),
            next_id: AtomicU64::new(0),
            table: Mutex::new(Table::default()),
        }
    }

    /// A new per-address cap (SIGHUP); the global cap needs a restart.
    pub(super) fn set_per_ip(&self, per_ip: usize) {
        self.per_ip.store(per_ip.min(self.max), Ordering::Relaxed);
    }

    fn now(&self) -> u64 {
        duration_nanos(self.epoch.elapsed())
    }

    /// Admit a connection from `peer`, making room as described on
    /// [`Conns`]; `None`: refused (counted).
    pub(super) fn admit(self: &Arc<Self>, peer: IpAddr) -> Option<Registration> {
        let ip = client_key(peer);
        let refused = || {
            Telemetry::bump(&self.telemetry.http_connections_refused);
            None
        };
        let Ok(permit) = Arc::clone(&self.slots).try_acquire_owned() else {
            tracing::debug!(peer = %peer, "connection refused: cap and reserve full");
            return refused();
        };
        let Ok(mut table) = self.table.lock() else {
            return refused();
        };
        let from_ip = table.per_ip.get(&ip).copied().unwrap_or(0);
        let per_ip = self.per_ip.load(Ordering::Relaxed);
        // Connections told to close that have not yet (this one's slot not
        // counted): past half the reserve, an address that holds half its
        // cap and whose requests basic auth only refused is refused rather
        // than let churn more connections, so the rest of the reserve
        // stays for the other addresses.
        let closing =
            (self.total_slots - self.slots.available_permits()).saturating_sub(table.live + 1);
        if closing >= reserve(self.max) / 2
            && from_ip >= (per_ip / 2).max(1)
            && Table::only_refused_logins(&table, ip)
        {
            tracing::debug!(peer = %peer, "connection refused: a busy address while evicted connections close");
            return refused();
        }
        if from_ip >= per_ip {
            if !self.evict(&mut table, Some(ip)) {
                tracing::debug!(peer = %peer, "connection refused: per-address cap, all busy");
                return refused();
            }
        } else if table.live >= self.max && !self.evict(&mut table, None) {
            tracing::debug!(peer = %peer, "connection refused: cap reached, all busy");
            return refused();
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ConnState {
            busy: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            authorized: AtomicBool::new(false),
            refused_login: AtomicBool::new(false),
            served: AtomicU64::new(0),
            idle_since: AtomicU64::new(self.now()),
            closing: AtomicBool::new(false),
            close: Notify::new(),
        });
        table.conns.insert(
            id,
            Entry {
                ip,
                state: Arc::clone(&state),
            },
        );
        *table.per_ip.entry(ip).or_insert(0) += 1;
        table.live += 1;
        drop(table);
        Telemetry::bump(&self.telemetry.http_connections_open);
        Some(Registration {
            conns: Arc::clone(self),
            id,
            ip,
            state,
            _slot: permit,
        })
    }

    /// Close the slowest connection that is not being answered (of `ip`
    /// only, when given), as ranked on [`Conns`]. `false`: none to close.
    fn evict(&self, table: &mut Table, ip: Option<IpAddr>) -> bool {
        let slow_before = self.now().saturating_sub(duration_nanos(HALF_OPEN_SLOW));
        let victim = table
            .conns
            .values()
            .filter(|e| ip.is_none_or(|ip| e.ip == ip))
            .filter(|e| {
                e.state.busy.load(Ordering::Acquire) == 0
                    && !e.state.closing.load(Ordering::Acquire)
            })
            .min_by_key(|e| {
                let since = e.state.idle_since.load(Ordering::Relaxed);
                let slow_half_open =
                    e.state.served.load(Ordering::Relaxed) == 0 && since < slow_before;
                let authorized = e.state.authorized.load(Ordering::Relaxed);
                // Of the rest, the address holding the most goes first.
                let holds = table.per_ip.get(&e.ip).copied().unwrap_or(0);
                (!slow_half_open, authorized, std::cmp::Reverse(holds), since)
            })
            .map(|e| (e.ip, Arc::clone(&e.state)));
        let Some((victim_ip, state)) = victim else {
            return false;
        };
        state.closing.store(true, Ordering::Release);
        state.close.notify_one();
        Table::forget(table, victim_ip);
        Telemetry::bump(&self.telemetry.http_connections_evicted);
        true
    }

    /// Make room when the process is out of file descriptors.
    pub(super) fn evict_one(&self) -> bool {
        match self.table.lock() {
            Ok(mut table) => self.evict(&mut table, None),
            Err(_) => false,
        }
    }

    /// Open connections now.
    pub(super) fn open(&self) -> u64 {
        self.telemetry.http_connections_open.load(Ordering::Relaxed)
    }

    /// Resolves once every connection has closed (every slot is back).
    pub(super) async fn drained(&self) {
        let _ = self
            .slots
            .acquire_many(u32::try_from(self.total_slots).unwrap_or(u32::MAX))
            .await;
    }
}

impl Table {
    /// Whether `ip`'s open connections include one that basic auth refused
    /// and none that it let in.
    fn only_refused_logins(table: &Table, ip: IpAddr) -> bool {
        let mut refused = false;
        for e in table.conns.values().filter(|e| e.ip == ip) {
            if e.state.authorized.load(Ordering::Relaxed) {
                return false;
            }
            refused |= e.state.refused_login.load(Ordering::Relaxed);
        }
        refused
    }

    /// `ip`'s connection no longer counts against the caps.
    fn forget(table: &mut Table, ip: IpAddr) {
        table.live = table.live.saturating_sub(1);
        if let Some(n) = table.per_ip.get_mut(&ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                table.per_ip.remove(&ip);
            }
        }
    }
}

/// A connection's entry in [`Conns`] and its slot, both given back when the
/// connection ends.
pub(super) struct Registration {
    conns: Arc<Conns>,
    id: u64,
    /// The client's address as the caps count it ([`client_key`]).
    ip: IpAddr,
    state: Arc<ConnState>,
    _slot: OwnedSemaphorePermit,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Ok(mut table) = self.conns.table.lock()
            && let Some(e) = table.conns.remove(&self.id)
            && !e.state.closing.load(Ordering::Acquire)
        {
            Table::forget(&mut table, e.ip);
        }
        self.conns
            .telemetry
            .http_connections_open
            .fetch_sub(1, Ordering::Relaxed);
    }
}

impl Registration {
    /// Resolves once admission has told this connection to close (evicted
    /// to make room).
    pub(super) async fn evicted(&self) {
        self.state.close.notified().await;
    }

    /// Whether a request of this connection only waits for its password
    /// check: nothing is being written, so an evicted connection can close
    /// at once.
    pub(super) fn only_waiting(&self) -> bool {
        self.state.waiting.load(Ordering::Acquire) > 0
            && self.state.busy.load(Ordering::Acquire) == 0
    }

    /// What the connection's service marks each of its requests with.
    pub(super) fn requests(&self) -> Requests {
        Requests {
            state: Arc::clone(&self.state),
            conns: Arc::clone(&self.conns),
            ip: self.ip,
        }
    }
}

/// A connection's requests, as admission ranks them: one clone per
/// request handler, and in each request's extensions for the auth
/// middleware.
#[derive(Clone)]
pub(crate) struct Requests {
    state: Arc<ConnState>,
    conns: Arc<Conns>,
    ip: IpAddr,
}

impl Requests {
    /// One request received whole: the connection is busy (not to be
    /// evicted) until the returned guard is dropped.
    pub(super) fn start(&self) -> Busy {
        Busy::new(Arc::clone(&self.state), Arc::clone(&self.conns))
    }

    /// The client's address as the caps count it (IPv4, or an IPv6 /64).
    pub(crate) fn client(&self) -> IpAddr {
        self.ip
    }

    /// The request only waits (for its password check) until the guard is
    /// dropped: meanwhile the connection counts as idle, so admission may
    /// evict it.
    pub(crate) fn waiting(&self) -> Waiting {
        self.state.waiting.fetch_add(1, Ordering::AcqRel);
        self.state.busy.fetch_sub(1, Ordering::AcqRel);
        Waiting {
            state: Arc::clone(&self.state),
        }
    }

    /// A request of this connection passed basic auth: admission closes it
    /// only after every connection that did not.
    pub(crate) fn authorized(&self) {
        self.state.authorized.store(true, Ordering::Relaxed);
    }

    /// Basic auth refused a request of this connection (see
    /// [`Conns`]: such an address may not fill the reserve).
    pub(crate) fn refused_login(&self) {
        self.state.refused_login.store(true, Ordering::Relaxed);
    }
}

/// A request that waits (see [`Requests::waiting`]); busy again on drop.
pub(crate) struct Waiting {
    state: Arc<ConnState>,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.state.busy.fetch_add(1, Ordering::AcqRel);
        self.state.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Marks a connection busy while one request is handled (also when the
/// handler is dropped half-way).
pub(super) struct Busy {
    state: Arc<ConnState>,
    conns: Arc<Conns>,
}

impl Busy {
    fn new(state: Arc<ConnState>, conns: Arc<Conns>) -> Busy {
        state.busy.fetch_add(1, Ordering::AcqRel);
        state.served.fetch_add(1, Ordering::Relaxed);
        Busy { state, conns }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.state
            .idle_since
            .store(self.conns.now(), Ordering::Relaxed);
        self.state.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Connections with the epoch an hour back, so ages can be set.
    fn conns(max: usize, per_ip: usize) -> Arc<Conns> {
        let limits = Limits {
            max_connections: max,
            max_connections_per_ip: per_ip,
            ..Limits::default()
        };
        let mut c = Conns::new(limits, Arc::new(Telemetry::default()));
        c.epoch = Instant::now() - Duration::from_secs(3600);
        Arc::new(c)
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// `r` last became idle `secs` ago, having served `served` requests.
    fn age(c: &Conns, r: &Registration, secs: f64, served: u64) {
        let ago = duration_nanos(Duration::from_secs_f64(secs));
        r.state.idle_since.store(c.now() - ago, Ordering::Relaxed);
        r.state.served.store(served, Ordering::Relaxed);
    }

    fn evicted(r: &Registration) -> bool {
        r.state.closing.load(Ordering::Acquire)
    }

    #[test]
    fn the_per_address_cap_evicts_that_address_slowest_first() {
        let c = conns(100, 3);
        let a: Vec<Registration> = (0..3).map(|_| c.admit(ip("10.0.0.1")).unwrap()).collect();
        let b = c.admit(ip("10.0.0.2")).unwrap();
        age(&c, &b, 60.0, 0); // the oldest of all, but another address
        age(&c, &a[0], 2.0, 0); // half-open for 2 s: slow
        age(&c, &a[1], 5.0, 1); // keep-alive, idle 5 s
        age(&c, &a[2], 0.5, 0); // half-open, but just connected

        let a3 = c.admit(ip("10.0.0.1")).unwrap();
        let gone: Vec<bool> = a.iter().map(evicted).collect();
        assert_eq!(gone, [true, false, false], "slow half-open first");
        let a4 = c.admit(ip("10.0.0.1")).unwrap();
        let gone: Vec<bool> = a.iter().map(evicted).collect();
        assert_eq!(gone, [true, true, false], "then the longest idle");
        assert!(!evicted(&b) && !evicted(&a3) && !evicted(&a4));

        // Every one of the address's connections busy: refused.
        let busy: Vec<Busy> = [&a[2], &a3, &a4]
            .into_iter()
            .map(|r| r.requests().start())
            .collect();
        assert!(c.admit(ip("10.0.0.1")).is_none());
        // Another address is not affected.
        assert!(c.admit(ip("10.0.0.3")).is_some());
        let t = &c.telemetry;
        assert_eq!(t.http_connections_evicted.load(Ordering::Relaxed), 2);
        assert_eq!(t.http_connections_refused.load(Ordering::Relaxed), 1);
        drop(busy);
    }

    #[test]
    fn the_global_cap_spares_busy_and_newest_connections() {
        let c = conns(3, 3);
        let r: Vec<Registration> = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
            .iter()
            .map(|a| c.admit(ip(a)).unwrap())
            .collect();
        age(&c, &r[0], 30.0, 0);
        age(&c, &r[1], 0.3, 0);
        age(&c, &r[2], 0.1, 0);
        let busy = r[0].requests().start();
        let r3 = c.admit(ip("10.0.0.4")).unwrap();
        let gone: Vec<bool> = r.iter().map(evicted).collect();
        assert_eq!(gone, [false, true, false], "busy kept; oldest idle goes");
        assert!(!evicted(&r3));
        drop(busy);
        // Answered now, so it is the newest idle: the next to go is r[2].
        let _r4 = c.admit(ip("10.0.0.5")).unwrap();
        assert!(!evicted(&r[0]) && evicted(&r[2]));
    }

    /// Evicted connections still hold their slots until they close: the
    /// reserve takes the connections admitted meanwhile, then admission
    /// refuses until one closes.
    #[test]
    fn the_reserve_bounds_connections_admitted_while_evicted_ones_close() {
        let c = conns(16, 16);
        assert_eq!(reserve(16), 16);
        let held: Vec<Registration> = (0..32u8)
            .map(|i| c.admit(IpAddr::from([10, 0, 1, i])).unwrap())
            .collect();
        assert_eq!(held.iter().filter(|r| evicted(r)).count(), 16);
        assert!(c.admit(ip("10.0.2.1")).is_none(), "cap and reserve full");
        let closed = held.into_iter().find(evicted);
        drop(closed);
        assert!(c.admit(ip("10.0.2.1")).is_some());
        assert_eq!(reserve(2048), 256);
    }

    /// An address whose logins fail, churning at its cap, uses half the
    /// reserve at most; another address still gets in. Without failed
    /// logins (a slowloris, say) it may use it all.
    #[test]
    fn churn_at_the_per_address_cap_leaves_reserve_for_others() {
        let c = conns(16, 16);
        let mut held: Vec<Registration> =
            (0..16).map(|_| c.admit(ip("10.0.0.1")).unwrap()).collect();
        for r in &held {
            r.requests().refused_login();
        }
        let mut refused = 0;
        for _ in 0..40 {
            match c.admit(ip("10.0.0.1")) {
                Some(r) => held.push(r),
                None => refused += 1,
            }
        }
        let closing = held.iter().filter(|r| evicted(r)).count();
        assert_eq!(closing, reserve(16) / 2, "closing at most half the reserve");
        assert_eq!(refused, 40 - closing);
        assert!(c.admit(ip("10.0.0.2")).is_some(), "another address gets in");

        let c = conns(16, 16);
        let held: Vec<Registration> = (0..32).filter_map(|_| c.admit(ip("10.0.0.1"))).collect();
        assert_eq!(held.iter().filter(|r| evicted(r)).count(), reserve(16));
    }

    #[test]
    fn the_per_address_key() {
        for (peer, key) in [
            ("192.0.2.7", "192.0.2.7"),
            ("::ffff:192.0.2.7", "192.0.2.7"),
            ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::"),
            ("2001:db8:1:2:ffff::1", "2001:db8:1:2::"),
            ("::1", "::"),
        ] {
            assert_eq!(client_key(ip(peer)), ip(key), "{peer}");
        }
    }
}
