#!/usr/bin/env python3
"""Idle CPU per thread, two builds side by side on a GPU host, with torch
processes holding memory (as scripts/bench/peers does): every build at
the defaults and with --memory-sample-interval 1s, all at once, for R
rounds of S seconds (each round a fresh start, the start order rotated);
per thread its CPU (schedstat) and wake-ups, so what runs besides the
sampler shows. Changes no GPU setting; needs python3 with torch (CUDA).

    scripts/gpu/idle-threads.py NAME=BIN [NAME=BIN ...] [--rounds 3] [--seconds 30] [--hold-gib 4,2]

Markdown to stdout and $OUT/idle-threads.md.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from h200 import free_port  # noqa: E402  (the bench helpers)

HOLD = """
import sys, time, torch
x = torch.empty(int(float(sys.argv[1]) * (1 << 30)), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("held", flush=True)
time.sleep(3600)
"""


def threads(pid):
    """{tid: (name, run ns, slices)}"""
    got = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run, _, slices = (int(x) for x in f.read().split())
            got[tid] = (name, run, slices)
        except (OSError, ValueError):
            pass
    return got


def start(binary, args):
    port = free_port()
    p = subprocess.Popen([binary, "--web.listen-address", f"127.0.0.1:{port}", "--log.level", "warn", *args],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        if p.poll() is not None:
            raise SystemExit(f"{binary} exited with {p.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                if b"gpu_memory_used_bytes{" in r.read():
                    return p
        except OSError:
            pass
        time.sleep(0.1)
    p.kill()
    raise SystemExit(f"{binary}: no /metrics within 60 s")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="+", metavar="NAME=BIN")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--hold-gib", default="4,2")
    a = ap.parse_args()
    builds = [b.split("=", 1) for b in a.builds]
    runs = [(n, st, b, args) for n, b in builds
            for st, args in (("defaults", []), ("memory 1s", ["--memory-sample-interval", "1s"]))]
    holders = [subprocess.Popen([sys.executable, "-c", HOLD, g], stdout=subprocess.PIPE, text=True)
               for g in a.hold_gib.split(",")]
    out = [f"### Idle CPU per thread, {a.rounds} starts x {a.seconds:.0f} s, holders {a.hold_gib} GiB", ""]
    per = {}  # (name, setting, thread name) -> [ms per s]
    wakes = {}
    total = {(n, st): [] for n, st, _, _ in runs}
    try:
        for h in holders:
            h.stdout.readline()
        for r in range(a.rounds):
            order = runs[r % len(runs):] + runs[:r % len(runs)]
            procs = []
            try:
                for n, st, b, args in order:
                    procs.append(((n, st), start(b, args)))
                time.sleep(3)
                before = {k: threads(p.pid) for k, p in procs}
                t0 = time.monotonic()
                time.sleep(a.seconds)
                span = time.monotonic() - t0
                for k, p in procs:
                    after = threads(p.pid)
                    sums = {}
                    for tid, (name, run, slices) in after.items():
                        _, run0, sl0 = before[k].get(tid, (name, 0, 0))
                        s = sums.setdefault(name, [0, 0])
                        s[0] += run - run0
                        s[1] += slices - sl0
                    for name, (run, sl) in sums.items():
                        per.setdefault((*k, name), []).append(run / 1e6 / span)
                        wakes.setdefault((*k, name), []).append(sl / span)
                    total[k].append(sum(v[0] for v in sums.values()) / 1e7 / span)
            finally:
                for _, p in procs:
                    p.terminate()
                    p.wait()
    finally:
        for h in holders:
            h.kill()
    out.append("| build | setting | per start (% of a core) | median |")
    out.append("|---|---|---|---|")
    for (n, st), v in total.items():
        out.append(f"| {n} | {st} | " + ", ".join(f"{x:.3f}" for x in v) + f" | **{statistics.median(v):.3f}** |")
    out += ["", "| build | setting | thread | ms of CPU a second (median) | wake-ups a second |", "|---|---|---|---:|---:|"]
    for (n, st, t), v in sorted(per.items()):
        if statistics.median(v) < 0.005:
            continue
        out.append(f"| {n} | {st} | {t} | {statistics.median(v):.3f} | {statistics.median(wakes[(n, st, t)]):.1f} |")
    text = "\n".join(out)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "idle-threads.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
