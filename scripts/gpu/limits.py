#!/usr/bin/env python3
"""Real-GPU check of per-workload memory limits (GPU 0), about 2 minutes:

    python3 scripts/gpu/limits.py [path/to/gpumem-exporter]   # default .dev/gpumem-exporter
    OUT=DIR STEADY=60 RATE_MIB=1024 FRACTION=0.25 python3 scripts/gpu/limits.py

1. The driver's per-cgroup limits: whether this driver's libnvidia-ml has
   `nvmlDeviceGetMemoryLimits_v1` (dlsym), and what the exporter says
   (`gpumem_exporter_limit_sources{source="driver"}`: 1 with the call, 0
   without); no `memory_limits` NVML error may be counted either way.
2. torch's own limit: a child torch process (the torch bridge on, so its
   figures reach the exporter; as root, moved into a root-owned cgroup
   `system.slice/docker-<64 hex>.scope` so that it is a container
   workload, where the cgroup v2 hierarchy is writable) sets
   `torch.cuda.set_per_process_memory_fraction(FRACTION)`, holds 2 GiB for
   STEADY s, then grows by RATE_MIB MiB a second until torch raises OOM.
   Checked: `gpu_process_torch_memory_limit_bytes` equals FRACTION x the
   GPU's total as torch computes it; where the child is a container,
   `gpu_workload_memory_limit_bytes{source="torch",kind="hard"}` equals it
   too; the limit forecast (`gpu_workload_memory_limit_in_seconds`, else
   `gpu_process_torch_limit_in_seconds`) read at half way is within 15 %
   of when the OOM came; the OOM came with reserved within 2 % of the
   limit (or one step of it) while most of the GPU was free.
Prints PASS/FAIL lines and a summary; exits 1 if a check fails, 124 past
the time limit. Needs an NVIDIA GPU, python3 with torch and nvidia-ml-py.
"""
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time

import gpucheck
from gpucheck import check, scrape, series

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = gpucheck.exporter(".dev/gpumem-exporter")
PORT = int(os.environ.get("LIMITS_PORT", "19887"))
STEADY = float(os.environ.get("STEADY", "60"))
RATE_MIB = int(os.environ.get("RATE_MIB", "1024"))
FRACTION = float(os.environ.get("FRACTION", "0.25"))
GIB = 1 << 30
MIB = 1 << 20

if os.environ.get("OUT"):
    gpucheck.report_to(os.path.join(os.environ["OUT"], "limits.txt"))
gpucheck.time_limit(int(STEADY) + 200)

CHILD = r'''
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import torch, gpumem_bridge
fraction, steady, rate = float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
torch.cuda.init()
gpumem_bridge.start()
torch.cuda.set_per_process_memory_fraction(fraction, 0)
total = torch.cuda.get_device_properties(0).total_memory
def say(**kw):
    kw["t"] = time.time()
    kw["reserved"] = torch.cuda.memory_reserved(0)
    print(json.dumps(kw), flush=True)
say(event="start", total=total, limit=int(fraction * total))
hold = [torch.empty(2 << 30, dtype=torch.uint8, device="cuda")]
say(event="steady")
time.sleep(steady)
say(event="grow")
step = rate // 4
while True:
    t0 = time.time()
    try:
        hold.append(torch.empty(step, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError:
        say(event="oom", step=step)
        break
    time.sleep(max(0.0, 0.25 - (time.time() - t0)))
time.sleep(3)
say(event="end")
'''


def driver_has_the_call():
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        return None, str(e)
    try:
        getattr(lib, "nvmlDeviceGetMemoryLimits_v1")
        return True, "dlsym found nvmlDeviceGetMemoryLimits_v1"
    except AttributeError:
        return False, "dlsym: no nvmlDeviceGetMemoryLimits_v1 in libnvidia-ml.so.1"


def into_container_cgroup(pid):
    """Move `pid` into a root-owned cgroup named as Docker names a
    container's scope; the container id, or None where not possible."""
    top = "/sys/fs/cgroup"
    if not os.path.exists(os.path.join(top, "cgroup.controllers")) or os.geteuid() != 0:
        return None
    cid = os.urandom(32).hex()
    d = os.path.join(top, "system.slice", f"docker-{cid}.scope")
    try:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        return cid
    except OSError as e:
        print(f"note: no container cgroup ({e}): the torch limit is checked per process only")
        return None


def first(text, name, **labels):
    for ls, v in series(text, name):
        if all(ls.get(k) == val for k, val in labels.items()):
            return v
    return None


def main():
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    driver = pynvml.nvmlSystemGetDriverVersion()
    has, how = driver_has_the_call()
    print(f"driver {driver}: {how}")
    work = tempfile.mkdtemp(prefix="gpumem-limits-")
    sock = os.path.join(work, "bridge.sock")
    with open(os.path.join(work, "config.yaml"), "w") as f:
        f.write(f"processes:\n  torch_bridge_socket: {sock}\nlimits:\n  interval: 1s\n")
    log = open(os.path.join(work, "exporter.log"), "w+")
    ex = subprocess.Popen(
        [BIN, "--config.file", os.path.join(work, "config.yaml"),
         "--web.listen-address", f"127.0.0.1:{PORT}", "--sample-interval", "500ms"],
        stderr=log)
    child = None
    try:
        for _ in range(500):
            try:
                scrape(PORT)
                break
            except Exception:
                time.sleep(0.02)
        env = dict(os.environ, GPUMEM_BRIDGE_SOCKET=sock)
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, os.path.join(HERE, "..", "..", "python"),
             str(FRACTION), str(STEADY), str(RATE_MIB * MIB)],
            stdout=subprocess.PIPE, text=True, env=env)
        cid = into_container_cgroup(child.pid)
        events = {}
        reads = []  # (time of the sample, reserved by the scrape, forecast, process limit, workload limit)
        os.set_blocking(child.stdout.fileno(), False)
        while child.poll() is None or "end" not in events:
            for line in iter(child.stdout.readline, ""):
                e = json.loads(line)
                events[e["event"]] = e
                print(f"child: {line.strip()}")
                if e["event"] == "oom":
                    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                    events["oom_nvml"] = {"used": mem.used, "free": mem.free, "total": mem.total}
            if child.poll() is not None and "end" not in events:
                break
            try:
                text = scrape(PORT)
            except Exception:
                time.sleep(0.25)
                continue
            pid = str(child.pid)
            ts = first(text, "gpumem_exporter_last_sample_timestamp_seconds")
            reserved = first(text, "gpu_process_torch_reserved_bytes", pid=pid)
            plimit = first(text, "gpu_process_torch_memory_limit_bytes", pid=pid)
            wl = first(text, "gpu_workload_memory_limit_bytes", source="torch", kind="hard",
                       container_id=cid) if cid else None
            wf = first(text, "gpu_workload_memory_limit_in_seconds", container_id=cid) if cid else None
            pf = first(text, "gpu_process_torch_limit_in_seconds", pid=pid)
            reads.append((ts, reserved, wf if wf is not None else pf, plimit, wl,
                          "workload" if wf is not None else "process"))
            last_text = text
            time.sleep(0.25)
        start = events.get("start", {})
        limit = start.get("limit")
        total = start.get("total")
        check("the driver call vs the exporter",
              first(last_text, "gpumem_exporter_limit_sources", source="driver") == (1.0 if has else 0.0),
              f"dlsym {has}; exporter gpumem_exporter_limit_sources{{source=\"driver\"}} = "
              f"{first(last_text, 'gpumem_exporter_limit_sources', source='driver')}")
        errs = [v for ls, v in series(last_text, "gpumem_exporter_nvml_errors_total")
                if ls.get("operation") == "memory_limits"]
        check("no memory_limits NVML error counted", not errs, f"{errs or 'none'}")
        plimits = {r[3] for r in reads if r[3] is not None}
        check("torch limit per process exact", plimits == {float(limit)},
              f"exported {sorted(plimits)} vs torch {limit} = {FRACTION} x {total}")
        if cid:
            wls = {r[4] for r in reads if r[4] is not None}
            check("torch limit of the container workload", wls == {float(limit)},
                  f"exported {sorted(wls)} vs {limit} (container {cid[:12]})")
        oom = events.get("oom")
        if not oom:
            check("torch raised OOM", False, f"events {sorted(events)}")
            return
        nv = events.get("oom_nvml", {})
        near = abs(oom["reserved"] - limit) <= max(0.02 * limit, oom["step"])
        check("OOM at the limit, most of the GPU free",
              near and nv.get("free", 0) > 0.5 * nv.get("total", 1),
              f"reserved {oom['reserved'] / GIB:.2f} GiB vs limit {limit / GIB:.2f} GiB; "
              f"NVML free {nv.get('free', 0) / GIB:.1f} of {nv.get('total', 0) / GIB:.1f} GiB")
        base = events["grow"]["reserved"]
        half = base + 0.5 * (limit - base)
        cands = [r for r in reads if r[0] and r[1] and r[1] >= half and r[0] < oom["t"] - 1]
        if not cands:
            check("limit forecast at half way", False, "no read at half way")
        else:
            r = cands[0]
            truth = oom["t"] - r[0]
            f = r[2]
            err = None if f is None else (f - truth) / truth
            check("limit forecast at half way within 15 %", err is not None and abs(err) <= 0.15,
                  f"{r[5]} forecast {f} s vs OOM {truth:.1f} s later "
                  f"({'—' if err is None else f'{err * 100:+.1f} %'}; reserved {r[1] / GIB:.2f} GiB)")
        steady_f = [r for r in reads if r[0] and r[0] < events["grow"]["t"] - 2 and r[2] is not None
                    and r[0] > events["steady"]["t"] + 5]
        check("no limit forecast while steady", not steady_f, f"{len(steady_f)} reads with one")
    finally:
        for p in (child, ex):
            if p and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        log.seek(0)
        print("exporter log (limits lines):")
        for line in log:
            if "limit" in line:
                print("  " + line.rstrip())


main()
print(f"\n{len(gpucheck.failures)} failed: {gpucheck.failures}" if gpucheck.failures else "\nall passed")
sys.exit(1 if gpucheck.failures else 0)
