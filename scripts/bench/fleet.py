#!/usr/bin/env python3
"""A fleet simulated on one machine: N real gpumem-exporter processes on the
fake NVML (8 GPUs each, processes churning), scraped by vmagent into
VictoriaMetrics single-node, then a scrape-only stand-in at 1,000 targets.
Results in BENCHMARKS.md ("A fleet, simulated").

    scripts/bench/fleet.py --binary target/debug/gpumem-exporter \\
        --fake-nvml target/debug/libfake_nvml.so [--nodes 100] [--mode pid]

Needs: python3 (standard library only), victoria-metrics and vmagent
(`apt-get install -y victoria-metrics`), a built exporter and fake NVML
(`cargo build -p fake-nvml --lib && cargo build`).

Phase 1, the fleet: each node is an exporter with its own scenario file:
`--gpus` GPUs with `--procs` processes each; processes churn at
`--churn-per-hour` per node (one process on a random GPU replaced by a new
pid, the scenario rewritten). Each fake pid has an entry in the node's
own /proc root (`--path.procfs`): `python3`, uid 2000 + its GPU's index,
so a GPU's processes are one user's job (workload mode's workload).
`--mode` (pid, workload, off) writes `processes.series` into each
exporter's config (pid, the default, writes nothing). The exporters sample
every `--sample-interval` (memory samples at the same interval: the
machine's cores are shared, so the 1 s / 100 ms defaults are lowered; it
changes no series and no sample count, only the exporters' CPU). vmagent
scrapes them every `--scrape-interval` with the hosts job of
deploy/fleet/vmagent.yml (job relabelled to gpumem-exporter) and writes to
VictoriaMetrics. After `--warmup` s, over `--window` s:

- samples per second per node: vmagent's `scrape_samples_scraped` summed
  over the targets, per scrape interval, per node;
- active series per node: `count({job="gpumem-exporter"})` now, per node
  (stale series of ended pids are not counted: vmagent marks them stale);
- series churn per hour: VictoriaMetrics' `vm_new_timeseries_created_total`
  over the window, per node, scaled to an hour;
- disk bytes per node-day: two ways. (a) The growth of the storage folder
  (`du`, after /internal/force_flush) over the window, per node, scaled to
  a day: recent data sits in small, less compressed parts, so this is an
  upper bound. (b) After the window, /internal/force_merge: bytes of the
  data folder per sample ingested so far, times samples per node-day, plus
  the index folder's bytes per series created, times series created per
  node-day;
- the dashboard's slowest query: every panel query of
  grafana/gpumem-exporter.json (variables at All, `$__rate_interval` 1m =
  4 scrape intervals) as an instant query and as a range query over the
  window (step = scrape interval), 3 runs each, the median, slowest first.

vmalert evaluates the shipped rules (deploy/prometheus/rules.yml) against the
same VictoriaMetrics at the scrape interval (its alerts go to a sink), so the
recorded rollups the dashboard reads exist; its CPU and each rule's last
evaluation time are reported.

Phase 2, 1,000 targets (`--standins`, 0 to skip): the exporters stop; one
Python process serves the body that node 0 served last, unchanged, on
`--standins` loopback ports (each a target, so each gets its own instance
label); vmagent scrapes them into a fresh VictoriaMetrics. No churn there
(the body never changes). The same measures, and the slowest queries at
that size.

Markdown to stdout and to --out/fleet.md, raw JSON in --out/fleet.json.
"""

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOTAL = 85899345920  # an 80 GiB GPU


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--binary", required=True, help="the gpumem-exporter binary")
    p.add_argument("--fake-nvml", required=True, help="libfake_nvml.so")
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--procs", type=int, default=4, help="processes per GPU")
    p.add_argument("--churn-per-hour", type=float, default=1000.0, help="new processes per node per hour")
    p.add_argument("--mode", choices=["pid", "workload", "off"], default="pid")
    p.add_argument("--sample-interval", default="5s")
    p.add_argument("--scrape-interval", type=int, default=15, help="seconds")
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--window", type=int, default=120)
    p.add_argument("--standins", type=int, default=1000)
    p.add_argument("--standin-warmup", type=int, default=45)
    p.add_argument("--standin-window", type=int, default=60)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def wait_http(url, what, timeout=60):
    end = time.time() + timeout
    while time.time() < end:
        try:
            get(url, timeout=2)
            return
        except Exception:
            time.sleep(0.2)
    sys.exit(f"{what} did not answer {url} within {timeout} s")


def cpu_seconds(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return float("nan")


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def du(path):
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


# ------------------------------------------------------------------ nodes


class Node:
    """One exporter on its own scenario; its processes churn."""

    def __init__(self, i, args, base):
        self.i, self.args = i, args
        self.dir = os.path.join(base, f"node{i}")
        os.makedirs(self.dir)
        self.port = free_port()
        self.next_pid = 10000
        self.gpus = [[self.new_proc() for _ in range(args.procs)] for _ in range(args.gpus)]
        self.scenario = os.path.join(self.dir, "scenario.yaml")
        self.proc = None
        self.write()
        config = f"sample_interval: {args.sample_interval}\nmemory_sample_interval: {args.sample_interval}\n"
        config += "kubernetes:\n  enabled: false\n"
        if args.mode != "pid":
            config += f"processes:\n  series: {args.mode}\n"
        # An empty /proc root: the fake pids must not find this machine's
        # processes of the same numbers.
        self.proc = os.path.join(self.dir, "proc")
        os.makedirs(self.proc)
        for g, procs in enumerate(self.gpus):
            for pid, _ in procs:
                self.write_proc(pid, g)
        cfg = os.path.join(self.dir, "config.yaml")
        with open(cfg, "w") as f:
            f.write(config)
        env = dict(os.environ, FAKE_NVML_CONFIG=self.scenario)
        for k in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "NODE_NAME"):
            env.pop(k, None)
        self.log = open(os.path.join(self.dir, "exporter.log"), "w")
        self.child = subprocess.Popen(
            [args.binary, "--nvml.library", args.fake_nvml, "--config.file", cfg,
             "--web.listen-address", f"127.0.0.1:{self.port}", "--path.procfs", self.proc],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, env=env)

    def new_proc(self):
        self.next_pid += 1
        return (self.next_pid, random.randrange(1, 8) * 1_000_000_000)

    def write_proc(self, pid, gpu):
        """A /proc entry for a fake pid: the job of GPU `gpu` is one user's
        (uid 2000 + gpu), so workload mode has a workload per GPU."""
        d = os.path.join(self.proc, str(pid))
        os.makedirs(d, exist_ok=True)
        uid = 2000 + gpu
        files = {"comm": "python3\n", "cmdline": "python3\0train.py\0",
                 "stat": f"{pid} (python3) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {1000 + pid}\n",
                 "status": f"Name:\tpython3\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n",
                 "cgroup": f"0::/user.slice/user-{uid}.slice\n"}
        for name, text in files.items():
            with open(os.path.join(d, name), "w") as f:
                f.write(text)

    def churn_one(self):
        g = random.randrange(len(self.gpus))
        i = random.randrange(len(self.gpus[g]))
        old = self.gpus[g][i][0]
        self.gpus[g][i] = self.new_proc()
        self.write_proc(self.gpus[g][i][0], g)
        self.write()
        shutil.rmtree(os.path.join(self.proc, str(old)), ignore_errors=True)

    def write(self):
        out = ["devices:"]
        for g, procs in enumerate(self.gpus):
            used = sum(u for _, u in procs)
            out.append(f"  - uuid: GPU-{self.i:08x}-{g:04x}-0000-0000-000000000000")
            out.append(f"    memory: {{total: {TOTAL}, reserved: 536870912, used: {used}}}")
            out.append("    processes:")
            out.extend(f"      - {{pid: {pid}, used: {u}}}" for pid, u in procs)
        tmp = self.scenario + ".tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(out) + "\n")
        os.rename(tmp, self.scenario)

    def stop(self):
        if self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)
            try:
                self.child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
        self.log.close()


def churn(nodes, per_hour, stop):
    """Replace processes at per_hour per node, spread over time."""
    rate = per_hour / 3600.0 * len(nodes)
    debt = 0.0
    last = time.time()
    while not stop.is_set():
        time.sleep(0.2)
        now = time.time()
        debt += (now - last) * rate
        last = now
        while debt >= 1.0:
            random.choice(nodes).churn_one()
            debt -= 1.0


# ------------------------------------------------------------------ stand-ins


def listeners(n):
    """n listening loopback sockets on ports the kernel picks."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        s.setblocking(False)
        socks.append(s)
    return socks


def serve_standins(socks, body, ready):
    """One asyncio loop answering every socket with `body` (text format)."""
    head = (f"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()

    async def handle(reader, writer):
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                writer.write(head + body)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def main():
        servers = [await asyncio.start_server(handle, sock=s) for s in socks]
        ready.set()
        await asyncio.gather(*(s.serve_forever() for s in servers))

    asyncio.run(main())


# ------------------------------------------------------------------ VictoriaMetrics


class Stack:
    """VictoriaMetrics and vmagent scraping `targets`; stopped by stop()."""

    def __init__(self, base, targets, interval):
        self.dir = base
        self.vm_port, self.agent_port = free_port(), free_port()
        self.storage = os.path.join(base, "vm-data")
        self.vm = subprocess.Popen(
            ["victoria-metrics", f"-storageDataPath={self.storage}",
             f"-httpListenAddr=127.0.0.1:{self.vm_port}", "-retentionPeriod=1",
             "-search.latencyOffset=5s", "-loggerLevel=WARN",
             "-search.maxUniqueTimeseries=10000000"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(base, "vm.log"), "w"))
        self.url = f"http://127.0.0.1:{self.vm_port}"
        wait_http(self.url + "/health", "victoria-metrics")
        # The hosts job of deploy/fleet/vmagent.yml, its targets replaced.
        cfg = {
            "global": {"scrape_interval": f"{interval}s", "scrape_timeout": f"{min(interval, 10)}s"},
            "scrape_configs": [{
                "job_name": "gpumem-exporter-hosts",
                "static_configs": [{"targets": targets}],
                "relabel_configs": [{"target_label": "job", "replacement": "gpumem-exporter"}],
            }],
        }
        path = os.path.join(base, "vmagent.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        self.agent = subprocess.Popen(
            ["vmagent", f"-promscrape.config={path}", f"-remoteWrite.url={self.url}/api/v1/write",
             f"-remoteWrite.tmpDataPath={os.path.join(base, 'vmagent-buffer')}",
             f"-httpListenAddr=127.0.0.1:{self.agent_port}", "-loggerLevel=WARN",
             "-promscrape.maxScrapeSize=64MB"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(base, "vmagent.log"), "w"))
        wait_http(f"http://127.0.0.1:{self.agent_port}/health", "vmagent")
        # vmalert with the shipped rules at the scrape interval (the hourly
        # accounting tiles keep their own interval), its alerts dropped:
        # the recorded rollups the dashboard reads exist, and the rules'
        # own query cost is measured.
        self.alert_port, self.sink_port = free_port(), None
        self.sink = socket.socket()
        self.sink.bind(("127.0.0.1", 0))
        self.sink.listen(64)
        self.sink_port = self.sink.getsockname()[1]
        threading.Thread(target=accept_and_ok, args=(self.sink,), daemon=True).start()
        self.alert = subprocess.Popen(
            ["vmalert", f"-rule={os.path.join(REPO, 'deploy', 'prometheus', 'rules.yml')}",
             f"-datasource.url={self.url}", f"-remoteWrite.url={self.url}",
             f"-notifier.url=http://127.0.0.1:{self.sink_port}", f"-evaluationInterval={interval}s",
             f"-httpListenAddr=127.0.0.1:{self.alert_port}", "-loggerLevel=WARN"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(base, "vmalert.log"), "w"))
        wait_http(f"http://127.0.0.1:{self.alert_port}/health", "vmalert")

    def query(self, expr, **params):
        q = urllib.parse.urlencode(dict(query=expr, **params))
        path = "/api/v1/query_range" if "start" in params else "/api/v1/query"
        t0 = time.perf_counter()
        v = json.loads(get(f"{self.url}{path}?{q}", timeout=120))
        took = time.perf_counter() - t0
        if v.get("status") != "success":
            raise RuntimeError(f"{expr}: {v}")
        return v["data"]["result"], took

    def scalar(self, expr):
        r, _ = self.query(expr)
        return float(r[0]["value"][1]) if r else 0.0

    def vm_metric(self, name):
        text = get(self.url + "/metrics").decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and (len(line) > len(name) and line[len(name)] in " {"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def flush(self):
        get(self.url + "/internal/force_flush")

    def sizes(self):
        self.flush()
        time.sleep(1)
        return {"data": du(os.path.join(self.storage, "data")),
                "index": du(os.path.join(self.storage, "indexdb")),
                "total": du(self.storage)}

    def cpu(self):
        return {"vm": cpu_seconds(self.vm.pid), "vmagent": cpu_seconds(self.agent.pid),
                "vmalert": cpu_seconds(self.alert.pid)}

    def rule_seconds(self):
        """The slowest rule evaluations vmalert reports (its last one each)."""
        groups = json.loads(get(f"http://127.0.0.1:{self.alert_port}/api/v1/rules"))["data"]["groups"]
        rules = [(r.get("evaluationTime", 0.0), r["name"], r.get("lastError", ""))
                 for g in groups for r in g["rules"]]
        rules.sort(reverse=True)
        return {"sum_s": sum(t for t, _, _ in rules), "slowest": rules[:5],
                "errors": [(n, e) for _, n, e in rules if e]}

    def stop(self):
        for p in (self.alert, self.agent, self.vm):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in (self.alert, self.agent, self.vm):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def accept_and_ok(sock):
    """A notifier that takes vmalert's alerts and drops them."""
    while True:
        conn, _ = sock.accept()
        try:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            m = re.search(rb"(?i)content-length: *(\d+)", head)
            want = int(m.group(1)) if m else 0
            while len(body) < want:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                body += chunk
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        except OSError:
            pass
        finally:
            conn.close()


def panel_queries(rate_interval):
    with open(os.path.join(REPO, "grafana", "gpumem-exporter.json")) as f:
        dash = json.load(f)
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                e = t.get("expr")
                if e:
                    out.append((f"{p.get('title', '?')} [{t.get('refId', '?')}]", e))
            walk(p.get("panels", []))

    walk(dash["panels"])
    subst = []
    for title, e in out:
        e = e.replace("$__rate_interval", rate_interval).replace("${__rate_interval}", rate_interval)
        e = re.sub(r"\$\{?[A-Za-z_]+\}?", ".*", e)
        subst.append((title, e))
    return subst


def time_queries(stack, window_start, window_end, step):
    rows = []
    for title, expr in panel_queries(f"{4 * step}s"):
        inst, rng, n_series, err = [], [], 0, None
        for _ in range(3):
            try:
                r, t = stack.query(expr, time=window_end)
                inst.append(t)
                n_series = len(r)
                _, t = stack.query(expr, start=window_start, end=window_end, step=f"{step}s")
                rng.append(t)
            except Exception as e:  # a failing query is a result too
                err = str(e)[:200]
                break
        rows.append({"panel": title, "series": n_series,
                     "instant_s": statistics.median(inst) if inst else None,
                     "range_s": statistics.median(rng) if rng else None, "error": err})
    rows.sort(key=lambda r: -(r["range_s"] or 0))
    return rows


def measure(stack, n, interval, warmup, window, churn_expected):
    """The figures of one phase, per node (n targets)."""
    time.sleep(warmup)
    t0 = time.time()
    created0 = stack.vm_metric("vm_new_timeseries_created_total")
    rows0 = stack.vm_metric("vm_rows_inserted_total")
    size0 = stack.sizes()
    cpu0 = stack.cpu()
    time.sleep(window)
    t1 = time.time()
    created1 = stack.vm_metric("vm_new_timeseries_created_total")
    rows1 = stack.vm_metric("vm_rows_inserted_total")
    size1 = stack.sizes()
    cpu1 = stack.cpu()
    dt = t1 - t0
    scraped = stack.scalar('sum(scrape_samples_scraped{job="gpumem-exporter"})')
    active = stack.scalar('count({job="gpumem-exporter"})')
    up = stack.scalar('sum(up{job="gpumem-exporter"})')
    per_node_samples_s = scraped / n / interval
    created_h = (created1 - created0) / dt * 3600 / n
    r = {
        "targets": n, "targets_up": up, "window_s": round(dt, 1),
        "samples_per_scrape_per_node": scraped / n,
        "samples_per_s_per_node": per_node_samples_s,
        "active_series_per_node": active / n,
        "rows_inserted_per_s_total": (rows1 - rows0) / dt,
        "series_created_per_h_per_node": created_h,
        "churn_processes_per_h_per_node": churn_expected,
        "disk_growth_bytes_per_node_day": {k: (size1[k] - size0[k]) / dt * 86400 / n for k in size1},
        "cpu_cores": {k: (cpu1[k] - cpu0[k]) / dt for k in cpu1},
        "rss_mib": {"vm": rss_mib(stack.vm.pid), "vmagent": rss_mib(stack.agent.pid)},
    }
    # (b): merged parts.
    try:
        get(stack.url + "/internal/force_merge", timeout=300)
    except Exception:
        pass
    time.sleep(5)
    merged = stack.sizes()
    rows_total = stack.vm_metric("vm_rows_inserted_total")
    created_total = stack.vm_metric("vm_new_timeseries_created_total")
    bps = merged["data"] / max(rows_total, 1)
    ips = merged["index"] / max(created_total, 1)
    r["merged"] = {
        "data_bytes": merged["data"], "index_bytes": merged["index"],
        "rows_total": rows_total, "series_created_total": created_total,
        "data_bytes_per_sample": bps, "index_bytes_per_series": ips,
        "bytes_per_node_day": bps * per_node_samples_s * 86400 + ips * (created_h * 24),
    }
    r["queries"] = time_queries(stack, t0, t1, interval)
    r["rules"] = stack.rule_seconds()
    return r


# ------------------------------------------------------------------ report


def fmt(v, nd=1):
    if v is None:
        return "-"
    if isinstance(v, float) and v != v:
        return "nan"
    if abs(v) >= 1e9:
        return f"{v / 1e9:.{nd}f} G"
    if abs(v) >= 1e6:
        return f"{v / 1e6:.{nd}f} M"
    if abs(v) >= 1e4:
        return f"{v / 1e3:.{nd}f} k"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def render(res):
    a = res["args"]
    out = [f"Fleet simulation: {a['nodes']} exporters × {a['gpus']} GPUs × {a['procs']} processes, "
           f"mode {a['mode']}, churn {a['churn_per_hour']:.0f} processes/h/node, "
           f"scrape {a['scrape_interval']} s, exporter sample interval {a['sample_interval']}\n"]
    for name in ("fleet", "standins"):
        r = res.get(name)
        if not r:
            continue
        out.append(f"\n### {name}: {r['targets']} targets ({r['targets_up']:.0f} up), window {r['window_s']} s\n")
        out.append("| per node | value |\n|---|---|")
        rows = [
            ("samples per scrape", fmt(r["samples_per_scrape_per_node"])),
            ("samples per second", fmt(r["samples_per_s_per_node"])),
            ("active series", fmt(r["active_series_per_node"])),
            ("series created per hour", fmt(r["series_created_per_h_per_node"])),
            ("disk growth per day, `du` after flush (a)", fmt(r["disk_growth_bytes_per_node_day"]["total"]) + "B"),
            ("disk per day, merged: data B/sample × samples + index B/series × series (b)",
             fmt(r["merged"]["bytes_per_node_day"]) + "B"),
        ]
        out += [f"| {k} | {v} |" for k, v in rows]
        m = r["merged"]
        out.append(f"\nVictoriaMetrics: {fmt(r['rows_inserted_per_s_total'])} rows/s in, "
                   f"{r['cpu_cores']['vm']:.2f} cores, vmagent {r['cpu_cores']['vmagent']:.2f} cores; "
                   f"RSS VM {r['rss_mib']['vm']:.0f} MiB, vmagent {r['rss_mib']['vmagent']:.0f} MiB; merged: "
                   f"{m['data_bytes_per_sample']:.2f} B/sample, {m['index_bytes_per_series']:.0f} B/series created\n")
        out.append("| slowest panel queries (median of 3) | series | instant s | range s (window, step = scrape) |\n|---|---|---|---|")
        for q in r["queries"][:6]:
            out.append(f"| {q['panel']} | {q['series']} | {fmt(q['instant_s'], 3)} | {fmt(q['range_s'], 3)} |"
                       + (f" error: {q['error']}" if q["error"] else ""))
        errs = [q for q in r["queries"] if q["error"]]
        out.append(f"\n{len(r['queries'])} panel queries timed, {len(errs)} failed.")
        ru = r["rules"]
        out.append(f"vmalert: {r['cpu_cores']['vmalert']:.2f} cores; one evaluation of every rule took "
                   f"{ru['sum_s']:.2f} s in all; slowest: "
                   + ", ".join(f"{n} {t:.3f} s" for t, n, _ in ru["slowest"])
                   + (f"; errors: {ru['errors']}" if ru["errors"] else ""))
    return "\n".join(out) + "\n"


def main():
    args = parse_args()
    for tool in ("victoria-metrics", "vmagent"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is not on PATH: apt-get install -y victoria-metrics")
    out = args.out or tempfile.mkdtemp(prefix="fleet-bench-out-")
    os.makedirs(out, exist_ok=True)
    base = tempfile.mkdtemp(prefix="fleet-bench-")
    res = {"args": vars(args)}
    nodes, stack, stop = [], None, threading.Event()
    try:
        for i in range(args.nodes):
            nodes.append(Node(i, args, base))
        for n in nodes:
            wait_http(f"http://127.0.0.1:{n.port}/metrics", f"exporter {n.i} (log {n.dir}/exporter.log)")
        print(f"{len(nodes)} exporters up", file=sys.stderr)
        threading.Thread(target=churn, args=(nodes, args.churn_per_hour, stop), daemon=True).start()
        os.makedirs(os.path.join(base, "fleet"))
        stack = Stack(os.path.join(base, "fleet"), [f"127.0.0.1:{n.port}" for n in nodes], args.scrape_interval)
        exporters_cpu0 = sum(cpu_seconds(n.child.pid) for n in nodes)
        t0 = time.time()
        res["fleet"] = measure(stack, len(nodes), args.scrape_interval, args.warmup, args.window,
                               args.churn_per_hour)
        res["fleet"]["exporter_cpu_cores_each"] = (
            (sum(cpu_seconds(n.child.pid) for n in nodes) - exporters_cpu0) / (time.time() - t0) / len(nodes))
        res["fleet"]["exporter_rss_mib_each"] = statistics.median(rss_mib(n.child.pid) for n in nodes)
        body = get(f"http://127.0.0.1:{nodes[0].port}/metrics")
        stop.set()
        stack.stop()
        for n in nodes:
            n.stop()
        nodes = []
        print(render(res), file=sys.stderr)
        if args.standins:
            socks = listeners(args.standins)
            ports = [s.getsockname()[1] for s in socks]
            ready = threading.Event()
            threading.Thread(target=serve_standins, args=(socks, body, ready), daemon=True).start()
            if not ready.wait(60):
                sys.exit("the stand-in server did not start")
            os.makedirs(os.path.join(base, "standins"))
            stack = Stack(os.path.join(base, "standins"), [f"127.0.0.1:{p}" for p in ports],
                          args.scrape_interval)
            res["standins"] = measure(stack, args.standins, args.scrape_interval, args.standin_warmup,
                                      args.standin_window, 0)
            res["standins"]["body_bytes"] = len(body)
            stack.stop()
            stack = None
    finally:
        stop.set()
        if stack:
            stack.stop()
        for n in nodes:
            n.stop()
        shutil.rmtree(base, ignore_errors=True)
    text = render(res)
    with open(os.path.join(out, "fleet.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "fleet.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(text)
    print(f"(raw: {out}/fleet.json)", file=sys.stderr)


if __name__ == "__main__":
    main()
