//! The openmetrics format: what a scrape would have shown at each sample,
//! every sample line carrying that sample's timestamp, and one `# EOF` at
//! the end — the input of
//! `promtool tsdb create-blocks-from openmetrics FILE DATA_DIR`.
//!
//! The text comes from [`crate::expose`], so names, labels and types are
//! those of the daemon's `/metrics`: at a full sample every family but the
//! exporter's own (`gpumem_exporter_*` describe the recorder, not the
//! GPUs), at a memory sample only `gpu_info`, `gpu_up` and
//! `gpu_memory_*`. Each sample is one block with its own `# TYPE` lines;
//! `# HELP` (optional in OpenMetrics) is written the first time a family
//! appears only, which keeps a memory sample of one GPU under 1 KiB.
//!
//! So a family appears once per sample rather than once per file: strict
//! OpenMetrics wants each family (and each series) in one piece, which a
//! file written as it goes cannot do without holding the whole recording.
//! Prometheus' parser, and so promtool's backfill, reads the blocks one
//! after the other (the e2e test backfills a recording and queries it). A
//! sample whose millisecond timestamp is not after the previous one (the
//! wall clock stepped back) is left out, since a series' timestamps must
//! increase.

use std::collections::HashSet;
use std::sync::Arc;

use super::{EncodeError, Encoder, SampleKind, Stamp};
use crate::expose::{self, Families, Format};
use crate::model::Snapshot;

#[derive(Default)]
pub struct OpenMetrics {
    last_ms: Option<u64>,
    /// Families whose `# HELP` line is written already.
    helped: HashSet<String>,
    /// Samples left out because the clock did not move forward.
    pub skipped: u64,
}

impl Encoder for OpenMetrics {
    fn header(&mut self) -> Result<Vec<u8>, EncodeError> {
        Ok(Vec::new())
    }

    fn trailer(&self) -> &'static [u8] {
        b"# EOF\n"
    }

    fn sample(
        &mut self,
        s: &Arc<Snapshot>,
        kind: SampleKind,
        at: &Stamp,
        out: &mut Vec<u8>,
    ) -> Result<u64, EncodeError> {
        if self.last_ms.is_some_and(|l| at.unix_ms <= l) {
            self.skipped += 1;
            return Ok(0);
        }
        self.last_ms = Some(at.unix_ms);
        let families = match kind {
            SampleKind::Full => Families::Gpus,
            SampleKind::Memory => Families::Devices,
        };
        let text = expose::encode_families(s, Format::OpenMetrics, families)
            .map_err(|e| EncodeError(e.to_string()))?;
        let mut rows = 0;
        for line in text.lines() {
            if line == "# EOF" {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let family = rest.split(' ').next().unwrap_or_default();
                if self.helped.contains(family) {
                    continue;
                }
                self.helped.insert(family.to_string());
            }
            out.extend_from_slice(line.as_bytes());
            if !line.starts_with('#') {
                out.push(b' ');
                out.extend_from_slice(at.unix_seconds.as_bytes());
                rows += 1;
            }
            out.push(b'\n');
        }
        Ok(rows)
    }
}
