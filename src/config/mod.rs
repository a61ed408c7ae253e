//! YAML file + command-line flags → validated [`Config`].
//!
//! The top [`Config`] is composed of each component's own config: the HTTP
//! server takes [`Http`], the sampler [`Timing`] and [`Selection`], the
//! attribution [`Attribution`], the pod watcher [`KubeConfig`], logging
//! [`Log`]. They are plain runtime types; the serde types (`file`) stay
//! apart, and `build` — validation — is the one place that turns one into
//! the other and reports config errors. Value types (`values`) validate
//! while they are deserialised, so YAML errors carry the line and column,
//! and flags reuse the same parsers through `FromStr`.

mod components;
mod file;
mod values;
pub(crate) mod yaml;

use std::borrow::Cow;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

pub use crate::kube::KubeConfig;
pub(crate) use components::{
    Attribution, ContainerEngine, Http, JobMappingConfig, Log, PodResourcesConfig, Selection,
};
pub(crate) use components::{Collectors, DEFAULT_UNINTERRUPTIBLE_AFTER};
pub use components::{SamplerConfig, Timing};
pub use values::HumanDuration;
pub(crate) use values::{
    Interval, JobMappingFormat, KubeMode, ListenAddress, LogFormat, LogLevel, TelemetryPath,
};

use crate::kube::discovery;
use file::{FileCollectors, FileConfig, FileKubernetes, FileProcesses, FileSlurm};
use yaml::{ReadError, YamlError};

use crate::collectors;

/// Default listen port (on every address). 9877 is not taken by a well-known exporter
/// (node 9100, dcgm-exporter 9400, nvitop-exporter 9445,
/// nvidia_gpu_exporter 9835).
pub(crate) const DEFAULT_PORT: u16 = 9877;
pub(crate) const DEFAULT_TELEMETRY_PATH: &str = "/metrics";
pub(crate) const DEFAULT_SAMPLE_INTERVAL: Duration = Duration::from_secs(1);
pub(crate) const DEFAULT_MEMORY_SAMPLE_INTERVAL: Duration = Duration::from_millis(100);
pub(crate) const DEFAULT_PEAK_WINDOW: Duration = Duration::from_secs(30);
/// MIG layouts are read again this often (or each full sample, when that is
/// slower). On the H200 the rescan of a GPU with MIG off is one
/// nvmlDeviceGetMigMode call of 158 µs, as much as the rest of a full
/// sample's NVML time (150 µs): every 30 s it adds 5 µs/s per GPU (3.5 %).
/// Layout changes that matter sooner are seen at once (a process on an
/// unknown instance, a stale instance handle); see docs/configuration.md.
pub(crate) const DEFAULT_MIG_RESCAN_INTERVAL: Duration = Duration::from_secs(30);
/// `limits.interval`'s default: the driver's and `dmem`'s limits change
/// when an operator or scheduler sets them, not per sample.
pub(crate) const DEFAULT_LIMITS_INTERVAL: Duration = Duration::from_secs(10);
/// Larger config files are refused before parsing.
pub(crate) const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The kubelet's pod-resources socket (kubelet flag
/// `--pod-resources-socket`'s default).
pub(crate) const DEFAULT_POD_RESOURCES_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
/// How often the kubelet is asked which devices are allocated. A `List`
/// costs the kubelet one walk of its pods (well under a millisecond for a
/// node's hundred pods); allocations change when pods start or stop, so
/// 10 s keeps the series current at a negligible cost (dcgm-exporter asks
/// on every scrape instead).
pub(crate) const DEFAULT_POD_RESOURCES_INTERVAL: Duration = Duration::from_secs(10);
/// How often the Slurm job-mapping directory is read: a prolog writes it
/// when a job starts and an epilog removes it when it ends, and one read
/// is a directory listing and a few small files (dcgm-exporter reads it
/// on every scrape instead).
pub(crate) const DEFAULT_JOB_MAPPING_INTERVAL: Duration = Duration::from_secs(5);

/// A config error: one line that names the flag or the key, and the file
/// and line it came from.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: ReadError,
    },
    #[error("config file {origin}: {source}")]
    Binary {
        origin: String,
        #[source]
        source: ReadError,
    },
    #[error("{0}")]
    Yaml(#[from] YamlError),
    #[error("flag --{flag}: {reason}")]
    Flag {
        flag: Cow<'static, str>,
        reason: String,
    },
    #[error("config file {origin}{}: key {key}: {reason}", line.map(|l| format!(" line {l}")).unwrap_or_default())]
    Key {
        origin: String,
        line: Option<usize>,
        key: Cow<'static, str>,
        reason: String,
    },
}

// ---------------------------------------------------------------- runtime

/// The validated configuration the program runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub http: Http,
    pub timing: Timing,
    pub selection: Selection,
    pub collectors: Collectors,
    /// `None`: let the dynamic loader find `libnvidia-ml.so.1`.
    pub nvml_library: Option<String>,
    pub log: Log,
    pub attribution: Attribution,
    /// `None`: the pod watcher is off.
    pub kubernetes: Option<KubeConfig>,
    /// `None`: the pod-resources client is off (`kubernetes.enabled:
    /// false`, or an empty `kubernetes.pod_resources_socket`).
    pub pod_resources: Option<PodResourcesConfig>,
    /// `None`: no Slurm job-mapping directory is read (`slurm.job_mapping_dir`
    /// unset or empty).
    pub job_mapping: Option<JobMappingConfig>,
    /// `None`: no container engine lookups (`containers.engine_socket`
    /// unset or empty).
    pub container_engine: Option<ContainerEngine>,
}

impl Config {
    /// What the sampler takes.
    pub fn sampler(&self) -> SamplerConfig {
        SamplerConfig {
            timing: self.timing,
            selection: self.selection,
            collectors: self.collectors.clone(),
            procfs: PathBuf::from(&self.attribution.procfs),
            cgroupfs: PathBuf::from(&self.attribution.cgroupfs),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            http: Http {
                listen_address: SocketAddr::from(([0, 0, 0, 0], DEFAULT_PORT)),
                telemetry_path: DEFAULT_TELEMETRY_PATH.to_string(),
                allowed_hosts: Vec::new(),
            },
            timing: Timing {
                sample_interval: DEFAULT_SAMPLE_INTERVAL,
                memory_sample_interval: DEFAULT_MEMORY_SAMPLE_INTERVAL,
                peak_window: DEFAULT_PEAK_WINDOW,
                mig_rescan_interval: DEFAULT_MIG_RESCAN_INTERVAL,
                limits_interval: DEFAULT_LIMITS_INTERVAL,
            },
            selection: Selection::default(),
            collectors: Collectors::default(),
            nvml_library: None,
            log: Log {
                level: LogLevel::Info,
                format: LogFormat::Logfmt,
            },
            attribution: Attribution::default(),
            kubernetes: None,
            pod_resources: Some(PodResourcesConfig {
                socket: PathBuf::from(DEFAULT_POD_RESOURCES_SOCKET),
                interval: DEFAULT_POD_RESOURCES_INTERVAL,
                extra_resources: Vec::new(),
            }),
            job_mapping: None,
            container_engine: None,
        }
    }
}

/// Command-line overrides, already parsed by the caller (clap). Each is
/// `None` when the flag was not given.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Overrides {
    pub listen_address: Option<String>,
    pub telemetry_path: Option<String>,
    pub sample_interval: Option<String>,
    pub memory_sample_interval: Option<String>,
    pub peak_window: Option<String>,
    pub mig_rescan_interval: Option<String>,
    /// `--limits.interval`.
    pub limits_interval: Option<String>,
    pub nvml_library: Option<String>,
    pub log_level: Option<String>,
    pub log_format: Option<String>,
    pub procfs: Option<String>,
    /// `--path.cgroupfs`.
    pub cgroupfs: Option<String>,
    pub job_mapping_dir: Option<String>,
    pub job_mapping_format: Option<String>,
    /// `--containers.engine-socket`.
    pub engine_socket: Option<String>,
    /// `--processes.idle-after`.
    pub idle_after: Option<String>,
    /// `--collector.<name>` (true) / `--no-collector.<name>` (false).
    pub collectors: Vec<(&'static str, bool)>,
}

// ---------------------------------------------------------------- runtime

/// Read the config file (if any), apply flag overrides, validate.
pub fn load(
    file: Option<&Path>,
    flags: &Overrides,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, ConfigError> {
    match file {
        Some(path) => {
            let text = read_file(path)?;
            let origin = path.display().to_string();
            build(parse_yaml(&text, &origin)?, flags, env).map_err(|e| locate(e, &text, &origin))
        }
        None => build(FileConfig::default(), flags, env).map_err(|e| locate(e, "", "")),
    }
}

/// Parse YAML text; `origin` names it in errors.
pub(crate) fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
    build(parse_yaml(text, origin)?, &Overrides::default(), &|_| None)
        .map_err(|e| locate(e, text, origin))
}

/// An error from [`build`], before it is placed in the file: about a flag
/// (already complete) or a key.
#[derive(Debug)]
enum Located {
    Flag(Cow<'static, str>, String),
    Key(Cow<'static, str>, String),
}

/// Errors found after parsing (relations between keys) name a key; add the
/// file and line where that key is written, when it is in the file.
fn locate(e: Located, text: &str, origin: &str) -> ConfigError {
    match e {
        Located::Flag(flag, reason) => ConfigError::Flag { flag, reason },
        Located::Key(key, reason) => ConfigError::Key {
            origin: origin.to_string(),
            line: yaml::line_of_key(text, &key),
            key,
            reason,
        },
    }
}

fn read_file(path: &Path) -> Result<String, ConfigError> {
    let read = |source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    };
    yaml::utf8(yaml::read_limited(path, MAX_CONFIG_BYTES).map_err(read)?).map_err(read)
}

fn parse_yaml(text: &str, origin: &str) -> Result<FileConfig, ConfigError> {
    yaml::no_nul(text.as_bytes()).map_err(|source| ConfigError::Binary {
        origin: origin.to_string(),
        source,
    })?;
    serde_saphyr::from_str::<Option<FileConfig>>(text)
        .map(Option::unwrap_or_default)
        .map_err(|e| YamlError::new(&e, text, &format!("config file {origin}")).into())
}

fn flag<T: FromStr<Err = String>>(
    name: &'static str,
    v: &Option<String>,
) -> Result<Option<T>, Located> {
    v.as_deref()
        .map(|s| s.parse::<T>().map_err(|e| Located::Flag(name.into(), e)))
        .transpose()
}

/// The sample intervals, the peak window and the MIG rescan interval:
/// flags over file keys over `d`, each checked against the full sample
/// interval.
fn timing(file: &FileConfig, o: &Overrides, d: &Timing) -> Result<Timing, Located> {
    let interval = flag::<Interval>("sample-interval", &o.sample_interval)?
        .or(file.sample_interval)
        .map(|i| i.0)
        .unwrap_or(d.sample_interval);
    let mem_flag = flag::<Interval>("memory-sample-interval", &o.memory_sample_interval)?;
    let mem_from_flag = mem_flag.is_some();
    let memory_interval = mem_flag
        .or(file.memory_sample_interval)
        .map(|i| i.0)
        .unwrap_or(d.memory_sample_interval)
        .min(if mem_from_flag || file.memory_sample_interval.is_some() {
            Duration::MAX
        } else {
            // Default: never slower than the full samples.
            interval
        });
    if memory_interval > interval {
        let msg = format!(
            "memory_sample_interval {} is longer than sample_interval {}; it must be shorter or equal",
            HumanDuration(memory_interval),
            HumanDuration(interval)
        );
        return Err(if mem_from_flag {
            Located::Flag("memory-sample-interval".into(), msg)
        } else {
            Located::Key("memory_sample_interval".into(), msg)
        });
    }
    // Default: 30s, or one sample interval when that is longer.
    let peak_window = not_below_interval(
        ("peak-window", &o.peak_window),
        ("peak_window", file.peak_window),
        d.peak_window,
        interval,
        "it must be at least one sample interval (and should be at least the scrape interval)",
    )?;
    let mig_rescan_interval = not_below_interval(
        ("mig-rescan-interval", &o.mig_rescan_interval),
        ("mig_rescan_interval", file.mig_rescan_interval),
        d.mig_rescan_interval,
        interval,
        "MIG layouts are read in full samples, so it must be at least one sample interval",
    )?;
    let limits_interval = not_below_interval(
        ("limits.interval", &o.limits_interval),
        ("limits.interval", file.limits.interval),
        d.limits_interval,
        interval,
        "the limits are read in full samples, so it must be at least one sample interval",
    )?;
    Ok(Timing {
        sample_interval: interval,
        memory_sample_interval: memory_interval,
        peak_window,
        mig_rescan_interval,
        limits_interval,
    })
}

fn build(
    file: FileConfig,
    o: &Overrides,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, Located> {
    let d = Config::default();
    let timing = timing(&file, o, &d.timing)?;
    let listen = flag::<ListenAddress>("web.listen-address", &o.listen_address)?
        .or(file.web.listen_address)
        .map(|a| a.0)
        .unwrap_or(d.http.listen_address);
    let path = flag::<TelemetryPath>("web.telemetry-path", &o.telemetry_path)?
        .or(file.web.telemetry_path)
        .map(|p| p.0)
        .unwrap_or(d.http.telemetry_path);
    let library = o
        .nvml_library
        .clone()
        .or(file.nvml.library)
        .filter(|s| !s.is_empty());
    let level = flag::<LogLevel>("log.level", &o.log_level)?
        .or(file.log.level)
        .unwrap_or(d.log.level);
    let format = flag::<LogFormat>("log.format", &o.log_format)?
        .or(file.log.format)
        .unwrap_or(d.log.format);
    let idle_after = flag::<HumanDuration>("processes.idle-after", &o.idle_after)?.map(|i| i.0);
    let (mut selection, mut attribution) = processes(file.processes, &file.path.procfs, &o.procfs);
    if let Some(after) = idle_after {
        selection.idle_after = after;
    }
    if let Some(b) = file.series_budget {
        selection.series.budget = b;
    }
    if let Some(p) = o
        .cgroupfs
        .clone()
        .or_else(|| file.path.cgroupfs.clone())
        .filter(|p| !p.is_empty())
    {
        attribution.cgroupfs = p;
    }
    let collectors = collectors(&file.collectors, &o.collectors)?;
    Ok(Config {
        http: Http {
            listen_address: listen,
            telemetry_path: path,
            allowed_hosts: file
                .web
                .allowed_hosts
                .unwrap_or_default()
                .into_iter()
                .map(|h| h.0)
                .collect(),
        },
        timing,
        selection,
        collectors,
        nvml_library: library,
        log: Log { level, format },
        attribution,
        kubernetes: kubernetes(&file.kubernetes, env)?,
        pod_resources: pod_resources(file.kubernetes)?,
        job_mapping: job_mapping(file.slurm, o)?,
        container_engine: container_engine(file.containers.engine_socket, &o.engine_socket)?,
    })
}

/// The Slurm job-mapping directory: on when `slurm.job_mapping_dir` (or
/// its flag) names one; whether it exists is seen at each read.
fn job_mapping(f: FileSlurm, o: &Overrides) -> Result<Option<JobMappingConfig>, Located> {
    let Some(dir) = o
        .job_mapping_dir
        .clone()
        .or(f.job_mapping_dir)
        .filter(|d| !d.is_empty())
    else {
        return Ok(None);
    };
    let format = flag::<JobMappingFormat>("slurm.job-mapping-format", &o.job_mapping_format)?
        .or(f.job_mapping_format)
        .unwrap_or(JobMappingFormat::Dcgm);
    let interval = f
        .job_mapping_interval
        .map(|i| i.0)
        .unwrap_or(DEFAULT_JOB_MAPPING_INTERVAL);
    Ok(Some(JobMappingConfig {
        dir: PathBuf::from(dir),
        format,
        interval,
    }))
}

/// `containers.engine_socket` (or its flag): off when unset or empty; an
/// absolute path otherwise. Whether the socket answers is seen at run time
/// (errors counted), so an engine started after the exporter is found.
fn container_engine(
    key: Option<String>,
    flag: &Option<String>,
) -> Result<Option<ContainerEngine>, Located> {
    let (value, from_flag) = match flag {
        Some(f) => (f.clone(), true),
        None => (key.unwrap_or_default(), false),
    };
    if value.is_empty() {
        return Ok(None);
    }
    let socket = PathBuf::from(&value);
    if !socket.is_absolute() {
        let msg = format!(
            "{value:?} is not an absolute path (the engine's Unix socket, e.g. /run/docker.sock)"
        );
        return Err(if from_flag {
            Located::Flag("containers.engine-socket".into(), msg)
        } else {
            Located::Key("containers.engine_socket".into(), msg)
        });
    }
    Ok(Some(ContainerEngine { socket }))
}

/// The `collectors:` map, then the `--collector.<name>` /
/// `--no-collector.<name>` flags in the order given. Names were checked
/// against the registry when the file was read and by the flag parser;
/// switching off a collector that always runs is refused here.
fn collectors(
    file: &FileCollectors,
    flags: &[(&'static str, bool)],
) -> Result<Collectors, Located> {
    let mut c = Collectors::default();
    let refused = |def: &collectors::Def| {
        format!(
            "the {} collector ({}) cannot be switched off",
            def.name, def.help
        )
    };
    for (def, on) in file.choices() {
        if !on && !def.switchable {
            return Err(Located::Key(
                format!("collectors.{}", def.name).into(),
                refused(def),
            ));
        }
        c.set(def, on);
    }
    for &(name, on) in flags {
        let Some(def) = collectors::find(name) else {
            let flag = if on { "collector" } else { "no-collector" };
            return Err(Located::Flag(
                format!("{flag}.{name}").into(),
                "no such collector".into(),
            ));
        };
        if !on && !def.switchable {
            return Err(Located::Flag(
                format!("no-collector.{name}").into(),
                refused(def),
            ));
        }
        c.set(def, on);
    }
    Ok(c)
}

/// A duration from its flag, else its file key, else `default` (raised to
/// `interval` when shorter), which must not be below the sample interval.
fn not_below_interval(
    (flag_name, flag_value): (&'static str, &Option<String>),
    (key, file_value): (&'static str, Option<Interval>),
    default: Duration,
    interval: Duration,
    why: &str,
) -> Result<Duration, Located> {
    let from_flag = flag::<Interval>(flag_name, flag_value)?;
    let from_flag_set = from_flag.is_some();
    let value = from_flag
        .or(file_value)
        .map(|i| i.0)
        .unwrap_or(default.max(interval));
    if value >= interval {
        return Ok(value);
    }
    let msg = format!(
        "{key} {} is shorter than sample_interval {}; {why}",
        HumanDuration(value),
        HumanDuration(interval)
    );
    Err(if from_flag_set {
        Located::Flag(flag_name.into(), msg)
    } else {
        Located::Key(key.into(), msg)
    })
}

/// The `processes:` keys (and `path.procfs`, or its flag) split by owner:
/// what the sampler selects, and what attribution reads.
fn processes(
    f: FileProcesses,
    procfs_key: &Option<String>,
    procfs_flag: &Option<String>,
) -> (Selection, Attribution) {
    let s = Selection::default();
    let a = Attribution::default();
    let selection = Selection {
        enabled: f.enabled.unwrap_or(s.enabled),
        min_bytes: f.min_bytes.unwrap_or(s.min_bytes),
        top_n: f.top_n.map(|n| n as usize).unwrap_or(s.top_n),
        series: crate::model::SeriesPolicy {
            mode: f.series.map_or(s.series.mode, |m| m.0),
            budget: s.series.budget,
            process_byte_seconds: f.byte_seconds.unwrap_or(s.series.process_byte_seconds),
        },
        idle_after: f.idle_after.map_or(s.idle_after, |i| i.0),
    };
    let attribution = Attribution {
        procfs: procfs_flag
            .clone()
            .or_else(|| procfs_key.clone())
            .filter(|p| !p.is_empty())
            .unwrap_or(a.procfs),
        cgroupfs: a.cgroupfs,
        passwd_file: f
            .passwd_file
            .filter(|p| !p.is_empty())
            .unwrap_or(a.passwd_file),
        cmdline: f
            .cmdline
            .unwrap_or(false)
            .then(|| f.cmdline_max_length.map(|l| l.0).unwrap_or(256)),
        torch_bridge: f.torch_bridge.unwrap_or(a.torch_bridge),
        // Empty: no socket.
        torch_bridge_socket: match f.torch_bridge_socket {
            Some(p) if p.is_empty() => None,
            Some(p) => Some(PathBuf::from(p)),
            None => a.torch_bridge_socket,
        },
        torch_bridge_fd_scan: f.torch_bridge_fd_scan.unwrap_or(a.torch_bridge_fd_scan),
        uninterruptible_after: f
            .uninterruptible_after
            .map_or(a.uninterruptible_after, |i| i.0),
    };
    (selection, attribution)
}

/// Resolve the pod watcher's settings. It runs when a cluster is known
/// (`api_url`, the in-cluster environment, a kubeconfig) and this node's
/// name is (`node_name`, `NODE_NAME`). The client itself is inferred at
/// run time by kube-rs; the keys set here override parts of it.
fn kubernetes(
    f: &FileKubernetes,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<KubeConfig>, Located> {
    let mode = f.enabled.unwrap_or(KubeMode::Auto);
    if mode == KubeMode::Off {
        return Ok(None);
    }
    let nonempty = |v: Option<String>| v.filter(|s| !s.is_empty());
    let api_url = f.api_url.clone().map(|u| u.0).filter(|u| !u.is_empty());
    let found = discovery::discover(api_url.as_deref(), env);
    if !found.any() {
        return if mode == KubeMode::On {
            Err(Located::Key(
                "kubernetes.enabled".into(),
                "is true but no API is known: set kubernetes.api_url or KUBECONFIG, or run in a cluster (KUBERNETES_SERVICE_HOST)".into(),
            ))
        } else {
            Ok(None)
        };
    }
    let Some(node_name) = nonempty(f.node_name.clone()).or_else(|| nonempty(env("NODE_NAME")))
    else {
        // A kubeconfig alone (a workstation pointed at a cluster) says
        // nothing about which node this is: without a name, auto is off.
        if mode == KubeMode::Auto && !found.named {
            return Ok(None);
        }
        return Err(Located::Key(
            "kubernetes.node_name".into(),
            "is empty and NODE_NAME is not set: the pod watcher needs this node's name (downward API spec.nodeName), or set kubernetes.enabled: false".into(),
        ));
    };
    Ok(Some(KubeConfig {
        node_name,
        api_url,
        in_cluster_url: found.in_cluster_url,
        token_file: nonempty(f.token_file.clone()).map(PathBuf::from),
        ca_file: nonempty(f.ca_file.clone()).map(PathBuf::from),
    }))
}

/// The pod-resources client's settings: on unless `kubernetes.enabled` is
/// false or the socket key is empty; whether the socket exists is seen at
/// run time.
fn pod_resources(f: FileKubernetes) -> Result<Option<PodResourcesConfig>, Located> {
    if f.enabled == Some(KubeMode::Off) {
        return Ok(None);
    }
    let socket = match f.pod_resources_socket {
        None => PathBuf::from(DEFAULT_POD_RESOURCES_SOCKET),
        Some(s) if s.is_empty() => return Ok(None),
        Some(s) => PathBuf::from(s),
    };
    let mut extra_resources = Vec::new();
    for name in f.pod_resources_extra_resources.unwrap_or_default() {
        let (domain, rest) = name.split_once('/').unwrap_or(("", ""));
        if domain.is_empty() || rest.is_empty() || name.contains(char::is_whitespace) {
            return Err(Located::Key(
                "kubernetes.pod_resources_extra_resources".into(),
                format!(
                    "invalid resource name {name:?} (an extended resource such as nvidia.com/gpu.shared)"
                ),
            ));
        }
        if !extra_resources.contains(&name) {
            extra_resources.push(name);
        }
    }
    Ok(Some(PodResourcesConfig {
        socket,
        interval: f
            .pod_resources_interval
            .map(|i| i.0)
            .unwrap_or(DEFAULT_POD_RESOURCES_INTERVAL),
        extra_resources,
    }))
}

/// Keys whose change needs a restart: they are read once at start (the
/// listener, the NVML library, /proc and passwd paths, the pod watcher,
/// logging).
pub(crate) fn restart_needed(old: &Config, new: &Config) -> Vec<&'static str> {
    let mut keys = Vec::new();
    let mut check = |changed: bool, key: &'static str| {
        if changed {
            keys.push(key);
        }
    };
    let (o, n) = (&old.attribution, &new.attribution);
    check(
        old.http.listen_address != new.http.listen_address,
        "web.listen_address",
    );
    check(
        old.http.telemetry_path != new.http.telemetry_path,
        "web.telemetry_path",
    );
    check(
        old.http.allowed_hosts != new.http.allowed_hosts,
        "web.allowed_hosts",
    );
    check(old.nvml_library != new.nvml_library, "nvml.library");
    check(old.log.level != new.log.level, "log.level");
    check(old.log.format != new.log.format, "log.format");
    check(o.procfs != n.procfs, "path.procfs");
    check(o.cgroupfs != n.cgroupfs, "path.cgroupfs");
    check(o.cmdline != n.cmdline, "processes.cmdline");
    check(o.passwd_file != n.passwd_file, "processes.passwd_file");
    check(o.torch_bridge != n.torch_bridge, "processes.torch_bridge");
    check(
        o.torch_bridge_socket != n.torch_bridge_socket,
        "processes.torch_bridge_socket",
    );
    check(
        o.torch_bridge_fd_scan != n.torch_bridge_fd_scan,
        "processes.torch_bridge_fd_scan",
    );
    check(old.kubernetes != new.kubernetes, "kubernetes");
    check(
        old.container_engine != new.container_engine,
        "containers.engine_socket",
    );
    check(
        old.pod_resources != new.pod_resources,
        "kubernetes.pod_resources_*",
    );
    check(old.job_mapping != new.job_mapping, "slurm.job_mapping_*");
    keys
}

/// Where the config came from, for the startup log line.
pub fn describe(file: Option<&PathBuf>) -> String {
    file.map(|p| p.display().to_string())
        .unwrap_or_else(|| "defaults and flags".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_defaults() {
        assert_eq!(parse("", "t").unwrap(), Config::default());
        assert_eq!(parse("# only a comment\n", "t").unwrap(), Config::default());
    }

    #[test]
    fn full_file() {
        let c = parse(
            "web:\n  listen_address: 127.0.0.1:9999\n  telemetry_path: /m\nsample_interval: 500ms\nnvml:\n  library: /x/libnvidia-ml.so.1\nlog:\n  level: debug\n  format: json\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.http.listen_address, "127.0.0.1:9999".parse().unwrap());
        assert_eq!(c.http.telemetry_path, "/m");
        assert_eq!(c.timing.sample_interval, Duration::from_millis(500));
        assert_eq!(c.nvml_library.as_deref(), Some("/x/libnvidia-ml.so.1"));
        assert_eq!(c.log.level, LogLevel::Debug);
        assert_eq!(c.log.format, LogFormat::Json);
    }

    #[test]
    fn flags_override_file() {
        let file = parse_yaml("sample_interval: 2s\nlog:\n  level: debug\n", "t").unwrap();
        let o = Overrides {
            sample_interval: Some("250ms".into()),
            ..Default::default()
        };
        let c = build(file, &o, &|_| None).unwrap();
        assert_eq!(c.timing.sample_interval, Duration::from_millis(250));
        assert_eq!(c.log.level, LogLevel::Debug);
    }

    #[test]
    fn per_process_byte_seconds_are_off_unless_asked_for() {
        let c = parse("", "t").unwrap();
        assert!(!c.selection.series.process_byte_seconds);
        let c = parse("processes:\n  byte_seconds: true\n", "t").unwrap();
        assert!(c.selection.series.process_byte_seconds);
        assert_eq!(c.selection.series.mode, crate::model::SeriesMode::Pid);
        let e = parse("processes:\n  byte_seconds: 3\n", "c.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2"), "{e}");
    }

    #[test]
    fn memory_interval_defaults_follow_sample_interval() {
        let c = parse("sample_interval: 50ms\n", "t").unwrap();
        assert_eq!(c.timing.memory_sample_interval, Duration::from_millis(50));
        let c = parse("", "t").unwrap();
        assert_eq!(c.timing.memory_sample_interval, Duration::from_millis(100));
        assert_eq!(c.timing.peak_window, Duration::from_secs(30));
    }

    #[test]
    fn collectors_from_the_file_then_the_flags() {
        let on = |c: &Config, name: &str| c.collectors.is_on(collectors::find(name).unwrap());
        let c = parse("", "t").unwrap();
        assert_eq!(c.collectors, Collectors::default());
        assert!(!on(&c, "process_utilization"), "off by default");
        assert!(on(&c, "health") && on(&c, "memory"));
        let text = "collectors:\n  health: false\n  process_utilization: true\n  memory: true\n";
        let c = parse(text, "t").unwrap();
        assert!(!on(&c, "health") && on(&c, "process_utilization"));
        let o = Overrides {
            collectors: vec![("health", true), ("utilization", false), ("memory", true)],
            ..Default::default()
        };
        let file = parse_yaml(text, "t").unwrap();
        let c = build(file, &o, &|_| None).unwrap();
        assert!(on(&c, "health"), "a flag beats the file");
        assert!(!on(&c, "utilization"));
        assert!(on(&c, "process_utilization"));

        let e = parse("collectors:\n  memory: false\n", "c.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 2: key collectors.memory: the memory collector"),
            "{e}"
        );
        let e = parse("collectors:\n  gpu_temp: true\n", "c.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `gpu_temp`"), "{e}");
        assert!(e.contains("line 2"), "{e}");
        let e = parse("collectors:\n  health: 3\n", "c.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2"), "{e}");
        let o = Overrides {
            collectors: vec![("memory", false)],
            ..Default::default()
        };
        let Err(e) = load(None, &o, &|_| None) else {
            panic!("--no-collector.memory accepted");
        };
        assert!(e.to_string().contains("--no-collector.memory"), "{e}");
    }

    #[test]
    fn bad_flag_names_the_flag() {
        let o = Overrides {
            sample_interval: Some("fast".into()),
            ..Default::default()
        };
        let Err(e) = load(None, &o, &|_| None) else {
            panic!("expected a flag error");
        };
        let e = e.to_string();
        assert!(
            e.starts_with("flag --sample-interval: invalid duration \"fast\""),
            "{e}"
        );
    }

    /// Each bad file gives one line naming the key and its line.
    #[test]
    fn bad_files_name_key_and_line() {
        let cases = [
            (
                "web:\n  listen_addres: x\n",
                "line 2 column 3: key web.listen_addres: unknown field `listen_addres`",
            ),
            (
                "sample_interval: 5x\n",
                "line 1 column 18: key sample_interval: invalid duration \"5x\"",
            ),
            (
                "log:\n  level: loud\n",
                "line 2 column 10: key log.level: invalid log level \"loud\"",
            ),
            (
                "log:\n  format: xml\n",
                "key log.format: invalid log format \"xml\"",
            ),
            (
                "web:\n  listen_address: nowhere\n",
                "key web.listen_address: invalid listen address \"nowhere\"",
            ),
            (
                "sample_interval: 1ms\n",
                "key sample_interval: interval \"1ms\" out of range",
            ),
            (
                "bogus: 1\n",
                "line 1 column 1: key bogus: unknown field `bogus`",
            ),
            ("web: 3\n", "line 1 column 6: key web:"),
            (
                "sample_interval: 1s\nmemory_sample_interval: 2s\n",
                "line 2: key memory_sample_interval: memory_sample_interval 2s is longer than sample_interval 1s",
            ),
            (
                "sample_interval: 10s\n\npeak_window: 5s\n",
                "line 3: key peak_window: peak_window 5s is shorter than sample_interval 10s",
            ),
            (
                "sample_interval: 2s\nmig_rescan_interval: 1s\n",
                "line 2: key mig_rescan_interval: mig_rescan_interval 1s is shorter than sample_interval 2s; MIG layouts are read in full samples",
            ),
        ];
        for (text, want) in cases {
            let e = parse(text, "c.yaml").unwrap_err().to_string();
            assert!(e.starts_with("config file c.yaml "), "{e}");
            assert!(e.contains(want), "{text:?}: got {e:?}, want {want:?}");
            assert!(!e.contains('\n'), "one line: {e:?}");
        }
    }

    #[test]
    fn kubernetes_settings() {
        let env = |k: &str| match k {
            "KUBERNETES_SERVICE_HOST" => Some("10.0.0.1".to_string()),
            "KUBERNETES_SERVICE_PORT" => Some("443".to_string()),
            "NODE_NAME" => Some("gpu-1".to_string()),
            _ => None,
        };
        let none = FileKubernetes::default();
        let k = kubernetes(&none, &env).unwrap().unwrap();
        assert_eq!(k.api_url, None, "inferred at run time");
        assert_eq!(k.in_cluster_url.as_deref(), Some("https://10.0.0.1:443"));
        assert_eq!(k.node_name, "gpu-1");
        assert_eq!((k.token_file, k.ca_file), (None, None));
        // auto outside a cluster: off.
        assert_eq!(kubernetes(&none, &|_| None).unwrap(), None);
        // explicit URL, node and credentials from the file.
        let f = parse_yaml(
            "kubernetes:\n  api_url: http://127.0.0.1:8001\n  node_name: n1\n  token_file: /t\n  ca_file: /c\n",
            "t",
        )
        .unwrap();
        let k = kubernetes(&f.kubernetes, &|_| None).unwrap().unwrap();
        assert_eq!(
            k,
            KubeConfig {
                node_name: "n1".into(),
                api_url: Some("http://127.0.0.1:8001".into()),
                in_cluster_url: None,
                token_file: Some("/t".into()),
                ca_file: Some("/c".into()),
            }
        );
        // on, but nothing known.
        let e = parse("kubernetes:\n  enabled: true\n", "c.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 2: key kubernetes.enabled: is true but no API is known"),
            "{e}"
        );
        let e = parse("kubernetes:\n  api_url: http://x:1\n", "c.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("key kubernetes.node_name: is empty"), "{e}");
        assert_eq!(
            parse("kubernetes:\n  enabled: false\n", "c")
                .unwrap()
                .kubernetes,
            None
        );
    }

    /// KUBECONFIG, or a ~/.kube/config that exists, turns the watcher on
    /// in auto mode when this node's name is known, and only then.
    #[test]
    fn kubeconfig_turns_the_watcher_on() {
        let home = tempfile::tempdir().unwrap();
        let home_path = home.path().to_str().unwrap().to_owned();
        let vars = |pairs: Vec<(&'static str, String)>| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(key, _)| *key == k)
                    .map(|(_, v)| v.clone())
            }
        };
        let none = FileKubernetes::default();
        let on = |env: &dyn Fn(&str) -> Option<String>| kubernetes(&none, env).unwrap();
        let kubeconfig = vars(vec![
            ("KUBECONFIG", "/etc/k.yaml".into()),
            ("NODE_NAME", "n1".into()),
        ]);
        assert_eq!(on(&kubeconfig), Some(KubeConfig::node("n1")));
        // A kubeconfig but no node name: off in auto, an error when on.
        assert_eq!(on(&vars(vec![("KUBECONFIG", "/etc/k.yaml".into())])), None);
        let forced = FileKubernetes {
            enabled: Some(KubeMode::On),
            ..FileKubernetes::default()
        };
        assert!(matches!(
            kubernetes(&forced, &vars(vec![("KUBECONFIG", "/etc/k.yaml".into())])),
            Err(Located::Key(ref k, _)) if k == "kubernetes.node_name"
        ));
        // ~/.kube/config counts once it exists.
        let home_env = vars(vec![
            ("HOME", home_path.clone()),
            ("NODE_NAME", "n1".into()),
        ]);
        assert_eq!(on(&home_env), None);
        std::fs::create_dir_all(home.path().join(".kube")).unwrap();
        std::fs::write(home.path().join(".kube/config"), "apiVersion: v1\n").unwrap();
        assert_eq!(on(&home_env), Some(KubeConfig::node("n1")));
    }

    #[test]
    fn job_mapping_settings() {
        assert_eq!(parse("", "t").unwrap().job_mapping, None);
        assert_eq!(
            parse("slurm:\n  job_mapping_dir: \"\"\n", "t")
                .unwrap()
                .job_mapping,
            None
        );
        let c = parse(
            "slurm:\n  job_mapping_dir: /run/gpustat\n  job_mapping_format: jobstats\n  job_mapping_interval: 2s\n",
            "t",
        )
        .unwrap()
        .job_mapping;
        assert_eq!(
            c,
            Some(JobMappingConfig {
                dir: PathBuf::from("/run/gpustat"),
                format: JobMappingFormat::Jobstats,
                interval: Duration::from_secs(2),
            })
        );
        // The flags: the directory alone turns it on at the defaults, and
        // override the file.
        let o = Overrides {
            job_mapping_dir: Some("/run/jobs".into()),
            ..Overrides::default()
        };
        let c = build(FileConfig::default(), &o, &|_| None).unwrap();
        assert_eq!(
            c.job_mapping,
            Some(JobMappingConfig {
                dir: PathBuf::from("/run/jobs"),
                format: JobMappingFormat::Dcgm,
                interval: DEFAULT_JOB_MAPPING_INTERVAL,
            })
        );
        let o = Overrides {
            job_mapping_dir: Some("/run/jobs".into()),
            job_mapping_format: Some("pbs".into()),
            ..Overrides::default()
        };
        assert!(matches!(
            build(FileConfig::default(), &o, &|_| None),
            Err(Located::Flag(ref f, _)) if f == "slurm.job-mapping-format"
        ));
        let err = parse("slurm:\n  job_mapping_format: lsf\n", "t").unwrap_err();
        assert!(
            err.to_string()
                .contains("key slurm.job_mapping_format: invalid job mapping format \"lsf\""),
            "{err}"
        );
    }

    #[test]
    fn pod_resources_settings() {
        let c = parse("", "t").unwrap().pod_resources.unwrap();
        assert_eq!(c.socket, Path::new(DEFAULT_POD_RESOURCES_SOCKET));
        assert_eq!(c.interval, Duration::from_secs(10));
        assert!(c.exports("nvidia.com/gpu") && c.exports("nvidia.com/mig-1g.10gb"));
        assert!(!c.exports("nvidia.com/gpu.shared") && !c.exports("example.com/fpga"));
        let c = parse(
            "kubernetes:\n  pod_resources_socket: /run/k.sock\n  pod_resources_interval: 2s\n  pod_resources_extra_resources: [nvidia.com/gpu.shared, nvidia.com/gpu.shared]\n",
            "t",
        )
        .unwrap()
        .pod_resources
        .unwrap();
        assert_eq!(
            c,
            PodResourcesConfig {
                socket: "/run/k.sock".into(),
                interval: Duration::from_secs(2),
                extra_resources: vec!["nvidia.com/gpu.shared".into()],
            }
        );
        assert!(c.exports("nvidia.com/gpu.shared"));
        for off in [
            "kubernetes:\n  enabled: false\n",
            "kubernetes:\n  pod_resources_socket: \"\"\n",
        ] {
            assert_eq!(parse(off, "t").unwrap().pod_resources, None, "{off}");
        }
        for (text, want) in [
            (
                "kubernetes:\n  pod_resources_extra_resources: [gpu]\n",
                "line 2: key kubernetes.pod_resources_extra_resources: invalid resource name \"gpu\"",
            ),
            (
                "kubernetes:\n  pod_resources_interval: 5x\n",
                "key kubernetes.pod_resources_interval: invalid duration",
            ),
        ] {
            let e = parse(text, "c.yaml").unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn process_knobs() {
        let c = parse(
            "processes:\n  enabled: true\n  min_bytes: 1048576\n  top_n: 10\n  cmdline: true\n  cmdline_max_length: 64\n  torch_bridge: false\n  torch_bridge_socket: /run/x/b.sock\n  torch_bridge_fd_scan: false\n",
            "t",
        )
        .unwrap();
        assert_eq!(
            (c.selection, c.attribution),
            (
                Selection {
                    enabled: true,
                    min_bytes: 1 << 20,
                    top_n: 10,
                    ..Selection::default()
                },
                Attribution {
                    procfs: "/proc".into(),
                    cgroupfs: "/sys/fs/cgroup".into(),
                    passwd_file: "/etc/passwd".into(),
                    cmdline: Some(64),
                    torch_bridge: false,
                    torch_bridge_socket: Some("/run/x/b.sock".into()),
                    torch_bridge_fd_scan: false,
                    uninterruptible_after: Duration::from_secs(30),
                }
            )
        );
        // An empty socket path turns the socket off; unset is the default.
        let off = parse("processes:\n  torch_bridge_socket: \"\"\n", "t").unwrap();
        assert_eq!(off.attribution.torch_bridge_socket, None);
        let default = parse("processes: {}\n", "t").unwrap();
        assert_eq!(
            default.attribution.torch_bridge_socket.as_deref(),
            Some(Path::new("/run/gpumem-exporter/bridge.sock"))
        );
        assert!(default.attribution.torch_bridge_fd_scan);
        for (text, want) in [
            (
                "processes:\n  min_bytes: -1\n",
                "line 2 column 14: key processes.min_bytes:",
            ),
            (
                "processes:\n  top_n: many\n",
                "line 2 column 10: key processes.top_n:",
            ),
            (
                "processes:\n  cmdline: yes please\n",
                "key processes.cmdline:",
            ),
            (
                "processes:\n  cmdline_max_length: 3\n",
                "key processes.cmdline_max_length: invalid length",
            ),
            (
                "kubernetes:\n  enabled: maybe\n",
                "key kubernetes.enabled: invalid value \"maybe\"",
            ),
            (
                "kubernetes:\n  api_url: ftp://x\n",
                "key kubernetes.api_url: invalid API URL",
            ),
        ] {
            let e = parse(text, "c.yaml").unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    /// config.example.yaml lists every key with its default.
    #[test]
    fn example_file_is_the_defaults() {
        let text = include_str!("../../config.example.yaml");
        assert_eq!(
            parse(text, "config.example.yaml").unwrap(),
            Config::default()
        );
    }

    #[test]
    fn binary_is_rejected() {
        let e = parse("\0\x01\x02", "c.yaml").unwrap_err().to_string();
        assert!(e.contains("binary data"), "{e}");
    }
}
