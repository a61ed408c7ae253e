//! The only owner of SIGTERM, SIGINT and SIGHUP. [`install`] registers the
//! handlers once, before the listener is announced, so a signal that
//! arrives right after startup is handled too. Stop is a `watch` that turns
//! true once; each SIGHUP bumps a `watch` counter that every reloader (the
//! config file, the web config file) follows on its own.

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

/// Receivers for the signals the exporter acts on.
#[derive(Debug, Clone)]
pub struct Signals {
    stop: watch::Receiver<bool>,
    hangup: watch::Receiver<u64>,
}

/// Install the handlers and forward signals from a task on the current
/// tokio runtime. Without handlers (very unusual), a warning is logged and
/// only SIGKILL stops the exporter.
pub(crate) fn install() -> Signals {
    let (stop_tx, stop) = watch::channel(false);
    let (hup_tx, hangup) = watch::channel(0u64);
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::spawn(async move {
                tokio::select! {
                    _ = term.recv() => tracing::info!(signal = "SIGTERM", "shutting down"),
                    _ = int.recv() => tracing::info!(signal = "SIGINT", "shutting down"),
                }
                let _ = stop_tx.send(true);
            });
        }
        // Dropping the sender leaves `stopped` pending for good.
        _ => tracing::warn!("cannot install signal handlers; only SIGKILL will stop the exporter"),
    }
    match signal(SignalKind::hangup()) {
        Ok(mut hup) => {
            tokio::spawn(async move {
                while hup.recv().await.is_some() {
                    hup_tx.send_modify(|n| *n += 1);
                }
            });
        }
        Err(e) => tracing::warn!(error = %e, "cannot install the SIGHUP handler; reloads are off"),
    }
    Signals { stop, hangup }
}

impl Signals {
    /// Resolves once SIGTERM or SIGINT has arrived.
    pub async fn stopped(&mut self) {
        if self.stop.wait_for(|s| *s).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Resolves at the next SIGHUP; never, when SIGHUP cannot be received.
    pub async fn hangup(&mut self) {
        if self.hangup.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
