//! gpumem-exporter: flags → config → sampler thread + HTTP server.
//!
//! Exit codes: 0 clean shutdown, 1 NVML could not be loaded or initialised
//! (or the listen address could not be bound), 2 bad flags, config or web
//! config file.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;

use gpumem_exporter::gpu::nvml::{InitError, NvmlSource};
use gpumem_exporter::sampler::Shared;
use gpumem_exporter::{config, kube, logging, metrics, procfs, sampler, server, web};

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

fn main() -> ExitCode {
    // Two malloc arenas are plenty for a sampler and a few HTTP threads;
    // glibc's default (8 per core) keeps freed memory in per-thread arenas
    // and lets RSS creep up after bursts of concurrent scrapes.
    // SAFETY: mallopt only tunes the allocator; called before any thread.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
    let cli = Cli::parse();
    let overrides = config::Overrides {
        listen_address: cli.listen_address,
        telemetry_path: cli.telemetry_path,
        sample_interval: cli.sample_interval,
        memory_sample_interval: cli.memory_sample_interval,
        peak_window: cli.peak_window,
        nvml_library: cli.nvml_library,
        log_level: cli.log_level,
        log_format: cli.log_format,
        procfs: cli.procfs,
    };
    let env = |k: &str| std::env::var(k).ok();
    let cfg = match config::load(cli.config_file.as_deref(), &overrides, &env) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpumem-exporter: {e}");
            return ExitCode::from(2);
        }
    };
    logging::init(cfg.log_level, cfg.log_format);
    let web = match web::Web::load(cli.web_config_file) {
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

fn timing(cfg: &config::Config) -> sampler::Timing {
    sampler::Timing {
        sample_interval: cfg.sample_interval,
        memory_sample_interval: cfg.memory_sample_interval,
        peak_window: cfg.peak_window,
    }
}

fn selection(cfg: &config::Config) -> sampler::Selection {
    sampler::Selection {
        enabled: cfg.processes.enabled,
        min_bytes: cfg.processes.min_bytes,
        top_n: cfg.processes.top_n,
    }
}

/// On SIGHUP, re-read the config file with the same flags. A bad file keeps
/// the running config (logged, counted). Intervals, peak window and the
/// process knobs apply at once; keys that need a restart are named in a
/// warning.
async fn reload_on_sighup(
    file: Option<PathBuf>,
    flags: config::Overrides,
    mut current: config::Config,
    control: std::sync::mpsc::Sender<sampler::Control>,
) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot install the SIGHUP handler; config reload is off");
        return;
    };
    while hup.recv().await.is_some() {
        let env = |k: &str| std::env::var(k).ok();
        match config::load(file.as_deref(), &flags, &env) {
            Err(e) => {
                config::RELOAD_FAILURE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::error!("config reload failed, keeping the running config: {e}");
            }
            Ok(new) => {
                config::RELOAD_SUCCESS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let restart = config::restart_needed(&current, &new);
                if !restart.is_empty() {
                    tracing::warn!(
                        keys = %restart.join(","),
                        "config reloaded; these changed keys take effect only after a restart"
                    );
                }
                let _ = control.send(sampler::Control::Reconfigure(timing(&new), selection(&new)));
                tracing::info!("config reloaded");
                current = new;
            }
        }
    }
}

fn run(
    cfg: config::Config,
    config_file: Option<PathBuf>,
    overrides: config::Overrides,
    web: web::Web,
) -> anyhow::Result<()> {
    tracing::info!(
        version = metrics::VERSION,
        revision = metrics::REVISION,
        config = %config::describe(config_file.as_ref()),
        "starting gpumem-exporter"
    );
    let shared = Arc::new(Shared::new(cfg.sample_interval));
    let (control_tx, control_rx) = std::sync::mpsc::channel::<sampler::Control>();
    let library = cfg.nvml_library.clone();
    let started = std::time::Instant::now();
    let mut lookup = sampler::ProcCache::new(procfs::ProcRoot::new(&cfg.procfs))
        .with_users(procfs::UserNames::new(&cfg.processes.passwd_file));
    if cfg.processes.torch_bridge {
        lookup = lookup.with_torch_bridge();
    }
    if let Some(max) = cfg.processes.cmdline {
        lookup = lookup.with_cmdline(max);
    }
    let pods = cfg
        .kubernetes
        .as_ref()
        .map(|_| Arc::new(kube::PodIndex::new()));
    if let Some(p) = &pods {
        lookup = lookup.with_pods(Arc::clone(p));
    }
    let _sampler = sampler::spawn(
        move || {
            NvmlSource::open(library.as_deref()).map_err(|e| match e {
                // A library that cannot be loaded will not appear by itself.
                InitError::Load { .. } => sampler::OpenFailure::Fatal(e),
                // A driver not loaded yet (boot), a permission not granted
                // yet (udev), a GPU not answering: keep trying.
                _ => sampler::OpenFailure::Retry(e),
            })
        },
        lookup,
        timing(&cfg),
        selection(&cfg),
        Arc::clone(&shared),
        control_rx,
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    if let Some(p) = shared.latest() {
        tracing::info!(
            init_ms = started.elapsed().as_millis() as u64,
            gpus = p.snapshot.devices.len(),
            interval = %config::HumanDuration(cfg.sample_interval),
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
    if let (Some(k), Some(index)) = (&cfg.kubernetes, pods) {
        tracing::info!(api = %k.api_url, node = %k.node_name, "watching this node's pods");
        runtime.spawn(kube::run_watcher(
            kube::KubeConfig {
                api_url: k.api_url.clone(),
                node_name: k.node_name.clone(),
                token: None,
                token_file: k.token_file.clone(),
                ca_file: k.ca_file.clone(),
            },
            index,
        ));
    }
    let reload_tx = control_tx.clone();
    let reload_base = cfg.clone();
    runtime.spawn(async move {
        reload_on_sighup(config_file, overrides, reload_base, reload_tx).await;
    });
    runtime.block_on(server::serve(cfg, shared, web))?;
    let _ = control_tx.send(sampler::Control::Stop);
    tracing::info!("stopped");
    Ok(())
}
