//! Reading YAML files the user wrote — the config file and the web config
//! file: a size-limited read, and parser errors as one line with the line,
//! column and dotted key where the parser stopped.
//!
//! `key_path_at` is written by hand: serde-saphyr reports a position but not
//! the key path, and block-style YAML (what config files use) gives the path
//! from indentation alone.

use std::path::Path;

/// Why a file could not be read as text.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read: {0}")]
    Io(#[source] std::io::Error),
    #[error("not a regular file")]
    NotAFile,
    #[error("{size} bytes is larger than the {limit}-byte limit")]
    TooLarge { size: u64, limit: u64 },
    #[error("binary data (NUL byte at offset {0}), expected YAML text")]
    Binary(usize),
    #[error("not UTF-8 text (invalid byte at offset {0})")]
    NotUtf8(usize),
}

/// The bytes of a regular file of at most `limit` bytes.
pub(crate) fn read_limited(path: &Path, limit: u64) -> Result<Vec<u8>, ReadError> {
    let meta = std::fs::metadata(path).map_err(ReadError::Io)?;
    if !meta.is_file() {
        return Err(ReadError::NotAFile);
    }
    if meta.len() > limit {
        return Err(ReadError::TooLarge {
            size: meta.len(),
            limit,
        });
    }
    std::fs::read(path).map_err(ReadError::Io)
}

/// `bytes` as UTF-8 text.
pub(crate) fn utf8(bytes: Vec<u8>) -> Result<String, ReadError> {
    String::from_utf8(bytes).map_err(|e| ReadError::NotUtf8(e.utf8_error().valid_up_to()))
}

/// An error unless `bytes` is free of NUL bytes (binary data, not YAML).
pub(crate) fn no_nul(bytes: &[u8]) -> Result<(), ReadError> {
    match bytes.iter().position(|b| *b == 0) {
        Some(offset) => Err(ReadError::Binary(offset)),
        None => Ok(()),
    }
}

/// A YAML syntax or type error, located in the file it came from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}{}", self.position())]
pub struct YamlError {
    /// What was parsed, e.g. "config file /etc/x.yaml".
    pub what: String,
    /// 1-based line and column where the parser stopped, when known.
    pub at: Option<(usize, usize)>,
    /// The dotted key on that line, when it holds one.
    pub key: Option<String>,
    /// The parser's message, in the user's terms.
    pub message: String,
}

impl YamlError {
    /// The error of parsing `text`; `what` names it in the message.
    pub fn new(e: &serde_saphyr::Error, text: &str, what: &str) -> Self {
        let rendered = e.to_string();
        let first = rendered.lines().next().unwrap_or("invalid YAML");
        let first = first.strip_prefix("error: ").unwrap_or(first);
        let message = plain_words(strip_position(first));
        let at = e
            .location()
            .map(|loc| (loc.line() as usize, loc.column() as usize));
        YamlError {
            what: what.to_string(),
            at,
            key: at.and_then(|(line, _)| key_path_at(text, line)),
            message,
        }
    }

    fn position(&self) -> String {
        match (self.at, &self.key) {
            (Some((line, column)), Some(key)) => {
                format!(" line {line} column {column}: key {key}: {}", self.message)
            }
            (Some((line, column)), None) => {
                format!(" line {line} column {column}: {}", self.message)
            }
            (None, _) => format!(": {}", self.message),
        }
    }
}

/// Say the parser's terse messages in the user's terms.
fn plain_words(msg: &str) -> String {
    let msg = msg
        .trim_end_matches(", set DuplicateKeyPolicy in Options if acceptable")
        .to_string();
    match msg.as_str() {
        "invalid u64" => "expected a whole number from 0 to 18446744073709551615".to_string(),
        "invalid u32" => "expected a whole number from 0 to 4294967295".to_string(),
        "invalid boolean" => "expected true or false".to_string(),
        "expected string scalar" => "expected a single value, not a list or a mapping".to_string(),
        "expected mapping start" => "expected a mapping of keys (key: value lines)".to_string(),
        _ => msg,
    }
}

/// Drop a leading "line N column M: " that the YAML parser adds.
fn strip_position(msg: &str) -> &str {
    if let Some(rest) = msg.strip_prefix("line ")
        && let Some(idx) = rest.find(": ")
        && rest[..idx].split(' ').count() == 3
        && rest[..idx].contains("column")
    {
        return &rest[idx + 2..];
    }
    msg
}

/// The 1-based line of `text` where the dotted key `key` is written.
pub(crate) fn line_of_key(text: &str, key: &str) -> Option<usize> {
    (1..=text.lines().count()).find(|l| key_path_at(text, *l).as_deref() == Some(key))
}

/// The dotted key path (e.g. `web.listen_address`) of the mapping entry on
/// 1-based `line`, found by indentation. Good enough for block-style YAML,
/// which is what config files use; `None` when the line holds no key.
pub(crate) fn key_path_at(text: &str, line: usize) -> Option<String> {
    let mut stack: Vec<(usize, String)> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if i + 1 > line {
            break;
        }
        let trimmed = raw.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let indent = raw.len() - trimmed.len();
        let Some(colon) = trimmed.find(':') else {
            continue;
        };
        let key = trimmed[..colon]
            .trim()
            .trim_matches(|c| c == '"' || c == '\'');
        if key.is_empty() || key.contains(' ') || key.starts_with('-') {
            continue;
        }
        while stack.last().is_some_and(|(ind, _)| *ind >= indent) {
            stack.pop();
        }
        stack.push((indent, key.to_string()));
        if i + 1 == line {
            let path: Vec<&str> = stack.iter().map(|(_, k)| k.as_str()).collect();
            return Some(path.join("."));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_paths() {
        let t = "a:\n  b: 1\n  c:\n    d: 2\ne: 3\n";
        assert_eq!(key_path_at(t, 2).as_deref(), Some("a.b"));
        assert_eq!(key_path_at(t, 4).as_deref(), Some("a.c.d"));
        assert_eq!(key_path_at(t, 5).as_deref(), Some("e"));
        assert_eq!(line_of_key(t, "a.c.d"), Some(4));
        assert_eq!(line_of_key(t, "a.x"), None);
    }

    #[test]
    fn read_errors_say_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.yaml");
        std::fs::write(&big, vec![b'a'; 11]).unwrap();
        let cases: [(Result<Vec<u8>, ReadError>, &str); 3] = [
            (
                read_limited(&dir.path().join("missing"), 10),
                "cannot read: No such file or directory (os error 2)",
            ),
            (read_limited(dir.path(), 10), "not a regular file"),
            (
                read_limited(&big, 10),
                "11 bytes is larger than the 10-byte limit",
            ),
        ];
        for (got, want) in cases {
            assert_eq!(got.unwrap_err().to_string(), want);
        }
        assert_eq!(
            no_nul(b"ab\0").unwrap_err().to_string(),
            "binary data (NUL byte at offset 2), expected YAML text"
        );
        assert_eq!(
            utf8(vec![b'a', 0xff]).unwrap_err().to_string(),
            "not UTF-8 text (invalid byte at offset 1)"
        );
    }
}
