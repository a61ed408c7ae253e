//! Re-encoding only what a snapshot changed. A memory-only sample (ten a
//! second at the defaults) changes `gpu_info`, `gpu_up`, the
//! `gpu_memory_*_bytes` gauges, the kubelet's allocations and the
//! exporter's own counters; the per-process, MIG, torch and collector
//! families stay those of the last full sample, and they are most of the
//! body. A scrape that lands after a memory sample used to encode all of
//! it on the request path: that was the `/metrics` tail the lean pass
//! removed (BENCHMARKS.md, "H200: peers after the lean pass").
//!
//! The body is written as segments in scrape order, each through its own
//! prometheus-client registry (the encoder keeps no state between
//! families, so the concatenation is byte for byte the single encode; the
//! golden files and `segmented_equals_whole` check it). The two segments
//! that only a full sample changes are kept in a [`Reuse`] with the inputs
//! they were made from — `Arc` clones of each GPU's identity, processes,
//! MIG instances and collector readings — and used again while the next
//! snapshot holds the very same `Arc`s (pointer equality: the sampler
//! shares them between snapshots until a full sample replaces them, and
//! the clones kept here stop an address from being reused). Anything else
//! the reused families read would have to join [`FullKey`].

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::registry::Registry;

use super::budget::{self, Counts};
use super::format::Format;
use super::{accounting, allocation, exporter, forecast, gpu, limits, mig, process, stale, torch};
use crate::collectors::{Def, REGISTRY};
use crate::model::{
    DeviceInfo, MigSample, OtherProcesses, ProcessSample, Readings, SeriesMode, SeriesPolicy,
    Snapshot,
};

/// Family groups, in scrape order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Group {
    /// `gpu_info`, `gpu_up`, `gpu_memory_*`: every sample.
    Devices,
    /// Per-process memory, torch, rollups and identity, MIG: full samples.
    Processes,
    /// The kubelet's and Slurm's allocations: copied in at each publish.
    Allocation,
    /// The ledger's counters (`accounting`) and the allocation rows':
    /// every publish.
    Accounting,
    /// The switchable collectors' families, in registry order: full
    /// samples.
    Collectors,
    /// `gpu_driver_info`.
    Driver,
    /// The exporter's own families (`gpumem_exporter_*`), last: every
    /// publish.
    Exporter,
}

impl Group {
    /// Every group, in scrape order.
    pub(super) const ALL: [Group; 7] = [
        Group::Devices,
        Group::Processes,
        Group::Allocation,
        Group::Accounting,
        Group::Collectors,
        Group::Driver,
        Group::Exporter,
    ];
}

/// One group's families; the collectors' from `registry`'s rows. `whole`
/// is `s` before a series budget cut (`budget::cut`; the same snapshot
/// without one): the workloads' counters read it.
pub(super) fn encode_group(
    enc: &mut DescriptorEncoder,
    s: &Snapshot,
    whole: &Snapshot,
    group: Group,
    registry: &[Def],
) -> Result<(), fmt::Error> {
    match group {
        Group::Devices => {
            gpu::devices(enc, s)?;
            forecast::families(enc, s)
        }
        Group::Processes => {
            process::memory(enc, s)?;
            if s.torch.is_some() && s.series.mode == SeriesMode::Pid {
                torch::families(enc, s)?;
            }
            process::rollup_and_identity(enc, s)?;
            mig::families(enc, s)?;
            stale::families(enc, s)
        }
        Group::Allocation => {
            allocation::families(enc, s)?;
            limits::families(enc, s)
        }
        Group::Accounting => {
            accounting::families(enc, s, whole)?;
            allocation::counters(enc, s)
        }
        Group::Collectors => {
            for encode in registry.iter().filter_map(|d| d.encode) {
                encode(enc, s)?;
            }
            Ok(())
        }
        Group::Driver => gpu::driver(enc, s),
        Group::Exporter => exporter::families(enc, s),
    }
}

#[derive(Debug)]
struct GroupCollector {
    s: Arc<Snapshot>,
    whole: Arc<Snapshot>,
    groups: &'static [Group],
    registry: &'static [Def],
}

impl Collector for GroupCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), fmt::Error> {
        for &g in self.groups {
            encode_group(&mut enc, &self.s, &self.whole, g, self.registry)?;
        }
        Ok(())
    }
}

/// Append some groups' families of `s` (cut from `whole`, or `whole`
/// itself) to `out`, without OpenMetrics' `# EOF`.
fn append(
    out: &mut String,
    (s, whole): (&Arc<Snapshot>, &Arc<Snapshot>),
    format: Format,
    groups: &'static [Group],
    collectors: &'static [Def],
) -> Result<(), fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(GroupCollector {
        s: Arc::clone(s),
        whole: Arc::clone(whole),
        groups,
        registry: collectors,
    }));
    match format {
        Format::Text => prometheus_client::encoding::prometheus_text::encode(out, &registry),
        Format::OpenMetrics => prometheus_client::encoding::text::encode_registry(out, &registry),
    }
}

/// Append some groups' families to `out` and their series to `counts`.
fn append_counted(
    out: &mut String,
    counts: &mut Counts,
    pair: (&Arc<Snapshot>, &Arc<Snapshot>),
    format: Format,
    groups: &'static [Group],
    collectors: &'static [Def],
) -> Result<(), fmt::Error> {
    let from = out.len();
    append(out, pair, format, groups, collectors)?;
    budget::count(out.get(from..).unwrap_or(""), counts);
    Ok(())
}

/// What the two full-sample groups read of a snapshot, held as `Arc`
/// clones and compared by address.
#[derive(Debug)]
struct FullKey {
    torch: bool,
    series: SeriesPolicy,
    devices: Vec<DeviceKey>,
}

#[derive(Debug)]
struct DeviceKey {
    info: Arc<DeviceInfo>,
    processes: Arc<[ProcessSample]>,
    other: Option<OtherProcesses>,
    mig: Arc<[MigSample]>,
    readings: Arc<Readings>,
}

impl FullKey {
    fn of(s: &Snapshot) -> Self {
        FullKey {
            torch: s.torch.is_some(),
            series: s.series,
            devices: s
                .devices
                .iter()
                .map(|d| DeviceKey {
                    info: Arc::clone(&d.info),
                    processes: Arc::clone(&d.processes),
                    other: d.other,
                    mig: Arc::clone(&d.mig),
                    readings: d.readings.clone(),
                })
                .collect(),
        }
    }

    /// `s` reads the very same data.
    fn holds_for(&self, s: &Snapshot) -> bool {
        self.torch == s.torch.is_some()
            && self.series == s.series
            && self.devices.len() == s.devices.len()
            && self.devices.iter().zip(&s.devices).all(|(k, d)| {
                Arc::ptr_eq(&k.info, &d.info)
                    && Arc::ptr_eq(&k.processes, &d.processes)
                    && k.other == d.other
                    && Arc::ptr_eq(&k.mig, &d.mig)
                    && (Arc::ptr_eq(&k.readings, &d.readings) || k.readings.same_arcs(&d.readings))
            })
    }
}

#[derive(Debug)]
struct Kept {
    key: FullKey,
    /// Units each GPU keeps (`budget::cut`) when this full sample was
    /// over the series budget; `None`: all.
    keep: Option<usize>,
    processes: String,
    collectors: String,
    /// The series of `processes` and `collectors`.
    processes_counts: Counts,
    collectors_counts: Counts,
    /// Series the cut leaves out of each body, per family.
    cut_dropped: Counts,
}

/// Room for a body's per-publish families before one was encoded.
const REST: usize = 32 * 1024;

/// Room for the full-sample segments before any were encoded.
const ROOM: (usize, usize) = (8192, 4096);

/// The full-sample segments of the last body encoded, per format, the
/// series every body left out so far (per family), and the collector
/// registry the bodies are encoded with.
#[derive(Debug)]
pub struct Reuse {
    kept: [Mutex<Option<Kept>>; 2],
    /// Per format, the bytes of the last body besides its full-sample
    /// segments: the next body's room for them.
    rest: [AtomicUsize; 2],
    reused: AtomicU64,
    dropped: Mutex<BTreeMap<Box<str>, u64>>,
    registry: &'static [Def],
}

impl Default for Reuse {
    fn default() -> Self {
        Reuse::with_registry(REGISTRY)
    }
}

impl Reuse {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bodies whose collectors' families come from `registry`'s rows (the
    /// sampler's, when it was made with another registry: the toy
    /// collector's test).
    pub(crate) fn with_registry(registry: &'static [Def]) -> Self {
        Reuse {
            kept: Default::default(),
            rest: [AtomicUsize::new(REST), AtomicUsize::new(REST)],
            reused: AtomicU64::new(0),
            dropped: Mutex::default(),
            registry,
        }
    }

    /// Bodies that reused the full-sample segments instead of encoding
    /// them (tests and benches look).
    pub fn reused(&self) -> u64 {
        self.reused.load(Ordering::Relaxed)
    }
}

/// The two full-sample segments of `s` (cut from `whole`, or `whole`),
/// with room for `room` bytes each to begin with (the last ones' sizes).
fn full_segments(
    pair: (&Arc<Snapshot>, &Arc<Snapshot>),
    format: Format,
    registry: &'static [Def],
    keep: Option<usize>,
    room: (usize, usize),
) -> Result<Kept, fmt::Error> {
    let mut processes = String::with_capacity(room.0);
    let mut processes_counts = Counts::new();
    append_counted(
        &mut processes,
        &mut processes_counts,
        pair,
        format,
        &[Group::Processes],
        registry,
    )?;
    let mut collectors = String::with_capacity(room.1);
    let mut collectors_counts = Counts::new();
    append_counted(
        &mut collectors,
        &mut collectors_counts,
        pair,
        format,
        &[Group::Collectors],
        registry,
    )?;
    // Kept until the next full sample: no room left over that a grown
    // string doubled into.
    for segment in [&mut processes, &mut collectors] {
        if segment.capacity() - segment.len() > segment.len() / 8 + 4096 {
            segment.shrink_to_fit();
        }
    }
    Ok(Kept {
        key: FullKey::of(pair.1),
        keep,
        processes,
        collectors,
        processes_counts,
        collectors_counts,
        cut_dropped: Counts::new(),
    })
}

/// The body up to the exporter's own families, and its series per
/// family: the per-publish groups of `s` around `k`'s segments, in a
/// string of room for them and `rest` bytes more (what the last body
/// held besides the segments), so a body is one allocation that does not
/// grow while it is written.
fn assemble(
    pair: (&Arc<Snapshot>, &Arc<Snapshot>),
    format: Format,
    k: &Kept,
    registry: &'static [Def],
    rest: usize,
    buf: Vec<u8>,
) -> Result<(String, Counts), fmt::Error> {
    let mut out = into_string(buf);
    out.reserve(k.processes.len() + k.collectors.len() + rest);
    let mut counts =
        Counts::with_capacity(k.processes_counts.len() + k.collectors_counts.len() + 32);
    append_counted(
        &mut out,
        &mut counts,
        pair,
        format,
        &[Group::Devices],
        registry,
    )?;
    out.push_str(&k.processes);
    counts.extend(k.processes_counts.iter().cloned());
    append_counted(
        &mut out,
        &mut counts,
        pair,
        format,
        &[Group::Allocation, Group::Accounting],
        registry,
    )?;
    out.push_str(&k.collectors);
    counts.extend(k.collectors_counts.iter().cloned());
    append_counted(
        &mut out,
        &mut counts,
        pair,
        format,
        &[Group::Driver],
        registry,
    )?;
    Ok((out, counts))
}

/// The largest cut that fits `budget` (binary search: the series a body
/// holds never fall as a GPU keeps more units), its segments and what it
/// leaves out compared with `uncut`; at worst every unit rolled up.
fn search(
    whole: &Arc<Snapshot>,
    format: Format,
    registry: &'static [Def],
    uncut: &Counts,
) -> Result<Kept, fmt::Error> {
    let budget = whole.series.budget;
    let trial = |k: usize| -> Result<(Kept, u64), fmt::Error> {
        let view = Arc::new(budget::cut(whole, k));
        let kept = full_segments((&view, whole), format, registry, Some(k), ROOM)?;
        let (_, counts) = assemble((&view, whole), format, &kept, registry, REST, Vec::new())?;
        Ok((kept, budget::total(&counts)))
    };
    // Invariant: `hi` units do not fit (the whole body did not).
    let (mut lo, mut hi) = (0usize, budget::units(whole));
    let mut best: Option<Kept> = None;
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let (kept, n) = trial(mid)?;
        if n <= budget {
            best = Some(kept);
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    let mut kept = match best {
        Some(k) => k,
        None => trial(0)?.0,
    };
    let view = Arc::new(budget::cut(whole, kept.keep.unwrap_or(0)));
    let (_, served) = assemble((&view, whole), format, &kept, registry, REST, Vec::new())?;
    let served: BTreeMap<&str, u64> = served.iter().map(|(f, n)| (&**f, *n)).collect();
    kept.cut_dropped = uncut
        .iter()
        .filter_map(|(f, n)| {
            let left = n.saturating_sub(served.get(&**f).copied().unwrap_or(0));
            (left > 0).then(|| (f.clone(), left))
        })
        .collect();
    Ok(kept)
}

/// Encode `snapshot` whole, reusing `reuse`'s full-sample segments when
/// they were made from the same data, and keeping this snapshot's; within
/// its series budget (see `budget`).
pub fn encode_reusing(
    snapshot: &Arc<Snapshot>,
    format: Format,
    reuse: &Reuse,
) -> Result<String, fmt::Error> {
    encode_into(snapshot, format, reuse, Vec::new())
}

/// `buf` emptied, as a string to write into (its capacity kept).
fn into_string(mut buf: Vec<u8>) -> String {
    buf.clear();
    String::from_utf8(buf).unwrap_or_default()
}

/// [`encode_reusing`], written into `buf` (emptied first): a body
/// recycled from an earlier snapshot (`http::cache`) keeps its pages, so
/// the new body faults none in.
pub(crate) fn encode_into(
    snapshot: &Arc<Snapshot>,
    format: Format,
    reuse: &Reuse,
    buf: Vec<u8>,
) -> Result<String, fmt::Error> {
    let i = match format {
        Format::Text => 0,
        Format::OpenMetrics => 1,
    };
    let slot = &reuse.kept[i];
    // A little more than last time: the exporter's counters grow digits.
    let rest = reuse.rest[i].load(Ordering::Relaxed) + 1024;
    // Held across the encode: two requests for two snapshots at once
    // take turns (each body is already encoded once per snapshot by the
    // body cache), and a poisoned lock only loses the kept segments.
    let mut kept = slot.lock().unwrap_or_else(|e| {
        let mut g = e.into_inner();
        *g = None;
        g
    });
    let registry = reuse.registry;
    let whole = (snapshot, snapshot);
    let fresh = match kept.as_ref() {
        Some(k) if k.key.holds_for(snapshot) => {
            reuse.reused.fetch_add(1, Ordering::Relaxed);
            false
        }
        _ => true,
    };
    if fresh {
        // The last segments go first, so two are never held at once; their
        // sizes are the new ones' room.
        let room = kept.take().map_or(ROOM, |k| {
            let more = |n: usize| n + n / 16 + 1024;
            (more(k.processes.len()), more(k.collectors.len()))
        });
        *kept = Some(full_segments(whole, format, registry, None, room)?);
    }
    let Some(k) = kept.as_ref() else {
        return Err(fmt::Error);
    };
    let budget = snapshot.series.budget;
    let (mut out, mut counts) = match k.keep {
        None => assemble(whole, format, k, registry, rest, buf)?,
        Some(n) => assemble(
            (&Arc::new(budget::cut(snapshot, n)), snapshot),
            format,
            k,
            registry,
            rest,
            buf,
        )?,
    };
    if fresh && budget::total(&counts) > budget && snapshot.series.mode != SeriesMode::Off {
        let cut = search(snapshot, format, registry, &counts)?;
        let view = Arc::new(budget::cut(snapshot, cut.keep.unwrap_or(0)));
        let buf = std::mem::take(&mut out).into_bytes();
        (out, counts) = assemble((&view, snapshot), format, &cut, registry, rest, buf)?;
        *kept = Some(cut);
    }
    let Some(k) = kept.as_ref() else {
        return Err(fmt::Error);
    };
    let mut dropped: Counts = k.cut_dropped.clone();
    if budget::total(&counts) > budget {
        let drop = budget::families_to_drop(&counts, budget);
        out = budget::without(&out, &counts, &drop);
        for i in drop {
            if let Some((family, n)) = counts.get_mut(i) {
                dropped.push((family.clone(), *n));
                *n = 0;
            }
        }
    }
    let totals = {
        let mut d = reuse.dropped.lock().unwrap_or_else(|e| e.into_inner());
        for (family, n) in dropped {
            *d.entry(family).or_insert(0) += n;
        }
        d.clone()
    };
    append(&mut out, whole, format, &[Group::Exporter], registry)?;
    append_budget(&mut out, format, counts, totals)?;
    if format == Format::OpenMetrics {
        prometheus_client::encoding::text::encode_eof(&mut out)?;
    }
    let segments = kept
        .as_ref()
        .map_or(0, |k| k.processes.len() + k.collectors.len());
    reuse.rest[i].store(out.len().saturating_sub(segments), Ordering::Relaxed);
    Ok(out)
}

#[derive(Debug)]
struct BudgetCollector(Counts, BTreeMap<Box<str>, u64>);

impl Collector for BudgetCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), fmt::Error> {
        budget::families(&mut enc, &self.0, &self.1)
    }
}

/// The budget's two families (`budget::families`), after the exporter's
/// own.
fn append_budget(
    out: &mut String,
    format: Format,
    served: Counts,
    dropped: BTreeMap<Box<str>, u64>,
) -> Result<(), fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(BudgetCollector(served, dropped)));
    match format {
        Format::Text => prometheus_client::encoding::prometheus_text::encode(out, &registry),
        Format::OpenMetrics => prometheus_client::encoding::text::encode_registry(out, &registry),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DeviceSample, MemoryInfo};

    fn whole(s: &Arc<Snapshot>, format: Format) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(GroupCollector {
            s: Arc::clone(s),
            whole: Arc::clone(s),
            groups: &Group::ALL,
            registry: REGISTRY,
        }));
        let mut out = String::new();
        let r = match format {
            Format::Text => {
                prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)
            }
            Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut out, &registry),
        };
        assert!(r.is_ok());
        out
    }

    /// `body` without the budget's families (`budget::families`), which
    /// `whole` does not write.
    fn without_budget(body: &str) -> String {
        let Some(at) = body.find("# HELP gpumem_exporter_series ") else {
            return body.to_string();
        };
        let eof = body.find("# EOF\n").unwrap_or(body.len());
        format!("{}{}", &body[..at], &body[eof..])
    }

    fn memory(used: u64) -> MemoryInfo {
        MemoryInfo {
            total: 100 << 30,
            used,
            free: (100 << 30) - used,
            reserved: Some(1 << 20),
        }
    }

    fn one_gpu_three_processes() -> Snapshot {
        let mut s = Snapshot::empty(std::time::UNIX_EPOCH);
        let info = DeviceInfo {
            uuid: "GPU-1".into(),
            name: "Fake".into(),
            ..DeviceInfo::unknown(0)
        };
        let processes: Vec<ProcessSample> = (1..=3)
            .map(|pid| ProcessSample {
                pid,
                used_bytes: Some(u64::from(pid) << 20),
                ident: Arc::default(),
                gpu_instance_id: None,
                compute_instance_id: None,
                used_peak_bytes: None,
                torch: None,
                readings: Default::default(),
            })
            .collect();
        s.devices.push(DeviceSample {
            info: Arc::new(info),
            memory: Some(memory(3 << 20)),
            used_peak_bytes: Some(3 << 20),
            processes: processes.into(),
            other: None,
            mig: Arc::new([]),
            readings: Default::default(),
        });
        s
    }

    /// A body after the first is one allocation sized from the last one's
    /// parts: nothing grown by doubling, kept as long as its snapshot.
    #[test]
    fn a_body_after_the_first_is_one_allocation_of_about_its_size() {
        let s = Arc::new(one_gpu_three_processes());
        let reuse = Reuse::new();
        for format in [Format::Text, Format::OpenMetrics] {
            let first = encode_reusing(&s, format, &reuse).unwrap_or_default();
            for _ in 0..3 {
                let body = encode_reusing(&s, format, &reuse).unwrap_or_default();
                assert_eq!(body, first, "{format:?}");
                assert!(
                    body.capacity() <= body.len() + 2048,
                    "{format:?}: {} bytes in room for {}",
                    body.len(),
                    body.capacity()
                );
            }
        }
    }

    #[test]
    fn segmented_equals_whole_and_reuses_only_the_same_full_sample() {
        let full = Arc::new(one_gpu_three_processes());
        let reuse = Reuse::new();
        for format in [Format::Text, Format::OpenMetrics] {
            let r0 = reuse.reused();
            let first = encode_reusing(&full, format, &reuse).unwrap_or_default();
            assert_eq!(
                without_budget(&first),
                whole(&full, format),
                "{format:?}: whole body"
            );
            assert_eq!(reuse.reused(), r0, "nothing to reuse yet");
            // A memory-only sample: same Arcs, other memory figures.
            let mut next = (*full).clone();
            next.devices = next
                .devices
                .iter()
                .map(|d| DeviceSample {
                    memory: Some(memory(7 << 30)),
                    ..d.clone()
                })
                .collect();
            let next = Arc::new(next);
            let body = encode_reusing(&next, format, &reuse).unwrap_or_default();
            assert_eq!(reuse.reused(), r0 + 1, "full-sample part reused");
            assert_eq!(without_budget(&body), whole(&next, format));
            assert!(
                body.contains(&(7u64 << 30).to_string()),
                "new memory figure"
            );
            // A full sample: new process list (another Arc, same content
            // or not) is encoded again.
            let mut third = (*next).clone();
            third.devices = third
                .devices
                .iter()
                .map(|d| DeviceSample {
                    processes: d.processes.iter().skip(1).cloned().collect(),
                    ..d.clone()
                })
                .collect();
            let third = Arc::new(third);
            let body = encode_reusing(&third, format, &reuse).unwrap_or_default();
            assert_eq!(reuse.reused(), r0 + 1, "new processes: encoded again");
            assert_eq!(without_budget(&body), whole(&third, format));
        }
    }
}
