//! One GPU as the sampler keeps it between ticks: its identity, memory and
//! peak window, MIG layout, and the last full sample's processes. The
//! switchable collectors keep their own per-GPU state
//! (`collectors/`); this holds what every sample has.
//!
//! Per device, a full tick walks this state machine:
//! - identity unknown (NVML enumerated the GPU but its handle or identity
//!   did not answer): retried every full tick; the GPU is down meanwhile;
//! - known: memory read every tick; on a full tick also the processes, the
//!   MIG layout when `mig_rescan_interval` has passed or a MIG call says it
//!   changed (a process on an instance the layout does not have, a stale
//!   instance handle), and each instance's memory.
//!
//! A GPU that answers NOT_SUPPORTED to memory info when it is discovered
//! has unified memory (DGX Spark / GB10): said once in the log, marked
//! [`MemoryKind::Unified`], and its memory is the host's from then on
//! (`host_memory.rs`), read at the same interval, with no NVML error
//! counted.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use super::errors::Errors;
use super::host_memory;
use super::peaks::WindowMax;
use crate::gpu::Virtualization;
use crate::gpu::{ErrorKind, GpuSource, RawProcess};
use crate::model::{
    DeviceInfo, MemoryInfo, MemoryKind, MigInfo, MigSample, OtherProcesses, ProcessSample,
    Unattributed,
};

pub(super) struct DeviceState {
    pub(super) index: usize,
    pub(super) info: Arc<DeviceInfo>,
    pub(super) memory: Option<MemoryInfo>,
    pub(super) used_peak: WindowMax,
    pub(super) processes: Arc<[ProcessSample]>,
    pub(super) other: Option<OtherProcesses>,
    pub(super) process_peaks: HashMap<u32, WindowMax>,
    pub(super) mig: Arc<[MigSample]>,
    /// Used memory no listed process accounts for, at the last full
    /// sample (a reading of the GPU).
    pub(super) unattributed: Option<Arc<Unattributed>>,
    /// When each listed pid was first seen on this GPU (idle time counts
    /// from there at the most).
    pub(super) first_seen: HashMap<u32, SystemTime>,
    /// When the GPU's own utilisation was last above 0 (the idle fallback
    /// where the driver has no per-process samples).
    pub(super) busy_at: Option<SystemTime>,
    /// When the MIG layout was last read; `None`: not yet.
    mig_read_at: Option<Instant>,
    /// Failed identity reads in a row (the first one is logged).
    identify_failures: u32,
    /// NVML says this GPU is a vGPU guest's (read at discovery): the
    /// collectors whose calls misbehave there are skipped on it.
    pub(super) vgpu_guest: bool,
    /// A unified-memory GPU's host meminfo failed in the last read (the
    /// first failure of a run is logged).
    meminfo_failed: bool,
}

impl DeviceState {
    pub(super) fn unknown(index: usize) -> Self {
        DeviceState {
            index,
            info: Arc::new(DeviceInfo::unknown(index)),
            memory: None,
            used_peak: WindowMax::default(),
            processes: Arc::from(Vec::new()),
            other: None,
            process_peaks: HashMap::new(),
            unattributed: None,
            first_seen: HashMap::new(),
            busy_at: None,
            mig: Arc::from(Vec::new()),
            mig_read_at: None,
            identify_failures: 0,
            meminfo_failed: false,
            vgpu_guest: false,
        }
    }

    /// No answer in this sample: no memory, no processes, no MIG memory.
    pub(super) fn mark_down(&mut self) {
        self.memory = None;
        self.processes = Arc::from(Vec::new());
        self.other = None;
        self.process_peaks.clear();
        if self.mig.iter().any(|m| m.memory.is_some()) {
            self.mig = self
                .mig
                .iter()
                .map(|m| MigSample {
                    info: Arc::clone(&m.info),
                    memory: None,
                })
                .collect();
        }
    }

    /// Read the memory and feed the peak window; while the identity is
    /// unknown or the driver is gone, the GPU is down. A unified-memory
    /// GPU's memory is the host's, from `procfs`'s meminfo. Returns the
    /// time spent in NVML.
    pub(super) fn read_memory(
        &mut self,
        gpu: &mut dyn GpuSource,
        errors: &mut Errors,
        now: Instant,
        window: Duration,
        procfs: &Path,
    ) -> Duration {
        if errors.driver_gone.is_some() || !self.info.is_known() {
            self.mark_down();
            self.used_peak.expire(now, window);
            return Duration::ZERO;
        }
        if self.info.memory == MemoryKind::Unified {
            self.read_host_memory(now, window, procfs);
            return Duration::ZERO;
        }
        let t = Instant::now();
        let result = gpu.memory(self.index);
        let spent = t.elapsed();
        match result {
            Ok(m) => {
                self.used_peak.push(now, m.used, window);
                self.memory = Some(m);
            }
            Err(e) => {
                self.memory = None;
                self.used_peak.expire(now, window);
                errors.count(e);
            }
        }
        spent
    }

    /// The host's memory as a unified-memory GPU's: not an NVML call, so a
    /// failure is logged (first of a run) and the GPU is down, uncounted.
    fn read_host_memory(&mut self, now: Instant, window: Duration, procfs: &Path) {
        match host_memory::read(procfs) {
            Ok(m) => {
                if self.meminfo_failed {
                    tracing::info!(gpu = self.index, "host memory readable again");
                }
                self.meminfo_failed = false;
                self.used_peak.push(now, m.used, window);
                self.memory = Some(m);
            }
            Err(e) => {
                if !self.meminfo_failed {
                    tracing::warn!(
                        gpu = self.index,
                        error = %e,
                        "unified-memory GPU: host memory cannot be read; the GPU is exported as gpu_up 0 until it can"
                    );
                }
                self.meminfo_failed = true;
                self.memory = None;
                self.used_peak.expire(now, window);
            }
        }
    }

    /// Read the identity and MIG layout; on success the GPU is known from
    /// now on. Failures are counted, and the first of a run is logged.
    /// A GPU whose memory info is NOT_SUPPORTED has unified memory: said
    /// once here, and not asked again.
    pub(super) fn discover(
        &mut self,
        gpu: &mut dyn GpuSource,
        errors: &mut Errors,
        now: Instant,
        procfs: &Path,
    ) {
        let i = self.index;
        let found = gpu
            .identify(i)
            .and_then(|info| Ok((info, gpu.mig_layout(i)?)));
        match found {
            Ok((mut info, layout)) => {
                if gpu
                    .memory(i)
                    .is_err_and(|e| e.kind == ErrorKind::NotSupported)
                {
                    info.memory = MemoryKind::Unified;
                    tracing::info!(
                        gpu = i,
                        uuid = %info.uuid,
                        name = %info.name,
                        meminfo = %procfs.join("meminfo").display(),
                        "GPU answers NOT_SUPPORTED for memory info: unified memory, shared with the host; its memory figures are the host's (MemTotal, MemAvailable) and gpu_info has memory=\"unified\""
                    );
                }
                if self.identify_failures > 0 {
                    tracing::info!(
                        gpu = i,
                        uuid = %info.uuid,
                        failures = self.identify_failures,
                        "GPU answered; its series start now"
                    );
                }
                self.vgpu_guest = match gpu.virtualization(i) {
                    Ok(v) => v == Virtualization::VgpuGuest,
                    Err(e) => {
                        if !e.kind.is_unsupported() {
                            errors.count(e);
                        }
                        false
                    }
                };
                self.info = Arc::new(info);
                self.mig = layout_samples(layout);
                self.mig_read_at = Some(now);
                self.identify_failures = 0;
            }
            Err(e) => {
                if self.identify_failures == 0 {
                    tracing::warn!(
                        gpu = i,
                        operation = %e.operation,
                        error = %e.kind,
                        "GPU identity cannot be read; it is exported as gpu_up 0 and retried at each full sample"
                    );
                }
                self.identify_failures = self.identify_failures.saturating_add(1);
                errors.count(e);
            }
        }
    }

    /// Whether the MIG layout is due for a rescan at `now` (read once per
    /// tick at most).
    pub(super) fn mig_rescan_due(&self, now: Instant, every: Duration) -> bool {
        self.mig_read_at
            .is_none_or(|at| at != now && now.duration_since(at) >= every)
    }

    /// Whether the layout was read in the tick that started at `now`.
    pub(super) fn mig_read_in(&self, now: Instant) -> bool {
        self.mig_read_at == Some(now)
    }

    /// Read the MIG layout again; a changed layout replaces the instance
    /// list (instances that vanished leave no series).
    pub(super) fn rescan_mig(
        &mut self,
        gpu: &mut dyn GpuSource,
        errors: &mut Errors,
        now: Instant,
    ) {
        let result = gpu.mig_layout(self.index);
        self.mig_read_at = Some(now);
        match result {
            Ok(layout) => {
                let same = layout.len() == self.mig.len()
                    && layout
                        .iter()
                        .zip(self.mig.iter())
                        .all(|(a, b)| *a == *b.info);
                if !same {
                    tracing::info!(
                        gpu = self.index,
                        before = self.mig.len(),
                        after = layout.len(),
                        "MIG layout changed"
                    );
                    self.mig = layout_samples(layout);
                }
            }
            Err(e) => errors.count(e),
        }
    }

    /// Each MIG instance's memory. Returns whether a failure says the
    /// layout changed under the handles.
    pub(super) fn read_mig_memory(&mut self, gpu: &mut dyn GpuSource, errors: &mut Errors) -> bool {
        let mut changed = false;
        let mut mig = Vec::with_capacity(self.mig.len());
        for (k, m) in self.mig.iter().enumerate() {
            let memory = match gpu.mig_memory(self.index, k) {
                Ok(mem) => Some(mem),
                Err(e) => {
                    changed |= e.kind.is_layout_changed();
                    errors.count(e);
                    None
                }
            };
            mig.push(MigSample {
                info: Arc::clone(&m.info),
                memory,
            });
        }
        self.mig = Arc::from(mig);
        changed
    }

    /// The MIG instance process `p` runs on, if the layout has it.
    /// Used memory minus the bytes of the processes `listed` in this full
    /// sample, for the GPU and each MIG instance (`None` where a listed
    /// process has no figure, or the GPU did not answer).
    pub(super) fn unattributed(&self, listed: &[RawProcess]) -> Unattributed {
        let sum = |on: &dyn Fn(&RawProcess) -> bool| -> Option<u64> {
            listed
                .iter()
                .filter(|p| on(p))
                .map(|p| p.used_bytes)
                .try_fold(0u64, |acc, b| Some(acc.saturating_add(b?)))
        };
        let bytes = self
            .memory
            .and_then(|m| Some(m.used.saturating_sub(sum(&|_| true)?)));
        let mig = self
            .mig
            .iter()
            .map(|m| {
                let on = |p: &RawProcess| {
                    self.instance_of(p)
                        .is_some_and(|i| i.info.mig_uuid == m.info.mig_uuid)
                };
                let used = m.memory.map(|mm| mm.used);
                (
                    Arc::from(m.info.mig_uuid.as_str()),
                    used.and_then(|u| Some(u.saturating_sub(sum(&on)?))),
                )
            })
            .collect();
        Unattributed { bytes, mig }
    }

    pub(super) fn instance_of(&self, p: &RawProcess) -> Option<&MigSample> {
        let gi = p.gpu_instance_id?;
        self.mig.iter().find(|m| {
            m.info.gpu_instance_id == gi
                && p.compute_instance_id
                    .is_none_or(|ci| ci == m.info.compute_instance_id)
        })
    }

    /// A listed process runs on a MIG instance the layout does not have.
    pub(super) fn unknown_instance(&self, listed: &[RawProcess]) -> bool {
        listed
            .iter()
            .any(|p| p.gpu_instance_id.is_some() && self.instance_of(p).is_none())
    }
}

/// A MIG layout as samples without memory (read in the same tick).
fn layout_samples(layout: Vec<MigInfo>) -> Arc<[MigSample]> {
    layout
        .into_iter()
        .map(|m| MigSample {
            info: Arc::new(m),
            memory: None,
        })
        .collect()
}
