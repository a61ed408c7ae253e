#!/usr/bin/env python3
"""Grow GPU memory until torch runs out of it: 2 GiB more every 100 ms
(about 7 s on a 140 GiB H200), with the torch bridge on so the recording
has torch's figures too. Prints what it held when the OOM came, then exits
3 (so the recorder's exit code can be checked against it).

    gpumem-exporter record -o run.csv -- scripts/gpu/record-oom.py
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402

try:
    import gpumem_bridge  # noqa: E402

    bridged = gpumem_bridge.start()
except ImportError:
    bridged = False

GIB = 1 << 30
CHUNK = 2 * GIB
chunks = []
print(f"growing by {CHUNK // GIB} GiB every 100 ms (torch bridge: {bridged})", flush=True)
t0 = time.monotonic()
try:
    while True:
        chunks.append(torch.empty(CHUNK, dtype=torch.uint8, device="cuda"))
        time.sleep(0.1)
except torch.cuda.OutOfMemoryError:
    held = len(chunks) * CHUNK
    print(
        f"OOM after {time.monotonic() - t0:.1f} s holding {held / GIB:.0f} GiB "
        f"(allocated {torch.cuda.memory_allocated() / GIB:.1f} GiB, "
        f"reserved {torch.cuda.memory_reserved() / GIB:.1f} GiB)",
        flush=True,
    )
    # Hold at the top for a moment so the last full sample sees it.
    time.sleep(1.2)
    sys.exit(3)
