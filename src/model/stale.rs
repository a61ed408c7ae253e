//! Memory held by the dead and the idle: why a process on a GPU is stale
//! ([`Stale`], a reading of the process: from the kernel's /proc and the
//! API's deletions, never from what the process says), and the bytes no
//! listed process accounts for ([`Unattributed`], a reading of the GPU).

use std::sync::Arc;
use std::time::SystemTime;

/// Why a process still listed by NVML holds memory nobody uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StaleReason {
    /// Seen alive in /proc, gone from it for at least two full samples.
    Exited,
    /// State `Z` in `/proc/<pid>/stat`.
    Zombie,
    /// State `D` for at least `processes.uninterruptible_after`.
    Uninterruptible,
    /// Its parent pid changed since it was first seen: the parent died.
    Reparented,
    /// Its pod was deleted in the API, its Slurm job left the job map,
    /// or the container engine says its container is gone.
    OwnerDeleted,
}

impl StaleReason {
    /// Every reason, in the order the families list them.
    pub const ALL: [StaleReason; 5] = [
        StaleReason::Exited,
        StaleReason::Zombie,
        StaleReason::Uninterruptible,
        StaleReason::Reparented,
        StaleReason::OwnerDeleted,
    ];

    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            StaleReason::Exited => "exited",
            StaleReason::Zombie => "zombie",
            StaleReason::Uninterruptible => "uninterruptible",
            StaleReason::Reparented => "reparented",
            StaleReason::OwnerDeleted => "owner_deleted",
        }
    }

    /// The dead (exited, zombie, stuck in D) against the orphaned.
    pub fn is_dead(self) -> bool {
        matches!(
            self,
            StaleReason::Exited | StaleReason::Zombie | StaleReason::Uninterruptible
        )
    }
}

/// A process's stale reason and since when it holds (a reading of the
/// process, left by the sampler from attribution's answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stale {
    pub reason: StaleReason,
    pub since: SystemTime,
}

/// Used memory that no listed process accounts for, at the last full
/// sample: `used` minus the listed processes' bytes (0 at least); `None`
/// where a listed process has no figure (NVML_VALUE_NOT_AVAILABLE). A
/// reading of the GPU, left by the sampler.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Unattributed {
    pub bytes: Option<u64>,
    /// The same per MIG instance, by its UUID.
    pub mig: Vec<(Arc<str>, Option<u64>)>,
}

/// When a process last ran a kernel, as NVML's per-process utilisation
/// samples say (a reading of the process, left by the collector that
/// reads them, today `process_activity`); `None`: none seen since the
/// exporter began watching it. Absent where the driver has no such
/// samples (the sampler then falls back to the GPU's own utilisation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Activity {
    pub last_active: Option<SystemTime>,
}

/// A process that holds memory and has run no kernel since `since`, for
/// at least `processes.idle_after` (a reading of the process, left by the
/// sampler).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Idle {
    pub since: SystemTime,
}
