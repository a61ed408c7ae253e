//! `gpumem-exporter record`: the daemon's sampler, config and attribution
//! (torch bridge and pod watcher included), with a file instead of an HTTP
//! server. Every snapshot the sampler publishes also goes to a bounded
//! channel ([`Shared::set_sink`]); a writer thread turns each into rows of
//! one format — [`csv`], [`trace`] (Chrome Trace Event JSON) or
//! [`openmetrics`] (timestamped exposition for promtool's backfill) — and
//! writes them, one write per sample, through [`output`], which keeps a
//! regular file a complete document after every sample. The sampler never
//! waits for the disk: a sample the channel has no room for is counted and
//! reported at the end.
//!
//! It stops at `--duration`, at SIGINT/SIGTERM, or when `-- COMMAND`
//! exits. With a command, a stop signal does not stop the recording: from
//! a terminal Ctrl-C reaches the command too (it runs in the recorder's
//! process group), and what it does then is worth recording; the recorder
//! never signals the command itself. docs/record.md has the formats, the
//! exit codes and what a recording costs.

pub mod csv;
pub mod openmetrics;
pub mod output;
pub mod trace;

use std::ffi::OsString;
use std::os::fd::AsFd;
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, sync_channel};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::attribute::ProcCache;
use crate::config::{Config, HumanDuration};
use crate::gpu::GpuSource;
use crate::kube::{self, PodIndex};
use crate::model::Snapshot;
use crate::publish::Shared;
use crate::sample::{self, Control, OpenFailure};
use crate::signals;
use crate::telemetry::Telemetry;

pub use output::{Kept, OutputError, Target};

/// Snapshots the writer may fall behind by before samples are dropped:
/// about 100 s of memory samples at the default 100 ms.
pub const SINK_CAPACITY: usize = 1024;

/// Exit code when the command cannot be started, as a shell says.
pub const EXIT_CANNOT_START: u8 = 127;

/// The three output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Csv,
    Trace,
    OpenMetrics,
}

impl FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Format, String> {
        match s {
            "csv" => Ok(Format::Csv),
            "trace" => Ok(Format::Trace),
            "openmetrics" => Ok(Format::OpenMetrics),
            _ => Err(format!(
                "unknown format {s:?} (use csv, trace or openmetrics)"
            )),
        }
    }
}

impl Format {
    /// The format asked for, else the one the file name says (`.csv`;
    /// `.json`, `.trace.json`; `.om`); standard output and an existing
    /// device or FIFO (`/dev/stderr`) default to CSV.
    pub fn for_target(target: &Target, asked: Option<Format>) -> Result<Format, String> {
        if let Some(f) = asked {
            return Ok(f);
        }
        let path = match target {
            Target::Stdout => return Ok(Format::Csv),
            Target::Path(p) => p,
        };
        if std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir()) {
            return Ok(Format::Csv);
        }
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("csv") => Ok(Format::Csv),
            Some("json") => Ok(Format::Trace),
            Some("om") => Ok(Format::OpenMetrics),
            _ => Err(format!(
                "cannot tell the format of {} from its name (.csv, .json, .trace.json or .om); pass --format csv|trace|openmetrics",
                path.display()
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::Csv => "csv",
            Format::Trace => "trace",
            Format::OpenMetrics => "openmetrics",
        }
    }
}

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
    Sampler(String),
    #[error("cannot start the recorder: {0}")]
    Runtime(#[source] std::io::Error),
    #[error(transparent)]
    Encode(#[from] EncodeError),
}

/// A sample could not be turned into text (a bug, never the input).
#[derive(Debug, thiserror::Error)]
#[error("cannot encode a sample: {0}")]
pub struct EncodeError(pub String);

/// Whether a snapshot comes from a memory-only or a full sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleKind {
    /// GPU memory only; processes are those of the last full sample.
    Memory,
    /// Memory, processes, MIG instances (or every GPU down while NVML is
    /// re-opened).
    Full,
}

/// Tells memory from full samples by the sampler's own counters: a full
/// tick adds to the sample duration histogram, a memory tick to
/// `memory_samples`; a snapshot that adds to neither (published while NVML
/// is closed) is treated as full.
#[derive(Debug, Default)]
pub struct Classifier {
    full: u64,
    memory: u64,
}

impl Classifier {
    pub fn next(&mut self, s: &Snapshot) -> SampleKind {
        let full = s.sample_duration.count;
        let kind = if s.memory_samples != self.memory && full == self.full {
            SampleKind::Memory
        } else {
            SampleKind::Full
        };
        self.full = full;
        self.memory = s.memory_samples;
        kind
    }
}

/// A sample's time in the forms the formats write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stamp {
    pub unix_ms: u64,
    pub unix_micros: u64,
    /// `1767225600.123`
    pub unix_seconds: String,
    /// `2026-01-01T00:00:00.123Z`
    pub rfc3339: String,
}

impl Stamp {
    pub fn new(t: SystemTime) -> Stamp {
        let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
        let unix_ms = d.as_millis() as u64;
        Stamp {
            unix_ms,
            unix_micros: d.as_micros() as u64,
            unix_seconds: format!("{}.{:03}", unix_ms / 1000, unix_ms % 1000),
            rfc3339: humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(unix_ms))
                .to_string(),
        }
    }
}

/// One output format.
pub trait Encoder: Send {
    /// Written once, when the output is opened.
    fn header(&mut self) -> Result<Vec<u8>, EncodeError>;
    /// What closes the document, kept after the last sample.
    fn trailer(&self) -> &'static [u8];
    /// Append one sample's rows to `out`; returns how many rows (lines,
    /// events) it wrote.
    fn sample(
        &mut self,
        s: &Arc<Snapshot>,
        kind: SampleKind,
        at: &Stamp,
        out: &mut Vec<u8>,
    ) -> Result<u64, EncodeError>;
}

/// The encoder of `format`.
pub fn encoder(format: Format, started: &Stamp) -> Box<dyn Encoder> {
    match format {
        Format::Csv => Box::new(csv::Csv::default()),
        Format::Trace => Box::new(trace::Trace::new(started)),
        Format::OpenMetrics => Box::new(openmetrics::OpenMetrics::new(&host_name())),
    }
}

/// The kernel's host name (the `instance` of OpenMetrics samples).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".to_string())
}

/// What a finished recording holds.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    pub samples: u64,
    pub rows: u64,
    pub bytes: u64,
}

/// Why the writer stopped early.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error(transparent)]
    Output(#[from] OutputError),
    #[error(transparent)]
    Encode(#[from] EncodeError),
}

/// Write every snapshot `rx` yields until it disconnects; the output is
/// finished (trailer written) on every way out but a failed write.
pub fn write_all(
    mut out: output::Output,
    mut enc: Box<dyn Encoder>,
    rx: Receiver<Arc<Snapshot>>,
) -> Result<Summary, WriteError> {
    let mut kinds = Classifier::default();
    let mut buf = Vec::with_capacity(64 * 1024);
    let mut summary = Summary::default();
    for s in rx.iter() {
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

/// The shell's exit code for a child's status: its code, or 128 + the
/// signal that killed it.
pub fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(c), _) => (c & 0xff) as u8,
        (None, Some(sig)) => (128 + sig).clamp(0, 255) as u8,
        (None, None) => 1,
    }
}

/// Record as `opts` says with the sampler `cfg` configures, opening the
/// GPU source with `open` (on the sampler thread). Returns the exit code:
/// the command's (when there is one), 1 when writing failed (said on
/// stderr as it happens), 127 when the command cannot be started, else 0.
/// An error is returned when nothing could be recorded at all.
pub fn run<G, E, F>(cfg: &Config, opts: Options, open: F) -> Result<u8, RecordError>
where
    G: GpuSource + 'static,
    E: std::error::Error + Send + 'static,
    F: Fn() -> Result<G, OpenFailure<E>> + Send + 'static,
{
    let shared = Arc::new(Shared::new(
        cfg.timing.sample_interval,
        Arc::new(Telemetry::new()),
    ));
    let (sink_tx, sink_rx) = sync_channel(SINK_CAPACITY);
    shared.set_sink(Some(sink_tx));
    let (control_tx, control_rx) = std::sync::mpsc::channel::<Control>();
    let pods = cfg.kubernetes.as_ref().map(|_| Arc::new(PodIndex::new()));
    let lookup = ProcCache::from_config(&cfg.attribution, pods.clone());
    // The sampler first: its first snapshot waits in the channel while the
    // output is opened, and no file is left behind when NVML cannot load.
    let sampler = sample::spawn(
        open,
        lookup,
        cfg.timing,
        cfg.selection,
        cfg.collectors,
        Arc::clone(&shared),
        control_rx,
    )
    .map_err(|e| RecordError::Sampler(e.to_string()))?;
    let stop_sampler = |sampler: std::thread::JoinHandle<()>| {
        let _ = control_tx.send(Control::Stop);
        let _ = sampler.join();
        shared.set_sink(None);
    };

    let started = Stamp::new(SystemTime::now());
    let mut enc = encoder(opts.format, &started);
    let opened = enc.header().map_err(RecordError::from).and_then(|h| {
        Ok(output::Output::create(
            &opts.target,
            opts.force,
            &h,
            enc.trailer(),
        )?)
    });
    let out = match opened {
        Ok(o) => o,
        Err(e) => {
            stop_sampler(sampler);
            return Err(e);
        }
    };
    let name = out.name().to_string();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            stop_sampler(sampler);
            return Err(RecordError::Runtime(e));
        }
    };
    let (done_tx, mut done_rx) = tokio::sync::oneshot::channel::<()>();
    let writer = std::thread::Builder::new()
        .name("recorder".into())
        .spawn(move || {
            let r = write_all(out, enc, sink_rx);
            let _ = done_tx.send(());
            r
        });
    let writer = match writer {
        Ok(w) => w,
        Err(e) => {
            stop_sampler(sampler);
            return Err(RecordError::Runtime(e));
        }
    };
    tracing::info!(
        output = %name,
        format = opts.format.name(),
        sample_interval = %HumanDuration(cfg.timing.sample_interval),
        memory_sample_interval = %HumanDuration(cfg.timing.memory_sample_interval),
        duration = %opts.duration.map(|d| HumanDuration(d).to_string()).unwrap_or_else(|| "until stopped".into()),
        "recording"
    );

    let to_stdout = opts.target == Target::Stdout;
    let (stopped, mut child) = runtime.block_on(async {
        let mut signals = signals::install();
        if let (Some(k), Some(index)) = (&cfg.kubernetes, pods) {
            tokio::spawn(kube::run_watcher(k.clone(), index));
        }
        let mut child = None;
        if let Some((program, args)) = opts.command.split_first() {
            match start(program, args, to_stdout) {
                Ok(c) => child = Some(c),
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
                status = wait(&mut child) => break Stopped::Exited(status),
                _ = signals.stopped(), if !signalled => {
                    if child.is_none() {
                        break Stopped::Signal;
                    }
                    signalled = true;
                    tracing::info!("stop signal received; the recording goes on until the command exits");
                }
                _ = &mut done_rx => break Stopped::WriterEnded,
            }
        };
        (stopped, child)
    });

    stop_sampler(sampler);
    let written = writer.join().unwrap_or_else(|_| {
        Err(WriteError::Encode(EncodeError(
            "the writer thread panicked".into(),
        )))
    });
    let mut code = match &written {
        Ok(s) => {
            tracing::info!(
                output = %name,
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
    };
    let dropped = shared.sink_dropped();
    if dropped > 0 {
        tracing::warn!(
            dropped,
            "samples left out of the recording because writing them fell behind"
        );
    }
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
            return Ok(EXIT_CANNOT_START);
        }
        Stopped::Duration | Stopped::WriterEnded if child.is_some() => {
            tracing::info!("recording stopped; waiting for the command to exit");
            Some(runtime.block_on(wait(&mut child)))
        }
        Stopped::Duration | Stopped::WriterEnded | Stopped::Signal => None,
    };
    match status {
        Some(Ok(s)) => {
            let c = exit_code(s);
            tracing::info!(status = %s, "command exited");
            if code == 0 {
                code = c;
            }
        }
        Some(Err(e)) => {
            eprintln!("gpumem-exporter: cannot wait for the command: {e}");
            code = 1;
        }
        None => {}
    }
    Ok(code)
}

/// Start the command in the recorder's process group with its stdin and
/// stderr; its stdout too, unless the recording goes there (then its
/// stdout goes to stderr).
fn start(
    program: &OsString,
    args: &[OsString],
    to_stdout: bool,
) -> std::io::Result<tokio::process::Child> {
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args);
    if to_stdout {
        let fd = std::io::stderr().as_fd().try_clone_to_owned()?;
        cmd.stdout(Stdio::from(fd));
    }
    cmd.spawn()
}

/// The child's status; never resolves without a child.
async fn wait(child: &mut Option<tokio::process::Child>) -> std::io::Result<ExitStatus> {
    match child {
        Some(c) => {
            let status = c.wait().await;
            *child = None;
            status
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn formats_come_from_the_name_unless_asked() {
        let t = |p: &str| Target::Path(PathBuf::from(p));
        assert_eq!(Format::for_target(&t("a.csv"), None), Ok(Format::Csv));
        assert_eq!(
            Format::for_target(&t("a.trace.json"), None),
            Ok(Format::Trace)
        );
        assert_eq!(Format::for_target(&t("a.JSON"), None), Ok(Format::Trace));
        assert_eq!(
            Format::for_target(&t("a.om"), None),
            Ok(Format::OpenMetrics)
        );
        assert_eq!(Format::for_target(&Target::Stdout, None), Ok(Format::Csv));
        assert!(
            Format::for_target(&t("a.txt"), None)
                .unwrap_err()
                .contains("--format")
        );
        assert!(Format::for_target(&t("a"), None).is_err());
        assert_eq!(
            Format::for_target(&t("a.txt"), Some(Format::OpenMetrics)),
            Ok(Format::OpenMetrics)
        );
        assert_eq!("trace".parse::<Format>(), Ok(Format::Trace));
        assert!(
            "xml"
                .parse::<Format>()
                .unwrap_err()
                .contains("csv, trace or openmetrics")
        );
    }

    #[test]
    fn stamps_have_milliseconds_in_both_forms() {
        let t = UNIX_EPOCH + Duration::from_micros(1_767_225_600_123_456);
        let s = Stamp::new(t);
        assert_eq!(s.unix_seconds, "1767225600.123");
        assert_eq!(s.rfc3339, "2026-01-01T00:00:00.123Z");
        assert_eq!(s.unix_micros, 1_767_225_600_123_456);
        let s = Stamp::new(UNIX_EPOCH + Duration::from_millis(5));
        assert_eq!(s.unix_seconds, "0.005");
    }

    #[test]
    fn shell_exit_codes() {
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(9)), 137);
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
    }
}

/// The encoders on snapshots from the real [`crate::sample::Sampler`] over
/// the in-process fake GPU.
#[cfg(test)]
mod encoder_tests {
    use super::*;
    use crate::attribute::ProcessLookup;
    use crate::config::Timing;
    use crate::gpu::GpuError;
    use crate::gpu::fake::{FakeDevice, FakeGpu, process};
    use crate::model::{ProcIdentity, TorchStats};
    use crate::sample::Sampler;

    const GIB: u64 = 1 << 30;

    /// Names pid n "p,n" (a comma, to check quoting); torch figures for
    /// pid 7.
    struct Names;
    impl ProcessLookup for Names {
        fn identify(&mut self, pid: u32) -> Arc<ProcIdentity> {
            Arc::new(ProcIdentity {
                comm: Arc::from(format!("p,{pid}")),
                user: Arc::from("alice"),
                ..ProcIdentity::default()
            })
        }
        fn retain(&mut self, _live: &dyn Fn(u32) -> bool) {}
        fn torch(&mut self, pid: u32, _uuids: &[&str]) -> Option<TorchStats> {
            (pid == 7).then_some(TorchStats {
                allocated: 3 * GIB,
                reserved: 4 * GIB,
                ..TorchStats::default()
            })
        }
    }

    fn sampler() -> Sampler<FakeGpu, Names> {
        let mut d = FakeDevice::new(0, 80 * GIB, 10 * GIB);
        d.processes = Ok(vec![process(7, 6 * GIB), process(9, GIB)]);
        let t = Timing {
            sample_interval: Duration::from_secs(1),
            memory_sample_interval: Duration::from_millis(100),
            peak_window: Duration::from_secs(30),
            mig_rescan_interval: Duration::from_secs(30),
        };
        Sampler::new(FakeGpu::new(vec![d]), Names, t)
    }

    /// Encode each snapshot as the writer does; the text of each sample.
    fn encode_all(enc: &mut dyn Encoder, snaps: &[Snapshot]) -> Vec<String> {
        let mut kinds = Classifier::default();
        snaps
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let s = Arc::new(s.clone());
                // Distinct, increasing times whatever the clock did.
                let at = Stamp::new(UNIX_EPOCH + Duration::from_millis(1_000_000 + 100 * i as u64));
                let mut out = Vec::new();
                enc.sample(&s, kinds.next(&s), &at, &mut out).unwrap();
                String::from_utf8(out).unwrap()
            })
            .collect()
    }

    #[test]
    fn memory_and_full_samples_are_told_apart() {
        let mut s = sampler();
        let mut c = Classifier::default();
        assert_eq!(c.next(&s.tick()), SampleKind::Full);
        assert_eq!(c.next(&s.tick_memory()), SampleKind::Memory);
        assert_eq!(c.next(&s.tick_memory()), SampleKind::Memory);
        assert_eq!(c.next(&s.tick()), SampleKind::Full);
        // Published while NVML is closed: no tick at all.
        assert_eq!(c.next(&s.snapshot()), SampleKind::Full);
    }

    #[test]
    fn csv_writes_process_rows_at_full_samples_only_and_quotes_names() {
        let mut s = sampler();
        let snaps = [s.tick(), s.tick_memory()];
        let mut enc = csv::Csv::default();
        let header = String::from_utf8(enc.header().unwrap()).unwrap();
        assert_eq!(header, csv::COLUMNS.join(",") + "\n");
        let text = encode_all(&mut enc, &snaps);
        let u = "GPU-fake-0000";
        let free = 80 * GIB - 10 * GIB;
        let reserved = 0;
        let full = format!(
            "1970-01-01T00:16:40.000Z,1000.000,gpu,0,{u},{},{reserved},{free},{},,,,,,,\n\
             1970-01-01T00:16:40.000Z,1000.000,process,0,{u},{},,,,7,\"p,7\",alice,,,{},{}\n\
             1970-01-01T00:16:40.000Z,1000.000,process,0,{u},{},,,,9,\"p,9\",alice,,,,\n",
            10 * GIB,
            80 * GIB,
            6 * GIB,
            3 * GIB,
            4 * GIB,
            GIB
        );
        assert_eq!(text[0], full);
        assert_eq!(
            text[1],
            format!(
                "1970-01-01T00:16:40.100Z,1000.100,gpu,0,{u},{},{reserved},{free},{},,,,,,,\n",
                10 * GIB,
                80 * GIB
            )
        );
    }

    #[test]
    fn openmetrics_stamps_every_sample_and_helps_once() {
        let mut s = sampler();
        let snaps = [s.tick(), s.tick_memory(), s.tick()];
        let mut enc = openmetrics::OpenMetrics::new("host \"a\"");
        let text = encode_all(&mut enc, &snaps);
        let target = r#"{instance="host \"a\"",job="gpumem-record""#;
        assert!(
            text[0].contains(&format!("\ngpu_up{target},gpu=\"0\",")),
            "{}",
            text[0]
        );
        assert!(
            text[0].contains(&format!("\ngpu_driver_info{target},driver_version=")),
            "{}",
            text[0]
        );
        for (block, ts) in text.iter().zip(["1000.000", "1000.100", "1000.200"]) {
            assert!(!block.contains("# EOF"));
            for line in block.lines().filter(|l| !l.starts_with('#')) {
                assert!(line.ends_with(&format!(" {ts}")), "{line}");
                assert!(line.contains(target), "{line}");
            }
            assert!(block.contains("# TYPE gpu_memory_used_bytes gauge\n"));
            assert!(!block.contains("gpumem_exporter_"), "no exporter families");
        }
        assert!(text[0].contains("# HELP gpu_memory_used_bytes "));
        assert!(!text[2].contains("# HELP"), "HELP once per family");
        assert!(text[0].contains("gpu_process_memory_used_bytes{"));
        assert!(
            !text[1].contains("gpu_process"),
            "a memory sample: GPU families only"
        );
        assert!(text[2].contains("gpu_process_memory_used_bytes{"));
        // A clock that does not move forward: the sample is left out.
        let snap = Arc::new(s.tick_memory());
        let at = Stamp::new(UNIX_EPOCH + Duration::from_millis(1_000_200));
        let mut out = Vec::new();
        assert_eq!(
            enc.sample(&snap, SampleKind::Memory, &at, &mut out)
                .unwrap(),
            0
        );
        assert!(out.is_empty());
        assert_eq!(enc.skipped, 1);
    }

    fn events(text: &str) -> Vec<serde_json::Value> {
        text.split(",\n")
            .filter(|e| !e.is_empty())
            .map(|e| serde_json::from_str(e.trim_start_matches('\n')).unwrap())
            .collect()
    }

    #[test]
    fn trace_drops_a_process_that_left_to_0_but_not_one_on_a_gpu_down() {
        let mut s = sampler();
        let first = s.tick();
        s.gpu_mut().devices[0].processes = Ok(vec![process(7, 6 * GIB)]);
        let left = s.tick();
        s.gpu_mut().devices[0].memory = Err(GpuError {
            operation: "memory",
            error: "gpu_lost",
        });
        let down = s.tick();
        let down_again = s.tick();
        let start = Stamp::new(UNIX_EPOCH);
        let mut enc = trace::Trace::new(&start);
        let text = encode_all(&mut enc, &[first, left, down, down_again]);
        let all: Vec<serde_json::Value> = text.iter().flat_map(|t| events(t)).collect();
        let of = |name: &str, pid: u64| -> Vec<&serde_json::Value> {
            all.iter()
                .filter(|e| e["name"] == name && e["pid"] == pid)
                .collect()
        };
        let gone = of("gpu 0 used", 9);
        assert_eq!(gone.len(), 2);
        assert_eq!(gone[0]["args"]["bytes"], GIB);
        assert_eq!(gone[1]["args"]["bytes"], 0);
        let stays = of("gpu 0 used", 7);
        assert_eq!(stays.len(), 2, "nothing made up while the GPU is down");
        assert_eq!(of("gpu 0 torch allocated", 7)[0]["args"]["bytes"], 3 * GIB);
        assert_eq!(of("gpu 0 torch reserved", 7)[0]["args"]["bytes"], 4 * GIB);
        assert_eq!(of("process_name", 7)[0]["args"]["name"], "p,7 (alice)");
        let down = of("GPU not answering", trace::GPU_PID_BASE);
        assert_eq!(down.len(), 1, "said once");
        assert_eq!(down[0]["ph"], "i");
        assert_eq!(of("memory", trace::GPU_PID_BASE).len(), 2);
    }
}
