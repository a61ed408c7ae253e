#!/usr/bin/env python3
"""Real-GPU check of the memory-time counters and `record`'s summary
(GPU-hours and GiB-hours accounting), about 110 s:

    python3 scripts/gpu/accounting.py [path/to/gpumem-exporter]   # default .dev/gpumem-exporter

1. The daemon (`--sample-interval 100ms`, so process lists are read at
   the memory-sample rate; `processes.byte_seconds: true`, so the
   per-process counter is served) and a torch process that starts CUDA, waits
   3 s (its context alone), holds 8 GiB for 30 s (times it itself), frees
   it and waits 3 s. Scraped before the 8 GiB and after it is freed, each
   scrape with its snapshot's time: the increase of
   `gpu_process_memory_used_byte_seconds_total` minus the context's bytes
   over the same span must be 8 GiB x the hold, 240 GiB.s, within 1 %;
   the GPU's `gpu_memory_used_byte_seconds_total` grows by at least as
   much; the process's workload total (its user) keeps its value after
   it exits.
2. `record -o run.csv -- python3 holder` (8 GiB for 8 s): the summary
   beside the recording names the holder; its peak equals nvidia-smi's
   used_memory for the pid, and GPU 0's peak nvidia-smi's memory.used,
   within 1 MiB, both read while it holds.
3. Busy time from NVML's utilisation samples: the daemon reading only
   every 5 s (`--sample-interval 5s`) and a torch process running bf16
   matmuls in 8 bursts of 1 s with 1.5 s idle between (it times each
   burst itself, synchronized): the increase of `gpu_busy_seconds_total`
   over the run must be the bursts' total within 5 % (a gauge held
   between 5 s reads would be off by whatever the reads happened to
   see), and the log must not say the GPU has no samples. Also the cost
   of `nvmlDeviceGetSamples` (pynvml, median of 200 calls).

Prints markdown, also to $OUT/gpu-accounting.md (OUT: a new temporary
folder when unset); exits 1 if a check fails, 124 past 170 s. Needs an
NVIDIA GPU, nvidia-smi and python3 with torch.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

import gpucheck
from gpucheck import check, failures, series

BIN = gpucheck.exporter(".dev/gpumem-exporter")
OUT = os.environ.get("OUT") or tempfile.mkdtemp()
PORT = int(os.environ.get("ACCOUNTING_PORT", "19879"))
GIB = 1 << 30
MIB = 1 << 20
HOLD_S = 30.0
gpucheck.time_limit(170)
gpucheck.report_to(os.path.join(OUT, "gpu-accounting.md"))

if not os.access(BIN, os.X_OK):
    sys.exit(f"exporter binary {BIN} not found or not executable (build it: cargo build --release)")

HOLDER = """
import os, sys, time, torch
hold = float(sys.argv[1]); before = float(sys.argv[2]); after = float(sys.argv[3])
torch.zeros(1, device='cuda'); torch.cuda.synchronize()
print('ready', os.getpid(), flush=True)
time.sleep(before)
x = torch.empty(8 * (1 << 30), dtype=torch.uint8, device='cuda'); x.fill_(1); torch.cuda.synchronize()
t0 = time.monotonic()
print('holding', flush=True)
time.sleep(hold)
del x; torch.cuda.empty_cache(); torch.cuda.synchronize()
t1 = time.monotonic()
print('freed', t1 - t0, flush=True)
time.sleep(after)
"""


def smi(query, kind):
    out = subprocess.check_output(
        ["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader,nounits"], text=True)
    return [[c.strip() for c in l.split(",")] for l in out.strip().splitlines() if l.strip()]


def scrape():
    text = gpucheck.scrape(PORT)
    ts = [v for _, v in series(text, "gpumem_exporter_last_sample_timestamp_seconds")]
    return (ts[0] if ts else None), text


def one(text, name, **labels):
    v = [val for l, val in series(text, name) if all(l.get(k) == w for k, w in labels.items())]
    return v[0] if len(v) == 1 else None


print(f"# gpumem-exporter memory-time on {os.uname().nodename}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
print("```")
print(subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv"],
                     capture_output=True, text=True).stdout.strip())
print("```\n")

# 1. The daemon's counters.
holder_py = os.path.join(OUT, "holder.py")
with open(holder_py, "w") as f:
    f.write(HOLDER)
config_yaml = os.path.join(OUT, "byte-seconds.yaml")
with open(config_yaml, "w") as f:
    f.write("processes:\n  byte_seconds: true\n")  # the per-process counter is off by default
exporter = subprocess.Popen([BIN, "--web.listen-address", f"127.0.0.1:{PORT}", "--sample-interval", "100ms",
                             "--config.file", config_yaml],
                            stderr=subprocess.DEVNULL)
try:
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            scrape()
            break
        except Exception:
            time.sleep(0.05)
    holder = subprocess.Popen([sys.executable, holder_py, str(HOLD_S), "3", "3"], stdout=subprocess.PIPE, text=True)
    _, pid = holder.stdout.readline().split()
    time.sleep(1.5)  # its context alone, listed
    t_a, before = scrape()
    ctx = one(before, "gpu_process_memory_used_bytes", pid=pid)
    c_a = one(before, "gpu_process_memory_used_byte_seconds_total", pid=pid)
    uuid = [l for l, _ in series(before, "gpu_process_memory_used_bytes") if l.get("pid") == pid][0]["uuid"]
    g_a = one(before, "gpu_memory_used_byte_seconds_total", uuid=uuid)
    assert holder.stdout.readline().startswith("holding")
    line = holder.stdout.readline().split()
    held = float(line[1])
    time.sleep(1.0)  # the context alone again, listed
    t_b, after = scrape()
    c_b = one(after, "gpu_process_memory_used_byte_seconds_total", pid=pid)
    g_b = one(after, "gpu_memory_used_byte_seconds_total", uuid=uuid)
    user = [l for l, _ in series(after, "gpu_process_info") if l.get("pid") == pid][0].get("user", "")
    w_b = one(after, "gpu_workload_memory_used_byte_seconds_total", uuid=uuid, user=user)
    if None in (ctx, c_a, c_b, t_a, t_b):
        check("counters present", False, f"ctx={ctx} c_a={c_a} c_b={c_b}")
    else:
        extra = (c_b - c_a) - ctx * (t_b - t_a)
        want = 8 * GIB * held
        err = abs(extra - want) / want
        check("8 GiB held 30 s: byte-seconds", err <= 0.01,
              f"{extra / GIB:.2f} GiB.s beyond the context's {ctx / MIB:.0f} MiB over {t_b - t_a:.2f} s; "
              f"8 GiB x {held:.3f} s = {want / GIB:.2f} GiB.s; off by {100 * err:.3f} %")
        check("the GPU's total grew at least as much", g_b - g_a >= (c_b - c_a) * 0.999,
              f"GPU +{(g_b - g_a) / GIB:.2f} GiB.s, process +{(c_b - c_a) / GIB:.2f} GiB.s")
    holder.wait(timeout=20)
    time.sleep(1.5)
    _, gone = scrape()
    w_gone = one(gone, "gpu_workload_memory_used_byte_seconds_total", uuid=uuid, user=user)
    check("the process series went with it", one(gone, "gpu_process_memory_used_byte_seconds_total", pid=pid) is None,
          "absent after exit")
    check("its workload keeps its total", w_gone is not None and w_b is not None and w_gone >= w_b,
          f"user={user!r}: {w_b} then {w_gone}")
finally:
    exporter.terminate()
    exporter.wait(timeout=10)

# 2. record's summary against nvidia-smi.
run_csv = os.path.join(OUT, "run.csv")
for p in (run_csv, run_csv + ".summary.json"):
    if os.path.exists(p):
        os.remove(p)
rec = subprocess.Popen([BIN, "record", "--force", "-o", run_csv, "--", sys.executable, "-u", holder_py, "8", "1", "1"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
_, pid = rec.stdout.readline().split()
assert rec.stdout.readline().startswith("holding")
time.sleep(3)
apps = [a for a in smi("pid,used_memory", "compute-apps") if a[0] == pid]
gpu0 = smi("index,memory.used", "gpu")[0]
out, err = rec.communicate(timeout=40)
print("```")
print(err.strip())
print("```\n")
summary = json.load(open(run_csv + ".summary.json"))
procs = [p for p in summary["processes"] if str(p["pid"]) == pid]
check("record exit code", rec.returncode == 0, f"{rec.returncode}")
check("the summary names the holder", len(procs) == 1, f"{[p['pid'] for p in summary['processes']]}")
if procs and apps:
    diff = abs(procs[0]["peak_used_bytes"] - int(apps[0][1]) * MIB)
    check("process peak vs nvidia-smi", diff <= MIB,
          f"summary {procs[0]['peak_used_bytes'] / MIB:.1f} MiB, nvidia-smi {apps[0][1]} MiB")
g = [x for x in summary["gpus"] if x["gpu"] == gpu0[0]]
if g:
    diff = abs(g[0]["peak_used_bytes"] - int(gpu0[1]) * MIB)
    check("GPU peak vs nvidia-smi", diff <= MIB,
          f"summary {g[0]['peak_used_bytes'] / MIB:.1f} MiB, nvidia-smi {gpu0[1]} MiB")
print("\n```json")
print(json.dumps(summary, indent=1))
print("```")

# 3. Busy seconds from NVML's utilisation samples, read every 5 s only.
BURSTS = """
import os, sys, time, torch
bursts = int(sys.argv[1]); on = float(sys.argv[2]); off = float(sys.argv[3])
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16); b = torch.randn_like(a)
c = a @ b; torch.cuda.synchronize()
print('ready', os.getpid(), flush=True)
time.sleep(3)
busy = 0.0
for _ in range(bursts):
    t0 = time.monotonic()
    while time.monotonic() - t0 < on:
        for _ in range(4):
            c = a @ b
        torch.cuda.synchronize()
    busy += time.monotonic() - t0
    time.sleep(off)
print('busy', busy, flush=True)
time.sleep(3)
"""
bursts_py = os.path.join(OUT, "bursts.py")
with open(bursts_py, "w") as f:
    f.write(BURSTS)
log_path = os.path.join(OUT, "busy-exporter.log")
with open(log_path, "w") as log:
    exporter = subprocess.Popen([BIN, "--web.listen-address", f"127.0.0.1:{PORT}", "--sample-interval", "5s"],
                                stderr=log)
try:
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            if one(scrape()[1], "gpu_busy_seconds_total", gpu="0") is not None:
                break
        except Exception:
            pass
        time.sleep(0.2)
    burner = subprocess.Popen([sys.executable, bursts_py, "8", "1.0", "1.5"], stdout=subprocess.PIPE, text=True)
    _, bpid = burner.stdout.readline().split()
    time.sleep(1.5)
    _, b_before = scrape()
    busy_a = one(b_before, "gpu_busy_seconds_total", gpu="0")
    line = burner.stdout.readline().split()
    burst_s = float(line[1])
    burner.wait(timeout=20)
    time.sleep(6)  # one more 5 s read after the last burst
    _, b_after = scrape()
    busy_b = one(b_after, "gpu_busy_seconds_total", gpu="0")
    if None in (busy_a, busy_b):
        check("gpu_busy_seconds_total present", False, f"{busy_a} {busy_b}")
    else:
        got = busy_b - busy_a
        err = abs(got - burst_s) / burst_s
        check("busy seconds vs the bursts (reads every 5 s)", err <= 0.05,
              f"gpu_busy_seconds_total +{got:.3f} s, bursts {burst_s:.3f} s; off by {100 * err:.2f} %")
finally:
    exporter.terminate()
    exporter.wait(timeout=10)
with open(log_path) as f:
    log_text = f.read()
check("NVML has utilisation samples here", "NVML has no utilisation samples" not in log_text,
      "no fallback line in the log" if "NVML has no utilisation samples" not in log_text else "fell back")
try:
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    _, first = pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
    last = max((x.timeStamp for x in first), default=0)
    costs = []
    for _ in range(200):
        t = time.perf_counter()
        try:
            _, got = pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, last)
            last = max([last] + [x.timeStamp for x in got])
        except pynvml.NVMLError_NotFound:
            pass
        costs.append(time.perf_counter() - t)
        time.sleep(0.005)
    costs.sort()
    print(f"\nnvmlDeviceGetSamples(GPU utilization, last seen): median {1e6 * costs[100]:.1f} µs, "
          f"p99 {1e6 * costs[197]:.1f} µs over 200 calls; {len(first)} samples in the buffer, "
          f"period {((first[-1].timeStamp - first[0].timeStamp) / max(1, len(first) - 1)) if len(first) > 1 else 0:.0f} µs")
except Exception as e:  # the cost is a figure to note, not a check
    print(f"\nnvmlDeviceGetSamples cost not measured: {e}")
print(f"\n{'all checks pass' if not failures else 'FAILED: ' + ', '.join(failures)}")
sys.exit(1 if failures else 0)
