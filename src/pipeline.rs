//! The one wiring both commands share: the daemon (`serve`) and `record`
//! start the same [`Pipeline`] — the sampler thread with attribution (the
//! pod index when the pod watcher is on, the container-engine lookup
//! thread when `containers.engine_socket` is set), the pod watcher, the
//! ResourceSlice watcher and the DRA claim reader (with both the pod
//! watcher and the pod-resources client), the pod-resources client, the
//! Slurm job-mapping reader (its own thread, started with the sampler), and
//! the config reload on SIGHUP — and differ only in where snapshots go
//! (the HTTP server, or a file through the sink).
//!
//! [`Pipeline::start`] runs on the caller's thread (the sampler opens NVML
//! on its own thread and reports a fatal error back);
//! [`Pipeline::run_background`] starts the async parts on the current
//! tokio runtime and installs the signal handlers.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::SyncSender;
use std::thread::JoinHandle;

use crate::attribute::ProcCache;
use crate::bridge;
use crate::config::{self, Config, Overrides};
use crate::containers::{self, ContainerCache};
use crate::gpu::GpuSource;
use crate::jobmap::{self, JobMap};
use crate::kube::{self, ClaimLimits, PodIndex, SliceIndex};
use crate::model::Snapshot;
use crate::podres::{self, PodResources};
use crate::publish::{Shared, Sources};
use crate::sample::{self, Control, ControlSender, OpenFailure, Parts, StartError};
use crate::signals::{self, Signals};
use crate::telemetry::Telemetry;

/// Where the running config came from, to read it again on SIGHUP.
#[derive(Debug, Clone, Default)]
pub struct Reload {
    /// `--config.file`, if given.
    pub file: Option<PathBuf>,
    /// The flags, which override the file again on every reload.
    pub flags: Overrides,
}

/// The running sampler and what feeds it.
pub struct Pipeline {
    config: Config,
    reload: Reload,
    shared: Arc<Shared>,
    telemetry: Arc<Telemetry>,
    control: ControlSender,
    sampler: Option<JoinHandle<()>>,
    pods: Option<Arc<PodIndex>>,
    pod_resources: Option<Arc<PodResources>>,
    /// This node's ResourceSlices, when both the pod watcher and the
    /// pod-resources client are on (DRA devices → GPUs).
    slices: Option<Arc<SliceIndex>>,
    /// The DRA claims' limits, with the slices.
    claims: Option<Arc<ClaimLimits>>,
}

impl Pipeline {
    /// Start the sampler thread, opening the GPU source with `open` on that
    /// thread; every published snapshot also goes to `sink` when given
    /// (from the first one on). Returns once the first snapshot is
    /// published or NVML is being retried; a fatal open error is returned.
    pub fn start<G, E, F>(
        config: Config,
        reload: Reload,
        sink: Option<SyncSender<Arc<Snapshot>>>,
        open: F,
    ) -> Result<Pipeline, StartError<E>>
    where
        G: GpuSource + 'static,
        E: std::error::Error + Send + 'static,
        F: Fn() -> Result<G, OpenFailure<E>> + Send + 'static,
    {
        let telemetry = Arc::new(Telemetry::new());
        let shared = Arc::new(Shared::new(
            config.timing.sample_interval,
            Arc::clone(&telemetry),
        ));
        if sink.is_some() {
            shared.set_sink(sink);
        }
        // NVML first: a host without a driver says so before any source
        // starts (or logs anything).
        let (control, control_rx) = sample::control_channel();
        let opened = sample::spawn(open, config.sampler(), Arc::clone(&shared), control_rx)?;
        // The sources, each started here and nowhere else; publish copies
        // each one's state into every snapshot.
        let mut sources = Sources {
            pod_resources: config
                .pod_resources
                .as_ref()
                .and_then(PodResources::if_socket_exists),
            job_mapping: config.job_mapping.as_ref().and_then(|cfg| {
                let store = Arc::new(JobMap::default());
                match jobmap::spawn(cfg.clone(), &store) {
                    Ok(_) => Some(store),
                    Err(e) => {
                        tracing::error!(error = %e, "cannot start the Slurm job-mapping reader thread: gpu_allocation_info has no Slurm rows");
                        None
                    }
                }
            }),
            pods: config
                .kubernetes
                .as_ref()
                .map(|_| Arc::new(PodIndex::new())),
            ..Sources::default()
        };
        if let Some(engine) = &config.container_engine {
            // Its own thread from the start (also for `record`); it ends
            // when the sampler drops the cache.
            let (cache, queue) = ContainerCache::new();
            match containers::lookup::spawn(engine, Arc::clone(&cache), queue) {
                Ok(_) => sources.containers = Some(cache),
                Err(e) => tracing::error!(
                    "container engine lookups are off: cannot start their thread: {e}"
                ),
            }
        }
        let bridge = bridge::spawn(&config.attribution);
        sources.bridge = bridge.as_ref().map(|b| b.bridge());
        let slices = (sources.pods.is_some() && sources.pod_resources.is_some())
            .then(|| Arc::new(SliceIndex::new()));
        sources.claims = slices.as_ref().map(|_| Arc::new(ClaimLimits::new()));
        let mut lookup = ProcCache::from_config(&config.attribution, sources.pods.clone());
        if let Some(store) = &sources.job_mapping {
            // A Slurm job's owner from the mapping, where it gives one.
            lookup = lookup.with_job_owners(Arc::clone(store) as _);
        }
        if let Some(cache) = &sources.containers {
            lookup = lookup.with_container_engine(Arc::clone(cache));
        }
        shared.set_sources(sources.clone());
        let sampler = opened.attribute(Parts {
            procs: lookup,
            bridge: bridge.map(|b| Box::new(b) as Box<dyn bridge::Figures>),
        })?;
        let Sources {
            pods,
            pod_resources,
            claims,
            ..
        } = sources;
        Ok(Pipeline {
            config,
            reload,
            shared,
            telemetry,
            control,
            sampler: Some(sampler),
            pods,
            pod_resources,
            slices,
            claims,
        })
    }

    /// The latest snapshot, health and readiness.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The exporter's own counters outside the sampler.
    pub fn telemetry(&self) -> &Arc<Telemetry> {
        &self.telemetry
    }

    /// The config the pipeline started with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// On the current tokio runtime: install the signal handlers, start
    /// the pod watcher and the pod-resources client (when on) and the
    /// config reload on SIGHUP. Returns the signals for the caller's own
    /// loop.
    pub fn run_background(&self) -> Signals {
        let signals = signals::install();
        if let (Some(k), Some(index)) = (&self.config.kubernetes, &self.pods) {
            tokio::spawn(kube::run_watcher(k.clone(), Arc::clone(index)));
        }
        if let (Some(k), Some(slices)) = (&self.config.kubernetes, &self.slices) {
            tokio::spawn(kube::run_slice_watcher(k.clone(), Arc::clone(slices)));
        }
        let claims = match (&self.config.kubernetes, &self.claims) {
            (Some(k), Some(store)) => {
                let (requests, answers) = kube::claim_channel();
                tokio::spawn(kube::run_claim_reader(
                    k.clone(),
                    Arc::clone(store),
                    answers,
                ));
                Some(requests)
            }
            _ => None,
        };
        if let (Some(p), Some(store)) = (&self.config.pod_resources, &self.pod_resources) {
            let resolver = podres::Resolver::new(self.slices.clone(), self.pods.clone());
            tokio::spawn(podres::run(p.clone(), Arc::clone(store), resolver, claims));
        }
        tokio::spawn(reload_on_sighup(
            self.reload.clone(),
            self.config.clone(),
            self.control.clone(),
            Arc::clone(&self.telemetry),
            signals.clone(),
        ));
        signals
    }

    /// Tell the sampler to stop, without waiting for it (a hung NVML call
    /// must not hold up the exit).
    pub fn stop(mut self) {
        let _ = self.control.send(Control::Stop);
        self.sampler = None;
    }

    /// Stop the sampler and wait for it; the sink (if any) is closed after
    /// its last snapshot, so a writer reading it sees the end.
    pub fn stop_and_join(mut self) {
        let _ = self.control.send(Control::Stop);
        if let Some(t) = self.sampler.take() {
            let _ = t.join();
        }
        self.shared.set_sink(None);
    }
}

/// On SIGHUP, re-read the config file with the same flags. A bad file keeps
/// the running config (logged, counted). Intervals, peak window, the
/// process knobs and the collectors apply at once; keys that need a restart
/// are named in a warning.
async fn reload_on_sighup(
    reload: Reload,
    mut current: Config,
    control: ControlSender,
    telemetry: Arc<Telemetry>,
    mut signals: Signals,
) {
    loop {
        signals.hangup().await;
        let env = |k: &str| std::env::var(k).ok();
        match config::load(reload.file.as_deref(), &reload.flags, &env) {
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
                let _ = control.send(Control::Reconfigure(Box::new(new.sampler())));
                tracing::info!("config reloaded");
                current = new;
            }
        }
    }
}
