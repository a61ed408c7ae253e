"""Unit tests of gpumem_bridge with the stub torch (tests/torch_stub).

Run from the repository root: python3 -m unittest discover -s python/tests
"""

import fcntl
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHONPATH = [os.path.join(ROOT, "python"), os.path.join(ROOT, "tests", "torch_stub")]
sys.path[:0] = [p for p in PYTHONPATH if p not in sys.path]

import gpumem_bridge  # noqa: E402

TARGET = "/memfd:gpumem-bridge (deleted)"
UUID0 = "8f2c1d3e-0000-4000-8000-000000000000"
UUID1 = "8f2c1d3e-1111-4000-8000-000000000001"


def stats(allocated, reserved, retries=0, ooms=0):
    return {
        "allocated_bytes.all.current": allocated,
        "allocated_bytes.all.peak": allocated + 100,
        "reserved_bytes.all.current": reserved,
        "reserved_bytes.all.peak": reserved + 200,
        "active_bytes.all.current": allocated + 1,
        "inactive_split_bytes.all.current": 7,
        "num_alloc_retries": retries,
        "num_ooms": ooms,
    }


def bridge_fds(pid="self"):
    """(fd, inode) of every gpumem-bridge memfd this process holds."""
    out = []
    d = "/proc/%s/fd" % pid
    for name in os.listdir(d):
        try:
            if os.readlink(os.path.join(d, name)) == TARGET:
                out.append((int(name), os.stat(os.path.join(d, name)).st_ino))
        except OSError:
            pass
    return sorted(out)


class StubState:
    def __init__(self):
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "state.json")

    def write(self, devices, initialized=True):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"initialized": initialized, "devices": devices}, f)
        os.replace(tmp, self.path)


class BridgeTest(unittest.TestCase):
    def setUp(self):
        self.state = StubState()
        os.environ["TORCH_STUB_STATE"] = self.state.path
        self.state.write([])
        self.addCleanup(gpumem_bridge.stop)
        self.addCleanup(self.state.dir.cleanup)

    def test_uuid_spelled_as_nvml_does(self):
        cases = [
            (UUID0, "GPU-" + UUID0),
            (UUID0.upper(), "GPU-" + UUID0),
            ("GPU-" + UUID0, "GPU-" + UUID0),
            ("gpu-" + UUID0, "GPU-" + UUID0),
            ("MIG-" + UUID0, "MIG-" + UUID0),
            (" " + UUID0 + "\n", "GPU-" + UUID0),
        ]
        for raw, want in cases:
            self.assertEqual(gpumem_bridge.normalize_uuid(raw), want, raw)

    def test_document_without_torch_imported_is_empty(self):
        saved = sys.modules.pop("torch", None)
        try:
            self.assertEqual(gpumem_bridge.document(3), {"v": 1, "seq": 3, "devices": []})
        finally:
            if saved is not None:
                sys.modules["torch"] = saved

    def test_document_maps_memory_stats_and_skips_unused_devices(self):
        import torch  # the stub

        self.assertTrue(torch.__version__.endswith("+stub"))
        unused = {k: 0 for k in stats(0, 0)}
        self.state.write(
            [
                {"uuid": UUID0, "stats": stats(1000, 4096, retries=2, ooms=1)},
                {"uuid": UUID1, "stats": unused},
            ]
        )
        doc = gpumem_bridge.document(5)
        self.assertEqual(doc["v"], 1)
        self.assertEqual(doc["seq"], 5)
        self.assertEqual(
            doc["devices"],
            [
                {
                    "uuid": "GPU-" + UUID0,
                    "allocated": 1000,
                    "reserved": 4096,
                    "allocated_peak": 1100,
                    "reserved_peak": 4296,
                    "active": 1001,
                    "inactive_split": 7,
                    "alloc_retries": 2,
                    "ooms": 1,
                }
            ],
        )
        self.state.write([{"uuid": UUID0, "stats": stats(1, 2)}], initialized=False)
        self.assertEqual(gpumem_bridge.document()["devices"], [])

    def test_publishes_a_sealed_memfd_and_replaces_it_atomically(self):
        import torch  # noqa: F401

        self.state.write([{"uuid": UUID0, "stats": stats(10, 20)}])
        self.assertTrue(gpumem_bridge.start(interval=30))
        self.assertTrue(gpumem_bridge.start(), "idempotent")
        fds = bridge_fds()
        self.assertEqual([f for f, _ in fds], [gpumem_bridge.fd()])
        fd, inode = fds[0]

        def read():
            # Open through /proc, as the exporter does: a new file description.
            with open("/proc/self/fd/%d" % fd, "rb") as f:
                seals = fcntl.fcntl(f.fileno(), fcntl.F_GET_SEALS)
                want = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK
                self.assertEqual(seals & want, want)
                return json.loads(f.read())

        first = read()
        self.assertEqual(first["devices"][0]["allocated"], 10)
        self.assertNotIn("pid", first)

        self.state.write([{"uuid": UUID0, "stats": stats(11, 22)}])
        gpumem_bridge.publish_now()
        second = read()
        self.assertEqual(second["devices"][0]["allocated"], 11)
        self.assertEqual(second["seq"], first["seq"] + 1)
        # Same fd number, new (sealed) file; no temporary memfd left behind.
        fds = bridge_fds()
        self.assertEqual([f for f, _ in fds], [fd])
        self.assertNotEqual(fds[0][1], inode)

        gpumem_bridge.stop()
        self.assertEqual(bridge_fds(), [])
        self.assertFalse(gpumem_bridge.running())

    def test_thread_publishes_periodically(self):
        import torch  # noqa: F401

        self.state.write([{"uuid": UUID0, "stats": stats(1, 2)}])
        gpumem_bridge.start(interval=0.05)
        self.state.write([{"uuid": UUID0, "stats": stats(3, 4)}])
        fd = gpumem_bridge.fd()
        deadline = time.monotonic() + 5
        while True:
            with open("/proc/self/fd/%d" % fd, "rb") as f:
                doc = json.loads(f.read())
            if doc["devices"] and doc["devices"][0]["allocated"] == 3:
                break
            self.assertLess(time.monotonic(), deadline, doc)
            time.sleep(0.02)

    def test_forked_child_does_not_keep_the_parents_document(self):
        import torch  # noqa: F401

        self.state.write([{"uuid": UUID0, "stats": stats(1, 2)}])
        gpumem_bridge.start(interval=30)
        parent = bridge_fds()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: report what it holds, then leave at once
            try:
                os.close(r)
                os.write(w, json.dumps(bridge_fds()).encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            child = [tuple(x) for x in json.loads(f.read())]
        os.waitpid(pid, 0)
        self.assertEqual(len(child), 1, child)
        self.assertNotEqual(child[0][1], parent[0][1], "the child publishes its own file")


class MainTest(unittest.TestCase):
    """python -m gpumem_bridge runs a script or module with the bridge on."""

    def run_main(self, args, cwd):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(PYTHONPATH), PYTHONDONTWRITEBYTECODE="1")
        env.pop("TORCH_STUB_STATE", None)
        return subprocess.run(
            [sys.executable, "-m", "gpumem_bridge"] + args,
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    PROBE = textwrap.dedent(
        """
        import json, os, sys
        import gpumem_bridge
        def link(n):
            try:
                return os.readlink("/proc/self/fd/" + n)
            except OSError:  # the fd of the listing itself
                return None
        fds = [n for n in os.listdir("/proc/self/fd")
               if link(n) == "/memfd:gpumem-bridge (deleted)"]
        print(json.dumps({"argv": sys.argv, "name": __name__, "running": gpumem_bridge.running(),
                          "memfds": len(fds), "path0": sys.path[0]}))
        sys.exit(int(os.environ.get("EXIT", "0")))
        """
    )

    def test_script_with_args(self):
        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(d, "train.py")
            with open(script, "w") as f:
                f.write(self.PROBE)
            p = self.run_main([script, "--lr", "0.1", "-m", "x"], cwd=ROOT)
            self.assertEqual(p.returncode, 0, p.stderr)
            out = json.loads(p.stdout)
            self.assertEqual(out["argv"], [script, "--lr", "0.1", "-m", "x"])
            self.assertEqual(out["name"], "__main__")
            self.assertTrue(out["running"])
            self.assertEqual(out["memfds"], 1)
            self.assertEqual(out["path0"], d)

    def test_module_with_args_and_exit_code(self):
        with tempfile.TemporaryDirectory() as d:
            os.mkdir(os.path.join(d, "pkg"))
            open(os.path.join(d, "pkg", "__init__.py"), "w").close()
            with open(os.path.join(d, "pkg", "main.py"), "w") as f:
                f.write(self.PROBE)
            os.environ["EXIT"] = "3"
            try:
                p = self.run_main(["-m", "pkg.main", "a", "b"], cwd=d)
            finally:
                del os.environ["EXIT"]
            self.assertEqual(p.returncode, 3, p.stderr)
            out = json.loads(p.stdout)
            self.assertEqual(out["argv"], [os.path.join(d, "pkg", "main.py"), "a", "b"])
            self.assertEqual(out["name"], "__main__")
            self.assertTrue(out["running"])
            self.assertEqual(out["memfds"], 1)

    def test_usage(self):
        p = self.run_main([], cwd=ROOT)
        self.assertEqual(p.returncode, 2)
        self.assertIn("usage:", p.stderr)


if __name__ == "__main__":
    unittest.main()
