"""PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF as torch parses it
(gpumem_bridge.allocconf), and what of it reaches the document.

Run from the repository root: python3 -m unittest discover -s python/tests
"""

import os
import sys
import unittest

from test_bridge import PYTHONPATH, UUID0, StubState, stats

sys.path[:0] = [p for p in PYTHONPATH if p not in sys.path]

import gpumem_bridge  # noqa: E402
from gpumem_bridge import allocconf  # noqa: E402

MIB = 1 << 20
DEFAULTS = {"backend": "native", "expandable_segments": False, "max_split_size": None}


def settings(**kw):
    return dict(DEFAULTS, **kw)


class ParseTest(unittest.TestCase):
    def test_lexes_as_torch_does(self):
        self.assertEqual(
            allocconf.lex(" expandable_segments : True,roundup_power2_divisions:[256:1,>:4]"),
            ["expandable_segments", ":", "True", ",", "roundup_power2_divisions", ":", "[", "256", ":", "1", ",", ">", ":", "4", "]"],
        )
        self.assertEqual(allocconf.lex(""), [])
        # Only spaces are dropped: a tab or newline stays in the word.
        self.assertEqual(allocconf.lex("a:\tTrue\n"), ["a", ":", "\tTrue\n"])

    def test_good_values(self):
        cases = [
            ("", DEFAULTS),
            ("   ", DEFAULTS),
            ("expandable_segments:True", settings(expandable_segments=True)),
            ("expandable_segments:False", DEFAULTS),
            ("max_split_size_mb:128", settings(max_split_size=128 * MIB)),
            ("max_split_size_mb:21", settings(max_split_size=21 * MIB)),
            ("max_split_size_mb:2147483647", settings(max_split_size=2147483647 * MIB)),
            ("backend:native", DEFAULTS),
            ("backend:cudaMallocAsync", settings(backend="cudaMallocAsync")),
            ("backend:async", settings(backend="cudaMallocAsync")),
            (
                " expandable_segments : True , max_split_size_mb : 512 ",
                settings(expandable_segments=True, max_split_size=512 * MIB),
            ),
            ("expandable_segments:True,", settings(expandable_segments=True)),
            ("expandable_segments:True,expandable_segments:False", DEFAULTS),
            (
                # Other options, a newer torch's among them, are skipped.
                "garbage_collection_threshold:0.6,roundup_power2_divisions:[256:1,512:2,>:4],"
                "per_process_memory_fraction:0.5,pinned_use_cuda_host_register:True,expandable_segments:True",
                settings(expandable_segments=True),
            ),
            ("roundup_power2_divisions:4,max_split_size_mb:64", settings(max_split_size=64 * MIB)),
            ("future_option:[],backend:async", settings(backend="cudaMallocAsync")),
        ]
        for text, want in cases:
            self.assertEqual(allocconf.parse(text), want, text)

    def test_malformed_values(self):
        cases = [
            "expandable_segments:true",  # torch takes True/False only
            "expandable_segments:1",
            "expandable_segments",
            "expandable_segments:",
            "expandable_segments:,max_split_size_mb:64",
            ":True",
            ",expandable_segments:True",
            "expandable_segments:True,,max_split_size_mb:64",
            "expandable_segments:True:False",
            "expandable_segments:[True]",
            "expandable_segments:True max_split_size_mb:128",  # no comma
            "expandable_segments:True\n",
            "max_split_size_mb:20",  # must be above 20
            "max_split_size_mb:0",
            "max_split_size_mb:-5",
            "max_split_size_mb:128MB",
            "max_split_size_mb:1.5",
            "max_split_size_mb:2147483648",  # beyond std::stoi
            "max_split_size_mb:\u0661\u0662\u0668",  # digits, but not ASCII
            "backend:cuda",
            "backend:Native",
            "roundup_power2_divisions:[256:1",
            "roundup_power2_divisions:[[256:1]]",
            "roundup_power2_divisions:]",
        ]
        for text in cases:
            with self.assertRaises(allocconf.Malformed, msg=text):
                allocconf.parse(text)

    def test_which_variable_torch_reads(self):
        both = {"PYTORCH_ALLOC_CONF": "a:1", "PYTORCH_CUDA_ALLOC_CONF": "b:2"}
        cases = [
            ({}, "2.11.0+cu130", (None, None)),
            (both, "2.11.0+cu130", ("PYTORCH_ALLOC_CONF", "a:1")),
            (both, "2.9.0", ("PYTORCH_ALLOC_CONF", "a:1")),
            (both, "2.8.0+cu128", ("PYTORCH_CUDA_ALLOC_CONF", "b:2")),
            ({"PYTORCH_ALLOC_CONF": "a:1"}, "2.5.1", (None, None)),
            ({"PYTORCH_CUDA_ALLOC_CONF": "b:2"}, "2.11.0", ("PYTORCH_CUDA_ALLOC_CONF", "b:2")),
            # Set but empty is set (torch: getenv is not NULL).
            ({"PYTORCH_ALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": "b:2"}, "2.10.0", ("PYTORCH_ALLOC_CONF", "")),
            (both, "nightly", ("PYTORCH_ALLOC_CONF", "a:1")),  # unreadable: new
        ]
        for environ, version, want in cases:
            self.assertEqual(allocconf.source(environ, version), want, (environ, version))


class DocumentTest(unittest.TestCase):
    """The settings in the published document: parsed once, malformed ->
    left out with one warning, nothing else affected."""

    def setUp(self):
        self.state = StubState()
        self.addCleanup(self.state.dir.cleanup)
        saved = {k: os.environ.get(k) for k in ("TORCH_STUB_STATE", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}

        def restore():
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

        self.addCleanup(restore)
        self.addCleanup(gpumem_bridge.stop)
        os.environ["TORCH_STUB_STATE"] = self.state.path
        os.environ.pop("PYTORCH_ALLOC_CONF", None)
        self.state.write([{"uuid": UUID0, "stats": stats(10, 20)}])
        import torch  # noqa: F401  (the stub)

    def published(self):
        gpumem_bridge.publish_now()
        import json

        with open("/proc/self/fd/%d" % gpumem_bridge.fd(), "rb") as f:
            return json.loads(f.read())

    def test_good_settings_are_published_and_read_once(self):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True,max_split_size_mb:256"
        gpumem_bridge.start(interval=30)
        doc = self.published()
        self.assertEqual(doc["allocator"], settings(expandable_segments=True, max_split_size=256 * MIB))
        # torch read it when its allocator started; a later change is not it.
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:async"
        self.assertEqual(self.published()["allocator"]["backend"], "native")

    def test_unset_is_the_defaults(self):
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        gpumem_bridge.start(interval=30)
        self.assertEqual(self.published()["allocator"], DEFAULTS)

    def test_malformed_leaves_out_only_the_settings_with_one_warning(self):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:yes"
        with self.assertLogs("gpumem_bridge", "WARNING") as logs:
            gpumem_bridge.start(interval=30)
            docs = [self.published() for _ in range(5)]
        self.assertEqual(len(logs.records), 1, logs.output)
        self.assertIn("PYTORCH_CUDA_ALLOC_CONF", logs.output[0])
        for doc in docs:
            self.assertNotIn("allocator", doc)
            self.assertEqual(doc["devices"][0]["allocated"], 10)
            self.assertEqual(doc["devices"][0]["reserved"], 20)

    def test_no_settings_before_cuda_is_initialised(self):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        self.state.write([{"uuid": UUID0, "stats": stats(10, 20)}], initialized=False)
        gpumem_bridge.start(interval=30)
        self.assertEqual(self.published(), {"v": 1, "seq": 2, "devices": []})


if __name__ == "__main__":
    unittest.main()
