"""gpumem-exporter (this build and an earlier one) beside nvitop-exporter and
all-smi on a real GPU host, in one run (see scripts/bench/peers, which runs it).

  1. The NVML floor: RSS of benches/tools/nvml_floor.rs (a Rust process that
     opens NVML and reads one GPU), idle.
  2. Two torch processes hold GPU memory for the whole run (so every exporter
     has processes to report).
  3. Every exporter runs at its defaults, side by side. After a warm-up:
     RSS (VmRSS, VmHWM), then CPU over one idle window in which nobody
     scrapes (all at once), then scrape latency one exporter at a time: R
     rounds of N request pairs, each pair one request to the exporter's
     endpoint and one to /healthz of the same build of ours (the client
     floor: a request that encodes nothing), interleaved, a new connection
     each (as Prometheus does when keep-alive is off; the client's own cost
     is the same on both sides). p50 and p99 per endpoint, pooled over the
     rounds, with each round's ratio to the floor.
  4. /api/v1/snapshot at 8 GPUs x 256 processes on the fake NVML (both builds
     of ours), interleaved with /healthz the same way.

Markdown to stdout and $OUT/peers.md (raw JSON in $OUT/peers.json, each
exporter's log and last body beside). Standard library only (torch in the
holders). Exit 1 if an exporter does not start.
"""

import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import h200  # noqa: E402  (the bench helpers: pct, free_port, get, proc_status, cpu_seconds)

from h200 import cpu_seconds, free_port, get, pct, proc_status  # noqa: E402
from h200 import scenario as bare_scenario  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ours", default=".dev/gpumem-exporter", help="this build of gpumem-exporter")
    p.add_argument("--before", default=".dev/gpumem-exporter-before", help="the earlier build ('' to skip)")
    p.add_argument("--nvitop-site", default="/tmp/site", help="nvitop and nvitop_exporter (PYTHONPATH of that process)")
    p.add_argument("--all-smi", default=".dev/allsmi/all-smi", help="all-smi binary ('' to skip)")
    p.add_argument("--all-smi-lib", default=".dev/allsmi/lib", help="its non-system libraries (LD_LIBRARY_PATH)")
    p.add_argument("--floor", default=".dev/nvml_floor", help="the nvml_floor example binary")
    p.add_argument("--fake-lib", default=".dev/libfake_nvml.so", help="the fake NVML for the 8 x 256 phase ('' to skip)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--pairs", type=int, default=300, help="request pairs per round")
    p.add_argument("--idle", type=float, default=30.0, help="idle CPU window (s)")
    p.add_argument("--warm", type=float, default=10.0, help="warm-up before measuring (s)")
    p.add_argument("--hold-gib", default="4,2", help="GiB the two torch processes hold")
    p.add_argument("--fake-only", action="store_true",
                   help="only the fake-NVML phase (no GPU needed: checks the script on any machine)")
    p.add_argument("--out", default=os.environ.get("OUT") or None)
    a = p.parse_args(argv)
    if a.rounds < 1 or a.pairs < 10 or a.idle <= 0:
        p.error("need --rounds >= 1, --pairs >= 10, --idle > 0")
    return a


class Proc:
    def __init__(self, name, argv, env, ready, outdir):
        self.name, self.argv, self.env, self.ready, self.outdir = name, argv, env, ready, outdir
        self.port = free_port()
        self.proc = None

    def start(self, timeout=90):
        log = open(os.path.join(self.outdir, f"{self.name}.log"), "w") if self.outdir else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv(self.port), env=self.env, stdout=log, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before serving")
            try:
                _, status, body = get(self.port, "/metrics")
                if status == 200 and self.ready(body):
                    return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.name}: no good /metrics within {timeout} s")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def interleaved(port, path, floor_port, rounds, pairs):
    """Pooled and per-round p50/p99 of `path` and of the floor (/healthz)."""
    out = {"rounds": [], "bytes": 0}
    all_m, all_h = [], []
    for _ in range(rounds):
        m, h = [], []
        for i in range(pairs):
            # Alternate which goes first, so neither always follows the other.
            order = [(path, port, m), ("/healthz", floor_port, h)]
            for p, po, acc in (order if i % 2 == 0 else order[::-1]):
                ms, status, body = get(po, p)
                if status != 200:
                    raise RuntimeError(f"GET {p} on {po}: HTTP {status}")
                acc.append(ms)
                if acc is m:
                    out["bytes"] = len(body)
        all_m += m
        all_h += h
        out["rounds"].append({"p50": pct(m, 50), "p99": pct(m, 99), "floor_p50": pct(h, 50), "floor_p99": pct(h, 99)})
    out.update(p50=pct(all_m, 50), p99=pct(all_m, 99), floor_p50=pct(all_h, 50), floor_p99=pct(all_h, 99))
    return out


def families(body):
    text = body.decode("utf-8", errors="replace")
    return len(re.findall(r"^# TYPE ", text, flags=re.M))


def holders(gib_list, outdir):
    code = (
        "import sys, time, torch\n"
        "x = torch.empty(int(float(sys.argv[1]) * (1 << 30)), dtype=torch.uint8, device='cuda')\n"
        "x.fill_(1); torch.cuda.synchronize(); print('holding', flush=True)\n"
        "time.sleep(3600)\n"
    )
    procs = []
    for gib in gib_list:
        p = subprocess.Popen([sys.executable, "-c", code, gib], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(p)
    for p in procs:
        line = p.stdout.readline().strip()
        if line != "holding":
            raise RuntimeError(f"torch holder failed: {line!r}")
    return procs


def floor_rss(binary):
    r = subprocess.run([binary, "3"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"nvml_floor failed: {r.stderr.strip()}")
    idle = [l for l in r.stdout.splitlines() if l.startswith("idle:")]
    m = re.search(r"rss_kib=(\d+) hwm_kib=(\d+)", idle[-1] if idle else "")
    if not m:
        raise RuntimeError(f"nvml_floor printed {r.stdout!r}")
    return int(m.group(1)) / 1024, int(m.group(2)) / 1024


def fake_phase(args, builds, outdir, report):
    """8 GPUs x 256 processes on the fake NVML: /api/v1/snapshot and
    /metrics against /healthz, per build of ours."""
    sleepers = [subprocess.Popen(["sleep", "3600"]) for _ in range(256)]
    try:
        scenario = bare_scenario([p.pid for p in sleepers])
        env = dict(os.environ, FAKE_NVML_CONFIG=scenario)
        for name, binary in builds:
            e = Proc(f"fake-{name}", lambda port, b=binary: [b, "--nvml.library", args.fake_lib,
                                                              "--web.listen-address", f"127.0.0.1:{port}"],
                     env, lambda body: b"gpu_process_memory_used_bytes{" in body, outdir)
            e.start()
            try:
                time.sleep(args.warm / 2)
                r = {}
                for path in ("/api/v1/snapshot", "/metrics"):
                    r[path] = interleaved(e.port, path, e.port, args.rounds, args.pairs // 2)
                r["rss_mib"] = proc_status(e.proc.pid)[1]
                report["fake"][name] = r
            finally:
                e.stop()
        os.unlink(scenario)
    finally:
        for s in sleepers:
            s.kill()
        for s in sleepers:
            s.wait()


def f(v, nd=3):
    return "—" if v is None or v != v else f"{v:.{nd}f}"


def render(r):
    out = ["# Peers on one GPU host, one run", ""]
    out.append(f"Host: {r['host']}; GPUs: {r['gpus']}; two torch processes holding {r['hold_gib']} GiB; "
               f"{r['rounds']} rounds x {r['pairs']} interleaved request pairs, a new connection each.")
    out.append("")
    out.append(f"NVML floor (benches/tools/nvml_floor.rs, idle): **RSS {f(r['floor'][0], 1)} MiB** (HWM {f(r['floor'][1], 1)} MiB)")
    out.append("")
    out.append("| exporter | /metrics p50 ms | p99 ms | floor p50 / p99 ms | p50 ratio | p99 ratio | per-round p99 ratios | body bytes | families | idle CPU % of a core | RSS MiB (HWM) |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, e in r["exporters"].items():
        m = e["metrics"]
        rr = ", ".join(f(x["p99"] / x["floor_p99"], 2) for x in m["rounds"])
        out.append(f"| {e['label']} | {f(m['p50'])} | {f(m['p99'])} | {f(m['floor_p50'])} / {f(m['floor_p99'])} | "
                   f"{f(m['p50'] / m['floor_p50'], 2)} | {f(m['p99'] / m['floor_p99'], 2)} | {rr} | {m['bytes']} | "
                   f"{e['families']} | {f(e['idle_cpu_pct'])} | {f(e['rss'][1], 1)} ({f(e['rss'][0], 1)}) |")
    out.append("")
    ours = [n for n in r["exporters"] if "endpoints" in r["exporters"][n]]
    if ours:
        out.append("Our other endpoints (same interleaving, floor = /healthz):")
        out.append("")
        out.append("| build | endpoint | p50 ms | p99 ms | p50 ratio | p99 ratio | bytes |")
        out.append("|---|---|---|---|---|---|---|")
        for n in ours:
            for path, m in r["exporters"][n]["endpoints"].items():
                out.append(f"| {r['exporters'][n]['label']} | {path} | {f(m['p50'])} | {f(m['p99'])} | "
                           f"{f(m['p50'] / m['floor_p50'], 2)} | {f(m['p99'] / m['floor_p99'], 2)} | {m['bytes']} |")
        out.append("")
    if r.get("fake"):
        out.append("8 GPUs x 256 processes on the fake NVML (same host):")
        out.append("")
        out.append("| build | endpoint | p50 ms | p99 ms | floor p50 / p99 ms | p50 ratio | p99 ratio | bytes | RSS MiB |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for n, e in r["fake"].items():
            for path in ("/api/v1/snapshot", "/metrics"):
                m = e[path]
                out.append(f"| {n} | {path} | {f(m['p50'])} | {f(m['p99'])} | {f(m['floor_p50'])} / {f(m['floor_p99'])} | "
                           f"{f(m['p50'] / m['floor_p50'], 2)} | {f(m['p99'] / m['floor_p99'], 2)} | {m['bytes']} | {f(e['rss_mib'], 1)} |")
        out.append("")
    return "\n".join(out)


def main():
    args = parse_args()
    outdir = args.out
    if outdir:
        os.makedirs(outdir, exist_ok=True)
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip().replace("\n", "; ")
    except OSError:
        gpus = "none (no nvidia-smi)"
    report = {"host": os.uname().nodename, "gpus": gpus, "rounds": args.rounds, "pairs": args.pairs,
              "hold_gib": args.hold_gib, "exporters": {}, "fake": {}}
    if args.fake_only:
        report["floor"] = (float("nan"), float("nan"))
        builds = [("ours", args.ours)] + ([("ours-before", args.before)] if args.before else [])
        fake_phase(args, builds, outdir, report)
        print(render(report))
        return
    report["floor"] = floor_rss(args.floor)
    held = holders(args.hold_gib.split(","), outdir)
    exporters = []
    ours_ready = lambda body: b"gpu_process_memory_used_bytes{" in body  # noqa: E731
    exporters.append(("ours", "gpumem-exporter (this build)",
                      Proc("ours", lambda port: [args.ours, "--web.listen-address", f"127.0.0.1:{port}"],
                           dict(os.environ), ours_ready, outdir)))
    exporters.append(("ours-pu", "gpumem-exporter (this build) --collector.process_utilization",
                      Proc("ours-pu", lambda port: [args.ours, "--web.listen-address", f"127.0.0.1:{port}",
                                                    "--collector.process_utilization"],
                           dict(os.environ), ours_ready, outdir)))
    if args.before:
        exporters.append(("ours-before", "gpumem-exporter (before)",
                          Proc("ours-before", lambda port: [args.before, "--web.listen-address", f"127.0.0.1:{port}"],
                               dict(os.environ), ours_ready, outdir)))
    site_env = dict(os.environ)
    site_env["PYTHONPATH"] = args.nvitop_site + (os.pathsep + site_env["PYTHONPATH"] if site_env.get("PYTHONPATH") else "")
    exporters.append(("nvitop", "nvitop-exporter 1.7.2",
                      Proc("nvitop", lambda port: [sys.executable, "-m", "nvitop_exporter", "--bind-address", "127.0.0.1",
                                                   "--port", str(port)], site_env,
                           lambda body: b"gpu_memory_used_MiB{" in body, outdir)))
    if args.all_smi:
        env = dict(os.environ, LD_LIBRARY_PATH=os.path.abspath(args.all_smi_lib))
        exporters.append(("all-smi", "all-smi 0.22.0 (api)",
                          Proc("all-smi", lambda port: [args.all_smi, "api", "--port", str(port)], env,
                               lambda body: b"memory" in body and len(body) > 1000, outdir)))
        exporters.append(("all-smi-processes", "all-smi 0.22.0 (api --processes)",
                          Proc("all-smi-processes",
                               lambda port: [args.all_smi, "api", "--port", str(port), "--processes"], env,
                               lambda body: b"memory" in body and len(body) > 1000, outdir)))
    try:
        for _, _, e in exporters:
            e.start()
        time.sleep(args.warm)
        for name, label, e in exporters:
            report["exporters"][name] = {"label": label, "rss": proc_status(e.proc.pid)}
        before = {name: cpu_seconds(e.proc.pid)[1] for name, _, e in exporters}
        t0 = time.monotonic()
        time.sleep(args.idle)
        wall = time.monotonic() - t0
        for name, _, e in exporters:
            report["exporters"][name]["idle_cpu_pct"] = (cpu_seconds(e.proc.pid)[1] - before[name]) / wall * 100
        floor_of = {"ours": "ours", "ours-pu": "ours-pu", "ours-before": "ours-before"}
        ports = {name: e.port for name, _, e in exporters}
        for name, _, e in exporters:
            floor_port = ports[floor_of.get(name, "ours")]
            m = interleaved(e.port, "/metrics", floor_port, args.rounds, args.pairs)
            rep = report["exporters"][name]
            rep["metrics"] = m
            _, _, body = get(e.port, "/metrics")
            rep["families"] = families(body)
            if outdir:
                with open(os.path.join(outdir, f"{name}-metrics.txt"), "wb") as fh:
                    fh.write(body)
            if name in ("ours", "ours-before"):
                rep["endpoints"] = {p: interleaved(e.port, p, e.port, args.rounds, args.pairs // 2)
                                    for p in ("/api/v1/snapshot", "/")}
            rep["rss_after"] = proc_status(e.proc.pid)
    finally:
        for _, _, e in exporters:
            e.stop()
        for h in held:
            h.kill()
            h.wait()
    if args.fake_lib:
        builds = [("ours", args.ours)] + ([("ours-before", args.before)] if args.before else [])
        fake_phase(args, builds, outdir, report)
    md = render(report)
    print(md)
    if outdir:
        with open(os.path.join(outdir, "peers.md"), "w") as fh:
            fh.write(md + "\n")
        with open(os.path.join(outdir, "peers.json"), "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    h200.OUTDIR = None
    main()
