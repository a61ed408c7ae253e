//! The config file as serde reads it. These types stay here: validation
//! ([`super::build`]) turns them into the runtime [`Config`](super::Config).

use serde::Deserialize;

use super::values::{
    ApiUrl, CmdlineLength, Interval, KubeMode, ListenAddress, LogFormat, LogLevel, TelemetryPath,
};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileConfig {
    pub(super) web: FileWeb,
    pub(super) sample_interval: Option<Interval>,
    pub(super) memory_sample_interval: Option<Interval>,
    pub(super) peak_window: Option<Interval>,
    pub(super) mig_rescan_interval: Option<Interval>,
    pub(super) nvml: FileNvml,
    pub(super) log: FileLog,
    pub(super) path: FilePath,
    pub(super) processes: FileProcesses,
    pub(super) kubernetes: FileKubernetes,
    pub(super) collectors: FileCollectors,
}

/// `collectors:` — each collector on (true) or off (false); absent keys
/// keep their default.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileCollectors {
    pub(super) memory: Option<bool>,
    pub(super) processes: Option<bool>,
    pub(super) utilization: Option<bool>,
    pub(super) process_utilization: Option<bool>,
    pub(super) power_thermal: Option<bool>,
    pub(super) health: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FilePath {
    pub(super) procfs: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileProcesses {
    pub(super) enabled: Option<bool>,
    pub(super) min_bytes: Option<u64>,
    pub(super) top_n: Option<u32>,
    pub(super) cmdline: Option<bool>,
    pub(super) cmdline_max_length: Option<CmdlineLength>,
    pub(super) passwd_file: Option<String>,
    pub(super) torch_bridge: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileKubernetes {
    pub(super) enabled: Option<KubeMode>,
    pub(super) node_name: Option<String>,
    pub(super) api_url: Option<ApiUrl>,
    pub(super) token_file: Option<String>,
    pub(super) ca_file: Option<String>,
    pub(super) pod_resources_socket: Option<String>,
    pub(super) pod_resources_interval: Option<Interval>,
    pub(super) pod_resources_extra_resources: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileWeb {
    pub(super) listen_address: Option<ListenAddress>,
    pub(super) telemetry_path: Option<TelemetryPath>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileNvml {
    pub(super) library: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileLog {
    pub(super) level: Option<LogLevel>,
    pub(super) format: Option<LogFormat>,
}

// ------------------------------------------------------------------ flags
