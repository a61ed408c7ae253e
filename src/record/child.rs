//! The command `record` runs (`-- COMMAND ARGS…`): started in the
//! recorder's process group with its stdin and stderr, waited for, and its
//! status turned into the shell's exit code.

use std::ffi::OsString;
use std::os::fd::AsFd;
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};

/// Exit code when the command cannot be started, as a shell says.
pub(crate) const EXIT_CANNOT_START: u8 = 127;

/// The shell's exit code for a child's status: its code, or 128 + the
/// signal that killed it.
pub(crate) fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(c), _) => (c & 0xff) as u8,
        (None, Some(sig)) => (128 + sig).clamp(0, 255) as u8,
        (None, None) => 1,
    }
}

/// Start the command in the recorder's process group with its stdin and
/// stderr; its stdout too, unless the recording goes there (then its
/// stdout goes to stderr).
pub(super) fn start(
    program: &OsString,
    args: &[OsString],
    to_stdout: bool,
) -> std::io::Result<tokio::process::Child> {
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args);
    if to_stdout {
        let fd = std::io::stderr().as_fd().try_clone_to_owned()?;
        cmd.stdout(Stdio::from(fd));
    }
    cmd.spawn()
}

/// The child's status; never resolves without a child.
pub(super) async fn wait(child: &mut Option<tokio::process::Child>) -> std::io::Result<ExitStatus> {
    match child {
        Some(c) => {
            let status = c.wait().await;
            *child = None;
            status
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_exit_codes() {
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(9)), 137);
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
    }
}
