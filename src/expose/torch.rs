//! PyTorch allocator families (`gpu_process_torch_*`), from the torch
//! bridge, with the labels of `gpu_process_memory_used_bytes` (per pool
//! families add `pool`, the settings info series its settings).

use std::fmt;

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use crate::encoding::Ids;
use crate::encoding::process_labels;
use crate::model::{Snapshot, TorchPool, TorchStats};

/// Calls `f` with the labels of `gpu_process_memory_used_bytes` and the
/// figures of every process that published torch figures for a GPU.
fn each_process(
    s: &Snapshot,
    mut f: impl FnMut(&[(&'static str, &str)], &TorchStats) -> fmt::Result,
) -> fmt::Result {
    let mut ids = Ids::default();
    for d in &s.devices {
        for p in d.processes.iter() {
            let Some(t) = &p.torch else { continue };
            let (pid, gi, ci) = ids.all(p);
            // Labels with an empty value are left out (see encoder::Labels).
            let labels: Vec<(&'static str, &str)> = process_labels(d, p, pid, gi, ci)
                .0
                .into_iter()
                .filter(|(_, v)| !v.is_empty())
                .collect();
            f(&labels, t)?;
        }
    }
    Ok(())
}

/// One family with a series per process for which its pick gives a
/// figure: name, help, type, pick.
type Row = (
    &'static str,
    &'static str,
    MetricType,
    fn(&TorchStats) -> Option<u64>,
);

/// The figures every bridge document carries (memory_stats()), in output
/// order.
const REPORTED: [Row; 8] = [
    (
        "gpu_process_torch_allocated_bytes",
        "Bytes in live tensors of this process on this GPU, from torch.cuda.memory_stats() (allocated_bytes.all.current), published by the process through the torch bridge.",
        MetricType::Gauge,
        |t| Some(t.allocated),
    ),
    (
        "gpu_process_torch_reserved_bytes",
        "Bytes the PyTorch caching allocator holds from CUDA on this GPU: allocated plus cached (reserved_bytes.all.current). gpu_process_memory_used_bytes minus this is the non-torch part (CUDA context, libraries).",
        MetricType::Gauge,
        |t| Some(t.reserved),
    ),
    (
        "gpu_process_torch_allocated_peak_bytes",
        "Peak of gpu_process_torch_allocated_bytes since the process started or reset its peaks (allocated_bytes.all.peak).",
        MetricType::Gauge,
        |t| Some(t.allocated_peak),
    ),
    (
        "gpu_process_torch_reserved_peak_bytes",
        "Peak of gpu_process_torch_reserved_bytes since the process started or reset its peaks (reserved_bytes.all.peak).",
        MetricType::Gauge,
        |t| Some(t.reserved_peak),
    ),
    (
        "gpu_process_torch_active_bytes",
        "Bytes in active memory blocks of the PyTorch allocator, including blocks still used by pending streams (active_bytes.all.current).",
        MetricType::Gauge,
        |t| Some(t.active),
    ),
    (
        "gpu_process_torch_inactive_split_bytes",
        "Bytes in inactive, split blocks of the PyTorch allocator: cached memory that fragmentation keeps from being released (inactive_split_bytes.all.current).",
        MetricType::Gauge,
        |t| Some(t.inactive_split),
    ),
    (
        "gpu_process_torch_alloc_retries",
        "Allocations the PyTorch allocator retried after freeing its cache (num_alloc_retries); a rising count means memory pressure.",
        MetricType::Counter,
        |t| Some(t.alloc_retries),
    ),
    (
        "gpu_process_torch_ooms",
        "Out-of-memory errors the PyTorch allocator raised in this process (num_ooms).",
        MetricType::Counter,
        |t| Some(t.ooms),
    ),
];

/// One per-pool family: name, help, the pool's figure.
type PoolRow = (&'static str, &'static str, fn(&TorchPool) -> u64);

/// The per-pool figures (large and small pool).
const POOLS: [PoolRow; 4] = [
    (
        "gpu_process_torch_pool_allocated_bytes",
        "Bytes in live tensors per allocator pool (pool=\"large\": blocks over 1 MiB, \"small\": the rest), from allocated_bytes.<pool>_pool.current. The two pools sum to gpu_process_torch_allocated_bytes.",
        |p| p.allocated,
    ),
    (
        "gpu_process_torch_pool_reserved_bytes",
        "Bytes the PyTorch caching allocator holds from CUDA per pool (reserved_bytes.<pool>_pool.current); reserved minus allocated of a pool is its cache.",
        |p| p.reserved,
    ),
    (
        "gpu_process_torch_pool_inactive_split_bytes",
        "Bytes in inactive, split blocks per pool (inactive_split_bytes.<pool>_pool.current): the pool's fragmentation.",
        |p| p.inactive_split,
    ),
    (
        "gpu_process_torch_pool_segments",
        "Segments (cudaMalloc allocations) the allocator holds per pool (segment.<pool>_pool.current); many segments with inactive split bytes is fragmentation.",
        |p| p.segments,
    ),
];

/// The optional figures: the memory fraction's limit, OOM snapshots.
const OPTIONAL: [Row; 2] = [
    (
        "gpu_process_torch_memory_limit_bytes",
        "Bytes the PyTorch allocator may reserve on this GPU: torch.cuda.set_per_process_memory_fraction() times the GPU's memory. Present only while a fraction below 1 is set (torch >= 2.6 tells it).",
        MetricType::Gauge,
        |t| t.limit,
    ),
    (
        "gpu_process_torch_oom_snapshots",
        "Allocator snapshots (torch.cuda.memory._snapshot() pickles, for memory_viz) the torch bridge wrote for out-of-memory errors on this GPU. Present only when the process set GPUMEM_BRIDGE_OOM_SNAPSHOT_DIR.",
        MetricType::Counter,
        |t| t.oom_snapshots,
    ),
];

/// The step hook's figures (the growth slope, derived, is written apart).
const STEPS: [Row; 2] = [
    (
        "gpu_process_torch_steps",
        "Training steps this process has taken, counted by the torch bridge's global optimizer step post-hook (every optimizer.step() of every optimizer) and gpumem_bridge.step() calls. Present once the process has the hook or called step().",
        MetricType::Counter,
        |t| t.steps.map(|st| st.total),
    ),
    (
        "gpu_process_torch_step_allocated_bytes",
        "torch.cuda.memory_allocated() of this GPU at the end of the last recorded step (read by the step hook, no device synchronisation).",
        MetricType::Gauge,
        |t| t.steps.and_then(|st| st.allocated),
    ),
];

/// The in-process warning threshold and its crossings.
const THRESHOLD: [Row; 2] = [
    (
        "gpu_process_torch_threshold_bytes",
        "The in-process warning threshold on the allocator's reserved bytes (GPUMEM_BRIDGE_WARN_AT, resolved to bytes for this GPU). Present only while it is set and valid.",
        MetricType::Gauge,
        |t| t.threshold.map(|th| th.bytes),
    ),
    (
        "gpu_process_torch_threshold_crossings",
        "Upward crossings of gpu_process_torch_threshold_bytes by the allocator's reserved bytes (each one warning and one on_threshold callback in the process; re-armed below 95% of the threshold).",
        MetricType::Counter,
        |t| t.threshold.map(|th| th.crossings),
    ),
];

/// PyTorch allocator figures a process published (torch bridge), with the
/// labels of `gpu_process_memory_used_bytes`. Only processes that publish
/// have series; there is no `pid="other"` rollup (torch figures of the
/// processes left out are not read at all). The optional figures (pools,
/// limit, settings, OOM snapshots) have series only where the bridge sent
/// them.
pub(super) fn families(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    rows(enc, s, &REPORTED)?;
    pool_families(enc, s)?;
    rows(enc, s, &OPTIONAL)?;
    rows(enc, s, &STEPS)?;
    step_growth(enc, s)?;
    rows(enc, s, &THRESHOLD)?;
    allocator_info(enc, s)
}

/// A table's families, in its order.
fn rows(enc: &mut DescriptorEncoder, s: &Snapshot, rows: &[Row]) -> fmt::Result {
    for &(name, help, kind, pick) in rows {
        simple(enc, s, name, help, kind, pick)?;
    }
    Ok(())
}

/// The per-pool families: a series per process and pool (`pool` label),
/// for the processes whose bridge sent pool figures.
fn pool_families(enc: &mut DescriptorEncoder, s: &Snapshot) -> fmt::Result {
    for (name, help, pick) in POOLS {
        let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
        each_process(s, |labels, t| {
            let Some(p) = &t.pools else { return Ok(()) };
            for (pool, figures) in [("large", &p.large), ("small", &p.small)] {
                let mut l = labels.to_vec();
                l.push(("pool", pool));
                m.encode_family(&l)?.encode_gauge(&pick(figures))?;
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// The leak signal: a least-squares slope over the last steps, a float
/// and only once there are enough steps, so not a [`Row`].
fn step_growth(enc: &mut DescriptorEncoder, s: &Snapshot) -> fmt::Result {
    let mut m = enc.encode_descriptor(
        "gpu_process_torch_step_allocated_growth_bytes",
        "Least-squares slope of allocated-at-step-end over step number across the last <= 64 steps, in bytes per step: steady growth across steps is a leak (memory kept from step to step); a sawtooth within a step is not, since every figure is taken at a step end. Absent with fewer than 16 steps.",
        None,
        MetricType::Gauge,
    )?;
    each_process(s, |labels, t| {
        match t.steps.and_then(|st| st.growth_bytes()) {
            Some(g) => m.encode_family(&labels)?.encode_gauge(&g),
            None => Ok(()),
        }
    })
}

/// The allocator settings as labels of an info series: text, not a figure.
fn allocator_info(enc: &mut DescriptorEncoder, s: &Snapshot) -> fmt::Result {
    let mut m = enc.encode_descriptor(
        "gpu_process_torch_allocator_info",
        "PyTorch caching-allocator settings of this process, parsed by the torch bridge from PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF: backend, expandable_segments, max_split_size_bytes (\"unlimited\" unless max_split_size_mb is set). Value is always 1; absent when the setting is malformed.",
        None,
        MetricType::Gauge,
    )?;
    each_process(s, |labels, t| {
        let Some(a) = &t.allocator else {
            return Ok(());
        };
        let split = a
            .max_split_size
            .map_or_else(|| "unlimited".to_string(), |b| b.to_string());
        let mut l = labels.to_vec();
        l.push(("backend", a.backend.as_str()));
        l.push((
            "expandable_segments",
            if a.expandable_segments {
                "true"
            } else {
                "false"
            },
        ));
        l.push(("max_split_size_bytes", &split));
        m.encode_family(&l)?.encode_gauge(&1u64)?;
        Ok(())
    })
}

/// One family with a series per process for which `pick` gives a figure.
fn simple(
    enc: &mut DescriptorEncoder,
    s: &Snapshot,
    name: &str,
    help: &str,
    kind: MetricType,
    pick: fn(&TorchStats) -> Option<u64>,
) -> fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, kind)?;
    each_process(s, |labels, t| {
        let Some(v) = pick(t) else { return Ok(()) };
        match kind {
            MetricType::Counter => m
                .encode_family(&labels)?
                .encode_counter::<NoLabelSet, _, u64>(&v, None),
            _ => m.encode_family(&labels)?.encode_gauge(&v),
        }
    })
}
