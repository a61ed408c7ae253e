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
//! **Nothing a sender attaches is closed here.** The socket refuses passed
//! fds (`SO_PASSRIGHTS` off, Linux ≥ 6.16, on the listener, which the
//! connection's socket inherits at `connect`, before `accept`): a sender's
//! `SCM_RIGHTS` fails with `EPERM`. Where the kernel cannot refuse them,
//! messages are received with room for every fd the kernel may pass
//! ([`super::control`]), so none is released in this thread, and the fds
//! and every connection (whose queue may hold more) are closed on another
//! thread ([`super::closer`]): a TCP socket lingering or a FUSE file whose
//! daemon never answers `FLUSH` waits there, not here. A connection that
//! passes fds is closed and its holder refused for [`FDS_REFUSED_FOR`].
//! Should this thread still stop (a kernel hang), the stall is visible:
//! [`Store::stalled`] (a gauge, and `/readyz`), counted when it ends.
//!
//! **Bounds**, all counted ([`Counters`], `gpumem_exporter_torch_bridge_*`),
//! per budget holder ([`super::holder`]: the peer's pod, container or
//! Slurm job where its root-owned cgroup path names one, else its uid) and
//! in all ([`LIMITS`]): open connections (one over is closed at once),
//! connections a second (the same), messages and bytes per second (a
//! holder past its budget is not read until the budget refills: its
//! messages wait in the socket, where the bridge's non-blocking `send`
//! drops what does not fit, so a flood costs the exporter at most the
//! budget), at most [`MAX_MESSAGE_BYTES`] a message (a longer packet is
//! cut by the kernel and dropped), the memory of the documents kept (per
//! holder and in all; a process not on a GPU keeps at most a small
//! allowance per holder, so a process just started gets its figures in
//! its first sample on a GPU), and connections silent for [`Limits::idle`]
//! are closed (the bridge sends at least once a minute, and reconnects).
//!
//! Why by hand: tokio has no `SOCK_SEQPACKET` socket, and one thread
//! polling at most [`Limits::connections`] fds is small and bounded.
//! rustix makes the socket, binds, accepts and polls; `SO_PEERCRED` and
//! `recvmsg` go through libc because rustix's `UCred` holds the pid as a
//! non-zero integer, and a peer outside the exporter's pid namespace has
//! pid 0.

use std::collections::{HashMap, HashSet};
use std::io;
use std::mem::{MaybeUninit, size_of};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use rustix::process::{Pid, PidfdFlags};

use super::closer::Closer;
use super::control::{self, CONTROL_BYTES};
use super::document::{Document, DropReason};
use super::frame::{self, FRAME_VERSION, FrameError, MAX_MESSAGE_BYTES};
use super::holder::{Holder, Holders};
use crate::attribute::procfs::ProcRoot;
use crate::ratelimit::LogLimiter;

/// What one budget holder, and everyone together, may use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Limits {
    pub per_holder_connections: usize,
    pub connections: usize,
    /// New connections a second (the burst is
    /// [`Limits::per_holder_connections`]).
    pub per_holder_connects: f64,
    /// Messages a second (the burst is one second's worth).
    pub per_holder_messages: f64,
    pub messages: f64,
    /// Bytes a second (the burst is one second's worth).
    pub per_holder_bytes: f64,
    pub bytes: f64,
    /// Memory of the documents kept (their parsed size), per holder and
    /// in all.
    pub per_holder_held: usize,
    pub held: usize,
    /// Documents of processes not (yet) on a GPU kept per holder, and
    /// their memory in all.
    pub pending_per_holder: usize,
    pub pending_held: usize,
    /// A connection that sent nothing for this long is closed.
    pub idle: Duration,
}

/// The bridge publishes once a second (at most 20 times a second, at
/// least once a minute); a holder's 64 processes with full step rings on
/// 8 GPUs (about 40 KiB a document, a few KiB parsed) fit. A flood within
/// these costs the exporter about 1 % of a core (2 MiB of JSON a second)
/// per holder; the documents kept are at most 24 MiB in all (a node's
/// DaemonSet limit is 160 MiB).
pub(crate) const LIMITS: Limits = Limits {
    per_holder_connections: 64,
    connections: 512,
    per_holder_connects: 16.0,
    per_holder_messages: 500.0,
    messages: 4000.0,
    per_holder_bytes: 2.0 * 1024.0 * 1024.0,
    bytes: 16.0 * 1024.0 * 1024.0,
    per_holder_held: 4 << 20,
    held: 24 << 20,
    pending_per_holder: 8,
    pending_held: 4 << 20,
    idle: Duration::from_secs(180),
};

/// How long the thread sleeps at most: it ends within this when the
/// sampler drops the store.
const IDLE: Duration = Duration::from_millis(500);
/// A round of the loop (its longest sleep is [`IDLE`]) that has not ended
/// after this long is a stall.
pub(crate) const STALL_AFTER: Duration = Duration::from_secs(2);
/// Connections accepted per wake-up, so a connect flood cannot keep the
/// loop from reading.
const ACCEPTS_PER_ROUND: usize = 64;
/// Messages read from one connection per wake-up.
const READS_PER_ROUND: usize = 8;
/// A holder whose connection passed fds is refused for this long.
pub(crate) const FDS_REFUSED_FOR: Duration = Duration::from_secs(60);
/// What a kept document costs beside its parsed size (its entry).
const ENTRY_BYTES: usize = 256;

/// `SO_PEERPIDFD` (asm-generic: x86_64 and aarch64); libc does not
/// export it yet.
const SO_PEERPIDFD: libc::c_int = 77;
/// `SO_PASSRIGHTS` (asm-generic, Linux ≥ 6.16): 0 refuses `SCM_RIGHTS`.
const SO_PASSRIGHTS: libc::c_int = 83;

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
    /// Connections closed at once: their holder connected too often.
    pub limited_connects: AtomicU64,
    /// Times a holder (or everyone) was paused for passing the budget.
    pub limited_rate: AtomicU64,
    /// Documents not kept (or dropped later) for the memory bounds.
    pub limited_memory: AtomicU64,
    /// Connections closed because they passed fds (or were refused while
    /// their holder was).
    pub limited_fds: AtomicU64,
    /// Connections closed after [`Limits::idle`] without a message.
    pub idle_closed: AtomicU64,
    /// Connections open now.
    pub open: AtomicU64,
    /// Rounds of the loop that took longer than [`STALL_AFTER`].
    pub stalls: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

type Key = (u32, u64);

#[derive(Debug)]
struct Entry {
    conn: u64,
    holder: Holder,
    doc: Arc<Document>,
    bytes: usize,
    /// Order of arrival: the oldest pending document goes first.
    seq: u64,
}

#[derive(Debug, Default, Clone, Copy)]
struct Usage {
    bytes: usize,
    pending: usize,
}

/// The documents kept, and what they cost.
#[derive(Debug, Default)]
struct Docs {
    map: HashMap<Key, Entry>,
    /// The processes the last full sample found on a GPU.
    live: HashSet<Key>,
    usage: HashMap<Holder, Usage>,
    held: usize,
    pending_held: usize,
    seq: u64,
}

impl Docs {
    fn is_live(&self, key: &Key) -> bool {
        self.live.contains(key)
    }

    fn remove(&mut self, key: &Key) -> Option<Entry> {
        let e = self.map.remove(key)?;
        let pending = !self.is_live(key);
        self.held -= e.bytes;
        if pending {
            self.pending_held -= e.bytes;
        }
        if let Some(u) = self.usage.get_mut(&e.holder) {
            u.bytes -= e.bytes;
            u.pending -= usize::from(pending);
            if u.bytes == 0 && u.pending == 0 {
                self.usage.remove(&e.holder);
            }
        }
        Some(e)
    }

    fn insert(&mut self, key: Key, e: Entry) {
        let pending = !self.is_live(&key);
        self.held += e.bytes;
        if pending {
            self.pending_held += e.bytes;
        }
        let u = self.usage.entry(e.holder.clone()).or_default();
        u.bytes += e.bytes;
        u.pending += usize::from(pending);
        self.map.insert(key, e);
    }

    fn usage(&self, h: &Holder) -> Usage {
        self.usage.get(h).copied().unwrap_or_default()
    }

    /// Drop the oldest pending document (of `holder`, or of anyone);
    /// false when there is none.
    fn evict_pending(&mut self, holder: Option<&Holder>) -> bool {
        let oldest = self
            .map
            .iter()
            .filter(|(k, e)| !self.live.contains(k) && holder.is_none_or(|h| *h == e.holder))
            .min_by_key(|(_, e)| e.seq)
            .map(|(k, _)| *k);
        oldest.is_some_and(|k| self.remove(&k).is_some())
    }

    /// Recount after the live set changed.
    fn recount(&mut self) {
        self.usage.clear();
        self.held = 0;
        self.pending_held = 0;
        for (k, e) in &self.map {
            let pending = !self.live.contains(k);
            self.held += e.bytes;
            if pending {
                self.pending_held += e.bytes;
            }
            let u = self.usage.entry(e.holder.clone()).or_default();
            u.bytes += e.bytes;
            u.pending += usize::from(pending);
        }
    }
}

/// What the listener thread shares with the sampler: the latest document
/// per (pid, start time), the counters and the listener's progress. The
/// thread holds it weakly and ends when the sampler drops it.
#[derive(Debug)]
pub(crate) struct Store {
    docs: Mutex<Docs>,
    limits: Limits,
    pub(crate) counters: Counters,
    epoch: Instant,
    /// Milliseconds after `epoch` when the listener last ended a round.
    progress_ms: AtomicU64,
    /// Fds waiting on the closing thread.
    close_waiting: AtomicU64,
}

impl Default for Store {
    fn default() -> Self {
        Store::new(LIMITS)
    }
}

impl Store {
    pub(crate) fn new(limits: Limits) -> Self {
        Store {
            docs: Mutex::default(),
            limits,
            counters: Counters::default(),
            epoch: Instant::now(),
            progress_ms: AtomicU64::new(0),
            close_waiting: AtomicU64::new(0),
        }
    }

    /// The latest document process (`pid`, `start`) sent, if its
    /// connection is open.
    pub(crate) fn get(&self, pid: u32, start: u64) -> Option<Arc<Document>> {
        let docs = self.docs.lock().ok()?;
        docs.map.get(&(pid, start)).map(|e| Arc::clone(&e.doc))
    }

    /// The processes a full sample found on a GPU: their documents are
    /// kept within the holder's and the total memory bound; the others'
    /// only within the small pending allowance.
    pub(crate) fn set_live(&self, live: HashSet<Key>) {
        let Ok(mut d) = self.docs.lock() else {
            return;
        };
        d.live = live;
        d.recount();
        let l = self.limits;
        let mut dropped = 0;
        let over: Vec<Holder> = d
            .usage
            .iter()
            .filter(|(_, u)| u.pending > l.pending_per_holder)
            .map(|(h, _)| h.clone())
            .collect();
        for h in over {
            while d.usage(&h).pending > l.pending_per_holder && d.evict_pending(Some(&h)) {
                dropped += 1;
            }
        }
        while d.pending_held > l.pending_held && d.evict_pending(None) {
            dropped += 1;
        }
        self.counters
            .limited_memory
            .fetch_add(dropped, Ordering::Relaxed);
    }

    /// Keep `doc` as `key`'s latest, sent on connection `conn` of
    /// `holder`, within the memory bounds; false when it was not kept.
    fn put(&self, key: Key, conn: u64, holder: &Holder, doc: Document) -> bool {
        let bytes = doc.heap_bytes() + ENTRY_BYTES;
        let l = self.limits;
        let Ok(mut d) = self.docs.lock() else {
            return false;
        };
        d.remove(&key);
        let live = d.is_live(&key);
        let mut evicted = 0;
        let mut fits = true;
        if !live {
            while d.usage(holder).pending >= l.pending_per_holder && d.evict_pending(Some(holder)) {
                evicted += 1;
            }
            while d.pending_held + bytes > l.pending_held && d.evict_pending(Some(holder)) {
                evicted += 1;
            }
            fits = d.usage(holder).pending < l.pending_per_holder
                && d.pending_held + bytes <= l.pending_held;
        }
        while fits && d.usage(holder).bytes + bytes > l.per_holder_held {
            if !d.evict_pending(Some(holder)) {
                fits = false;
            } else {
                evicted += 1;
            }
        }
        while fits && d.held + bytes > l.held {
            // A process on a GPU goes before anyone's pending ones.
            if !live || !d.evict_pending(None) {
                fits = false;
            } else {
                evicted += 1;
            }
        }
        if fits {
            let seq = d.seq;
            d.seq += 1;
            d.insert(
                key,
                Entry {
                    conn,
                    holder: holder.clone(),
                    doc: Arc::new(doc),
                    bytes,
                    seq,
                },
            );
        }
        self.counters
            .limited_memory
            .fetch_add(evicted + u64::from(!fits), Ordering::Relaxed);
        fits
    }

    /// Forget `key`'s document if connection `conn` sent it (a newer
    /// connection of the same process keeps its own).
    fn closed(&self, key: Key, conn: u64) {
        if let Ok(mut docs) = self.docs.lock()
            && docs.map.get(&key).is_some_and(|e| e.conn == conn)
        {
            docs.remove(&key);
        }
    }

    /// Memory of the documents kept now.
    pub(crate) fn held_bytes(&self) -> u64 {
        self.docs.lock().map_or(0, |d| d.held as u64)
    }

    /// Fds handed to the closing thread and not closed yet.
    pub(crate) fn close_waiting(&self) -> u64 {
        self.close_waiting.load(Ordering::Relaxed)
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// The listener ended a round now.
    fn progress(&self) {
        let now = self.now_ms();
        let last = self.progress_ms.swap(now, Ordering::Relaxed);
        if now.saturating_sub(last) > STALL_AFTER.as_millis() as u64 && last != 0 {
            bump(&self.counters.stalls);
        }
    }

    /// How long the listener has been stuck in one round, when longer
    /// than [`STALL_AFTER`] (its longest sleep is half a second).
    pub(crate) fn stalled(&self) -> Option<Duration> {
        let last = self.progress_ms.load(Ordering::Relaxed);
        let age = Duration::from_millis(self.now_ms().saturating_sub(last));
        (age > STALL_AFTER).then_some(age)
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
    /// The kernel refuses `SCM_RIGHTS` on it (`SO_PASSRIGHTS` off).
    refuses_fds: bool,
}

fn seqpacket() -> io::Result<OwnedFd> {
    Ok(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?)
}

/// Turn `SO_PASSRIGHTS` off on `fd`: whether the kernel now refuses fds
/// sent to it (false before Linux 6.16).
fn refuse_fds(fd: BorrowedFd<'_>) -> bool {
    let off: libc::c_int = 0;
    // SAFETY: an int option, passed by pointer with its size.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PASSRIGHTS,
            (&off as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    r == 0
}

/// Bind and listen on `path`: its directory must exist and be writable by
/// no one but its owner (the exporter's uid or root); a stale socket left
/// by an earlier run is replaced, a live one is not; the socket is mode
/// 0666 (anyone may connect; the kernel says who did).
pub(crate) fn bind(path: &Path) -> Result<Listener, BindError> {
    bind_with(path, true)
}

/// [`bind`], with passed fds refused where the kernel can
/// (`refuse` false: as on a kernel before 6.16, for tests of the closer).
pub(crate) fn bind_with(path: &Path, refuse: bool) -> Result<Listener, BindError> {
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
    // Before listen: a connection's socket inherits it when made, so no
    // fd can be queued even before `accept`.
    let refuses_fds = refuse && refuse_fds(fd.as_fd());
    let listener = Listener {
        path: path.to_path_buf(),
        fd,
        refuses_fds,
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
/// [`IDLE`] of the sampler dropping `store`. `cgroupfs` is where budget
/// holders' cgroup paths are checked (`path.cgroupfs`).
pub(crate) fn spawn(
    listener: Listener,
    root: ProcRoot,
    cgroupfs: &str,
    store: &Arc<Store>,
) -> io::Result<JoinHandle<()>> {
    let weak = Arc::downgrade(store);
    let limits = store.limits;
    let holders = Holders::new(root.clone(), cgroupfs);
    // Not needed where the kernel refuses fds: nothing to close can wait.
    let closer = if listener.refuses_fds {
        None
    } else {
        Some(Closer::spawn()?)
    };
    store.progress();
    std::thread::Builder::new()
        .name("torch-bridge".into())
        .spawn(move || Loop::new(listener, root, holders, closer, weak, limits).run())
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

/// A budget holder's share.
#[derive(Debug)]
struct HolderState {
    connections: usize,
    bucket: Bucket,
    paused_until: Option<Instant>,
    /// Connects left (refilled at [`Limits::per_holder_connects`]).
    connects: f64,
    connects_at: Instant,
    /// Refused until then: one of its connections passed fds.
    refused_until: Option<Instant>,
}

impl HolderState {
    fn new(now: Instant, l: &Limits) -> HolderState {
        HolderState {
            connections: 0,
            bucket: Bucket::full(now, (l.per_holder_messages, l.per_holder_bytes)),
            paused_until: None,
            connects: l.per_holder_connections as f64,
            connects_at: now,
            refused_until: None,
        }
    }

    /// Take one connect; false when none is left.
    fn connect(&mut self, now: Instant, l: &Limits) -> bool {
        let dt = now
            .saturating_duration_since(self.connects_at)
            .as_secs_f64();
        self.connects_at = now;
        self.connects =
            (self.connects + dt * l.per_holder_connects).min(l.per_holder_connections as f64);
        if self.connects < 1.0 {
            return false;
        }
        self.connects -= 1.0;
        true
    }

    /// Nothing to remember: no connection, no pause, no refusal, and its
    /// connects refilled.
    fn forgettable(&self, now: Instant, l: &Limits) -> bool {
        let dt = now
            .saturating_duration_since(self.connects_at)
            .as_secs_f64();
        self.connections == 0
            && self.paused_until.is_none()
            && self.refused_until.is_none_or(|t| t <= now)
            && self.connects + dt * l.per_holder_connects >= l.per_holder_connections as f64
    }
}

#[derive(Debug)]
struct Conn {
    fd: OwnedFd,
    id: u64,
    holder: Holder,
    pid: u32,
    uid: u32,
    start: u64,
    last_message: Instant,
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
    HolderConnections,
    Connections,
    Connects,
    /// Its holder passed fds a moment ago.
    Fds,
}

struct Loop {
    listener: Listener,
    root: ProcRoot,
    holders: Holders,
    closer: Option<Closer>,
    store: Weak<Store>,
    limits: Limits,
    conns: Vec<Conn>,
    budgets: HashMap<Holder, HolderState>,
    all: Bucket,
    all_paused_until: Option<Instant>,
    next_id: u64,
    buf: Vec<u8>,
    control: Vec<u64>,
    last_sweep: Instant,
    warned: LogLimiter<&'static str>,
}

impl Loop {
    fn new(
        listener: Listener,
        root: ProcRoot,
        holders: Holders,
        closer: Option<Closer>,
        store: Weak<Store>,
        limits: Limits,
    ) -> Loop {
        Loop {
            listener,
            root,
            holders,
            closer,
            store,
            limits,
            conns: Vec::new(),
            budgets: HashMap::new(),
            all: Bucket::full(Instant::now(), (limits.messages, limits.bytes)),
            all_paused_until: None,
            next_id: 0,
            buf: vec![0; MAX_MESSAGE_BYTES + 1],
            control: vec![0; CONTROL_BYTES.div_ceil(8)],
            last_sweep: Instant::now(),
            warned: LogLimiter::once(),
        }
    }

    fn run(mut self) {
        tracing::info!(
            path = %self.listener.path.display(),
            version = FRAME_VERSION,
            passed_fds = if self.listener.refuses_fds { "refused by the kernel" } else { "closed on a thread of their own (SO_PASSRIGHTS needs Linux 6.16)" },
            "listening for torch bridge documents"
        );
        while let Some(store) = self.store.upgrade() {
            let now = Instant::now();
            if self.all_paused_until.is_some_and(|t| t <= now) {
                self.all_paused_until = None;
            }
            for u in self.budgets.values_mut() {
                if u.paused_until.is_some_and(|t| t <= now) {
                    u.paused_until = None;
                }
            }
            let wake = self
                .budgets
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
                        self.budgets
                            .get(&c.holder)
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
            if self.last_sweep.elapsed() >= Duration::from_secs(1) {
                self.sweep(&store);
            }
            store
                .counters
                .open
                .store(self.conns.len() as u64, Ordering::Relaxed);
            store.close_waiting.store(
                self.closer.as_ref().map_or(0, Closer::waiting),
                Ordering::Relaxed,
            );
            store.progress();
        }
    }

    /// Once a second: close idle connections, forget holders with
    /// nothing to remember.
    fn sweep(&mut self, store: &Store) {
        let now = Instant::now();
        self.last_sweep = now;
        let idle: Vec<u64> = self
            .conns
            .iter()
            .filter(|c| now.saturating_duration_since(c.last_message) >= self.limits.idle)
            .map(|c| c.id)
            .collect();
        for id in idle {
            bump(&store.counters.idle_closed);
            self.close(store, id);
        }
        let l = self.limits;
        self.budgets.retain(|_, u| !u.forgettable(now, &l));
    }

    /// Close `fd` where its release cannot hold up this thread.
    fn dispose(&self, fd: OwnedFd) {
        match &self.closer {
            Some(c) => c.close(fd),
            None => drop(fd),
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
            if self.listener.refuses_fds {
                // Inherited from the listener already; kept off should a
                // kernel not pass it on.
                refuse_fds(fd.as_fd());
            }
            match self.admit(&fd) {
                Ok((peer, start, holder)) => {
                    let id = self.next_id;
                    self.next_id += 1;
                    if let Some(h) = self.budgets.get_mut(&holder) {
                        h.connections += 1;
                    }
                    self.conns.push(Conn {
                        fd,
                        id,
                        holder,
                        uid: peer.uid,
                        pid: peer.pid,
                        start,
                        last_message: Instant::now(),
                    });
                }
                Err((refusal, peer, holder)) => {
                    // Closing at once tells the bridge plainly: its send
                    // fails, and it retries later.
                    self.dispose(fd);
                    self.refused(store, refusal, peer, holder.as_ref());
                }
            }
        }
    }

    fn refused(
        &mut self,
        store: &Store,
        refusal: Refusal,
        peer: Option<Peer>,
        holder: Option<&Holder>,
    ) {
        let c = &store.counters;
        let (pid, uid) = peer.map_or((0, 0), |p| (p.pid, p.uid));
        let holder_kind = holder.map_or("none", Holder::kind);
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
            Refusal::HolderConnections | Refusal::Connections => {
                bump(&c.limited_connections);
                if self.warned.check("connections").is_some() {
                    tracing::warn!(
                        pid,
                        uid,
                        holder = holder_kind,
                        per_holder = self.limits.per_holder_connections,
                        total = self.limits.connections,
                        "torch bridge socket: too many connections (of this pod, container, Slurm job or uid, or in all): new ones are closed at once; counted in gpumem_exporter_torch_bridge_limited_total{{reason=\"connections\"}}; logged once"
                    );
                }
            }
            Refusal::Connects => {
                bump(&c.limited_connects);
                if self.warned.check("connects").is_some() {
                    tracing::warn!(
                        pid,
                        uid,
                        holder = holder_kind,
                        per_second = self.limits.per_holder_connects,
                        "torch bridge socket: a pod, container, Slurm job or uid connects too often: its new connections are closed at once until its budget refills; counted in gpumem_exporter_torch_bridge_limited_total{{reason=\"connects\"}}; logged once"
                    );
                }
            }
            Refusal::Fds => bump(&c.limited_fds),
        }
    }

    /// Who is on the other end of a new connection, as the kernel says, and
    /// whether its holder may have one more.
    #[allow(clippy::type_complexity)]
    fn admit(
        &mut self,
        fd: &OwnedFd,
    ) -> Result<(Peer, u64, Holder), (Refusal, Option<Peer>, Option<Holder>)> {
        let accepted_at = boottime_ticks();
        let peer = peer_cred(fd.as_fd()).map_err(|_| (Refusal::Unverified, None, None))?;
        if peer.pid == 0 {
            return Err((Refusal::OtherNamespace, Some(peer), None));
        }
        if self.conns.len() >= self.limits.connections {
            return Err((Refusal::Connections, Some(peer), None));
        }
        let unverified = (Refusal::Unverified, Some(peer), None);
        // The connecting process itself (Linux ≥ 6.5), else its pid now.
        let (pidfd, exact) = match peer_pidfd(fd.as_fd()) {
            Ok(p) => (p, true),
            Err(_) => {
                let pid = Pid::from_raw(peer.pid as i32).ok_or_else(|| unverified.clone())?;
                let p = rustix::process::pidfd_open(pid, PidfdFlags::empty())
                    .map_err(|_| unverified.clone())?;
                (p, false)
            }
        };
        // A process seen before costs an fstat (its pidfd's inode).
        let known = if exact {
            self.holders.cached(pidfd.as_fd())
        } else {
            None
        };
        let (start, holder) = match known {
            Some(k) => k,
            None => {
                let start = self
                    .root
                    .start_time(peer.pid)
                    .ok_or_else(|| unverified.clone())?;
                let holder = self.holders.resolve(peer.pid, peer.uid);
                // Still running after the reads: they were its own.
                if exited(pidfd.as_fd()) {
                    return Err(unverified);
                }
                if !exact && accepted_at.is_some_and(|t| start > t) {
                    return Err(unverified);
                }
                if exact {
                    self.holders.remember(pidfd.as_fd(), start, &holder);
                }
                (start, holder)
            }
        };
        let now = Instant::now();
        let l = self.limits;
        let state = self
            .budgets
            .entry(holder.clone())
            .or_insert_with(|| HolderState::new(now, &l));
        let refuse = |r| Err((r, Some(peer), Some(holder.clone())));
        if state.refused_until.is_some_and(|t| t > now) {
            return refuse(Refusal::Fds);
        }
        if !state.connect(now, &l) {
            return refuse(Refusal::Connects);
        }
        if state.connections >= l.per_holder_connections {
            return refuse(Refusal::HolderConnections);
        }
        Ok((peer, start, holder))
    }

    fn read(&mut self, store: &Store, id: u64) {
        for _ in 0..READS_PER_ROUND {
            let Some(conn) = self.conns.iter().find(|c| c.id == id) else {
                return;
            };
            let (holder, key) = (conn.holder.clone(), (conn.pid, conn.start));
            let peer = Peer {
                pid: conn.pid,
                uid: conn.uid,
            };
            let got = recv(conn.fd.as_fd(), &mut self.buf, &mut self.control);
            let msg = match got {
                Ok(Received::Message(m)) => m,
                Ok(Received::WouldBlock) => return,
                Ok(Received::Eof) | Err(_) => {
                    self.close(store, id);
                    return;
                }
            };
            if !msg.fds.is_empty() || msg.control_truncated {
                self.passed_fds(store, id, msg.fds);
                return;
            }
            if let Some(c) = self.conns.iter_mut().find(|c| c.id == id) {
                c.last_message = Instant::now();
            }
            let paused = self.charge(&holder, msg.len);
            if paused {
                bump(&store.counters.limited_rate);
                if self.warned.check("rate").is_some() {
                    tracing::warn!(
                        holder = holder.kind(),
                        "torch bridge socket: a pod, container, Slurm job or uid passed its budget ({} messages, {} bytes a second): its connections wait until it refills; counted in gpumem_exporter_torch_bridge_limited_total{{reason=\"rate\"}}; logged once",
                        self.limits.per_holder_messages,
                        self.limits.per_holder_bytes
                    );
                }
            }
            self.handle(store, key, peer, &holder, id, &msg);
            if paused {
                return;
            }
        }
    }

    /// A connection passed fds (possible only where the kernel cannot
    /// refuse them): they and the connection go to the closing thread,
    /// and its holder is refused for a while.
    fn passed_fds(&mut self, store: &Store, id: u64, fds: Vec<OwnedFd>) {
        let n = fds.len();
        for fd in fds {
            self.dispose(fd);
        }
        let Some(conn) = self.conns.iter().find(|c| c.id == id) else {
            return;
        };
        let (pid, holder) = (conn.pid, conn.holder.clone());
        if let Some(h) = self.budgets.get_mut(&holder) {
            h.refused_until = Some(Instant::now() + FDS_REFUSED_FOR);
        }
        bump(&store.counters.limited_fds);
        if self.warned.check("fds").is_some() {
            tracing::warn!(
                pid,
                fds = n,
                holder = holder.kind(),
                "torch bridge socket: a message came with file descriptors (the bridge never sends any): they were closed apart from the listener, the connection too, and its pod, container, Slurm job or uid is refused for 60 s; counted in gpumem_exporter_torch_bridge_limited_total{{reason=\"fds\"}}; logged once"
            );
        }
        self.close(store, id);
    }

    /// Charge one message of `bytes` to `holder` and to everyone; true
    /// when either is now paused.
    fn charge(&mut self, holder: &Holder, bytes: usize) -> bool {
        let now = Instant::now();
        let l = self.limits;
        let mut paused = false;
        if let Some(u) = self.budgets.get_mut(holder) {
            let rate = (l.per_holder_messages, l.per_holder_bytes);
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

    fn handle(
        &mut self,
        store: &Store,
        key: Key,
        peer: Peer,
        holder: &Holder,
        conn: u64,
        msg: &Message,
    ) {
        let c = &store.counters;
        if msg.sender != Some(peer) {
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
                if !store.put(key, conn, holder, doc) && self.warned.check("memory").is_some() {
                    tracing::warn!(
                        pid = key.0,
                        holder = holder.kind(),
                        "torch bridge socket: a document was not kept: its process is not on a GPU (a pod, container, Slurm job or uid keeps {} such documents) or the documents kept would pass {} MiB for its holder or {} MiB in all; counted in gpumem_exporter_torch_bridge_limited_total{{reason=\"memory\"}}; logged once",
                        self.limits.pending_per_holder,
                        self.limits.per_holder_held >> 20,
                        self.limits.held >> 20
                    );
                }
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
        if let Some(u) = self.budgets.get_mut(&conn.holder) {
            u.connections = u.connections.saturating_sub(1);
        }
        // Its queue may still hold fds in flight (where the kernel does
        // not refuse them): released wherever it is closed.
        self.dispose(conn.fd);
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
    /// Fds passed with it (only where the kernel does not refuse them).
    fds: Vec<OwnedFd>,
    /// The control data did not fit (it always should).
    control_truncated: bool,
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
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Receive one packet into `buf` with its control data (into `control`,
/// room for every fd the kernel may pass), without waiting.
fn recv(fd: BorrowedFd<'_>, buf: &mut [u8], control: &mut [u64]) -> io::Result<Received> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let control_len = std::mem::size_of_val(control);
    // SAFETY: an all-zero msghdr is valid (no name, no iov, no control).
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    hdr.msg_control = control.as_mut_ptr().cast();
    hdr.msg_controllen = control_len as _;
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
    let filled = (hdr.msg_controllen as usize).min(control_len);
    // SAFETY: `control` is `control_len` initialised bytes (u64s).
    let bytes = unsafe { std::slice::from_raw_parts(control.as_ptr().cast::<u8>(), control_len) };
    let parsed = control::parse(&bytes[..filled]);
    let fds = parsed
        .fds
        .iter()
        .filter(|f| **f >= 0)
        // SAFETY: the kernel installed these fds for this message; nothing
        // else owns them.
        .map(|f| unsafe { OwnedFd::from_raw_fd(*f) })
        .collect();
    if n == 0 && parsed.fds.is_empty() {
        return Ok(Received::Eof);
    }
    let len = (n as usize).min(buf.len());
    Ok(Received::Message(Message {
        len,
        truncated: hdr.msg_flags & libc::MSG_TRUNC != 0 || len > MAX_MESSAGE_BYTES,
        sender: parsed.sender.map(|s| Peer {
            pid: s.pid,
            uid: s.uid,
        }),
        fds,
        control_truncated: hdr.msg_flags & libc::MSG_CTRUNC != 0,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;
    use std::os::unix::net::UnixStream;

    const CGROUPFS: &str = "/sys/fs/cgroup";

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
        let thread = spawn(listener, root.clone(), CGROUPFS, &store).unwrap();
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
        let _t = spawn(bind(&path).unwrap(), ProcRoot::default(), CGROUPFS, &store).unwrap();
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
        let store = Arc::new(Store::new(Limits {
            per_holder_connections: 2,
            ..LIMITS
        }));
        let _t = spawn(bind(&path).unwrap(), ProcRoot::default(), CGROUPFS, &store).unwrap();
        let kept: Vec<OwnedFd> = (0..2).map(|_| connect(&path)).collect();
        wait_for("two open", || {
            store.counters.open.load(Ordering::Relaxed) == 2
        });
        // Its connects (a burst of 2) have refilled: the cap refuses it.
        std::thread::sleep(Duration::from_millis(200));
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
        let store = Arc::new(Store::new(Limits {
            per_holder_messages: 20.0,
            ..LIMITS
        }));
        let _t = spawn(bind(&path).unwrap(), ProcRoot::default(), CGROUPFS, &store).unwrap();
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

    /// Send `bytes` with `fds` attached (`SCM_RIGHTS`).
    fn send_fds(fd: &OwnedFd, bytes: &[u8], fds: &[i32]) -> io::Result<()> {
        let mut space = vec![0u64; CONTROL_BYTES.div_ceil(8)];
        let len = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as usize;
        let mut iov = libc::iovec {
            iov_base: bytes.as_ptr() as *mut _,
            iov_len: bytes.len(),
        };
        // SAFETY: a msghdr over live buffers, the cmsg written within
        // `len` bytes of `space` with the kernel's macros.
        unsafe {
            let mut hdr: libc::msghdr = std::mem::zeroed();
            hdr.msg_iov = &mut iov;
            hdr.msg_iovlen = 1;
            hdr.msg_control = space.as_mut_ptr().cast();
            hdr.msg_controllen = len as _;
            let c = libc::CMSG_FIRSTHDR(&hdr);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), fds.len());
            if libc::sendmsg(fd.as_raw_fd(), &hdr, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }

    /// A loopback TCP connection whose peer never reads, with 30 s of
    /// linger and unsent data: its last close waits (`tcp_close`). The
    /// peer is returned to end the wait (dropped, it resets).
    fn lingering_tcp() -> (std::net::TcpStream, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (peer, _) = l.accept().unwrap();
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 30,
        };
        // SAFETY: a linger option passed with its size.
        unsafe {
            libc::setsockopt(
                c.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        c.set_nonblocking(true).unwrap();
        let chunk = vec![0u8; 1 << 16];
        while (&c).write(&chunk).is_ok() {}
        (c, peer)
    }

    /// Where the kernel refuses passed fds (Linux ≥ 6.16) a sender's
    /// `SCM_RIGHTS` fails, before and after `accept`.
    #[test]
    fn passed_fds_are_refused_by_the_kernel() {
        let d = dir();
        let path = d.path().join("bridge.sock");
        let listener = bind(&path).unwrap();
        if !listener.refuses_fds {
            eprintln!("this kernel cannot refuse passed fds (SO_PASSRIGHTS needs 6.16)");
            return;
        }
        let store = Arc::new(Store::default());
        // Before the listener thread accepts it: the embryo socket refuses.
        let early = connect(&path);
        let devnull = std::fs::File::open("/dev/null").unwrap();
        let e = send_fds(&early, b"gpumem-bridge 1\n{}", &[devnull.as_raw_fd()]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        let _t = spawn(listener, ProcRoot::default(), CGROUPFS, &store).unwrap();
        wait_for("accepted", || {
            store.counters.open.load(Ordering::Relaxed) == 1
        });
        let e = send_fds(&early, b"gpumem-bridge 1\n{}", &[devnull.as_raw_fd()]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        assert_eq!(store.close_waiting(), 0);
    }

    /// Where the kernel passes fds (as before 6.16), a lingering TCP
    /// socket passed along is closed on the closing thread: the listener
    /// keeps reading another sender, the connection is closed and its
    /// holder refused, and nothing stalls.
    #[test]
    fn a_lingering_fd_is_closed_apart_from_the_listener() {
        let d = dir();
        let path = d.path().join("bridge.sock");
        let store = Arc::new(Store::default());
        let listener = bind_with(&path, false).unwrap();
        assert!(!listener.refuses_fds);
        let me = std::process::id();
        let start = ProcRoot::default().start_time(me).unwrap();
        let msg = |n: u64| {
            format!(
                "gpumem-bridge 1\n{}",
                DOC.replace("\"allocated\":1", &format!("\"allocated\":{n}"))
            )
        };
        // Both send before the listener thread runs, and this test closes
        // its own copy of the socket while the passed one is still in
        // flight: the last close, the lingering one, is then surely the
        // exporter's (were the listener quicker than this thread's close,
        // this thread would linger instead, as a run on a loaded machine
        // once did).
        let victim = connect(&path);
        send(&victim, msg(1).as_bytes());
        let attacker = connect(&path);
        let (tcp, peer) = lingering_tcp();
        send_fds(&attacker, msg(2).as_bytes(), &[tcp.as_raw_fd()]).unwrap();
        let closed = Instant::now();
        drop(tcp);
        assert!(
            closed.elapsed() < Duration::from_secs(1),
            "not the last close"
        );
        let _t = spawn(listener, ProcRoot::default(), CGROUPFS, &store).unwrap();
        wait_for("the first document", || store.get(me, start).is_some());
        wait_for("the fds counted", || {
            store.counters.limited_fds.load(Ordering::Relaxed) == 1
        });
        // The listener is not waiting on that close.
        let began = Instant::now();
        send(&victim, msg(3).as_bytes());
        wait_for("the victim's next document", || {
            store
                .get(me, start)
                .is_some_and(|d| d.devices[0].1.allocated == 3)
        });
        let took = began.elapsed();
        assert!(took < Duration::from_secs(1), "{took:?}");
        assert!(store.close_waiting() >= 1, "the linger holds the closer");
        assert_eq!(store.stalled(), None);
        // The attacker's document was not taken; its connection is closed
        // and the holder (this uid) is refused for a while.
        assert_eq!(store.counters.accepted.load(Ordering::Relaxed), 2);
        let again = connect(&path);
        wait_for("refused", || {
            store.counters.limited_fds.load(Ordering::Relaxed) == 2
        });
        drop((again, attacker, peer));
        wait_for("the closer done", || store.close_waiting() == 0);
    }

    fn doc_of(devices: usize) -> Document {
        Document {
            devices: (0..devices)
                .map(|i| (format!("GPU-{i}"), crate::model::TorchStats::default()))
                .collect(),
        }
    }

    /// Documents of processes not on a GPU are kept only within their
    /// holder's allowance (the newest), a live one goes before pending
    /// ones, and the memory bounds hold.
    #[test]
    fn the_memory_bounds() {
        let one = doc_of(1).heap_bytes() + ENTRY_BYTES;
        let store = Store::new(Limits {
            pending_per_holder: 2,
            pending_held: 3 * one,
            per_holder_held: 4 * one,
            held: 5 * one,
            ..LIMITS
        });
        let (a, b) = (Holder::Uid(1), Holder::Uid(2));
        let mem = || store.counters.limited_memory.load(Ordering::Relaxed);
        // Three pending of A: the oldest goes.
        for pid in 1..=3 {
            assert!(store.put((pid, 1), pid as u64, &a, doc_of(1)));
        }
        assert!(store.get(1, 1).is_none() && store.get(3, 1).is_some());
        assert_eq!(mem(), 1);
        // B's pending: the pending total (3) lets one in; a second pushes
        // out B's own, never A's.
        assert!(store.put((10, 1), 10, &b, doc_of(1)));
        assert!(store.put((11, 1), 11, &b, doc_of(1)));
        assert!(store.get(10, 1).is_none() && store.get(2, 1).is_some());
        // On a GPU: A's processes 20..=22 are live; the third fits A's
        // bound (4) only by pushing out A's oldest pending one.
        store.set_live([(20, 1), (21, 1), (22, 1), (23, 1)].into_iter().collect());
        assert_eq!(store.held_bytes() as usize, 3 * one);
        for pid in 20..=22 {
            assert!(store.put((pid, 1), pid as u64, &a, doc_of(1)), "{pid}");
        }
        assert!(store.get(2, 1).is_none() && store.get(3, 1).is_some());
        assert!(store.get(11, 1).is_some());
        // B's live one fits the total (5) by pushing out the oldest
        // pending one, whoever's.
        assert!(store.put((23, 1), 23, &b, doc_of(1)));
        assert!(store.get(3, 1).is_none() && store.get(11, 1).is_some());
        assert_eq!(store.held_bytes() as usize, 5 * one);
        // A document too big for any bound is not kept.
        assert!(!store.put((21, 1), 21, &a, doc_of(64)));
        // Off the GPU: demoted to pending, within the allowance.
        store.set_live(HashSet::new());
        assert!(store.held_bytes() as usize <= 3 * one);
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
