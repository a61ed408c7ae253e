#!/usr/bin/env python3
"""Real-GPU check of `gpumem-exporter record`, under a minute:

    OUT=/some/dir scripts/gpu/record.py [path/to/gpumem-exporter]   # default .dev/gpumem-exporter

1. `record -o $OUT/run.csv -- python3 record-oom.py`: a torch process
   grows by 2 GiB every 100 ms until it OOMs. Checks the recorder exits
   with the script's code (3), that the CSV parses, that GPU 0's used bytes
   climb by more than 100 GiB, and that the process rows have torch's
   figures; prints the last rows and the file size.
2. The recorder's CPU at 10 Hz memory samples (the default 100 ms), for
   30 s while a torch process holds 4 GiB: utime + stime from
   /proc/<pid>/stat between 3 s and 28 s (steady state), and over the
   whole run from wait4 (NVML init included). Must be <= 1 % of a core.

Prints markdown, also to $OUT/gpu-record.md (OUT: a new temporary folder
when unset); exits 1 if a check fails, 124 past 170 s. Needs an NVIDIA GPU
and python3 with torch.
"""
import csv
import os
import subprocess
import sys
import tempfile
import time

import gpucheck

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = gpucheck.exporter(".dev/gpumem-exporter")
OUT = os.environ.get("OUT") or tempfile.mkdtemp()
gpucheck.time_limit(170)
gpucheck.report_to(os.path.join(OUT, "gpu-record.md"))
GIB = 1 << 30
failures = []


def check(ok, what):
    print(f"- {'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        failures.append(what)


if not os.access(BIN, os.X_OK):
    sys.exit(f"exporter binary {BIN} not found or not executable (build it: cargo build --release)")

print(f"# gpumem-exporter record on {os.uname().nodename}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv"],
                         capture_output=True, text=True).stdout.strip()
except OSError as e:
    smi = f"nvidia-smi: {e}"
print("```")
print(smi)
print("```\n")

# 1. Grow until OOM.
run_csv = os.path.join(OUT, "run.csv")
if os.path.exists(run_csv):
    os.remove(run_csv)
cmd = [BIN, "record", "-o", run_csv, "--", sys.executable, os.path.join(HERE, "record-oom.py")]
print("## 1. " + " ".join(cmd[1:]) + "\n")
t = time.monotonic()
p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
wall = time.monotonic() - t
print("```")
print((p.stdout + p.stderr).strip())
print("```")
check(p.returncode == 3, f"record exits with the command's code 3 (got {p.returncode})")
size = os.path.getsize(run_csv)
with open(run_csv, newline="") as f:
    rows = list(csv.DictReader(f))
gpu0 = [r for r in rows if r["kind"] == "gpu" and r["gpu"] == "0" and r["used_bytes"]]
procs = [r for r in rows if r["kind"] == "process"]
print(f"\n{len(rows)} rows ({len(gpu0)} GPU 0 rows, {len(procs)} process rows) in {size} bytes "
      f"over {wall:.1f} s: {size / wall * 3600 / 1e6:.1f} MB/hour at this rate\n")
print("Last rows:\n\n```")
with open(run_csv) as f:
    lines = f.read().splitlines()
print(lines[0])
for line in lines[-15:]:
    print(line)
print("```\n")
if gpu0:
    used = [int(r["used_bytes"]) for r in gpu0]
    climb = max(used) - used[0]
    check(climb > 100 * GIB, f"GPU 0 used climbs by {climb / GIB:.1f} GiB (> 100 GiB)")
    peak_at = used.index(max(used))
    print(f"  first {used[0] / GIB:.2f} GiB, peak {max(used) / GIB:.2f} GiB at row {peak_at + 1} of {len(used)}")
else:
    check(False, "GPU 0 rows with used_bytes")
torch_rows = [r for r in procs if r["torch_allocated_bytes"]]
check(len(torch_rows) > 0, f"{len(torch_rows)} process rows with torch figures (bridge)")
if torch_rows:
    top = max(torch_rows, key=lambda r: int(r["torch_allocated_bytes"]))
    print(f"  largest torch allocated {int(top['torch_allocated_bytes']) / GIB:.1f} GiB, "
          f"reserved {int(top['torch_reserved_bytes']) / GIB:.1f} GiB, NVML used {int(top['used_bytes']) / GIB:.1f} GiB")

# 2. CPU at 10 Hz memory samples.
print("\n## 2. recorder CPU at the default 100 ms memory samples (10 Hz), 30 s, one torch process holding 4 GiB\n")
cpu_csv = os.path.join(OUT, "cpu.csv")
if os.path.exists(cpu_csv):
    os.remove(cpu_csv)
holder = ("import torch, time; x = torch.empty(4 << 30, dtype=torch.uint8, device='cuda'); "
          "time.sleep(31)")
tick = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (after the state field)


proc = subprocess.Popen([BIN, "record", "-o", cpu_csv, "--duration", "30s", "--", sys.executable, "-c", holder],
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
start = time.monotonic()
time.sleep(3)
a, ta = cpu_ticks(proc.pid), time.monotonic()
time.sleep(25)
b, tb = cpu_ticks(proc.pid), time.monotonic()
_, status, usage = os.wait4(proc.pid, 0)
total_wall = time.monotonic() - start
steady = (b - a) / tick / (tb - ta) * 100
whole = (usage.ru_utime + usage.ru_stime) / total_wall * 100
with open(cpu_csv, newline="") as f:
    cpu_rows = list(csv.DictReader(f))
mem_rows = [r for r in cpu_rows if r["kind"] == "gpu" and r["gpu"] == "0"]
print(f"- steady state (3 s to 28 s): {b - a} ticks of {1 / tick * 1000:.0f} ms in {tb - ta:.1f} s = {steady:.2f} % of a core")
print(f"- whole run: utime {usage.ru_utime:.3f} s + stime {usage.ru_stime:.3f} s in {total_wall:.1f} s = {whole:.2f} % of a core; "
      f"max RSS {usage.ru_maxrss / 1024:.1f} MiB")
print(f"- {len(mem_rows)} GPU 0 rows in 30 s ({len(mem_rows) / 30:.1f} per second), {os.path.getsize(cpu_csv)} bytes")
check(os.waitstatus_to_exitcode(status) == 0, "record exits 0 with the holder's code")
check(steady <= 1.0, f"steady CPU {steady:.2f} % <= 1 % of a core")
check(len(mem_rows) >= 280, "about 10 memory rows per second")

print()
if failures:
    print(f"FAILED: {len(failures)} check(s)")
    sys.exit(1)
print("all checks passed")
