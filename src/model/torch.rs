//! PyTorch's own figures for one process, from the torch bridge: the
//! caching allocator's bytes and counts, training steps, pools, settings,
//! and the bridge's document counters.

use crate::trend::Slope;

/// PyTorch caching-allocator figures of one process on one GPU, from
/// `torch.cuda.memory_stats()` via the torch bridge: bytes, and counts for
/// `alloc_retries` and `ooms`. The `Option`s are what a bridge may leave
/// out (an older bridge, a torch without the figure, a setting not made).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorchStats {
    pub allocated: u64,
    pub reserved: u64,
    pub allocated_peak: u64,
    pub reserved_peak: u64,
    pub active: u64,
    pub inactive_split: u64,
    pub alloc_retries: u64,
    pub ooms: u64,
    /// The large (blocks over 1 MiB) and small pools, where fragmentation
    /// shows.
    pub pools: Option<TorchPools>,
    /// Bytes the allocator may reserve on this GPU, when the process set a
    /// per-process memory fraction below 1.
    pub limit: Option<u64>,
    /// Allocator settings (the process's, the same on each of its GPUs);
    /// `None` when its `PYTORCH_CUDA_ALLOC_CONF` is malformed.
    pub allocator: Option<AllocatorSettings>,
    /// OOM snapshots the bridge wrote for OOMs on this GPU, when the
    /// process turned them on (`GPUMEM_BRIDGE_OOM_SNAPSHOT_DIR`).
    pub oom_snapshots: Option<u64>,
    /// Per-step figures from the bridge's optimizer step hook (or
    /// `gpumem_bridge.step()`), when the process has taken steps.
    pub steps: Option<TorchSteps>,
    /// The bridge's in-process threshold (`GPUMEM_BRIDGE_WARN_AT`), when set.
    pub threshold: Option<TorchThreshold>,
}

/// What the bridge recorded at the end of each training step on one GPU,
/// reduced to the figures exported (the steps themselves are not kept).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorchSteps {
    /// Steps the process has taken (every optimizer step, or `step()` call).
    pub total: u64,
    /// Allocated bytes at the end of the last recorded step.
    pub allocated: Option<u64>,
    /// Least-squares slope of allocated-at-step-end over step number, over
    /// the last `window` steps; `None` with fewer than
    /// [`crate::trend::MIN_GROWTH_STEPS`].
    pub growth: Option<Slope>,
    /// Steps and milliseconds from the first to the last step of the
    /// window (steps per second), when time passed between them.
    pub pace: Option<(u64, u64)>,
    /// Steps the figures are over (at most [`crate::trend::MAX_GROWTH_STEPS`]).
    pub window: u32,
}

impl TorchSteps {
    /// Growth in bytes per step.
    pub fn growth_bytes(&self) -> Option<f64> {
        self.growth.map(Slope::value)
    }

    /// Steps per second over the window.
    pub fn steps_per_second(&self) -> Option<f64> {
        self.pace
            .map(|(steps, ms)| steps as f64 * 1000.0 / ms as f64)
    }
}

/// The bridge's threshold on reserved bytes, and its upward crossings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorchThreshold {
    pub bytes: u64,
    pub crossings: u64,
    /// Reserved is at or above the threshold now (not yet re-armed).
    pub above: bool,
}

/// `torch.cuda.memory_stats()`' `*.large_pool.current` and
/// `*.small_pool.current`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorchPools {
    pub large: TorchPool,
    pub small: TorchPool,
}

/// One allocator pool: bytes, and the number of segments (`cudaMalloc`
/// calls the pool holds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorchPool {
    pub allocated: u64,
    pub reserved: u64,
    pub inactive_split: u64,
    pub segments: u64,
}

/// The caching-allocator settings that change what the figures mean, as
/// the bridge parsed them from the process's `PYTORCH_CUDA_ALLOC_CONF`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocatorSettings {
    pub backend: AllocatorBackend,
    pub expandable_segments: bool,
    /// Blocks larger than this are never split; `None`: unlimited.
    pub max_split_size: Option<u64>,
}

/// `backend:` of `PYTORCH_CUDA_ALLOC_CONF`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AllocatorBackend {
    /// The caching allocator (the default).
    #[default]
    Native,
    /// `cudaMallocAsync` (torch's `async`): most allocator figures are 0.
    CudaMallocAsync,
}

impl AllocatorBackend {
    pub fn as_str(self) -> &'static str {
        match self {
            AllocatorBackend::Native => "native",
            AllocatorBackend::CudaMallocAsync => "cudaMallocAsync",
        }
    }
}

/// Torch bridge documents accepted and dropped so far (by reason).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorchCounters {
    pub reports: u64,
    pub malformed: u64,
    pub oversized: u64,
    pub permission: u64,
    /// Socket messages and connections whose sender the kernel could not
    /// vouch for as the process that connected.
    pub identity: u64,
    /// The bridge socket's own figures, while it listens.
    pub socket: Option<BridgeSocketCounters>,
}

/// The bridge socket (`processes.torch_bridge_socket`): what its limits
/// did, and its connections now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BridgeSocketCounters {
    /// Connections open now.
    pub connections: u64,
    /// Connections closed at once: a holder's (pod, container, Slurm job
    /// or uid) or the total cap was reached.
    pub limited_connections: u64,
    /// Connections closed at once: their holder connected too often.
    pub limited_connects: u64,
    /// Times a holder (or everyone) was paused for passing its budget of
    /// messages or bytes a second.
    pub limited_rate: u64,
    /// Documents not kept for the memory bounds (or of a process not on
    /// a GPU past its holder's allowance).
    pub limited_memory: u64,
    /// Connections closed because they passed fds.
    pub limited_fds: u64,
    /// Connections closed after long silence.
    pub idle_closed: u64,
    /// Memory of the documents kept now.
    pub held_bytes: u64,
    /// Fds waiting to be closed apart from the listener.
    pub close_waiting: u64,
    /// Rounds of the listener that took over 2 s.
    pub stalls: u64,
    /// How long the listener has been stuck now, in ms (0 unless over
    /// 2 s).
    pub stalled_ms: u64,
}
