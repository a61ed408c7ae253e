//! Closing what a sender could make slow to close, away from the
//! listener.
//!
//! A file's last `close` runs its release: a TCP socket with `SO_LINGER`
//! and unsent data waits up to its linger time (`tcp_close`), a FUSE file
//! waits for its daemon to answer `FLUSH` (every close), and a Unix socket
//! whose queue still holds fds in flight releases those in the closing
//! thread. A sender picks all of that. So where the kernel cannot refuse
//! passed fds at the socket (`SO_PASSRIGHTS`, Linux ≥ 6.16), every fd a
//! message brought, and every connection the listener is done with, is
//! handed to this thread: it may wait as long as the sender likes while
//! the listener keeps reading everyone else. Where the kernel refuses
//! fds, no fd can arrive and connections are closed in place.
//!
//! What waits here is bounded by the listener, not by this thread: a
//! connection that passes fds is closed and its budget holder refused for
//! a while, so each holder can leave at most one message's fds
//! ([`super::control::MAX_FDS`]) and its connections here.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};

/// The closing thread's queue; dropped, the thread ends once the queue is
/// empty.
#[derive(Debug)]
pub(crate) struct Closer {
    tx: Option<Sender<OwnedFd>>,
    waiting: Arc<AtomicU64>,
}

impl Closer {
    /// Start the thread (`torch-bridge-close`); on failure fds are closed
    /// in place (logged once by the caller).
    pub(crate) fn spawn() -> std::io::Result<Closer> {
        let (tx, rx) = channel::<OwnedFd>();
        let waiting = Arc::new(AtomicU64::new(0));
        let w = Arc::clone(&waiting);
        std::thread::Builder::new()
            .name("torch-bridge-close".into())
            .spawn(move || {
                for fd in rx {
                    drop(fd);
                    w.fetch_sub(1, Ordering::Relaxed);
                }
            })?;
        Ok(Closer {
            tx: Some(tx),
            waiting,
        })
    }

    /// Close `fd` on the closing thread.
    pub(crate) fn close(&self, fd: OwnedFd) {
        self.waiting.fetch_add(1, Ordering::Relaxed);
        if let Some(tx) = &self.tx
            && let Err(e) = tx.send(fd)
        {
            // The thread is gone (it cannot panic): close here.
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            drop(e.0);
        }
    }

    /// Fds handed over and not closed yet.
    pub(crate) fn waiting(&self) -> u64 {
        self.waiting.load(Ordering::Relaxed)
    }
}
