//! The config file as serde reads it. These types stay here: validation
//! ([`super::build`]) turns them into the runtime [`Config`](super::Config).

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, Visitor};

use crate::collectors;

use super::values::{
    AllowedHost, ApiUrl, CmdlineLength, HumanDuration, Interval, JobMappingFormat, KubeMode,
    ListenAddress, LogFormat, LogLevel, SeriesModeValue, TelemetryPath,
};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileConfig {
    pub(super) web: FileWeb,
    pub(super) sample_interval: Option<Interval>,
    pub(super) memory_sample_interval: Option<Interval>,
    pub(super) peak_window: Option<Interval>,
    pub(super) mig_rescan_interval: Option<Interval>,
    pub(super) series_budget: Option<u64>,
    pub(super) nvml: FileNvml,
    pub(super) log: FileLog,
    pub(super) path: FilePath,
    pub(super) processes: FileProcesses,
    pub(super) kubernetes: FileKubernetes,
    pub(super) collectors: FileCollectors,
    pub(super) slurm: FileSlurm,
    pub(super) containers: FileContainers,
    pub(super) limits: FileLimits,
}

/// `limits:` — the cgroup-keyed limit sources' reads.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileLimits {
    pub(super) interval: Option<Interval>,
}

/// `collectors:` — each collector on (true) or off (false), by its name in
/// the registry ([`collectors::REGISTRY`]); absent keys keep their default.
/// A name the registry does not have is refused while reading, so the
/// error carries the line and column.
#[derive(Debug, Default)]
pub(super) struct FileCollectors(Vec<(&'static collectors::Def, bool)>);

impl FileCollectors {
    /// The choices in file order.
    pub(super) fn choices(&self) -> impl Iterator<Item = (&'static collectors::Def, bool)> + '_ {
        self.0.iter().copied()
    }
}

impl<'de> Deserialize<'de> for FileCollectors {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> Visitor<'de> for Visit {
            type Value = FileCollectors;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of collector names to true or false")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<FileCollectors, A::Error> {
                let mut out = Vec::new();
                while let Some(name) = map.next_key::<String>()? {
                    let Some(def) = collectors::find(&name) else {
                        let names: Vec<&str> =
                            collectors::REGISTRY.iter().map(|d| d.name).collect();
                        return Err(de::Error::custom(format!(
                            "unknown field `{name}`, expected one of {}",
                            names.join(", ")
                        )));
                    };
                    out.push((def, map.next_value::<bool>()?));
                }
                Ok(FileCollectors(out))
            }
        }
        d.deserialize_map(Visit)
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FilePath {
    pub(super) procfs: Option<String>,
    pub(super) cgroupfs: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileProcesses {
    pub(super) enabled: Option<bool>,
    pub(super) min_bytes: Option<u64>,
    pub(super) top_n: Option<u32>,
    pub(super) series: Option<SeriesModeValue>,
    pub(super) byte_seconds: Option<bool>,
    pub(super) cmdline: Option<bool>,
    pub(super) cmdline_max_length: Option<CmdlineLength>,
    pub(super) passwd_file: Option<String>,
    pub(super) torch_bridge: Option<bool>,
    pub(super) torch_bridge_socket: Option<String>,
    pub(super) torch_bridge_fd_scan: Option<bool>,
    pub(super) uninterruptible_after: Option<Interval>,
    pub(super) idle_after: Option<HumanDuration>,
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

/// `containers:` — the container engine's API; off while unset or empty.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileContainers {
    pub(super) engine_socket: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileSlurm {
    pub(super) job_mapping_dir: Option<String>,
    pub(super) job_mapping_format: Option<JobMappingFormat>,
    pub(super) job_mapping_interval: Option<Interval>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileWeb {
    pub(super) listen_address: Option<ListenAddress>,
    pub(super) telemetry_path: Option<TelemetryPath>,
    pub(super) allowed_hosts: Option<Vec<AllowedHost>>,
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
