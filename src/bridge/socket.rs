//! The bridge socket: a `SOCK_SEQPACKET` Unix socket the exporter listens
//! on (`processes.torch_bridge_socket`, `/run/gpumem-exporter/bridge.sock`
//! by default), where each bridged process sends its documents
//! ([`super::frame`]). It needs no capability: whoever may connect says
//! only who it is, and the kernel, not the message, says that.
//!
//! **Identity.** At `accept` the peer's pid and uid come from
//! `SO_PEERCRED` (as the kernel recorded them at `connect`), and its start
//! time from `<path.procfs>/<pid>/stat`, read while a pidfd of the peer
//! (`SO_PEERPIDFD`, Linux ≥ 6.5) shows it has not exited, so the start time
//! is the connecting process's own and a recycled pid cannot inherit its
//! figures. On an older kernel the pidfd is opened by pid
//! (`pidfd_open`), and a process that started after the `accept` is
//! refused: what is left is a pid recycled within one clock tick (10 ms)
//! between `connect` and `accept`. Every message then carries the sender's
//! pid and uid again (`SCM_CREDENTIALS`, filled in by the kernel at
//! `send`; an unprivileged sender cannot claim another pid); one whose
//! sender is not the process that connected (a child that inherited the
//! socket) is dropped as `identity`. Documents are keyed by (pid, start
//! time) and leave with their connection: a process that exits closes it.
//!
//! **Bounds**, all counted ([`Counters`], `gpumem_exporter_torch_bridge_*`):
//! [`LIMITS`] per uid and in all — open connections (one over is closed at
//! once), messages and bytes per second (a uid past its budget is not read
//! until the budget refills: its messages wait in the socket, where the
//! bridge's non-blocking `send` drops what does not fit, so a flood costs
//! the exporter at most the budget), at most [`MAX_MESSAGE_BYTES`] a
//! message (a longer packet is cut by the kernel and dropped). Fds passed
//! with a message are never installed (the control buffer only has room
//! for the credentials).
//!
//! Why by hand: tokio has no `SOCK_SEQPACKET` socket, and one thread
//! polling at most [`Limits::connections`] fds is small and bounded.
//! rustix makes the socket, binds, accepts and polls; `SO_PEERCRED` and
//! `SCM_CREDENTIALS` are read with libc because rustix's `UCred` holds the
//! pid as a non-zero integer, and a peer outside the exporter's pid
//! namespace has pid 0.

use std::collections::HashMap;
use std::io;
use std::mem::{MaybeUninit, size_of};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use rustix::process::{Pid, PidfdFlags};

use super::document::{Document, DropReason};
use super::frame::{self, FRAME_VERSION, FrameError, MAX_MESSAGE_BYTES};
use crate::attribute::procfs::ProcRoot;
use crate::ratelimit::LogLimiter;

/// What one uid, and everyone together, may use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Limits {
    pub per_uid_connections: usize,
    pub connections: usize,
    /// Messages a second (the burst is one second's worth).
    pub per_uid_messages: f64,
    pub messages: f64,
    /// Bytes a second (the burst is one second's worth).
    pub per_uid_bytes: f64,
    pub bytes: f64,
}

/// The bridge publishes once a second (at most 20 times a second); a uid's
/// 64 processes with full step rings on 8 GPUs (about 40 KiB a document)
/// fit. A flood within these costs the exporter about 1 % of a core (2 MiB
/// of JSON a second) per uid.
pub(crate) const LIMITS: Limits = Limits {
    per_uid_connections: 64,
    connections: 512,
    per_uid_messages: 500.0,
    messages: 4000.0,
    per_uid_bytes: 2.0 * 1024.0 * 1024.0,
    bytes: 16.0 * 1024.0 * 1024.0,
};

/// How long the thread sleeps at most: it ends within this when the
/// sampler drops the store.
const IDLE: Duration = Duration::from_millis(500);
/// Connections accepted per wake-up, so a connect flood cannot keep the
/// loop from reading.
const ACCEPTS_PER_ROUND: usize = 64;
/// Messages read from one connection per wake-up.
const READS_PER_ROUND: usize = 8;

/// `SO_PEERPIDFD` (asm-generic: x86_64 and aarch64); libc does not
/// export it yet.
const SO_PEERPIDFD: libc::c_int = 77;

/// Counters the listener keeps and the sampler copies into snapshots.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub accepted: AtomicU64,
    pub malformed: AtomicU64,
    pub oversized: AtomicU64,
    /// Messages or connections whose sender the kernel could not vouch
    /// for as the process that connected.
    pub identity: AtomicU64,
    /// Connections closed at once (a cap was reached).
    pub limited_connections: AtomicU64,
    /// Times a uid (or everyone) was paused for passing the budget.
    pub limited_rate: AtomicU64,
    /// Connections open now.
    pub open: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

#[derive(Debug)]
struct Entry {
    conn: u64,
    doc: Arc<Document>,
}

/// What the listener thread shares with the sampler: the latest document
/// per (pid, start time), and the counters. The thread holds it weakly and
/// ends when the sampler drops it.
#[derive(Debug, Default)]
pub(crate) struct Store {
    docs: Mutex<HashMap<(u32, u64), Entry>>,
    pub(crate) counters: Counters,
}

impl Store {
    /// The latest document process (`pid`, `start`) sent, if its
    /// connection is open.
    pub(crate) fn get(&self, pid: u32, start: u64) -> Option<Arc<Document>> {
        let docs = self.docs.lock().ok()?;
        docs.get(&(pid, start)).map(|e| Arc::clone(&e.doc))
    }

    fn put(&self, key: (u32, u64), conn: u64, doc: Document) {
        if let Ok(mut docs) = self.docs.lock() {
            docs.insert(
                key,
                Entry {
                    conn,
                    doc: Arc::new(doc),
                },
            );
        }
    }

    /// Forget `key`'s document if connection `conn` sent it (a newer
    /// connection of the same process keeps its own).
    fn closed(&self, key: (u32, u64), conn: u64) {
        if let Ok(mut docs) = self.docs.lock()
            && docs.get(&key).is_some_and(|e| e.conn == conn)
        {
            docs.remove(&key);
        }
    }
}

/// Why the socket is not listening.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BindError {
    #[error(
        "its directory {0} does not exist (systemd: RuntimeDirectory=gpumem-exporter; Kubernetes: the hostPath of the torch-bridge overlay)"
    )]
    NoDirectory(PathBuf),
    #[error(
        "its directory {dir} is writable by others (mode {mode:o}, owner uid {owner}): a tenant could put its own socket there; make it owned by the exporter's uid (or root) and not group- or world-writable"
    )]
    UnsafeDirectory { dir: PathBuf, mode: u32, owner: u32 },
    #[error("another exporter is listening on it")]
    InUse,
    #[error("something that is not a socket is there; it was left alone")]
    NotSocket,
    #[error("{0}")]
    Io(#[from] io::Error),
}

impl From<rustix::io::Errno> for BindError {
    fn from(e: rustix::io::Errno) -> Self {
        BindError::Io(e.into())
    }
}

impl BindError {
    /// A missing directory is the usual state where the socket is not set
    /// up (a development machine): not worth a warning.
    pub(crate) fn is_absent(&self) -> bool {
        matches!(self, BindError::NoDirectory(_))
    }
}

/// A bound, listening socket.
#[derive(Debug)]
pub(crate) struct Listener {
    path: PathBuf,
    fd: OwnedFd,
}

fn seqpacket() -> io::Result<OwnedFd> {
    Ok(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?)
}

/// Bind and listen on `path`: its directory must exist and be writable by
/// no one but its owner (the exporter's uid or root); a stale socket left
/// by an earlier run is replaced, a live one is not; the socket is mode
/// 0666 (anyone may connect; the kernel says who did).
pub(crate) fn bind(path: &Path) -> Result<Listener, BindError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let meta = match std::fs::metadata(&dir) {
        Ok(m) if m.is_dir() => m,
        Ok(_) => return Err(BindError::NoDirectory(dir)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(BindError::NoDirectory(dir)),
        Err(e) => return Err(e.into()),
    };
    let mode = meta.permissions().mode();
    let euid = rustix::process::geteuid().as_raw();
    if mode & 0o022 != 0 || (meta.uid() != euid && meta.uid() != 0) {
        return Err(BindError::UnsafeDirectory {
            dir,
            mode: mode & 0o7777,
            owner: meta.uid(),
        });
    }
    let addr = SocketAddrUnix::new(path)?;
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_socket() => return Err(BindError::NotSocket),
        Ok(_) => {
            let probe = seqpacket()?;
            match rustix::net::connect(&probe, &addr) {
                Ok(()) => return Err(BindError::InUse),
                Err(rustix::io::Errno::AGAIN) => return Err(BindError::InUse),
                Err(rustix::io::Errno::CONNREFUSED) => std::fs::remove_file(path)?,
                Err(e) => return Err(io::Error::from(e).into()),
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    let fd = seqpacket()?;
    rustix::net::bind(&fd, &addr)?;
    let listener = Listener {
        path: path.to_path_buf(),
        fd,
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    // Accepted sockets inherit it: each message then carries its sender.
    rustix::net::sockopt::set_socket_passcred(&listener.fd, true)?;
    rustix::net::listen(&listener.fd, 256)?;
    Ok(listener)
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Start the listener's thread; it ends (removing the socket file) within
/// [`IDLE`] of the sampler dropping `store`.
pub(crate) fn spawn(
    listener: Listener,
    root: ProcRoot,
    store: &Arc<Store>,
    limits: Limits,
) -> io::Result<JoinHandle<()>> {
    let weak = Arc::downgrade(store);
    std::thread::Builder::new()
        .name("torch-bridge".into())
        .spawn(move || Loop::new(listener, root, weak, limits).run())
}

/// A token bucket that may go into debt by one message: the message that
/// empties it is still taken, the next waits.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    messages: f64,
    bytes: f64,
    last: Instant,
}

impl Bucket {
    fn full(now: Instant, per_second: (f64, f64)) -> Bucket {
        Bucket {
            messages: per_second.0,
            bytes: per_second.1,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant, per_second: (f64, f64)) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.messages = (self.messages + per_second.0 * dt).min(per_second.0);
        self.bytes = (self.bytes + per_second.1 * dt).min(per_second.1);
    }

    /// Take one message of `bytes`; `Some(wait)` when the bucket is now
    /// empty and refills after `wait`.
    fn take(&mut self, bytes: usize, per_second: (f64, f64)) -> Option<Duration> {
        self.messages -= 1.0;
        self.bytes -= bytes as f64;
        if self.messages >= 1.0 && self.bytes > 0.0 {
            return None;
        }
        let m = (1.0 - self.messages).max(0.0) / per_second.0;
        let b = (1.0 - self.bytes).max(0.0) / per_second.1;
        Some(Duration::from_secs_f64(m.max(b).min(60.0)))
    }
}

#[derive(Debug)]
struct Uid {
    connections: usize,
    bucket: Bucket,
    paused_until: Option<Instant>,
}

#[derive(Debug)]
struct Conn {
    fd: OwnedFd,
    id: u64,
    uid: u32,
    pid: u32,
    start: u64,
}

/// The peer as the kernel vouches for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Peer {
    pid: u32,
    uid: u32,
}

/// Why a connection was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Refusal {
    /// Pid 0: connected from another pid namespace.
    OtherNamespace,
    /// Gone before its start time could be read with certainty, or
    /// started after the connection was accepted.
    Unverified,
    UidConnections,
    Connections,
}

struct Loop {
    listener: Listener,
    root: ProcRoot,
    store: Weak<Store>,
    limits: Limits,
    conns: Vec<Conn>,
    uids: HashMap<u32, Uid>,
    all: Bucket,
    all_paused_until: Option<Instant>,
    next_id: u64,
    buf: Vec<u8>,
    warned: LogLimiter<&'static str>,
}

impl Loop {
    fn new(listener: Listener, root: ProcRoot, store: Weak<Store>, limits: Limits) -> Loop {
        Loop {
            listener,
            root,
            store,
            limits,
            conns: Vec::new(),
            uids: HashMap::new(),
            all: Bucket::full(Instant::now(), (limits.messages, limits.bytes)),
            all_paused_until: None,
            next_id: 0,
            buf: vec![0; MAX_MESSAGE_BYTES + 1],
            warned: LogLimiter::once(),
        }
    }

    fn run(mut self) {
        tracing::info!(path = %self.listener.path.display(), version = FRAME_VERSION, "listening for torch bridge documents");
        while let Some(store) = self.store.upgrade() {
            let now = Instant::now();
            if self.all_paused_until.is_some_and(|t| t <= now) {
                self.all_paused_until = None;
            }
            for u in self.uids.values_mut() {
                if u.paused_until.is_some_and(|t| t <= now) {
                    u.paused_until = None;
                }
            }
            let wake = self
                .uids
                .values()
                .filter_map(|u| u.paused_until)
                .chain(self.all_paused_until)
                .min()
                .map_or(IDLE, |t| t.saturating_duration_since(now).min(IDLE));
            let readable: Vec<u64> = if self.all_paused_until.is_some() {
                Vec::new()
            } else {
                self.conns
                    .iter()
                    .filter(|c| {
                        self.uids
                            .get(&c.uid)
                            .is_none_or(|u| u.paused_until.is_none())
                    })
                    .map(|c| c.id)
                    .collect()
            };
            let (accept, ready) = match self.poll(&readable, wake) {
                Ok(r) => r,
                Err(e) => {
                    if self.warned.check("poll").is_some() {
                        tracing::error!(error = %e, "torch bridge socket: poll failed; retrying");
                    }
                    std::thread::sleep(IDLE);
                    continue;
                }
            };
            if accept {
                self.accept(&store);
            }
            for id in ready {
                self.read(&store, id);
            }
            store
                .counters
                .open
                .store(self.conns.len() as u64, Ordering::Relaxed);
        }
    }

    /// Wait for the listener and the connections in `ids`; which are ready.
    fn poll(&self, ids: &[u64], timeout: Duration) -> io::Result<(bool, Vec<u64>)> {
        let conns: Vec<&Conn> = ids
            .iter()
            .filter_map(|id| self.conns.iter().find(|c| c.id == *id))
            .collect();
        let mut fds = Vec::with_capacity(conns.len() + 1);
        fds.push(PollFd::new(&self.listener.fd, PollFlags::IN));
        for c in &conns {
            fds.push(PollFd::new(&c.fd, PollFlags::IN));
        }
        let ts = rustix::time::Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        match rustix::event::poll(&mut fds, Some(&ts)) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => return Ok((false, Vec::new())),
            Err(e) => return Err(e.into()),
        }
        let accept = !fds[0].revents().is_empty();
        let ready = fds[1..]
            .iter()
            .zip(&conns)
            .filter(|(f, _)| !f.revents().is_empty())
            .map(|(_, c)| c.id)
            .collect();
        Ok((accept, ready))
    }

    fn accept(&mut self, store: &Store) {
        for _ in 0..ACCEPTS_PER_ROUND {
            let fd = match rustix::net::accept_with(
                &self.listener.fd,
                SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            ) {
                Ok(fd) => fd,
                Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => return,
                // The peer gave up already, or we are out of fds: the
                // next round tries again.
                Err(e) => {
                    if self.warned.check("accept").is_some() {
                        tracing::warn!(error = %e, "torch bridge socket: accept failed; logged once");
                    }
                    return;
                }
            };
            match self.admit(&fd) {
                Ok((peer, start)) => {
                    let id = self.next_id;
                    self.next_id += 1;
                    let now = Instant::now();
                    let per_uid = (self.limits.per_uid_messages, self.limits.per_uid_bytes);
                    self.uids
                        .entry(peer.uid)
                        .or_insert_with(|| Uid {
                            connections: 0,
                            bucket: Bucket::full(now, per_uid),
                            paused_until: None,
                        })
                        .connections += 1;
                    self.conns.push(Conn {
                        fd,
                        id,
                        uid: peer.uid,
                        pid: peer.pid,
                        start,
                    });
                }
                Err((refusal, peer)) => {
                    // Closing at once tells the bridge plainly: its send
                    // fails, and it retries later.
                    drop(fd);
                    self.refused(store, refusal, peer);
                }
            }
        }
    }

    fn refused(&mut self, store: &Store, refusal: Refusal, peer: Option<Peer>) {
        let c = &store.counters;
        let (pid, uid) = peer.map_or((0, 0), |p| (p.pid, p.uid));
        match refusal {
            Refusal::OtherNamespace | Refusal::Unverified => {
                bump(&c.identity);
                if self.warned.check("identity").is_some() {
                    tracing::warn!(
                        pid,
                        uid,
                        cause = if refusal == Refusal::OtherNamespace {
                            "pid 0: the process is outside the exporter's pid namespace (run the exporter with hostPID)"
                        } else {
                            "it exited, or its pid was reused, before its start time could be read"
                        },
                        "torch bridge socket: a connection whose process cannot be told was closed; counted in gpumem_exporter_torch_reports_dropped_total{{reason=\"identity\"}}; logged once"
                    );
                }
            }
            Refusal::UidConnections | Refusal::Connections => {
                bump(&c.limited_connections);
                if self.warned.check("connections").is_some() {
                    tracing::warn!(
                        uid,
                        per_uid = self.limits.per_uid_connections,
                        total = self.limits.connections,
                        "torch bridge socket: too many connections (of this uid, or in all): new ones are closed at once; counted in gpumem_exporter_torch_bridge_limited_total{{reason=\"connections\"}}; logged once"
                    );
                }
            }
        }
    }

    /// Who is on the other end of a new connection, as the kernel says, and
    /// whether it may have one more.
    fn admit(&self, fd: &OwnedFd) -> Result<(Peer, u64), (Refusal, Option<Peer>)> {
        let accepted_at = boottime_ticks();
        let peer = peer_cred(fd.as_fd()).map_err(|_| (Refusal::Unverified, None))?;
        if peer.pid == 0 {
            return Err((Refusal::OtherNamespace, Some(peer)));
        }
        if self.conns.len() >= self.limits.connections {
            return Err((Refusal::Connections, Some(peer)));
        }
        if self
            .uids
            .get(&peer.uid)
            .is_some_and(|u| u.connections >= self.limits.per_uid_connections)
        {
            return Err((Refusal::UidConnections, Some(peer)));
        }
        let unverified = (Refusal::Unverified, Some(peer));
        // The connecting process itself (Linux ≥ 6.5), else its pid now.
        let (pidfd, exact) = match peer_pidfd(fd.as_fd()) {
            Ok(p) => (p, true),
            Err(_) => {
                let pid = Pid::from_raw(peer.pid as i32).ok_or(unverified)?;
                let p = rustix::process::pidfd_open(pid, PidfdFlags::empty())
                    .map_err(|_| unverified)?;
                (p, false)
            }
        };
        let start = self.root.start_time(peer.pid).ok_or(unverified)?;
        // Still running after the read: the start time was its own.
        if exited(pidfd.as_fd()) {
            return Err(unverified);
        }
        if !exact && accepted_at.is_some_and(|t| start > t) {
            return Err(unverified);
        }
        Ok((peer, start))
    }

    fn read(&mut self, store: &Store, id: u64) {
        for _ in 0..READS_PER_ROUND {
            let Some(conn) = self.conns.iter().find(|c| c.id == id) else {
                return;
            };
            let (uid, key) = (conn.uid, (conn.pid, conn.start));
            let got = recv(conn.fd.as_fd(), &mut self.buf);
            let msg = match got {
                Ok(Received::Message(m)) => m,
                Ok(Received::WouldBlock) => return,
                Ok(Received::Eof) | Err(_) => {
                    self.close(store, id);
                    return;
                }
            };
            let paused = self.charge(uid, msg.len);
            if paused {
                bump(&store.counters.limited_rate);
                if self.warned.check("rate").is_some() {
                    tracing::warn!(
                        uid,
                        "torch bridge socket: a uid passed its budget ({} messages, {} bytes a second): its connections wait until it refills; counted in gpumem_exporter_torch_bridge_limited_total{{reason=\"rate\"}}; logged once",
                        self.limits.per_uid_messages,
                        self.limits.per_uid_bytes
                    );
                }
            }
            self.handle(store, key, uid, id, &msg);
            if paused {
                return;
            }
        }
    }

    /// Charge one message of `bytes` to `uid` and to everyone; true when
    /// either is now paused.
    fn charge(&mut self, uid: u32, bytes: usize) -> bool {
        let now = Instant::now();
        let l = self.limits;
        let mut paused = false;
        if let Some(u) = self.uids.get_mut(&uid) {
            let rate = (l.per_uid_messages, l.per_uid_bytes);
            u.bucket.refill(now, rate);
            if let Some(wait) = u.bucket.take(bytes, rate) {
                u.paused_until = Some(now + wait);
                paused = true;
            }
        }
        let rate = (l.messages, l.bytes);
        self.all.refill(now, rate);
        if let Some(wait) = self.all.take(bytes, rate) {
            self.all_paused_until = Some(now + wait);
            paused = true;
        }
        paused
    }

    fn handle(&mut self, store: &Store, key: (u32, u64), uid: u32, conn: u64, msg: &Message) {
        let c = &store.counters;
        if msg.sender != Some(Peer { pid: key.0, uid }) {
            bump(&c.identity);
            if self.warned.check("sender").is_some() {
                tracing::warn!(
                    pid = key.0,
                    sender = ?msg.sender.map(|s| s.pid),
                    "torch bridge socket: a message from another process than the one that connected (a child that inherited the socket?) was dropped; counted in gpumem_exporter_torch_reports_dropped_total{{reason=\"identity\"}}; logged once"
                );
            }
            return;
        }
        let parsed = if msg.truncated {
            Err(FrameError::Oversized)
        } else {
            frame::parse_message(&self.buf[..msg.len])
        };
        match parsed {
            Ok(doc) => {
                bump(&c.accepted);
                store.put(key, conn, doc);
            }
            Err(e) => {
                match e.reason() {
                    DropReason::Oversized => bump(&c.oversized),
                    _ => bump(&c.malformed),
                }
                let kind = match e {
                    FrameError::NoHeader => "no-header",
                    FrameError::Version(_) => "version",
                    FrameError::Document(_) => "document",
                    FrameError::Oversized => "oversized",
                };
                if self.warned.check(kind).is_some() {
                    match e {
                        FrameError::Version(v) => tracing::warn!(
                            pid = key.0,
                            version = v,
                            speaks = FRAME_VERSION,
                            "torch bridge socket: a message of a framing version this exporter does not speak was dropped: use a gpumem_bridge of the exporter's release; counted in gpumem_exporter_torch_reports_dropped_total{{reason=\"malformed\"}}; logged once"
                        ),
                        _ => tracing::warn!(
                            pid = key.0,
                            reason = e.reason().as_str(),
                            "torch bridge socket: dropped a message (expected \"gpumem-bridge 1\\n\" and a v1 document of at most 64 KiB); counted in gpumem_exporter_torch_reports_dropped_total; logged once per kind"
                        ),
                    }
                }
            }
        }
    }

    fn close(&mut self, store: &Store, id: u64) {
        let Some(i) = self.conns.iter().position(|c| c.id == id) else {
            return;
        };
        let conn = self.conns.swap_remove(i);
        store.closed((conn.pid, conn.start), conn.id);
        if let Some(u) = self.uids.get_mut(&conn.uid) {
            u.connections = u.connections.saturating_sub(1);
            if u.connections == 0 && u.paused_until.is_none() {
                self.uids.remove(&conn.uid);
            }
        }
    }
}

/// One message as received.
#[derive(Debug)]
struct Message {
    len: usize,
    /// Longer than the buffer: the kernel dropped the rest.
    truncated: bool,
    /// The kernel's `SCM_CREDENTIALS` for it.
    sender: Option<Peer>,
}

#[derive(Debug)]
enum Received {
    Message(Message),
    WouldBlock,
    Eof,
}

/// The clock `/proc/<pid>/stat`'s start time counts in, now.
fn boottime_ticks() -> Option<u64> {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = u64::try_from(hz).ok().filter(|h| *h > 0)?;
    let secs = u64::try_from(t.tv_sec).ok()?;
    let nanos = u64::try_from(t.tv_nsec).ok()?;
    Some(secs * hz + nanos * hz / 1_000_000_000)
}

/// Whether the process behind `pidfd` has exited (the pidfd is readable).
fn exited(pidfd: BorrowedFd<'_>) -> bool {
    let mut fds = [PollFd::from_borrowed_fd(pidfd, PollFlags::IN)];
    let zero = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match rustix::event::poll(&mut fds, Some(&zero)) {
        Ok(n) => n > 0,
        Err(_) => true,
    }
}

/// `SO_PEERCRED`: the pid and uid the kernel recorded at `connect`.
fn peer_cred(fd: BorrowedFd<'_>) -> io::Result<Peer> {
    let mut cred = MaybeUninit::<libc::ucred>::zeroed();
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` has room for `len` bytes, which getsockopt writes at
    // most; a zeroed ucred is a valid value whatever it writes.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            cred.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: zero-initialised above, every bit pattern is a valid ucred.
    let cred = unsafe { cred.assume_init() };
    Ok(Peer {
        pid: u32::try_from(cred.pid).unwrap_or(0),
        uid: cred.uid,
    })
}

/// `SO_PEERPIDFD`: a pidfd of the process that connected (Linux ≥ 6.5).
fn peer_pidfd(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let mut raw: libc::c_int = -1;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `raw` has room for one int, the option's size.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut raw as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r != 0 || raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just installed this fd for us; nothing else owns it.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(raw) })
}

/// Receive one packet into `buf` with its credentials, without waiting.
fn recv(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Received> {
    // Room for one ucred only: fds sent along are never installed.
    let mut control = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid (no name, no iov, no control).
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    hdr.msg_control = control.as_mut_ptr().cast();
    hdr.msg_controllen = size_of::<[u64; 8]>() as _;
    // SAFETY: hdr points at `buf` and `control`, both alive and at least
    // as long as the lengths given.
    let n = unsafe {
        libc::recvmsg(
            fd.as_raw_fd(),
            &mut hdr,
            libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(Received::WouldBlock),
            _ => Err(e),
        };
    }
    let mut sender = None;
    // SAFETY: walking the control buffer the kernel filled, with the
    // kernel's own macros, within msg_controllen.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&hdr);
        while !cmsg.is_null() {
            let c = &*cmsg;
            let data = libc::CMSG_DATA(cmsg);
            let payload = (c.cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
            if c.cmsg_level == libc::SOL_SOCKET {
                if c.cmsg_type == libc::SCM_CREDENTIALS && payload >= size_of::<libc::ucred>() {
                    let cred: libc::ucred = std::ptr::read_unaligned(data.cast());
                    sender = Some(Peer {
                        pid: u32::try_from(cred.pid).unwrap_or(0),
                        uid: cred.uid,
                    });
                } else if c.cmsg_type == libc::SCM_RIGHTS {
                    for i in 0..payload / size_of::<libc::c_int>() {
                        let fd: libc::c_int =
                            std::ptr::read_unaligned(data.cast::<libc::c_int>().add(i));
                        libc::close(fd);
                    }
                }
            }
            cmsg = libc::CMSG_NXTHDR(&hdr, cmsg);
        }
    }
    if n == 0 {
        return Ok(Received::Eof);
    }
    let len = (n as usize).min(buf.len());
    Ok(Received::Message(Message {
        len,
        truncated: hdr.msg_flags & libc::MSG_TRUNC != 0 || len > MAX_MESSAGE_BYTES,
        sender,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;
    use std::os::unix::net::UnixStream;

    const DOC: &str = r#"{"v":1,"devices":[{"uuid":"GPU-a","allocated":1,"reserved":2,"allocated_peak":3,"reserved_peak":4,"active":5,"inactive_split":6,"alloc_retries":7,"ooms":8}]}"#;

    fn connect(path: &Path) -> OwnedFd {
        let fd = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        rustix::net::connect(&fd, &SocketAddrUnix::new(path).unwrap()).unwrap();
        fd
    }

    fn send(fd: &OwnedFd, bytes: &[u8]) {
        rustix::net::send(fd, bytes, rustix::net::SendFlags::empty()).unwrap();
    }

    fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A private directory for the socket (mode 0700, ours).
    fn dir() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    #[test]
    fn documents_are_keyed_by_the_kernels_pid_and_leave_with_the_connection() {
        let d = dir();
        let path = d.path().join("bridge.sock");
        let store = Arc::new(Store::default());
        let root = ProcRoot::default();
        let listener = bind(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o666);
        let thread = spawn(listener, root.clone(), &store, LIMITS).unwrap();
        let me = std::process::id();
        let start = root.start_time(me).unwrap();

        let c = connect(&path);
        // A claimed pid in the document counts for nothing.
        send(
            &c,
            format!(
                "gpumem-bridge 1\n{}",
                DOC.replace("{\"v\":1", "{\"v\":1,\"pid\":1")
            )
            .as_bytes(),
        );
        wait_for("the document", || store.get(me, start).is_some());
        assert_eq!(store.get(1, start), None);
        assert_eq!(store.get(me, start + 1), None, "another start time");
        let doc = store.get(me, start).unwrap();
        assert_eq!(doc.devices[0].1.allocated, 1);
        assert_eq!(store.counters.open.load(Ordering::Relaxed), 1);

        // Bad messages are counted, the good document stays.
        send(&c, DOC.as_bytes());
        send(&c, format!("gpumem-bridge 7\n{DOC}").as_bytes());
        send(&c, &vec![b' '; MAX_MESSAGE_BYTES + 10]);
        wait_for("drops counted", || {
            store.counters.malformed.load(Ordering::Relaxed) == 2
                && store.counters.oversized.load(Ordering::Relaxed) == 1
        });
        assert!(store.get(me, start).is_some());
        assert_eq!(store.counters.accepted.load(Ordering::Relaxed), 1);

        drop(c);
        wait_for("gone with the connection", || {
            store.get(me, start).is_none()
        });

        // A second exporter on the same path is refused; the first one's
        // socket is left alone.
        assert!(matches!(bind(&path), Err(BindError::InUse)));
        drop(store);
        thread.join().unwrap();
        assert!(!path.exists(), "socket removed when the thread ended");
    }

    #[test]
    fn a_message_from_a_process_that_did_not_connect_is_dropped() {
        let d = dir();
        let path = d.path().join("bridge.sock");
        let store = Arc::new(Store::default());
        let _t = spawn(bind(&path).unwrap(), ProcRoot::default(), &store, LIMITS).unwrap();
        let c = connect(&path);
        // A child sends on the socket its parent connected: the kernel's
        // per-message credentials name the child.
        let msg = format!("gpumem-bridge 1\n{DOC}");
        // SAFETY: the child only calls async-signal-safe functions (send,
        // _exit) before exiting.
        let child = unsafe { libc::fork() };
        if child == 0 {
            unsafe {
                libc::send(c.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0);
                libc::_exit(0);
            }
        }
        assert!(child > 0);
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(child, &mut status, 0) };
        wait_for("identity counted", || {
            store.counters.identity.load(Ordering::Relaxed) == 1
        });
        let start = ProcRoot::default().start_time(std::process::id()).unwrap();
        assert!(store.get(std::process::id(), start).is_none());
        assert!(store.get(child as u32, start).is_none());
    }

    #[test]
    fn connections_past_the_uid_cap_are_closed_at_once() {
        let d = dir();
        let path = d.path().join("bridge.sock");
        let store = Arc::new(Store::default());
        let limits = Limits {
            per_uid_connections: 2,
            ..LIMITS
        };
        let _t = spawn(bind(&path).unwrap(), ProcRoot::default(), &store, limits).unwrap();
        let kept: Vec<OwnedFd> = (0..2).map(|_| connect(&path)).collect();
        wait_for("two open", || {
            store.counters.open.load(Ordering::Relaxed) == 2
        });
        let extra = connect(&path);
        wait_for("the third refused", || {
            store.counters.limited_connections.load(Ordering::Relaxed) == 1
        });
        // Its sends fail: the exporter closed it.
        let mut s = UnixStream::from(extra);
        let failed = (0..50).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            s.write(b"gpumem-bridge 1\n{}").is_err()
        });
        assert!(failed, "a refused connection must be closed");
        assert_eq!(store.counters.open.load(Ordering::Relaxed), 2);
        drop(kept);
    }

    #[test]
    fn a_flood_is_paused_at_the_uids_budget() {
        let d = dir();
        let path = d.path().join("bridge.sock");
        let store = Arc::new(Store::default());
        let limits = Limits {
            per_uid_messages: 20.0,
            ..LIMITS
        };
        let _t = spawn(bind(&path).unwrap(), ProcRoot::default(), &store, limits).unwrap();
        let c = connect(&path);
        rustix::io::ioctl_fionbio(&c, true).unwrap();
        let msg = format!("gpumem-bridge 1\n{DOC}");
        let began = Instant::now();
        let mut sent = 0u64;
        while began.elapsed() < Duration::from_millis(1500) {
            if rustix::net::send(&c, msg.as_bytes(), rustix::net::SendFlags::empty()).is_ok() {
                sent += 1;
            } else {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let elapsed = began.elapsed().as_secs_f64();
        let accepted = store.counters.accepted.load(Ordering::Relaxed);
        // A burst of one second's worth, then the rate: never much more.
        let bound = (20.0 * (1.0 + elapsed)) as u64 + 2;
        assert!(
            accepted <= bound,
            "{accepted} accepted of {sent} sent in {elapsed:.2} s, bound {bound}"
        );
        assert!(accepted >= 20, "{accepted}");
        assert!(store.counters.limited_rate.load(Ordering::Relaxed) >= 1);
    }

    #[test]
    fn buckets() {
        let t0 = Instant::now();
        let rate = (2.0, 1000.0);
        let mut b = Bucket::full(t0, rate);
        assert_eq!(b.take(10, rate), None);
        // The second message empties it: taken, then a wait of half a second.
        let wait = b.take(10, rate).unwrap();
        assert!((wait.as_secs_f64() - 0.5).abs() < 1e-6, "{wait:?}");
        b.refill(t0 + Duration::from_millis(500), rate);
        assert_eq!(b.take(10, rate), Some(Duration::from_millis(500)));
        // A large message runs the bytes into debt: the wait covers it.
        let mut b = Bucket::full(t0, rate);
        let wait = b.take(3000, rate).unwrap();
        assert!((wait.as_secs_f64() - 2.001).abs() < 1e-6, "{wait:?}");
    }

    #[test]
    fn bind_refuses_unsafe_places() {
        let d = dir();
        assert!(matches!(
            bind(&d.path().join("missing/bridge.sock")),
            Err(BindError::NoDirectory(_))
        ));
        let open = d.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let e = bind(&open.join("bridge.sock")).unwrap_err();
        assert!(matches!(e, BindError::UnsafeDirectory { .. }), "{e}");
        assert!(e.to_string().contains("writable by others"), "{e}");
        let file = d.path().join("file");
        std::fs::write(&file, b"keep me").unwrap();
        assert!(matches!(bind(&file), Err(BindError::NotSocket)));
        assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
        // A stale socket (nobody listening) is replaced.
        let stale = d.path().join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
        assert!(stale.exists());
        let l = bind(&stale).unwrap();
        drop(l);
        assert!(!stale.exists());
    }
}
