//! Snapshot → exposition text (Prometheus text 0.0.4 or OpenMetrics 1.0).
//! Every metric name the exporter serves is defined in this folder, one
//! file per family group, in the order a scrape shows them: `gpu`
//! (with `forecast`, the time-to-full families, absent unless growing),
//! `process`, `torch`, `mig`, `allocation` (the kubelet's device
//! allocations), then each switchable collector's families in registry
//! order (they live in `collectors/<name>/families.rs`; `segments.rs`
//! calls the registry rows' encode steps), then the exporter's own
//! families (`exporter`) last. The collectors' families are left out
//! entirely when no GPU has their figures (collector off, or not
//! supported). Encoding
//! reads only the [`Snapshot`]: no NVML, no /proc, no HTTP state. No series
//! carries a label with an empty value: every label set goes through
//! `encoder::Labels`, which leaves those out (for Prometheus they are the
//! same series). The golden files in `tests/fixtures/` are the whole output
//! for one fixed snapshot.
//! [`json`] is the same snapshot as JSON for `/api/v1/snapshot` (and the
//! memory history for `/api/v1/history`), the page's and scripts' view.

mod accounting;
mod allocation;
mod budget;
mod exporter;
mod forecast;
mod format;
mod gpu;
pub(crate) mod json;
mod limits;
mod mig;
mod process;
mod segments;
mod stale;
mod torch;

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::registry::Registry;

use crate::collectors::REGISTRY;
use crate::model::Snapshot;

pub(crate) use allocation::placed;
pub use exporter::{REVISION, VERSION};
pub(crate) use segments::encode_into;
pub use segments::{Reuse, encode_reusing};
pub(crate) use stale::stale_bytes;

pub use format::Format;

/// Encode one snapshot in the given format (segment by segment, as
/// [`encode_reusing`] does, with nothing to reuse).
pub fn encode(snapshot: &Arc<Snapshot>, format: Format) -> Result<String, fmt::Error> {
    encode_reusing(snapshot, format, &Reuse::new())
}

/// The series `text` holds, counted as the series budget counts them
/// (the tick bench times it).
pub fn count_series(text: &str) -> u64 {
    let mut counts = budget::Counts::new();
    budget::count(text, &mut counts);
    budget::total(&counts)
}

/// Which families [`encode_families`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Families {
    /// Everything but the exporter's own families (`gpumem_exporter_*`):
    /// what the GPUs and their processes did. The recorder writes these at
    /// each full sample.
    Gpus,
    /// Only `gpu_info`, `gpu_up` and `gpu_memory_*_bytes`: all that a
    /// memory-only sample changes. The recorder writes these in between.
    Devices,
}

/// Encode some of one snapshot's families (see [`Families`]), in the
/// order and with the names a scrape has.
pub(crate) fn encode_families(
    snapshot: &Arc<Snapshot>,
    format: Format,
    families: Families,
) -> Result<String, fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(FamiliesCollector(Arc::clone(snapshot), families)));
    let mut out = String::with_capacity(4096);
    match format {
        Format::Text => prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)?,
        Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut out, &registry)?,
    }
    Ok(out)
}

#[derive(Debug)]
struct FamiliesCollector(Arc<Snapshot>, Families);

impl Collector for FamiliesCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), fmt::Error> {
        match self.1 {
            Families::Gpus => gpu_families(&mut enc, &self.0),
            Families::Devices => gpu::devices(&mut enc, &self.0),
        }
    }
}

/// Every family but the exporter's own, in scrape order.
fn gpu_families(enc: &mut DescriptorEncoder, s: &Snapshot) -> Result<(), fmt::Error> {
    for g in segments::Group::ALL {
        if g != segments::Group::Exporter {
            segments::encode_group(enc, s, s, g, REGISTRY)?;
        }
    }
    Ok(())
}
