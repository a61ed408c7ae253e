#!/usr/bin/env python3
"""Where the exporter's CPU and memory go on a GPU host (diagnostics for
BENCHMARKS.md): CPU per thread at the default intervals, without fast
memory samples, and with the MIG layout read at every full sample; the
steady tick against its NVML time; the cost of one NVML memory_info call
and of a MIG rescan (nvmlDeviceGetMigMode), NVML's own RSS, and the
exporter's largest resident mappings.

    scripts/gpu/overhead.py [path/to/gpumem-exporter]   (default: .dev/gpumem-exporter)
"""
import os
import subprocess
import sys
import time
import urllib.request

import gpucheck

BIN = gpucheck.exporter(".dev/gpumem-exporter")
TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu_ns(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            ns = int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0])
        except OSError:
            continue
        out[name] = out.get(name, 0) + ns
    return out


def run(args, secs, port):
    p = subprocess.Popen([BIN, "--web.listen-address", f"127.0.0.1:{port}"] + args,
                         stderr=subprocess.DEVNULL)
    for _ in range(500):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read()
            break
        except Exception:
            time.sleep(0.01)
    time.sleep(3)  # warm-up
    m0 = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
    a = thread_cpu_ns(p.pid)
    t = time.time()
    time.sleep(secs)
    b = thread_cpu_ns(p.pid)
    dt = time.time() - t
    m = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
    status = open(f"/proc/{p.pid}/status").read()
    rss = [l for l in status.splitlines() if l.startswith(("VmRSS", "VmHWM"))]
    maps = {}
    cur = None
    for line in open(f"/proc/{p.pid}/smaps"):
        parts = line.split()
        if "-" in parts[0] and len(parts) >= 5:
            cur = parts[5] if len(parts) >= 6 else "[anon]"
        elif parts[0] == "Rss:":
            maps[cur] = maps.get(cur, 0) + int(parts[1])
    p.terminate()
    p.wait()
    total = sum(b.values()) - sum(a.values())
    print(f"\n### {' '.join(args) or 'defaults'}: {secs} s")
    print(f"CPU {100 * total / (dt * 1e9):.3f} % of a core; per thread:")
    for k in sorted(b, key=lambda k: -(b[k] - a.get(k, 0))):
        print(f"  {k:16} {(b[k] - a.get(k, 0)) / dt / 1e3:8.1f} µs/s")
    for line in m.splitlines():
        if line.startswith(("gpumem_exporter_sample_duration_seconds_sum", "gpumem_exporter_sample_duration_seconds_count",
                            "gpumem_exporter_sample_nvml_duration_seconds_sum", "gpumem_exporter_memory_samples_total",
                            'gpumem_exporter_sample_duration_seconds_bucket{le="0.00025"}', 'gpumem_exporter_sample_duration_seconds_bucket{le="0.0005"}')):
            print("  " + line)
    def val(text, name):
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0
    ticks = val(m, "gpumem_exporter_sample_duration_seconds_count") - val(m0, "gpumem_exporter_sample_duration_seconds_count")
    tick_s = val(m, "gpumem_exporter_sample_duration_seconds_sum") - val(m0, "gpumem_exporter_sample_duration_seconds_sum")
    nvml_s = val(m, "gpumem_exporter_sample_nvml_duration_seconds_sum") - val(m0, "gpumem_exporter_sample_nvml_duration_seconds_sum")
    if ticks and nvml_s:
        print(f"  steady state ({int(ticks)} full ticks after warm-up): tick {1e6 * tick_s / ticks:.1f} µs, "
              f"NVML {1e6 * nvml_s / ticks:.1f} µs, ratio {tick_s / nvml_s:.3f}")
    print("  " + "; ".join(rss))
    print("  largest resident mappings (KiB):")
    for name, kib in sorted(maps.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {kib:7} {name}")


run([], 20, 19901)
run(["--memory-sample-interval", "1s"], 20, 19902)
run(["--mig-rescan-interval", "1s"], 20, 19903)

# NVML alone, from Python: memory_info cost and NVML's resident memory.
import pynvml  # noqa: E402
rss0 = int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1])
pynvml.nvmlInit()
rss1 = int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1])
h = pynvml.nvmlDeviceGetHandleByIndex(0)
n = 2000
t = time.perf_counter()
for _ in range(n):
    pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
per = (time.perf_counter() - t) / n
t = time.perf_counter()
for _ in range(200):
    pynvml.nvmlDeviceGetComputeRunningProcesses(h)
per_p = (time.perf_counter() - t) / 200
t = time.perf_counter()
for _ in range(n):
    try:
        pynvml.nvmlDeviceGetMigMode(h)
    except pynvml.NVMLError:
        pass
per_mig = (time.perf_counter() - t) / n
t = time.perf_counter()
for _ in range(200):
    g = pynvml.nvmlDeviceGetHandleByIndex(0)
    pynvml.nvmlDeviceGetUUID(g)
    pynvml.nvmlDeviceGetName(g)
    pynvml.nvmlDeviceGetPciInfo(g)
per_id = (time.perf_counter() - t) / 200
print(f"NVML from Python: MIG rescan with MIG off (nvmlDeviceGetMigMode) {per_mig * 1e6:.1f} µs/call; "
      f"identity (handle, UUID, name, PCI info) {per_id * 1e6:.1f} µs")
print(f"\nNVML from Python: memory_info v2 {per * 1e6:.1f} µs/call (incl. ctypes); compute processes {per_p * 1e6:.1f} µs/call; "
      f"nvmlInit grew this process's RSS by {(rss1 - rss0) / 1024:.1f} MiB")
