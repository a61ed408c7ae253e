//! One message on the bridge socket ([`super::socket`]).
//!
//! The socket is `SOCK_SEQPACKET`: the kernel keeps each `send` one packet
//! and delivers it whole or not at all, so there is no length prefix to
//! trust or get wrong. A packet is a header line naming the protocol and
//! its version, then the document ([`super::document`]):
//!
//! ```text
//! gpumem-bridge 1\n{"v":1,"seq":7,"devices":[…]}
//! ```
//!
//! At most [`MAX_MESSAGE_BYTES`]; what the header says is checked before a
//! byte of the document is parsed. The header is text so that a stray
//! client (`socat`, a curl to the wrong socket) is plainly malformed, and
//! so that a later version can change the body without the exporter
//! guessing: an unknown version is dropped as malformed and logged with
//! the version this exporter speaks.

use super::document::{self, Document, DropReason, MAX_DOCUMENT_BYTES};

/// The header's first word.
pub(crate) const MAGIC: &[u8] = b"gpumem-bridge ";
/// The framing version this exporter speaks (the header's second word).
pub(crate) const FRAME_VERSION: u32 = 1;
/// The header line is at most this long, its newline included.
pub(crate) const MAX_HEADER_BYTES: usize = 32;
/// A longer packet is dropped (`oversized`) without being parsed.
pub(crate) const MAX_MESSAGE_BYTES: usize = MAX_DOCUMENT_BYTES as usize + MAX_HEADER_BYTES;

/// Why a message was refused, finer than its [`DropReason`] (for the log).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameError {
    /// No `gpumem-bridge N\n` header.
    NoHeader,
    /// A header with a version this exporter does not speak.
    Version(u32),
    /// The document after the header was refused.
    Document(DropReason),
    /// Larger than [`MAX_MESSAGE_BYTES`].
    Oversized,
}

impl FrameError {
    pub(crate) fn reason(self) -> DropReason {
        match self {
            FrameError::NoHeader | FrameError::Version(_) => DropReason::Malformed,
            FrameError::Document(r) => r,
            FrameError::Oversized => DropReason::Oversized,
        }
    }
}

/// The framing version of `bytes`' header and where the body starts.
fn header(bytes: &[u8]) -> Result<(u32, usize), FrameError> {
    let line_end = bytes
        .iter()
        .take(MAX_HEADER_BYTES)
        .position(|b| *b == b'\n')
        .ok_or(FrameError::NoHeader)?;
    let digits = bytes[..line_end]
        .strip_prefix(MAGIC)
        .ok_or(FrameError::NoHeader)?;
    if digits.is_empty() || digits.len() > 9 || !digits.iter().all(u8::is_ascii_digit) {
        return Err(FrameError::NoHeader);
    }
    let version = digits
        .iter()
        .fold(0u32, |v, d| v * 10 + u32::from(d - b'0'));
    Ok((version, line_end + 1))
}

/// Parse one packet: its header, then its document.
pub(crate) fn parse_message(bytes: &[u8]) -> Result<Document, FrameError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(FrameError::Oversized);
    }
    let (version, body) = header(bytes)?;
    if version != FRAME_VERSION {
        return Err(FrameError::Version(version));
    }
    document::parse(&bytes[body..]).map_err(FrameError::Document)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_table() {
        let doc = r#"{"v":1,"devices":[]}"#;
        let cases: Vec<(&str, Vec<u8>, Result<Document, FrameError>)> = vec![
            (
                "header and document",
                format!("gpumem-bridge 1\n{doc}").into_bytes(),
                Ok(Document::default()),
            ),
            (
                "leading zeros are the same version",
                format!("gpumem-bridge 0001\n{doc}").into_bytes(),
                Ok(Document::default()),
            ),
            (
                "no header",
                doc.as_bytes().to_vec(),
                Err(FrameError::NoHeader),
            ),
            ("empty", vec![], Err(FrameError::NoHeader)),
            (
                "header only",
                b"gpumem-bridge 1\n".to_vec(),
                Err(FrameError::Document(DropReason::Malformed)),
            ),
            (
                "no newline",
                b"gpumem-bridge 1".to_vec(),
                Err(FrameError::NoHeader),
            ),
            (
                "other word",
                format!("gpumem-bridgx 1\n{doc}").into_bytes(),
                Err(FrameError::NoHeader),
            ),
            (
                "no version",
                format!("gpumem-bridge \n{doc}").into_bytes(),
                Err(FrameError::NoHeader),
            ),
            (
                "version not a number",
                format!("gpumem-bridge 1a\n{doc}").into_bytes(),
                Err(FrameError::NoHeader),
            ),
            (
                "version too long to be one",
                format!("gpumem-bridge 4294967296\n{doc}").into_bytes(),
                Err(FrameError::NoHeader),
            ),
            (
                "a later version",
                format!("gpumem-bridge 2\n{doc}").into_bytes(),
                Err(FrameError::Version(2)),
            ),
            (
                "a header longer than its bound",
                format!("gpumem-bridge {}1\n{doc}", "0".repeat(40)).into_bytes(),
                Err(FrameError::NoHeader),
            ),
            (
                "CRLF is not the header's end",
                format!("gpumem-bridge 1\r\n{doc}").into_bytes(),
                Err(FrameError::NoHeader),
            ),
            (
                "a bad document",
                b"gpumem-bridge 1\nnot json".to_vec(),
                Err(FrameError::Document(DropReason::Malformed)),
            ),
            (
                "a document over its bound",
                format!(
                    "gpumem-bridge 1\n{}",
                    " ".repeat(MAX_DOCUMENT_BYTES as usize + 1)
                )
                .into_bytes(),
                Err(FrameError::Document(DropReason::Oversized)),
            ),
            (
                "a message over its bound",
                vec![b' '; MAX_MESSAGE_BYTES + 1],
                Err(FrameError::Oversized),
            ),
        ];
        for (name, input, want) in cases {
            assert_eq!(parse_message(&input), want, "case {name:?}");
        }
        assert_eq!(FrameError::Version(2).reason(), DropReason::Malformed);
        assert_eq!(FrameError::Oversized.reason(), DropReason::Oversized);
    }
}
