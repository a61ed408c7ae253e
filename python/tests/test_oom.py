"""OOM snapshots (gpumem_bridge.oom) with the stub torch: how an OOM is
seen, the file's name and content, the bounds, and what is counted.

Run from the repository root: python3 -m unittest discover -s python/tests
"""

import contextlib
import fcntl
import io
import json
import os
import pickle
import sys
import tempfile
import time
import unittest

from test_bridge import PYTHONPATH, UUID0, UUID1, StubState, stats

sys.path[:0] = [p for p in PYTHONPATH if p not in sys.path]

import gpumem_bridge  # noqa: E402
from gpumem_bridge import oom  # noqa: E402

ENV = (
    "TORCH_STUB_STATE",
    oom.ENV_DIR,
    oom.ENV_MAX_FILES,
    oom.ENV_MAX_BYTES,
    oom.ENV_HISTORY,
    oom.ENV_HISTORY_ENTRIES,
)


class OomTest(unittest.TestCase):
    def setUp(self):
        import torch  # the stub

        self.torch = torch
        saved = {k: os.environ.get(k) for k in ENV}

        def restore():
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

        self.addCleanup(restore)
        for k in ENV:
            os.environ.pop(k, None)
        self.state = StubState()
        self.addCleanup(self.state.dir.cleanup)
        os.environ["TORCH_STUB_STATE"] = self.state.path
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.dir = os.path.join(self.tmp.name, "snapshots")
        os.environ[oom.ENV_DIR] = self.dir
        self.write_state()
        # A fresh process as far as torch and the bridge know: no observer
        # attached, nothing queued, no OOM counted, no history.
        self.addCleanup(gpumem_bridge.stop)
        self.addCleanup(self.reset)
        self.reset()

    def reset(self):
        oom._hooked, oom._queued, oom._active = None, False, None
        self.torch._C._oom_observers.clear()
        cuda = self.torch.cuda
        for d in (cuda._ooms, cuda._allowed, cuda._events):
            d.clear()
        cuda._queued_calls.clear()
        cuda.memory._history = None

    def write_state(self, initialized=True, **extra):
        tmp = self.state.path + ".tmp"
        devices = [{"uuid": UUID0, "stats": stats(10, 20)}, {"uuid": UUID1, "stats": stats(30, 40)}]
        with open(tmp, "w") as f:
            json.dump(dict({"initialized": initialized, "devices": devices}, **extra), f)
        os.replace(tmp, self.state.path)

    def start(self):
        self.assertTrue(gpumem_bridge.start(interval=30))

    def published(self):
        gpumem_bridge.publish_now()
        with open("/proc/self/fd/%d" % gpumem_bridge.fd(), "rb") as f:
            return json.loads(f.read())

    def counts(self):
        return [d.get("oom_snapshots") for d in self.published()["devices"]]

    def out_of_memory(self, device=0, n=1):
        """n OOMs, caught as a training loop would; what went to stderr."""
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            for _ in range(n):
                with self.assertRaises(self.torch.cuda.OutOfMemoryError):
                    self.torch.cuda.stub_out_of_memory(device)
        return err.getvalue()

    def files(self):
        return sorted(n for n in os.listdir(self.dir) if oom.NAME_RE.match(n))

    def test_snapshot_name(self):
        # 2026-12-01T10:15:30.123456Z
        t = 1796120130.123456
        self.assertEqual(oom.snapshot_name(4242, t), "gpumem-oom-4242-20261201T101530.123456Z.pickle")
        self.assertEqual(oom.snapshot_name(7, 1796120130.9999996), "gpumem-oom-7-20261201T101531.000000Z.pickle")
        self.assertTrue(oom.NAME_RE.match(oom.snapshot_name(1, t)))
        for bad in ("gpumem-oom-1-old.pickle", "gpumem-oom-x-20261201T101530.123456Z.pickle", ".gpumem-oom-1-20261201T101530.123456Z.pickle.tmp"):
            self.assertIsNone(oom.NAME_RE.match(bad), bad)

    def test_one_oom_writes_one_snapshot_at_the_oom(self):
        self.start()
        self.assertEqual(oom.hooked(), "observer")
        self.assertEqual(self.counts(), [0, 0])
        self.assertEqual(self.files(), [])
        said = self.out_of_memory(device=1)
        # Written in the observer, before the error reached the program.
        files = self.files()
        self.assertEqual(len(files), 1, files)
        self.assertEqual(oom.NAME_RE.match(files[0]).group(1), str(os.getpid()))
        path = os.path.join(self.dir, files[0])
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)
        with open(path, "rb") as f:
            snap = pickle.load(f)
        self.assertEqual(snap["segments"][1]["total_size"], 40)
        self.assertEqual(snap["device_traces"], [[], []], "no history asked for")
        self.assertEqual(said.count("\n"), 1, said)
        self.assertIn(path, said)
        self.assertIn("cuda:1", said)
        self.assertIn("memory_viz", said)
        self.assertNotIn("after the fact", said)
        self.assertEqual(self.counts(), [0, 1])
        self.assertEqual(os.listdir(self.dir), files, "no temporary file left")

    def test_the_count_is_published_without_waiting_for_the_interval(self):
        self.start()  # interval 30 s
        fd = gpumem_bridge.fd()
        self.out_of_memory()
        for _ in range(200):
            with open("/proc/self/fd/%d" % fd, "rb") as f:
                if json.loads(f.read())["devices"][0]["oom_snapshots"] == 1:
                    return
            import time

            time.sleep(0.01)
        self.fail("the OOM snapshot count was not published promptly")

    def test_history_only_when_asked(self):
        cuda = self.torch.cuda
        self.start()
        self.assertIsNone(cuda.memory._history)
        gpumem_bridge.stop()
        self.reset()
        os.environ[oom.ENV_HISTORY] = "python"
        os.environ[oom.ENV_HISTORY_ENTRIES] = "5000"
        self.start()
        self.assertEqual(cuda.memory._history, {"enabled": "all", "context": "all", "stacks": "python", "max_entries": 5000})
        self.out_of_memory()
        with open(os.path.join(self.dir, self.files()[0]), "rb") as f:
            snap = pickle.load(f)
        self.assertEqual([e["action"] for e in snap["device_traces"][0]], ["oom"])

    def test_history_settings(self):
        cases = [
            ({}, None, oom.DEFAULT_HISTORY_ENTRIES, 0),
            ({oom.ENV_HISTORY: "off"}, None, oom.DEFAULT_HISTORY_ENTRIES, 0),
            ({oom.ENV_HISTORY: "ALL"}, "all", oom.DEFAULT_HISTORY_ENTRIES, 0),
            ({oom.ENV_HISTORY: "yes"}, None, oom.DEFAULT_HISTORY_ENTRIES, 1),
            ({oom.ENV_HISTORY: "python", oom.ENV_HISTORY_ENTRIES: "0"}, "python", oom.DEFAULT_HISTORY_ENTRIES, 1),
        ]
        for env, history, entries, warnings in cases:
            warned = []
            cfg = oom.Config.from_env(dict(env, **{oom.ENV_DIR: "/x"}), lambda *a: warned.append(a))
            self.assertEqual((cfg.history, cfg.history_entries, len(warned)), (history, entries, warnings), env)
        self.assertIsNone(oom.Config.from_env({oom.ENV_HISTORY: "all"}, None), "no directory: off")
        cfg = oom.Config.from_env({oom.ENV_DIR: "rel"}, None)
        self.assertEqual((cfg.directory, cfg.max_files, cfg.max_bytes), (os.path.abspath("rel"), 5, 1 << 30))

    def test_off_without_the_directory(self):
        del os.environ[oom.ENV_DIR]
        os.environ[oom.ENV_HISTORY] = "all"
        self.start()
        self.assertIsNone(oom.hooked())
        self.assertIsNone(self.torch.cuda.memory._history)
        self.assertEqual(self.out_of_memory(), "")
        self.assertEqual(self.counts(), [None, None])
        self.assertFalse(os.path.exists(self.dir))

    def test_bounded_in_files_keeping_the_newest(self):
        os.environ[oom.ENV_MAX_FILES] = "2"
        self.start()
        said = self.out_of_memory(n=7)
        paths = [line.split(" written to ")[1].split(" ")[0] for line in said.splitlines()]
        self.assertEqual(len(paths), 7)
        self.assertEqual(self.files(), sorted(os.path.basename(p) for p in paths[-2:]))
        self.assertEqual(self.counts(), [7, 0])

    def test_bounded_in_bytes(self):
        self.write_state(snapshot_pad=10000)
        os.environ[oom.ENV_MAX_BYTES] = "25000"
        self.start()
        self.out_of_memory(n=6)
        sizes = [os.path.getsize(os.path.join(self.dir, n)) for n in self.files()]
        self.assertEqual(len(sizes), 2, sizes)
        self.assertLessEqual(sum(sizes), 25000)
        self.assertEqual(self.counts(), [6, 0])

    def test_a_snapshot_larger_than_the_bound_is_not_written(self):
        self.write_state(snapshot_pad=5000)
        os.environ[oom.ENV_MAX_BYTES] = "4000"
        with self.assertLogs("gpumem_bridge", "WARNING") as logs:
            self.start()
            said = self.out_of_memory(n=3)
        self.assertEqual(said, "")
        self.assertEqual(self.files(), [])
        self.assertEqual(self.counts(), [0, 0])
        self.assertEqual(len(logs.records), 1, logs.output)
        self.assertIn("exceeds", logs.output[0])

    def test_a_failed_snapshot_is_warned_once_and_not_counted(self):
        self.write_state(snapshot_fails=True)
        with self.assertLogs("gpumem_bridge", "WARNING") as logs:
            self.start()
            self.out_of_memory(n=2)
        self.assertEqual(self.files(), [])
        self.assertEqual(self.counts(), [0, 0])
        self.assertEqual(len(logs.records), 1, logs.output)
        self.assertIn("_snapshot() failed", logs.output[0])

    def test_an_unusable_directory_turns_snapshots_off_with_a_warning(self):
        blocker = os.path.join(self.tmp.name, "a-file")
        open(blocker, "w").close()
        os.environ[oom.ENV_DIR] = os.path.join(blocker, "snapshots")
        with self.assertLogs("gpumem_bridge", "WARNING") as logs:
            self.start()
        self.assertIn(oom.ENV_DIR, logs.output[0])
        self.assertEqual(self.out_of_memory(), "")
        self.assertEqual(self.counts(), [None, None], "no counter: snapshots are off")

    def test_a_lock_held_by_another_process_delays_the_oom_at_most_lock_wait(self):
        self.start()
        os.makedirs(self.dir, exist_ok=True)
        holder = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        self.addCleanup(os.close, holder)
        fcntl.flock(holder, fcntl.LOCK_EX)  # blocking, never released here
        with self.assertLogs("gpumem_bridge", "WARNING") as logs:
            t0 = time.monotonic()
            said = self.out_of_memory()
            took = time.monotonic() - t0
        self.assertLess(took, oom.LOCK_WAIT + 1.0, "the OOM waited %.2f s" % took)
        self.assertGreaterEqual(took, oom.LOCK_WAIT * 0.9)
        self.assertIn("written to", said)
        self.assertEqual(len(self.files()), 1)
        self.assertIn("stayed locked", logs.output[0])

    def test_lock_retries_without_blocking(self):
        d = tempfile.mkdtemp(dir=self.tmp.name)
        a = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        b = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        self.addCleanup(os.close, a)
        self.addCleanup(os.close, b)
        self.assertTrue(oom.lock(a, 0.0))
        clock = [0.0]
        slept = []

        def sleep(s):
            slept.append(s)
            clock[0] += s

        self.assertFalse(oom.lock(b, 0.5, sleep=sleep, clock=lambda: clock[0]))
        self.assertAlmostEqual(sum(slept), 0.5)
        self.assertLessEqual(max(slept), 0.1)
        fcntl.flock(a, fcntl.LOCK_UN)
        self.assertTrue(oom.lock(b, 0.5, sleep=sleep, clock=lambda: clock[0]))

    def test_a_directory_writable_by_others_is_refused(self):
        os.makedirs(self.dir)
        os.chmod(self.dir, 0o777)
        with self.assertLogs("gpumem_bridge", "WARNING") as logs:
            self.start()
        self.assertIn("writable by others", logs.output[0])
        self.assertEqual(self.out_of_memory(), "")
        self.assertEqual(self.counts(), [None, None], "snapshots are off")

    def test_a_sticky_shared_directory_is_accepted(self):
        os.makedirs(self.dir)
        os.chmod(self.dir, 0o1777)
        self.start()
        self.assertIn("written to", self.out_of_memory())

    @unittest.skipUnless(os.geteuid() == 0, "needs root to make another user's directory and files")
    def test_another_users_directory_is_refused(self):
        os.makedirs(self.dir)
        os.chown(self.dir, 4242, 4242)
        with self.assertLogs("gpumem_bridge", "WARNING") as logs:
            self.start()
        self.assertIn("not this user's own", logs.output[0])
        self.assertEqual(self.counts(), [None, None])

    @unittest.skipUnless(os.geteuid() == 0, "needs root to make another user's files")
    def test_other_users_snapshots_are_neither_counted_nor_deleted(self):
        os.makedirs(self.dir)
        os.chmod(self.dir, 0o1777)
        theirs = []
        for i in range(3):
            name = oom.snapshot_name(999000 + i, 1000000000 + i)  # older than any of ours
            path = os.path.join(self.dir, name)
            with open(path, "wb") as f:
                f.write(b"x" * 100)
            os.chown(path, 4242, 4242)
            theirs.append(name)
        os.environ[oom.ENV_MAX_FILES] = "2"
        self.start()
        self.out_of_memory(n=4)
        names = self.files()
        for n in theirs:
            self.assertIn(n, names, "another user's snapshot was deleted")
        ours = [n for n in names if n not in theirs]
        self.assertEqual(len(ours), 2, names)

    def test_without_an_observer_the_snapshot_comes_at_the_next_publish(self):
        attach = self.torch._C._cuda_attach_out_of_memory_observer
        del self.torch._C._cuda_attach_out_of_memory_observer
        self.addCleanup(setattr, self.torch._C, "_cuda_attach_out_of_memory_observer", attach)
        with self.assertLogs("gpumem_bridge", "WARNING") as logs:
            self.start()
        self.assertEqual(oom.hooked(), "none")
        self.assertIn("no out-of-memory observer", logs.output[0])
        self.assertEqual(self.out_of_memory(n=3), "", "nothing at the OOM itself")
        self.assertEqual(self.files(), [])
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(self.counts(), [1, 0])  # one snapshot for the three
            self.assertEqual(self.counts(), [1, 0])  # and no more without an OOM
        self.assertIn("after the fact", err.getvalue())
        self.assertEqual(len(self.files()), 1)
        self.out_of_memory(device=1)
        with contextlib.redirect_stderr(io.StringIO()):
            self.assertEqual(self.counts(), [1, 1])

    def test_ooms_before_the_observer_are_caught_up_once(self):
        # The process ran out of memory twice before the bridge started.
        self.torch.cuda._ooms[1] = 2
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.start()
        self.assertIn("before the bridge could attach", err.getvalue())
        self.assertEqual(len(self.files()), 1)
        self.assertEqual(self.counts(), [0, 1])
        self.out_of_memory(device=1)
        self.assertEqual(self.counts(), [0, 2])

    def test_attached_when_cuda_comes_up_not_before(self):
        self.write_state(initialized=False)
        self.start()
        # Attaching now would be lost (no device allocator yet): queued.
        self.assertIsNone(oom.hooked())
        self.assertEqual(self.torch._C._oom_observers, [])
        self.assertEqual(len(self.torch.cuda._queued_calls), 1)
        self.write_state(initialized=True)
        self.torch.cuda.init()  # torch's _lazy_init runs the queue
        self.assertEqual(oom.hooked(), "observer")
        self.assertEqual(len(self.torch._C._oom_observers), 1)
        self.out_of_memory()
        self.assertEqual(len(self.files()), 1)

    def test_one_observer_for_the_process_across_restarts(self):
        self.start()
        gpumem_bridge.stop()
        self.assertEqual(self.out_of_memory(), "", "stopped: nothing written")
        self.start()
        self.out_of_memory()
        self.assertEqual(len(self.torch._C._oom_observers), 1)
        self.assertEqual(len(self.files()), 1)
        self.assertEqual(self.counts(), [1, 0])

    def test_a_device_that_only_failed_to_allocate_is_reported(self):
        unused = {k: 0 for k in stats(0, 0)}
        tmp = self.state.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"initialized": True, "devices": [{"uuid": UUID0, "stats": unused}]}, f)
        os.replace(tmp, self.state.path)
        self.start()
        self.assertEqual(self.published()["devices"], [])
        self.out_of_memory()
        [d] = self.published()["devices"]
        self.assertEqual((d["ooms"], d["oom_snapshots"]), (1, 1))


class LimitAndPoolsTest(unittest.TestCase):
    def setUp(self):
        import torch

        self.torch = torch
        self.state = StubState()
        self.addCleanup(self.state.dir.cleanup)
        os.environ["TORCH_STUB_STATE"] = self.state.path
        torch.cuda._allowed.clear()
        self.addCleanup(torch.cuda._allowed.clear)

    def test_limit_only_while_a_fraction_below_1_is_set(self):
        total = 150754820096
        self.state.write([{"uuid": UUID0, "total_memory": total, "stats": stats(10, 20)}])
        cuda = self.torch.cuda
        limit = lambda: gpumem_bridge.document(1)["devices"][0].get("limit")  # noqa: E731
        self.assertIsNone(limit())
        cuda.set_per_process_memory_fraction(0.3, 0)
        self.assertEqual(limit(), int(0.3 * total))
        cuda.set_per_process_memory_fraction(0.0, 0)
        self.assertEqual(limit(), 0)
        cuda.set_per_process_memory_fraction(1.0, 0)
        self.assertIsNone(limit())
        cuda.set_per_process_memory_fraction(0.5, 0)
        get = cuda.get_per_process_memory_fraction
        del cuda.get_per_process_memory_fraction  # torch < 2.6
        self.addCleanup(setattr, cuda, "get_per_process_memory_fraction", get)
        self.assertIsNone(limit())

    def test_a_failing_fraction_getter_leaves_the_rest(self):
        self.state.write([{"uuid": UUID0, "stats": stats(10, 20)}])
        cuda = self.torch.cuda
        get = cuda.get_per_process_memory_fraction
        self.addCleanup(setattr, cuda, "get_per_process_memory_fraction", get)

        def broken(device=None):
            raise RuntimeError("CUDA error")

        cuda.get_per_process_memory_fraction = broken
        with self.assertLogs("gpumem_bridge", "WARNING"):
            [d] = gpumem_bridge.document(1)["devices"]
        self.assertNotIn("limit", d)
        self.assertEqual(d["allocated"], 10)

    def test_pools_exact_and_all_or_nothing(self):
        s = stats(10, 20)
        want = {}
        for n, pool in enumerate(("large", "small")):
            base = (n + 1) * 1000
            s["allocated_bytes.%s_pool.current" % pool] = base + 1
            s["reserved_bytes.%s_pool.current" % pool] = base + 2
            s["inactive_split_bytes.%s_pool.current" % pool] = base + 3
            s["segment.%s_pool.current" % pool] = base + 4
            want[pool] = {"allocated": base + 1, "reserved": base + 2, "inactive_split": base + 3, "segments": base + 4}
        self.state.write([{"uuid": UUID0, "stats": s}])
        self.assertEqual(gpumem_bridge.document(1)["devices"][0]["pools"], want)
        del s["segment.small_pool.current"]
        self.state.write([{"uuid": UUID0, "stats": s}])
        self.assertNotIn("pools", gpumem_bridge.document(1)["devices"][0])


if __name__ == "__main__":
    unittest.main()
