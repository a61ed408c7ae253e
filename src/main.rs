//! gpumem-exporter: flags → config → `Pipeline::start` (sampler thread,
//! pod watcher, pod-resources client, config reload; the wiring `record`
//! shares) → serve HTTP or record to a file. The only place for `anyhow`:
//! every component returns its own typed error.
//!
//! Exit codes: 0 clean shutdown, 1 NVML could not be loaded or initialised
//! (or the listen address could not be bound), 2 bad flags, config or web
//! config file. `record` (see `gpumem_exporter::record`) exits with its
//! command's code when it runs one, 127 when that cannot be started, 1 when
//! the output cannot be written, 2 for bad flags.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Arg, ArgAction, ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use gpumem_exporter::{
    COLLECTORS, Config, HumanDuration, NvmlInitError as InitError, NvmlSource, OpenFailure,
    Overrides, Pipeline, RecordFormat, RecordOptions, RecordOutputError, RecordTarget as Target,
    Reload, Web,
};

#[derive(Debug, Parser)]
#[command(
    name = "gpumem-exporter",
    version,
    about = "Prometheus exporter for GPU memory per GPU and per process (NVML)"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Sub>,
    /// YAML config file (see config.example.yaml). Flags override its values.
    #[arg(long = "config.file", global = true, value_name = "PATH")]
    config_file: Option<PathBuf>,
    /// Address to listen on: host:port, :port or [v6]:port [default: :9877]
    #[arg(long = "web.listen-address", value_name = "ADDR")]
    listen_address: Option<String>,
    /// Path that serves metrics [default: /metrics]
    #[arg(long = "web.telemetry-path", value_name = "PATH")]
    telemetry_path: Option<String>,
    /// TLS, basic auth and connection limits (exporter-toolkit format; re-read on SIGHUP)
    #[arg(long = "web.config.file", value_name = "PATH")]
    web_config_file: Option<PathBuf>,
    /// How often GPUs and their processes are sampled, e.g. 500ms, 2s [default: 1s]
    #[arg(long = "sample-interval", global = true, value_name = "DURATION")]
    sample_interval: Option<String>,
    /// Memory-only samples between full samples, for peaks [default: 100ms]
    #[arg(
        long = "memory-sample-interval",
        global = true,
        value_name = "DURATION"
    )]
    memory_sample_interval: Option<String>,
    /// Peaks are the maximum over this window; keep it >= the scrape interval [default: 30s]
    #[arg(long = "peak-window", global = true, value_name = "DURATION")]
    peak_window: Option<String>,
    /// How often each GPU's MIG mode and instances are read again [default: 30s]
    #[arg(long = "mig-rescan-interval", global = true, value_name = "DURATION")]
    mig_rescan_interval: Option<String>,
    /// Path of libnvidia-ml.so.1 [default: found by the dynamic loader]
    #[arg(long = "nvml.library", global = true, value_name = "PATH")]
    nvml_library: Option<String>,
    /// Where /proc is, e.g. /host/proc when the host's is mounted there [default: /proc]
    #[arg(long = "path.procfs", global = true, value_name = "PATH")]
    procfs: Option<String>,
    /// Where the cgroup filesystem is, e.g. /host/sys/fs/cgroup (who owns each cgroup on a process's path) [default: /sys/fs/cgroup]
    #[arg(long = "path.cgroupfs", global = true, value_name = "PATH")]
    cgroupfs: Option<String>,
    /// Slurm job-mapping directory a prolog writes (GPU → job) [default: off]
    #[arg(long = "slurm.job-mapping-dir", global = true, value_name = "DIR")]
    job_mapping_dir: Option<String>,
    /// dcgm or jobstats: the layout of --slurm.job-mapping-dir [default: dcgm]
    #[arg(
        long = "slurm.job-mapping-format",
        global = true,
        value_name = "FORMAT"
    )]
    job_mapping_format: Option<String>,
    /// The container engine's Unix socket (Docker, or `podman system service`), for container names, images and compose labels; empty: off [default: off]
    #[arg(long = "containers.engine-socket", global = true, value_name = "PATH")]
    engine_socket: Option<String>,
    /// The driver's per-cgroup memory limits and the kernel's dmem limits are read this often [default: 10s]
    #[arg(long = "limits.interval", global = true, value_name = "DURATION")]
    limits_interval: Option<String>,
    /// A process holding GPU memory that ran no kernel this long is idle (gpu_process_idle_seconds) [default: 30m]
    #[arg(long = "processes.idle-after", global = true, value_name = "DURATION")]
    idle_after: Option<String>,
    /// error, warn, info, debug or trace [default: info]
    #[arg(long = "log.level", global = true, value_name = "LEVEL")]
    log_level: Option<String>,
    /// logfmt or json [default: logfmt]
    #[arg(long = "log.format", global = true, value_name = "FORMAT")]
    log_format: Option<String>,
}

#[derive(Debug, Subcommand)]
enum Sub {
    /// Record GPU and process memory to a file (CSV, Chrome trace or
    /// OpenMetrics) with the daemon's sampler and no HTTP server, for a
    /// while, until SIGINT/SIGTERM, or while a command runs
    Record(RecordArgs),
}

#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  gpumem-exporter record -o run.csv -- python3 train.py\n  gpumem-exporter record -o run.trace.json --duration 10m\n  gpumem-exporter record -o run.om --duration 1h   # then: promtool tsdb create-blocks-from openmetrics run.om DATA_DIR\n\nFormats, columns and exit codes: docs/record.md"
)]
struct RecordArgs {
    /// File to write, or - for standard output
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    output: String,
    /// csv, trace or openmetrics [default: from the file name: .csv; .json, .trace.json; .om]
    #[arg(long = "format", value_name = "FORMAT", value_parser = parse_format)]
    format: Option<RecordFormat>,
    /// Stop after this long, e.g. 90s, 10m [default: at SIGINT/SIGTERM or when COMMAND exits]
    #[arg(long = "duration", value_name = "DURATION", value_parser = parse_duration)]
    duration: Option<Duration>,
    /// Overwrite FILE if it exists
    #[arg(long = "force")]
    force: bool,
    /// Run this command, record while it runs, exit with its code
    #[arg(last = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

fn parse_format(s: &str) -> Result<RecordFormat, String> {
    s.parse()
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = s.parse::<HumanDuration>()?.0;
    if d.is_zero() {
        return Err(format!("duration {s:?} must be more than 0"));
    }
    Ok(d)
}

/// Open NVML from `library`; a library that cannot be loaded is fatal,
/// anything else is retried.
fn open_nvml(library: Option<&str>) -> Result<NvmlSource, OpenFailure<InitError>> {
    NvmlSource::open(library).map_err(|e| match e {
        // A library that cannot be loaded will not appear by itself.
        InitError::Load { .. } => OpenFailure::Fatal(e),
        // A driver not loaded yet (boot), a permission not granted
        // yet (udev), a GPU not answering: keep trying.
        _ => OpenFailure::Retry(e),
    })
}

/// `--collector.<name>` and `--no-collector.<name>` for every row of the
/// collector registry, global (they apply after `record` too); the later of
/// the two wins.
fn collector_flags(cmd: clap::Command) -> clap::Command {
    COLLECTORS.iter().fold(cmd, |cmd, def| {
        let (on, off) = (
            format!("collector.{}", def.name),
            format!("no-collector.{}", def.name),
        );
        let default = match (def.switchable, def.default) {
            (false, _) => format!("always on (--no-collector.{} is refused)", def.name),
            (true, true) => "on".to_string(),
            (true, false) => "off".to_string(),
        };
        cmd.arg(
            Arg::new(on.clone())
                .long(on.clone())
                .action(ArgAction::SetTrue)
                .global(true)
                .overrides_with(off.clone())
                .help(format!(
                    "Collector {}: {} [default: {default}]",
                    def.name, def.help
                )),
        )
        .arg(
            Arg::new(off.clone())
                .long(off)
                .action(ArgAction::SetTrue)
                .global(true)
                .overrides_with(on)
                .help(format!("Switch the {} collector off", def.name)),
        )
    })
}

/// The collector flags given, as (name, on).
fn collector_choices(m: &ArgMatches) -> Vec<(&'static str, bool)> {
    COLLECTORS
        .iter()
        .filter_map(|def| {
            let given = |id: String| m.get_flag(&id);
            if given(format!("collector.{}", def.name)) {
                Some((def.name, true))
            } else if given(format!("no-collector.{}", def.name)) {
                Some((def.name, false))
            } else {
                None
            }
        })
        .collect()
}

impl Cli {
    /// The flags that override config file keys.
    fn overrides(&self) -> Overrides {
        Overrides {
            listen_address: self.listen_address.clone(),
            telemetry_path: self.telemetry_path.clone(),
            sample_interval: self.sample_interval.clone(),
            memory_sample_interval: self.memory_sample_interval.clone(),
            peak_window: self.peak_window.clone(),
            mig_rescan_interval: self.mig_rescan_interval.clone(),
            nvml_library: self.nvml_library.clone(),
            log_level: self.log_level.clone(),
            log_format: self.log_format.clone(),
            procfs: self.procfs.clone(),
            cgroupfs: self.cgroupfs.clone(),
            job_mapping_dir: self.job_mapping_dir.clone(),
            job_mapping_format: self.job_mapping_format.clone(),
            engine_socket: self.engine_socket.clone(),
            idle_after: self.idle_after.clone(),
            limits_interval: self.limits_interval.clone(),
            collectors: Vec::new(),
        }
    }
}

fn main() -> ExitCode {
    // Two malloc arenas are plenty for a sampler and a few HTTP threads;
    // glibc's default (8 per core) keeps freed memory in per-thread arenas
    // and lets RSS creep up after bursts of concurrent scrapes. Blocks of
    // 128 KiB and more (a large host's bodies and their segments) are
    // mapped and unmapped on their own: glibc's default raises that bar to
    // the largest block freed so far, after which every body is carved
    // from an arena that keeps the freed room (+1 MiB at 8 GPUs × 256
    // processes under sequential scrapes, BENCHMARKS.md "At the defaults").
    // The body cache writes each new body into the last one's buffer
    // (`http::cache`), so the mapped pages are reused, not faulted in anew.
    // SAFETY: mallopt only tunes the allocator; called before any thread.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
    let matches = collector_flags(Cli::command()).get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    let overrides = Overrides {
        collectors: collector_choices(&matches),
        ..cli.overrides()
    };
    let env = |k: &str| std::env::var(k).ok();
    let cfg = match gpumem_exporter::load_config(cli.config_file.as_deref(), &overrides, &env) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpumem-exporter: {e}");
            return ExitCode::from(2);
        }
    };
    gpumem_exporter::init_logging(&cfg.log);
    if let Some(Sub::Record(args)) = cli.command {
        let web_flags = [
            ("--web.listen-address", cli.listen_address.is_some()),
            ("--web.telemetry-path", cli.telemetry_path.is_some()),
            ("--web.config.file", cli.web_config_file.is_some()),
        ];
        if let Some((flag, _)) = web_flags.iter().find(|(_, given)| *given) {
            eprintln!("gpumem-exporter: {flag} does not apply to record, which serves no HTTP");
            return ExitCode::from(2);
        }
        let reload = Reload {
            file: cli.config_file.clone(),
            flags: overrides,
        };
        return record_main(cfg, reload, args);
    }
    let web = match Web::load(cli.web_config_file) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("gpumem-exporter: {e}");
            return ExitCode::from(2);
        }
    };
    let reload = Reload {
        file: cli.config_file,
        flags: overrides,
    };
    match serve(cfg, reload, web) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::from(1)
        }
    }
}

/// `gpumem-exporter record`: exit 2 when the format cannot be told, 1 when
/// nothing could be recorded, else what `gpumem_exporter::record` says.
fn record_main(cfg: Config, reload: Reload, args: RecordArgs) -> ExitCode {
    let target = Target::parse(&args.output);
    if let Target::Path(p) = &target
        && p.is_dir()
    {
        // Said before the format, which a directory's name cannot tell.
        eprintln!(
            "gpumem-exporter: {}",
            RecordOutputError::Directory {
                path: p.display().to_string()
            }
        );
        return ExitCode::from(1);
    }
    let format = match RecordFormat::for_target(&target, args.format) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("gpumem-exporter: {e}");
            return ExitCode::from(2);
        }
    };
    let opts = RecordOptions {
        target,
        format,
        duration: args.duration,
        force: args.force,
        command: args.command,
    };
    let library = cfg.nvml_library.clone();
    match gpumem_exporter::record(cfg, reload, opts, move || open_nvml(library.as_deref())) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("gpumem-exporter: {e}");
            ExitCode::from(1)
        }
    }
}

/// The daemon: the pipeline, then the HTTP server until SIGTERM/SIGINT.
fn serve(cfg: Config, reload: Reload, web: Web) -> anyhow::Result<()> {
    tracing::info!(
        version = gpumem_exporter::VERSION,
        revision = gpumem_exporter::REVISION,
        config = %gpumem_exporter::describe_config(reload.file.as_ref()),
        "starting gpumem-exporter"
    );
    let library = cfg.nvml_library.clone();
    let started = std::time::Instant::now();
    let pipeline = Pipeline::start(cfg.clone(), reload, None, move || {
        open_nvml(library.as_deref())
    })?;
    if let Some(s) = pipeline.shared().latest() {
        tracing::info!(
            init_ms = started.elapsed().as_millis() as u64,
            gpus = s.devices.len(),
            interval = %HumanDuration(cfg.timing.sample_interval),
            "NVML initialised"
        );
    }

    // HTTP threads: scrapes are served from cached bytes, so a few threads
    // carry any realistic load; more cores only shorten queues under many
    // concurrent scrapers.
    let http_threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(2, 4);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(http_threads)
        .enable_all()
        .thread_name("http")
        .build()?;
    runtime.block_on(async {
        let signals = pipeline.run_background();
        let shared = Arc::clone(pipeline.shared());
        let telemetry = Arc::clone(pipeline.telemetry());
        gpumem_exporter::serve(&cfg.http, shared, web, telemetry, signals).await
    })?;
    pipeline.stop();
    tracing::info!("stopped");
    Ok(())
}
