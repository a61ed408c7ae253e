//! The sampler thread's control messages and their channel: an mpsc channel whose sender also
//! unparks the sampler thread, so that thread waits for its next deadline
//! with `std::thread::park_timeout` and only looks at the channel when it
//! wakes. `Receiver::recv_timeout` waits on the same kind of futex, but
//! registers and unregisters a waker around every wait; at ten waits a
//! second, on cold caches after each 100 ms asleep, that bookkeeping cost
//! more CPU than the memory sample it waits for (BENCHMARKS.md, "what a
//! 10 Hz memory sample costs"). Hand-written: std's channel and thread
//! parker are all it takes.

use std::sync::mpsc::{self, Receiver, SendError, Sender, TryRecvError};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;
use std::time::Instant;

use crate::config::SamplerConfig;

/// Messages to the sampler thread.
#[derive(Debug, Clone)]
pub(crate) enum Control {
    Stop,
    /// New intervals, selection and collectors from a reloaded config
    /// (SIGHUP).
    Reconfigure(Box<SamplerConfig>),
}

/// A control channel for one sampler thread.
pub(crate) fn channel() -> (ControlSender, ControlReceiver) {
    let (tx, rx) = mpsc::channel();
    let waiter = Arc::new(OnceLock::new());
    (
        ControlSender {
            tx: Some(tx),
            waiter: Arc::clone(&waiter),
        },
        ControlReceiver { rx, waiter },
    )
}

/// Sends [`Control`] messages and wakes the sampler thread for each; a
/// dropped sender wakes it too, so it sees the channel closed at once.
#[derive(Clone)]
pub(crate) struct ControlSender {
    /// `None` only while dropping (the sender goes before the wake-up).
    tx: Option<Sender<Control>>,
    waiter: Arc<OnceLock<Thread>>,
}

impl ControlSender {
    pub(crate) fn send(&self, c: Control) -> Result<(), SendError<Control>> {
        let sent = match &self.tx {
            Some(tx) => tx.send(c),
            None => Err(SendError(c)),
        };
        self.wake();
        sent
    }

    fn wake(&self) {
        if let Some(t) = self.waiter.get() {
            t.unpark();
        }
    }
}

impl Drop for ControlSender {
    fn drop(&mut self) {
        drop(self.tx.take());
        self.wake();
    }
}

/// The sampler thread's end: [`ControlReceiver::register`] on that thread
/// before its first wait.
pub(crate) struct ControlReceiver {
    rx: Receiver<Control>,
    waiter: Arc<OnceLock<Thread>>,
}

impl ControlReceiver {
    /// The calling thread is the one senders wake (the first call counts).
    pub(crate) fn register(&self) {
        let _ = self.waiter.set(std::thread::current());
    }

    /// Wait until `deadline` or a message, whichever comes first. `None`:
    /// the deadline came; a closed channel reads as [`Control::Stop`].
    /// A message sent before the wait is returned at once; a wake-up with
    /// neither (a stale unpark) waits on.
    pub(crate) fn wait_until(&self, deadline: Instant) -> Option<Control> {
        loop {
            match self.rx.try_recv() {
                Ok(c) => return Some(c),
                Err(TryRecvError::Disconnected) => return Some(Control::Stop),
                Err(TryRecvError::Empty) => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            std::thread::park_timeout(left);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn registered() -> (ControlSender, ControlReceiver) {
        let (tx, rx) = channel();
        rx.register();
        (tx, rx)
    }

    #[test]
    fn the_deadline_comes_without_a_message() {
        let (_tx, rx) = registered();
        let t = Instant::now();
        assert!(rx.wait_until(t + Duration::from_millis(30)).is_none());
        assert!(t.elapsed() >= Duration::from_millis(30));
    }

    #[test]
    fn a_message_sent_before_the_wait_is_taken_at_once() {
        let (tx, rx) = registered();
        assert!(tx.send(Control::Stop).is_ok());
        let far = Instant::now() + Duration::from_secs(60);
        assert!(matches!(rx.wait_until(far), Some(Control::Stop)));
    }

    #[test]
    fn a_message_from_another_thread_ends_a_long_wait() {
        let (tx, rx) = registered();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.send(Control::Stop).is_ok()
        });
        let t = Instant::now();
        let got = rx.wait_until(t + Duration::from_secs(60));
        assert!(matches!(got, Some(Control::Stop)));
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "woken, not timed out"
        );
        assert!(sender.join().unwrap_or(false));
    }

    #[test]
    fn dropping_every_sender_ends_a_long_wait_as_stop() {
        let (tx, rx) = registered();
        let second = tx.clone();
        let dropper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            drop(second);
            std::thread::sleep(Duration::from_millis(20));
            drop(tx);
        });
        let t = Instant::now();
        let got = rx.wait_until(t + Duration::from_secs(60));
        assert!(matches!(got, Some(Control::Stop)));
        assert!(
            t.elapsed() >= Duration::from_millis(40),
            "one clone left kept it open"
        );
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "woken, not timed out"
        );
        assert!(dropper.join().is_ok());
    }
}
