//! gpumem-exporter: flags → config → wire the components (sampler thread,
//! pod watcher, pod-resources client, config reload, HTTP server). The only place for `anyhow`:
//! every component returns its own typed error.
//!
//! Exit codes: 0 clean shutdown, 1 NVML could not be loaded or initialised
//! (or the listen address could not be bound), 2 bad flags, config or web
//! config file.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;

use gpumem_exporter::attribute::ProcCache;
use gpumem_exporter::attribute::kube::{self, PodIndex};
use gpumem_exporter::config::{self, Config, HumanDuration, Overrides};
use gpumem_exporter::gpu::nvml::{InitError, NvmlSource};
use gpumem_exporter::http::web_config::Web;
use gpumem_exporter::podres::{self, PodResources};
use gpumem_exporter::publish::Shared;
use gpumem_exporter::sample::{self, Control, OpenFailure};
use gpumem_exporter::signals::{self, Signals};
use gpumem_exporter::telemetry::Telemetry;
use gpumem_exporter::{expose, http, logging};

#[derive(Debug, Parser)]
#[command(
    name = "gpumem-exporter",
    version,
    about = "Prometheus exporter for GPU memory per GPU and per process (NVML)"
)]
struct Cli {
    /// YAML config file (see config.example.yaml). Flags override its values.
    #[arg(long = "config.file", value_name = "PATH")]
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
    #[arg(long = "sample-interval", value_name = "DURATION")]
    sample_interval: Option<String>,
    /// Memory-only samples between full samples, for peaks [default: 100ms]
    #[arg(long = "memory-sample-interval", value_name = "DURATION")]
    memory_sample_interval: Option<String>,
    /// Peaks are the maximum over this window; keep it >= the scrape interval [default: 30s]
    #[arg(long = "peak-window", value_name = "DURATION")]
    peak_window: Option<String>,
    /// How often each GPU's MIG mode and instances are read again [default: 30s]
    #[arg(long = "mig-rescan-interval", value_name = "DURATION")]
    mig_rescan_interval: Option<String>,
    /// Path of libnvidia-ml.so.1 [default: found by the dynamic loader]
    #[arg(long = "nvml.library", value_name = "PATH")]
    nvml_library: Option<String>,
    /// Where /proc is, e.g. /host/proc when the host's is mounted there [default: /proc]
    #[arg(long = "path.procfs", value_name = "PATH")]
    procfs: Option<String>,
    /// error, warn, info, debug or trace [default: info]
    #[arg(long = "log.level", value_name = "LEVEL")]
    log_level: Option<String>,
    /// logfmt or json [default: logfmt]
    #[arg(long = "log.format", value_name = "FORMAT")]
    log_format: Option<String>,
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
        }
    }
}

fn main() -> ExitCode {
    // Two malloc arenas are plenty for a sampler and a few HTTP threads;
    // glibc's default (8 per core) keeps freed memory in per-thread arenas
    // and lets RSS creep up after bursts of concurrent scrapes.
    // SAFETY: mallopt only tunes the allocator; called before any thread.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
    let cli = Cli::parse();
    let overrides = cli.overrides();
    let env = |k: &str| std::env::var(k).ok();
    let cfg = match config::load(cli.config_file.as_deref(), &overrides, &env) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpumem-exporter: {e}");
            return ExitCode::from(2);
        }
    };
    logging::init(&cfg.log);
    let web = match Web::load(cli.web_config_file) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("gpumem-exporter: {e}");
            return ExitCode::from(2);
        }
    };
    match run(cfg, cli.config_file, overrides, web) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::from(1)
        }
    }
}

/// On SIGHUP, re-read the config file with the same flags. A bad file keeps
/// the running config (logged, counted). Intervals, peak window and the
/// process knobs apply at once; keys that need a restart are named in a
/// warning.
async fn reload_on_sighup(
    file: Option<PathBuf>,
    flags: Overrides,
    mut current: Config,
    control: std::sync::mpsc::Sender<Control>,
    telemetry: Arc<Telemetry>,
    mut signals: Signals,
) {
    loop {
        signals.hangup().await;
        let env = |k: &str| std::env::var(k).ok();
        match config::load(file.as_deref(), &flags, &env) {
            Err(e) => {
                Telemetry::bump(&telemetry.config_reloads_failure);
                tracing::error!("config reload failed, keeping the running config: {e}");
            }
            Ok(new) => {
                Telemetry::bump(&telemetry.config_reloads_success);
                let restart = config::restart_needed(&current, &new);
                if !restart.is_empty() {
                    tracing::warn!(
                        keys = %restart.join(","),
                        "config reloaded; these changed keys take effect only after a restart"
                    );
                }
                let _ = control.send(Control::Reconfigure(new.timing, new.selection));
                tracing::info!("config reloaded");
                current = new;
            }
        }
    }
}

fn run(
    cfg: Config,
    config_file: Option<PathBuf>,
    overrides: Overrides,
    web: Web,
) -> anyhow::Result<()> {
    tracing::info!(
        version = expose::VERSION,
        revision = expose::REVISION,
        config = %config::describe(config_file.as_ref()),
        "starting gpumem-exporter"
    );
    let telemetry = Arc::new(Telemetry::new());
    let pod_resources = cfg
        .pod_resources
        .as_ref()
        .and_then(PodResources::if_socket_exists);
    let shared = Arc::new(
        Shared::new(cfg.timing.sample_interval, Arc::clone(&telemetry))
            .with_pod_resources(pod_resources.clone()),
    );
    let (control_tx, control_rx) = std::sync::mpsc::channel::<Control>();
    let library = cfg.nvml_library.clone();
    let started = std::time::Instant::now();
    let pods = cfg.kubernetes.as_ref().map(|_| Arc::new(PodIndex::new()));
    let lookup = ProcCache::from_config(&cfg.attribution, pods.clone());
    let _sampler = sample::spawn(
        move || {
            NvmlSource::open(library.as_deref()).map_err(|e| match e {
                // A library that cannot be loaded will not appear by itself.
                InitError::Load { .. } => OpenFailure::Fatal(e),
                // A driver not loaded yet (boot), a permission not granted
                // yet (udev), a GPU not answering: keep trying.
                _ => OpenFailure::Retry(e),
            })
        },
        lookup,
        cfg.timing,
        cfg.selection,
        Arc::clone(&shared),
        control_rx,
    )?;
    if let Some(s) = shared.latest() {
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
        let signals = signals::install();
        if let (Some(k), Some(index)) = (&cfg.kubernetes, pods) {
            tokio::spawn(kube::run_watcher(k.clone(), index));
        }
        if let (Some(p), Some(store)) = (&cfg.pod_resources, pod_resources) {
            tokio::spawn(podres::run(p.clone(), store));
        }
        tokio::spawn(reload_on_sighup(
            config_file,
            overrides,
            cfg.clone(),
            control_tx.clone(),
            Arc::clone(&telemetry),
            signals.clone(),
        ));
        http::serve(&cfg.http, shared, web, telemetry, signals).await
    })?;
    let _ = control_tx.send(Control::Stop);
    tracing::info!("stopped");
    Ok(())
}
