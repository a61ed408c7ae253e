//! The listening socket and what the process needs to take connections
//! from it: a backlog as deep as the kernel allows, and an open-file limit
//! above the connection cap. The accept loop itself is [`super::serve`];
//! each connection it takes is admitted ([`super::admission`]) and then
//! driven ([`super::connection`]).

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpSocket};

/// Pending connections the kernel may queue (capped by `net.core.somaxconn`).
const LISTEN_BACKLOG: u32 = 4096;

/// Listen with a backlog as deep as the kernel allows (`somaxconn`, as Go
/// does), so a burst of connections waits in the queue rather than in SYN
/// retransmits.
pub(super) fn bind(address: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if address.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(address)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Let this process open as many files as its hard limit allows (as Go
/// programs do), and say so when that is below the connection cap.
pub(super) fn raise_fd_limit(max_connections: usize) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    let want = lim.rlim_max.min(1 << 20);
    if lim.rlim_cur < want {
        let raised = libc::rlimit {
            rlim_cur: want,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit only reads the struct we pass.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = want;
        }
    }
    let needed = (max_connections + 64) as libc::rlim_t;
    if lim.rlim_cur < needed {
        tracing::warn!(
            limit = lim.rlim_cur,
            max_connections,
            "the open-file limit is below http_server_config.max_connections; raise it (ulimit -n, LimitNOFILE=)"
        );
    }
}
