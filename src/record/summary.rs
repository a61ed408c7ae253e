//! What `record` says when it ends: per GPU and for the command's own
//! processes, peak and mean used memory, GiB-hours, seconds above 90 % of
//! the GPU, torch's peak allocated against peak reserved and its OOMs
//! where the bridge ran — `/usr/bin/time -v` for GPU memory. Built on the
//! writer thread from every snapshot it writes (so it is of what the
//! recording holds), printed on stderr and written as JSON beside the
//! recording (`<file>.summary.json`), also when the command failed or the
//! recording was interrupted.
//!
//! Memory-time comes from the ledger's counters in the snapshots
//! (`accounting`): the difference between the last snapshot and the first
//! one, so it is exact to the samples. "The command's own processes" are
//! those whose parent chain in `/proc` reaches the command's pid (every
//! process when there is no command), decided once per pid. Hand-written:
//! a few sums, and serde for the JSON.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::accounting::process_byte_seconds;
use crate::model::Snapshot;

const GIB_HOUR: f64 = 3600.0 * (1u64 << 30) as f64;

/// The summary document (its JSON form is docs/record.md's).
#[derive(Debug, Default, Serialize)]
pub(crate) struct Report {
    /// Seconds from the first sample to the last.
    pub duration_seconds: f64,
    pub samples: u64,
    /// `exited` (with `exit_code`), `signalled`, `interrupted` (a stop
    /// signal, no command), `duration`, `cannot_start`, `no_command`.
    pub end: String,
    pub exit_code: Option<i32>,
    pub gpus: Vec<GpuSummary>,
    /// The command's own processes, by (GPU, pid).
    pub processes: Vec<ProcessSummary>,
}

#[derive(Debug, Default, Serialize, Clone)]
pub(crate) struct GpuSummary {
    pub gpu: String,
    pub uuid: String,
    pub peak_used_bytes: u64,
    /// Time-weighted over the recording (byte-seconds / seconds).
    pub mean_used_bytes: f64,
    pub gib_hours: f64,
    pub seconds_above_90_percent: f64,
}

#[derive(Debug, Default, Serialize, Clone)]
pub(crate) struct ProcessSummary {
    pub gpu: String,
    pub uuid: String,
    pub pid: u32,
    pub process: String,
    pub peak_used_bytes: u64,
    pub mean_used_bytes: f64,
    pub gib_hours: f64,
    /// Torch's own peaks, where the bridge ran in the process.
    pub torch_peak_allocated_bytes: Option<u64>,
    pub torch_peak_reserved_bytes: Option<u64>,
    /// Of the peak reserved, the share the cache held beyond the peak
    /// allocated (0–1).
    pub torch_cache_share: Option<f64>,
    pub torch_ooms: Option<u64>,
}

#[derive(Debug, Default)]
struct GpuAcc {
    gpu: String,
    peak: u64,
    first: Option<(f64, f64)>,
    last: Option<(f64, f64)>,
    above: f64,
    /// The previous sample: its time and whether it was above 90 %.
    prev: Option<(f64, bool)>,
}

#[derive(Debug, Default)]
struct ProcAcc {
    gpu: String,
    process: String,
    peak: u64,
    first: Option<(f64, f64)>,
    last: Option<(f64, f64)>,
    torch_alloc: Option<u64>,
    torch_reserved: Option<u64>,
    ooms: Option<u64>,
}

/// Fed every snapshot the recording holds.
#[derive(Debug)]
pub(crate) struct Tracker {
    command: Arc<AtomicU32>,
    procfs: std::path::PathBuf,
    samples: u64,
    first_at: Option<f64>,
    last_at: Option<f64>,
    gpus: BTreeMap<String, GpuAcc>,
    procs: BTreeMap<(String, u32), ProcAcc>,
    /// Whether a pid is the command's (decided once).
    own: HashMap<u32, bool>,
}

fn seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Tracker {
    /// `command` holds the command's pid once it runs (0: none yet, or no
    /// command: then every process counts).
    pub(crate) fn new(command: Arc<AtomicU32>, procfs: &Path) -> Tracker {
        Tracker {
            command,
            procfs: procfs.to_path_buf(),
            samples: 0,
            first_at: None,
            last_at: None,
            gpus: BTreeMap::new(),
            procs: BTreeMap::new(),
            own: HashMap::new(),
        }
    }

    pub(crate) fn add(&mut self, s: &Snapshot) {
        let at = seconds(s.taken_at);
        self.samples += 1;
        self.first_at.get_or_insert(at);
        self.last_at = Some(at);
        for d in s.devices.iter().filter(|d| d.info.is_known()) {
            let g = self.gpus.entry(d.info.uuid.clone()).or_default();
            g.gpu = d.info.gpu.clone();
            if let Some((t, true)) = g.prev {
                g.above += at - t;
            }
            let above = d
                .memory
                .is_some_and(|m| m.total > 0 && m.used as f64 >= 0.9 * m.total as f64);
            g.prev = Some((at, above));
            if let Some(m) = d.memory {
                g.peak = g.peak.max(m.used);
            }
            // Memory-time over the ledger's own clock.
            let mono = s.accounting.seconds;
            if let Some(a) = s.accounting.gpus.get(d.info.uuid.as_str()) {
                g.first.get_or_insert((mono, a.used_byte_seconds));
                g.last = Some((mono, a.used_byte_seconds));
            }
            for p in d.processes.iter() {
                if !self.is_own(p.pid) {
                    continue;
                }
                let e = self.procs.entry((d.info.uuid.clone(), p.pid)).or_default();
                e.gpu = d.info.gpu.clone();
                if e.process.is_empty() {
                    e.process = p.ident.comm.to_string();
                }
                e.peak = e.peak.max(p.used_bytes.unwrap_or(0));
                let bs = process_byte_seconds(&s.accounting, &d.info.uuid, p);
                e.first.get_or_insert((mono, bs));
                e.last = Some((mono, bs));
                if let Some(t) = &p.torch {
                    e.torch_alloc = Some(e.torch_alloc.unwrap_or(0).max(t.allocated_peak));
                    e.torch_reserved = Some(e.torch_reserved.unwrap_or(0).max(t.reserved_peak));
                    e.ooms = Some(e.ooms.unwrap_or(0).max(t.ooms));
                }
            }
        }
    }

    /// Whether `pid` is the command's or a descendant (every pid when there
    /// is no command).
    fn is_own(&mut self, pid: u32) -> bool {
        let root = self.command.load(Ordering::Acquire);
        if root == 0 {
            return true;
        }
        if let Some(&own) = self.own.get(&pid) {
            return own;
        }
        let mut p = pid;
        let mut own = false;
        // A parent chain is short; bound it anyway (a pid loop cannot
        // happen, a bad read must not spin).
        for _ in 0..64 {
            if p == root {
                own = true;
                break;
            }
            match ppid(&self.procfs, p) {
                Some(q) if q > 1 && q != p => p = q,
                _ => break,
            }
        }
        self.own.insert(pid, own);
        own
    }

    pub(crate) fn report(&self, end: &str, exit_code: Option<i32>) -> Report {
        let span = |first: Option<(f64, f64)>, last: Option<(f64, f64)>| match (first, last) {
            (Some((t0, v0)), Some((t1, v1))) => (v1 - v0, t1 - t0),
            _ => (0.0, 0.0),
        };
        let mean = |bs: f64, secs: f64| if secs > 0.0 { bs / secs } else { 0.0 };
        Report {
            duration_seconds: match (self.first_at, self.last_at) {
                (Some(a), Some(b)) => b - a,
                _ => 0.0,
            },
            samples: self.samples,
            end: end.to_string(),
            exit_code,
            gpus: self
                .gpus
                .iter()
                .map(|(uuid, g)| {
                    let (bs, secs) = span(g.first, g.last);
                    GpuSummary {
                        gpu: g.gpu.clone(),
                        uuid: uuid.clone(),
                        peak_used_bytes: g.peak,
                        mean_used_bytes: mean(bs, secs),
                        gib_hours: bs / GIB_HOUR,
                        seconds_above_90_percent: g.above,
                    }
                })
                .collect(),
            processes: self
                .procs
                .iter()
                .map(|((uuid, pid), p)| {
                    let (bs, secs) = span(p.first, p.last);
                    ProcessSummary {
                        gpu: p.gpu.clone(),
                        uuid: uuid.clone(),
                        pid: *pid,
                        process: p.process.clone(),
                        peak_used_bytes: p.peak,
                        mean_used_bytes: mean(bs, secs),
                        gib_hours: bs / GIB_HOUR,
                        torch_peak_allocated_bytes: p.torch_alloc,
                        torch_peak_reserved_bytes: p.torch_reserved,
                        torch_cache_share: match (p.torch_alloc, p.torch_reserved) {
                            (Some(a), Some(r)) if r > 0 => {
                                Some(r.saturating_sub(a) as f64 / r as f64)
                            }
                            _ => None,
                        },
                        torch_ooms: p.ooms,
                    }
                })
                .collect(),
        }
    }
}

/// The parent pid from `<procfs>/<pid>/stat` (field 4, after the comm's
/// closing parenthesis, which a comm may itself contain).
fn ppid(procfs: &Path, pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(procfs.join(pid.to_string()).join("stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

const MIB: f64 = (1u64 << 20) as f64;

impl Report {
    /// The lines printed on stderr.
    pub(crate) fn text(&self) -> String {
        let mut out = format!(
            "gpumem-exporter record: {:.1} s, {} samples, ended: {}{}\n",
            self.duration_seconds,
            self.samples,
            self.end,
            self.exit_code
                .map(|c| format!(" (exit code {c})"))
                .unwrap_or_default()
        );
        for g in &self.gpus {
            out.push_str(&format!(
                "  GPU {} {}: peak {:.1} MiB, mean {:.1} MiB, {:.6} GiB-hours, {:.1} s above 90 %\n",
                g.gpu,
                g.uuid,
                g.peak_used_bytes as f64 / MIB,
                g.mean_used_bytes / MIB,
                g.gib_hours,
                g.seconds_above_90_percent
            ));
        }
        for p in &self.processes {
            out.push_str(&format!(
                "  pid {} ({}) on GPU {}: peak {:.1} MiB, mean {:.1} MiB, {:.6} GiB-hours",
                p.pid,
                p.process,
                p.gpu,
                p.peak_used_bytes as f64 / MIB,
                p.mean_used_bytes / MIB,
                p.gib_hours
            ));
            if let (Some(a), Some(r)) = (p.torch_peak_allocated_bytes, p.torch_peak_reserved_bytes)
            {
                out.push_str(&format!(
                    "; torch peak allocated {:.1} MiB of peak reserved {:.1} MiB, {} OOMs",
                    a as f64 / MIB,
                    r as f64 / MIB,
                    p.torch_ooms.unwrap_or(0)
                ));
            }
            out.push('\n');
        }
        out
    }
}

/// Where the JSON goes: beside the recording, `<file>.summary.json`.
pub(crate) fn json_path(recording: &Path) -> std::path::PathBuf {
    let mut name = recording.as_os_str().to_owned();
    name.push(".summary.json");
    std::path::PathBuf::from(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ppid_reads_past_a_comm_with_parentheses() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("7")).unwrap();
        std::fs::write(dir.path().join("7/stat"), "7 (a) b) S 3 7 7 0").unwrap();
        assert_eq!(ppid(dir.path(), 7), Some(3));
        assert_eq!(ppid(dir.path(), 8), None);
    }
}
