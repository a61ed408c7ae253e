//! The control messages that come with a bridge message (`recvmsg`'s
//! ancillary data): the kernel's `SCM_CREDENTIALS` of the sender, and, on a
//! kernel that cannot refuse them, any `SCM_RIGHTS` fds a sender attached.
//!
//! Walked here in safe Rust over the bytes the kernel filled in, rather
//! than with libc's `CMSG_*` macros over raw pointers, so the walk is a
//! plain function the fuzz target can call on any bytes: every length is
//! checked against the buffer, nothing is read past it, and the fds are
//! only numbers until the caller (which knows they are the kernel's) takes
//! ownership of them.

use std::mem::size_of;

/// `SCM_MAX_FD`: the kernel passes at most this many fds in one message.
pub(crate) const MAX_FDS: usize = 253;

/// Room for one `ucred` and [`MAX_FDS`] fds, so that the kernel never has
/// fds left over to release in the receiving thread.
pub(crate) const CONTROL_BYTES: usize = space(size_of::<libc::ucred>())
    + space(MAX_FDS * size_of::<libc::c_int>())
    // Slack for an unexpected third message (e.g. SCM_PIDFD).
    + space(16);

const HEADER: usize = size_of::<libc::cmsghdr>();

const fn align(len: usize) -> usize {
    let a = size_of::<usize>();
    (len + a - 1) & !(a - 1)
}

const fn space(len: usize) -> usize {
    align(HEADER) + align(len)
}

/// The sender's pid and uid as the kernel vouched for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sender {
    pub pid: u32,
    pub uid: u32,
}

/// What one message's control data held.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Control {
    /// `SCM_CREDENTIALS` (the last one, should there be several).
    pub sender: Option<Sender>,
    /// `SCM_RIGHTS`: fds the kernel installed in this process, which the
    /// caller owns from now on.
    pub fds: Vec<libc::c_int>,
    /// Other control messages (ignored).
    pub other: usize,
}

fn word(bytes: &[u8], at: usize) -> Option<usize> {
    let b = bytes.get(at..at + size_of::<usize>())?;
    Some(usize::from_ne_bytes(b.try_into().ok()?))
}

fn int(bytes: &[u8], at: usize) -> Option<i32> {
    let b = bytes.get(at..at + 4)?;
    Some(i32::from_ne_bytes(b.try_into().ok()?))
}

fn uint(bytes: &[u8], at: usize) -> Option<u32> {
    let b = bytes.get(at..at + 4)?;
    Some(u32::from_ne_bytes(b.try_into().ok()?))
}

/// Walk `buf` (the first `msg_controllen` bytes of the control buffer) the
/// way `CMSG_FIRSTHDR`/`CMSG_NXTHDR` do: a header whose length is shorter
/// than a header, or runs past the buffer, ends the walk (its data is cut
/// to what is there).
pub(crate) fn parse(buf: &[u8]) -> Control {
    let mut out = Control::default();
    let mut at = 0usize;
    while at.checked_add(HEADER).is_some_and(|end| end <= buf.len()) {
        let Some(len) = word(buf, at) else { break };
        let (Some(level), Some(kind)) = (
            int(buf, at + size_of::<usize>()),
            int(buf, at + size_of::<usize>() + 4),
        ) else {
            break;
        };
        if len < HEADER {
            break;
        }
        let data_start = at + align(HEADER);
        let data_end = at.saturating_add(len).min(buf.len());
        let data = buf.get(data_start..data_end).unwrap_or_default();
        match (level, kind) {
            (libc::SOL_SOCKET, libc::SCM_CREDENTIALS) => {
                if let (Some(pid), Some(uid)) = (int(data, 0), uint(data, 4)) {
                    out.sender = Some(Sender {
                        pid: u32::try_from(pid).unwrap_or(0),
                        uid,
                    });
                }
            }
            (libc::SOL_SOCKET, libc::SCM_RIGHTS) => {
                out.fds.extend(
                    data.chunks_exact(4)
                        .filter_map(|c| c.try_into().ok().map(i32::from_ne_bytes)),
                );
            }
            _ => out.other += 1,
        }
        let Some(next) = len
            .checked_add(size_of::<usize>() - 1)
            .map(|l| l & !(size_of::<usize>() - 1))
            .and_then(|l| at.checked_add(l))
        else {
            break;
        };
        at = next;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmsg(level: i32, kind: i32, data: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&(HEADER + data.len()).to_ne_bytes());
        v.extend_from_slice(&level.to_ne_bytes());
        v.extend_from_slice(&kind.to_ne_bytes());
        v.resize(align(HEADER), 0);
        v.extend_from_slice(data);
        v.resize(align(v.len()), 0);
        v
    }

    #[test]
    fn credentials_fds_and_damage() {
        let cred: Vec<u8> = [
            7i32.to_ne_bytes(),
            1000i32.to_ne_bytes(),
            5i32.to_ne_bytes(),
        ]
        .concat();
        let fds: Vec<u8> = [3i32, 4, 5].iter().flat_map(|f| f.to_ne_bytes()).collect();
        let mut both = cmsg(libc::SOL_SOCKET, libc::SCM_CREDENTIALS, &cred);
        both.extend(cmsg(libc::SOL_SOCKET, libc::SCM_RIGHTS, &fds));
        let c = parse(&both);
        assert_eq!(c.sender, Some(Sender { pid: 7, uid: 1000 }));
        assert_eq!(c.fds, vec![3, 4, 5]);
        assert_eq!(parse(&[]), Control::default());
        // Cut anywhere: never a panic, never a fd that was not all there.
        for n in 0..both.len() {
            let c = parse(&both[..n]);
            assert!(c.fds.iter().all(|f| [3, 4, 5].contains(f)), "{n}: {c:?}");
        }
        // A length shorter than a header ends the walk; a huge one is cut.
        let mut bad = both.clone();
        bad[..size_of::<usize>()].copy_from_slice(&1usize.to_ne_bytes());
        assert_eq!(parse(&bad), Control::default());
        bad[..size_of::<usize>()].copy_from_slice(&usize::MAX.to_ne_bytes());
        assert_eq!(parse(&bad).sender, Some(Sender { pid: 7, uid: 1000 }));
        assert!(CONTROL_BYTES >= space(12) + space(MAX_FDS * 4));
    }
}
