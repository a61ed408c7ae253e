//! `kubernetes.token_file`: a bearer token read from a file at every
//! request, as a layer in kube-rs's client stack. Written by hand rather
//! than handed to kube-rs (`AuthInfo::token_file`) for two reasons: kube-rs
//! sends the file's bytes as they are, so a token file ending in a newline
//! (`echo $TOKEN > file`) gives an invalid header, where client-go trims
//! it; and it re-reads the file once a minute, while a request here is rare
//! (one LIST, then one WATCH every few minutes), so reading it every time
//! makes a rotated token count at once.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper::Request;
use hyper::header::{AUTHORIZATION, HeaderValue};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why no token could be sent.
#[derive(Debug, thiserror::Error)]
pub(super) enum TokenError {
    #[error("reading kubernetes.token_file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("kubernetes.token_file {} is empty or not a valid header value", path.display())]
    Invalid { path: PathBuf },
}

/// Reads the token file, trimmed, as an `Authorization` header value.
pub(super) fn header(path: &std::path::Path) -> Result<HeaderValue, TokenError> {
    let text = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
        path: path.to_owned(),
        source,
    })?;
    let token = text.trim();
    let invalid = || TokenError::Invalid {
        path: path.to_owned(),
    };
    if token.is_empty() {
        return Err(invalid());
    }
    let mut value = HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| invalid())?;
    value.set_sensitive(true);
    Ok(value)
}

/// The layer that sets `Authorization: Bearer <token of the file>`.
#[derive(Debug, Clone)]
pub(super) struct BearerFileLayer {
    pub(super) path: Arc<std::path::Path>,
}

impl<S> tower::Layer<S> for BearerFileLayer {
    type Service = BearerFile<S>;
    fn layer(&self, inner: S) -> BearerFile<S> {
        BearerFile {
            inner,
            path: Arc::clone(&self.path),
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct BearerFile<S> {
    inner: S,
    path: Arc<std::path::Path>,
}

impl<S, B> tower::Service<Request<B>> for BearerFile<S>
where
    S: tower::Service<Request<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        match header(&self.path) {
            Ok(value) => {
                req.headers_mut().insert(AUTHORIZATION, value);
                let response = self.inner.call(req);
                Box::pin(async move { response.await.map_err(Into::into) })
            }
            Err(e) => Box::pin(async move { Err(Box::new(e) as BoxError) }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_files_are_trimmed_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let v = header(&file("t", "abc.def\n")).unwrap();
        assert_eq!(v.to_str().unwrap(), "Bearer abc.def");
        assert!(v.is_sensitive());
        for (name, text) in [("empty", "\n"), ("bad", "a\u{7}b")] {
            let e = header(&file(name, text)).unwrap_err().to_string();
            assert!(e.contains("is empty or not a valid header value"), "{e}");
        }
        let e = header(&dir.path().join("missing")).unwrap_err().to_string();
        assert!(e.starts_with("reading kubernetes.token_file "), "{e}");
    }
}
