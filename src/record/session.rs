//! One recording, as the steps it takes: start the [`Pipeline`] with a
//! sink (the sampler first, so no file is left behind when NVML cannot
//! load), open the output, start the writer thread, wait for the end
//! (duration, signal, the command's exit, or a writer that stopped), stop
//! the sampler, let the writer finish, and turn what happened into an
//! exit code.

use std::ffi::OsString;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{Receiver, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use super::child::{self, EXIT_CANNOT_START};
use super::format::{Classifier, EncodeError, Encoder, Format, Stamp};
use super::output::{self, OutputError, Target};
use super::summary::{self, Tracker};
use super::{csv, openmetrics, regroup, trace};
use crate::config::{Config, HumanDuration};
use crate::gpu::GpuSource;
use crate::model::Snapshot;
use crate::pipeline::{Pipeline, Reload};
use crate::sample::OpenFailure;
use crate::signals::Signals;

/// Snapshots the writer may fall behind by before samples are dropped:
/// about 100 s of memory samples at the default 100 ms.
pub(crate) const SINK_CAPACITY: usize = 1024;

/// What to record, where, for how long.
#[derive(Debug, Clone)]
pub struct Options {
    pub target: Target,
    pub format: Format,
    /// `None`: until a stop signal or the command's exit.
    pub duration: Option<Duration>,
    /// Overwrite an existing regular file.
    pub force: bool,
    /// `-- COMMAND ARGS…`; empty: none.
    pub command: Vec<OsString>,
}

/// Why a recording could not start.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error(transparent)]
    Output(#[from] OutputError),
    #[error("{0}")]
    Sampler(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("cannot start the recorder: {0}")]
    Runtime(#[source] std::io::Error),
    #[error(transparent)]
    Encode(#[from] EncodeError),
}

/// The encoder of `format`.
pub(crate) fn encoder(format: Format, started: &Stamp) -> Box<dyn Encoder> {
    match format {
        Format::Csv => Box::new(csv::Csv::default()),
        Format::Trace => Box::new(trace::Trace::new(started)),
        Format::OpenMetrics => Box::new(openmetrics::OpenMetrics::new(&openmetrics::host_name())),
    }
}

/// What a finished recording holds.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Summary {
    pub samples: u64,
    pub rows: u64,
    pub bytes: u64,
}

/// Why the writer stopped early.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WriteError {
    #[error(transparent)]
    Output(#[from] OutputError),
    #[error(transparent)]
    Encode(#[from] EncodeError),
    #[error("the writer thread panicked")]
    Panicked,
}

/// Write every snapshot `rx` yields until it disconnects; the output is
/// finished (trailer written) on every way out but a failed write.
pub(crate) fn write_all(
    mut out: output::Output,
    mut enc: Box<dyn Encoder>,
    rx: Receiver<Arc<Snapshot>>,
    tracker: Option<&Mutex<Tracker>>,
) -> Result<Summary, WriteError> {
    let mut kinds = Classifier::default();
    let mut buf = Vec::with_capacity(64 * 1024);
    let mut summary = Summary::default();
    for s in rx.iter() {
        if let Some(t) = tracker {
            t.lock().unwrap_or_else(|e| e.into_inner()).add(&s);
        }
        let kind = kinds.next(&s);
        let at = Stamp::new(s.taken_at);
        buf.clear();
        match enc.sample(&s, kind, &at, &mut buf) {
            Ok(rows) => summary.rows += rows,
            Err(e) => {
                let _ = out.finish();
                return Err(e.into());
            }
        }
        out.write(&buf)?;
        summary.samples += 1;
    }
    summary.bytes = out.finish()?;
    Ok(summary)
}

/// How the recording loop ended.
enum Stopped {
    Duration,
    Signal,
    Exited(std::io::Result<ExitStatus>),
    CannotStart(std::io::Error),
    WriterEnded,
}

/// Record as `opts` says with the pipeline `cfg` configures, opening the
/// GPU source with `open` (on the sampler thread). Returns the exit code:
/// the command's (when there is one), 1 when writing failed (said on
/// stderr as it happens), 127 when the command cannot be started, else 0.
/// An error is returned when nothing could be recorded at all.
pub fn run<G, E, F>(cfg: Config, reload: Reload, opts: Options, open: F) -> Result<u8, RecordError>
where
    G: GpuSource + 'static,
    E: std::error::Error + Send + Sync + 'static,
    F: Fn() -> Result<G, OpenFailure<E>> + Send + 'static,
{
    // The output path first, without creating it: a bad one is the only
    // line printed. Then the sampler: its first snapshot waits in the
    // channel while the output is opened, and no file is left behind when
    // NVML cannot load.
    output::check(&opts.target, opts.force)?;
    let (sink_tx, sink_rx) = sync_channel(SINK_CAPACITY);
    let pipeline = Pipeline::start(cfg, reload, Some(sink_tx), open)
        .map_err(|e| RecordError::Sampler(Box::new(e)))?;
    let command_pid = Arc::new(AtomicU32::new(0));
    let tracker = Arc::new(Mutex::new(Tracker::new(
        Arc::clone(&command_pid),
        std::path::Path::new(&pipeline.config().attribution.procfs),
    )));
    let started = match Writer::start(&opts, sink_rx, Arc::clone(&tracker))
        .and_then(|w| Ok((w, runtime()?)))
    {
        Ok(s) => s,
        Err(e) => {
            pipeline.stop_and_join();
            return Err(e);
        }
    };
    let (mut writer, runtime) = started;
    let t = pipeline.config().timing;
    tracing::info!(
        output = %writer.name,
        format = opts.format.name(),
        sample_interval = %HumanDuration(t.sample_interval),
        memory_sample_interval = %HumanDuration(t.memory_sample_interval),
        duration = %opts.duration.map(|d| HumanDuration(d).to_string()).unwrap_or_else(|| "until stopped".into()),
        "recording"
    );
    let (stopped, child) = runtime.block_on(async {
        let signals = pipeline.run_background();
        wait_for_end(&opts, signals, &mut writer.done, &command_pid).await
    });
    let dropped = pipeline.shared().sink_dropped();
    pipeline.stop_and_join();
    let mut code = writer.finish();
    if dropped > 0 {
        tracing::warn!(
            dropped,
            "samples left out of the recording because writing them fell behind"
        );
    }
    let Some((end, command_code)) = conclude(stopped, child, &runtime, &opts, &mut code) else {
        return Ok(EXIT_CANNOT_START);
    };
    let report = tracker
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .report(&end, command_code);
    write_summary(&opts.target, &report);
    Ok(code)
}

/// How the recording ended, and the command's exit code when it ran:
/// waits for a command still running after a duration or a writer's end
/// (a command that could not start is said here, and `None` returned);
/// sets `code` from the command's where writing did not fail.
fn conclude(
    stopped: Stopped,
    mut child: Option<tokio::process::Child>,
    runtime: &tokio::runtime::Runtime,
    opts: &Options,
    code: &mut u8,
) -> Option<(String, Option<i32>)> {
    let end = match &stopped {
        Stopped::Exited(_) => "exited",
        Stopped::CannotStart(_) => "cannot_start",
        Stopped::Duration => "duration",
        Stopped::Signal => "interrupted",
        Stopped::WriterEnded => "writer_ended",
    };
    let status = match stopped {
        Stopped::Exited(status) => Some(status),
        Stopped::CannotStart(e) => {
            let program = opts
                .command
                .first()
                .map(|p| p.to_string_lossy().into_owned());
            eprintln!(
                "gpumem-exporter: cannot start the command {:?}: {e}",
                program.unwrap_or_default()
            );
            return None;
        }
        Stopped::Duration | Stopped::WriterEnded if child.is_some() => {
            tracing::info!("recording stopped; waiting for the command to exit");
            Some(runtime.block_on(child::wait(&mut child)))
        }
        Stopped::Duration | Stopped::WriterEnded | Stopped::Signal => None,
    };
    let mut command_code = None;
    let mut end = end.to_string();
    match status {
        Some(Ok(s)) => {
            let c = child::exit_code(s);
            tracing::info!(status = %s, "command exited");
            if std::os::unix::process::ExitStatusExt::signal(&s).is_some() {
                end = "signalled".into();
            }
            command_code = Some(i32::from(c));
            if *code == 0 {
                *code = c;
            }
        }
        Some(Err(e)) => {
            eprintln!("gpumem-exporter: cannot wait for the command: {e}");
            *code = 1;
        }
        None => {}
    }
    Some((end, command_code))
}

/// The summary on stderr, and as JSON beside a recording in a file. A
/// summary that cannot be written is said, and changes no exit code.
fn write_summary(target: &Target, report: &summary::Report) {
    eprint!("{}", report.text());
    let Target::Path(p) = target else {
        return;
    };
    let path = summary::json_path(p);
    let written = serde_json::to_vec_pretty(report)
        .map_err(std::io::Error::other)
        .and_then(|json| std::fs::write(&path, json));
    if let Err(e) = written {
        eprintln!(
            "gpumem-exporter: cannot write the summary {}: {e}",
            path.display()
        );
    }
}

/// The recorder's runtime: signals, the pod watcher, the pod-resources
/// client and the command, on one thread.
fn runtime() -> Result<tokio::runtime::Runtime, RecordError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(RecordError::Runtime)
}

/// The writer thread and how to hear that it stopped.
struct Writer {
    name: String,
    thread: JoinHandle<Result<Summary, WriteError>>,
    done: tokio::sync::oneshot::Receiver<()>,
}

impl Writer {
    /// Open the output (header written) and start writing what `rx` yields.
    fn start(
        opts: &Options,
        rx: Receiver<Arc<Snapshot>>,
        tracker: Arc<Mutex<Tracker>>,
    ) -> Result<Writer, RecordError> {
        let started = Stamp::new(SystemTime::now());
        let mut enc = encoder(opts.format, &started);
        let header = enc.header()?;
        let out = output::Output::create(&opts.target, opts.force, &header, enc.trailer())?;
        let name = out.name().to_string();
        // An OpenMetrics file the recorder wrote by position is regrouped
        // after a clean end (`regroup.rs`); a stream cannot be.
        let regroup = match &opts.target {
            Target::Path(p) if opts.format == Format::OpenMetrics && out.is_regular_file() => {
                Some(p.clone())
            }
            _ => None,
        };
        let (done_tx, done) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("recorder".into())
            .spawn(move || {
                let mut r = write_all(out, enc, rx, Some(&tracker));
                if let (Ok(summary), Some(path)) = (&mut r, regroup) {
                    match regroup::regroup(&path) {
                        Ok(done) => summary.bytes = done.bytes,
                        Err(e) => tracing::warn!(
                            error = %e,
                            "the recording is left as written (promtool reads it; a strict OpenMetrics parser does not)"
                        ),
                    }
                }
                let _ = done_tx.send(());
                r
            })
            .map_err(RecordError::Runtime)?;
        Ok(Writer { name, thread, done })
    }

    /// Wait for the writer (the sink is closed); log what it wrote. Returns
    /// 0, or 1 when writing failed (said on stderr).
    fn finish(self) -> u8 {
        match self.thread.join().unwrap_or(Err(WriteError::Panicked)) {
            Ok(s) => {
                tracing::info!(
                    output = %self.name,
                    samples = s.samples,
                    rows = s.rows,
                    bytes = s.bytes,
                    "recording stopped"
                );
                0
            }
            Err(e) => {
                eprintln!("gpumem-exporter: {e}");
                1
            }
        }
    }
}

/// Start the command (if any) and wait for the first way out: the
/// duration, a stop signal (only without a command: with one, the
/// recording follows the command), the command's exit, the writer's end.
async fn wait_for_end(
    opts: &Options,
    mut signals: Signals,
    writer_done: &mut tokio::sync::oneshot::Receiver<()>,
    command_pid: &AtomicU32,
) -> (Stopped, Option<tokio::process::Child>) {
    let mut child = None;
    if let Some((program, args)) = opts.command.split_first() {
        match child::start(program, args, opts.target == Target::Stdout) {
            Ok(c) => {
                command_pid.store(c.id().unwrap_or(0), Ordering::Release);
                child = Some(c);
            }
            Err(e) => return (Stopped::CannotStart(e), None),
        }
    }
    let sleep = async {
        match opts.duration {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(sleep);
    let mut signalled = false;
    let stopped = loop {
        tokio::select! {
            _ = &mut sleep => break Stopped::Duration,
            status = child::wait(&mut child) => break Stopped::Exited(status),
            _ = signals.stopped(), if !signalled => {
                if child.is_none() {
                    break Stopped::Signal;
                }
                signalled = true;
                tracing::info!("stop signal received; the recording goes on until the command exits");
            }
            _ = &mut *writer_done => break Stopped::WriterEnded,
        }
    };
    (stopped, child)
}
