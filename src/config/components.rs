//! Each component's own config: the runtime types the HTTP server, the
//! sampler, attribution, the pod watcher and logging take. The top
//! [`Config`](super::Config) is composed of them; [`super::build`] fills
//! them from the file and flags.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::values::{JobMappingFormat, LogFormat, LogLevel};
pub(crate) use crate::collectors::Collectors;

/// The HTTP server's address, metrics path, and the `Host` names the page
/// and API answer to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Http {
    pub listen_address: SocketAddr,
    pub telemetry_path: String,
    /// `web.allowed_hosts`, lower-cased (IPv6 in brackets); empty: any
    /// `Host`.
    pub allowed_hosts: Vec<String>,
}

/// Timing of the loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// Full samples: memory, processes, /proc.
    pub sample_interval: Duration,
    /// Memory-only samples in between; `>= sample_interval` means none.
    pub memory_sample_interval: Duration,
    /// Peaks are the maximum over this much history.
    pub peak_window: Duration,
    /// Each GPU's MIG mode and instances are read again this often (and
    /// whenever a MIG call says the layout changed).
    pub mig_rescan_interval: Duration,
    /// The cgroup-keyed limits (the driver's, `dmem`) are read this often
    /// (`limits.interval`).
    pub limits_interval: Duration,
}

impl Timing {
    pub fn every(sample_interval: Duration) -> Timing {
        Timing {
            sample_interval,
            memory_sample_interval: sample_interval,
            peak_window: sample_interval,
            mig_rescan_interval: sample_interval,
            limits_interval: sample_interval,
        }
    }
}

/// Which processes get series of their own (cardinality knobs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Selection {
    /// Per-process series at all.
    pub enabled: bool,
    /// Processes using less are summed into the `pid="other"` series.
    pub min_bytes: u64,
    /// Keep at most this many processes per GPU (largest first); 0: all.
    pub top_n: usize,
    /// `processes.series` and `series_budget`: how the per-process
    /// families are written and how many series a body may hold.
    pub series: crate::model::SeriesPolicy,
    /// A process holding memory that ran no kernel this long is idle
    /// (`processes.idle_after`).
    pub idle_after: Duration,
}

/// How long a process may stay in `D` before it is `uninterruptible`
/// (`processes.uninterruptible_after`'s default).
pub(crate) const DEFAULT_UNINTERRUPTIBLE_AFTER: Duration = Duration::from_secs(30);

/// `processes.idle_after`'s default.
pub(crate) const DEFAULT_IDLE_AFTER: Duration = Duration::from_secs(30 * 60);

impl Default for Selection {
    fn default() -> Self {
        Selection {
            enabled: true,
            min_bytes: 0,
            top_n: 0,
            series: crate::model::SeriesPolicy::default(),
            idle_after: DEFAULT_IDLE_AFTER,
        }
    }
}

/// `processes.torch_bridge_socket`'s default (the Python bridge's too).
pub(crate) const DEFAULT_TORCH_BRIDGE_SOCKET: &str = "/run/gpumem-exporter/bridge.sock";

/// Who a pid is: where /proc and passwd are, what else to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attribution {
    /// Where /proc is (the host's, e.g. /host/proc, when mounted elsewhere).
    pub procfs: String,
    /// Where the cgroup filesystem is (`/sys/fs/cgroup`; the host's, e.g.
    /// /host/sys/fs/cgroup, in a container): the owner of every directory
    /// on a process's cgroup path is checked there (`attribute::cgroupfs`).
    pub cgroupfs: String,
    pub passwd_file: String,
    /// `Some(max length)` when the command line is exported.
    pub cmdline: Option<usize>,
    /// Read PyTorch allocator figures published by `gpumem_bridge`.
    pub torch_bridge: bool,
    /// Where to listen for bridge documents (`None`: no socket).
    pub torch_bridge_socket: Option<PathBuf>,
    /// Look for older bridges' memfds in `/proc/<pid>/fd`.
    pub torch_bridge_fd_scan: bool,
    /// A process in `D` this long is `uninterruptible` (stale).
    pub uninterruptible_after: Duration,
}

impl Default for Attribution {
    fn default() -> Self {
        Attribution {
            procfs: "/proc".to_string(),
            cgroupfs: "/sys/fs/cgroup".to_string(),
            passwd_file: "/etc/passwd".to_string(),
            cmdline: None,
            torch_bridge: true,
            torch_bridge_socket: Some(PathBuf::from(DEFAULT_TORCH_BRIDGE_SOCKET)),
            torch_bridge_fd_scan: true,
            uninterruptible_after: DEFAULT_UNINTERRUPTIBLE_AFTER,
        }
    }
}

/// The container engine's API (Docker, or Podman's Docker-compatible
/// service): container names, images and compose labels per process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerEngine {
    /// Its Unix socket, e.g. `/run/docker.sock`; asked only by the
    /// lookup thread.
    pub socket: PathBuf,
}

/// The kubelet's pod-resources API: which devices are allocated to which
/// container (`gpu_allocation_info`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodResourcesConfig {
    /// The kubelet's gRPC socket; when it does not exist at start, this
    /// part is off (one log line).
    pub socket: PathBuf,
    /// `List` is called this often, on its own task.
    pub interval: Duration,
    /// Resource names exported besides `nvidia.com/gpu` and
    /// `nvidia.com/mig-*`.
    pub extra_resources: Vec<String>,
}

impl PodResourcesConfig {
    /// Whether allocations of `resource` are exported.
    pub fn exports(&self, resource: &str) -> bool {
        resource == "nvidia.com/gpu"
            || resource.starts_with("nvidia.com/mig-")
            || self.extra_resources.iter().any(|r| r == resource)
    }
}

/// The Slurm job-mapping directory a prolog writes (`slurm.*`): which job
/// holds which GPU (`gpu_allocation_info` rows with `slurm_job`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobMappingConfig {
    pub dir: PathBuf,
    pub format: JobMappingFormat,
    /// The directory is read this often, on its own thread.
    pub interval: Duration,
}

/// Log level and format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Log {
    pub level: LogLevel,
    pub format: LogFormat,
}

/// Everything the sampler takes: timing, process selection and which
/// collectors run. A reload (SIGHUP) hands the sampler a new one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SamplerConfig {
    pub timing: Timing,
    pub selection: Selection,
    pub collectors: Collectors,
    /// `path.procfs`: a unified-memory GPU's figures are its `meminfo`.
    pub procfs: PathBuf,
    /// `path.cgroupfs`: where the cgroup-keyed limits are read.
    pub cgroupfs: PathBuf,
}
