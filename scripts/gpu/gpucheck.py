"""Shared helpers of the real-GPU check scripts: the exporter argument,
a time limit and a report file for the whole check, PASS/FAIL lines,
scraping the exporter, and reading series out of the text format."""
import os
import re
import signal
import sys
import urllib.request

# The repository root (this file is scripts/gpu/gpucheck.py).
ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def exporter(default, index=1):
    """The exporter binary: sys.argv[index] when given, else `default`
    (a path from the repository root, e.g. ".dev/gpumem-exporter")."""
    return sys.argv[index] if len(sys.argv) > index else os.path.join(ROOT, default)


def time_limit(seconds):
    """End the whole check after `seconds`, as `timeout(1)` does: this
    process leads its own process group, and at the limit a FAIL line is
    printed, the group (the exporter, torch children) gets SIGTERM and
    this process exits 124."""
    os.setpgrp()

    def expire(*_):
        print(f"FAIL  the whole check timed out after {seconds} s", flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
        os._exit(124)

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)


class _Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
            s.flush()
        return len(text)

    def flush(self):
        for s in self.streams:
            s.flush()


def report_to(path):
    """From now on, stdout goes to `path` too (as `| tee path` did)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sys.stdout = _Tee(sys.stdout, open(path, "w", buffering=1))

failures = []


def check(name, ok, detail):
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    if not ok:
        failures.append(name)


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def series(text, name):
    """[(labels, value)] of every sample of `name`."""
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m and m.group(1) == name:
            out.append((dict(LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out
