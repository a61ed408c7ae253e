"""gpumem-exporter beside nvitop-exporter on a real GPU host (see scripts/bench/h200, which runs it).

One run, both exporters side by side at their default intervals:
  - cost of one `nvidia-smi --query-gpu=memory.used --format=csv` (median of 20)
  - time from process start to the first good /metrics
  - scrape latency: sequential (keep-alive where the server allows it) and
    with 50 concurrent Python threads; the client's own floor is measured on
    our /healthz with the same client
  - RSS (VmHWM / VmRSS) after warm-up and after the load
  - CPU over an idle window (nobody scrapes)
  - ours: mean full-sample time vs its NVML part, from its own histograms
  - spike: a torch process allocates N GiB for ~150 ms once between two
    scrapes 15 s apart; our gpu_memory_used_peak_bytes must show >= 95 % of it
    above the baseline; nvitop's gpu_memory_used_MiB at the same scrapes

Markdown to stdout, and to $OUT/bench-h200.md (plus raw JSON and the last
/metrics of each) when OUT is set (or --out DIR). Standard library only;
torch only in the spike child. Exit 1 when the spike check fails.
"""

import argparse
import http.client
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

MIB = 1 << 20
GIB = 1 << 30
LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)(?: \S+)?$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exporter", default=".dev/gpumem-exporter", help="gpumem-exporter binary")
    p.add_argument("--nvitop-site", default="/tmp/site",
                   help="directory holding nvitop and nvitop_exporter (added to PYTHONPATH of that process only)")
    p.add_argument("--gpu", default="0", help="NVML index or UUID of the GPU for the spike (default 0)")
    p.add_argument("--spike-gib", type=float, default=8.0, help="spike size in GiB (default 8)")
    p.add_argument("--spike-ms", type=float, default=150.0, help="how long the spike is held (default 150)")
    p.add_argument("--gap", type=float, default=15.0, help="seconds between the two spike scrapes (default 15)")
    p.add_argument("--seq", type=int, default=500, help="sequential scrapes per exporter (default 500)")
    p.add_argument("--conc", type=int, default=50, help="concurrent client threads (default 50)")
    p.add_argument("--conc-requests", type=int, default=1000,
                   help="requests per concurrent run, over all threads (default 1000)")
    p.add_argument("--conc-seconds", type=float, default=15.0, help="time cap of one concurrent run (default 15)")
    p.add_argument("--idle", type=float, default=30.0, help="idle CPU window in seconds (default 30)")
    p.add_argument("--smi-runs", type=int, default=20, help="nvidia-smi calls to time (default 20)")
    p.add_argument("--skip-nvitop", action="store_true", help="only our exporter")
    p.add_argument("--skip-spike", action="store_true", help="no torch spike test")
    p.add_argument("--out", default=os.environ.get("OUT") or None, help="write the report here (default $OUT)")
    p.add_argument("--self-test", action="store_true", help="check the parsers and nvitop's CLI, then exit (no GPU)")
    a = p.parse_args(argv)
    if a.seq < 1 or a.conc < 1 or a.conc_requests < a.conc or a.idle <= 0 or a.gap <= 1:
        p.error("need --seq >= 1, --conc >= 1, --conc-requests >= --conc, --idle > 0, --gap > 1")
    if not 0 < a.spike_gib < 1024 or a.spike_ms <= 0:
        p.error("--spike-gib must be in (0, 1024) and --spike-ms > 0")
    return a


# ------------------------------------------------------------------ helpers

def series(text, name):
    """[(labels, value)] of one metric name in exposition text."""
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = LINE.match(line)
        if m and m.group(1) == name:
            out.append((dict(LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def one(text, name, **labels):
    """Value of the first series of `name` whose labels include `labels`, else None."""
    for ls, v in series(text, name):
        if all(ls.get(k) == val for k, val in labels.items()):
            return v
    return None


def pct(values, q):
    """q-th percentile (0-100), nearest rank."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def get(port, path):
    """One GET on a new connection: (ms, status, body)."""
    t = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("GET", path)
        r = c.getresponse()
        body = r.read()
    finally:
        c.close()
    return (time.perf_counter() - t) * 1000, r.status, body


def scenario(pids, gpus=8):
    """A fake-NVML scenario file (its path) of `gpus` GPUs listing these
    pids on every one, as the scrape bench's 8 x 256."""
    lines = ["devices:"]
    for g in range(gpus):
        used = 8 << 20
        procs = []
        for k, pid in enumerate(pids):
            b = (256 << 20) + k * (256 << 10)
            used += b
            procs.append(f"      - {{pid: {pid}, used: {b}, type: compute}}")
        lines.append(f"  - uuid: GPU-6f1c2a9e-4b1d-8c3e-9a7f-{g:012x}")
        lines.append(f"    memory: {{total: 150754820096, reserved: 644939776, used: {used}}}")
        lines.append("    processes:")
        lines += procs
    fd, path = tempfile.mkstemp(suffix=".yaml")
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def proc_status(pid):
    """(VmHWM, VmRSS) in MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS"):
                out[k] = int(v.split()[0]) / 1024
    return out.get("VmHWM", float("nan")), out.get("VmRSS", float("nan"))


def cpu_seconds(pid):
    """(utime+stime in s, summed schedstat run time of all threads in s)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = (int(fields[11]) + int(fields[12])) / HZ  # fields 14 and 15 of stat
    run_ns = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    run_ns += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    except OSError:
        pass
    return ticks, run_ns / 1e9


class Client:
    """http.client GET with keep-alive when the server keeps the connection;
    a server that closes (HTTP/1.0, like nvitop's wsgiref) costs a reconnect."""

    def __init__(self, port, path="/metrics"):
        self.port, self.path = port, path
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def get(self, headers=None):
        try:
            self.conn.request("GET", self.path, headers=headers or {})
            r = self.conn.getresponse()
            body = r.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            self.conn.request("GET", self.path, headers=headers or {})
            r = self.conn.getresponse()
            body = r.read()
        if r.will_close:
            self.conn.close()
        return r.status, body

    def close(self):
        self.conn.close()


def scrape(port, path="/metrics"):
    c = Client(port, path)
    try:
        status, body = c.get()
    finally:
        c.close()
    if status != 200:
        raise RuntimeError(f"GET {path} on port {port}: HTTP {status}")
    return body.decode("utf-8", errors="replace")


class Exporter:
    def __init__(self, name, argv, env, good_series):
        self.name, self.argv, self.env, self.good = name, argv, env, good_series
        self.port = None
        self.proc = None
        self.start_ms = None
        self.log = None

    def start(self, port, timeout=60):
        self.port = port
        self.log = open(os.devnull, "w") if not OUTDIR else open(os.path.join(OUTDIR, f"{self.name}.log"), "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv(port), env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before serving")
            try:
                c = Client(port)
                status, body = c.get()
                c.close()
                if status == 200 and (self.good + "{").encode() in body:
                    self.start_ms = (time.monotonic() - t0) * 1000
                    return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.001)
        raise RuntimeError(f"{self.name}: no good /metrics within {timeout} s")

    @property
    def pid(self):
        return self.proc.pid

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log:
            self.log.close()


def sequential(port, n, path="/metrics"):
    c = Client(port, path)
    lat = []
    size = 0
    try:
        for _ in range(n):
            t = time.perf_counter()
            status, body = c.get()
            lat.append((time.perf_counter() - t) * 1000)
            if status != 200:
                raise RuntimeError(f"GET {path}: HTTP {status}")
            size = len(body)
    finally:
        c.close()
    return {"p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "n": len(lat), "bytes": size}


def concurrent(port, threads, total, cap_s, path="/metrics"):
    per = total // threads
    lats = [[] for _ in range(threads)]
    errors = []
    barrier = threading.Barrier(threads + 1)
    deadline = [0.0]

    def worker(i):
        c = Client(port, path)
        barrier.wait()
        try:
            for _ in range(per):
                if time.monotonic() > deadline[0]:
                    break
                t = time.perf_counter()
                status, _ = c.get()
                lats[i].append((time.perf_counter() - t) * 1000)
                if status != 200:
                    errors.append(status)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            errors.append(repr(e))
        finally:
            c.close()

    ts = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for t in ts:
        t.start()
    deadline[0] = time.monotonic() + cap_s
    t0 = time.monotonic()
    barrier.wait()
    for t in ts:
        t.join(cap_s + 30)
    wall = time.monotonic() - t0
    lat = [x for l in lats for x in l]
    return {"p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "n": len(lat),
            "rps": len(lat) / wall if wall > 0 else float("nan"), "errors": len(errors),
            "first_error": errors[0] if errors else None}


def smi_cost(runs):
    if not shutil.which("nvidia-smi"):
        return None
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv"],
                       check=True, stdout=subprocess.DEVNULL)
        times.append((time.perf_counter() - t) * 1000)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def gpu_list():
    out = subprocess.check_output(
        ["nvidia-smi", "--query-gpu=index,uuid,name,driver_version,memory.total",
         "--format=csv,noheader,nounits"], text=True)
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines() if line.strip()]


SPIKE_CHILD = r"""
import json, sys, time
import torch
dev = torch.device("cuda:0")
torch.empty(1, device=dev)            # CUDA context before the baseline scrape
torch.cuda.synchronize()
print(json.dumps({"ready": True, "torch": torch.__version__}), flush=True)
n = int(sys.argv[1]); hold = float(sys.argv[2]) / 1000
sys.stdin.readline()                  # "go"
start, filled = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
t_alloc = time.time()
start.record()
x = torch.empty(n, dtype=torch.uint8, device=dev)
x.fill_(1)                            # touch every page
filled.record()
torch.cuda.synchronize()
t_held = time.time()
time.sleep(hold)
t_free = time.time()
del x
torch.cuda.synchronize()
torch.cuda.empty_cache()
t_freed = time.time()
print(json.dumps({"t_alloc": t_alloc, "t_held": t_held, "t_free": t_free, "t_freed": t_freed,
                  "alloc_fill_ms": start.elapsed_time(filled), "bytes": n,
                  "reserved_after_free": torch.cuda.memory_reserved(dev)}), flush=True)
sys.stdin.readline()                  # "exit": keep the context until the second scrape
"""


def spike_test(args, uuid, report):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=uuid)
    nbytes = int(args.spike_gib * GIB)
    child = subprocess.Popen([sys.executable, "-c", SPIKE_CHILD, str(nbytes), str(args.spike_ms)],
                             env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    report["spike_child_pid"] = child.pid
    return child, nbytes


def finish_spike(args, child, nbytes, ours, nvitop, uuid):
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"spike child failed (exit {child.wait()}): is torch with CUDA installed?")
    ready = json.loads(line)
    time.sleep(1.5)  # both exporters have sampled the child's context
    res = {"torch": ready.get("torch"), "bytes": nbytes}

    def snap(tag):
        t = time.time()
        o = scrape(ours.port)
        res[f"ours_used_{tag}"] = one(o, "gpu_memory_used_bytes", uuid=uuid)
        res[f"ours_peak_{tag}"] = one(o, "gpu_memory_used_peak_bytes", uuid=uuid)
        if nvitop:
            n = scrape(nvitop.port)
            res[f"nvitop_used_mib_{tag}"] = one(n, "gpu_memory_used_MiB", uuid=uuid)
        res[f"t_{tag}"] = t
        return o

    snap("0")
    # the spike lands at a point between the two scrapes that is not
    # aligned with either exporter's sampling clock
    time.sleep(args.gap * 0.47)
    child.stdin.write("go\n")
    child.stdin.flush()
    timing = json.loads(child.stdout.readline())
    res.update(timing)
    wait = res["t_0"] + args.gap - time.time()
    if wait > 0:
        time.sleep(wait)
    snap("15")
    child.stdin.write("exit\n")
    child.stdin.flush()
    child.wait(timeout=30)
    base = res["ours_used_0"]
    peak = res["ours_peak_15"]
    res["ours_peak_above_base"] = None if base is None or peak is None else peak - base
    res["ours_ratio"] = None if res["ours_peak_above_base"] is None else res["ours_peak_above_base"] / nbytes
    res["pass"] = res["ours_ratio"] is not None and res["ours_ratio"] >= 0.95
    return res


# ------------------------------------------------------------------ report

def md_table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def f(v, nd=2):
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def render(r):
    parts = [f"## H200 run: gpumem-exporter vs nvitop-exporter ({r['when']})", ""]
    env = r["env"]
    parts.append(md_table(["host", "value"], [[k, v] for k, v in env.items()]))
    parts.append("")
    names = [n for n in ("ours", "nvitop") if n in r["exporters"]]
    head = ["measure"] + [r["exporters"][n]["label"] for n in names]
    rows = []

    def row(label, fn):
        rows.append([label] + [fn(r["exporters"][n]) for n in names])

    row("process start → first good /metrics", lambda e: f"{f(e.get('start_ms'), 1)} ms")
    row("/metrics body (sequential run)", lambda e: f"{e['seq']['bytes']} bytes" if e.get("seq") else "–")
    row(f"sequential scrapes (n={r['args']['seq']}): p50 / p99",
        lambda e: f"{f(e['seq']['p50_ms'], 3)} / {f(e['seq']['p99_ms'], 3)} ms" if e.get("seq") else "–")
    row(f"{r['args']['conc']} concurrent: p50 / p99 (req/s)",
        lambda e: (f"{f(e['conc']['p50_ms'], 2)} / {f(e['conc']['p99_ms'], 2)} ms ({f(e['conc']['rps'], 0)}/s"
                   + (f", {e['conc']['errors']} errors" if e['conc']['errors'] else "") + ")") if e.get("conc") else "–")
    row("RSS after warm-up: VmHWM / VmRSS", lambda e: f"{f(e['rss_warm'][0], 1)} / {f(e['rss_warm'][1], 1)} MiB")
    row("RSS after the load: VmHWM / VmRSS", lambda e: f"{f(e['rss_load'][0], 1)} / {f(e['rss_load'][1], 1)} MiB")
    row(f"CPU idle over {r['args']['idle']:.0f} s (schedstat; utime+stime)",
        lambda e: f"{f(e['cpu_pct'], 3)} % ; {f(e['cpu_pct_ticks'], 2)} % of a core")
    row("sample interval", lambda e: e["interval"])
    parts.append(md_table(head, rows))
    parts.append("")
    c = r.get("client_floor")
    if c:
        parts.append(
            f"Client floor (same Python client on our `/healthz`, a tiny body): sequential p50 "
            f"{f(c['seq']['p50_ms'], 3)} ms / p99 {f(c['seq']['p99_ms'], 3)} ms; {r['args']['conc']} threads p50 "
            f"{f(c['conc']['p50_ms'], 2)} ms / p99 {f(c['conc']['p99_ms'], 2)} ms. Concurrent figures are "
            f"dominated by the client's GIL at this size: compare exporters, not absolute numbers. "
            f"nvitop-exporter (wsgiref, HTTP/1.0) closes each connection, so its scrapes include a TCP connect, "
            f"and its listen backlog is 5 (socketserver's default): 50 simultaneous connects overflow it and "
            f"some wait for SYN retransmits (1 s, 3 s, ...), which is what its concurrent p99 shows.")
        parts.append("")
    t = r.get("ours_tick")
    if t:
        parts.append(md_table(["ours: full sample", "mean", "ticks"], [
            ["wall (gpumem_exporter_sample_duration_seconds)", f"{f(t['tick_ms'], 3)} ms", t["count"]],
            ["in NVML (gpumem_exporter_sample_nvml_duration_seconds)", f"{f(t['nvml_ms'], 3)} ms", t["count"]],
            ["tick / NVML (target ≤ 1.2)", f(t["ratio"], 3), ""],
        ]))
        parts.append("")
    s = r.get("smi")
    if s:
        parts.append(f"One `nvidia-smi --query-gpu=memory.used --format=csv`: median {f(s['median_ms'], 1)} ms "
                     f"(min {f(s['min_ms'], 1)}, max {f(s['max_ms'], 1)}) over {r['args']['smi_runs']} runs.")
        parts.append("")
    sp = r.get("spike")
    if sp:
        gib = sp["bytes"] / GIB
        parts.append(f"### Spike: {gib:g} GiB held {r['args']['spike_ms']:g} ms on GPU {r['spike_gpu']}, "
                     f"scrapes {r['args']['gap']:g} s apart")
        parts.append("")
        if "t_alloc" in sp:
            parts.append(f"Allocated {sp['t_alloc'] - sp['t_0']:.3f} s after the first scrape (alloc + fill "
                         f"{sp['alloc_fill_ms']:.1f} ms on the GPU, torch {sp['torch']}); held "
                         f"{(sp['t_free'] - sp['t_held']) * 1000:.0f} ms; freed (empty_cache) "
                         f"{(sp['t_freed'] - sp['t_free']) * 1000:.0f} ms later; second scrape "
                         f"{sp['t_15'] - sp['t_0']:.3f} s after the first.")
            parts.append("")
        rows = [
            ["ours gpu_memory_used_bytes", f"{f(sp.get('ours_used_0'), 0)}", f"{f(sp.get('ours_used_15'), 0)}"],
            ["ours gpu_memory_used_peak_bytes", f"{f(sp.get('ours_peak_0'), 0)}", f"{f(sp.get('ours_peak_15'), 0)}"],
        ]
        if "nvitop_used_mib_0" in sp:
            rows.append(["nvitop gpu_memory_used_MiB", f(sp.get("nvitop_used_mib_0"), 1),
                         f(sp.get("nvitop_used_mib_15"), 1)])
        parts.append(md_table(["series", "t = 0", f"t = {r['args']['gap']:g} s"], rows))
        parts.append("")
        above = sp.get("ours_peak_above_base")
        verdict = "PASS" if sp.get("pass") else "FAIL"
        parts.append(f"**{verdict}**: our peak at t = {r['args']['gap']:g} s is "
                     f"{f(above / MIB if above is not None else None, 0)} MiB above the t = 0 used figure = "
                     f"{f(100 * sp['ours_ratio'] if sp.get('ours_ratio') is not None else None, 1)} % of the "
                     f"{gib:g} GiB spike (needs ≥ 95 %).")
        if "nvitop_used_mib_0" in sp and sp.get("nvitop_used_mib_0") is not None:
            d = (sp.get("nvitop_used_mib_15") or 0) - sp["nvitop_used_mib_0"]
            seen = d * MIB >= 0.5 * sp["bytes"]
            parts.append(f"nvitop-exporter (interval 1 s, last value only) moved {d:+.0f} MiB between the same "
                         f"scrapes: " + ("it shows the spike." if seen else "the spike is not in its series."))
        parts.append("")
    for e in r.get("errors", []):
        parts.append(f"- error: {e}")
    if "runtime_s" in r:
        parts.append(f"Run time {r['runtime_s']:.0f} s.")
    return "\n".join(parts).rstrip() + "\n"


# ------------------------------------------------------------------ self-test

def self_test(args):
    text = ('# HELP gpu_memory_used_bytes x\n# TYPE gpu_memory_used_bytes gauge\n'
            'gpu_memory_used_bytes{gpu="0",uuid="GPU-a"} 12363563008\n'
            'gpu_memory_used_peak_bytes{gpu="0",uuid="GPU-a"} 2.1e+10\n'
            'gpumem_exporter_sample_duration_seconds_sum 0.5\n'
            'gpumem_exporter_sample_duration_seconds_count 10\n'
            'gpu_memory_used_MiB{devicename="NVIDIA H200",hostname="h",index="0",uuid="GPU-a"} 11790.0\n'
            'x{a="q\\"uote"} 1 1700000000000\n')
    assert one(text, "gpu_memory_used_bytes", uuid="GPU-a") == 12363563008
    assert one(text, "gpu_memory_used_peak_bytes", uuid="GPU-a") == 2.1e10
    assert one(text, "gpu_memory_used_MiB", uuid="GPU-a", index="0") == 11790.0
    assert one(text, "gpu_memory_used_bytes", uuid="GPU-b") is None
    assert one(text, "x") == 1.0
    assert pct(list(range(1, 101)), 50) == 50 and pct(list(range(1, 101)), 99) == 99
    assert pct([5.0], 99) == 5.0
    assert tick_stats(text)["tick_ms"] == 50.0
    hwm, rss = proc_status(os.getpid())
    assert hwm >= rss > 0
    assert cpu_seconds(os.getpid())[1] > 0
    fake = {"when": "now", "env": {"gpus": "1"}, "args": vars(args), "spike_gpu": "0 (GPU-a)",
            "exporters": {"ours": {"label": "gpumem-exporter", "start_ms": 40.0,
                                   "seq": {"p50_ms": 0.2, "p99_ms": 0.4, "n": 500, "bytes": 9000},
                                   "conc": {"p50_ms": 9.0, "p99_ms": 20.0, "rps": 3000.0, "errors": 0},
                                   "rss_warm": (8.0, 7.5), "rss_load": (9.0, 8.0), "cpu_pct": 0.05,
                                   "cpu_pct_ticks": 0.0, "interval": "1s"}},
            "spike": {"bytes": 8 * GIB, "ours_used_0": 1e9, "ours_used_15": 1e9, "ours_peak_0": 1e9,
                      "ours_peak_15": 1e9 + 8 * GIB, "ours_peak_above_base": 8 * GIB, "ours_ratio": 1.0,
                      "pass": True, "nvitop_used_mib_0": 900.0, "nvitop_used_mib_15": 900.0}}
    out = render(fake)
    assert "PASS" in out and "| process start" in out, out
    # nvitop-exporter's real CLI: the flags this script passes, and its default interval
    try:
        sys.path.insert(0, args.nvitop_site)
        saved = sys.argv
        sys.argv = ["nvitop-exporter", "--bind-address", "127.0.0.1", "--port", "1"]
        try:
            from nvitop_exporter import cli  # noqa: PLC0415
            ns = cli.parse_arguments()
        finally:
            sys.argv = saved
        assert ns.bind_address == "127.0.0.1" and ns.port == 1 and ns.interval == 1.0, ns
        print(f"self-test: nvitop-exporter CLI ok (interval default {ns.interval} s)")
    except ImportError as e:
        print(f"self-test: nvitop-exporter not importable from {args.nvitop_site}: {e}")
        return 1
    print("self-test: ok")
    return 0


def tick_stats(text):
    s = one(text, "gpumem_exporter_sample_duration_seconds_sum")
    n = one(text, "gpumem_exporter_sample_duration_seconds_count")
    ns = one(text, "gpumem_exporter_sample_nvml_duration_seconds_sum")
    nn = one(text, "gpumem_exporter_sample_nvml_duration_seconds_count")
    if not n:
        return None
    tick = s / n * 1000
    nvml = ns / nn * 1000 if nn else None
    return {"tick_ms": tick, "nvml_ms": nvml, "count": int(n), "ratio": tick / nvml if nvml else None}


# ------------------------------------------------------------------ main

OUTDIR = None


def main():
    global OUTDIR
    args = parse_args()
    if args.self_test:
        return self_test(args)
    t_begin = time.monotonic()
    OUTDIR = args.out
    if OUTDIR:
        os.makedirs(OUTDIR, exist_ok=True)
    report = {"when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args), "exporters": {}, "errors": []}
    gpus = gpu_list()
    pick = next((g for g in gpus if args.gpu in (g[0], g[1])), None)
    if pick is None:
        sys.exit(f"--gpu {args.gpu}: not among {[g[0] + ' ' + g[1] for g in gpus]}")
    uuid = pick[1]
    report["spike_gpu"] = f"{pick[0]} ({uuid})"

    # versions as the nvitop-exporter process sees them (its PYTHONPATH)
    probe = ("import importlib.metadata as m\n"
             "def v(n):\n"
             "    try:\n        return m.version(n)\n"
             "    except m.PackageNotFoundError:\n        return 'missing'\n"
             "print(' / '.join(v(n) for n in ('nvitop', 'nvitop-exporter', 'prometheus-client', "
             "'nvidia-ml-py', 'psutil')))")
    site_env = dict(os.environ)
    site_env["PYTHONPATH"] = args.nvitop_site + (os.pathsep + site_env["PYTHONPATH"]
                                                 if site_env.get("PYTHONPATH") else "")
    versions = subprocess.run([sys.executable, "-c", probe], env=site_env, capture_output=True,
                              text=True).stdout.strip() or "?"
    report["env"] = {
        "GPUs": f"{len(gpus)} × {pick[2]}, {pick[4]} MiB",
        "driver": pick[3],
        "CPU cores": str(os.cpu_count()),
        "python": sys.version.split()[0],
        "nvitop / nvitop-exporter / prometheus-client / nvidia-ml-py / psutil": versions,
    }
    report["smi"] = smi_cost(args.smi_runs)

    ours = Exporter("ours", lambda port: [args.exporter, "--web.listen-address", f"127.0.0.1:{port}"],
                    dict(os.environ), "gpu_memory_used_bytes")
    nvitop = None
    if not args.skip_nvitop:
        nvitop = Exporter("nvitop", lambda port: [sys.executable, "-m", "nvitop_exporter",
                                                  "--bind-address", "127.0.0.1", "--port", str(port)],
                          site_env, "gpu_memory_used_MiB")
    exporters = [("ours", ours, "gpumem-exporter", "1s (memory 100ms)")]
    if nvitop:
        exporters.append(("nvitop", nvitop, "nvitop-exporter 1.7.2", "1s (its default)"))
    child = None
    try:
        # start one after the other, so each start time is its own
        for key, e, label, interval in list(exporters):
            try:
                e.start(free_port())
                report["exporters"][key] = {"label": label, "start_ms": e.start_ms, "interval": interval}
            except Exception as ex:  # noqa: BLE001 - reported, the rest still runs
                report["errors"].append(f"{label}: {ex}")
                exporters.remove((key, e, label, interval))
                e.stop()
        if not any(k == "ours" for k, *_ in exporters):
            raise RuntimeError("our exporter did not start")
        if nvitop and not any(k == "nvitop" for k, *_ in exporters):
            nvitop = None
        time.sleep(2)  # warm-up: both have sampled a few times
        for key, e, *_ in exporters:
            scrape(e.port)
            report["exporters"][key]["rss_warm"] = proc_status(e.pid)
        for key, e, *_ in exporters:
            report["exporters"][key]["seq"] = sequential(e.port, args.seq)
        report["client_floor"] = {"seq": sequential(ours.port, args.seq, "/healthz"),
                                  "conc": concurrent(ours.port, args.conc, args.conc_requests,
                                                     args.conc_seconds, "/healthz")}
        for key, e, *_ in exporters:
            report["exporters"][key]["conc"] = concurrent(e.port, args.conc, args.conc_requests, args.conc_seconds)
            report["exporters"][key]["rss_load"] = proc_status(e.pid)
        if not args.skip_spike:
            # torch imports during the idle window (another process, other cores)
            child, nbytes = spike_test(args, uuid, report)
        time.sleep(2)
        before = {k: (cpu_seconds(e.pid), time.monotonic()) for k, e, *_ in exporters}
        time.sleep(args.idle)
        for key, e, *_ in exporters:
            (t0, r0), m0 = before[key]
            t1, r1 = cpu_seconds(e.pid)
            dt = time.monotonic() - m0
            report["exporters"][key]["cpu_pct"] = (r1 - r0) / dt * 100
            report["exporters"][key]["cpu_pct_ticks"] = (t1 - t0) / dt * 100
        text = scrape(ours.port)
        report["ours_tick"] = tick_stats(text)
        if OUTDIR:
            with open(os.path.join(OUTDIR, "ours-metrics.txt"), "w") as fh:
                fh.write(text)
            if nvitop:
                with open(os.path.join(OUTDIR, "nvitop-metrics.txt"), "w") as fh:
                    fh.write(scrape(nvitop.port))
        if child is not None:
            try:
                report["spike"] = finish_spike(args, child, nbytes, ours, nvitop, uuid)
            except Exception as ex:  # noqa: BLE001
                report["errors"].append(f"spike: {ex}")
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        for _, e, *_ in exporters:
            e.stop()
    report["runtime_s"] = time.monotonic() - t_begin
    out = render(report)
    print(out)
    if OUTDIR:
        with open(os.path.join(OUTDIR, "bench-h200.md"), "w") as fh:
            fh.write(out)
        with open(os.path.join(OUTDIR, "bench-h200.json"), "w") as fh:
            json.dump(report, fh, indent=1, default=str)
    spike = report.get("spike")
    if not args.skip_spike and not (spike and spike.get("pass")):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
