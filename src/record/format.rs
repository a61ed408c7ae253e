//! The three output formats: which one a target gets, how a sample's
//! time and kind (memory-only or full) are told, and the [`Encoder`] each
//! format implements (`csv.rs`, `trace.rs`, `openmetrics.rs`), and how
//! that can fail.

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::output::Target;
use crate::model::Snapshot;

/// A sample could not be turned into text (a bug, never the input); the
/// serialiser's error is kept as the source.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    #[error("cannot encode a sample as CSV: {0}")]
    Csv(#[from] ::csv::Error),
    #[error("cannot encode a sample as JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("cannot encode a sample as OpenMetrics: {0}")]
    Text(#[from] std::fmt::Error),
    #[error("cannot encode a sample: {0}")]
    Io(#[from] std::io::Error),
}

/// The three output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Csv,
    Trace,
    OpenMetrics,
}

impl FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Format, String> {
        match s {
            "csv" => Ok(Format::Csv),
            "trace" => Ok(Format::Trace),
            "openmetrics" => Ok(Format::OpenMetrics),
            _ => Err(format!(
                "unknown format {s:?} (use csv, trace or openmetrics)"
            )),
        }
    }
}

impl Format {
    /// The format asked for, else the one the file name says (`.csv`;
    /// `.json`, `.trace.json`; `.om`); standard output and an existing
    /// device or FIFO (`/dev/stderr`) default to CSV.
    pub fn for_target(target: &Target, asked: Option<Format>) -> Result<Format, String> {
        if let Some(f) = asked {
            return Ok(f);
        }
        let path = match target {
            Target::Stdout => return Ok(Format::Csv),
            Target::Path(p) => p,
        };
        if std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir()) {
            return Ok(Format::Csv);
        }
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("csv") => Ok(Format::Csv),
            Some("json") => Ok(Format::Trace),
            Some("om") => Ok(Format::OpenMetrics),
            _ => Err(format!(
                "cannot tell the format of {} from its name (.csv, .json, .trace.json or .om); pass --format csv|trace|openmetrics",
                path.display()
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::Csv => "csv",
            Format::Trace => "trace",
            Format::OpenMetrics => "openmetrics",
        }
    }
}

/// Whether a snapshot comes from a memory-only or a full sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SampleKind {
    /// GPU memory only; processes are those of the last full sample.
    Memory,
    /// Memory, processes, MIG instances (or every GPU down while NVML is
    /// re-opened).
    Full,
}

/// Tells memory from full samples by the sampler's own counters: a full
/// tick adds to the sample duration histogram, a memory tick to
/// `memory_samples`; a snapshot that adds to neither (published while NVML
/// is closed) is treated as full.
#[derive(Debug, Default)]
pub(crate) struct Classifier {
    full: u64,
    memory: u64,
}

impl Classifier {
    pub(crate) fn next(&mut self, s: &Snapshot) -> SampleKind {
        let full = s.sample_duration.count;
        let kind = if s.memory_samples != self.memory && full == self.full {
            SampleKind::Memory
        } else {
            SampleKind::Full
        };
        self.full = full;
        self.memory = s.memory_samples;
        kind
    }
}

/// A sample's time in the forms the formats write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub unix_ms: u64,
    pub unix_micros: u64,
    /// `1767225600.123`
    pub unix_seconds: String,
    /// `2026-01-01T00:00:00.123Z`
    pub rfc3339: String,
}

impl Stamp {
    pub(crate) fn new(t: SystemTime) -> Stamp {
        let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
        let unix_ms = d.as_millis() as u64;
        Stamp {
            unix_ms,
            unix_micros: d.as_micros() as u64,
            unix_seconds: format!("{}.{:03}", unix_ms / 1000, unix_ms % 1000),
            rfc3339: humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(unix_ms))
                .to_string(),
        }
    }
}

/// One output format.
pub(crate) trait Encoder: Send {
    /// Written once, when the output is opened.
    fn header(&mut self) -> Result<Vec<u8>, EncodeError>;
    /// What closes the document, kept after the last sample.
    fn trailer(&self) -> &'static [u8];
    /// Append one sample's rows to `out`; returns how many rows (lines,
    /// events) it wrote.
    fn sample(
        &mut self,
        s: &Arc<Snapshot>,
        kind: SampleKind,
        at: &Stamp,
        out: &mut Vec<u8>,
    ) -> Result<u64, EncodeError>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn formats_come_from_the_name_unless_asked() {
        let t = |p: &str| Target::Path(PathBuf::from(p));
        assert_eq!(Format::for_target(&t("a.csv"), None), Ok(Format::Csv));
        assert_eq!(
            Format::for_target(&t("a.trace.json"), None),
            Ok(Format::Trace)
        );
        assert_eq!(Format::for_target(&t("a.JSON"), None), Ok(Format::Trace));
        assert_eq!(
            Format::for_target(&t("a.om"), None),
            Ok(Format::OpenMetrics)
        );
        assert_eq!(Format::for_target(&Target::Stdout, None), Ok(Format::Csv));
        assert!(
            Format::for_target(&t("a.txt"), None)
                .unwrap_err()
                .contains("--format")
        );
        assert!(Format::for_target(&t("a"), None).is_err());
        assert_eq!(
            Format::for_target(&t("a.txt"), Some(Format::OpenMetrics)),
            Ok(Format::OpenMetrics)
        );
        assert_eq!("trace".parse::<Format>(), Ok(Format::Trace));
        assert!(
            "xml"
                .parse::<Format>()
                .unwrap_err()
                .contains("csv, trace or openmetrics")
        );
    }

    #[test]
    fn stamps_have_milliseconds_in_both_forms() {
        let t = UNIX_EPOCH + Duration::from_micros(1_767_225_600_123_456);
        let s = Stamp::new(t);
        assert_eq!(s.unix_seconds, "1767225600.123");
        assert_eq!(s.rfc3339, "2026-01-01T00:00:00.123Z");
        assert_eq!(s.unix_micros, 1_767_225_600_123_456);
        let s = Stamp::new(UNIX_EPOCH + Duration::from_millis(5));
        assert_eq!(s.unix_seconds, "0.005");
    }
}
