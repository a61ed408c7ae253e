//! Each workload's own memory limit on a GPU, beside its use: what the
//! sources say (the driver's per-cgroup limits, the kernel's `dmem`
//! controller, HAMi's and KAI's pod annotations, a DRA claim's consumed
//! capacity, PyTorch's own fraction), and what `crate::limits` makes of
//! them per workload and GPU.

use std::sync::Arc;

use super::{Forecast, Workload};

/// Where a limit comes from (the `source` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LimitSource {
    /// NVML's per-cgroup memory limits (`nvmlDeviceGetMemoryLimits_v1`).
    Driver,
    /// The kernel's `dmem` cgroup controller (`dmem.max`).
    Dmem,
    /// HAMi's scheduler-written `hami.io/vgpu-devices-allocated`.
    Hami,
    /// A DRA ResourceClaim's allocated consumed capacity (`memory`).
    Dra,
    /// KAI-Scheduler's `gpu-memory` / `gpu-fraction` annotations.
    Kai,
    /// PyTorch's `set_per_process_memory_fraction`, over the torch bridge.
    Torch,
}

impl LimitSource {
    pub const ALL: [LimitSource; 6] = [
        LimitSource::Driver,
        LimitSource::Dmem,
        LimitSource::Hami,
        LimitSource::Dra,
        LimitSource::Kai,
        LimitSource::Torch,
    ];

    pub fn label(self) -> &'static str {
        match self {
            LimitSource::Driver => "driver",
            LimitSource::Dmem => "dmem",
            LimitSource::Hami => "hami",
            LimitSource::Dra => "dra",
            LimitSource::Kai => "kai",
            LimitSource::Torch => "torch",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// What a limit means (the `kind` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LimitKind {
    /// Allocations past it fail.
    Hard,
    /// Memory guaranteed before allocations may fail under pressure.
    Soft,
    /// A share a scheduler granted and does not enforce.
    Granted,
}

impl LimitKind {
    pub fn label(self) -> &'static str {
        match self {
            LimitKind::Hard => "hard",
            LimitKind::Soft => "soft",
            LimitKind::Granted => "granted",
        }
    }
}

/// How much a pod-level source grants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Amount {
    Bytes(u64),
    /// A share of the GPU's total memory (KAI's `gpu-fraction`).
    Fraction(f64),
}

/// A limit the Kubernetes API states for a pod (hami, kai, dra), kept by
/// the pod watcher and the claims reader: never read from anything the
/// pod's own processes can write.
#[derive(Debug, Clone, PartialEq)]
pub struct PodLimit {
    pub pod_uid: Arc<str>,
    /// The GPU (or MIG device) it is on; `None`: every GPU the pod's
    /// processes use (KAI's annotations name no GPU).
    pub uuid: Option<Arc<str>>,
    pub source: LimitSource,
    pub kind: LimitKind,
    pub amount: Amount,
}

/// A limit of a cgroup directory on one GPU (driver, dmem), read by the
/// sampler for the root-owned cgroups of the processes it lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupLimit {
    /// The cgroup v2 path (`/kubepods.slice/…`), as `/proc/<pid>/cgroup`
    /// gives it.
    pub cgroup: Arc<str>,
    /// The directory the limit is set on: the process's own or the
    /// nearest ancestor that has one (the lowest, for `dmem`, whose limits
    /// nest). A workload's processes under one such directory share it.
    pub at: Arc<str>,
    pub uuid: Arc<str>,
    pub source: LimitSource,
    pub kind: LimitKind,
    pub bytes: u64,
}

/// Whether each source was found on this node: `None` not looked for
/// (its input is off), `Some(false)` looked for and absent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimitSources([Option<bool>; 6]);

impl LimitSources {
    pub fn set(&mut self, source: LimitSource, present: bool) {
        self.0[source.index()] = Some(present);
    }

    pub fn get(&self, source: LimitSource) -> Option<bool> {
        self.0[source.index()]
    }

    /// Take every source `other` looked for.
    pub fn merge(&mut self, other: &LimitSources) {
        for (mine, theirs) in self.0.iter_mut().zip(other.0) {
            if theirs.is_some() {
                *mine = theirs;
            }
        }
    }
}

/// One limit of one workload on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub source: LimitSource,
    pub kind: LimitKind,
    pub bytes: u64,
}

/// A workload with at least one limit on a GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadLimits {
    pub workload: Workload,
    /// The GPU's position in the snapshot (its `gpu` label) and UUID.
    pub gpu: usize,
    pub uuid: Arc<str>,
    /// Its processes' bytes on that GPU (those with a figure).
    pub used: u64,
    /// Sorted by source, then kind.
    pub limits: Vec<Limit>,
    /// When it reaches its lowest hard limit at its present growth.
    pub limit_in: Option<Forecast>,
}

impl WorkloadLimits {
    /// The lowest hard limit.
    pub fn hard(&self) -> Option<u64> {
        self.limits
            .iter()
            .filter(|l| l.kind == LimitKind::Hard)
            .map(|l| l.bytes)
            .min()
    }
}

/// What a snapshot knows of limits.
#[derive(Debug, Clone, Default)]
pub struct Limits {
    /// From the pod watcher and the claims reader.
    pub pods: Arc<Vec<PodLimit>>,
    /// From the sampler's last cgroup read.
    pub cgroups: Arc<Vec<CgroupLimit>>,
    pub sources: LimitSources,
    /// Per workload and GPU, by GPU then workload; assembled when published.
    pub workloads: Arc<Vec<WorkloadLimits>>,
}
