//! PyTorch allocator families (`gpu_process_torch_*`), from the torch
//! bridge, with the labels of `gpu_process_memory_used_bytes`.

use std::fmt;

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use super::encoder::Ids;
use super::process::process_labels;
use crate::model::{Snapshot, TorchStats};

/// PyTorch allocator figures a process published (torch bridge), with the
/// labels of `gpu_process_memory_used_bytes`. Only processes that publish
/// have series; there is no `pid="other"` rollup (torch figures of the
/// processes left out are not read at all).
pub(super) fn families(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    type Pick = fn(&TorchStats) -> u64;
    let families: [(&str, &str, MetricType, Pick); 8] = [
        (
            "gpu_process_torch_allocated_bytes",
            "Bytes in live tensors of this process on this GPU, from torch.cuda.memory_stats() (allocated_bytes.all.current), published by the process through the torch bridge.",
            MetricType::Gauge,
            |t| t.allocated,
        ),
        (
            "gpu_process_torch_reserved_bytes",
            "Bytes the PyTorch caching allocator holds from CUDA on this GPU: allocated plus cached (reserved_bytes.all.current). gpu_process_memory_used_bytes minus this is the non-torch part (CUDA context, libraries).",
            MetricType::Gauge,
            |t| t.reserved,
        ),
        (
            "gpu_process_torch_allocated_peak_bytes",
            "Peak of gpu_process_torch_allocated_bytes since the process started or reset its peaks (allocated_bytes.all.peak).",
            MetricType::Gauge,
            |t| t.allocated_peak,
        ),
        (
            "gpu_process_torch_reserved_peak_bytes",
            "Peak of gpu_process_torch_reserved_bytes since the process started or reset its peaks (reserved_bytes.all.peak).",
            MetricType::Gauge,
            |t| t.reserved_peak,
        ),
        (
            "gpu_process_torch_active_bytes",
            "Bytes in active memory blocks of the PyTorch allocator, including blocks still used by pending streams (active_bytes.all.current).",
            MetricType::Gauge,
            |t| t.active,
        ),
        (
            "gpu_process_torch_inactive_split_bytes",
            "Bytes in inactive, split blocks of the PyTorch allocator: cached memory that fragmentation keeps from being released (inactive_split_bytes.all.current).",
            MetricType::Gauge,
            |t| t.inactive_split,
        ),
        (
            "gpu_process_torch_alloc_retries",
            "Allocations the PyTorch allocator retried after freeing its cache (num_alloc_retries); a rising count means memory pressure.",
            MetricType::Counter,
            |t| t.alloc_retries,
        ),
        (
            "gpu_process_torch_ooms",
            "Out-of-memory errors the PyTorch allocator raised in this process (num_ooms).",
            MetricType::Counter,
            |t| t.ooms,
        ),
    ];
    let mut ids = Ids::default();
    for (name, help, kind, pick) in families {
        let mut m = enc.encode_descriptor(name, help, None, kind)?;
        for d in &s.devices {
            for p in d.processes.iter() {
                let Some(t) = &p.torch else { continue };
                let (pid, gi, ci) = ids.all(p);
                let labels = process_labels(d, p, pid, gi, ci);
                let v = pick(t);
                match kind {
                    MetricType::Counter => m
                        .encode_family(&labels)?
                        .encode_counter::<NoLabelSet, _, u64>(&v, None)?,
                    _ => m.encode_family(&labels)?.encode_gauge(&v)?,
                }
            }
        }
    }
    Ok(())
}
