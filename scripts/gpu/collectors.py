#!/usr/bin/env python3
"""Real-GPU check of the collectors (utilization, process_utilization,
power_thermal, health): what each NVML call costs, what each collector adds
to the exporter's tick and CPU, and whether the figures agree with
nvidia-smi. Needs an NVIDIA GPU, nvidia-smi, python3 with torch and
nvidia-ml-py. Changes no GPU setting. About 2.5 minutes.

    scripts/gpu/collectors.py [path/to/gpumem-exporter]   (default: target/release/gpumem-exporter)

Prints PASS/FAIL lines and tables; exit 0 when every check passes.
"""
import os
import re
import subprocess
import sys
import time
import urllib.request

import pynvml

import gpucheck

BIN = gpucheck.exporter("target/release/gpumem-exporter")
FAILS = []


def check(ok, what):
    print(("PASS  " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        FAILS.append(what)


def scrape(port):
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()


def series(text, name, **labels):
    """Values of `name` whose labels include `labels`."""
    out = []
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            out.append(float(value))
    return out


def start(args, port):
    p = subprocess.Popen([BIN, "--web.listen-address", f"127.0.0.1:{port}", "--log.level", "warn"] + args,
                         stderr=subprocess.DEVNULL)
    for _ in range(500):
        try:
            scrape(port)
            return p
        except Exception:
            time.sleep(0.01)
    p.kill()
    raise SystemExit(f"exporter did not start: {args}")


def cpu_ns(pid):
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0])
        except OSError:
            pass
    return total


def val(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


# ------------------------------------------------------------ NVML costs
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)


def cost(name, f, n=300):
    try:
        f()
    except (pynvml.NVMLError, AttributeError) as e:
        print(f"  {name:44} {e!r}")
        return None
    t = time.perf_counter()
    for _ in range(n):
        f()
    us = (time.perf_counter() - t) / n * 1e6
    print(f"  {name:44} {us:8.1f} µs")
    return us


print("### NVML call costs (from Python, incl. ctypes), GPU 0")
costs = {
    "utilization": [
        cost("nvmlDeviceGetUtilizationRates", lambda: pynvml.nvmlDeviceGetUtilizationRates(h)),
        cost("nvmlDeviceGetEncoderUtilization", lambda: pynvml.nvmlDeviceGetEncoderUtilization(h)),
        cost("nvmlDeviceGetDecoderUtilization", lambda: pynvml.nvmlDeviceGetDecoderUtilization(h)),
    ],
    "process_utilization": [
        cost("nvmlDeviceGetProcessUtilization", lambda: pynvml.nvmlDeviceGetProcessUtilization(h, 0), n=50),
    ],
    "power_thermal": [
        cost("nvmlDeviceGetTemperature", lambda: pynvml.nvmlDeviceGetTemperature(h, 0)),
        cost("nvmlDeviceGetPowerUsage", lambda: pynvml.nvmlDeviceGetPowerUsage(h)),
        cost("nvmlDeviceGetEnforcedPowerLimit", lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h)),
        cost("nvmlDeviceGetTotalEnergyConsumption", lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(h)),
    ] + [cost(f"nvmlDeviceGetClockInfo({c})", lambda c=c: pynvml.nvmlDeviceGetClockInfo(h, c)) for c in range(4)] + [
        cost("nvmlDeviceGetPerformanceState", lambda: pynvml.nvmlDeviceGetPerformanceState(h)),
        cost("nvmlDeviceGetCurrentClocksEventReasons", lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)),
    ],
    "health": [
        cost("nvmlDeviceGetEccMode", lambda: pynvml.nvmlDeviceGetEccMode(h)),
    ] + [cost(f"nvmlDeviceGetTotalEccErrors({t},{c})", lambda t=t, c=c: pynvml.nvmlDeviceGetTotalEccErrors(h, t, c))
         for t in range(2) for c in range(2)] + [
        cost("nvmlDeviceGetRemappedRows", lambda: pynvml.nvmlDeviceGetRemappedRows(h)),
        cost("nvmlDeviceGetSupportedEventTypes", lambda: pynvml.nvmlDeviceGetSupportedEventTypes(h)),
    ],
}
es = pynvml.nvmlEventSetCreate()
try:
    pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
except pynvml.NVMLError as e:
    print(f"  nvmlDeviceRegisterEvents(XidCritical): {e!r}")


WAIT = getattr(pynvml, "nvmlEventSetWait_v2", None) or pynvml.nvmlEventSetWait


def wait0():
    try:
        WAIT(es, 0)
    except pynvml.NVMLError_Timeout:
        pass


costs["health"].append(cost("nvmlEventSetWait_v2(timeout 0)", wait0))
print("per collector, summed per GPU per full sample:")
for k, v in costs.items():
    print(f"  {k:22} {sum(x for x in v if x):8.1f} µs")

# ------------------------------------------------- tick and CPU per setup
print("\n### exporter: steady full tick and CPU, 15 s each (after 3 s warm-up)")
runs = [
    ("defaults", []),
    ("--no-collector.utilization", ["--no-collector.utilization"]),
    ("--no-collector.power_thermal", ["--no-collector.power_thermal"]),
    ("--no-collector.health", ["--no-collector.health"]),
    ("--collector.process_utilization", ["--collector.process_utilization"]),
    ("only memory + processes", ["--no-collector.utilization", "--no-collector.power_thermal", "--no-collector.health"]),
]
print(f"  {'setup':36} {'tick µs':>8} {'NVML µs':>8} {'ratio':>6} {'CPU %':>7}")
results = {}
for i, (name, args) in enumerate(runs):
    port = 19950 + i
    p = start(args, port)
    time.sleep(3)
    m0, c0, t0 = scrape(port), cpu_ns(p.pid), time.time()
    time.sleep(15)
    m1, c1, t1 = scrape(port), cpu_ns(p.pid), time.time()
    p.terminate()
    p.wait()
    n = val(m1, "gpumem_exporter_sample_duration_seconds_count") - val(m0, "gpumem_exporter_sample_duration_seconds_count")
    tick = (val(m1, "gpumem_exporter_sample_duration_seconds_sum") - val(m0, "gpumem_exporter_sample_duration_seconds_sum")) / n
    nvml = (val(m1, "gpumem_exporter_sample_nvml_duration_seconds_sum") - val(m0, "gpumem_exporter_sample_nvml_duration_seconds_sum")) / n
    cpu = 100 * (c1 - c0) / ((t1 - t0) * 1e9)
    results[name] = (tick, nvml, cpu)
    print(f"  {name:36} {tick * 1e6:8.1f} {nvml * 1e6:8.1f} {tick / nvml:6.3f} {cpu:7.3f}")
d = results["defaults"]
check(d[0] <= 1.2 * d[1], f"defaults: steady tick {d[0] * 1e6:.1f} µs <= 1.2 x NVML {d[1] * 1e6:.1f} µs")
check(d[2] <= 0.25, f"defaults: idle CPU {d[2]:.3f} % <= 0.25 % of a core")

# ----------------------------------------------------- agreement, idle
print("\n### figures against nvidia-smi")
port = 19960
p = start(["--collector.process_utilization", "--sample-interval", "1s"], port)
time.sleep(4)


def smi(query):
    out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout
    return [x.strip() for x in out.split(",")]


m = scrape(port)
temp, power, sm, mem, util = smi("temperature.gpu,power.draw,clocks.sm,clocks.mem,utilization.gpu")
ours_t = series(m, "gpu_temperature_celsius", gpu="0")
check(ours_t and abs(ours_t[0] - float(temp)) <= 1, f"idle temperature: exporter {ours_t} °C, nvidia-smi {temp} °C")
ours_p = series(m, "gpu_power_usage_watts", gpu="0")
check(ours_p and abs(ours_p[0] - float(power)) <= max(2.0, 0.03 * float(power)),
      f"idle power: exporter {ours_p} W, nvidia-smi {power} W (read ~1 ms apart; within 3 % or 2 W)")
ours_sm = series(m, "gpu_clock_hertz", gpu="0", clock="sm")
ours_mem = series(m, "gpu_clock_hertz", gpu="0", clock="memory")
check(ours_sm and ours_sm[0] == float(sm) * 1e6, f"sm clock: exporter {ours_sm} Hz, nvidia-smi {sm} MHz")
check(ours_mem and ours_mem[0] == float(mem) * 1e6, f"memory clock: exporter {ours_mem} Hz, nvidia-smi {mem} MHz")
ours_u = series(m, "gpu_utilization_ratio", gpu="0")
check(ours_u and ours_u[0] <= 0.05, f"idle utilization: exporter {ours_u}, nvidia-smi {util} %")
print("  gpu_clock_event_active:", {re.search(r'reason="(\w+)"', l).group(1): l.rsplit(' ', 1)[1]
                                    for l in m.splitlines() if l.startswith("gpu_clock_event_active{")})
print("  gpu_performance_state:", series(m, "gpu_performance_state", gpu="0"),
      " nvidia-smi pstate:", smi("pstate")[0])

# ECC and row remapping against nvidia-smi -q -d ECC,ROW_REMAPPER
q = subprocess.run(["nvidia-smi", "-q", "-d", "ECC,ROW_REMAPPER", "-i", "0"], capture_output=True, text=True).stdout
print("  --- nvidia-smi -q -d ECC,ROW_REMAPPER (excerpt) ---")
for line in q.splitlines():
    if re.search(r"ECC Mode|Current|Volatile|Aggregate|Correctable|Uncorrectable|Pending|Failure", line):
        print("  " + line.rstrip())


def smi_sum(scope, kind):
    """Sum of the DRAM/SRAM counts of one scope ("Volatile"/"Aggregate") and kind."""
    block = re.split(r"\n\s*(?=Volatile|Aggregate)", q)
    total = 0
    for b in block:
        if b.strip().startswith(scope):
            for line in b.splitlines():
                if kind in line and ":" in line:
                    v = line.split(":")[1].strip()
                    if v.isdigit():
                        total += int(v)
    return total


ecc_on = series(m, "gpu_memory_ecc_enabled", gpu="0")
check(ecc_on == [1.0 if re.search(r"Current\s*:\s*Enabled", q) else 0.0],
      f"ECC mode: exporter {ecc_on}, nvidia-smi {'Enabled' if 'Enabled' in q else 'Disabled'}")
for t, kind in [("corrected", "Correctable"), ("uncorrected", "Uncorrectable")]:
    for scope in ["volatile", "aggregate"]:
        ours = series(m, "gpu_memory_ecc_errors_total", gpu="0", type=t, scope=scope)
        theirs = smi_sum(scope.capitalize(), kind)
        check(ours == [float(theirs)], f"ECC {t} {scope}: exporter {ours}, nvidia-smi {theirs}")
rr = re.search(r"Remapped Rows.*?Correctable Error\s*:\s*(\d+).*?Uncorrectable Error\s*:\s*(\d+).*?Pending\s*:\s*(\w+).*?Remapping Failure Occurred\s*:\s*(\w+)", q, re.S)
if rr:
    for cause, want in [("correctable", rr.group(1)), ("uncorrectable", rr.group(2))]:
        ours = series(m, "gpu_memory_remapped_rows", gpu="0", cause=cause)
        check(ours == [float(want)], f"remapped rows {cause}: exporter {ours}, nvidia-smi {want}")
    ours = series(m, "gpu_memory_row_remap_pending", gpu="0")
    check(ours == [1.0 if rr.group(3) == "Yes" else 0.0], f"remap pending: exporter {ours}, nvidia-smi {rr.group(3)}")
    ours = series(m, "gpu_memory_row_remap_failed", gpu="0")
    check(ours == [1.0 if rr.group(4) == "Yes" else 0.0], f"remap failed: exporter {ours}, nvidia-smi {rr.group(4)}")
else:
    check(False, "nvidia-smi -q -d ROW_REMAPPER printed no remapped rows block")
print("  gpu_xid_errors_total series:", [l for l in m.splitlines() if l.startswith("gpu_xid_errors_total")] or "none (no Xid since start)")

# ---------------------------------------------------- agreement, busy
BUSY = r"""
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.time() + 14
while time.time() < end:
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize()
"""
busy = subprocess.Popen([sys.executable, "-c", BUSY])
time.sleep(7)
m = scrape(port)
pmon = subprocess.run(["nvidia-smi", "pmon", "-s", "u", "-c", "1", "-i", "0"], capture_output=True, text=True).stdout
util = smi("utilization.gpu")[0]
busy_sm = None
for line in pmon.splitlines():
    f = line.split()
    if len(f) > 4 and f[1] == str(busy.pid):
        busy_sm = f[3]
ours_u = series(m, "gpu_utilization_ratio", gpu="0")
check(ours_u and ours_u[0] >= 0.9, f"busy utilization: exporter {ours_u}, nvidia-smi {util} %")
ours_sm = series(m, "gpu_process_sm_utilization_ratio", gpu="0", pid=str(busy.pid))
print("  --- nvidia-smi pmon -s u -c 1 ---\n" + "\n".join("  " + l for l in pmon.splitlines()))
check(bool(ours_sm) and busy_sm not in (None, "-") and abs(ours_sm[0] * 100 - float(busy_sm)) <= 10,
      f"busy process sm: exporter {ours_sm} (x100), pmon {busy_sm} % (within 10 points)")
busy.wait()
p.terminate()
p.wait()

print("\nall checks passed" if not FAILS else f"\n{len(FAILS)} check(s) failed")
sys.exit(1 if FAILS else 0)
