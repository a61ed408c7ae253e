#!/usr/bin/env python3
"""Real-GPU smoke test: start gpumem-exporter, hold a known amount of GPU
memory with torch, compare the scrape with nvidia-smi, and check that the
process's series disappear after it exits. Needs: an NVIDIA GPU, the
driver (nvidia-smi), python3 with torch.

    scripts/gpu/smoke.py [path/to/gpumem-exporter]    (default: target/release/gpumem-exporter)

Exit 0 when every check passes; prints a table of what it compared.
"""
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import gpucheck
from gpucheck import check, failures, series

BIN = gpucheck.exporter("target/release/gpumem-exporter")
PORT = int(os.environ.get("SMOKE_PORT", "19877"))
INTERVAL = 0.5  # seconds, passed as --sample-interval
HOLD_GIB = int(os.environ.get("SMOKE_GIB", "4"))
MIB = 1 << 20


def scrape():
    return gpucheck.scrape(PORT)


def smi(query, kind):
    out = subprocess.check_output(
        ["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader,nounits"], text=True)
    return [[c.strip() for c in l.split(",")] for l in out.strip().splitlines() if l.strip()]


exporter = subprocess.Popen(
    [BIN, "--web.listen-address", f"127.0.0.1:{PORT}", "--sample-interval", f"{int(INTERVAL*1000)}ms"],
    stderr=subprocess.PIPE, text=True)
t0 = time.time()
text = None
while time.time() - t0 < 20:
    try:
        text = scrape()
        break
    except Exception:
        time.sleep(0.02)
print(f"exporter up, first good /metrics {1000*(time.time()-t0):.0f} ms after start")
if text is None:
    print(exporter.stderr.read() if exporter.poll() is not None else "no answer")
    sys.exit(1)

holder_src = f"""
import os, sys, time, torch
x = torch.empty({HOLD_GIB} * (1 << 30), dtype=torch.uint8, device='cuda')
x.fill_(1); torch.cuda.synchronize()
print(os.getpid(), torch.cuda.get_device_properties(0).uuid, flush=True)
sys.stdin.read()
"""
holder = subprocess.Popen([sys.executable, "-c", holder_src], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
pid = int(holder.stdout.readline().split()[0])
print(f"torch holder pid {pid} holds {HOLD_GIB} GiB")
time.sleep(3 * INTERVAL)

# Device and process figures: exporter vs nvidia-smi, taken back to back.
text = scrape()
gpus = smi("index,uuid,memory.used,memory.reserved,memory.total", "gpu")
apps = smi("pid,process_name,used_memory,gpu_uuid", "compute-apps")
print("\n--- scrape (gpu_memory_* and gpu_process_*) ---")
for line in text.splitlines():
    if line.startswith(("gpu_memory", "gpu_process", "gpu_up", "gpu_info", "gpu_driver_info")):
        print(line)
# Body size of this scrape (the torch holder listed), plain and as the
# exporter gzips it: the figure BENCHMARKS.md compares before / after leaving out empty labels.
req = urllib.request.Request(f"http://127.0.0.1:{PORT}/metrics", headers={"Accept-Encoding": "gzip"})
with urllib.request.urlopen(req, timeout=5) as r:
    gz = r.read()
    gz_enc = r.headers.get("Content-Encoding")
print(f"--- /metrics body: {len(text.encode())} bytes plain, {len(gz)} bytes {gz_enc or 'identity'} "
      f"({sum(1 for l in text.splitlines() if l and not l.startswith('#'))} series) ---")
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "smoke-metrics.prom"), "w") as f:
        f.write(text)
print("--- nvidia-smi --query-gpu ---")
for g in gpus:
    print(", ".join(g))
print("--- nvidia-smi --query-compute-apps ---")
for a in apps:
    print(", ".join(a))
print()

for idx, uuid, used, reserved, total in gpus:
    def ours(name):
        v = [val for l, val in series(text, name) if l.get("uuid") == uuid]
        return v[0] if v else None
    for label, smi_mib, name in [("used", used, "gpu_memory_used_bytes"),
                                  ("reserved", reserved, "gpu_memory_reserved_bytes"),
                                  ("total", total, "gpu_memory_total_bytes")]:
        val = ours(name)
        diff = None if val is None else abs(val - int(smi_mib) * MIB)
        check(f"gpu {idx} {label}", diff is not None and diff <= MIB,
              f"exporter {val:.0f} B = {val / MIB:.1f} MiB, nvidia-smi {smi_mib} MiB, |diff| {diff / MIB if diff is not None else 'n/a'} MiB"
              if val is not None else "missing")
    up = ours("gpu_up")
    check(f"gpu {idx} up", up == 1.0, f"gpu_up {up}")

ours_proc = [(l, v) for l, v in series(text, "gpu_process_memory_used_bytes") if l.get("pid") == str(pid)]
smi_proc = [a for a in apps if a[0] == str(pid)]
check("holder pid listed by exporter", len(ours_proc) == 1, f"{len(ours_proc)} series for pid {pid}")
check("holder pid listed by nvidia-smi", len(smi_proc) == 1, f"{smi_proc}")
if ours_proc and smi_proc:
    labels, val = ours_proc[0]
    smi_bytes = int(smi_proc[0][2]) * MIB
    check("holder bytes", abs(val - smi_bytes) <= MIB,
          f"exporter {val:.0f} B ({val / MIB:.1f} MiB), nvidia-smi {smi_proc[0][2]} MiB")
    smi_name = os.path.basename(smi_proc[0][1])[:15]
    check("holder name", labels.get("process") == smi_name,
          f"exporter process={labels.get('process')!r}, nvidia-smi {smi_proc[0][1]!r}")
    check("holder uuid", labels.get("uuid") == smi_proc[0][3], f"{labels.get('uuid')} vs {smi_proc[0][3]}")
    check("holder >= allocation", val >= HOLD_GIB * (1 << 30), f"{val:.0f} >= {HOLD_GIB} GiB")

# Exit: the series must be gone within 2 sample intervals of the process ending.
holder.stdin.close()
holder.wait()
gone_at = time.time()
gone = None
while time.time() - gone_at < 10:
    t = scrape()
    if not [1 for l, _ in series(t, "gpu_process_memory_used_bytes") if l.get("pid") == str(pid)]:
        gone = time.time() - gone_at
        break
    time.sleep(0.02)
check("series gone after exit", gone is not None and gone <= 2 * INTERVAL,
      f"gone {gone * 1000:.0f} ms after the process exited (limit {2 * INTERVAL * 1000:.0f} ms)"
      if gone is not None else "still present after 10 s")

# Shutdown.
exporter.send_signal(signal.SIGTERM)
t = time.time()
rc = exporter.wait(timeout=5)
check("SIGTERM exit", rc == 0 and time.time() - t < 1.0, f"exit {rc} after {1000*(time.time()-t):.0f} ms")
print("\n--- exporter log ---")
print(exporter.stderr.read().strip())
print(f"\n{len(failures)} failed: {failures}" if failures else "\nall checks passed")
sys.exit(1 if failures else 0)
