//! Where a recording goes, and how it stays a complete document.
//!
//! A regular file that the recorder opened itself is written by position:
//! each sample's rows are written, in one `pwrite`, over the closing
//! trailer of the format (`\n]}\n` for a trace, `# EOF\n` for
//! OpenMetrics, nothing for CSV), followed by that trailer again. So the
//! file is a complete document after every sample — after SIGINT, SIGTERM,
//! the command's exit, and even after SIGKILL. When a write fails (a full
//! disk, a file size limit), the file is cut back to its last complete
//! sample and the trailer is written again, which fits where the old one
//! was.
//!
//! Standard output, pipes and devices cannot be rewritten: there each
//! sample is appended and the trailer is written once, at the end.
//!
//! Opening follows what a careful shell redirect would do: an existing
//! regular file is kept unless `--force`; a directory is an error; a
//! device or FIFO that exists (`/dev/stderr`, `/dev/full`, a named pipe)
//! is written to as it is, since there is nothing in it to lose.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Where to write: standard output (`-o -`) or a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Stdout,
    Path(PathBuf),
}

impl Target {
    /// `-` is standard output; anything else a path.
    pub fn parse(s: &str) -> Target {
        if s == "-" {
            Target::Stdout
        } else {
            Target::Path(PathBuf::from(s))
        }
    }

    fn name(&self) -> String {
        match self {
            Target::Stdout => "standard output".to_string(),
            Target::Path(p) => p.display().to_string(),
        }
    }
}

/// Why the output could not be opened or written.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("{path} exists; pass --force to overwrite it")]
    Exists { path: String },
    #[error("{path} is a directory; name a file to write the recording to")]
    Directory { path: String },
    #[error("cannot open {path} for writing: {source}")]
    Open {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {name}: {source}; {}", kept_text(*.kept, *.state))]
    Write {
        name: String,
        #[source]
        source: std::io::Error,
        /// Bytes of complete samples (header included) in the output.
        kept: u64,
        state: Kept,
    },
}

/// What is left in the output after a failed write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// Cut back to the last complete sample, trailer written again: a
    /// complete document.
    Complete,
    /// Cut back to the last complete sample, but the trailer could not be
    /// written again.
    NoTrailer,
    /// A stream: what reached it stays, the last sample possibly cut.
    Stream,
}

fn kept_text(kept: u64, state: Kept) -> String {
    match state {
        Kept::Complete => format!(
            "it keeps {kept} bytes, every sample before the failure, as a complete document"
        ),
        Kept::NoTrailer => format!(
            "it keeps {kept} bytes, every sample before the failure, but its closing lines could not be written again"
        ),
        Kept::Stream => format!("{kept} bytes had been written to it before the failed sample"),
    }
}

#[derive(Debug)]
enum Mode {
    /// A regular file opened here: written by position, trailer kept.
    Positioned,
    /// Standard output, a pipe, a device: appended, trailer at the end.
    Stream,
}

/// An open recording output.
#[derive(Debug)]
pub(crate) struct Output {
    file: File,
    name: String,
    mode: Mode,
    trailer: &'static [u8],
    /// Bytes of complete samples written (header included), not counting
    /// the trailer.
    committed: u64,
    scratch: Vec<u8>,
}

impl Output {
    /// Open `target` (see the module doc for the rules) and write `header`
    /// (and, for a regular file, `trailer` after it).
    pub(crate) fn create(
        target: &Target,
        force: bool,
        header: &[u8],
        trailer: &'static [u8],
    ) -> Result<Output, OutputError> {
        let name = target.name();
        let (file, mode, created) = match target {
            Target::Stdout => {
                let fd = std::io::stdout()
                    .as_fd()
                    .try_clone_to_owned()
                    .map_err(|source| OutputError::Open {
                        path: name.clone(),
                        source,
                    })?;
                (File::from(fd), Mode::Stream, None)
            }
            Target::Path(path) => open_path(path, &name, force)?,
        };
        let mut out = Output {
            file,
            name,
            mode,
            trailer,
            committed: 0,
            scratch: Vec::new(),
        };
        if let Err(e) = out.write(header) {
            // A file made here with not even its header in it is no
            // recording: do not leave it behind.
            if let Some(path) = created {
                let _ = std::fs::remove_file(path);
            }
            return Err(e);
        }
        Ok(out)
    }

    /// The output's name as messages show it.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Whether this is a regular file written by position (which can be
    /// rewritten after the recording), rather than a stream.
    pub(crate) fn is_regular_file(&self) -> bool {
        matches!(self.mode, Mode::Positioned)
    }

    /// Append one sample's rows (a no-op for an empty one).
    pub(crate) fn write(&mut self, record: &[u8]) -> Result<(), OutputError> {
        match self.mode {
            Mode::Stream => {
                if record.is_empty() {
                    return Ok(());
                }
                let written = self.file.write_all(record);
                self.check(written, Kept::Stream)?;
            }
            Mode::Positioned => {
                if record.is_empty() && self.committed > 0 {
                    return Ok(());
                }
                self.scratch.clear();
                self.scratch.extend_from_slice(record);
                self.scratch.extend_from_slice(self.trailer);
                let written = self.file.write_all_at(&self.scratch, self.committed);
                if let Err(source) = written {
                    let state = self.repair();
                    return Err(self.failed(source, state));
                }
            }
        }
        self.committed += record.len() as u64;
        Ok(())
    }

    /// Write the trailer where it is not kept already; returns the bytes
    /// the output holds.
    pub(crate) fn finish(mut self) -> Result<u64, OutputError> {
        if let Mode::Stream = self.mode {
            let written = self
                .file
                .write_all(self.trailer)
                .and_then(|()| self.file.flush());
            self.check(written, Kept::Stream)?;
        }
        Ok(self.committed + self.trailer.len() as u64)
    }

    /// Cut the file back to its last complete sample and write the
    /// trailer again.
    fn repair(&self) -> Kept {
        let again = self
            .file
            .set_len(self.committed)
            .and_then(|()| self.file.write_all_at(self.trailer, self.committed));
        match again {
            Ok(()) => Kept::Complete,
            Err(_) => Kept::NoTrailer,
        }
    }

    fn check(&self, r: std::io::Result<()>, state: Kept) -> Result<(), OutputError> {
        r.map_err(|source| self.failed(source, state))
    }

    fn failed(&self, source: std::io::Error, state: Kept) -> OutputError {
        OutputError::Write {
            name: self.name.clone(),
            source,
            kept: self.committed,
            state,
        }
    }
}

/// Whether `target` could be opened as [`Output::create`] would, without
/// creating or changing anything: checked before the pipeline starts, so
/// a bad path is one clear error and nothing else.
pub(crate) fn check(target: &Target, force: bool) -> Result<(), OutputError> {
    let Target::Path(path) = target else {
        return Ok(());
    };
    let name = target.name();
    let open_err = |source| OutputError::Open {
        path: name.clone(),
        source,
    };
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Err(OutputError::Directory { path: name.clone() }),
        Ok(m) if m.is_file() && !force => Err(OutputError::Exists { path: name.clone() }),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            match std::fs::metadata(dir) {
                Ok(m) if m.is_dir() => rustix::fs::access(dir, rustix::fs::Access::WRITE_OK)
                    .map_err(|e| open_err(e.into())),
                Ok(_) => Err(open_err(std::io::Error::new(
                    ErrorKind::NotADirectory,
                    format!("{} is not a directory", dir.display()),
                ))),
                Err(e) => Err(open_err(e)),
            }
        }
        Err(e) => Err(open_err(e)),
    }
}

/// Open a path as the module doc says; also returns the path when the
/// file was created here.
fn open_path(
    path: &Path,
    name: &str,
    force: bool,
) -> Result<(File, Mode, Option<PathBuf>), OutputError> {
    let open_err = |source| OutputError::Open {
        path: name.to_string(),
        source,
    };
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Err(OutputError::Directory {
            path: name.to_string(),
        }),
        Ok(m) if m.is_file() => {
            if !force {
                return Err(OutputError::Exists {
                    path: name.to_string(),
                });
            }
            let f = OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(path)
                .map_err(open_err)?;
            Ok((f, Mode::Positioned, None))
        }
        // A device, FIFO or socket: nothing in it to overwrite.
        Ok(_) => {
            let f = OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(open_err)?;
            Ok((f, Mode::Stream, None))
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {
            match OpenOptions::new().write(true).create_new(true).open(path) {
                Ok(f) => Ok((f, Mode::Positioned, Some(path.to_path_buf()))),
                // Made by someone else since the metadata call.
                Err(e) if e.kind() == ErrorKind::AlreadyExists && !force => {
                    Err(OutputError::Exists {
                        path: name.to_string(),
                    })
                }
                Err(e) => Err(open_err(e)),
            }
        }
        Err(e) => Err(open_err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(p: &Path) -> String {
        std::fs::read_to_string(p).unwrap()
    }

    #[test]
    fn a_regular_file_is_complete_after_every_sample() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.json");
        let t = Target::Path(p.clone());
        let mut o = Output::create(&t, false, b"[", b"]\n").unwrap();
        assert_eq!(read(&p), "[]\n");
        o.write(b"1").unwrap();
        assert_eq!(read(&p), "[1]\n");
        o.write(b",2").unwrap();
        assert_eq!(read(&p), "[1,2]\n");
        assert_eq!(o.finish().unwrap(), 6);
        assert_eq!(read(&p), "[1,2]\n");
    }

    #[test]
    fn existing_files_need_force_and_directories_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.csv");
        std::fs::write(&p, "keep me").unwrap();
        let t = Target::Path(p.clone());
        let e = Output::create(&t, false, b"h\n", b"").unwrap_err();
        assert!(matches!(e, OutputError::Exists { .. }), "{e}");
        assert!(e.to_string().contains("--force"), "{e}");
        assert_eq!(read(&p), "keep me");
        Output::create(&t, true, b"h\n", b"").unwrap();
        assert_eq!(read(&p), "h\n");
        let d = Target::Path(dir.path().to_path_buf());
        let e = Output::create(&d, true, b"h\n", b"").unwrap_err();
        assert!(matches!(e, OutputError::Directory { .. }), "{e}");
        let missing = Target::Path(dir.path().join("no/such/dir/r.csv"));
        let e = Output::create(&missing, false, b"h\n", b"").unwrap_err();
        assert!(matches!(e, OutputError::Open { .. }), "{e}");
        // The check before the pipeline says the same, creating nothing.
        let e = check(&missing, false).unwrap_err();
        assert!(matches!(e, OutputError::Open { .. }), "{e}");
        assert!(matches!(
            check(&d, true),
            Err(OutputError::Directory { .. })
        ));
        assert!(matches!(check(&t, false), Err(OutputError::Exists { .. })));
        assert!(check(&t, true).is_ok());
        let fresh = Target::Path(dir.path().join("new.csv"));
        assert!(check(&fresh, false).is_ok());
        assert!(!dir.path().join("new.csv").exists());
    }

    #[test]
    fn a_full_device_fails_with_nothing_left_behind() {
        let t = Target::Path(PathBuf::from("/dev/full"));
        let e = Output::create(&t, false, b"h\n", b"").unwrap_err();
        assert!(e.to_string().contains("No space left on device"), "{e}");
    }
}
