"""Per-step figures and the threshold warning, with the stub torch
(tests/torch_stub): the optimizer step hook, gpumem_bridge.step(), the
rings, GPUMEM_BRIDGE_WARN_AT and the document's size bound.

Run from the repository root: python3 -m unittest discover -s python/tests
"""

import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
import warnings
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHONPATH = [os.path.join(ROOT, "python"), os.path.join(ROOT, "tests", "torch_stub")]
sys.path[:0] = [p for p in PYTHONPATH if p not in sys.path]

import gpumem_bridge  # noqa: E402
from gpumem_bridge import base, steps, threshold  # noqa: E402

import torch  # noqa: E402  (the stub)

MIB = 1 << 20
GIB = 1 << 30
TOTAL = 150754820096  # the stub's default total memory
UUIDS = ["8f2c1d3e-%04d-4000-8000-%012d" % (i, i) for i in range(8)]


def used_stats(allocated=0, reserved=0):
    """A used device (peaks above 0) with these current figures."""
    return {
        "allocated_bytes.all.current": allocated,
        "allocated_bytes.all.peak": max(allocated, 1),
        "reserved_bytes.all.current": reserved,
        "reserved_bytes.all.peak": max(reserved, 1),
        "active_bytes.all.current": allocated,
        "inactive_split_bytes.all.current": 0,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }


def unused_stats():
    return {k: 0 for k in used_stats()}


def reset_stub():
    for d in (torch.cuda._alloc, torch.cuda._cache, torch.cuda._peaks, torch.cuda._allowed, torch.cuda._ooms):
        d.clear()
    sys.modules["torch.optim.optimizer"]._global_optimizer_post_hooks.clear()


def reset_tracker():
    t = steps.tracker
    t.unregister()
    t.reset()
    t.callbacks[:] = []
    t.no_hook = False
    t.warn = base.Warn()


def published():
    """The document the running bridge publishes now."""
    gpumem_bridge.publish_now()
    with open("/proc/self/fd/%d" % gpumem_bridge.fd(), "rb") as f:
        data = f.read()
    return json.loads(data), len(data)


class Base(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        self.path = os.path.join(self.dir.name, "state.json")
        os.environ["TORCH_STUB_STATE"] = self.path
        os.environ.pop(threshold.ENV, None)
        self.write([used_stats()])
        gpumem_bridge.stop()
        reset_stub()
        reset_tracker()
        self.addCleanup(reset_tracker)
        self.addCleanup(reset_stub)
        self.addCleanup(gpumem_bridge.stop)
        self.addCleanup(os.environ.pop, threshold.ENV, None)

    def write(self, stats_list, initialized=True, totals=None):
        devices = []
        for i, s in enumerate(stats_list):
            d = {"uuid": UUIDS[i], "stats": s}
            if totals:
                d["total_memory"] = totals[i]
            devices.append(d)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"initialized": initialized, "devices": devices}, f)
        os.replace(tmp, self.path)


class StepTest(Base):
    def test_ring_is_bounded_at_128_and_steps_strictly_increase(self):
        self.assertTrue(gpumem_bridge.start(interval=30))
        for _ in range(300):
            self.assertIsNone(gpumem_bridge.step())
        doc, _ = published()
        s = doc["devices"][0]["steps"]
        self.assertEqual(s["total"], 300)
        self.assertEqual(len(s["ring"]), 128)
        self.assertEqual([e[0] for e in s["ring"]], list(range(173, 301)))
        for (a, ta, _), (b, tb, _) in zip(s["ring"], s["ring"][1:]):
            self.assertLess(a, b)
            self.assertLessEqual(ta, tb)
        for step, t, allocated in s["ring"]:
            self.assertIsInstance(step, int)
            self.assertIsInstance(t, float)
            self.assertEqual(t, round(t, 3))
            self.assertIsInstance(allocated, int)

    def test_hook_registered_lazily_and_removed_on_stop(self):
        hooks = sys.modules["torch.optim.optimizer"]._global_optimizer_post_hooks
        saved = sys.modules.pop("torch")
        try:
            self.assertTrue(gpumem_bridge.start(interval=30))
            self.assertEqual(len(hooks), 0, "torch not imported yet: no hook")
            doc, _ = published()
            self.assertEqual(doc["devices"], [])
        finally:
            sys.modules["torch"] = saved
        # The first publish that sees torch registers it.
        doc, _ = published()
        self.assertEqual(len(hooks), 1)
        self.assertEqual(doc["devices"][0]["steps"], {"total": 0, "ring": []})
        opt = torch.optim.SGD([], lr=0.1)
        opt.step()
        opt.step()
        doc, _ = published()
        self.assertEqual(doc["devices"][0]["steps"]["total"], 2)
        self.assertEqual([e[0] for e in doc["devices"][0]["steps"]["ring"]], [1, 2])
        published()
        self.assertEqual(len(hooks), 1, "registered once")
        gpumem_bridge.stop()
        self.assertEqual(len(hooks), 0, "removed on stop")
        opt.step()
        self.assertEqual(steps.tracker.total, 2)

    def test_hook_registered_at_start_when_torch_is_imported(self):
        hooks = sys.modules["torch.optim.optimizer"]._global_optimizer_post_hooks
        self.assertTrue(gpumem_bridge.start(interval=30))
        self.assertEqual(len(hooks), 1)
        # Two optimizers: each step() counts.
        a, b = torch.optim.SGD([], lr=0.1), torch.optim.Adam([], lr=0.001)
        a.step()
        b.step()
        self.assertEqual(steps.tracker.total, 2)

    def test_no_steps_field_before_hook_or_step(self):
        self.assertEqual(gpumem_bridge.document(1)["devices"][0].get("steps"), None)
        with mock.patch.object(steps.tracker, "no_hook", True):  # a torch < 2.0
            self.assertTrue(gpumem_bridge.start(interval=30))
            doc, _ = published()
            self.assertNotIn("steps", doc["devices"][0])
            gpumem_bridge.step()
            doc, _ = published()
            self.assertEqual(doc["devices"][0]["steps"]["total"], 1)

    def test_step_without_torch_counts(self):
        saved = sys.modules.pop("torch")
        try:
            for _ in range(3):
                self.assertIsNone(gpumem_bridge.step())
        finally:
            sys.modules["torch"] = saved
        self.assertEqual(steps.tracker.total, 3)
        self.assertEqual(steps.tracker.rings, {})

    def test_cuda_not_initialized_only_counts(self):
        self.write([used_stats(5, 10)], initialized=False)
        gpumem_bridge.step()
        self.write([used_stats(5, 10)])
        gpumem_bridge.step()
        self.assertEqual(steps.tracker.total, 2)
        self.assertEqual([e[0] for e in steps.tracker.rings[0]], [2])

    def test_a_loop_retaining_3_mib_per_step(self):
        self.write([used_stats(1000, 2 * GIB)])
        self.assertTrue(gpumem_bridge.start(interval=30))
        opt = torch.optim.SGD([], lr=0.1)
        for _ in range(40):
            torch.cuda.stub_allocate(0, 3 * MIB)
            opt.step()
        ring = published()[0]["devices"][0]["steps"]["ring"]
        self.assertEqual(len(ring), 40)
        self.assertEqual([b[2] - a[2] for a, b in zip(ring, ring[1:])], [3 * MIB] * 39)
        self.assertEqual(ring[-1][2], 1000 + 40 * 3 * MIB)

    def test_only_used_devices_are_read_at_a_step(self):
        self.write([used_stats(1, 2), unused_stats(), used_stats(3, 4)])
        self.assertTrue(gpumem_bridge.start(interval=30))
        seen = []
        real = torch.cuda.memory_stats_as_nested_dict

        def spy(i=None):
            seen.append(i)
            return real(i)

        with mock.patch.object(torch.cuda, "memory_stats_as_nested_dict", spy):
            for _ in range(3):
                gpumem_bridge.step()
        self.assertEqual(seen, [0, 2] * 3)
        self.assertEqual(sorted(steps.tracker.rings), [0, 2])
        # The cache empty (no publish yet): computed once in the hook.
        reset_tracker()
        seen[:] = []
        with mock.patch.object(torch.cuda, "memory_stats_as_nested_dict", spy):
            gpumem_bridge.step()
            gpumem_bridge.step()
        self.assertEqual(seen, [0, 1, 2, 0, 2, 0, 2])

    def test_hook_errors_are_swallowed_with_one_warning(self):
        def boom(i=None):
            raise RuntimeError("stats broke")

        opt = torch.optim.SGD([], lr=0.1)
        self.assertTrue(gpumem_bridge.start(interval=30))
        with mock.patch.object(torch.cuda, "memory_stats_as_nested_dict", boom):
            with self.assertLogs("gpumem_bridge", "WARNING") as logs:
                for _ in range(5):
                    opt.step()
        self.assertEqual(len(logs.records), 1, logs.output)
        self.assertIn("stats broke", logs.output[0])
        self.assertEqual(steps.tracker.total, 5, "still counted")

    def test_forked_child_counts_from_zero(self):
        for _ in range(5):
            gpumem_bridge.step()
        self.assertTrue(gpumem_bridge.start(interval=30))
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                gpumem_bridge.step()
                t = steps.tracker
                os.write(w, json.dumps([t.total, len(sys.modules["torch.optim.optimizer"]._global_optimizer_post_hooks)]).encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            child = json.loads(f.read())
        os.waitpid(pid, 0)
        self.assertEqual(child, [1, 1], "own count; the inherited hook, not a second one")
        self.assertEqual(steps.tracker.total, 5)

    def test_forked_child_counts_from_zero_without_a_bridge(self):
        for _ in range(5):
            gpumem_bridge.step()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                gpumem_bridge.step()
                os.write(w, json.dumps([steps.tracker.total, gpumem_bridge.running()]).encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            child = json.loads(f.read())
        os.waitpid(pid, 0)
        self.assertEqual(child, [1, False])


def run_child(code, env):
    full = dict(os.environ, PYTHONPATH=os.pathsep.join(PYTHONPATH), PYTHONDONTWRITEBYTECODE="1", **env)
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True, timeout=60)
    return p


class OlderTorchTest(Base):
    """The stub's toggles, read at import: in a child process."""

    LOOP = """
        import json, torch, gpumem_bridge
        assert gpumem_bridge.start(interval=30)
        opt = torch.optim.SGD([], lr=0.1)
        for _ in range(20):
            torch.cuda.stub_allocate(0, 3 << 20)
            opt.step()
        gpumem_bridge.publish_now()
        with open("/proc/self/fd/%d" % gpumem_bridge.fd()) as f:
            print(json.dumps(json.load(f)["devices"][0].get("steps")))
    """

    def test_flat_memory_stats_when_no_nested_dict(self):
        p = run_child(self.LOOP, {"TORCH_STUB_STATE": self.path, "TORCH_STUB_NO_NESTED_STATS": "1"})
        self.assertEqual(p.returncode, 0, p.stderr)
        ring = json.loads(p.stdout)["ring"]
        self.assertEqual([b[2] - a[2] for a, b in zip(ring, ring[1:])], [3 * MIB] * 19)

    def test_torch_without_the_step_hook(self):
        p = run_child(self.LOOP, {"TORCH_STUB_STATE": self.path, "TORCH_STUB_NO_STEP_HOOK": "1"})
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(json.loads(p.stdout), None, "no hook, no step() call: no steps field")
        self.assertEqual(p.stderr, "", "nothing said at warning level")


class ParseTest(unittest.TestCase):
    def test_values(self):
        good = [
            ("0.9", 0.9, None),
            ("1", 1.0, None),
            ("1.0", 1.0, None),
            (" .5 ", 0.5, None),
            ("0.001", 0.001, None),
            ("123456", None, 123456),
            ("2", None, 2),
            ("123456B", None, 123456),
            ("70GiB", None, 70 * GIB),
            ("512MiB", None, 512 * MIB),
            ("512 MiB", None, 512 * MIB),
            ("1.5GB", None, 1500000000),
            ("1.5GiB", None, 3 * GIB // 2),
            ("64KiB", None, 65536),
            ("2TiB", None, 2 << 40),
            ("3KB", None, 3000),
            ("7MB", None, 7000000),
            ("1TB", None, 10**12),
            ("70gib", None, 70 * GIB),
        ]
        for raw, fraction, nbytes in good:
            spec = threshold.parse(raw)
            self.assertEqual((spec.fraction, spec.nbytes), (fraction, nbytes), raw)
        bad = ["", "abc", "0", "0.0", "-0.5", "-1GiB", "1.5", "2.0", "70G", "70 gigs", "0GiB", "1e9", "90%", "0x10", "nan", "inf", "1,5GB"]
        for raw in bad:
            with self.assertRaises(ValueError, msg=raw):
                threshold.parse(raw)

    def test_bytes_for(self):
        f = threshold.parse("0.9")
        self.assertEqual(f.bytes_for(1000, 5000), 900)
        self.assertEqual(f.bytes_for(None, 5000), 4500)
        self.assertIsNone(f.bytes_for(None, None))
        self.assertEqual(threshold.parse("1KiB").bytes_for(None, None), 1024)

    def test_hysteresis(self):
        level = threshold.Level()
        level.bytes = 1000
        seq = [(900, False, False), (1000, True, True), (1200, False, True), (950, False, True), (949, False, False), (999, False, False), (1001, True, True)]
        for reserved, crossed, above in seq:
            self.assertEqual(level.update(reserved), crossed, reserved)
            self.assertEqual(level.above, above, reserved)
        self.assertEqual(level.crossings, 2)


class ThresholdTest(Base):
    def start(self, value, stats_list=None, totals=None):
        os.environ[threshold.ENV] = value
        if stats_list is not None:
            self.write(stats_list, totals=totals)
        self.calls = []
        gpumem_bridge.on_threshold(self.calls.append)
        self.assertTrue(gpumem_bridge.start(interval=30))

    def test_fraction_of_the_limit(self):
        self.write([used_stats(0, 0)])
        torch.cuda.set_per_process_memory_fraction(0.25, 0)
        self.start("0.9")
        doc, _ = published()
        limit = doc["devices"][0]["limit"]
        self.assertEqual(limit, int(0.25 * TOTAL))
        self.assertEqual(doc["devices"][0]["threshold"], {"bytes": int(0.9 * limit), "crossings": 0, "above": False})

    def test_fraction_of_the_total_without_a_limit(self):
        self.start("0.5", [used_stats(0, 0), used_stats(0, 0)], totals=[80 * GIB, 140 * GIB])
        doc, _ = published()
        self.assertEqual([d["threshold"]["bytes"] for d in doc["devices"]], [40 * GIB, 70 * GIB])
        self.assertNotIn("limit", doc["devices"][0])

    def test_one_warning_and_one_callback_per_upward_crossing(self):
        self.start("100MiB", [used_stats(0, 0)])
        opt = torch.optim.SGD([], lr=0.1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")  # Python's own default action

            def crossings():
                return [w for w in seen if issubclass(w.category, gpumem_bridge.GpuMemoryThresholdWarning)]

            torch.cuda.stub_allocate(0, 90 * MIB)
            opt.step()
            self.assertEqual(len(crossings()), 0)
            torch.cuda.stub_allocate(0, 20 * MIB)  # reserved 110 MiB
            opt.step()
            self.assertEqual(len(crossings()), 1)
            torch.cuda.stub_allocate(0, 10 * MIB)
            opt.step()
            published()
            # Freed, but the cache keeps it reserved: still above.
            torch.cuda.stub_free(0, 30 * MIB)
            opt.step()
            self.assertEqual(len(crossings()), 1)
            doc, _ = published()
            self.assertEqual(doc["devices"][0]["threshold"], {"bytes": 100 * MIB, "crossings": 1, "above": True})
            # 96 MiB reserved: within 95 %, still disarmed.
            torch.cuda.empty_cache()
            torch.cuda.stub_allocate(0, 6 * MIB)
            opt.step()
            self.assertTrue(published()[0]["devices"][0]["threshold"]["above"])
            # Below 95 MiB: re-armed.
            torch.cuda.stub_free(0, 2 * MIB)
            torch.cuda.empty_cache()
            opt.step()
            self.assertFalse(published()[0]["devices"][0]["threshold"]["above"])
            torch.cuda.stub_allocate(0, 10 * MIB)  # 104 MiB: again
            opt.step()
            opt.step()
            self.assertEqual(len(crossings()), 2, [str(w.message) for w in seen])
        w = crossings()[0]
        self.assertEqual(w.filename, __file__, "points at the opt.step() line")
        text = str(w.message)
        for part in ["cuda:0", "GPU-" + UUIDS[0], "reserved 0.11 GiB", "allocated 0.11 GiB", "cache 0.00 GiB", "no limit", "threshold 0.10 GiB", "GPUMEM_BRIDGE_WARN_AT=100MiB"]:
            self.assertIn(part, text)
        self.assertEqual(len(self.calls), 2)
        c = self.calls[0]
        self.assertEqual(
            c._asdict(),
            {"device": 0, "uuid": "GPU-" + UUIDS[0], "allocated": 110 * MIB, "reserved": 110 * MIB, "limit": None, "threshold": 100 * MIB, "crossings": 1},
        )
        self.assertEqual(self.calls[1].crossings, 2)
        self.assertEqual(published()[0]["devices"][0]["threshold"]["crossings"], 2)

    def test_crossing_seen_at_a_publish(self):
        self.start("1GiB", [used_stats(0, 0)])
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")
            self.write([used_stats(GIB // 2, 2 * GIB)])  # the cache, not tensors
            doc, _ = published()
            self.assertEqual(doc["devices"][0]["threshold"], {"bytes": GIB, "crossings": 1, "above": True})
            gpumem_bridge.step()
            published()
        self.assertEqual(len([w for w in seen if w.category is gpumem_bridge.GpuMemoryThresholdWarning]), 1)
        self.assertEqual(len(self.calls), 1)
        self.assertIn("cache 1.50 GiB", str(seen[0].message))

    def test_message_with_a_limit(self):
        torch.cuda.set_per_process_memory_fraction(0.5, 0)
        self.start("0.9", [used_stats(0, 0)])
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.stub_allocate(0, int(0.46 * TOTAL))
            gpumem_bridge.step()
        text = str(seen[0].message)
        self.assertIn("limit %.2f GiB" % (int(0.5 * TOTAL) / GIB), text)
        self.assertIn("of the limit", text)
        self.assertEqual(self.calls[0].limit, int(0.5 * TOTAL))
        self.assertEqual(self.calls[0].threshold, int(0.9 * int(0.5 * TOTAL)))

    def test_callback_errors_are_logged_once_and_never_propagate(self):
        self.start("1MiB", [used_stats(0, 0)])
        called = []

        def bad(c):
            called.append(c)
            raise RuntimeError("callback broke")

        gpumem_bridge.on_threshold(bad)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with self.assertLogs("gpumem_bridge", "WARNING") as logs:
                for _ in range(2):
                    torch.cuda.stub_allocate(0, 2 * MIB)
                    gpumem_bridge.step()
                    torch.cuda.stub_free(0, 2 * MIB)
                    torch.cuda.empty_cache()
                    gpumem_bridge.step()
        self.assertEqual(len(called), 2)
        self.assertEqual(len(self.calls), 2, "the other callback still called")
        self.assertEqual(len(logs.records), 1, logs.output)
        self.assertIn("callback broke", logs.output[0])

    def test_a_warnings_error_filter_does_not_raise_into_the_program(self):
        self.start("1MiB", [used_stats(0, 0)])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.cuda.stub_allocate(0, 2 * MIB)
            with self.assertLogs("gpumem_bridge", "WARNING"):
                torch.optim.SGD([], lr=0.1).step()
        self.assertEqual(len(self.calls), 1)

    def test_bad_value_one_log_warning_and_no_threshold(self):
        for raw in ["lots", "0", "1.5", "-3GiB", "70G"]:
            with self.subTest(raw=raw):
                gpumem_bridge.stop()
                reset_tracker()
                with self.assertLogs("gpumem_bridge", "WARNING") as logs:
                    self.start(raw, [used_stats(0, 2 * GIB)])
                    torch.cuda.stub_allocate(0, MIB)
                    gpumem_bridge.step()
                    doc, _ = published()
                    logging.getLogger("gpumem_bridge").warning("end")  # assertLogs needs one
                said = [r.getMessage() for r in logs.records if r.getMessage() != "end"]
                self.assertEqual(len(said), 1, said)
                self.assertIn("GPUMEM_BRIDGE_WARN_AT", said[0])
                self.assertIn(repr(raw), said[0])
                self.assertNotIn("threshold", doc["devices"][0])
                self.assertEqual(doc["devices"][0]["steps"]["total"], 1, "everything else unchanged")
                self.assertEqual(self.calls, [])


class SizeTest(Base):
    def eight_devices_with_full_rings(self):
        big = (1 << 40) + 12345
        self.write([used_stats(big, big) for _ in range(8)])
        steps.tracker.total = 10**9  # long runs: wide step numbers
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the threshold's, when on
            for _ in range(128):
                gpumem_bridge.step()
        self.assertTrue(gpumem_bridge.start(interval=30))

    def test_eight_devices_of_128_entries_stay_valid_and_under_64_kib(self):
        os.environ[threshold.ENV] = "0.9"
        self.eight_devices_with_full_rings()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            doc, size = published()
        self.assertLessEqual(size, gpumem_bridge.MAX_BYTES)
        self.assertEqual(len(doc["devices"]), 8)
        for d in doc["devices"]:
            self.assertEqual(len(d["steps"]["ring"]), 128)
            self.assertEqual(d["steps"]["total"], 10**9 + 128)
            self.assertIn("threshold", d)

    def test_rings_are_trimmed_to_fit(self):
        self.eight_devices_with_full_rings()
        full = len(json.dumps(gpumem_bridge.document(1)))  # without steps
        for limit, want in [(full + 8 * 80 * 40, 64), (full + 8 * 30 * 40, 16), (full + 800, 0)]:
            with self.subTest(limit=limit), mock.patch.object(gpumem_bridge, "MAX_BYTES", limit):
                if want == 64:  # said once
                    with self.assertLogs("gpumem_bridge", "WARNING") as logs:
                        doc, size = published()
                    self.assertIn("shortened to their last 64", logs.output[0])
                else:
                    doc, size = published()
                self.assertLessEqual(size, limit)
                for d in doc["devices"]:
                    ring = d["steps"]["ring"]
                    self.assertEqual(len(ring), want)
                    self.assertEqual(d["steps"]["total"], 10**9 + 128)
                    if want:
                        self.assertEqual(ring[-1][0], 10**9 + 128, "the newest kept")
        # Too large even without rings: not published, as before.
        with mock.patch.object(gpumem_bridge, "MAX_BYTES", full // 2):
            with self.assertLogs("gpumem_bridge", "WARNING"):
                doc, _ = published()
        self.assertEqual(len(doc["devices"][0]["steps"]["ring"]), 0, "the last document published stays")


if __name__ == "__main__":
    unittest.main()
