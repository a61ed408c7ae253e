#!/usr/bin/env python3
"""The gpm collector on a real GPU (Hopper or later): start gpumem-exporter
with --collector.gpm and check, on GPU 0, that

- SM activity and tensor-core activity are near 0 while the GPU is idle,
  high while a bf16 matmul loop runs, and near 0 again after it;
- DRAM bandwidth utilisation is high while a device-to-device copy loop
  runs;
- no NVML error is counted with gpm on;
- the full-sample (tick) cost with gpm on, against the same exporter with
  gpm off, from the exporter's own tick histograms
  (gpumem_exporter_sample_duration_seconds and its NVML part, as
  scripts/gpu/overhead.py reads them), at idle.

Needs: an NVIDIA GPU with GPM (H100/H200 or later), the driver, python3
with torch.

    scripts/gpu/gpm.py [path/to/gpumem-exporter]    (default: .dev/gpumem-exporter)
    OUT=DIR scripts/gpu/gpm.py ...                   (also writes DIR/gpu-gpm.txt)

Prints PASS/FAIL lines; exit 0 when every check passes.
"""
import os
import signal
import subprocess
import sys
import time

import gpucheck
from gpucheck import check, failures, series

BIN = gpucheck.exporter(".dev/gpumem-exporter")
PORT = int(os.environ.get("GPM_PORT", "19878"))
# Full samples every second (the default): each GPM figure is the average
# over one second, so a phase of SETTLE seconds has at least two figures
# taken wholly inside it.
SETTLE = 4.0
# Thresholds: what "near 0" and "high" mean here.
IDLE_MAX = 0.05
SM_BUSY_MIN = 0.80
TENSOR_BUSY_MIN = 0.40
DRAM_BUSY_MIN = 0.50
# Tick comparison: seconds measured per run, after a warm-up.
TICK_SECS = 20
TICK_WARMUP = 4

# cuda:0 is NVML's GPU 0 only in PCI bus order.
ENV = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID")

METRICS = [
    "gpu_gpm_sm_activity_ratio",
    "gpu_gpm_sm_occupancy_ratio",
    "gpu_gpm_tensor_activity_ratio",
    "gpu_gpm_dram_bandwidth_utilization_ratio",
    "gpu_gpm_fp16_activity_ratio",
    "gpu_gpm_fp32_activity_ratio",
    "gpu_gpm_fp64_activity_ratio",
    "gpu_gpm_pcie_transmit_bytes_per_second",
    "gpu_gpm_pcie_receive_bytes_per_second",
    "gpu_gpm_nvlink_transmit_bytes_per_second",
    "gpu_gpm_nvlink_receive_bytes_per_second",
]

gpucheck.time_limit(900)
if os.environ.get("OUT"):
    gpucheck.report_to(os.path.join(os.environ["OUT"], "gpu-gpm.txt"))


def start(port, extra):
    p = subprocess.Popen([BIN, "--web.listen-address", f"127.0.0.1:{port}"] + extra,
                         stderr=subprocess.PIPE, text=True, env=ENV)
    t0 = time.time()
    while time.time() - t0 < 20:
        try:
            gpucheck.scrape(port)
            return p
        except Exception:
            if p.poll() is not None:
                break
            time.sleep(0.02)
    print(p.stderr.read() if p.poll() is not None else "the exporter does not answer")
    sys.exit(1)


def stop(p):
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    return p.stderr.read()


def gpu0(text, name):
    v = [val for labels, val in series(text, name) if labels.get("gpu") == "0"]
    return v[0] if v else None


def show(phase, text):
    print(f"--- {phase}: GPU 0 ---")
    for name in METRICS:
        v = gpu0(text, name)
        print(f"  {name:44} {'absent' if v is None else f'{v:.4g}'}")


def phase(name):
    """Scrape after SETTLE seconds in the current state."""
    time.sleep(SETTLE)
    text = gpucheck.scrape(PORT)
    show(name, text)
    return text


def load(kind, seconds):
    """A torch child that runs `kind` on cuda:0 for `seconds` after a
    warm-up; it prints "ready" once the loop runs."""
    src = f"""
import sys, time, torch
dev = torch.device('cuda', 0)
if {kind!r} == 'matmul':
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    step = lambda: torch.matmul(a, b)
else:
    src = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    step = lambda: dst.copy_(src)
for _ in range(20):
    step()
torch.cuda.synchronize()
print('ready', flush=True)
end = time.time() + {seconds}
while time.time() < end:
    for _ in range(20):
        step()
    torch.cuda.synchronize()
"""
    child = subprocess.Popen([sys.executable, "-c", src], stdout=subprocess.PIPE, text=True, env=ENV)
    line = child.stdout.readline().strip()
    if line != "ready":
        print(f"the {kind} child did not start: {line!r}")
        child.kill()
        sys.exit(1)
    return child


# ----------------------------------------------------------- the figures

exporter = start(PORT, ["--collector.gpm"])
text = phase("idle, before")
GPUS = max(1, len(series(text, "gpu_up")))
present = [n for n in METRICS if gpu0(text, n) is not None]
check("GPM families served for GPU 0", {"gpu_gpm_sm_activity_ratio", "gpu_gpm_tensor_activity_ratio",
                                         "gpu_gpm_dram_bandwidth_utilization_ratio"} <= set(present),
      f"{len(present)} of {len(METRICS)}: {', '.join(n[len('gpu_gpm_'):] for n in present)}")
for name in ["gpu_gpm_sm_activity_ratio", "gpu_gpm_tensor_activity_ratio"]:
    v = gpu0(text, name)
    check(f"idle before: {name} near 0", v is not None and v <= IDLE_MAX, f"{v} (<= {IDLE_MAX})")

child = load("matmul", 3 * SETTLE + 10)
text = phase("bf16 matmul loop")
sm, tensor = gpu0(text, "gpu_gpm_sm_activity_ratio"), gpu0(text, "gpu_gpm_tensor_activity_ratio")
check("matmul: SM activity high", sm is not None and sm >= SM_BUSY_MIN, f"{sm} (>= {SM_BUSY_MIN})")
check("matmul: tensor activity high", tensor is not None and tensor >= TENSOR_BUSY_MIN,
      f"{tensor} (>= {TENSOR_BUSY_MIN})")
child.kill()
child.wait()

text = phase("idle, after the matmul")
for name in ["gpu_gpm_sm_activity_ratio", "gpu_gpm_tensor_activity_ratio"]:
    v = gpu0(text, name)
    check(f"idle after: {name} near 0", v is not None and v <= IDLE_MAX, f"{v} (<= {IDLE_MAX})")

child = load("copy", 3 * SETTLE + 10)
text = phase("device-to-device copy loop")
dram = gpu0(text, "gpu_gpm_dram_bandwidth_utilization_ratio")
check("copy: DRAM bandwidth utilisation high", dram is not None and dram >= DRAM_BUSY_MIN,
      f"{dram} (>= {DRAM_BUSY_MIN})")
child.kill()
child.wait()

errors = series(gpucheck.scrape(PORT), "gpumem_exporter_nvml_errors_total")
check("no NVML error counted with gpm on", not errors, f"{errors}")
log = stop(exporter)

# ------------------------------------------------------- the tick cost


def val(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def tick_cost(port, extra):
    """Mean full-sample time and its NVML part (µs) over TICK_SECS, after
    TICK_WARMUP, from the exporter's own histograms."""
    p = start(port, extra)
    time.sleep(TICK_WARMUP)
    m0 = gpucheck.scrape(port)
    time.sleep(TICK_SECS)
    m1 = gpucheck.scrape(port)
    stop(p)
    d = lambda name: val(m1, name) - val(m0, name)
    ticks = d("gpumem_exporter_sample_duration_seconds_count")
    if not ticks:
        return None, None, 0
    return (1e6 * d("gpumem_exporter_sample_duration_seconds_sum") / ticks,
            1e6 * d("gpumem_exporter_sample_nvml_duration_seconds_sum") / ticks, int(ticks))


off_tick, off_nvml, off_n = tick_cost(PORT + 1, [])
on_tick, on_nvml, on_n = tick_cost(PORT + 2, ["--collector.gpm"])
print(f"--- tick cost at idle, {GPUS} GPU(s) (mean full sample, of which in NVML) ---")
for what, tick, nvml, n in [("off", off_tick, off_nvml, off_n), ("on", on_tick, on_nvml, on_n)]:
    if tick is not None:
        print(f"  gpm {what:3}: {tick:.1f} µs (NVML {nvml:.1f} µs) over {n} full samples")
if off_tick is not None and on_tick is not None:
    extra = on_tick - off_tick
    # Measured on the H200 from Python: nvmlGpmSampleGet 51 µs +
    # nvmlGpmMetricsGet 1.73 ms per GPU; allow the p99s and some slack.
    check("gpm adds what GPM costs per full sample", 0 < extra <= 5000 * GPUS,
          f"+{extra:.1f} µs per full sample ({extra / 1e4:.3f} % of a core at 1 s), "
          f"NVML +{on_nvml - off_nvml:.1f} µs")
else:
    check("gpm adds what GPM costs per full sample", False, "no full samples counted")

print("\n--- exporter log (gpm on, the figures run) ---")
print(log.strip())
print(f"\n{len(failures)} failed: {failures}" if failures else "\nall checks passed")
sys.exit(1 if failures else 0)
