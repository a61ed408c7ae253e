#!/usr/bin/env python3
"""The forecast and GPM staleness on a real GPU (the change-point forecast), GPU 0:

a. ramps after a steady period: two processes hold memory steady (other
   jobs on the GPU); for each rate (default 0.75 and 2.5 GiB/s), after
   STEADY s (default 120) of steady memory, a third process allocates at
   that rate until torch runs out of memory. When used memory is 25 %,
   50 % and 75 % of the way from the ramp's start to full,
   `gpu_memory_full_in_seconds` (and its sample's time) is read; each read
   must be within 15 % of the time the OOM really came after that sample.
   Also printed: when the forecast first appeared after the ramp began,
   and when it went after the OOM.
b. GPM beside a second GPM client: the exporter with --collector.gpm,
   a bf16 matmul loop on the GPU, and `nvidia-smi dmon --gpm-metrics`
   running beside it for DMON s (default 20). No served GPM figure may
   repeat bit for bit from one full sample to the next while the GPU is
   busy (a stale answer must be absent, counted in
   gpumem_exporter_gpm_stale_readings_total, and logged once); SM activity
   must read high, and near nvidia-smi's own figure.

Needs: an NVIDIA GPU (GPM for b: H100/H200 or later), the driver,
nvidia-smi, python3 with torch. Nothing else may use GPU 0 meanwhile.
About 7 minutes at the defaults (STEADY=120, rates 0.75 and 2.5 GiB/s
on an H200 with 60 GiB held); the whole check stops at 9 minutes.

    scripts/gpu/forecast.py [path/to/gpumem-exporter]   (default: .dev/gpumem-exporter)
    OUT=DIR scripts/gpu/forecast.py ...                  (also writes DIR/gpu-forecast.txt)
    RATES=0.75,2.5 STEADY=120 HOLD_GIB=30,30 DMON=20     (the defaults)

Prints PASS/FAIL lines and a table of the reads; exit 0 when every check
passes.
"""
import json
import os
import subprocess
import sys
import time

import gpucheck
from gpucheck import check, failures, series

GIB = 1 << 30
CHUNK = 64 << 20
BIN = gpucheck.exporter(".dev/gpumem-exporter")
PORT = int(os.environ.get("FORECAST_PORT", "19879"))
RATES = [float(r) for r in os.environ.get("RATES", "0.75,2.5").split(",")]
STEADY = float(os.environ.get("STEADY", "120"))
HOLD = [float(g) for g in os.environ.get("HOLD_GIB", "30,30").split(",")]
DMON = int(os.environ.get("DMON", "20"))
TOLERANCE = 0.15
READS = (0.25, 0.50, 0.75)

HOLDER = """
import sys, time, torch
x = torch.empty(int(float(sys.argv[1]) * (1 << 30)), dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print("held", flush=True)
time.sleep(3600)
"""

GROWER = """
import json, sys, time, torch
rate, chunk = float(sys.argv[1]) * (1 << 30), int(sys.argv[2])
dev = torch.device("cuda", 0)
torch.zeros(1, device=dev)
held, k = [], 0
oom = getattr(torch.cuda, "OutOfMemoryError", RuntimeError)
t0 = time.time()
print(json.dumps({"event": "start", "t0": t0}), flush=True)
while True:
    k += 1
    wait = t0 + k * chunk / rate - time.time()
    if wait > 0:
        time.sleep(wait)
    try:
        held.append(torch.empty(chunk, dtype=torch.uint8, device=dev))
    except oom as e:
        t = time.time()
        held.clear()
        print(json.dumps({"event": "oom", "t": t, "bytes": (k - 1) * chunk}), flush=True)
        break
"""

MATMUL = """
import time, torch
a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
print("busy", flush=True)
t = time.time()
while time.time() - t < float(__import__("sys").argv[1]):
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize()
"""


def py(code, *args, **kw):
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")},
        **kw,
    )


def start_exporter(extra, log):
    if not os.access(BIN, os.X_OK):
        sys.exit(f"exporter binary {BIN} not found or not executable (cargo build --release)")
    p = subprocess.Popen([BIN, "--web.listen-address", f"127.0.0.1:{PORT}", *extra], stderr=log)
    for _ in range(500):
        try:
            gpucheck.scrape(PORT)
            return p
        except Exception:
            if p.poll() is not None:
                sys.exit("exporter exited; see its log")
            time.sleep(0.02)
    sys.exit("exporter did not answer")


def gpu0(text, name):
    v = [val for labels, val in series(text, name) if labels.get("gpu") == "0"]
    return v[0] if v else None


def ramps(out):
    log = open(os.path.join(out, "exporter-forecast.log"), "w")
    exporter = start_exporter([], log)
    holders = []
    rows = []
    try:
        for g in HOLD:
            h = py(HOLDER, g)
            holders.append(h)
            if h.stdout.readline().strip() != "held":
                check("a. holders", False, f"a holder of {g} GiB did not start")
                return
        print(f"# a. {len(HOLD)} processes hold {sum(HOLD):.0f} GiB; ramps at {RATES} GiB/s, each after {STEADY:.0f} s steady\n")
        for rate in RATES:
            time.sleep(STEADY)
            text = gpucheck.scrape(PORT)
            used0, free0 = gpu0(text, "gpu_memory_used_bytes"), gpu0(text, "gpu_memory_free_bytes")
            steady_forecast = gpu0(text, "gpu_memory_full_in_seconds")
            cap = used0 + free0
            g = py(GROWER, rate, CHUNK)
            start = json.loads(g.stdout.readline())
            t0 = start["t0"]
            reads, first, last_seen, trace = {}, None, None, []
            deadline = time.time() + (cap - used0) / (rate * GIB) * 2 + 30
            while g.poll() is None and time.time() < deadline:
                text = gpucheck.scrape(PORT)
                ts = series(text, "gpumem_exporter_last_sample_timestamp_seconds")[0][1]
                used = gpu0(text, "gpu_memory_used_bytes")
                f = gpu0(text, "gpu_memory_full_in_seconds")
                if f is not None:
                    last_seen = ts
                    if first is None:
                        first = ts - t0
                trace.append((ts - t0, used, f))
                for q in READS:
                    if q not in reads and used is not None and used >= used0 + q * (cap - used0):
                        reads[q] = (ts, used, f)
                time.sleep(0.2)
            end = g.stdout.readline()
            g.wait()
            oom = json.loads(end) if end.strip() else None
            if oom is None or oom.get("event") != "oom":
                check(f"a. {rate} GiB/s", False, f"no OOM from the grower: {end!r}")
                continue
            # After the OOM: the grower freed its memory; the forecast must go.
            gone = None
            for _ in range(50):
                text = gpucheck.scrape(PORT)
                if gpu0(text, "gpu_memory_full_in_seconds") is None:
                    gone = time.time() - oom["t"]
                    break
                time.sleep(0.2)
            check(
                f"a. {rate} GiB/s: no forecast while steady",
                steady_forecast is None,
                f"gpu_memory_full_in_seconds before the ramp: {steady_forecast}",
            )
            check(
                f"a. {rate} GiB/s: a forecast soon after the ramp began",
                first is not None and first <= 20,
                f"first seen {first if first is None else round(first, 1)} s after the ramp began (fills in {oom['t'] - t0:.0f} s)",
            )
            check(f"a. {rate} GiB/s: the forecast goes after the OOM", gone is not None, f"gone {gone if gone is None else round(gone, 1)} s after")
            for q in READS:
                if q not in reads:
                    check(f"a. {rate} GiB/s at {q:.0%}", False, "never read (the ramp did not get there)")
                    continue
                ts, used, f = reads[q]
                truth = oom["t"] - ts
                err = None if f is None else (f - truth) / truth
                rows.append((rate, q, truth, f, err))
                check(
                    f"a. {rate} GiB/s at {q:.0%} of the way",
                    err is not None and abs(err) <= TOLERANCE,
                    f"forecast {f if f is None else round(f, 1)} s, OOM came {truth:.1f} s after that sample"
                    + ("" if err is None else f" ({err:+.1%})"),
                )
            with open(os.path.join(out, f"forecast-trace-{rate}.json"), "w") as t:
                json.dump({"rate_gib_s": rate, "used0": used0, "cap": cap, "t0": t0, "oom": oom, "trace": trace}, t)
        print("\n| rate GiB/s | read at | OOM came after s | forecast s | error |\n|---|---|---|---|---|")
        for rate, q, truth, f, err in rows:
            print(f"| {rate} | {q:.0%} | {truth:.1f} | {'none' if f is None else f'{f:.1f}'} | {'-' if err is None else f'{err:+.1%}'} |")
        print()
    finally:
        for h in holders:
            h.kill()
            h.wait()
        exporter.terminate()
        exporter.wait()


def gpm_beside_dmon(out):
    log_path = os.path.join(out, "exporter-gpm.log")
    log = open(log_path, "w")
    exporter = start_exporter(["--collector.gpm"], log)
    busy = py(MATMUL, DMON + 10)
    dmon = None
    try:
        if busy.stdout.readline().strip() != "busy":
            check("b. matmul", False, "the matmul child did not start")
            return
        time.sleep(3)
        dmon = subprocess.Popen(
            ["nvidia-smi", "dmon", "-i", "0", "--gpm-metrics", "2,5,10", "-d", "1", "-c", str(DMON)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        served, repeats, last_count, last_values = [], 0, None, None
        t_end = time.time() + DMON
        while time.time() < t_end:
            text = gpucheck.scrape(PORT)
            count = sum(v for _, v in series(text, "gpumem_exporter_sample_duration_seconds_count"))
            values = tuple(
                gpu0(text, f"gpu_gpm_{n}")
                for n in ("sm_activity_ratio", "tensor_activity_ratio", "dram_bandwidth_utilization_ratio", "sm_occupancy_ratio")
            )
            if count != last_count:
                if values[0] is not None:
                    served.append(values)
                    if last_values is not None and values == last_values:
                        repeats += 1
                    last_values = values
                last_count = count
            time.sleep(0.25)
        text = gpucheck.scrape(PORT)
        stale = gpu0(text, "gpumem_exporter_gpm_stale_readings_total")
        errors = series(text, "gpumem_exporter_nvml_errors_total")
        dmon_out, _ = dmon.communicate(timeout=DMON + 10)
        ours = sorted(v[0] for v in served)
        # dmon prints its default columns (pwr, temperatures, sm, ...)
        # before the GPM ones: find GPM metric 2's column, `smutil`, by its
        # header (the header line starts with "#", the data lines do not).
        theirs = []
        column = None
        for line in dmon_out.splitlines():
            parts = line.split()
            if parts[:2] == ["#", "gpu"] and "smutil" in parts:
                column = parts.index("smutil") - 1
            elif column is not None and parts and parts[0] == "0" and len(parts) > column:
                if parts[column].replace(".", "").isdigit():
                    theirs.append(float(parts[column]) / 100)
        theirs.sort()
        med = lambda v: v[len(v) // 2] if v else None
        print(f"# b. {len(served)} full samples with GPM served beside `nvidia-smi dmon --gpm-metrics 2,5,10` ({len(theirs)} lines)")
        print(f"#    ours SM activity median {med(ours)}, nvidia-smi's {med(theirs)}; stale answers counted: {stale}")
        print("#    nvidia-smi dmon said:\n" + "\n".join("#      " + l for l in dmon_out.splitlines()[:8]))
        check("b. GPM served beside nvidia-smi", len(served) >= DMON // 2, f"{len(served)} full samples with figures in {DMON} s")
        check("b. no GPM figures repeated bit for bit while busy", repeats == 0, f"{repeats} repeats among {len(served)} samples (stale answers not served: {stale})")
        check("b. SM activity high under the matmul", med(ours) is not None and med(ours) >= 0.8, f"median {med(ours)}")
        check(
            "b. near nvidia-smi's SM activity",
            med(ours) is not None and med(theirs) is not None and abs(med(ours) - med(theirs)) <= 0.1,
            f"ours {med(ours)}, nvidia-smi {med(theirs)}",
        )
        check("b. no NVML error", not errors, f"{errors}")
        logged = open(log_path).read().count("GPM answered exactly the figures")
        check("b. a stale answer logged at most once", logged <= 1, f"logged {logged} times, counted {stale}")
    finally:
        for p in (busy, dmon):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        exporter.terminate()
        exporter.wait()


def main():
    gpucheck.time_limit(540)
    out = os.environ.get("OUT") or os.path.join(gpucheck.ROOT, "target", "gpu-forecast")
    os.makedirs(out, exist_ok=True)
    gpucheck.report_to(os.path.join(out, "gpu-forecast.txt"))
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used", "--format=csv,noheader", "-i", "0"],
        capture_output=True,
        text=True,
    )
    print(f"# forecast and GPM staleness; exporter {BIN}; GPU 0: {smi.stdout.strip()}\n")
    t = time.time()
    ramps(out)
    print(f"# a. took {time.time() - t:.0f} s")
    t = time.time()
    gpm_beside_dmon(out)
    print(f"# b. took {time.time() - t:.0f} s")
    print(f"\n{'ALL PASS' if not failures else 'FAILED: ' + ', '.join(failures)}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
