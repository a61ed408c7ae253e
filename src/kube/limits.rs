//! Bounds on what the API server may make the watcher buffer, as a layer in
//! kube-rs's client stack. kube-rs reads a watch stream with an unbounded
//! line reader and a LIST page as a whole, so a broken or hostile server
//! could otherwise grow the exporter's memory without limit. Written by
//! hand because no middleware crate bounds the bytes between newlines.
//!
//! The same layer sees every request, so it also counts re-watches: kube-rs
//! re-opens a dropped watch silently, and a watch request that does not
//! follow a LIST is one.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use hyper::{Request, Response};

/// The longest single watch event accepted. A pod object is a few KiB to a
/// few hundred KiB; anything bigger is a broken or hostile stream, and
/// buffering it without bound would let it take the exporter's memory.
pub(crate) const MAX_EVENT_LINE_BYTES: usize = 4 << 20;

/// The largest LIST response accepted (a page of 500 pods with big specs
/// stays well under).
pub(crate) const MAX_LIST_PAGE_BYTES: usize = 64 << 20;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A response went past its bound.
#[derive(Debug, thiserror::Error)]
pub(super) enum LimitError {
    #[error("a watch event longer than {MAX_EVENT_LINE_BYTES} bytes")]
    LineTooLong,
    #[error("a response larger than {MAX_LIST_PAGE_BYTES} bytes")]
    TooLarge,
}

/// Called for each watch request that does not follow a LIST.
pub(super) type OnRewatch = Arc<dyn Fn() + Send + Sync>;

/// The `tower::Layer` that wraps every response body in a [`Bounded`] one.
#[derive(Clone)]
pub(super) struct LimitLayer {
    pub(super) on_rewatch: OnRewatch,
}

impl<S> tower::Layer<S> for LimitLayer {
    type Service = Limit<S>;
    fn layer(&self, inner: S) -> Limit<S> {
        Limit {
            inner,
            on_rewatch: Arc::clone(&self.on_rewatch),
            after_list: Arc::new(AtomicBool::new(false)),
        }
    }
}

#[derive(Clone)]
pub(super) struct Limit<S> {
    inner: S,
    on_rewatch: OnRewatch,
    /// The last request was a LIST (so the next watch is the first after it).
    after_list: Arc<AtomicBool>,
}

impl<S, ReqBody, B> tower::Service<Request<ReqBody>> for Limit<S>
where
    S: tower::Service<Request<ReqBody>, Response = Response<B>>,
    S::Future: Send + 'static,
{
    type Response = Response<Bounded<B>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let bound = if is_watch(req.uri().query()) {
            if !self.after_list.swap(false, Ordering::AcqRel) {
                (self.on_rewatch)();
            }
            Bound::Line(MAX_EVENT_LINE_BYTES)
        } else {
            self.after_list.store(true, Ordering::Release);
            Bound::Total(MAX_LIST_PAGE_BYTES)
        };
        let response = self.inner.call(req);
        Box::pin(async move {
            let r = response.await?;
            Ok(r.map(|inner| Bounded {
                inner,
                bound,
                counted: 0,
            }))
        })
    }
}

/// `watch=true` (kube-rs) or `watch=1` in the query.
fn is_watch(query: Option<&str>) -> bool {
    query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .any(|p| matches!(p, "watch=true" | "watch=1"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bound {
    /// At most this many bytes without a newline (a watch stream).
    Line(usize),
    /// At most this many bytes in all (any other response).
    Total(usize),
}

/// A response body that fails once it passes its bound.
#[derive(Debug)]
pub(super) struct Bounded<B> {
    inner: B,
    bound: Bound,
    /// Bytes since the last newline (`Line`) or in all (`Total`).
    counted: usize,
}

impl<B> Bounded<B> {
    fn count(&mut self, data: &[u8]) -> Result<(), LimitError> {
        match self.bound {
            Bound::Line(max) => {
                self.counted = match data.iter().rposition(|&b| b == b'\n') {
                    Some(nl) => data.len() - nl - 1,
                    None => self.counted.saturating_add(data.len()),
                };
                if self.counted > max {
                    return Err(LimitError::LineTooLong);
                }
            }
            Bound::Total(max) => {
                self.counted = self.counted.saturating_add(data.len());
                if self.counted > max {
                    return Err(LimitError::TooLarge);
                }
            }
        }
        Ok(())
    }
}

impl<B> Body for Bounded<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref()
                    && let Err(e) = this.count(data)
                {
                    return Poll::Ready(Some(Err(Box::new(e))));
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounded(bound: Bound) -> Bounded<http_body_util::Empty<Bytes>> {
        Bounded {
            inner: http_body_util::Empty::new(),
            bound,
            counted: 0,
        }
    }

    #[test]
    fn watch_requests_are_told_apart() {
        assert!(is_watch(Some(
            "&watch=true&timeoutSeconds=290&fieldSelector=spec.nodeName%3Dn1"
        )));
        assert!(is_watch(Some("fieldSelector=x&watch=1")));
        assert!(!is_watch(Some(
            "fieldSelector=spec.nodeName%3Dwatch%3Dtrue&limit=500"
        )));
        assert!(!is_watch(None));
    }

    #[test]
    fn lines_are_bounded_between_newlines() {
        let mut b = bounded(Bound::Line(10));
        assert!(b.count(b"0123456789").is_ok(), "exactly the bound");
        assert!(b.count(b"\n01234").is_ok());
        assert!(b.count(b"56789\n0123456789\n012").is_ok(), "newlines reset");
        assert_eq!(b.counted, 3);
        assert!(matches!(b.count(b"34567890"), Err(LimitError::LineTooLong)));
    }

    #[test]
    fn totals_are_bounded() {
        let mut b = bounded(Bound::Total(10));
        assert!(b.count(b"01234\n").is_ok());
        assert!(b.count(b"5678").is_ok());
        assert!(matches!(b.count(b"9\n"), Err(LimitError::TooLarge)));
    }
}
