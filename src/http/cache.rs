//! The body cache: each snapshot is encoded at most once per body (the
//! text and OpenMetrics expositions, the JSON snapshot, the JSON history
//! per `seconds`) and gzipped at most once, however many clients ask. The
//! sampler publishes the snapshot itself; the encoded bodies live here, on
//! the HTTP side, keyed by the snapshot they were made from. Every encode
//! is counted (`gpumem_exporter_http_body_encodes_total{body}`), so "once
//! per snapshot" can be checked from outside. What the last full sample
//! encoded is kept across snapshots too: a snapshot from a memory-only
//! sample re-encodes only what that sample changed (`expose::Reuse`,
//! `expose::json::Reuse`), so a scrape after one costs little more than a
//! cache hit. A body the next snapshot replaces is recycled when no
//! response still holds it: the next body of its kind is written into the
//! same buffer, whose pages are already mapped (a fresh megabyte at 8 GPUs
//! × 256 processes faulted in ~250 pages per encode; mappings of that size
//! are the kernel's own, `main`'s `M_MMAP_THRESHOLD`).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use bytes::Bytes;

use crate::expose::{self, Format};
use crate::history::History;
use crate::model::{HttpBody, Snapshot};
use crate::telemetry::Telemetry;

/// Distinct `seconds` of `/api/v1/history` cached per snapshot; another
/// one is encoded for its request alone (still counted).
const HISTORY_SLOTS: usize = 8;

/// A body, plain and gzipped, made lazily.
type Pair = [OnceLock<Option<Bytes>>; 2];

/// The bodies of one snapshot.
#[derive(Debug)]
struct Bodies {
    snapshot: Arc<Snapshot>,
    text: Pair,
    openmetrics: Pair,
    snapshot_json: Pair,
    /// JSON history by `seconds`.
    history: Mutex<Vec<(u64, Arc<Pair>)>>,
}

impl Bodies {
    fn new(snapshot: Arc<Snapshot>) -> Self {
        Bodies {
            snapshot,
            text: Pair::default(),
            openmetrics: Pair::default(),
            snapshot_json: Pair::default(),
            history: Mutex::new(Vec::new()),
        }
    }

    fn history_pair(&self, seconds: u64) -> Arc<Pair> {
        let mut slots = self.history.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, p)) = slots.iter().find(|(s, _)| *s == seconds) {
            return Arc::clone(p);
        }
        let pair = Arc::new(Pair::default());
        if slots.len() < HISTORY_SLOTS {
            slots.push((seconds, Arc::clone(&pair)));
        }
        pair
    }
}

/// The plain body of `pair` (encoded by `encode` on first use), or its
/// gzip (made from the plain one on first use).
fn fill(
    pair: &Pair,
    gzip: bool,
    kind: HttpBody,
    counts: Option<&Telemetry>,
    encode: &dyn Fn() -> Option<Bytes>,
) -> Option<Bytes> {
    let [plain, zipped] = pair;
    let plain_body = || {
        plain
            .get_or_init(|| {
                if let Some(t) = counts {
                    t.http_body_encodes
                        .get(kind)
                        .fetch_add(1, Ordering::Relaxed);
                }
                let body = encode();
                if body.is_none() {
                    tracing::error!(body = ?kind, "encoding the snapshot failed");
                }
                body
            })
            .clone()
    };
    if !gzip {
        return plain_body();
    }
    zipped
        .get_or_init(|| {
            let plain = plain_body()?;
            let mut z = flate2::write::GzEncoder::new(
                Vec::with_capacity(plain.len() / 4),
                flate2::Compression::fast(),
            );
            std::io::Write::write_all(&mut z, &plain).ok()?;
            // Kept as long as the snapshot: without the room a body that
            // compressed well did not need.
            let mut zipped = z.finish().ok()?;
            zipped.shrink_to_fit();
            Some(Bytes::from(zipped))
        })
        .clone()
}

/// The bodies of the latest snapshot asked for. A request for another
/// snapshot replaces the entry; its bodies are made on first use.
#[derive(Debug, Default)]
pub struct BodyCache {
    current: ArcSwapOption<Bodies>,
    /// Where encodes are counted; `None` in benches and unit tests.
    counts: Option<Arc<Telemetry>>,
    /// The last full sample's segments of the exposition, and its
    /// processes in JSON: a body after a memory-only sample encodes only
    /// what that sample changed (`expose::segments`, `expose::json`).
    reuse: expose::Reuse,
    json_reuse: expose::json::Reuse,
    /// Buffers of replaced bodies, per [`Slot`], for the next encode.
    spares: [Mutex<Vec<u8>>; 3],
}

/// The plain bodies that are recycled.
#[derive(Debug, Clone, Copy)]
enum Slot {
    Text = 0,
    OpenMetrics = 1,
    SnapshotJson = 2,
}

/// A spare far larger than what is written into it is let go rather than
/// kept: a host whose processes left should not hold their old body.
const SPARE_SLACK: usize = 4;

/// A spare up to this size is kept whatever was written into it.
const SPARE_ANY: usize = 64 << 10;

impl BodyCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// A cache that counts its encodes in `telemetry`.
    pub fn counting(telemetry: Arc<Telemetry>) -> Self {
        BodyCache {
            counts: Some(telemetry),
            ..Self::default()
        }
    }

    /// The exposition of `snapshot`; `None` only if encoding failed (a
    /// bug, logged).
    pub fn body(&self, snapshot: &Arc<Snapshot>, format: Format, gzip: bool) -> Option<Bytes> {
        let entry = self.entry(snapshot);
        let (pair, kind, slot) = match format {
            Format::Text => (&entry.text, HttpBody::Text, Slot::Text),
            Format::OpenMetrics => (&entry.openmetrics, HttpBody::OpenMetrics, Slot::OpenMetrics),
        };
        fill(pair, gzip, kind, self.counts.as_deref(), &|| {
            expose::encode_into(snapshot, format, &self.reuse, self.spare(slot))
                .ok()
                .map(Bytes::from)
        })
    }

    /// `/api/v1/snapshot` of `snapshot`, taken at `sample_interval`.
    pub fn snapshot_json(
        &self,
        snapshot: &Arc<Snapshot>,
        sample_interval: Duration,
        gzip: bool,
    ) -> Option<Bytes> {
        let entry = self.entry(snapshot);
        let kind = HttpBody::SnapshotJson;
        fill(
            &entry.snapshot_json,
            gzip,
            kind,
            self.counts.as_deref(),
            &|| {
                expose::json::snapshot_into(
                    snapshot,
                    sample_interval,
                    &self.json_reuse,
                    self.spare(Slot::SnapshotJson),
                )
                .ok()
                .map(Bytes::from)
            },
        )
    }

    /// `/api/v1/history?seconds=…` as of `snapshot`; `history` is locked
    /// only while it is encoded, at most once per snapshot and `seconds`.
    pub fn history_json<'h>(
        &self,
        snapshot: &Arc<Snapshot>,
        seconds: u64,
        history: &dyn Fn() -> MutexGuard<'h, History>,
        gzip: bool,
    ) -> Option<Bytes> {
        let pair = self.entry(snapshot).history_pair(seconds);
        let kind = HttpBody::HistoryJson;
        fill(&pair, gzip, kind, self.counts.as_deref(), &|| {
            expose::json::history(snapshot, &history(), seconds)
                .ok()
                .map(Bytes::from)
        })
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
        // Requests racing on a new snapshot all end up with the entry
        // stored first, so it is encoded once.
        let fresh = Arc::new(Bodies::new(Arc::clone(snapshot)));
        let prev = self
            .current
            .rcu(|cur| of(cur).or_else(|| Some(Arc::clone(&fresh))));
        match of(&prev) {
            Some(stored) => stored,
            None => {
                if let Some(old) = prev {
                    self.recycle(old);
                }
                fresh
            }
        }
    }

    /// `slot`'s spare buffer, locked (a poisoned lock only loses a buffer).
    fn spare_slot(&self, slot: Slot) -> MutexGuard<'_, Vec<u8>> {
        self.spares[slot as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The buffer of `slot`'s last replaced body (empty if none), taken.
    fn spare(&self, slot: Slot) -> Vec<u8> {
        std::mem::take(&mut *self.spare_slot(slot))
    }

    /// Keep the plain bodies of a replaced entry that nothing else holds
    /// (no request is still sending one) as the next bodies' buffers.
    fn recycle(&self, old: Arc<Bodies>) {
        let Some(old) = Arc::into_inner(old) else {
            return;
        };
        for (pair, slot) in [
            (old.text, Slot::Text),
            (old.openmetrics, Slot::OpenMetrics),
            (old.snapshot_json, Slot::SnapshotJson),
        ] {
            let [plain, _] = pair;
            let Some(Some(body)) = plain.into_inner() else {
                continue;
            };
            let Ok(body) = body.try_into_mut() else {
                continue;
            };
            let used = body.len();
            let buf = Vec::from(body);
            if buf.capacity() > (SPARE_SLACK * used).max(SPARE_ANY) {
                continue;
            }
            *self.spare_slot(slot) = buf;
        }
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

    #[test]
    fn each_body_is_encoded_once_per_snapshot_and_counted() {
        let t = Arc::new(Telemetry::new());
        let cache = BodyCache::counting(Arc::clone(&t));
        let history = Mutex::new(History::new());
        let lock = || history.lock().unwrap_or_else(|e| e.into_inner());
        let interval = Duration::from_secs(1);
        let (a, b) = (snapshot(), snapshot());
        for _ in 0..10 {
            for gzip in [false, true] {
                cache.body(&a, Format::Text, gzip);
                cache.body(&a, Format::OpenMetrics, gzip);
                assert!(cache.snapshot_json(&a, interval, gzip).is_some());
                assert!(cache.history_json(&a, 600, &lock, gzip).is_some());
                assert!(cache.history_json(&a, 60, &lock, gzip).is_some());
            }
        }
        let encodes = || HttpBody::ALL.map(|b| *t.read().http_body_encodes.get(b));
        assert_eq!(encodes(), [1, 1, 1, 2]);
        cache.snapshot_json(&b, interval, false);
        assert_eq!(encodes(), [1, 1, 2, 2], "a new snapshot");
        // More distinct `seconds` than slots: encoded per request beyond.
        for s in 0..(HISTORY_SLOTS as u64 + 2) {
            cache.history_json(&b, s, &lock, false);
            cache.history_json(&b, s, &lock, false);
        }
        let h = t.read().http_body_encodes.history_json;
        assert_eq!(h, 2 + HISTORY_SLOTS as u64 + 4);
        let json = cache.snapshot_json(&b, interval, false).unwrap_or_default();
        assert_eq!(json.first(), Some(&b'{'));
    }

    /// Each plain body of a replaced snapshot that no response holds is
    /// the buffer of the next one of its kind (the same allocation once
    /// its size settled); one still held is left to its holder.
    #[test]
    fn a_replaced_body_is_recycled_unless_still_held() {
        type Encode = fn(&BodyCache, &Arc<Snapshot>) -> Option<Bytes>;
        let kinds: [(&str, Encode); 3] = [
            ("text", |c, s| c.body(s, Format::Text, false)),
            ("openmetrics", |c, s| c.body(s, Format::OpenMetrics, false)),
            ("json", |c, s| {
                c.snapshot_json(s, Duration::from_secs(1), false)
            }),
        ];
        let slots = [Slot::Text, Slot::OpenMetrics, Slot::SnapshotJson];
        for ((name, encode), slot) in kinds.into_iter().zip(slots) {
            let cache = BodyCache::new();
            let spare = |c: &BodyCache| c.spare_slot(slot).capacity();
            // Replacing the entry keeps the buffer; the next encode takes it.
            let (a, b) = (snapshot(), snapshot());
            let len = encode(&cache, &a).unwrap_or_default().len();
            assert_eq!(spare(&cache), 0, "{name}: nothing replaced yet");
            cache.entry(&b);
            assert!(spare(&cache) >= len, "{name}: the replaced body is kept");
            encode(&cache, &b);
            assert_eq!(spare(&cache), 0, "{name}: and written into");
            let snapshots: Vec<Arc<Snapshot>> = (0..4).map(|_| snapshot()).collect();
            let mut at = Vec::new();
            let mut bodies = Vec::new();
            for s in &snapshots {
                let body = encode(&cache, s).unwrap_or_default();
                at.push(body.as_ptr());
                bodies.push(body.to_vec());
            }
            assert!(
                bodies.windows(2).all(|w| w[0] == w[1]),
                "{name}: same bytes"
            );
            assert_eq!(at[2], at[3], "{name}: recycled");
            let held = encode(&cache, &snapshots[3]).unwrap_or_default();
            let c = snapshot();
            cache.entry(&c);
            assert_eq!(spare(&cache), 0, "{name}: a held body is not kept");
            let next = encode(&cache, &c).unwrap_or_default();
            assert_ne!(
                held.as_ptr(),
                next.as_ptr(),
                "{name}: a held body is not reused"
            );
            assert_eq!(held, next, "{name}: and what it holds is intact");
        }
    }
}
