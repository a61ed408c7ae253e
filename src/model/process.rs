//! One process on one GPU: who it is (from /proc, the cgroup, the
//! Kubernetes API, the container engine, Slurm) and what it holds.

use std::sync::Arc;

use super::{Readings, TorchStats};

/// Who a process is, from /proc (and the Kubernetes API for pod names).
/// Shared (`Arc`) between snapshots: looked up once per (pid, start time).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcIdentity {
    /// `/proc/<pid>/comm`, empty when unreadable.
    pub comm: Arc<str>,
    /// Owner's user name (host passwd), or the uid in decimal; empty when
    /// the process is not visible.
    pub user: Arc<str>,
    /// 64-hex container id from the cgroup path; empty outside containers.
    pub container_id: Arc<str>,
    /// Kubernetes pod UID from the cgroup path; empty outside pods.
    pub pod_uid: Arc<str>,
    /// The Slurm job (and step, uid) from the cgroup path; `None` outside
    /// Slurm jobs.
    pub slurm: Option<SlurmJob>,
    /// Redacted, truncated command line; `None` unless enabled.
    pub cmdline: Option<Arc<str>>,
    /// Resolved through the pod watcher; empty when unknown.
    pub namespace: Arc<str>,
    pub pod: Arc<str>,
    pub container: Arc<str>,
    /// Name, image and compose labels from the container engine's API
    /// (`containers.engine_socket`); `None` when off, not in a container,
    /// not known (yet), or when the pod watcher knows the process.
    pub engine: Option<Arc<ContainerInfo>>,
    /// `/proc/<pid>/stat`'s start time (clock ticks since boot): with the
    /// pid, which process this is (a reused pid has another); `None` when
    /// /proc does not show the process.
    pub start_time: Option<u64>,
    /// The process's cgroup v2 path (`0::` line of `/proc/<pid>/cgroup`),
    /// only where every directory on it is root's (`attribute::cgroupfs`):
    /// what the cgroup-keyed limit sources (driver, dmem) are asked about.
    /// `None` in a delegated, unverifiable or v1-only cgroup.
    pub cgroup: Option<Arc<str>>,
}

/// A container as the Docker Engine API (Docker, Podman) describes it:
/// `GET /containers/{id}/json`. Empty fields are unknown.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerInfo {
    /// `.Name` without its leading `/`.
    pub name: Arc<str>,
    /// `.Config.Image`, as the container was created from.
    pub image: Arc<str>,
    /// `.Config.Labels["com.docker.compose.project"]`.
    pub compose_project: Arc<str>,
    /// `.Config.Labels["com.docker.compose.service"]`.
    pub compose_service: Arc<str>,
}

/// Container engine API lookups so far, by outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ContainerLookups {
    /// Answered with the container.
    pub found: u64,
    /// Answered 404: the engine does not know the id (negative cache).
    pub not_found: u64,
    /// No answer: socket missing or refused, timeout, an unexpected
    /// status, a malformed body.
    pub error: u64,
}

/// A process's Slurm job, from its cgroup path (`attribute::slurm`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlurmJob {
    /// The numeric job id, or the job's SLUID where the path names it so
    /// (Slurm 26.05's default cgroup v2 layout).
    pub job: Arc<str>,
    /// `batch`, `extern`, `interactive` or the step number; empty when the
    /// process sits in the job's own cgroup.
    pub step: Arc<str>,
    /// The job owner's uid (cgroup v1 paths only); empty otherwise.
    pub uid: Arc<str>,
}

/// Processes whose cgroup named a job, pod or container that attribution
/// refused (`gpumem_exporter_attribution_rejected_total{reason}`), by
/// reason; each process (pid and start time) is counted once per reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttributionRejections {
    /// A directory on the cgroup path is owned by a non-root uid: a
    /// delegated subtree (`user@UID.service`, rootless engines).
    pub cgroup_owner: u64,
    /// The cgroup path could not be checked against the cgroup filesystem
    /// (`path.cgroupfs`): not mounted there, a path relative to another
    /// cgroup namespace, a directory gone.
    pub cgroup_unverified: u64,
    /// Slurm's or the kubelet's names, or a container's, where slurmd,
    /// the kubelet or the engines never put them.
    pub cgroup_misplaced: u64,
    /// The container id belongs to another pod than the path's pod UID.
    pub container_pod_mismatch: u64,
    /// The Slurm job's owner (the path's `uid_N`, or the job mapping's
    /// uid) is not the process's real uid.
    pub slurm_owner: u64,
}

impl AttributionRejections {
    /// `(reason, count)` in output order.
    pub fn by_reason(&self) -> [(&'static str, u64); 5] {
        [
            ("cgroup_owner", self.cgroup_owner),
            ("cgroup_unverified", self.cgroup_unverified),
            ("cgroup_misplaced", self.cgroup_misplaced),
            ("container_pod_mismatch", self.container_pod_mismatch),
            ("slurm_owner", self.slurm_owner),
        ]
    }
}

/// Processes left out of the per-process series by `processes.min_bytes`
/// or `processes.top_n`, summed so totals still add up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OtherProcesses {
    pub count: u64,
    pub used_bytes: u64,
}

/// One process on one GPU, as NVML reports it (compute and graphics lists
/// merged, one entry per pid).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessSample {
    pub pid: u32,
    /// `None` when NVML answers NVML_VALUE_NOT_AVAILABLE for this process
    /// (e.g. under some virtualisation): exported as a separate signal,
    /// never as a fake 0.
    pub used_bytes: Option<u64>,
    /// Name, owner, container and pod.
    pub ident: Arc<ProcIdentity>,
    /// MIG instance the process runs on (MIG mode only).
    pub gpu_instance_id: Option<u32>,
    pub compute_instance_id: Option<u32>,
    /// Largest `used_bytes` seen for this pid on this GPU over the last
    /// `peak_window` (full samples only).
    pub used_peak_bytes: Option<u64>,
    /// PyTorch allocator figures the process itself published for this GPU
    /// (torch bridge, read in this tick); `None` without the bridge. Behind
    /// an `Arc`: the figures are larger than the rest of a sample, and most
    /// processes have none (8 GPUs × 256 processes: 0.9 MB a list inline).
    pub torch: Option<Arc<TorchStats>>,
    /// What the switchable collectors read of this process (e.g. the
    /// `process_utilization` collector's busy percentages); empty when
    /// they are off or the GPU does not support their calls.
    pub readings: Readings,
}

/// What the per-process families (`gpu_process_*`, `gpu_processes_other`)
/// are written per (`processes.series`). The page and `/api/v1/snapshot`
/// keep every pid whatever this says: it only shapes the exposition.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SeriesMode {
    /// A series per process (`pid` label), as before this key existed.
    #[default]
    Pid,
    /// A series per workload on a GPU (its pod, else its Slurm job, else
    /// its container, else its user: [`super::Workload`]), the figures of
    /// its processes summed; no `pid` label on any family.
    Workload,
    /// No per-process family at all.
    Off,
}

/// How many series one body may hold, and how the per-process families
/// are written: what the encoder reads of the config, carried by each
/// snapshot so a reload (SIGHUP) applies with the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeriesPolicy {
    pub mode: SeriesMode,
    /// Series per body, the exporter's own `gpumem_exporter_*` families
    /// not counted (`series_budget`).
    pub budget: u64,
    /// `gpu_process_memory_used_byte_seconds_total`, a counter per process
    /// (`processes.byte_seconds`, pid mode only). Off by default: its
    /// figure is the workload counters' input, and a fleet keeps those
    /// (`gpu_workload_memory_used_byte_seconds_total`) without a series
    /// per pid.
    pub process_byte_seconds: bool,
}

/// `series_budget`'s default: far above what 8 GPUs with 1,024 processes
/// each write in pid mode, so only a budget set on purpose drops series.
pub const DEFAULT_SERIES_BUDGET: u64 = 1_000_000;

impl Default for SeriesPolicy {
    fn default() -> Self {
        SeriesPolicy {
            mode: SeriesMode::Pid,
            budget: DEFAULT_SERIES_BUDGET,
            process_byte_seconds: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full sample holds two lists of every GPU's processes for a moment
    /// (the last one and the new one): 4,096 samples at 8 GPUs × 256
    /// processes, so each byte here is 4 KiB of peak memory there. The
    /// torch figures (over 300 bytes) live behind an `Arc`.
    #[test]
    fn a_process_sample_stays_small() {
        let size = std::mem::size_of::<ProcessSample>();
        assert!(size <= 128, "{size} bytes");
    }
}
