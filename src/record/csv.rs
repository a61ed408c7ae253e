//! The CSV format: one row per GPU per sample (memory and full samples),
//! one row per process per GPU per full sample, and one per MIG instance
//! per full sample. Columns (docs/record.md has the table):
//!
//! ```text
//! time,unix_seconds,kind,gpu,uuid,used_bytes,reserved_bytes,free_bytes,total_bytes,pid,process,user,namespace,pod,torch_allocated_bytes,torch_reserved_bytes,container,resource,torch_steps,torch_step_allocated_bytes,torch_step_growth_bytes,used_byte_seconds,busy_seconds,unattributed_bytes,stale_exited_bytes,stale_zombie_bytes,stale_uninterruptible_bytes,stale_reparented_bytes,stale_owner_deleted_bytes
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
//! or quotes. The `torch_step*` columns (steps taken, allocated at the
//! last step end, growth per step) are filled for torch processes whose
//! bridge records steps. `used_byte_seconds` and `busy_seconds` are the
//! ledger's counters (`gpu_memory_used_byte_seconds_total`,
//! `gpu_busy_seconds_total` on `gpu` rows, at every sample;
//! `gpu_process_memory_used_byte_seconds_total` on `process` rows).
//! `unattributed_bytes` and the five `stale_*_bytes` are the GPU's
//! `gpu_memory_unattributed_bytes` and `gpu_memory_stale_bytes{reason}`
//! as of the last full sample, on `gpu` rows where the processes were read.

use std::borrow::Cow;
use std::sync::Arc;

use super::format::{EncodeError, Encoder, SampleKind, Stamp};
use crate::accounting;
use crate::expose;
use crate::model::{Allocation, MemoryInfo, Snapshot, StaleReason, Unattributed};

/// The columns, in order: the header row is [`COLUMNS`] and a row is set
/// column by column, the others left empty.
#[derive(Debug, Clone, Copy)]
enum Col {
    Time,
    UnixSeconds,
    Kind,
    Gpu,
    Uuid,
    Used,
    Reserved,
    Free,
    Total,
    Pid,
    Process,
    User,
    Namespace,
    Pod,
    TorchAllocated,
    TorchReserved,
    Container,
    Resource,
    TorchSteps,
    TorchStepAllocated,
    TorchStepGrowth,
    UsedByteSeconds,
    BusySeconds,
    Unattributed,
    StaleExited,
    StaleZombie,
    StaleUninterruptible,
    StaleReparented,
    StaleOwnerDeleted,
}

/// The stale columns, in the order of [`StaleReason::ALL`].
const STALE: [Col; StaleReason::ALL.len()] = [
    Col::StaleExited,
    Col::StaleZombie,
    Col::StaleUninterruptible,
    Col::StaleReparented,
    Col::StaleOwnerDeleted,
];

/// The header row, column by column (the order of [`Col`]).
pub(crate) const COLUMNS: [&str; 29] = [
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
    "torch_steps",
    "torch_step_allocated_bytes",
    "torch_step_growth_bytes",
    "used_byte_seconds",
    "busy_seconds",
    "unattributed_bytes",
    "stale_exited_bytes",
    "stale_zombie_bytes",
    "stale_uninterruptible_bytes",
    "stale_reparented_bytes",
    "stale_owner_deleted_bytes",
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

/// One row being filled: every column empty until set.
struct Row<'a>([Cow<'a, str>; COLUMNS.len()]);

impl<'a> Row<'a> {
    /// A row of `kind` at `time` (RFC 3339) / `unix` (seconds).
    fn new((time, unix): (&'a str, &'a str), kind: &'a str) -> Self {
        Row(Default::default())
            .set(Col::Time, time)
            .set(Col::UnixSeconds, unix)
            .set(Col::Kind, kind)
    }

    fn set(mut self, c: Col, v: impl Into<Cow<'a, str>>) -> Self {
        self.0[c as usize] = v.into();
        self
    }

    /// A number, or empty when there is none.
    fn num(self, c: Col, v: Option<impl ToString>) -> Self {
        match v {
            Some(v) => self.set(c, v.to_string()),
            None => self,
        }
    }

    fn write(self, w: &mut Rows) -> Result<(), EncodeError> {
        w.write_record(self.0.iter().map(|f| f.as_bytes()))
            .map_err(EncodeError::from)
    }
}

fn done(mut w: Rows) -> Result<(), EncodeError> {
    w.flush().map_err(EncodeError::from)
}

/// A `gpu` or `mig` row: who, then used / reserved / free / total bytes
/// (empty when the device did not answer); the process columns empty.
fn memory_row<'a>(
    at: (&'a str, &'a str),
    kind: &'a str,
    gpu: &'a str,
    uuid: &'a str,
    m: Option<MemoryInfo>,
) -> Row<'a> {
    Row::new(at, kind)
        .set(Col::Gpu, gpu)
        .set(Col::Uuid, uuid)
        .num(Col::Used, m.map(|m| m.used))
        .num(Col::Reserved, m.and_then(|m| m.reserved))
        .num(Col::Free, m.map(|m| m.free))
        .num(Col::Total, m.map(|m| m.total))
}

impl Csv {
    /// The allocation rows of a full sample, when the set changed.
    fn allocations(
        &mut self,
        w: &mut Rows,
        at: (&str, &str),
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
            Row::new(at, "allocation").write(w)?;
            return Ok(1);
        }
        for a in &placed {
            let al = a.allocation;
            Row::new(at, "allocation")
                .set(Col::Gpu, a.gpu)
                .set(Col::Uuid, a.mig_uuid.unwrap_or(a.uuid))
                .set(Col::Namespace, al.namespace.as_str())
                .set(Col::Pod, al.pod.as_str())
                .set(Col::Container, al.container.as_str())
                .set(Col::Resource, al.resource.as_str())
                .write(w)?;
        }
        Ok(placed.len() as u64)
    }
}

impl Encoder for Csv {
    fn header(&mut self) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::new();
        let mut w = self.builder.from_writer(&mut out);
        w.write_record(COLUMNS).map_err(EncodeError::from)?;
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
        let at = (at.rfc3339.as_str(), at.unix_seconds.as_str());
        for d in &s.devices {
            let account = s.accounting.gpus.get(d.info.uuid.as_str());
            let mut row = memory_row(at, "gpu", &d.info.gpu, &d.info.uuid, d.memory)
                .num(Col::UsedByteSeconds, account.map(|a| a.used_byte_seconds))
                .num(Col::BusySeconds, account.and_then(|a| a.busy_seconds))
                .num(
                    Col::Unattributed,
                    d.readings.get::<Unattributed>().and_then(|u| u.bytes),
                );
            if let Some(stale) = expose::stale_bytes(d) {
                for (c, bytes) in STALE.into_iter().zip(stale) {
                    row = row.set(c, bytes.to_string());
                }
            }
            row.write(&mut w)?;
            rows += 1;
        }
        if kind == SampleKind::Full {
            for d in s.devices.iter().filter(|d| d.up()) {
                for p in d.processes.iter() {
                    let i = &p.ident;
                    let torch = p.torch.as_deref();
                    let steps = torch.and_then(|t| t.steps);
                    Row::new(at, "process")
                        .set(Col::Gpu, d.info.gpu.as_str())
                        .set(Col::Uuid, d.info.uuid.as_str())
                        .num(Col::Used, p.used_bytes)
                        .set(Col::Pid, p.pid.to_string())
                        .set(Col::Process, &*i.comm)
                        .set(Col::User, &*i.user)
                        .set(Col::Namespace, &*i.namespace)
                        .set(Col::Pod, &*i.pod)
                        .num(Col::TorchAllocated, torch.map(|t| t.allocated))
                        .num(Col::TorchReserved, torch.map(|t| t.reserved))
                        .num(Col::TorchSteps, steps.map(|st| st.total))
                        .num(Col::TorchStepAllocated, steps.and_then(|st| st.allocated))
                        .num(Col::TorchStepGrowth, steps.and_then(|st| st.growth_bytes()))
                        .num(
                            Col::UsedByteSeconds,
                            Some(accounting::process_byte_seconds(
                                &s.accounting,
                                &d.info.uuid,
                                p,
                            )),
                        )
                        .write(&mut w)?;
                    rows += 1;
                }
                if let Some(o) = d.other {
                    Row::new(at, "process")
                        .set(Col::Gpu, d.info.gpu.as_str())
                        .set(Col::Uuid, d.info.uuid.as_str())
                        .set(Col::Used, o.used_bytes.to_string())
                        .set(Col::Pid, "other")
                        .write(&mut w)?;
                    rows += 1;
                }
                for mig in d.mig.iter() {
                    memory_row(at, "mig", &d.info.gpu, &mig.info.mig_uuid, mig.memory)
                        .write(&mut w)?;
                    rows += 1;
                }
            }
            rows += self.allocations(&mut w, at, s)?;
        }
        done(w)?;
        Ok(rows)
    }
}
