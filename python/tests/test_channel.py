"""The bridge's socket to the exporter (gpumem_bridge.channel), against a
SOCK_SEQPACKET listener in this test: the framing, the kernel's word on
who sent it, never a wait, and what is said (or not) when it fails.

Run from the repository root: python3 -m unittest discover -s python/tests
"""

import json
import os
import socket
import struct
import sys
import tempfile
import unittest

from test_bridge import PYTHONPATH, UUID0, StubState, stats

sys.path[:0] = [p for p in PYTHONPATH if p not in sys.path]

import gpumem_bridge  # noqa: E402
from gpumem_bridge import channel  # noqa: E402


class Server:
    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # On the listener too, as the exporter does: a message sent before
        # accept() is queued on the new socket, and gets its sender's
        # credentials only if the flag is already there.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(path)
        self.sock.listen(4)
        self.sock.settimeout(5)

    def accept(self):
        conn, _ = self.sock.accept()
        conn.settimeout(5)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        return conn

    def close(self):
        self.sock.close()


def recv_with_creds(conn):
    data, anc, _, _ = conn.recvmsg(1 << 17, socket.CMSG_SPACE(12))
    pid = None
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid, _uid, _gid = struct.unpack("iII", payload[:12])
    return data, pid


class ChannelTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.path = os.path.join(self.tmp.name, "bridge.sock")
        self.warnings = []

        def warn(what, msg, *args):
            self.warnings.append(msg % args)

        self.warn = warn

    def test_path_from_the_environment(self):
        self.assertEqual(channel.path_from_env({}), channel.DEFAULT_PATH)
        self.assertEqual(channel.DEFAULT_PATH, "/run/gpumem-exporter/bridge.sock")
        self.assertEqual(channel.path_from_env({channel.ENV: "/x/y.sock"}), "/x/y.sock")
        for off in ("", "off", "OFF", "0", "false", "no"):
            self.assertIsNone(channel.path_from_env({channel.ENV: off}), off)

    def test_one_packet_per_document_with_the_header_and_the_kernels_pid(self):
        server = Server(self.path)
        self.addCleanup(server.close)
        ch = channel.Channel(self.path, self.warn)
        self.addCleanup(ch.close)
        self.assertTrue(ch.send(b'{"v":1,"devices":[]}'))
        conn = server.accept()
        self.addCleanup(conn.close)
        self.assertTrue(ch.send(b'{"v":1,"seq":2,"devices":[]}'))
        first, pid = recv_with_creds(conn)
        second, _ = recv_with_creds(conn)
        self.assertEqual(first, b'gpumem-bridge 1\n{"v":1,"devices":[]}')
        self.assertEqual(second, b'gpumem-bridge 1\n{"v":1,"seq":2,"devices":[]}')
        self.assertEqual(pid, os.getpid())
        self.assertEqual(self.warnings, [])

    def test_a_full_socket_drops_the_document_without_waiting(self):
        server = Server(self.path)
        self.addCleanup(server.close)
        ch = channel.Channel(self.path, self.warn)
        self.addCleanup(ch.close)
        big = b"x" * 60000
        sent = sum(ch.send(big) for _ in range(200))  # nobody reads
        self.assertGreater(sent, 0)
        self.assertLess(sent, 200)
        self.assertEqual(ch.dropped, 200 - sent)
        self.assertTrue(ch.connected, "a full socket is not a failure")
        self.assertEqual(self.warnings, [])

    def test_a_missing_socket_is_retried_quietly(self):
        now = [100.0]
        ch = channel.Channel(self.path, self.warn, clock=lambda: now[0])
        self.addCleanup(ch.close)
        self.assertFalse(ch.send(b"{}"))
        self.assertEqual(self.warnings, [])
        # Not tried again before the retry time, then found.
        server = Server(self.path)
        self.addCleanup(server.close)
        self.assertFalse(ch.send(b"{}"))
        now[0] += channel.MISSING_RETRY
        self.assertTrue(ch.send(b"{}"))

    def test_a_closed_connection_is_said_once_and_retried_with_a_backoff(self):
        server = Server(self.path)
        self.addCleanup(server.close)
        now = [0.0]
        ch = channel.Channel(self.path, self.warn, clock=lambda: now[0])
        self.addCleanup(ch.close)
        self.assertTrue(ch.send(b"{}"))
        server.accept().close()  # as the exporter does past its limits
        ok = [ch.send(b"{}") for _ in range(3)]
        self.assertIn(False, ok)
        self.assertFalse(ch.connected)
        self.assertEqual(len(self.warnings), 1, self.warnings)
        self.assertIn("closed the connection", self.warnings[0])
        self.assertIn(self.path, self.warnings[0])
        # Backing off: no new connection before the retry time.
        self.assertFalse(ch.send(b"{}"))
        now[0] += channel.RETRY_MAX
        self.assertTrue(ch.send(b"{}"))

    def test_refused_when_nobody_listens(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind(self.path)
        s.close()  # a stale socket file
        ch = channel.Channel(self.path, self.warn)
        self.addCleanup(ch.close)
        self.assertFalse(ch.send(b"{}"))
        self.assertEqual(len(self.warnings), 1)
        self.assertIn("nothing listens", self.warnings[0])


class BridgeOverTheSocketTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.path = os.path.join(self.tmp.name, "bridge.sock")
        self.server = Server(self.path)
        self.addCleanup(self.server.close)
        self.state = StubState()
        self.addCleanup(self.state.dir.cleanup)
        saved = {k: os.environ.get(k) for k in ("TORCH_STUB_STATE", channel.ENV)}

        def restore():
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

        self.addCleanup(restore)
        os.environ["TORCH_STUB_STATE"] = self.state.path
        os.environ[channel.ENV] = self.path
        self.state.write([{"uuid": UUID0, "stats": stats(10, 20)}])
        self.addCleanup(gpumem_bridge.stop)

    def test_start_sends_the_document_and_keeps_the_memfd(self):
        import torch  # noqa: F401  (the stub: the bridge reads it if imported)

        self.assertTrue(gpumem_bridge.start(interval=30))
        conn = self.server.accept()
        self.addCleanup(conn.close)
        self.assertTrue(gpumem_bridge.socket_connected())
        gpumem_bridge.publish_now()
        data, pid = recv_with_creds(conn)
        self.assertEqual(pid, os.getpid())
        header, _, body = data.partition(b"\n")
        self.assertEqual(header, b"gpumem-bridge 1")
        doc = json.loads(body)
        self.assertEqual(doc["devices"][0]["allocated"], 10)
        # The memfd holds the same document, for exporters before the socket.
        with open("/proc/self/fd/%d" % gpumem_bridge.fd(), "rb") as f:
            self.assertEqual(json.loads(f.read())["devices"], doc["devices"])
        gpumem_bridge.stop()
        for _ in range(10):  # what was queued, then the end
            if conn.recv(1 << 17) == b"":
                break
        else:
            self.fail("stop() did not close the connection")

    def test_a_forked_child_connects_afresh(self):
        import torch  # noqa: F401

        self.assertTrue(gpumem_bridge.start(interval=30))
        parent_conn = self.server.accept()
        self.addCleanup(parent_conn.close)
        r, w = os.pipe()
        child = os.fork()
        if child == 0:  # the at-fork hook restarted the bridge here
            os.close(r)
            ok = gpumem_bridge.socket_connected()
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
        os.close(w)
        child_conn = self.server.accept()
        self.addCleanup(child_conn.close)
        _, pid = recv_with_creds(child_conn)
        self.assertEqual(pid, child)
        self.assertEqual(os.read(r, 1), b"1")
        os.close(r)
        os.waitpid(child, 0)


if __name__ == "__main__":
    unittest.main()
