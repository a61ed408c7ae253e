//! The trace format: Chrome Trace Event JSON (the object form,
//! `{"traceEvents":[…]}`), which Perfetto UI and chrome://tracing open.
//! Timestamps (`ts`) are microseconds since the Unix epoch, as PyTorch's
//! profiler writes them, so the two can be read side by side.
//!
//! Tracks (docs/record.md shows them):
//! - one trace process per GPU, pid [`GPU_PID_BASE`] + index (above any
//!   Linux pid, so it never collides with a real one), named
//!   `GPU <index> <name> <uuid>` by a `process_name` metadata event and
//!   sorted first; its counter `memory` has `used_bytes`, `reserved_bytes`
//!   and `free_bytes` (stacked, they make the total), one event per memory
//!   and full sample; `other processes` (`bytes`) when `processes.top_n` /
//!   `min_bytes` sum some up; `unattributed and stale` (`unattributed_bytes`
//!   and `stale_<reason>_bytes` for each reason, as
//!   `gpu_memory_unattributed_bytes` and `gpu_memory_stale_bytes`) at each
//!   full sample where the processes were read; an instant event
//!   `GPU not answering` when it stops answering;
//! - one trace process per host pid on a GPU, named
//!   `<process> (<user>) <namespace>/<pod>`; counters `gpu <index> used`
//!   and, with the torch bridge, `gpu <index> torch allocated` and
//!   `gpu <index> torch reserved` (each with `bytes`), one event per full
//!   sample. A process that left a GPU that still answers drops to 0 at the
//!   first full sample it is not listed in, so its track does not hold the
//!   last figure until the end of the trace.
//!
//! Events are serialised with serde_json; the array around them is
//! written by hand because it is streamed (the header once, the closing
//! `]}` kept after the last event by [`super::output`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use serde::Serialize;

use super::format::{EncodeError, Encoder, SampleKind, Stamp};
use crate::expose;
use crate::model::{DeviceSample, ProcIdentity, Snapshot, Unattributed};

/// Trace pid of GPU 0: `PID_MAX_LIMIT` on 64-bit Linux, one more than the
/// largest pid the kernel hands out.
pub(crate) const GPU_PID_BASE: u64 = 4_194_304;

const TRAILER: &[u8] = b"\n]}\n";

#[derive(Serialize)]
struct Event<'a, A: Serialize> {
    name: &'a str,
    ph: &'static str,
    ts: u64,
    pid: u64,
    tid: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    s: Option<&'static str>,
    args: A,
}

#[derive(Serialize)]
struct Memory {
    used_bytes: u64,
    /// Absent on a unified-memory GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    reserved_bytes: Option<u64>,
    free_bytes: u64,
}

/// Memory held by no live process: by none listed, and by the stale.
#[derive(Serialize)]
struct Held {
    /// Absent when a listed process has no figure.
    #[serde(skip_serializing_if = "Option::is_none")]
    unattributed_bytes: Option<u64>,
    stale_exited_bytes: u64,
    stale_zombie_bytes: u64,
    stale_uninterruptible_bytes: u64,
    stale_reparented_bytes: u64,
    stale_owner_deleted_bytes: u64,
}

#[derive(Serialize)]
struct Bytes {
    bytes: u64,
}

#[derive(Serialize)]
struct Name<'a> {
    name: &'a str,
}

#[derive(Serialize)]
struct SortIndex {
    sort_index: i64,
}

#[derive(Serialize)]
struct Header<'a> {
    generator: &'static str,
    version: &'static str,
    started: &'a str,
}

#[derive(Serialize)]
struct Empty {}

/// What the trace said last about one GPU.
#[derive(Default)]
struct GpuTrack {
    /// The identity its name was written for.
    named: Option<String>,
    up: Option<bool>,
    other: bool,
}

pub(crate) struct Trace {
    started: String,
    first: bool,
    gpus: Vec<GpuTrack>,
    /// (GPU position, pid) → whether it had torch tracks, as of the last
    /// full sample of that GPU.
    procs: HashMap<(usize, u32), bool>,
    /// The identity each pid's name was written for.
    named: HashMap<u32, Arc<ProcIdentity>>,
    /// Allocations on a GPU's track as of the last full sample: (GPU
    /// position, "namespace/pod/container resource").
    allocations: HashSet<(usize, String)>,
}

impl Trace {
    pub(crate) fn new(started: &Stamp) -> Trace {
        Trace {
            started: started.rfc3339.clone(),
            first: true,
            gpus: Vec::new(),
            procs: HashMap::new(),
            named: HashMap::new(),
            allocations: HashSet::new(),
        }
    }

    fn push<A: Serialize>(&mut self, out: &mut Vec<u8>, e: &Event<A>) -> Result<(), EncodeError> {
        if !self.first {
            out.extend_from_slice(b",\n");
        }
        serde_json::to_writer(&mut *out, e).map_err(EncodeError::from)?;
        self.first = false;
        Ok(())
    }

    fn counter<A: Serialize>(
        &mut self,
        out: &mut Vec<u8>,
        name: &str,
        ts: u64,
        pid: u64,
        args: A,
    ) -> Result<(), EncodeError> {
        self.push(
            out,
            &Event {
                name,
                ph: "C",
                ts,
                pid,
                tid: pid,
                s: None,
                args,
            },
        )
    }

    /// `process_name` (and `process_sort_index`) metadata for a track.
    fn name(
        &mut self,
        out: &mut Vec<u8>,
        ts: u64,
        pid: u64,
        name: &str,
        sort: Option<i64>,
    ) -> Result<(), EncodeError> {
        self.push(
            out,
            &Event {
                name: "process_name",
                ph: "M",
                ts,
                pid,
                tid: pid,
                s: None,
                args: Name { name },
            },
        )?;
        if let Some(sort_index) = sort {
            self.push(
                out,
                &Event {
                    name: "process_sort_index",
                    ph: "M",
                    ts,
                    pid,
                    tid: pid,
                    s: None,
                    args: SortIndex { sort_index },
                },
            )?;
        }
        Ok(())
    }

    fn gpu(
        &mut self,
        out: &mut Vec<u8>,
        k: usize,
        d: &DeviceSample,
        ts: u64,
    ) -> Result<(), EncodeError> {
        if self.gpus.len() <= k {
            self.gpus.resize_with(k + 1, GpuTrack::default);
        }
        let pid = GPU_PID_BASE + k as u64;
        let label = format!("GPU {} {} {}", d.info.gpu, d.info.name, d.info.uuid);
        if self.gpus[k].named.as_deref() != Some(label.as_str()) {
            self.name(out, ts, pid, label.trim_end(), Some(k as i64 - 1_000_000))?;
            self.gpus[k].named = Some(label);
        }
        match d.memory {
            Some(m) => {
                self.counter(
                    out,
                    "memory",
                    ts,
                    pid,
                    Memory {
                        used_bytes: m.used,
                        reserved_bytes: m.reserved,
                        free_bytes: m.free,
                    },
                )?;
                self.gpus[k].up = Some(true);
            }
            None => {
                if self.gpus[k].up != Some(false) {
                    self.instant(out, "GPU not answering", ts, pid)?;
                }
                self.gpus[k].up = Some(false);
            }
        }
        Ok(())
    }

    /// A full sample's process tracks of an answering GPU.
    fn processes(
        &mut self,
        out: &mut Vec<u8>,
        k: usize,
        d: &DeviceSample,
        ts: u64,
    ) -> Result<(), EncodeError> {
        let gpu = &d.info.gpu;
        let (used, allocated, reserved) = (
            format!("gpu {gpu} used"),
            format!("gpu {gpu} torch allocated"),
            format!("gpu {gpu} torch reserved"),
        );
        let mut listed = HashSet::with_capacity(d.processes.len());
        for p in d.processes.iter() {
            let pid = u64::from(p.pid);
            if self.named.get(&p.pid).is_none_or(|n| **n != *p.ident) {
                self.name(out, ts, pid, &process_label(&p.ident, p.pid), None)?;
                self.named.insert(p.pid, Arc::clone(&p.ident));
            }
            if let Some(bytes) = p.used_bytes {
                self.counter(out, &used, ts, pid, Bytes { bytes })?;
            }
            if let Some(t) = p.torch.as_deref() {
                self.counter(out, &allocated, ts, pid, Bytes { bytes: t.allocated })?;
                self.counter(out, &reserved, ts, pid, Bytes { bytes: t.reserved })?;
            }
            listed.insert(p.pid);
            self.procs.insert((k, p.pid), p.torch.is_some());
        }
        let gone: Vec<(u32, bool)> = self
            .procs
            .iter()
            .filter(|((g, pid), _)| *g == k && !listed.contains(pid))
            .map(|((_, pid), torch)| (*pid, *torch))
            .collect();
        for (pid, torch) in gone {
            self.procs.remove(&(k, pid));
            let tp = u64::from(pid);
            self.counter(out, &used, ts, tp, Bytes { bytes: 0 })?;
            if torch {
                self.counter(out, &allocated, ts, tp, Bytes { bytes: 0 })?;
                self.counter(out, &reserved, ts, tp, Bytes { bytes: 0 })?;
            }
        }
        let gpu_pid = GPU_PID_BASE + k as u64;
        if let Some([exited, zombie, uninterruptible, reparented, owner_deleted]) =
            expose::stale_bytes(d)
        {
            let held = Held {
                unattributed_bytes: d.readings.get::<Unattributed>().and_then(|u| u.bytes),
                stale_exited_bytes: exited,
                stale_zombie_bytes: zombie,
                stale_uninterruptible_bytes: uninterruptible,
                stale_reparented_bytes: reparented,
                stale_owner_deleted_bytes: owner_deleted,
            };
            self.counter(out, "unattributed and stale", ts, gpu_pid, held)?;
        }
        match d.other {
            Some(o) => {
                self.counter(
                    out,
                    "other processes",
                    ts,
                    gpu_pid,
                    Bytes {
                        bytes: o.used_bytes,
                    },
                )?;
                self.gpus[k].other = true;
            }
            None if self.gpus[k].other => {
                self.counter(out, "other processes", ts, gpu_pid, Bytes { bytes: 0 })?;
                self.gpus[k].other = false;
            }
            None => {}
        }
        Ok(())
    }
}

/// `python3 (alice) team-a/train-0`, as much of it as is known.
fn process_label(i: &ProcIdentity, pid: u32) -> String {
    let mut s = if i.comm.is_empty() {
        format!("pid {pid}")
    } else {
        i.comm.to_string()
    };
    if !i.user.is_empty() {
        s.push_str(&format!(" ({})", i.user));
    }
    if !i.pod.is_empty() {
        s.push_str(&format!(" {}/{}", i.namespace, i.pod));
    }
    s
}

impl Trace {
    /// An instant event (`"ph":"i"`, process scope) on track `pid`.
    fn instant(
        &mut self,
        out: &mut Vec<u8>,
        name: &str,
        ts: u64,
        pid: u64,
    ) -> Result<(), EncodeError> {
        let e = Event {
            name,
            ph: "i",
            ts,
            pid,
            tid: pid,
            s: Some("p"),
            args: Empty {},
        };
        self.push(out, &e)
    }

    /// An instant event on a GPU's track for each allocation that appeared
    /// ("allocated: …") or went ("released: …") since the last full sample;
    /// devices this exporter does not see have no track and no event.
    fn allocations(
        &mut self,
        out: &mut Vec<u8>,
        s: &Snapshot,
        ts: u64,
    ) -> Result<u64, EncodeError> {
        let now: HashSet<(usize, String)> = expose::placed(s)
            .iter()
            .filter_map(|p| {
                let k = s
                    .devices
                    .iter()
                    .position(|d| !p.gpu.is_empty() && d.info.gpu == p.gpu)?;
                let a = p.allocation;
                let device = p.mig_uuid.unwrap_or(p.uuid);
                Some((
                    k,
                    format!(
                        "{}/{}/{} {} {device}",
                        a.namespace, a.pod, a.container, a.resource
                    ),
                ))
            })
            .collect();
        let mut events = 0;
        let mut gone: Vec<(usize, String)> = self.allocations.difference(&now).cloned().collect();
        let mut new: Vec<(usize, String)> = now.difference(&self.allocations).cloned().collect();
        gone.sort();
        new.sort();
        for (verb, list) in [("released", gone), ("allocated", new)] {
            for (k, what) in list {
                let pid = GPU_PID_BASE + k as u64;
                self.instant(out, &format!("{verb}: {what}"), ts, pid)?;
                events += 1;
            }
        }
        self.allocations = now;
        Ok(events)
    }
}

impl Encoder for Trace {
    fn header(&mut self) -> Result<Vec<u8>, EncodeError> {
        let other = Header {
            generator: "gpumem-exporter record",
            version: env!("CARGO_PKG_VERSION"),
            started: &self.started,
        };
        let other = serde_json::to_string(&other).map_err(EncodeError::from)?;
        Ok(
            format!("{{\"displayTimeUnit\":\"ms\",\"otherData\":{other},\"traceEvents\":[\n")
                .into_bytes(),
        )
    }

    fn trailer(&self) -> &'static [u8] {
        TRAILER
    }

    fn sample(
        &mut self,
        s: &Arc<Snapshot>,
        kind: SampleKind,
        at: &Stamp,
        out: &mut Vec<u8>,
    ) -> Result<u64, EncodeError> {
        let ts = at.unix_micros;
        for (k, d) in s.devices.iter().enumerate() {
            self.gpu(out, k, d, ts)?;
        }
        let mut rows = s.devices.len() as u64;
        if kind == SampleKind::Full {
            for (k, d) in s.devices.iter().enumerate().filter(|(_, d)| d.up()) {
                self.processes(out, k, d, ts)?;
                rows += d.processes.len() as u64;
            }
            rows += self.allocations(out, s, ts)?;
            // Names of pids on no GPU any more are forgotten (a reused pid
            // is named again).
            let live: HashSet<u32> = self.procs.keys().map(|(_, pid)| *pid).collect();
            self.named.retain(|pid, _| live.contains(pid));
        }
        Ok(rows)
    }
}
