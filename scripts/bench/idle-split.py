#!/usr/bin/env python3
"""Where the exporter's idle CPU goes, on a GPU host: the same binary under
settings that each take one part of the work away (the 10 Hz memory
samples, the process lists, the collectors), measured in rounds so that
each setting is sampled at several moments of the machine's own noise.
Per setting: CPU as % of one core (schedstat of every thread), voluntary
context switches per second (the wakeups) and full ticks per second, the
median over the rounds with the range. No scrape during a window: the
figures are the exporter's own background work. Changes no GPU setting.

    scripts/bench/idle-split.py [path/to/gpumem-exporter] [--seconds N] [--rounds R]

Defaults: target/release/gpumem-exporter, 30 s windows, 2 rounds (about
6.5 minutes). EXPORTER_ARGS adds flags to every run (e.g.
`--nvml.library target/debug/libfake_nvml.so` to try it without a GPU). The differences between rows are what each part costs; the
last row is the floor (HTTP server, signals, a 1 Hz memory sample).
"""
import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
OFF_ALL = ["--no-collector.processes", "--no-collector.utilization",
           "--no-collector.power_thermal", "--no-collector.health"]
SETTINGS = [
    ("defaults", []),
    ("--collector.process_utilization", ["--collector.process_utilization"]),
    ("--memory-sample-interval 1s", ["--memory-sample-interval", "1s"]),
    ("--no-collector.processes", ["--no-collector.processes"]),
    ("every switchable collector off", OFF_ALL),
    ("all off, --memory-sample-interval 1s", OFF_ALL + ["--memory-sample-interval", "1s"]),
]


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def value(text, name):
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def threads(pid):
    return os.listdir(f"/proc/{pid}/task")


def cpu_ns(pid):
    total = 0
    for tid in threads(pid):
        try:
            total += int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0])
        except OSError:
            pass
    return total


def switches(pid):
    total = 0
    for tid in threads(pid):
        try:
            for line in open(f"/proc/{pid}/task/{tid}/status"):
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def measure(binary, args, port, seconds):
    extra = os.environ.get("EXPORTER_ARGS", "").split()
    p = subprocess.Popen([binary, "--web.listen-address", f"127.0.0.1:{port}", "--log.level", "warn"] + extra + args,
                         stderr=subprocess.DEVNULL)
    try:
        for _ in range(500):
            try:
                scrape(port)
                break
            except OSError:
                time.sleep(0.01)
        else:
            raise SystemExit(f"the exporter did not start with {args}")
        time.sleep(3)
        m0, c0, s0, t0 = scrape(port), cpu_ns(p.pid), switches(p.pid), time.time()
        time.sleep(seconds)
        c1, s1, t1 = cpu_ns(p.pid), switches(p.pid), time.time()
        m1 = scrape(port)
        span = t1 - t0
        ticks = value(m1, "gpumem_exporter_sample_duration_seconds_count") - \
            value(m0, "gpumem_exporter_sample_duration_seconds_count")
        return 100 * (c1 - c0) / (span * 1e9), (s1 - s0) / span, ticks / span
    finally:
        p.terminate()
        p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary", nargs="?", default=os.path.join(ROOT, "target/release/gpumem-exporter"))
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    got = {name: [] for name, _ in SETTINGS}
    for r in range(a.rounds):
        for i, (name, args) in enumerate(SETTINGS):
            got[name].append(measure(a.binary, args, 19900 + 10 * r + i, a.seconds))
            print(f"round {r + 1} {name}: {got[name][-1][0]:.3f} % CPU", file=sys.stderr, flush=True)
    print(f"idle, {a.rounds} rounds of {a.seconds:.0f} s per setting, no scrape in the window")
    print(f"| setting | CPU % of a core (median, range) | wakeups/s | full ticks/s |")
    print("|---|---|---|---|")
    for name, _ in SETTINGS:
        cpu = [x[0] for x in got[name]]
        wake = [x[1] for x in got[name]]
        ticks = [x[2] for x in got[name]]
        print(f"| {name} | {statistics.median(cpu):.3f} ({min(cpu):.3f}–{max(cpu):.3f}) | "
              f"{statistics.median(wake):.1f} | {statistics.median(ticks):.2f} |")


if __name__ == "__main__":
    main()
