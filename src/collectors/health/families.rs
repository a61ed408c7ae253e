//! The `health` collector's families: ECC errors, row remapping (Ampere
//! and later), page retirement (older GPUs) and critical Xid events.

use std::fmt;

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

use super::{EccCounter, Health, RemappedRows};
use crate::encoding::{Labels, gauge, gpu_labels};
use crate::model::{DeviceSample, Snapshot};

fn health(d: &DeviceSample) -> Option<&Health> {
    d.readings.get::<Health>()
}

fn any(s: &Snapshot, has: impl Fn(&Health) -> bool) -> bool {
    s.devices.iter().any(|d| health(d).is_some_and(&has))
}

/// Every family of this collector; each is absent when no GPU has it.
pub(crate) fn encode(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    ecc(enc, s)?;
    row_remapping(enc, s)?;
    retired_pages(enc, s)?;
    xid_errors(enc, s)
}

/// `gpu_memory_ecc_enabled` and `gpu_memory_ecc_errors`.
fn ecc(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    if any(s, |h| h.ecc_enabled.is_some()) {
        let mut m = gauge(
            enc,
            "gpu_memory_ecc_enabled",
            "1 when ECC is on for the GPU's memory, else 0.",
        )?;
        for d in &s.devices {
            if let Some(on) = health(d).and_then(|h| h.ecc_enabled) {
                m.encode_family(&gpu_labels(d))?
                    .encode_gauge(&u32::from(on))?;
            }
        }
    }
    if any(s, |h| h.ecc_errors.iter().any(Option::is_some)) {
        let mut m = enc.encode_descriptor(
            "gpu_memory_ecc_errors",
            "ECC errors of device memory: type corrected or uncorrected; scope volatile (since the driver loaded) or aggregate (lifetime).",
            None,
            MetricType::Counter,
        )?;
        for d in &s.devices {
            let Some(h) = health(d) else { continue };
            for c in EccCounter::ALL {
                if let Some(n) = h.ecc_errors[c as usize] {
                    let Labels([g, u]) = gpu_labels(d);
                    let (kind, scope) = (c.error_type(), c.scope());
                    m.encode_family(&Labels([g, u, ("type", kind), ("scope", scope)]))?
                        .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
                }
            }
        }
    }
    Ok(())
}

/// Row remapping (Ampere and later): the rows and the pending / failed
/// flags.
fn row_remapping(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    if !any(s, |h| h.remapped_rows.is_some()) {
        return Ok(());
    }
    // `m` writes `enc` until the block ends; the flags below write it next.
    {
        let mut m = gauge(
            enc,
            "gpu_memory_remapped_rows",
            "Memory rows remapped, by the cause: correctable or uncorrectable ECC errors.",
        )?;
        for d in &s.devices {
            if let Some(r) = health(d).and_then(|h| h.remapped_rows) {
                for (cause, n) in [
                    ("correctable", r.correctable),
                    ("uncorrectable", r.uncorrectable),
                ] {
                    let Labels([g, u]) = gpu_labels(d);
                    m.encode_family(&Labels([g, u, ("cause", cause)]))?
                        .encode_gauge(&n)?;
                }
            }
        }
        type Flag = fn(&RemappedRows) -> bool;
        let flags: [(&str, &str, Flag); 2] = [
            (
                "gpu_memory_row_remap_pending",
                "1 when a row remap is pending: the GPU needs a reset to apply it.",
                |r| r.pending,
            ),
            (
                "gpu_memory_row_remap_failed",
                "1 when a row remap failed: the GPU should be taken out of service.",
                |r| r.failed,
            ),
        ];
        for (name, help, flag) in flags {
            let mut m = gauge(enc, name, help)?;
            for d in &s.devices {
                if let Some(r) = health(d).and_then(|h| h.remapped_rows) {
                    m.encode_family(&gpu_labels(d))?
                        .encode_gauge(&u32::from(flag(&r)))?;
                }
            }
        }
    }
    Ok(())
}

/// Page retirement (GPUs before Ampere): the pages and the pending flag.
fn retired_pages(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    if any(s, |h| {
        h.retired_pages
            .is_some_and(|p| p.single_bit_ecc.is_some() || p.double_bit_ecc.is_some())
    }) {
        let mut m = gauge(
            enc,
            "gpu_memory_retired_pages",
            "Memory pages retired, by the cause: multiple single-bit or a double-bit ECC error (GPUs before Ampere).",
        )?;
        for d in &s.devices {
            if let Some(p) = health(d).and_then(|h| h.retired_pages) {
                for (cause, n) in [
                    ("single_bit_ecc", p.single_bit_ecc),
                    ("double_bit_ecc", p.double_bit_ecc),
                ] {
                    if let Some(n) = n {
                        let Labels([g, u]) = gpu_labels(d);
                        m.encode_family(&Labels([g, u, ("cause", cause)]))?
                            .encode_gauge(&n)?;
                    }
                }
            }
        }
    }
    if any(s, |h| h.retired_pages.is_some_and(|p| p.pending.is_some())) {
        let mut m = gauge(
            enc,
            "gpu_memory_retired_pages_pending",
            "1 when a page retirement waits for a reboot or GPU reset, else 0.",
        )?;
        for d in &s.devices {
            if let Some(p) = health(d)
                .and_then(|h| h.retired_pages)
                .and_then(|p| p.pending)
            {
                m.encode_family(&gpu_labels(d))?
                    .encode_gauge(&u32::from(p))?;
            }
        }
    }
    Ok(())
}

/// `gpu_xid_errors`: critical Xid events by Xid.
fn xid_errors(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    if any(s, |h| h.xid_errors.is_some()) {
        let mut m = enc.encode_descriptor(
            "gpu_xid_errors",
            "Critical Xid events the driver reported for this GPU since the exporter started watching it, by Xid.",
            None,
            MetricType::Counter,
        )?;
        for d in &s.devices {
            let Some(xids) = health(d).and_then(|h| h.xid_errors.as_ref()) else {
                continue;
            };
            for (xid, n) in xids.iter() {
                let xid = xid.to_string();
                let Labels([g, u]) = gpu_labels(d);
                m.encode_family(&Labels([g, u, ("xid", xid.as_str())]))?
                    .encode_counter::<NoLabelSet, _, u64>(n, None)?;
            }
        }
    }
    Ok(())
}
