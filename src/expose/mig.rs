//! MIG families: `gpu_mig_info` and the memory of each instance.

use std::fmt;

use prometheus_client::encoding::DescriptorEncoder;

use crate::encoding::{Labels, gauge};
use crate::model::{MemoryInfo, Snapshot};

/// `gpu_mig_info` and `gpu_mig_memory_*_bytes`.
pub(super) fn families(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    let mut m = gauge(
        enc,
        "gpu_mig_info",
        "Identity of a MIG instance; value is always 1. gpu and uuid name the parent GPU.",
    )?;
    for d in &s.devices {
        for g in d.mig.iter() {
            let gi = g.info.gpu_instance_id.to_string();
            let ci = g.info.compute_instance_id.to_string();
            let labels = Labels([
                ("gpu", d.info.gpu.as_str()),
                ("uuid", d.info.uuid.as_str()),
                ("mig_uuid", g.info.mig_uuid.as_str()),
                ("name", g.info.name.as_str()),
                ("gpu_instance_id", gi.as_str()),
                ("compute_instance_id", ci.as_str()),
            ]);
            m.encode_family(&labels)?.encode_gauge(&1u32)?;
        }
    }
    type MigPick = fn(&MemoryInfo) -> Option<u64>;
    let mig_memory: [(&str, &str, MigPick); 4] = [
        (
            "gpu_mig_memory_total_bytes",
            "Memory of one MIG instance (its own memory_info), in bytes.",
            |m| Some(m.total),
        ),
        (
            "gpu_mig_memory_used_bytes",
            "Memory used in one MIG instance, in bytes.",
            |m| Some(m.used),
        ),
        (
            "gpu_mig_memory_free_bytes",
            "Free memory of one MIG instance, in bytes.",
            |m| Some(m.free),
        ),
        (
            "gpu_mig_memory_reserved_bytes",
            "Reserved memory of one MIG instance, in bytes.",
            |m| m.reserved,
        ),
    ];
    for (name, help, pick) in mig_memory {
        let mut m = gauge(enc, name, help)?;
        for d in &s.devices {
            for g in d.mig.iter() {
                if let Some(v) = g.memory.as_ref().and_then(pick) {
                    let gi = g.info.gpu_instance_id.to_string();
                    let ci = g.info.compute_instance_id.to_string();
                    let labels = Labels([
                        ("gpu", d.info.gpu.as_str()),
                        ("uuid", d.info.uuid.as_str()),
                        ("gpu_instance_id", gi.as_str()),
                        ("compute_instance_id", ci.as_str()),
                    ]);
                    m.encode_family(&labels)?.encode_gauge(&v)?;
                }
            }
        }
    }
    Ok(())
}
