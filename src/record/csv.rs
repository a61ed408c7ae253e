//! The CSV format: one row per GPU per sample (memory and full samples),
//! one row per process per GPU per full sample, and one per MIG instance
//! per full sample. Columns (docs/record.md has the table):
//!
//! ```text
//! time,unix_seconds,kind,gpu,uuid,used_bytes,reserved_bytes,free_bytes,total_bytes,pid,process,user,namespace,pod,torch_allocated_bytes,torch_reserved_bytes,container,resource
//! ```
//!
//! `kind` is `gpu`, `process`, `mig` or `allocation`. Allocation rows (the
//! kubelet's pod-resources answer, when that client is on) are written at
//! the first full sample and at every full sample where the set changed:
//! the whole new set, one row per allocated device (`gpu` and `uuid` of
//! the GPU, or the MIG device's UUID; `namespace`, `pod`, `container`,
//! `resource`), or a single `allocation` row with those columns empty when
//! nothing is allocated any more. A column that does not apply to a
//! row's kind is empty, and so is a figure NVML did not give (a GPU that
//! did not answer has a `gpu` row with empty byte columns). Quoting is the
//! `csv` crate's (RFC 4180), since process and user names may hold commas
//! or quotes.

use std::sync::Arc;

use super::format::{EncodeError, Encoder, SampleKind, Stamp};
use crate::expose;
use crate::model::{Allocation, MemoryInfo, Snapshot};

/// The header row, column by column.
pub(crate) const COLUMNS: [&str; 18] = [
    "time",
    "unix_seconds",
    "kind",
    "gpu",
    "uuid",
    "used_bytes",
    "reserved_bytes",
    "free_bytes",
    "total_bytes",
    "pid",
    "process",
    "user",
    "namespace",
    "pod",
    "torch_allocated_bytes",
    "torch_reserved_bytes",
    "container",
    "resource",
];

pub(crate) struct Csv {
    builder: ::csv::WriterBuilder,
    /// The allocations written last; `None` before the first.
    allocations: Option<Arc<[Allocation]>>,
}

impl Default for Csv {
    fn default() -> Csv {
        let mut builder = ::csv::WriterBuilder::new();
        builder.terminator(::csv::Terminator::Any(b'\n'));
        Csv {
            builder,
            allocations: None,
        }
    }
}

type Rows<'a> = ::csv::Writer<&'a mut Vec<u8>>;

fn row(w: &mut Rows, fields: [&str; 18]) -> Result<(), EncodeError> {
    w.write_record(fields).map_err(EncodeError::from)
}

fn done(mut w: Rows) -> Result<(), EncodeError> {
    w.flush().map_err(EncodeError::from)
}

fn opt(v: Option<u64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

/// A `gpu` or `mig` row: who, then used / reserved / free / total bytes
/// (empty when the device did not answer); the process columns empty.
fn memory_row(
    w: &mut Rows,
    (time, unix): (&str, &str),
    kind: &str,
    gpu: &str,
    uuid: &str,
    m: Option<MemoryInfo>,
) -> Result<(), EncodeError> {
    row(
        w,
        [
            time,
            unix,
            kind,
            gpu,
            uuid,
            &opt(m.map(|m| m.used)),
            &opt(m.map(|m| m.reserved)),
            &opt(m.map(|m| m.free)),
            &opt(m.map(|m| m.total)),
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
        ],
    )
}

impl Csv {
    /// The allocation rows of a full sample, when the set changed.
    fn allocations(
        &mut self,
        w: &mut Rows,
        (time, unix): (&str, &str),
        s: &Snapshot,
    ) -> Result<u64, EncodeError> {
        let Some(p) = &s.pod_resources else {
            return Ok(0);
        };
        if self.allocations.as_deref() == Some(&*p.allocations) {
            return Ok(0);
        }
        self.allocations = Some(Arc::clone(&p.allocations));
        let placed = expose::placed(s);
        if placed.is_empty() {
            let mut fields = [""; 18];
            (fields[0], fields[1], fields[2]) = (time, unix, "allocation");
            row(w, fields)?;
            return Ok(1);
        }
        for a in &placed {
            let al = a.allocation;
            row(
                w,
                [
                    time,
                    unix,
                    "allocation",
                    a.gpu,
                    a.mig_uuid.unwrap_or(a.uuid),
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                    &al.namespace,
                    &al.pod,
                    "",
                    "",
                    &al.container,
                    &al.resource,
                ],
            )?;
        }
        Ok(placed.len() as u64)
    }
}

impl Encoder for Csv {
    fn header(&mut self) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::new();
        let mut w = self.builder.from_writer(&mut out);
        row(&mut w, COLUMNS)?;
        done(w)?;
        Ok(out)
    }

    fn trailer(&self) -> &'static [u8] {
        b""
    }

    fn sample(
        &mut self,
        s: &Arc<Snapshot>,
        kind: SampleKind,
        at: &Stamp,
        out: &mut Vec<u8>,
    ) -> Result<u64, EncodeError> {
        let mut rows = 0;
        let mut w = self.builder.from_writer(out);
        let (time, unix) = (at.rfc3339.as_str(), at.unix_seconds.as_str());
        for d in &s.devices {
            memory_row(
                &mut w,
                (time, unix),
                "gpu",
                &d.info.gpu,
                &d.info.uuid,
                d.memory,
            )?;
            rows += 1;
        }
        if kind == SampleKind::Full {
            for d in s.devices.iter().filter(|d| d.up()) {
                for p in d.processes.iter() {
                    let i = &p.ident;
                    let torch = p.torch;
                    row(
                        &mut w,
                        [
                            time,
                            unix,
                            "process",
                            &d.info.gpu,
                            &d.info.uuid,
                            &opt(p.used_bytes),
                            "",
                            "",
                            "",
                            &p.pid.to_string(),
                            &i.comm,
                            &i.user,
                            &i.namespace,
                            &i.pod,
                            &opt(torch.map(|t| t.allocated)),
                            &opt(torch.map(|t| t.reserved)),
                            "",
                            "",
                        ],
                    )?;
                    rows += 1;
                }
                if let Some(o) = d.other {
                    row(
                        &mut w,
                        [
                            time,
                            unix,
                            "process",
                            &d.info.gpu,
                            &d.info.uuid,
                            &o.used_bytes.to_string(),
                            "",
                            "",
                            "",
                            "other",
                            "",
                            "",
                            "",
                            "",
                            "",
                            "",
                            "",
                            "",
                        ],
                    )?;
                    rows += 1;
                }
                for mig in d.mig.iter() {
                    memory_row(
                        &mut w,
                        (time, unix),
                        "mig",
                        &d.info.gpu,
                        &mig.info.mig_uuid,
                        mig.memory,
                    )?;
                    rows += 1;
                }
            }
            rows += self.allocations(&mut w, (time, unix), s)?;
        }
        done(w)?;
        Ok(rows)
    }
}
