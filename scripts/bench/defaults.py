#!/usr/bin/env python3
"""What the exporter costs at its defaults, on the fake NVML, against the
lines BENCHMARKS.md keeps ("Lean at the defaults"): one build, or two side
by side (BEFORE). No GPU needed; standard library only.

  1. body: the text /metrics body at 8 GPUs x 256 processes, bare shape
     (pids 3000000-3000255, which /proc does not show: no name, no user,
     no pod), and the same with 256 sleeping processes (names and users
     known), with the largest families;
  2. rss: VmHWM after N sequential /metrics scrapes (a new connection
     each, one every 50 ms, so most land on a new snapshot) at 8 x 256 bare;
  3. snapshot: /api/v1/snapshot against /healthz at 8 x 256 bare, R rounds
     of P request pairs, interleaved, a new connection each; p99 of each
     per round and their ratio (the line: the best round at most 1.5);
  4. idle: every build at once on the fake's example scenario (2 GPUs),
     at the defaults and with --memory-sample-interval 1s, nobody
     scraping, CPU of all threads (schedstat) over R windows of S
     seconds; the ratio to BEFORE per window, and what the nine
     memory-only samples a second cost (the difference of the settings);
  5. starts: the same over K starts with the start order rotated (a
     start's timer phase moves a build's figure more than windows of one
     start do); per start the ratio to BEFORE at the defaults and one
     memory-only sample's CPU.

    scripts/bench/defaults.py BIN [--before BIN] [--also NAME=BIN ...] [--lib libfake_nvml.so]
        [--only body,rss,snapshot,idle,starts] [--rounds 4] [--seconds 45]
        [--starts 8] [--start-seconds 20]

BIN and --before are release builds; --lib defaults to
target/release/libfake_nvml.so (`cargo build --release -p fake-nvml`), the
same library for every build. Markdown to stdout (and $OUT/defaults.md).
"""

import argparse
import http.client
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from h200 import cpu_seconds, free_port, get, pct, proc_status, scenario  # noqa: E402  (the bench helpers)

EXAMPLE = os.path.join(ROOT, "tests/fake-nvml/scenarios/example.yaml")


class Exporter:
    def __init__(self, binary, lib, yaml, args=()):
        self.port = free_port()
        env = dict(os.environ, FAKE_NVML_CONFIG=yaml)
        self.proc = subprocess.Popen(
            [binary, "--nvml.library", lib, "--web.listen-address", f"127.0.0.1:{self.port}",
             "--log.level", "warn", *args],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            if self.proc.poll() is not None:
                raise SystemExit(f"{binary} exited with {self.proc.returncode}")
            try:
                _, status, body = get(self.port, "/metrics")
                if status == 200 and b"gpu_memory_used_bytes{" in body:
                    return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.05)
        raise SystemExit(f"{binary}: no good /metrics within 60 s")

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def families(body):
    sizes, series = {}, {}
    family = None
    for line in body.decode().splitlines(keepends=True):
        if line.startswith("# HELP "):
            family = line.split()[2]
        sizes[family] = sizes.get(family, 0) + len(line)
        if not line.startswith("#"):
            series[family] = series.get(family, 0) + 1
    return sorted(((b, series.get(f, 0), f) for f, b in sizes.items()), reverse=True)


def body(builds, lib, out):
    sleepers = [subprocess.Popen(["sleep", "3600"]) for _ in range(256)]
    shapes = [("bare (pids /proc does not show)", scenario(range(3_000_000, 3_000_256))),
              ("256 sleeping processes", scenario([s.pid for s in sleepers]))]
    try:
        out.append("| build | shape | text body bytes | largest families (bytes, series) |")
        out.append("|---|---|---:|---|")
        for name, binary in builds:
            for shape, yaml in shapes:
                e = Exporter(binary, lib, yaml)
                time.sleep(2.5)
                _, _, b = get(e.port, "/metrics")
                e.stop()
                top = ", ".join(f"`{f}` {n:,} ({k})" for n, k, f in families(b)[:4])
                out.append(f"| {name} | {shape} | {len(b):,} | {top} |")
    finally:
        for s in sleepers:
            s.kill()
            s.wait()
        for _, yaml in shapes:
            os.unlink(yaml)


def rss(builds, lib, scrapes, out):
    yaml = scenario(range(3_000_000, 3_000_256))
    out.append(f"| build | VmHWM / VmRSS after warm-up | after {scrapes} sequential /metrics (MiB) |")
    out.append("|---|---|---|")
    try:
        for name, binary in builds:
            e = Exporter(binary, lib, yaml)
            time.sleep(2)
            pid = e.proc.pid
            warm = proc_status(pid)
            for _ in range(scrapes):
                get(e.port, "/metrics")
                time.sleep(0.05)
            after = proc_status(pid)
            e.stop()
            out.append(f"| {name} | {warm[0]:.1f} / {warm[1]:.1f} | **{after[0]:.1f}** / {after[1]:.1f} |")
    finally:
        os.unlink(yaml)


def snapshot(builds, lib, rounds, pairs, out):
    yaml = scenario(range(3_000_000, 3_000_256))
    out.append("| build | round | /api/v1/snapshot p50 / p99 ms | /healthz p50 / p99 ms | p99 ratio | VmHWM MiB |")
    out.append("|---|---|---|---|---|---|")
    try:
        for name, binary in builds:
            e = Exporter(binary, lib, yaml)
            time.sleep(2)
            for _ in range(20):
                get(e.port, "/api/v1/snapshot")
            ratios = []
            for r in range(rounds):
                m, h = [], []
                for i in range(pairs):
                    order = [("/api/v1/snapshot", m), ("/healthz", h)]
                    for path, acc in (order if i % 2 == 0 else order[::-1]):
                        ms, status, _ = get(e.port, path)
                        if status != 200:
                            raise SystemExit(f"GET {path}: HTTP {status}")
                        acc.append(ms)
                ratio = pct(m, 99) / pct(h, 99)
                ratios.append(ratio)
                out.append(f"| {name} | {r + 1} | {pct(m, 50):.3f} / {pct(m, 99):.3f} | "
                           f"{pct(h, 50):.3f} / {pct(h, 99):.3f} | {ratio:.2f} | "
                           f"{proc_status(e.proc.pid)[0]:.1f} |")
            e.stop()
            out.append(f"| {name} | best | | | **{min(ratios):.2f}** | |")
    finally:
        os.unlink(yaml)


def idle(builds, lib, rounds, seconds, out):
    """Every build at the defaults and with --memory-sample-interval 1s, all
    at once: the difference is the nine memory-only samples a second."""
    runs = [(name, setting, args) for name, _ in builds
            for setting, args in (("defaults", []), ("memory 1s", ["--memory-sample-interval", "1s"]))]
    binary = dict(builds)
    exporters = [(name, setting, Exporter(binary[name], lib, EXAMPLE, args)) for name, setting, args in runs]
    got = {(n, st): [] for n, st, _ in exporters}
    try:
        time.sleep(3)
        for _ in range(rounds):
            c0 = {(n, st): cpu_seconds(e.proc.pid)[1] for n, st, e in exporters}
            t0 = time.monotonic()
            time.sleep(seconds)
            span = time.monotonic() - t0
            for n, st, e in exporters:
                got[(n, st)].append(100 * (cpu_seconds(e.proc.pid)[1] - c0[(n, st)]) / span)
    finally:
        for _, _, e in exporters:
            e.stop()
    out.append("| build | setting | " + " | ".join(f"window {i + 1}" for i in range(rounds)) + " | median |")
    out.append("|---|---|" + "---|" * (rounds + 1))
    med = {k: statistics.median(v) for k, v in got.items()}
    for (n, st), v in got.items():
        out.append(f"| {n} | {st} | " + " | ".join(f"{x:.3f} %" for x in v) + f" | **{med[(n, st)]:.3f} %** |")
    out.append("")
    for n, _ in builds:
        per = [(a - b) / 9 * 1e4 for a, b in zip(got[(n, "defaults")], got[(n, "memory 1s")])]
        out.append(f"- {n}: the nine memory-only samples a second cost "
                   f"{med[(n, 'defaults')] - med[(n, 'memory 1s')]:.3f} % of a core (medians), "
                   f"{statistics.median(per):.1f} µs of CPU each (median of the windows: "
                   + ", ".join(f"{x:.1f}" for x in per) + ")")
    names = [n for n, _ in builds]
    if "before" in names:
        for a in names:
            if a == "before":
                continue
            ratios = [x / y for x, y in zip(got[(a, "defaults")], got[("before", "defaults")])]
            out.append(f"- at the defaults, {a} / before: " + ", ".join(f"{r:.2f}" for r in ratios)
                       + f" per window; medians {med[(a, 'defaults')] / med[('before', 'defaults')]:.2f}")


def idle_starts(builds, lib, starts, seconds, out):
    """Idle CPU over many starts, every build at once at the defaults and
    with --memory-sample-interval 1s, the order they start in rotated each
    time: which build's 100 ms timer lands beside another's is set at its
    start and moves its figure by tens of per cent for as long as it runs,
    so one start's windows agree with each other more than starts do. Per
    start: the ratio to BEFORE at the defaults, and one memory-only
    sample's CPU (the difference of the settings / 9)."""
    runs = [(name, setting, binary, args) for name, binary in builds
            for setting, args in (("defaults", []), ("memory 1s", ["--memory-sample-interval", "1s"]))]
    got = {(name, setting): [] for name, setting, _, _ in runs}
    for i in range(starts):
        order = runs[i % len(runs):] + runs[:i % len(runs)]
        exporters = []
        try:
            for name, setting, binary, args in order:
                exporters.append(((name, setting), Exporter(binary, lib, EXAMPLE, args)))
                time.sleep(0.037 * (i % 3 + 1))
            time.sleep(3)
            c0 = {k: cpu_seconds(e.proc.pid)[1] for k, e in exporters}
            t0 = time.monotonic()
            time.sleep(seconds)
            span = time.monotonic() - t0
            for k, e in exporters:
                got[k].append(100 * (cpu_seconds(e.proc.pid)[1] - c0[k]) / span)
        finally:
            for _, e in exporters:
                e.stop()
    out.append("| build | setting | " + " | ".join(f"start {i + 1}" for i in range(starts)) + " | median |")
    out.append("|---|---|" + "---|" * (starts + 1))
    for (n, st), v in got.items():
        out.append(f"| {n} | {st} | " + " | ".join(f"{x:.3f}" for x in v) + f" | **{statistics.median(v):.3f} %** |")
    out.append("")
    sample = {n: [(a - b) / 9 * 1e4 for a, b in zip(got[(n, "defaults")], got[(n, "memory 1s")])]
              for n, _ in builds}
    for n, _ in builds:
        out.append(f"- {n}: one memory-only sample, per start: " + ", ".join(f"{x:.0f}" for x in sample[n])
                   + f" µs; median **{statistics.median(sample[n]):.0f} µs**")
    if "before" in sample:
        for n, _ in builds:
            if n == "before":
                continue
            ratios = sorted(x / y for x, y in zip(got[(n, "defaults")], got[("before", "defaults")]))
            out.append(f"- {n} / before at the defaults, per start (sorted): " + ", ".join(f"{r:.2f}" for r in ratios)
                       + f"; median **{statistics.median(ratios):.2f}**")
            diffs = sorted(x - y for x, y in zip(sample[n], sample["before"]))
            out.append(f"- {n} − before, one memory-only sample, per start (sorted, µs): "
                       + ", ".join(f"{d:+.0f}" for d in diffs) + f"; median **{statistics.median(diffs):+.0f} µs**")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary")
    ap.add_argument("--before", default=None)
    ap.add_argument("--also", action="append", default=[], metavar="NAME=BIN",
                    help="another build beside them (repeatable; the idle table compares each with --before)")
    ap.add_argument("--lib", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")),
                                                  "release/libfake_nvml.so"))
    ap.add_argument("--only", default="body,rss,snapshot,idle,starts")
    ap.add_argument("--starts", type=int, default=8, help="starts of the idle-at-defaults comparison (default 8)")
    ap.add_argument("--start-seconds", type=float, default=20, help="seconds measured per start (default 20)")
    ap.add_argument("--rounds", type=int, default=4, help="idle windows (default 4)")
    ap.add_argument("--seconds", type=float, default=45, help="seconds per idle window (default 45)")
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--snapshot-rounds", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=300)
    a = ap.parse_args()
    also = []
    for spec in a.also:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path or name in ("this", "before"):
            ap.error(f"--also {spec!r}: want NAME=BIN, NAME neither 'this' nor 'before'")
        also.append((name, path))
    builds = [("this", a.binary)] + also + ([("before", a.before)] if a.before else [])
    only = set(a.only.split(","))
    out = [f"### At the defaults, fake NVML, {os.cpu_count()} cores", ""]
    for name, b in builds:
        out.append(f"- {name}: `{b}`")
    out.append("")
    if "body" in only:
        out += ["#### /metrics body, 8 GPUs x 256 processes", ""]
        body(builds, a.lib, out)
        out.append("")
    if "rss" in only:
        out += ["#### RSS under sequential scrapes, 8 x 256 bare", ""]
        rss(builds, a.lib, a.scrapes, out)
        out.append("")
    if "snapshot" in only:
        out += [f"#### /api/v1/snapshot against /healthz, 8 x 256 bare, {a.pairs} pairs a round", ""]
        snapshot(builds, a.lib, a.snapshot_rounds, a.pairs, out)
        out.append("")
    if "idle" in only:
        out += [f"#### Idle CPU, example scenario (2 GPUs), side by side, {a.rounds} x {a.seconds:.0f} s", ""]
        idle(builds, a.lib, a.rounds, a.seconds, out)
        out.append("")
    if "starts" in only:
        out += [f"#### Idle CPU over {a.starts} starts, the start order rotated, "
                f"{a.start_seconds:.0f} s each (% of a core)", ""]
        idle_starts(builds, a.lib, a.starts, a.start_seconds, out)
        out.append("")
    text = "\n".join(out)
    print(text)
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "defaults.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
