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
//! Every sample gets `instance="<hostname>"` and `job="gpumem-record"`
//! (what a scrape would add), so the shipped dashboard, whose `instance`
//! variable comes from `gpu_info`, lists the recording under its host, and
//! a backfill never collides with the series a live exporter on the same
//! host was scraped into (their `job` differs).
//!
//! So a family appears once per sample rather than once per file, which
//! Prometheus' parser, and so promtool's backfill, reads block after block
//! (the e2e test backfills a recording and queries it). Strict OpenMetrics
//! wants each family (and each series) in one piece, which a file written
//! as it goes cannot do without holding the whole recording: after a clean
//! stop [`super::regroup`] rewrites the file in that order. A
//! sample whose millisecond timestamp is not after the previous one (the
//! wall clock stepped back) is left out, since a series' timestamps must
//! increase.

use std::collections::HashSet;
use std::sync::Arc;

use super::format::{EncodeError, Encoder, SampleKind, Stamp};
use crate::expose::{self, Families, Format};
use crate::model::Snapshot;

/// The `job` label of recorded samples.
pub(crate) const JOB: &str = "gpumem-record";

pub(crate) struct OpenMetrics {
    /// `instance="…",job="gpumem-record"`, escaped.
    target_labels: String,
    last_ms: Option<u64>,
    /// Families whose `# HELP` line is written already.
    helped: HashSet<String>,
    /// Samples left out because the clock did not move forward.
    pub skipped: u64,
}

impl OpenMetrics {
    /// Samples labelled with `instance` (the host's name).
    pub(crate) fn new(instance: &str) -> OpenMetrics {
        OpenMetrics {
            target_labels: format!("instance=\"{}\",job=\"{JOB}\"", escape(instance)),
            last_ms: None,
            helped: HashSet::new(),
            skipped: 0,
        }
    }

    /// `name{a="b"} 1` → `name{instance="h",job="j",a="b"} 1`.
    fn push_sample(&self, out: &mut Vec<u8>, line: &str) {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let (name, rest) = line.split_at(name_end);
        out.extend_from_slice(name.as_bytes());
        out.push(b'{');
        out.extend_from_slice(self.target_labels.as_bytes());
        match rest.strip_prefix('{') {
            Some(labels) if labels.starts_with('}') => out.extend_from_slice(labels.as_bytes()),
            Some(labels) => {
                out.push(b',');
                out.extend_from_slice(labels.as_bytes());
            }
            None => {
                out.push(b'}');
                out.extend_from_slice(rest.as_bytes());
            }
        }
    }
}

/// A label value as OpenMetrics writes it.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
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
        let text =
            expose::encode_families(s, Format::OpenMetrics, families).map_err(EncodeError::from)?;
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
            if line.starts_with('#') {
                out.extend_from_slice(line.as_bytes());
            } else {
                self.push_sample(out, line);
                out.push(b' ');
                out.extend_from_slice(at.unix_seconds.as_bytes());
                rows += 1;
            }
            out.push(b'\n');
        }
        Ok(rows)
    }
}

/// The kernel's host name (the `instance` of OpenMetrics samples).
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".to_string())
}
