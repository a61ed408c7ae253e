"""The bridge's socket to gpumem-exporter (0.4 and later).

The exporter listens on a Unix socket, ``/run/gpumem-exporter/bridge.sock``
by default (``GPUMEM_BRIDGE_SOCKET`` says otherwise; ``off`` or an empty
value turns it off). The bridge connects once (``SOCK_SEQPACKET``) and sends
each document as one packet::

    gpumem-bridge 1\\n{"v": 1, "seq": 7, "devices": [...]}

a header line with the framing version, then the document (the same JSON
as the memfd's, at most 64 KiB). The kernel tells the exporter which
process and user sent it (``SO_PEERCRED``, ``SCM_CREDENTIALS``), so the
bridge needs no privilege and cannot speak for another process; the
exporter needs no capability either. The socket only sends: nothing the
exporter could say is read.

Never a wait for the training program: the socket is non-blocking; a
packet the socket has no room for (the exporter is busy, or pauses this
user for passing its rate) is dropped, the next publish sends a newer one.
A socket that is not there is retried every 10 s without a word (an
exporter without the socket, or none: the memfd still serves older
exporters); any other failure is warned about once, plainly, and retried
with a backoff. In Kubernetes the socket's directory is a hostPath the
training pod mounts read-only (docs/torch-bridge.md).
"""

import errno
import os
import socket
import time

ENV = "GPUMEM_BRIDGE_SOCKET"
DEFAULT_PATH = "/run/gpumem-exporter/bridge.sock"
#: The framing version, the header's second word.
FRAME_VERSION = 1
HEADER = b"gpumem-bridge %d\n" % FRAME_VERSION

#: Seconds before trying a missing socket again, and the backoff of others.
MISSING_RETRY = 10.0
RETRY_MIN, RETRY_MAX = 1.0, 60.0

_OFF = ("", "off", "0", "false", "no")


def path_from_env(environ):
    """The socket's path, or None when it is turned off."""
    raw = environ.get(ENV)
    if raw is None:
        return DEFAULT_PATH
    raw = raw.strip()
    return None if raw.lower() in _OFF else raw


class Channel:
    """One connection to the exporter's socket, opened when needed."""

    def __init__(self, path, warn, clock=time.monotonic):
        self.path = path
        self.warn = warn
        self.clock = clock
        self.sock = None
        self.next_try = 0.0
        self.backoff = RETRY_MIN
        self.sent = 0
        self.dropped = 0

    @property
    def connected(self):
        return self.sock is not None

    def _failed(self, what, e):
        self.close()
        missing = isinstance(e, OSError) and e.errno in (errno.ENOENT, errno.ENOTDIR)
        if missing:
            self.next_try = self.clock() + MISSING_RETRY
            return
        self.next_try = self.clock() + self.backoff
        self.backoff = min(self.backoff * 2, RETRY_MAX)
        hint = ""
        if isinstance(e, OSError) and e.errno in (errno.EPIPE, errno.ECONNRESET):
            hint = " (the exporter closed the connection: it allows each pod, job or user 64 at once)"
        elif isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM):
            hint = " (no permission on the socket or its directory)"
        elif isinstance(e, OSError) and e.errno == errno.ECONNREFUSED:
            hint = " (nothing listens there: is the exporter running?)"
        self.warn(
            "socket-" + what,
            "gpumem_bridge: cannot %s the exporter's socket %s: %s%s; retrying with a backoff, the memfd still works for exporters that read it (%s=off turns the socket off)",
            what,
            self.path,
            e,
            hint,
            ENV,
        )

    def _connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            s.setblocking(False)
            s.connect(self.path)
        except BaseException:
            s.close()
            raise
        self.sock = s

    def send(self, data):
        """Send one document (bytes); never blocks, never raises."""
        if self.sock is None:
            if self.clock() < self.next_try:
                return False
            try:
                self._connect()
            except OSError as e:
                self._failed("connect to", e)
                return False
        try:
            self.sock.send(HEADER + data, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except BlockingIOError:
            self.dropped += 1  # no room now: the next publish is newer anyway
            return False
        except OSError as e:
            self._failed("send to", e)
            return False
        self.sent += 1
        self.backoff = RETRY_MIN
        return True

    def close(self):
        s, self.sock = self.sock, None
        if s is not None:
            try:
                s.close()
            except OSError:
                pass

    def forget_after_fork(self):
        """In a forked child: the inherited connection speaks for the
        parent (the exporter drops what the child sends on it); close it
        without a word and connect afresh when the child publishes."""
        s, self.sock = self.sock, None
        if s is not None:
            try:
                os.close(s.detach())
            except OSError:
                pass
        self.next_try = 0.0
