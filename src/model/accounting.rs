//! What the ledger (`crate::accounting`) has integrated so far: memory-time
//! and busy-time per GPU, per process, per workload, and allocated and idle
//! seconds per allocation row. Plain totals, copied (`Arc`) into every
//! snapshot when it is published, so a scrape shows counters exact to the
//! snapshot it encodes.
//!
//! The per-process and per-workload totals change only when a GPU's
//! process list changes (a full sample): in between, each GPU carries the
//! seconds its current list has held since it was folded in
//! ([`GpuAccount::pending_seconds`]) and its list's bytes summed per
//! workload ([`GpuAccount::live`]), and a process's (a workload's) total
//! is its folded total plus its bytes × those seconds, computed when
//! encoded. A memory sample so costs a few additions per GPU, and an
//! encode a few per workload, whatever the process count.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::{Allocation, DraAllocation, JobAllocation, ProcIdentity};

/// A process on a GPU: the GPU's UUID, the pid and the process's start
/// time (`ProcIdentity::start_time`).
pub type ProcessKey = (Arc<str>, u32, Option<u64>);

/// The totals as of one published snapshot.
#[derive(Debug, Clone, Default)]
pub struct Accounts {
    /// Per GPU ever seen since start, by UUID (a GPU that is lost or
    /// re-enumerated keeps its totals).
    pub gpus: Arc<BTreeMap<Arc<str>, GpuAccount>>,
    /// Byte-seconds of each process on each GPU (GPU UUID, pid, start
    /// time: a reused pid is another process, counted from 0) up to the
    /// last fold of that GPU's process list; present while the process is.
    pub processes: Arc<HashMap<ProcessKey, f64>>,
    /// Per workload and GPU, up to the last fold; kept for
    /// [`WORKLOAD_GRACE_SECONDS`] after the workload's last process left.
    pub workloads: Arc<BTreeMap<(Workload, Arc<str>), WorkloadAccount>>,
    /// Per allocation row (device plugin, DRA, Slurm): present while the
    /// row is, and kept for the same grace after it left.
    pub allocations: Arc<BTreeMap<AllocationRow, AllocationAccount>>,
    /// Seconds since the allocation rows were last folded: each present
    /// row's total is its folded one plus these (and its idle total too
    /// while it is idle).
    pub allocation_pending_seconds: f64,
    /// Seconds from the ledger's first sample to this one, on the
    /// monotonic clock the totals were integrated with.
    pub seconds: f64,
    /// What the workload ranking adds to the live totals: the last hour's
    /// whole minutes and the workloads that ended (changes once a minute).
    pub ranking: Arc<RankBase>,
}

/// Memory-time and busy time of one workload summed over its GPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WorkloadTotals {
    pub used_byte_seconds: f64,
    pub busy_seconds: f64,
}

impl WorkloadTotals {
    pub fn add(&mut self, other: WorkloadTotals) {
        self.used_byte_seconds += other.used_byte_seconds;
        self.busy_seconds += other.busy_seconds;
    }
}

/// The ranking's history, kept by `accounting::ranking` at each whole
/// minute of the ledger's clock; a snapshot's ranking is this plus the
/// live totals since the last whole minute. Bounded: see
/// [`RANK_MINUTES`], [`RANK_WORKLOADS_PER_MINUTE`], [`RANK_ENDED_WORKLOADS`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankBase {
    /// Ledger seconds at which the last-hour window starts: the oldest
    /// whole minute kept, at most [`RANK_MINUTES`] minutes back (0 in the
    /// first hour).
    pub window_start: f64,
    /// Per workload, the sum over the window's whole minutes.
    pub hour: HashMap<Workload, WorkloadTotals>,
    /// The window's minutes' totals of the workloads left out of a minute
    /// that had more than [`RANK_WORKLOADS_PER_MINUTE`].
    pub hour_omitted: WorkloadTotals,
    /// Each (workload, GPU) of the ledger at the last whole minute: its
    /// totals then and when its account was made (a later account is a
    /// new one, counted from 0).
    pub boundary: HashMap<(Workload, Arc<str>), (WorkloadTotals, f64)>,
    /// Workloads whose accounts the ledger dropped after the grace, with
    /// what they had: kept for the since-start ranking.
    pub ended: HashMap<Workload, WorkloadTotals>,
    /// Totals of the ended workloads forgotten to keep [`Self::ended`]
    /// bounded (the smallest first).
    pub ended_omitted: WorkloadTotals,
}

/// Minutes the last-hour ranking covers: the window is the last 59–60
/// whole minutes plus the current one, at most 3,600 s.
pub const RANK_MINUTES: usize = 60;

/// Workloads kept per minute of the last-hour ring (the largest by
/// memory-time); the rest of that minute is summed as omitted.
pub const RANK_WORKLOADS_PER_MINUTE: usize = 512;

/// Ended workloads kept for the since-start ranking; past it the
/// smallest by memory-time are forgotten (and summed as omitted).
pub const RANK_ENDED_WORKLOADS: usize = 1024;

/// How long a workload's (or an allocation row's) totals outlive it: a
/// workload that comes back within it carries on counting; after it, it
/// starts from 0 (a counter reset, which Prometheus' `increase` handles).
pub const WORKLOAD_GRACE_SECONDS: u64 = 300;

/// One GPU's totals.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuAccount {
    /// The NVML index it had when last seen: the `gpu` label.
    pub gpu: Arc<str>,
    /// ∫ used bytes dt, in byte-seconds.
    pub used_byte_seconds: f64,
    /// ∫ utilisation dt (0–1 × seconds); `None` while its utilisation was
    /// never read (collector off or not supported).
    pub busy_seconds: Option<f64>,
    /// Seconds the GPU's current process list has held since it was
    /// folded into [`Accounts::processes`] and [`Accounts::workloads`].
    pub pending_seconds: f64,
    /// Busy seconds over the same span.
    pub pending_busy_seconds: f64,
    /// ∫ bytes held by stale processes dt, by reason (indexed by
    /// `StaleReason as usize`); `None` while its processes were never
    /// read.
    pub stale_byte_seconds: Option<[f64; 5]>,
    /// The workloads of its current process list, each with its
    /// processes' bytes summed (in workload order): what each workload's
    /// totals grow by over [`Self::pending_seconds`].
    pub live: Arc<[LiveWorkload]>,
}

impl GpuAccount {
    /// Become equal to `other`, sharing its `Arc`s, without touching the
    /// reference counts of those that already are the same.
    pub fn copy_from(&mut self, other: &GpuAccount) {
        let GpuAccount {
            gpu,
            used_byte_seconds,
            busy_seconds,
            pending_seconds,
            pending_busy_seconds,
            stale_byte_seconds,
            live,
        } = other;
        if !Arc::ptr_eq(&self.gpu, gpu) {
            self.gpu = Arc::clone(gpu);
        }
        if !Arc::ptr_eq(&self.live, live) {
            self.live = Arc::clone(live);
        }
        self.used_byte_seconds = *used_byte_seconds;
        self.busy_seconds = *busy_seconds;
        self.pending_seconds = *pending_seconds;
        self.pending_busy_seconds = *pending_busy_seconds;
        self.stale_byte_seconds = *stale_byte_seconds;
    }
}

/// One workload's processes in a GPU's current list, summed.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveWorkload {
    pub workload: Workload,
    /// Bytes its processes use.
    pub bytes: u64,
    /// Of those, the bytes of its idle processes.
    pub idle_bytes: u64,
    /// Whether any of its processes is idle (with or without bytes).
    pub idle: bool,
}

/// One workload's totals on one GPU.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkloadAccount {
    pub used_byte_seconds: f64,
    /// Byte-seconds its processes held while idle (at least
    /// `processes.idle_after` without a kernel).
    pub idle_byte_seconds: f64,
    /// Busy seconds of the GPU while the workload held a process on it.
    pub busy_seconds: f64,
    /// Seconds since start (monotonic) it was last seen on the GPU.
    pub last_seen: f64,
    /// Seconds since start when this account was made.
    pub since: f64,
    /// Processes of it on the GPU in the current list.
    pub live: bool,
}

/// Who a process's memory-time is charged to: its pod, else its Slurm job,
/// else its container, else its user. Ordered, so families come out in a
/// stable order.
///
/// A pod is one workload by its UID alone: its names come from the pod
/// watcher and may arrive after its first processes were seen, and a pod
/// named late must not become two workloads (one by UID, one by names).
/// Equality, order and hash therefore read [`Workload::identity`]; the
/// names ride along, and the ledger refreshes them ([`Workload::same_names`]).
#[derive(Debug, Clone)]
pub enum Workload {
    /// A pod, by UID (from the cgroup path) with its names where the pod
    /// watcher knows them; by its names only where no UID is known.
    Pod {
        namespace: Arc<str>,
        pod: Arc<str>,
        pod_uid: Arc<str>,
    },
    SlurmJob {
        job: Arc<str>,
    },
    Container {
        container_id: Arc<str>,
    },
    User {
        user: Arc<str>,
    },
}

/// What tells one workload from another (see [`Workload`]).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Identity<'a> {
    PodUid(&'a str),
    PodNames(&'a str, &'a str),
    SlurmJob(&'a str),
    Container(&'a str),
    User(&'a str),
}

impl PartialEq for Workload {
    fn eq(&self, other: &Self) -> bool {
        self.identity() == other.identity()
    }
}

impl Eq for Workload {}

impl PartialOrd for Workload {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Workload {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.identity().cmp(&other.identity())
    }
}

impl std::hash::Hash for Workload {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.identity().hash(state);
    }
}

impl Workload {
    fn identity(&self) -> Identity<'_> {
        match self {
            Workload::Pod {
                namespace,
                pod,
                pod_uid,
            } => {
                if pod_uid.is_empty() {
                    Identity::PodNames(namespace, pod)
                } else {
                    Identity::PodUid(pod_uid)
                }
            }
            Workload::SlurmJob { job } => Identity::SlurmJob(job),
            Workload::Container { container_id } => Identity::Container(container_id),
            Workload::User { user } => Identity::User(user),
        }
    }

    /// Whether `self` and `other` (the same workload) carry the same
    /// names: false once a pod seen by UID alone has been named.
    pub fn same_names(&self, other: &Workload) -> bool {
        match (self, other) {
            (
                Workload::Pod { namespace, pod, .. },
                Workload::Pod {
                    namespace: n2,
                    pod: p2,
                    ..
                },
            ) => namespace == n2 && pod == p2,
            _ => true,
        }
    }

    /// The workload a process belongs to; `None` when nothing is known of
    /// it (not visible in /proc).
    pub fn of(ident: &ProcIdentity) -> Option<Workload> {
        if !ident.pod_uid.is_empty() || !ident.pod.is_empty() {
            return Some(Workload::Pod {
                namespace: Arc::clone(&ident.namespace),
                pod: Arc::clone(&ident.pod),
                pod_uid: Arc::clone(&ident.pod_uid),
            });
        }
        if let Some(s) = &ident.slurm {
            return Some(Workload::SlurmJob {
                job: Arc::clone(&s.job),
            });
        }
        if !ident.container_id.is_empty() {
            return Some(Workload::Container {
                container_id: Arc::clone(&ident.container_id),
            });
        }
        if !ident.user.is_empty() {
            return Some(Workload::User {
                user: Arc::clone(&ident.user),
            });
        }
        None
    }

    /// Its labels, in exposition order (empty values are left out when
    /// encoded).
    pub fn labels(&self) -> Vec<(&'static str, &str)> {
        match self {
            Workload::Pod {
                namespace,
                pod,
                pod_uid,
            } => vec![("namespace", namespace), ("pod", pod), ("pod_uid", pod_uid)],
            Workload::SlurmJob { job } => vec![("slurm_job", job)],
            Workload::Container { container_id } => vec![("container_id", container_id)],
            Workload::User { user } => vec![("user", user)],
        }
    }
}

/// One row of `gpu_allocation_info`, as the key of its totals.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum AllocationRow {
    Kube(Allocation),
    Dra(DraAllocation),
    Slurm(JobAllocation),
}

/// One allocation row's totals.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AllocationAccount {
    /// Seconds the row was allocated.
    pub seconds: f64,
    /// Of those, seconds its GPU held no process of its pod (or job).
    pub idle_seconds: f64,
    /// Seconds since start (monotonic) it was last in an answer.
    pub last_seen: f64,
    /// In the current answer.
    pub present: bool,
    /// Its GPU holds no process of its owner in the current sample.
    pub idle: bool,
}
