//! Basic auth: users and bcrypt hashes from the web config, and how a
//! password is checked so that a flood of wrong ones starves no one.
//!
//! - A check that passed is cached (sha256 of user and password, beside
//!   the user it names): a scraper's next requests are a lookup, answered
//!   at once, never queued. A reload (SIGHUP) keeps the entries of every
//!   user whose hash did not change (the same hash gives the same answer),
//!   so a reload sends no scraper back to bcrypt; the entries it drops (a
//!   changed hash, a removed user) are kept as *previously good*, and such
//!   an attempt is checked first ([`checks`]).
//! - Every other attempt is one bcrypt check in [`checks`]' bounded queue,
//!   paid for, when it fails, from the CPU budgets of [`budget`]: an
//!   attempt past them, or past the queue's bounds, is refused at once
//!   ([`Verdict::TooMany`], [`Verdict::Unavailable`]).
//! - An unknown user is checked against a dummy hash of the highest cost
//!   any user has, so an unknown name costs what the dearest known one
//!   does (users of lower cost can still be told from it by timing: the
//!   web config warns when costs differ).

pub(crate) mod budget;
pub(crate) mod checks;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use sha2::{Digest, Sha256};

use budget::Refusal;
use checks::{Checks, Outcome};

/// Successful (user, password) checks remembered, so a scrape does not pay
/// for bcrypt each time; as many previously-good ones after a reload.
const AUTH_CACHE_ENTRIES: usize = 1024;

/// What basic auth says about a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The password is right.
    Allowed,
    /// No credentials, or wrong ones (401).
    Denied,
    /// This client address has spent its budget of failed checks (429).
    TooMany { retry_after: Duration },
    /// The queue is full, or every address together has spent the budget
    /// (503).
    Unavailable { retry_after: Duration },
}

impl From<Refusal> for Verdict {
    fn from(r: Refusal) -> Verdict {
        match r {
            Refusal::Address { retry_after } => Verdict::TooMany { retry_after },
            Refusal::Overall { retry_after } => Verdict::Unavailable { retry_after },
        }
    }
}

/// Checks that passed, and those that passed before the last reload.
#[derive(Default)]
struct Cache {
    /// sha256(user, password) → the user, of checks that passed against
    /// this file's hashes.
    good: HashMap<[u8; 32], String>,
    /// Keys that passed against an earlier file's hash for their user,
    /// which has changed since.
    previously_good: HashSet<[u8; 32]>,
}

/// Whether credentials are known.
enum Known {
    Good,
    PreviouslyGood,
    No,
}

/// Users and their bcrypt hashes, with a cache of successful checks.
pub struct Users {
    pub(super) hashes: BTreeMap<String, String>,
    /// What an unknown user's password is checked against: a hash at the
    /// highest cost of `hashes` that no password matches.
    dummy: String,
    cache: Mutex<Cache>,
}

/// The bcrypt cost of `hash` (0 when it does not parse, which the web
/// config has already refused).
pub(super) fn cost(hash: &str) -> u32 {
    bcrypt::HashParts::from_str(hash).map_or(0, |p| p.get_cost())
}

/// A well-formed bcrypt hash at `cost` that no password matches (nothing
/// hashes to all zero bits), made without running bcrypt.
fn dummy_hash(cost: u32) -> String {
    // 22 characters of salt, 31 of hash, bcrypt's base64 ('.' is 0).
    format!("$2b${:02}${}", cost.clamp(4, 31), ".".repeat(53))
}

impl Users {
    pub(super) fn new(hashes: BTreeMap<String, String>) -> Users {
        let max_cost = hashes.values().map(|h| cost(h)).max().unwrap_or(4);
        Users {
            hashes,
            dummy: dummy_hash(max_cost),
            cache: Mutex::new(Cache::default()),
        }
    }

    /// After a reload: keep `old`'s successful checks of every user whose
    /// hash is unchanged; the others, and `old`'s previously-good keys of
    /// users still there, become previously good.
    pub(crate) fn inherit(&self, old: &Users) {
        let (Ok(old_cache), Ok(mut cache)) = (old.cache.lock(), self.cache.lock()) else {
            return;
        };
        for (key, user) in &old_cache.good {
            match (old.hashes.get(user), self.hashes.get(user)) {
                (Some(a), Some(b)) if a == b => {
                    cache.good.insert(*key, user.clone());
                }
                _ => {
                    cache.previously_good.insert(*key);
                }
            }
        }
        for key in &old_cache.previously_good {
            if cache.previously_good.len() >= AUTH_CACHE_ENTRIES {
                break;
            }
            cache.previously_good.insert(*key);
        }
    }

    fn known(&self, key: &[u8; 32]) -> Known {
        match self.cache.lock() {
            Ok(c) if c.good.contains_key(key) => Known::Good,
            Ok(c) if c.previously_good.contains(key) => Known::PreviouslyGood,
            _ => Known::No,
        }
    }

    fn remember(&self, key: [u8; 32], user: String) {
        if let Ok(mut c) = self.cache.lock() {
            if c.good.len() >= AUTH_CACHE_ENTRIES {
                c.good.clear();
            }
            c.previously_good.remove(&key);
            c.good.insert(key, user);
        }
    }

    fn forget_previous(&self, key: &[u8; 32]) {
        if let Ok(mut c) = self.cache.lock() {
            c.previously_good.remove(key);
        }
    }

    /// Whether an `Authorization` header value names a user and its
    /// password, `client` (an address as admission counts it) asking: from
    /// the cache at once, else one check in `checks`' queue.
    pub(crate) async fn authorize(
        self: &Arc<Self>,
        checks: &Checks,
        header: Option<&[u8]>,
        client: IpAddr,
    ) -> Verdict {
        let Some((user, password)) = header.and_then(parse_basic) else {
            return Verdict::Denied;
        };
        let key = cache_key(&user, &password);
        let previously_good = match self.known(&key) {
            Known::Good => return Verdict::Allowed,
            Known::PreviouslyGood => true,
            Known::No => false,
        };
        // The check records its own outcome, so a check whose caller left
        // (timed out, evicted) still caches a right password for the next
        // attempt; and a check whose key was cached meanwhile (the same
        // scraper trying again) runs no bcrypt.
        let users = Arc::clone(self);
        let check = move || {
            if matches!(users.known(&key), Known::Good) {
                return true;
            }
            let passed = users.verify(&user, &password);
            if passed {
                users.remember(key, user);
            } else {
                users.forget_previous(&key);
            }
            passed
        };
        match checks.check(client, previously_good, check).await {
            Outcome::Passed => Verdict::Allowed,
            Outcome::Failed => Verdict::Denied,
            Outcome::Refused(r) => r.into(),
        }
    }

    /// One blocking check of an `Authorization` header value, outside the
    /// queue and the cache (for a test of a shipped file).
    pub fn check_header(&self, header: &[u8]) -> bool {
        parse_basic(header).is_some_and(|(user, password)| self.verify(&user, &password))
    }

    /// The hash `user`'s password is checked against: its own, or the
    /// dummy of the highest cost.
    fn target(&self, user: &str) -> (&str, bool) {
        match self.hashes.get(user) {
            Some(hash) => (hash, true),
            None => (&self.dummy, false),
        }
    }

    /// One bcrypt check (slow on purpose: run it on a check thread).
    fn verify(&self, user: &str, password: &[u8]) -> bool {
        let (hash, known) = self.target(user);
        // An unknown user pays the same bcrypt run, then is refused.
        let matches = bcrypt::verify(password, hash).unwrap_or(false);
        matches && known
    }
}

fn cache_key(user: &str, password: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update((user.len() as u64).to_le_bytes());
    h.update(user.as_bytes());
    h.update(password);
    h.finalize().into()
}

/// `Basic base64(user:password)` → (user, password).
fn parse_basic(value: &[u8]) -> Option<(String, Vec<u8>)> {
    let value = std::str::from_utf8(value).ok()?.trim();
    let (scheme, creds) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(creds.trim())
        .ok()?;
    let colon = decoded.iter().position(|b| *b == b':')?;
    let user = String::from_utf8(decoded[..colon].to_vec()).ok()?;
    Some((user, decoded[colon + 1..].to_vec()))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A bcrypt hash at the lowest cost, with a fixed salt (fast, stable).
    pub(in crate::http) fn hash(password: &str) -> String {
        bcrypt::hash_with_salt(password, 4, [7; 16])
            .map(|h| h.to_string())
            .unwrap_or_default()
    }

    #[test]
    fn basic_header_parsing() {
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let cases: [(String, Option<(&str, &str)>); 6] = [
            (format!("Basic {}", b64("alice:pw")), Some(("alice", "pw"))),
            (
                format!("basic {}", b64("alice:p:w")),
                Some(("alice", "p:w")),
            ),
            (format!("Basic {}", b64("alice:")), Some(("alice", ""))),
            (format!("Basic {}", b64("alice")), None),
            (format!("Bearer {}", b64("alice:pw")), None),
            ("Basic !!!".to_string(), None),
        ];
        for (header, want) in cases {
            let got = parse_basic(header.as_bytes());
            let got = got
                .as_ref()
                .map(|(u, p)| (u.as_str(), std::str::from_utf8(p).unwrap_or("?")));
            assert_eq!(got, want, "{header}");
        }
    }

    fn b64(s: &str) -> String {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(s)
        )
    }

    fn client(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    fn users(list: &[(&str, String)]) -> Arc<Users> {
        Arc::new(Users::new(
            list.iter()
                .map(|(u, h)| (u.to_string(), h.clone()))
                .collect(),
        ))
    }

    #[tokio::test]
    async fn right_password_passes_and_is_cached() {
        let checks = Checks::start().unwrap();
        let users = users(&[("alice", hash("pw"))]);
        let good = b64("alice:pw");
        let ask = |h: Option<String>, c| {
            let users = Arc::clone(&users);
            let checks = &checks;
            async move {
                users
                    .authorize(checks, h.as_deref().map(str::as_bytes), c)
                    .await
            }
        };
        assert_eq!(ask(Some(good.clone()), client(1)).await, Verdict::Allowed);
        assert_eq!(users.cache.lock().unwrap().good.len(), 1);
        assert_eq!(ask(Some(good.clone()), client(1)).await, Verdict::Allowed);
        for (n, bad) in ["alice:nope", "bob:pw", "alice:pw2"]
            .into_iter()
            .enumerate()
        {
            let v = ask(Some(b64(bad)), client(10 + n as u8)).await;
            assert_eq!(v, Verdict::Denied, "{bad}");
        }
        assert_eq!(ask(None, client(1)).await, Verdict::Denied);
        assert_eq!(
            users.cache.lock().unwrap().good.len(),
            1,
            "failures are not cached"
        );
        // An address that keeps failing is refused once past its burst (or
        // the total's);
        // the cached scraper on the same address is not.
        let mut typos = 0;
        let v = loop {
            match ask(Some(b64(&format!("alice:nope{typos}"))), client(10)).await {
                Verdict::Denied if typos < 10_000 => typos += 1,
                v => break v,
            }
        };
        assert!(
            matches!(v, Verdict::TooMany { .. } | Verdict::Unavailable { .. }),
            "{v:?} after {typos}"
        );
        assert_eq!(ask(Some(good), client(10)).await, Verdict::Allowed);
    }

    /// One wrong password, then the right one from the same address: the
    /// right one is checked at once and passes (a typo costs a token of
    /// the address's budget, not the address).
    #[tokio::test]
    async fn a_typo_then_the_right_password_passes() {
        let checks = Checks::start().unwrap();
        let users = users(&[("alice", hash("pw"))]);
        let (typo, right) = (b64("alice:pq"), b64("alice:pw"));
        let typo = users
            .authorize(&checks, Some(typo.as_bytes()), client(1))
            .await;
        assert_eq!(typo, Verdict::Denied);
        let right = users
            .authorize(&checks, Some(right.as_bytes()), client(1))
            .await;
        assert_eq!(right, Verdict::Allowed);
    }

    /// A reload keeps the logins of users whose hash did not change; a
    /// changed hash makes its logins previously good, not good.
    #[test]
    fn a_reload_keeps_what_still_holds() {
        let old = users(&[("alice", hash("a")), ("bob", hash("b"))]);
        old.remember(cache_key("alice", b"a"), "alice".into());
        old.remember(cache_key("bob", b"b"), "bob".into());
        let rehashed = bcrypt::hash_with_salt("b", 4, [9; 16]).unwrap().to_string();
        let new = users(&[("alice", hash("a")), ("bob", rehashed)]);
        new.inherit(&old);
        assert!(matches!(new.known(&cache_key("alice", b"a")), Known::Good));
        assert!(matches!(
            new.known(&cache_key("bob", b"b")),
            Known::PreviouslyGood
        ));
        let gone = users(&[("carol", hash("c"))]);
        gone.inherit(&new);
        assert!(matches!(
            gone.known(&cache_key("alice", b"a")),
            Known::PreviouslyGood
        ));
    }

    /// An unknown user is checked against a hash of the highest cost, so
    /// it takes the dearest user's bcrypt work (measured as thread CPU
    /// time), not the first user's.
    #[test]
    fn an_unknown_user_costs_what_the_dearest_user_does() {
        let cheap = bcrypt::hash_with_salt("pw", 4, [1; 16])
            .unwrap()
            .to_string();
        let dear = bcrypt::hash_with_salt("pw", 8, [2; 16])
            .unwrap()
            .to_string();
        // "alice" sorts first: the old dummy check used her cost.
        let u = users(&[("alice", cheap), ("zed", dear)]);
        assert_eq!(cost(u.target("nobody").0), 8);
        assert_eq!(cost(u.target("zed").0), 8);
        assert_eq!(cost(u.target("alice").0), 4);
        let cpu = |user: &str| {
            let before = super::checks::tests::cpu();
            assert!(!u.verify(user, b"wrong"));
            super::checks::tests::cpu() - before
        };
        let (unknown, dear, cheap) = (cpu("nobody"), cpu("zed"), cpu("alice"));
        eprintln!("bcrypt work: unknown {unknown:?}, cost 8 {dear:?}, cost 4 {cheap:?}");
        let ratio = unknown.as_secs_f64() / dear.as_secs_f64();
        assert!((0.6..1.6).contains(&ratio), "unknown/dear = {ratio:.2}");
        assert!(unknown > cheap * 4, "{unknown:?} vs {cheap:?}");
        // The dummy matches no password.
        assert!(!bcrypt::verify("", &u.dummy).unwrap_or(true));
    }
}
