//! The torch bridge, a source: PyTorch caching-allocator figures that the
//! `gpumem_bridge` Python package (`python/`) publishes from inside a
//! process. They are figures, never identity: which process sent them is
//! what the kernel says (its credentials and a pidfd), and a process's
//! figures describe only that process. The sampler reads them as a
//! per-process reading keyed by (pid, start time); [`spawn`], called from
//! the pipeline alone, starts the socket's thread.
//!
//! Two ways in, one document ([`document`]):
//!
//! - **The socket** ([`socket`], `processes.torch_bridge_socket`): the
//!   bridge (0.4 and later) connects to a Unix socket the exporter listens
//!   on and sends each document as one packet ([`frame`]). The kernel says
//!   who sent it (`SO_PEERCRED`, a pidfd, `SCM_CREDENTIALS` per message),
//!   so it needs no capability on either side; documents are keyed by
//!   (pid, start time) and vanish with the connection.
//! - **The fd fallback** ([`fdscan`], `processes.torch_bridge_fd_scan`):
//!   older bridges only keep a sealed memfd; where the exporter may look at
//!   a process's fds (its own uid, or `CAP_SYS_PTRACE`), the memfd is found
//!   by a budgeted scan and duplicated with `pidfd_getfd`, never reopened.
//!   Where it may not, the process is counted once (`permission`) and the
//!   log says what to change: a newer bridge, which uses the socket.
//!
//! A process that sent over the socket is not scanned. The pid is the
//! kernel's, never the document's; reads are bounded (a socket message at
//! most [`frame::MAX_MESSAGE_BYTES`], under per-uid limits; one memfd read
//! per process per full sample, at most [`MAX_DOCUMENT_BYTES`], after at
//! most [`fdscan::PROBES_PER_SAMPLE`] fd probes per sample in all);
//! figures vanish with the process. Label values never come from the
//! document as text: pools and the allocator backend are closed sets,
//! settings are typed.

pub(crate) mod closer;
pub(crate) mod control;
pub(crate) mod document;
pub(crate) mod fdscan;
pub(crate) mod frame;
pub(crate) mod holder;
pub(crate) mod socket;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::attribute::procfs::ProcRoot;
use crate::config::Attribution;
use crate::model::{BridgeSocketCounters, TorchCounters, TorchStats};
use crate::ratelimit::LogLimiter;
pub(crate) use document::{Document, DropReason, MAX_DOCUMENT_BYTES, parse};
use fdscan::{FdScan, Outcome};

/// Counters of the fd fallback (the socket keeps its own); written by the
/// sampler thread's [`TorchReader`] alone, read by publish.
#[derive(Debug, Default)]
struct FdCounters {
    reports: AtomicU64,
    malformed: AtomicU64,
    oversized: AtomicU64,
    permission: AtomicU64,
}

/// The bridge as a source: the socket's store (written by its thread) and
/// the fd fallback's counters (written by the sampler's reader). Publish
/// copies [`Bridge::state`] into every snapshot.
#[derive(Debug, Default)]
pub(crate) struct Bridge {
    socket: Option<Arc<socket::Store>>,
    socket_path: Option<String>,
    fd: FdCounters,
}

impl Bridge {
    /// Documents accepted and dropped so far.
    pub(crate) fn state(&self) -> TorchCounters {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let f = &self.fd;
        let mut c = TorchCounters {
            reports: get(&f.reports),
            malformed: get(&f.malformed),
            oversized: get(&f.oversized),
            permission: get(&f.permission),
            identity: 0,
            socket: None,
        };
        if let Some(store) = &self.socket {
            let s = &store.counters;
            c.reports += get(&s.accepted);
            c.malformed += get(&s.malformed);
            c.oversized += get(&s.oversized);
            c.identity = get(&s.identity);
            c.socket = Some(BridgeSocketCounters {
                connections: get(&s.open),
                limited_connections: get(&s.limited_connections),
                limited_connects: get(&s.limited_connects),
                limited_rate: get(&s.limited_rate),
                limited_memory: get(&s.limited_memory),
                limited_fds: get(&s.limited_fds),
                idle_closed: get(&s.idle_closed),
                held_bytes: store.held_bytes(),
                close_waiting: store.close_waiting(),
                stalls: get(&s.stalls),
                stalled_ms: store.stalled().map_or(0, |d| d.as_millis() as u64),
            });
        }
        c
    }

    /// How long the socket's listener has been stuck in one round, when
    /// longer than [`socket::STALL_AFTER`] (`/readyz` says so).
    pub(crate) fn stalled(&self) -> Option<std::time::Duration> {
        self.socket.as_ref()?.stalled()
    }
}

/// Start what `processes.torch_bridge*` asks for (`None` when the bridge is
/// off): the socket's thread, listening at `torch_bridge_socket`, and the
/// fd fallback when `torch_bridge_fd_scan`. Called from the pipeline
/// alone; the reader goes to the sampler, its [`TorchReader::bridge`] to
/// publish.
pub(crate) fn spawn(cfg: &Attribution) -> Option<TorchReader> {
    if !cfg.torch_bridge {
        return None;
    }
    let root = ProcRoot::new(&cfg.procfs);
    Some(TorchReader::start(
        root,
        &cfg.cgroupfs,
        cfg.torch_bridge_socket.as_deref(),
        cfg.torch_bridge_fd_scan,
    ))
}

/// What the sampler asks of the bridge: the figures of one process (by pid
/// and start time) for one device, and the end of a full sample. The
/// [`TorchReader`] answers; tests stand in for it.
pub(crate) trait Figures: Send {
    /// The figures process `pid` (whose start time the caller just read
    /// from /proc) published for the device named by `uuids`, if any.
    fn stats(&mut self, pid: u32, start: u64, uuids: &[&str]) -> Option<TorchStats>;
    /// End of a full sample: `live` says which pids are still on a GPU.
    fn end_tick(&mut self, live: &dyn Fn(u32) -> bool);
}

impl Figures for TorchReader {
    fn stats(&mut self, pid: u32, start: u64, uuids: &[&str]) -> Option<TorchStats> {
        TorchReader::stats(self, pid, start, uuids)
    }
    fn end_tick(&mut self, live: &dyn Fn(u32) -> bool) {
        TorchReader::end_tick(self, live)
    }
}

/// Reads bridge documents for the sampler: from the socket's store first,
/// else (when on) the fd fallback. Owned by the sampler thread; each
/// figure is a per-process reading keyed by (pid, start time).
#[derive(Debug)]
pub(crate) struct TorchReader {
    bridge: Arc<Bridge>,
    fds: Option<FdScan>,
    /// Documents looked up in the current tick (a process on two GPUs is
    /// read once); cleared by [`TorchReader::end_tick`].
    this_tick: HashMap<(u32, u64), Option<Arc<Document>>>,
    /// Each reason is logged once.
    warned: LogLimiter<DropReason>,
}

impl TorchReader {
    /// The fd fallback alone, under `root` (the same root as every other
    /// /proc lookup: the host's, with hostPID).
    pub(crate) fn new(root: ProcRoot) -> Self {
        TorchReader {
            bridge: Arc::new(Bridge::default()),
            fds: Some(FdScan::new(root)),
            this_tick: HashMap::new(),
            warned: LogLimiter::once(),
        }
    }

    /// Listen on `socket` (its thread started here, ending when the
    /// [`Bridge`] is dropped) and scan fds when `fd_scan`. A socket that
    /// cannot be bound is logged (a missing directory at info level: the
    /// usual state where none is set up) and left off; the fallback still
    /// works.
    fn start(root: ProcRoot, cgroupfs: &str, socket: Option<&Path>, fd_scan: bool) -> Self {
        let mut reader = TorchReader::new(root.clone());
        if !fd_scan {
            reader.fds = None;
        }
        let Some(path) = socket else {
            return reader;
        };
        let store = Arc::new(socket::Store::new(socket::LIMITS));
        let listening = socket::bind(path)
            .and_then(|l| socket::spawn(l, root, cgroupfs, &store).map_err(socket::BindError::Io));
        match listening {
            Ok(_) => {
                reader.bridge = Arc::new(Bridge {
                    socket: Some(store),
                    socket_path: Some(path.display().to_string()),
                    fd: FdCounters::default(),
                });
            }
            Err(e) if e.is_absent() => tracing::info!(
                path = %path.display(),
                "the torch bridge socket is off: {e}; bridges of 0.4 and later send nothing here (the fd fallback still reads older ones where it may)"
            ),
            Err(e) => tracing::warn!(
                path = %path.display(),
                "cannot listen on the torch bridge socket (processes.torch_bridge_socket): {e}; bridges of 0.4 and later send nothing here (the fd fallback still reads older ones where it may)"
            ),
        }
        reader
    }

    /// The source's shared half, for publish.
    pub(crate) fn bridge(&self) -> Arc<Bridge> {
        Arc::clone(&self.bridge)
    }

    /// Documents accepted and dropped so far.
    #[cfg(test)]
    pub(crate) fn counters(&self) -> TorchCounters {
        self.bridge.state()
    }

    /// Fd links the fallback probed so far.
    #[cfg(test)]
    pub(crate) fn fd_probes(&self) -> u64 {
        self.fds.as_ref().map_or(0, FdScan::probes)
    }

    /// The figures process `pid` (whose start time the caller just read
    /// from /proc) published for the device named by `uuids`, if any.
    pub(crate) fn stats(&mut self, pid: u32, start: u64, uuids: &[&str]) -> Option<TorchStats> {
        if !self.this_tick.contains_key(&(pid, start)) {
            let doc = self.read(pid, start);
            self.this_tick.insert((pid, start), doc);
        }
        self.this_tick
            .get(&(pid, start))?
            .as_ref()?
            .stats_for(uuids)
    }

    /// End of a full tick: forget this tick's documents, and the processes
    /// no longer on any GPU; the fallback probes the fds of those due. The
    /// socket keeps the documents of the processes looked up this tick
    /// (those on a GPU) and only a small allowance of others'.
    pub(crate) fn end_tick(&mut self, live: &dyn Fn(u32) -> bool) {
        if let Some(s) = &self.bridge.socket {
            s.set_live(self.this_tick.keys().copied().collect::<HashSet<_>>());
        }
        self.this_tick.clear();
        if let Some(f) = &mut self.fds {
            f.end_tick(live);
        }
    }

    fn read(&mut self, pid: u32, start: u64) -> Option<Arc<Document>> {
        if let Some(doc) = self.bridge.socket.as_ref().and_then(|s| s.get(pid, start)) {
            return Some(doc);
        }
        match self.fds.as_mut()?.read(pid, start) {
            Outcome::Document(doc) => {
                self.bridge.fd.reports.fetch_add(1, Ordering::Relaxed);
                Some(Arc::new(doc))
            }
            Outcome::Dropped(reason) => {
                self.count(pid, reason);
                None
            }
            Outcome::Nothing => None,
        }
    }

    fn count(&mut self, pid: u32, reason: DropReason) {
        let f = &self.bridge.fd;
        let n = match reason {
            DropReason::Malformed => &f.malformed,
            DropReason::Oversized => &f.oversized,
            DropReason::Permission => &f.permission,
        };
        n.fetch_add(1, Ordering::Relaxed);
        if self.warned.check(reason).is_none() {
            return;
        }
        match reason {
            DropReason::Permission => tracing::warn!(
                pid,
                socket = self.bridge.socket_path.as_deref().unwrap_or("off"),
                "cannot look at the fds of a GPU process (permission denied), so a gpumem_bridge older than 0.4 (memfd only) in it cannot be read: upgrade the bridge, which then sends its figures over the exporter's socket (processes.torch_bridge_socket; in Kubernetes mount its directory into the pod) and needs no privilege; reading fds would need the process's uid or CAP_SYS_PTRACE, which the shipped deployments no longer grant. processes.torch_bridge_fd_scan: false stops trying. Counted in gpumem_exporter_torch_reports_dropped_total{{reason=\"permission\"}}; this is logged once"
            ),
            _ => tracing::warn!(
                pid,
                reason = reason.as_str(),
                "dropped a torch bridge document (gpumem-bridge memfd): counted in gpumem_exporter_torch_reports_dropped_total; this is logged once per reason"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TorchStats;
    use std::fs::File;
    use std::os::fd::{AsRawFd, OwnedFd};

    const U0: &str = "GPU-8f2c1d3e-0000-4000-8000-000000000000";

    fn doc(base: u64) -> String {
        format!(
            r#"{{"v":1,"devices":[{{"uuid":"{U0}","allocated":{},"reserved":{},"allocated_peak":0,"reserved_peak":0,"active":0,"inactive_split":0,"alloc_retries":0,"ooms":0}}]}}"#,
            base,
            base + 1
        )
    }

    fn stats(base: u64) -> TorchStats {
        TorchStats {
            allocated: base,
            reserved: base + 1,
            ..TorchStats::default()
        }
    }

    /// A memfd named like the bridge's, holding `data`, sealed or not.
    fn memfd(data: &[u8], seal: bool) -> OwnedFd {
        use std::io::Write;
        use std::os::fd::FromRawFd;
        // SAFETY: plain syscalls on a fd this function owns.
        unsafe {
            let fd = libc::memfd_create(
                c"gpumem-bridge".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            );
            assert!(fd >= 0, "memfd_create");
            let mut f = File::from_raw_fd(fd);
            f.write_all(data).unwrap();
            if seal {
                let r = libc::fcntl(
                    fd,
                    libc::F_ADD_SEALS,
                    fdscan::REQUIRED_SEALS | libc::F_SEAL_SEAL,
                );
                assert_eq!(r, 0, "F_ADD_SEALS");
            }
            OwnedFd::from(f)
        }
    }

    fn dup2(from: &OwnedFd, to: &OwnedFd) {
        // SAFETY: both fds are open and owned here.
        assert!(unsafe { libc::dup2(from.as_raw_fd(), to.as_raw_fd()) } >= 0);
    }

    fn reader() -> TorchReader {
        let mut r = TorchReader::new(ProcRoot::default());
        r.fds = Some(FdScan::new(ProcRoot::default()).without_grace());
        r
    }

    /// The fd fallback against this very process: finds the memfd, follows
    /// a replacement, skips unsealed files, drops bad ones, never takes an
    /// `O_PATH` fd swapped onto the number for a document, and forgets the
    /// figures as soon as the fd is closed. (The only test in this binary
    /// that makes bridge memfds: tests run in parallel threads.)
    #[test]
    fn fd_fallback_on_this_process() {
        let root = ProcRoot::default();
        let pid = std::process::id();
        let start = root.start_time(pid).expect("own start time");
        let mut r = reader();
        let tick = |r: &mut TorchReader| {
            let s = r.stats(pid, start, &[U0]);
            r.end_tick(&|_| true);
            s
        };
        assert_eq!(tick(&mut r), None, "no memfd yet");

        let first = memfd(doc(100).as_bytes(), true);
        // Not scanned again before RESCAN_AFTER: a fresh reader sees it,
        // probed at the end of one sample, read in the next.
        let mut r = reader();
        assert_eq!(tick(&mut r), None);
        assert!(r.fd_probes() > 0);
        assert_eq!(tick(&mut r), Some(stats(100)));
        assert_eq!(r.counters().reports, 1);
        // Read once per tick, however many GPUs ask.
        assert_eq!(r.stats(pid, start, &[U0]), Some(stats(100)));
        assert_eq!(r.stats(pid, start, &["GPU-other"]), None);
        assert_eq!(r.counters().reports, 2);
        r.end_tick(&|_| true);

        // Replaced the way the bridge does it: dup2 of a sealed memfd.
        let next = memfd(doc(200).as_bytes(), true);
        dup2(&next, &first);
        drop(next);
        assert_eq!(tick(&mut r), Some(stats(200)));

        // An unsealed file at that fd: still being written, skipped quietly.
        let unsealed = memfd(doc(300).as_bytes(), false);
        dup2(&unsealed, &first);
        drop(unsealed);
        assert_eq!(tick(&mut r), None);
        let c = r.counters();
        assert_eq!((c.malformed, c.oversized, c.permission), (0, 0, 0));

        // Malformed and oversized documents are dropped and counted.
        let bad = memfd(
            br#"{"v":1,"devices":[{"uuid":"x","allocated":"lots"}]}"#,
            true,
        );
        dup2(&bad, &first);
        drop(bad);
        let probes = r.fd_probes();
        assert_eq!(tick(&mut r), None);
        assert_eq!(r.counters().malformed, 1);
        let big = memfd(&vec![b' '; MAX_DOCUMENT_BYTES as usize + 1], true);
        dup2(&big, &first);
        drop(big);
        assert_eq!(tick(&mut r), None);
        assert_eq!(r.counters().oversized, 1);
        // A known fd costs no scan.
        assert_eq!(r.fd_probes(), probes);

        // An O_PATH fd of another file swapped onto the number: the link
        // no longer names the bridge, and nothing of it is read.
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, doc(400)).unwrap();
        let path_fd = rustix::fs::open(
            &secret,
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        dup2(&path_fd, &first);
        assert_eq!(tick(&mut r), None);
        let c = r.counters();
        assert_eq!((c.reports, c.malformed, c.oversized), (3, 1, 1), "{c:?}");
        // Even handed over directly, an O_PATH fd is no document.
        assert_eq!(
            fdscan::read_document(File::from(path_fd)),
            fdscan::Outcome::Dropped(DropReason::Malformed)
        );

        // Closed: gone at the next tick, nothing cached.
        drop(first);
        assert_eq!(tick(&mut r), None);
        // A pid that is not ours (or not there) reads nothing.
        assert_eq!(r.stats(u32::MAX, 1, &[U0]), None);
        assert_eq!(r.counters().reports, 3);
    }

    /// A document in the socket's store wins, and the process is not
    /// scanned.
    #[test]
    fn the_socket_store_comes_first() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("bridge.sock");
        let mut r = TorchReader::start(ProcRoot::default(), "/sys/fs/cgroup", Some(&path), true);
        assert!(r.counters().socket.is_some(), "listening");
        let fd = rustix::net::socket_with(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        rustix::net::connect(&fd, &rustix::net::SocketAddrUnix::new(&path).unwrap()).unwrap();
        let msg = format!("gpumem-bridge 1\n{}", doc(500));
        rustix::net::send(&fd, msg.as_bytes(), rustix::net::SendFlags::empty()).unwrap();
        let pid = std::process::id();
        let start = ProcRoot::default().start_time(pid).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let s = r.stats(pid, start, &[U0]);
            r.end_tick(&|_| true);
            if s == Some(stats(500)) {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "socket document not seen"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(r.fd_probes(), 0, "a socket-bridged process is not scanned");
        let c = r.counters();
        assert_eq!(c.reports, 1);
        assert_eq!(c.socket.map(|s| s.connections), Some(1));
    }

    /// No directory, no socket, no warning worth the name: the fallback
    /// alone.
    #[test]
    fn a_missing_socket_directory_leaves_the_fallback() {
        let d = tempfile::tempdir().unwrap();
        let r = TorchReader::start(
            ProcRoot::default(),
            "/sys/fs/cgroup",
            Some(&d.path().join("nope/bridge.sock")),
            true,
        );
        assert!(r.counters().socket.is_none());
        assert!(r.fds.is_some());
        let r = TorchReader::start(ProcRoot::default(), "/sys/fs/cgroup", None, false);
        assert!(r.fds.is_none() && r.bridge.socket.is_none());
    }
}
