//! The table the sampler reads: container id → what the engine said, with
//! the queue of misses for the lookup thread. The sampler never waits on
//! the engine: the mutex guards a hash map and is never held across I/O.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use tokio::sync::mpsc;

use super::{MAX_ENTRIES, QUEUE_LEN};
use crate::model::{ContainerInfo, ContainerLookups};

/// What is known of one container id.
#[derive(Debug, Clone)]
enum Entry {
    /// Queued for, or being asked by, the lookup thread.
    Pending,
    Found(Arc<ContainerInfo>),
    /// 404, or a failed lookup: not asked again before this instant.
    Retry(Instant),
}

/// What a lookup came back with, as the lookup thread reports it.
#[derive(Debug, Clone)]
pub enum Outcome {
    Found(ContainerInfo),
    /// 404; retry at the instant given.
    NotFound(Instant),
    /// No answer; retry at the instant given.
    Error(Instant),
}

/// Shared between the sampler (`get`, `retain`) and the lookup thread
/// (`complete`).
#[derive(Debug)]
pub struct ContainerCache {
    entries: Mutex<HashMap<Arc<str>, Entry>>,
    queue: mpsc::Sender<Arc<str>>,
    max_entries: usize,
    found: AtomicU64,
    not_found: AtomicU64,
    error: AtomicU64,
}

impl ContainerCache {
    /// A cache and the receiving end of its queue, for
    /// [`super::lookup::spawn`].
    pub fn new() -> (Arc<ContainerCache>, mpsc::Receiver<Arc<str>>) {
        Self::with_limits(MAX_ENTRIES, QUEUE_LEN)
    }

    /// As [`ContainerCache::new`] with other bounds (tests).
    pub fn with_limits(
        max_entries: usize,
        queue_len: usize,
    ) -> (Arc<ContainerCache>, mpsc::Receiver<Arc<str>>) {
        let (tx, rx) = mpsc::channel(queue_len.max(1));
        let cache = ContainerCache {
            entries: Mutex::new(HashMap::new()),
            queue: tx,
            max_entries,
            found: AtomicU64::new(0),
            not_found: AtomicU64::new(0),
            error: AtomicU64::new(0),
        };
        (Arc::new(cache), rx)
    }

    /// The container `id`, when the engine has described it. A miss (new
    /// id, or a 404 or failure whose retry time has come) queues `id` for
    /// the lookup thread and answers `None`; never blocks on the engine.
    pub fn get(&self, id: &str) -> Option<Arc<ContainerInfo>> {
        self.get_at(id, Instant::now())
    }

    fn get_at(&self, id: &str, now: Instant) -> Option<Arc<ContainerInfo>> {
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        match entries.get(id) {
            Some(Entry::Found(info)) => return Some(Arc::clone(info)),
            Some(Entry::Pending) => return None,
            Some(Entry::Retry(at)) if now < *at => return None,
            Some(Entry::Retry(_)) => {}
            None if entries.len() >= self.max_entries => return None,
            None => {}
        }
        let id: Arc<str> = Arc::from(id);
        // A full queue (or a stopped lookup thread) leaves the id unknown,
        // so the next tick asks again.
        if self.queue.try_send(Arc::clone(&id)).is_ok() {
            entries.insert(id, Entry::Pending);
        }
        None
    }

    /// The lookup thread's answer for `id`. An id dropped by `retain`
    /// meanwhile stays dropped.
    pub fn complete(&self, id: &str, outcome: Outcome) {
        let counter = match &outcome {
            Outcome::Found(_) => &self.found,
            Outcome::NotFound(_) => &self.not_found,
            Outcome::Error(_) => &self.error,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(e) = entries.get_mut(id) {
            *e = match outcome {
                Outcome::Found(info) => Entry::Found(Arc::new(info)),
                Outcome::NotFound(at) | Outcome::Error(at) => Entry::Retry(at),
            };
        }
    }

    /// Keep only the ids `live` says some process on a GPU is in.
    pub fn retain(&self, live: &dyn Fn(&str) -> bool) {
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        entries.retain(|id, _| live(id));
    }

    /// Ids held now.
    pub fn len(&self) -> usize {
        self.entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Whether no id is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Lookups so far, by outcome.
    pub fn lookups(&self) -> ContainerLookups {
        ContainerLookups {
            found: self.found.load(Ordering::Relaxed),
            not_found: self.not_found.load(Ordering::Relaxed),
            error: self.error.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn info(name: &str) -> ContainerInfo {
        ContainerInfo {
            name: Arc::from(name),
            ..ContainerInfo::default()
        }
    }

    /// A miss is queued once; the answer is served from memory after.
    #[test]
    fn a_miss_is_queued_once_and_then_served() {
        let (cache, mut rx) = ContainerCache::with_limits(8, 8);
        assert!(cache.get("aa").is_none());
        assert!(cache.get("aa").is_none());
        assert_eq!(rx.try_recv().as_deref().ok(), Some("aa"));
        assert!(rx.try_recv().is_err(), "queued twice");
        cache.complete("aa", Outcome::Found(info("trainer-a")));
        assert_eq!(&*cache.get("aa").unwrap().name, "trainer-a");
        assert!(rx.try_recv().is_err(), "a hit asked again");
        assert_eq!(cache.lookups().found, 1);
    }

    /// A 404 or an error is not asked again before its retry time, and is
    /// after it.
    #[test]
    fn negative_and_failed_entries_are_retried_after_their_time() {
        let (cache, mut rx) = ContainerCache::with_limits(8, 8);
        let now = Instant::now();
        for (id, outcome) in [
            ("nf", Outcome::NotFound(now + Duration::from_secs(60))),
            ("er", Outcome::Error(now + Duration::from_secs(1))),
        ] {
            assert!(cache.get_at(id, now).is_none());
            assert!(rx.try_recv().is_ok());
            cache.complete(id, outcome);
            assert!(cache.get_at(id, now + Duration::from_millis(500)).is_none());
            assert!(rx.try_recv().is_err(), "{id} retried too early");
        }
        assert!(cache.get_at("er", now + Duration::from_secs(2)).is_none());
        assert_eq!(rx.try_recv().as_deref().ok(), Some("er"));
        assert!(cache.get_at("nf", now + Duration::from_secs(2)).is_none());
        assert!(rx.try_recv().is_err(), "a 404 retried after 2 s");
        assert!(cache.get_at("nf", now + Duration::from_secs(61)).is_none());
        assert_eq!(rx.try_recv().as_deref().ok(), Some("nf"));
        let l = cache.lookups();
        assert_eq!((l.found, l.not_found, l.error), (0, 1, 1));
    }

    /// The size bound holds; `retain` frees room; a full queue leaves the
    /// id unknown, to be asked again.
    #[test]
    fn bounded_by_entries_and_queue() {
        let (cache, mut rx) = ContainerCache::with_limits(2, 1);
        assert!(cache.get("a").is_none());
        // Queue full: "b" is not held, so it is asked again later.
        assert!(cache.get("b").is_none());
        assert_eq!(cache.len(), 1);
        assert!(rx.try_recv().is_ok());
        assert!(cache.get("b").is_none());
        assert!(rx.try_recv().is_ok());
        assert_eq!(cache.len(), 2);
        // Full: a third id is not queued.
        assert!(cache.get("c").is_none());
        assert!(rx.try_recv().is_err());
        cache.retain(&|id| id == "b");
        assert!(cache.get("c").is_none());
        assert_eq!(rx.try_recv().as_deref().ok(), Some("c"));
        // An answer for an id dropped meanwhile is counted, not kept.
        cache.complete("a", Outcome::Found(info("gone")));
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.lookups().found, 1);
    }
}
