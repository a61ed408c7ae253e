//! The sampler thread: open NVML (retrying with backoff while the driver
//! is not ready), tick on two deadlines, publish each snapshot, close and
//! re-open NVML (with backoff) when a call says the driver is gone or every
//! GPU keeps failing, and obey [`Control`] messages.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::control::{Control, ControlReceiver};
use super::tick::Sampler;
use crate::attribute::ProcessLookup;
use crate::backoff::Backoff;
use crate::bridge::Figures;
use crate::config::{HumanDuration, SamplerConfig, Timing};
use crate::gpu::{GpuError, GpuSource};
use crate::publish::Shared;

/// Clears the `alive` flag however the thread ends (return or panic).
struct AliveGuard(Arc<Shared>);
impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.set_alive(false);
    }
}

/// Why the sampler could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError<E: std::error::Error + 'static> {
    #[error(transparent)]
    Open(E),
    #[error("cannot start the sampler thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("the sampler thread ended before NVML was opened")]
    Ended,
}

/// How opening the GPU source failed: a library that cannot be loaded at
/// all will not fix itself (fatal); a driver that is not loaded yet after a
/// reboot, or a permission that udev has not granted yet, may (retry).
#[derive(Debug)]
pub enum OpenFailure<E> {
    Fatal(E),
    Retry(E),
}

/// Waits between NVML (re)initialisation attempts: 1 s doubling to 30 s.
pub(crate) const NVML_RETRY_MIN: Duration = Duration::from_secs(1);
pub(crate) const NVML_RETRY_MAX: Duration = Duration::from_secs(30);

/// After this many full samples in which every GPU failed, NVML is opened
/// afresh (with backoff): device handles can go stale after a GPU reset.
pub(crate) const REINIT_AFTER_FAILED_SAMPLES: u32 = 3;

/// Wait up to `total`, beating the heartbeat every `beat` so `/healthz`
/// knows the thread is alive. Returns a control message if one arrives.
fn wait_alive(
    shared: &Shared,
    control: &ControlReceiver,
    total: Duration,
    beat: Duration,
) -> Option<Control> {
    let until = Instant::now() + total;
    loop {
        shared.beat();
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        if let Some(c) = control.wait_until(Instant::now() + left.min(beat)) {
            return Some(c);
        }
    }
}

/// What the sampler needs besides NVML, handed over once NVML is open:
/// attribution and the torch bridge's reader (the pipeline starts the
/// sources only after NVML answered or is being retried).
pub(crate) struct Parts<P> {
    pub(crate) procs: P,
    pub(crate) bridge: Option<Box<dyn Figures>>,
}

/// A sampler thread that opened NVML (or is retrying): hand it its
/// [`Parts`] with [`Opened::attribute`].
pub(crate) struct Opened<P> {
    handle: JoinHandle<()>,
    parts: SyncSender<Parts<P>>,
    first: Receiver<()>,
    retrying: bool,
}

impl<P> Opened<P> {
    /// Give the sampler its parts. Returns once the first snapshot is
    /// published, or at once while NVML is being retried.
    pub(crate) fn attribute<E: std::error::Error + 'static>(
        self,
        parts: Parts<P>,
    ) -> Result<JoinHandle<()>, StartError<E>> {
        if self.parts.send(parts).is_err() {
            let _ = self.handle.join();
            return Err(StartError::Ended);
        }
        if self.retrying {
            return Ok(self.handle);
        }
        match self.first.recv() {
            Ok(()) => Ok(self.handle),
            Err(_) => {
                let _ = self.handle.join();
                Err(StartError::Ended)
            }
        }
    }
}

/// Start the sampler thread. `open` runs on that thread (NVML handles stay
/// on the thread that made them), first, before any source starts. A
/// fatal open error is returned here, so the caller can exit with a clear
/// message before serving or starting anything else. A retryable one is
/// logged once; the thread keeps retrying with backoff while the server
/// answers `/readyz` 503 and `/healthz` 200, and starts sampling by itself
/// once NVML answers. Returns once NVML is open or retrying has begun; the
/// thread then waits for its [`Parts`]. It stops on [`Control::Stop`] or
/// when the sender is dropped.
pub(crate) fn spawn<G, P, E, F>(
    open: F,
    config: SamplerConfig,
    shared: Arc<Shared>,
    control: ControlReceiver,
) -> Result<Opened<P>, StartError<E>>
where
    G: GpuSource + 'static,
    P: ProcessLookup + Send + 'static,
    E: std::error::Error + Send + 'static,
    F: Fn() -> Result<G, OpenFailure<E>> + Send + 'static,
{
    let (ready_tx, ready_rx) = sync_channel::<Result<bool, E>>(1);
    let (parts_tx, parts_rx) = sync_channel::<Parts<P>>(1);
    let (first_tx, first_rx) = sync_channel::<()>(1);
    let thread_shared = Arc::clone(&shared);
    let handle = std::thread::Builder::new()
        .name("sampler".into())
        .spawn(move || {
            control.register();
            let shared = thread_shared;
            shared.set_alive(true);
            let _guard = AliveGuard(Arc::clone(&shared));
            let beat = config.timing.sample_interval;
            let Some(gpu) = open_first(&open, &shared, &control, &ready_tx, beat) else {
                return;
            };
            let _ = ready_tx.send(Ok(false));
            let Ok(Parts { procs, bridge }) = parts_rx.recv() else {
                return;
            };
            let mut sampler = Sampler::new(gpu, procs, config).with_bridge(bridge);
            shared.publish(sampler.tick());
            let _ = first_tx.send(());
            run_loop(sampler, &shared, &control, &open);
        })
        .map_err(StartError::Thread)?;
    match ready_rx.recv() {
        Ok(Ok(retrying)) => Ok(Opened {
            handle,
            parts: parts_tx,
            first: first_rx,
            retrying,
        }),
        Ok(Err(e)) => {
            let _ = handle.join();
            Err(StartError::Open(e))
        }
        Err(_) => {
            let _ = handle.join();
            Err(StartError::Ended)
        }
    }
}

/// Open NVML for the first time, retrying with backoff while the failure
/// may fix itself (heartbeat every `beat` meanwhile). A fatal error goes to
/// `spawn`'s caller through `ready`; the first retryable one is logged and
/// lets the caller start serving (`/readyz` 503) while this thread keeps
/// trying. `None`: a fatal error, or [`Control::Stop`] while waiting (a
/// reconfigure before NVML answers is not applied).
fn open_first<G, E>(
    open: &dyn Fn() -> Result<G, OpenFailure<E>>,
    shared: &Shared,
    control: &ControlReceiver,
    ready: &SyncSender<Result<bool, E>>,
    beat: Duration,
) -> Option<G>
where
    E: std::fmt::Display,
{
    let mut backoff = Backoff::new(NVML_RETRY_MIN, NVML_RETRY_MAX);
    let mut attempts: u64 = 0;
    let gpu = loop {
        attempts += 1;
        match open() {
            Ok(g) => break g,
            Err(OpenFailure::Fatal(e)) => {
                let _ = ready.send(Err(e));
                return None;
            }
            Err(OpenFailure::Retry(e)) => {
                if attempts == 1 {
                    // Alive before the caller starts serving, so the
                    // first /healthz cannot race the first wait.
                    shared.beat();
                    tracing::error!(
                        "{e}; the exporter stays up (/readyz answers 503) and retries with backoff until NVML answers"
                    );
                    let _ = ready.send(Ok(true));
                } else {
                    tracing::debug!(attempt = attempts, "NVML still not available: {e}");
                }
                let wait = backoff.next_delay();
                if let Some(Control::Stop) = wait_alive(shared, control, wait, beat) {
                    return None;
                }
            }
        }
    };
    if attempts > 1 {
        tracing::info!(attempts, "NVML answered; sampling starts");
    }
    Some(gpu)
}

/// Next deadline after `prev`; when the loop fell behind, restart from now
/// instead of bursting to catch up.
fn advance(prev: Instant, step: Duration, now: Instant) -> Instant {
    let next = prev + step;
    if next <= now { now + step } else { next }
}

/// Sample until [`Control::Stop`] (or the sender is dropped): wait for the
/// next deadline or a message, then take one step.
fn run_loop<G, P, E, F>(
    sampler: Sampler<G, P>,
    shared: &Shared,
    control: &ControlReceiver,
    open: &F,
) where
    G: GpuSource,
    P: ProcessLookup,
    E: std::fmt::Display,
    F: Fn() -> Result<G, OpenFailure<E>>,
{
    let mut run = Loop::new(sampler, shared, open);
    loop {
        match run.wait(control) {
            Some(Control::Stop) => return,
            Some(Control::Reconfigure(config)) => run.reconfigure(*config),
            None => run.step(Instant::now()),
        }
    }
}

/// Whether the sampler holds a GPU source that answers.
enum Nvml {
    /// Open; `failed_samples` full samples in a row had every GPU fail.
    Open { failed_samples: u32 },
    /// Let go (the driver is gone, or a re-open failed): every GPU is down
    /// until NVML opens again, tried at [`Loop::next_reinit`].
    Closed,
}

/// The sampling loop's state between steps.
struct Loop<'a, G: GpuSource, P: ProcessLookup, E> {
    sampler: Sampler<G, P>,
    shared: &'a Shared,
    /// Opens NVML afresh: the same function `spawn` opened it with.
    open: &'a dyn Fn() -> Result<G, OpenFailure<E>>,
    timing: Timing,
    next_full: Instant,
    next_mem: Instant,
    nvml: Nvml,
    /// Delays between re-open attempts; back to the first one after a full
    /// sample in which a GPU answered, or when the driver goes away.
    reinit_backoff: Backoff,
    /// No re-open attempt before this.
    next_reinit: Instant,
}

impl<'a, G, P, E> Loop<'a, G, P, E>
where
    G: GpuSource,
    P: ProcessLookup,
    E: std::fmt::Display,
{
    /// Just after the first snapshot: both deadlines one interval away.
    fn new(
        sampler: Sampler<G, P>,
        shared: &'a Shared,
        open: &'a dyn Fn() -> Result<G, OpenFailure<E>>,
    ) -> Self {
        let start = Instant::now();
        let timing = sampler.timing();
        Loop {
            sampler,
            shared,
            open,
            timing,
            next_full: start + timing.sample_interval,
            next_mem: start + timing.memory_sample_interval,
            nvml: Nvml::Open { failed_samples: 0 },
            reinit_backoff: Backoff::new(NVML_RETRY_MIN, NVML_RETRY_MAX),
            next_reinit: start,
        }
    }

    /// Sleep until the next deadline; a control message ends the wait
    /// early (a dropped sender reads as [`Control::Stop`]). `None`: the
    /// deadline came.
    fn wait(&self, control: &ControlReceiver) -> Option<Control> {
        control.wait_until(self.due())
    }

    /// The next deadline: the full sample's, or the memory sample's when
    /// memory is sampled faster and NVML is open (a closed source has no
    /// memory to read).
    fn due(&self) -> Instant {
        let open = matches!(self.nvml, Nvml::Open { .. });
        if open && self.timing.memory_sample_interval < self.timing.sample_interval {
            self.next_full.min(self.next_mem)
        } else {
            self.next_full
        }
    }

    /// A reloaded config (SIGHUP): both deadlines start over from now at
    /// the new intervals; selection and collectors apply from the next
    /// tick.
    fn reconfigure(&mut self, config: SamplerConfig) {
        let collectors = config.collectors.enabled();
        self.shared.set_interval(config.timing.sample_interval);
        let t = config.timing;
        self.timing = t;
        self.sampler.reconfigure(config);
        let now = Instant::now();
        self.next_full = now + t.sample_interval;
        self.next_mem = now + t.memory_sample_interval;
        tracing::info!(
            sample_interval = %HumanDuration(t.sample_interval),
            memory_sample_interval = %HumanDuration(t.memory_sample_interval),
            peak_window = %HumanDuration(t.peak_window),
            mig_rescan_interval = %HumanDuration(t.mig_rescan_interval),
            collectors = %collectors.join(","),
            "sampler reconfigured"
        );
    }

    /// One deadline came: sample, or, while NVML is closed, try to open it.
    fn step(&mut self, now: Instant) {
        match self.nvml {
            Nvml::Open { .. } => self.sample(now),
            Nvml::Closed => self.while_closed(now),
        }
    }

    /// A full sample when its deadline has come, else a memory-only one;
    /// published unless the driver went away during it (or, memory-only
    /// and no recording, it changed nothing: see
    /// [`Sampler::tick_memory_if_changed`]), then counted towards a
    /// re-open if it was a full one.
    fn sample(&mut self, now: Instant) {
        let full = now >= self.next_full;
        let snapshot = if full {
            self.next_full = advance(self.next_full, self.timing.sample_interval, now);
            self.next_mem = now + self.timing.memory_sample_interval;
            self.sampler.tick()
        } else {
            self.next_mem = advance(self.next_mem, self.timing.memory_sample_interval, now);
            if self.shared.has_sink() {
                self.sampler.tick_memory()
            } else {
                match self.sampler.tick_memory_if_changed() {
                    Some(s) => s,
                    // Nothing to publish: the thread is alive all the same.
                    None => return self.shared.beat(),
                }
            }
        };
        if let Some(e) = self.sampler.driver_gone() {
            log_driver_gone(e);
            self.close_after_driver_gone(now);
            return;
        }
        let all_down = !snapshot.devices.is_empty() && snapshot.devices.iter().all(|d| !d.up());
        self.shared.publish(snapshot);
        if full {
            self.count_full_sample(all_down, now);
        }
    }

    /// This NVML instance will not answer again: let it go, publish every
    /// GPU down (the tick's own snapshot is dropped) and re-open with
    /// backoff from the first delay.
    fn close_after_driver_gone(&mut self, now: Instant) {
        self.close();
        self.reinit_backoff.reset();
        self.next_reinit = now + self.reinit_backoff.next_delay();
        self.shared.publish(self.sampler.snapshot());
    }

    /// After a full sample: one in which a GPU answered starts the count of
    /// failed samples and the backoff over; after
    /// [`REINIT_AFTER_FAILED_SAMPLES`] in a row in which every GPU failed,
    /// NVML is opened afresh, at most once per backoff delay.
    fn count_full_sample(&mut self, all_down: bool, now: Instant) {
        let Nvml::Open { failed_samples } = &mut self.nvml else {
            return;
        };
        if !all_down {
            *failed_samples = 0;
            self.reinit_backoff.reset();
            return;
        }
        *failed_samples = failed_samples.saturating_add(1);
        let failed = *failed_samples;
        if failed >= REINIT_AFTER_FAILED_SAMPLES && now >= self.next_reinit {
            self.reopen_after_failures(failed, now);
        }
    }

    /// Device handles can go stale after a GPU reset; the library is let
    /// go first so the open loads it afresh. Whether it opens or not, the
    /// next attempt waits a backoff delay; if it did not, NVML stays
    /// closed and [`Loop::while_closed`] retries it.
    fn reopen_after_failures(&mut self, failed: u32, now: Instant) {
        self.close();
        match self.reopen() {
            Ok(()) => {
                tracing::warn!("every GPU failed {failed} samples in a row; NVML re-opened");
            }
            Err(e) => tracing::warn!(
                "every GPU failed {failed} samples in a row and re-opening NVML failed: {e}; retrying with backoff"
            ),
        }
        self.next_reinit = now + self.reinit_backoff.next_delay();
    }

    /// Every GPU is down until NVML opens again; keep publishing (each
    /// `sample_interval`) so /healthz sees the thread and /readyz says why.
    /// At `next_reinit` NVML is tried again, then after each backoff delay;
    /// once it opens, the GPUs are sampled at once.
    fn while_closed(&mut self, now: Instant) {
        self.next_full = advance(self.next_full, self.timing.sample_interval, now);
        if now >= self.next_reinit {
            match self.reopen() {
                Ok(()) => return self.first_sample_after_reopen(),
                Err(e) => {
                    tracing::debug!("re-opening NVML failed: {e}");
                    self.next_reinit = now + self.reinit_backoff.next_delay();
                }
            }
        }
        self.shared.publish(self.sampler.snapshot());
    }

    /// A full sample right after NVML opened again, so the GPUs are back
    /// without waiting for the next deadline; memory samples resume one
    /// interval after it.
    fn first_sample_after_reopen(&mut self) {
        let snapshot = self.sampler.tick();
        tracing::info!(
            gpus = snapshot.devices.len(),
            answering = snapshot.devices.iter().filter(|d| d.up()).count(),
            "NVML re-opened; devices enumerated and identified again"
        );
        self.shared.publish(snapshot);
        self.next_mem = Instant::now() + self.timing.memory_sample_interval;
    }

    /// Let go of the GPU source: every GPU is down until [`Loop::reopen`].
    fn close(&mut self) {
        self.sampler.close_gpu();
        self.nvml = Nvml::Closed;
    }

    /// Open NVML afresh over a closed source: the one open both re-opens
    /// (driver gone, every GPU failing) go through, counted whether it
    /// opens or not. The new source replaces the old one (devices
    /// enumerated again) and the count of failed samples starts over. A
    /// fatal error is retried like any other here: the exporter is
    /// already serving, and a library that loaded once may load again.
    fn reopen(&mut self) -> Result<(), E> {
        self.sampler.count_reinit();
        match (self.open)() {
            Ok(gpu) => {
                self.sampler.replace_gpu(gpu);
                self.nvml = Nvml::Open { failed_samples: 0 };
                Ok(())
            }
            Err(OpenFailure::Fatal(e) | OpenFailure::Retry(e)) => Err(e),
        }
    }
}

/// The driver said it is gone for this NVML instance (RM version mismatch,
/// driver not loaded, uninitialised): said once, with what to do about it.
fn log_driver_gone(e: &GpuError) {
    tracing::error!(
        operation = %e.operation,
        error = %e.kind,
        "{}; every GPU is exported as gpu_up 0 and /readyz answers 503 while NVML is re-opened with backoff",
        e.kind.driver_gone_advice()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_skip_when_behind() {
        let t0 = Instant::now();
        let s = Duration::from_millis(100);
        assert_eq!(advance(t0, s, t0), t0 + s);
        let late = t0 + Duration::from_millis(350);
        assert_eq!(advance(t0, s, late), late + s);
    }
}
