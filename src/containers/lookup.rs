//! The lookup thread: takes the ids the sampler missed from the queue, asks
//! the engine one at a time, and puts the answers in the cache. It has its
//! own single-threaded tokio runtime, so neither the sampler nor the HTTP
//! server ever waits on the engine; it ends when the cache (the queue's
//! sender) is dropped with the sampler.

use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::cache::{ContainerCache, Outcome};
use super::client::{self, Answer};
use super::{ERROR_RETRY_MAX, ERROR_RETRY_MIN, LOOKUP_TIMEOUT, NOT_FOUND_RETRY};
use crate::config::ContainerEngine;
use crate::ratelimit::LogLimiter;

/// Start the lookup thread for `cache`, reading `queue`.
pub(crate) fn spawn(
    cfg: &ContainerEngine,
    cache: Arc<ContainerCache>,
    queue: mpsc::Receiver<Arc<str>>,
) -> std::io::Result<JoinHandle<()>> {
    let socket = cfg.socket.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("container-lookup".into())
        .spawn(move || rt.block_on(run(socket, cache, queue)))
}

async fn run(socket: PathBuf, cache: Arc<ContainerCache>, mut queue: mpsc::Receiver<Arc<str>>) {
    let mut backoff = ERROR_RETRY_MIN;
    let mut warnings: LogLimiter<&'static str> =
        LogLimiter::backing_off(Duration::from_secs(10), Duration::from_secs(600));
    tracing::info!(socket = %socket.display(), "container engine lookups on");
    while let Some(id) = queue.recv().await {
        let answer = tokio::time::timeout(LOOKUP_TIMEOUT, client::inspect(&socket, &id))
            .await
            .unwrap_or(Err(client::LookupError::Timeout));
        let now = Instant::now();
        let outcome = match answer {
            Ok(Answer::Found(info)) => {
                backoff = ERROR_RETRY_MIN;
                warnings.clear();
                Outcome::Found(info)
            }
            Ok(Answer::NotFound) => {
                backoff = ERROR_RETRY_MIN;
                Outcome::NotFound(now + NOT_FOUND_RETRY)
            }
            Err(e) => {
                if let Some(suppressed) = warnings.check(e.kind()) {
                    tracing::warn!(
                        socket = %socket.display(),
                        container_id = %id,
                        retry_in = %humantime::format_duration(backoff),
                        suppressed,
                        "container engine lookup failed: {e}; processes keep their container_id without names. Counted in gpumem_exporter_container_lookups_total{{result=\"error\"}}"
                    );
                }
                let at = now + backoff;
                backoff = (backoff * 2).min(ERROR_RETRY_MAX);
                Outcome::Error(at)
            }
        };
        cache.complete(&id, outcome);
    }
}
