//! Basic auth: users and bcrypt hashes from the web config, checked at
//! most two at a time (bcrypt is slow on purpose), successful checks cached.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};

use base64::Engine;
use sha2::{Digest, Sha256};

/// Successful (user, password) checks remembered, so a scrape does not pay
/// for bcrypt each time.
const AUTH_CACHE_ENTRIES: usize = 1024;
/// bcrypt runs at most this many at once (each takes ~50–250 ms of CPU at
/// cost 10), so a flood of wrong passwords cannot take every core.
static BCRYPT_SLOTS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// Users and their bcrypt hashes, with a cache of successful checks.
pub struct Users {
    pub(super) hashes: BTreeMap<String, String>,
    /// sha256(user, password) of checks that succeeded against this file.
    ok: Mutex<HashSet<[u8; 32]>>,
}

impl Users {
    pub(super) fn new(hashes: BTreeMap<String, String>) -> Users {
        Users {
            hashes,
            ok: Mutex::new(HashSet::new()),
        }
    }

    /// Whether an `Authorization` header value names a user and its
    /// password. Unknown users cost a bcrypt run too, so timing does not
    /// tell which user names exist.
    pub async fn authorize(self: &Arc<Self>, header: Option<&[u8]>) -> bool {
        let Some((user, password)) = header.and_then(parse_basic) else {
            return false;
        };
        let key = cache_key(&user, &password);
        if self.ok.lock().map(|s| s.contains(&key)).unwrap_or(false) {
            return true;
        }
        let Ok(_slot) = BCRYPT_SLOTS.acquire().await else {
            return false;
        };
        let users = Arc::clone(self);
        let checked = tokio::task::spawn_blocking(move || users.verify(&user, &password)).await;
        let ok = checked.unwrap_or(false);
        if ok && let Ok(mut set) = self.ok.lock() {
            if set.len() >= AUTH_CACHE_ENTRIES {
                set.clear();
            }
            set.insert(key);
        }
        ok
    }

    fn verify(&self, user: &str, password: &[u8]) -> bool {
        match self.hashes.get(user) {
            Some(hash) => bcrypt::verify(password, hash).unwrap_or(false),
            None => {
                // Same work as for a known user, then refuse.
                if let Some(any) = self.hashes.values().next() {
                    let _ = bcrypt::verify(password, any);
                }
                false
            }
        }
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

    #[tokio::test]
    async fn right_password_passes_and_is_cached() {
        let users = Arc::new(Users::new(BTreeMap::from([(
            "alice".to_string(),
            hash("pw"),
        )])));
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let good = format!("Basic {}", b64("alice:pw"));
        assert!(users.authorize(Some(good.as_bytes())).await);
        assert_eq!(users.ok.lock().unwrap().len(), 1);
        assert!(users.authorize(Some(good.as_bytes())).await);
        for bad in ["alice:nope", "bob:pw", "alice:pw2"] {
            let h = format!("Basic {}", b64(bad));
            assert!(!users.authorize(Some(h.as_bytes())).await, "{bad}");
        }
        assert!(!users.authorize(None).await);
        assert_eq!(users.ok.lock().unwrap().len(), 1, "failures are not cached");
    }
}
