//! The sampler thread: open NVML (retrying with backoff while the driver
//! is not ready), tick on two deadlines, publish each snapshot, close and
//! re-open NVML (with backoff) when a call says the driver is gone or every
//! GPU keeps failing, and obey [`Control`] messages.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::tick::Sampler;
use crate::attribute::ProcessLookup;
use crate::backoff::Backoff;
use crate::config::{HumanDuration, SamplerConfig};
use crate::gpu::GpuSource;
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

/// Messages to the sampler thread.
#[derive(Debug, Clone)]
pub(crate) enum Control {
    Stop,
    /// New intervals, selection and collectors from a reloaded config
    /// (SIGHUP).
    Reconfigure(SamplerConfig),
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
    control: &Receiver<Control>,
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
        match control.recv_timeout(left.min(beat)) {
            Ok(c) => return Some(c),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return Some(Control::Stop),
        }
    }
}

/// Start the sampler thread. `open` runs on that thread (NVML handles stay
/// on the thread that made them). A fatal open error is returned here, so
/// the caller can exit with a clear message before serving anything. A
/// retryable one is logged once; the thread keeps retrying with backoff
/// while the server answers `/readyz` 503 and `/healthz` 200, and starts
/// sampling by itself once NVML answers. Returns once the first snapshot is
/// published or retrying has begun. The thread stops on [`Control::Stop`]
/// or when the sender is dropped.
pub(crate) fn spawn<G, P, E, F>(
    open: F,
    procs: P,
    config: SamplerConfig,
    shared: Arc<Shared>,
    control: Receiver<Control>,
) -> Result<JoinHandle<()>, StartError<E>>
where
    G: GpuSource + 'static,
    P: ProcessLookup + Send + 'static,
    E: std::error::Error + Send + 'static,
    F: Fn() -> Result<G, OpenFailure<E>> + Send + 'static,
{
    let (ready_tx, ready_rx) = sync_channel::<Result<(), E>>(1);
    let thread_shared = Arc::clone(&shared);
    let handle = std::thread::Builder::new()
        .name("sampler".into())
        .spawn(move || {
            let shared = thread_shared;
            shared.set_alive(true);
            let _guard = AliveGuard(Arc::clone(&shared));
            let mut backoff = Backoff::new(NVML_RETRY_MIN, NVML_RETRY_MAX);
            let mut attempts: u64 = 0;
            let gpu = loop {
                attempts += 1;
                match open() {
                    Ok(g) => break g,
                    Err(OpenFailure::Fatal(e)) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                    Err(OpenFailure::Retry(e)) => {
                        if attempts == 1 {
                            // Alive before the caller starts serving, so the
                            // first /healthz cannot race the first wait.
                            shared.beat();
                            tracing::error!(
                                "{e}; the exporter stays up (/readyz answers 503) and retries with backoff until NVML answers"
                            );
                            let _ = ready_tx.send(Ok(()));
                        } else {
                            tracing::debug!(attempt = attempts, "NVML still not available: {e}");
                        }
                        let wait = backoff.next_delay();
                        if let Some(Control::Stop) =
                            wait_alive(&shared, &control, wait, config.timing.sample_interval)
                        {
                            return;
                        }
                    }
                }
            };
            if attempts > 1 {
                tracing::info!(attempts, "NVML answered; sampling starts");
            }
            let mut sampler = Sampler::new(gpu, procs, config);
            shared.publish(sampler.tick());
            let _ = ready_tx.send(Ok(()));
            run_loop(sampler, &shared, &control, &open);
        })
        .map_err(StartError::Thread)?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(handle),
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

/// Next deadline after `prev`; when the loop fell behind, restart from now
/// instead of bursting to catch up.
fn advance(prev: Instant, step: Duration, now: Instant) -> Instant {
    let next = prev + step;
    if next <= now { now + step } else { next }
}

fn run_loop<G, P, E, F>(
    mut sampler: Sampler<G, P>,
    shared: &Shared,
    control: &Receiver<Control>,
    open: &F,
) where
    G: GpuSource,
    P: ProcessLookup,
    E: std::fmt::Display,
    F: Fn() -> Result<G, OpenFailure<E>>,
{
    let start = Instant::now();
    let mut t = sampler.timing();
    let mut next_full = start + t.sample_interval;
    let mut next_mem = start + t.memory_sample_interval;
    let mut failed_samples: u32 = 0;
    let mut reinit_backoff = Backoff::new(NVML_RETRY_MIN, NVML_RETRY_MAX);
    let mut next_reinit = start;
    // Whether the GPU source is closed and NVML must be opened afresh.
    let mut closed = false;
    loop {
        let fast = !closed && t.memory_sample_interval < t.sample_interval;
        let due = if fast {
            next_full.min(next_mem)
        } else {
            next_full
        };
        let wait = due.saturating_duration_since(Instant::now());
        match control.recv_timeout(wait) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(Control::Stop) | Err(RecvTimeoutError::Disconnected) => return,
            Ok(Control::Reconfigure(config)) => {
                let collectors = config.collectors.enabled();
                shared.set_interval(config.timing.sample_interval);
                t = config.timing;
                sampler.reconfigure(config);
                let now = Instant::now();
                next_full = now + t.sample_interval;
                next_mem = now + t.memory_sample_interval;
                tracing::info!(
                    sample_interval = %HumanDuration(t.sample_interval),
                    memory_sample_interval = %HumanDuration(t.memory_sample_interval),
                    peak_window = %HumanDuration(t.peak_window),
                    mig_rescan_interval = %HumanDuration(t.mig_rescan_interval),
                    collectors = %collectors.join(","),
                    "sampler reconfigured"
                );
                continue;
            }
        }
        let now = Instant::now();
        if closed {
            // Every GPU is down until NVML opens again; keep publishing so
            // /healthz sees the thread and /readyz says why.
            next_full = advance(next_full, t.sample_interval, now);
            if now >= next_reinit {
                sampler.count_reinit();
                match open() {
                    Ok(g) => {
                        sampler.replace_gpu(g);
                        closed = false;
                        failed_samples = 0;
                        let snapshot = sampler.tick();
                        tracing::info!(
                            gpus = snapshot.devices.len(),
                            answering = snapshot.devices.iter().filter(|d| d.up()).count(),
                            "NVML re-opened; devices enumerated and identified again"
                        );
                        shared.publish(snapshot);
                        next_mem = Instant::now() + t.memory_sample_interval;
                        continue;
                    }
                    Err(OpenFailure::Fatal(e)) | Err(OpenFailure::Retry(e)) => {
                        tracing::debug!("re-opening NVML failed: {e}");
                        next_reinit = now + reinit_backoff.next_delay();
                    }
                }
            }
            shared.publish(sampler.snapshot());
            continue;
        }
        let full = now >= next_full;
        let snapshot = if !full {
            next_mem = advance(next_mem, t.memory_sample_interval, now);
            sampler.tick_memory()
        } else {
            next_full = advance(next_full, t.sample_interval, now);
            next_mem = now + t.memory_sample_interval;
            sampler.tick()
        };
        let all_down = !snapshot.devices.is_empty() && snapshot.devices.iter().all(|d| !d.up());
        if let Some(e) = sampler.driver_gone() {
            tracing::error!(
                operation = %e.operation,
                error = %e.kind,
                "{}; every GPU is exported as gpu_up 0 and /readyz answers 503 while NVML is re-opened with backoff",
                e.kind.driver_gone_advice()
            );
            sampler.close_gpu();
            closed = true;
            reinit_backoff.reset();
            next_reinit = now + reinit_backoff.next_delay();
            shared.publish(sampler.snapshot());
            continue;
        }
        shared.publish(snapshot);
        if !full {
            continue;
        }
        if !all_down {
            failed_samples = 0;
            reinit_backoff.reset();
            continue;
        }
        failed_samples = failed_samples.saturating_add(1);
        if failed_samples >= REINIT_AFTER_FAILED_SAMPLES && now >= next_reinit {
            // Device handles can go stale after a GPU reset; the library is
            // let go first so the open below loads it afresh.
            sampler.close_gpu();
            sampler.count_reinit();
            match open() {
                Ok(g) => {
                    tracing::warn!(
                        "every GPU failed {failed_samples} samples in a row; NVML re-opened"
                    );
                    sampler.replace_gpu(g);
                    failed_samples = 0;
                }
                Err(OpenFailure::Fatal(e)) | Err(OpenFailure::Retry(e)) => {
                    tracing::warn!(
                        "every GPU failed {failed_samples} samples in a row and re-opening NVML failed: {e}; retrying with backoff"
                    );
                    closed = true;
                }
            }
            next_reinit = now + reinit_backoff.next_delay();
        }
    }
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
