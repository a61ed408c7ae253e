//! The body cache: each snapshot is encoded at most once per format and
//! gzipped at most once, however many scrapers ask. The sampler publishes
//! the snapshot itself; the encoded bodies live here, on the HTTP side,
//! keyed by the snapshot they were made from.

use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwapOption;
use bytes::Bytes;

use crate::expose::{self, Format};
use crate::model::Snapshot;

/// The bodies of one snapshot, made lazily.
#[derive(Debug)]
struct Bodies {
    snapshot: Arc<Snapshot>,
    slots: [OnceLock<Option<Bytes>>; 4],
}

impl Bodies {
    fn new(snapshot: Arc<Snapshot>) -> Self {
        Bodies {
            snapshot,
            slots: Default::default(),
        }
    }

    fn body(&self, format: Format, gzip: bool) -> Option<Bytes> {
        let slot = match (format, gzip) {
            (Format::Text, false) => 0,
            (Format::Text, true) => 1,
            (Format::OpenMetrics, false) => 2,
            (Format::OpenMetrics, true) => 3,
        };
        self.slots[slot]
            .get_or_init(|| {
                if gzip {
                    let plain = self.body(format, false)?;
                    let mut z = flate2::write::GzEncoder::new(
                        Vec::with_capacity(plain.len() / 4),
                        flate2::Compression::fast(),
                    );
                    std::io::Write::write_all(&mut z, &plain).ok()?;
                    z.finish().ok().map(Bytes::from)
                } else {
                    match expose::encode(&self.snapshot, format) {
                        Ok(s) => Some(Bytes::from(s)),
                        Err(_) => {
                            tracing::error!("encoding the snapshot failed");
                            None
                        }
                    }
                }
            })
            .clone()
    }
}

/// The bodies of the latest snapshot asked for. A scrape of another
/// snapshot replaces the entry; its bodies are made on first use.
#[derive(Debug, Default)]
pub struct BodyCache {
    current: ArcSwapOption<Bodies>,
}

impl BodyCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// The encoded body of `snapshot`; `None` only if encoding failed (a
    /// bug, logged).
    pub fn body(&self, snapshot: &Arc<Snapshot>, format: Format, gzip: bool) -> Option<Bytes> {
        self.entry(snapshot).body(format, gzip)
    }

    fn entry(&self, snapshot: &Arc<Snapshot>) -> Arc<Bodies> {
        let of = |b: &Option<Arc<Bodies>>| {
            b.as_ref()
                .filter(|b| Arc::ptr_eq(&b.snapshot, snapshot))
                .cloned()
        };
        if let Some(b) = of(&self.current.load_full()) {
            return b;
        }
        // Scrapers racing on a new snapshot all end up with the entry
        // stored first, so it is encoded once.
        let fresh = Arc::new(Bodies::new(Arc::clone(snapshot)));
        let prev = self
            .current
            .rcu(|cur| of(cur).or_else(|| Some(Arc::clone(&fresh))));
        of(&prev).unwrap_or(fresh)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot() -> Arc<Snapshot> {
        Arc::new(Snapshot::empty(std::time::UNIX_EPOCH))
    }

    #[test]
    fn one_entry_per_snapshot() {
        let cache = BodyCache::new();
        let (a, b) = (snapshot(), snapshot());
        let first = cache.entry(&a);
        assert!(
            Arc::ptr_eq(&first, &cache.entry(&a)),
            "same snapshot, same entry"
        );
        let text = cache.body(&a, Format::Text, false);
        assert!(text.is_some());
        assert_eq!(
            text.map(|t| t.as_ptr()),
            cache.body(&a, Format::Text, false).map(|t| t.as_ptr()),
            "encoded once"
        );
        let other = cache.entry(&b);
        assert!(!Arc::ptr_eq(&first, &other), "a new snapshot, a new entry");
        let gz = cache
            .body(&b, Format::OpenMetrics, true)
            .unwrap_or_default();
        assert_eq!(&gz[..2], &[0x1f, 0x8b], "gzip magic");
    }
}
