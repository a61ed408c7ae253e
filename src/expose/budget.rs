//! The series budget (`series_budget`): how many series one body may
//! hold, the exporter's own `gpumem_exporter_*` families not counted, and
//! what is left out first when a snapshot would write more.
//!
//! 1. **The smallest per-process series roll into the rollup.** Each GPU
//!    keeps its `k` largest processes (in `processes.series: workload`,
//!    its `k` largest workloads) and the rest join `pid="other"`
//!    (`workload="other"`): their bytes are added to it and their count
//!    to `gpu_processes_other`, so a GPU's per-process memory still sums to
//!    what NVML says it holds. `k` is the largest that fits, found by a
//!    binary search over bodies encoded from the cut snapshot (only on a
//!    snapshot over the budget, once per full sample: the memory-only
//!    snapshots after it reuse `k`). Every per-process family of a cut
//!    process goes with it, so no family is left half-served.
//! 2. **Then whole families.** If the body is still over the budget (the
//!    per-GPU families alone exceed it), families are left out whole:
//!    the per-process families (`gpu_process_*`, `gpu_processes_other`)
//!    first, then the others from the end of the body backwards, so
//!    `gpu_info`, `gpu_up` and `gpu_memory_*` go last.
//!
//! What was left out is counted per family
//! (`gpumem_exporter_series_dropped_total`, once per encoded body), and
//! what was served is `gpumem_exporter_series` (per family of the very
//! body it is in). Series are counted on the encoded text (a line that is
//! not a comment is a series), which stays exact whatever a family
//! writes; hand-written, a line scan no library does for us.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use prometheus_client::encoding::DescriptorEncoder;

use crate::encoding::gauge;
use crate::model::{ProcessSample, SeriesMode, Snapshot, Workload};

/// Series per family, in body order (family names as the text format
/// writes them: counters with `_total`).
pub(super) type Counts = Vec<(Box<str>, u64)>;

/// Add the series of `text`'s families to `out`: a line that starts
/// with `#` is a comment (a `# TYPE` one starts a family), every other
/// line a series of the family last started. One pass of `memchr` over
/// the newlines, a byte compare and an increment per line.
pub(super) fn count(text: &str, out: &mut Counts) {
    let b = text.as_bytes();
    let mut line = 0;
    let mut n: u64 = 0;
    let mut open = false;
    for nl in memchr::memchr_iter(b'\n', b) {
        if b.get(line) == Some(&b'#') {
            if let Some(rest) = text.get(line..nl).and_then(|l| l.strip_prefix("# TYPE ")) {
                if open && let Some(last) = out.last_mut() {
                    last.1 = n;
                }
                let mut words = rest.split(' ');
                let name = words.next().unwrap_or("");
                let name = match words.next() {
                    Some("counter") if !name.ends_with("_total") => format!("{name}_total"),
                    _ => name.to_string(),
                };
                out.push((name.into_boxed_str(), 0));
                open = true;
                n = 0;
            }
        } else if nl > line {
            n += 1;
        }
        line = nl + 1;
    }
    if open && let Some(last) = out.last_mut() {
        last.1 = n;
    }
}

/// The series of `counts`.
pub(super) fn total(counts: &Counts) -> u64 {
    counts.iter().map(|(_, n)| n).sum()
}

/// A family written per process (or per workload): left out first.
pub(super) fn per_process(family: &str) -> bool {
    family.starts_with("gpu_process_") || family == "gpu_processes_other"
}

/// The most units (processes, or workloads in workload mode) any GPU
/// lists: a cut at this keeps everything.
pub(super) fn units(s: &Snapshot) -> usize {
    s.devices
        .iter()
        .map(|d| ranked(&d.processes, s.series.mode).len())
        .max()
        .unwrap_or(0)
}

/// One GPU's units, largest first (bytes, then pid or workload order):
/// the indices of each unit's processes.
fn ranked(processes: &[ProcessSample], mode: SeriesMode) -> Vec<(u64, Vec<usize>)> {
    let mut units: Vec<(u64, Vec<usize>)> = match mode {
        SeriesMode::Workload => {
            let mut by: BTreeMap<(Workload, Option<u32>, Option<u32>), Vec<usize>> =
                BTreeMap::new();
            for (i, p) in processes.iter().enumerate() {
                // Processes of no known workload are in the rollup already.
                if let Some(w) = Workload::of(&p.ident) {
                    by.entry((w, p.gpu_instance_id, p.compute_instance_id))
                        .or_default()
                        .push(i);
                }
            }
            by.into_values()
                .map(|ix| (ix.iter().map(|&i| bytes(&processes[i])).sum(), ix))
                .collect()
        }
        _ => (0..processes.len())
            .map(|i| (bytes(&processes[i]), vec![i]))
            .collect(),
    };
    // Stable: equal bytes keep pid (or workload) order.
    units.sort_by_key(|u| std::cmp::Reverse(u.0));
    units
}

fn bytes(p: &ProcessSample) -> u64 {
    p.used_bytes.unwrap_or(0)
}

/// `s` with each GPU keeping its `k` largest units; the rest summed into
/// its rollup (`other`), its processes still in pid order.
pub(super) fn cut(s: &Snapshot, k: usize) -> Snapshot {
    let mut out = s.clone();
    for d in &mut out.devices {
        let units = ranked(&d.processes, s.series.mode);
        if units.len() <= k {
            continue;
        }
        let mut keep = vec![true; d.processes.len()];
        let mut other = d.other.unwrap_or_default();
        for (_, ix) in &units[k..] {
            for &i in ix {
                keep[i] = false;
                other.count += 1;
                other.used_bytes += bytes(&d.processes[i]);
            }
        }
        let kept: Vec<ProcessSample> = d
            .processes
            .iter()
            .zip(&keep)
            .filter(|(_, k)| **k)
            .map(|(p, _)| p.clone())
            .collect();
        d.processes = Arc::from(kept);
        d.other = Some(other);
    }
    out
}

/// Stage 2: the families of `counts` to leave out whole so that the rest
/// fits `budget` — per-process ones first, then the others from the end
/// of the body backwards.
pub(super) fn families_to_drop(counts: &Counts, budget: u64) -> Vec<usize> {
    let mut over = total(counts).saturating_sub(budget);
    let order = (0..counts.len())
        .rev()
        .filter(|&i| per_process(&counts[i].0))
        .chain(
            (0..counts.len())
                .rev()
                .filter(|&i| !per_process(&counts[i].0)),
        );
    let mut out = Vec::new();
    for i in order {
        if over == 0 {
            break;
        }
        if counts[i].1 > 0 {
            over = over.saturating_sub(counts[i].1);
            out.push(i);
        }
    }
    out
}

/// `body` without the families at `drop` (indices into the families in
/// body order, as `count` found them). A family starts at its `# HELP`.
pub(super) fn without(body: &str, counts: &Counts, drop: &[usize]) -> String {
    if drop.is_empty() {
        return body.to_string();
    }
    let mut out = String::with_capacity(body.len());
    let mut family: Option<usize> = None;
    let mut skip = false;
    for line in body.split_inclusive('\n') {
        if line.starts_with("# HELP ") {
            let i = family.map_or(0, |f| f + 1);
            family = Some(i);
            skip = i < counts.len() && drop.contains(&i);
        }
        if !skip {
            out.push_str(line);
        }
    }
    out
}

/// `gpumem_exporter_series` (what this body serves, per family) and
/// `gpumem_exporter_series_dropped_total` (what bodies left out so far).
pub(super) fn families(
    enc: &mut DescriptorEncoder,
    served: &Counts,
    dropped: &BTreeMap<Box<str>, u64>,
) -> Result<(), fmt::Error> {
    let mut m = gauge(
        enc,
        "gpumem_exporter_series",
        "Series of each family in this body, families without any left out (the exporter's own gpumem_exporter_* families not counted): what this node costs the time-series database, within series_budget.",
    )?;
    for (family, n) in served.iter().filter(|(_, n)| *n > 0) {
        m.encode_family(&crate::encoding::Labels([("family", &**family)]))?
            .encode_gauge(n)?;
    }
    if dropped.is_empty() {
        return Ok(());
    }
    let mut m = enc.encode_descriptor(
        "gpumem_exporter_series_dropped",
        "Series left out of encoded bodies by series_budget, per family, summed over the bodies encoded (each snapshot once per format): per-process series rolled into pid=\"other\" first, then whole families.",
        None,
        prometheus_client::metrics::MetricType::Counter,
    )?;
    for (family, n) in dropped {
        m.encode_family(&crate::encoding::Labels([("family", &**family)]))?
            .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(n, None)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
