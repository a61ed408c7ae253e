#!/usr/bin/env python3
"""Real-GPU check of the torch bridge's pools, memory limit, allocator
settings and OOM snapshots (docs/torch-bridge.md), and a measurement of
what torch's allocation history (GPUMEM_BRIDGE_OOM_HISTORY) costs:

 1. a torch process runs gpumem_bridge with GPUMEM_BRIDGE_OOM_SNAPSHOT_DIR
    and PYTORCH_CUDA_ALLOC_CONF set, makes both pools fragmented, and at a
    quiet moment compares the exporter's pool series (and the settings
    info series) with its own torch.cuda.memory_stats();
 2. it allocates 200 GiB, past the card: the bridge must write one
    snapshot that pickle.load reads, with segments and device_traces (an
    "oom" event in them: history is on), print its path on stderr, and the
    exporter's gpu_process_torch_oom_snapshots_total must read 1;
 3. it sets a memory fraction of 0.25: the exported limit must equal the
    limit torch's allocator hands its OOM observers when an allocation
    past it fails; back to 1, the limit series must go;
 4. separate processes time alloc+free pairs, an MLP training step and
    torch.cuda.memory._snapshot() with history off, python and all.

    scripts/gpu/torch-oom.py [EXPORTER]              # everything (the orchestrator); default .dev/gpumem-exporter
    scripts/gpu/torch-oom.py --oom EXPORTER OUT      # phases 1-3: one torch process
    scripts/gpu/torch-oom.py --bench off|python|all  # phase 4: one mode

PASS/FAIL lines; exit 1 when a check fails, 124 past 180 s (each phase
has its own timeout within that). Needs an NVIDIA GPU with < 200 GiB,
python3 with torch >= 2.6. Results under $OUT (default ./gpu-torch-oom-out):
report.txt (this output), results.json (every figure), snapshots/ (the
pickles written, open them at https://pytorch.org/memory_viz).

Each phase runs in its own process (its environment is what the bridge and
torch read at start; history is process-wide), under its own timeout. The
children print PASS/FAIL lines and ``RESULT {json}`` lines; the orchestrator
streams them, writes OUT/results.json, prints a summary and exits 1 on any
FAIL, a child's crash or its timeout.
"""
import json
import os
import pickle
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import gpucheck  # noqa: E402
from gpucheck import check, failures, series  # noqa: E402

GIB, MIB = 1 << 30, 1 << 20
BUDGET_S = 170  # the whole check ends at 180 (gpucheck.time_limit)
CONF = "expandable_segments:False,max_split_size_mb:256"
SPLIT_BYTES = 256 * MIB
INTERVAL = 0.2  # exporter sample_interval and bridge interval, seconds
POOLS = ("large", "small")
POOL_FAMILIES = (  # exported family, memory_stats key
    ("gpu_process_torch_pool_allocated_bytes", "allocated_bytes.{}_pool.current"),
    ("gpu_process_torch_pool_reserved_bytes", "reserved_bytes.{}_pool.current"),
    ("gpu_process_torch_pool_inactive_split_bytes", "inactive_split_bytes.{}_pool.current"),
    ("gpu_process_torch_pool_segments", "segment.{}_pool.current"),
)
TOTALS = (
    ("gpu_process_torch_allocated_bytes", "allocated_bytes.all.current"),
    ("gpu_process_torch_reserved_bytes", "reserved_bytes.all.current"),
    ("gpu_process_torch_inactive_split_bytes", "inactive_split_bytes.all.current"),
)
SNAPSHOTS = "gpu_process_torch_oom_snapshots_total"
LIMIT = "gpu_process_torch_memory_limit_bytes"
INFO = "gpu_process_torch_allocator_info"


def emit(**result):
    print("RESULT " + json.dumps(result), flush=True)


def info(msg):
    print("INFO  " + msg, flush=True)


def value(text, name, **labels):
    """The one sample of `name` whose labels include `labels`, as int."""
    found = [v for ls, v in series(text, name) if all(ls.get(k) == w for k, w in labels.items())]
    return int(found[0]) if len(found) == 1 else None


# ---------------------------------------------------------------- phases 1-3


def capture_stderr(fn):
    """fn()'s result and what went to fd 2 meanwhile (the bridge writes the
    snapshot's path there; torch's C++ warnings go there too)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            result = fn()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        return result, f.read().decode(errors="replace")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def oom_phase(bin_path, out):
    snapdir = os.path.join(out, "snapshots")
    shutil.rmtree(snapdir, ignore_errors=True)
    os.environ["GPUMEM_BRIDGE_OOM_SNAPSHOT_DIR"] = snapdir
    os.environ["GPUMEM_BRIDGE_OOM_HISTORY"] = "python"
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = CONF
    os.environ.pop("PYTORCH_ALLOC_CONF", None)  # torch >= 2.9 would read that one first
    if not os.access(bin_path, os.X_OK):
        check("exporter binary", False, f"{bin_path} not found or not executable (cargo build --release)")
        return
    port = free_port()
    log = open(os.path.join(out, "exporter.log"), "w")
    exporter = subprocess.Popen(
        [bin_path, "--web.listen-address", f"127.0.0.1:{port}", "--sample-interval", f"{int(INTERVAL * 1000)}ms"],
        stderr=log,
    )
    try:
        scrape = lambda: gpucheck.scrape(port)  # noqa: E731
        for _ in range(500):
            try:
                scrape()
                break
            except Exception:
                if exporter.poll() is not None:
                    check("exporter running", False, f"exited {exporter.returncode}, see exporter.log")
                    return
                time.sleep(0.02)
        run_oom_phase(scrape, snapdir)
    finally:
        exporter.terminate()
        try:
            exporter.wait(timeout=5)
        except subprocess.TimeoutExpired:
            exporter.kill()


def run_oom_phase(scrape, snapdir):
    import torch
    import gpumem_bridge
    from gpumem_bridge import oom

    assert gpumem_bridge.start(interval=INTERVAL)
    check(
        "torch has the allocator's OOM observer",
        hasattr(torch._C, "_cuda_attach_out_of_memory_observer"),
        f"torch {torch.__version__}",
    )
    dev = torch.device("cuda", 0)
    torch.zeros(1, device=dev)  # CUDA comes up: the queued attach runs
    check("observer attached as CUDA came up (torch.cuda._lazy_call)", oom.hooked() == "observer", f"hooked={oom.hooked()!r}")
    props = torch.cuda.get_device_properties(dev)
    uuid, pid = gpumem_bridge.normalize_uuid(props.uuid), str(os.getpid())
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", uuid],
            capture_output=True, text=True, timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = ""
    info(f"{props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, driver {driver or '?'}, pid {pid}, {uuid}")
    emit(phase="env", gpu=props.name, torch=torch.__version__, cuda=torch.version.cuda, driver=driver, total_memory=props.total_memory)
    me = dict(uuid=uuid, pid=pid)

    # Both pools fragmented: small (<= 1 MiB) and large tensors, a third freed.
    rnd = random.Random(16)
    small = [torch.empty(rnd.randint(1, 256) * 1024, dtype=torch.uint8, device=dev) for _ in range(3000)]
    large = [torch.empty(rnd.randint(2, 300) * MIB + rnd.randint(0, 4095), dtype=torch.uint8, device=dev) for _ in range(60)]
    del small[::3]
    del large[::3]

    def quiet_compare(when):
        """At a quiet moment: exported pool and total series == this
        process's memory_stats(), to the byte."""
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats(dev)
        want = {(name, pool): stats[key.format(pool)] for name, key in POOL_FAMILIES for pool in POOLS}
        want.update({(name, None): stats[key] for name, key in TOTALS})
        gpumem_bridge.publish_now()
        deadline = time.monotonic() + 8
        while True:
            text = scrape()
            got = {
                (name, pool): value(text, name, **me, **({"pool": pool} if pool else {}))
                for name, pool in want
            }
            if got == want or time.monotonic() > deadline:
                break
            time.sleep(INTERVAL)
        still = torch.cuda.memory_stats(dev)
        check(f"{when}: quiet (memory_stats unchanged while comparing)", all(
            still[key.format(pool)] == want[(name, pool)] for name, key in POOL_FAMILIES for pool in POOLS
        ), "")
        for (name, pool), w in want.items():
            series_name = name + ('{pool="%s"}' % pool if pool else "")
            check(f"{when}: {series_name} == memory_stats", got[(name, pool)] == w, f"{got[(name, pool)]} vs {w}")
        emit(phase=f"pools {when}", exported={f"{n}/{p}": v for (n, p), v in got.items()}, torch={f"{n}/{p}": v for (n, p), v in want.items()})
        return text

    text = quiet_compare("fragmented")
    infos = [ls for ls, v in series(text, INFO) if ls.get("pid") == pid and ls.get("uuid") == uuid]
    settings = [(ls.get("backend"), ls.get("expandable_segments"), ls.get("max_split_size_bytes")) for ls in infos]
    check(f"allocator settings from PYTORCH_CUDA_ALLOC_CONF={CONF}", settings == [("native", "false", str(SPLIT_BYTES))], f"{settings}")
    check("no limit series without a memory fraction", value(text, LIMIT, **me) is None, "")
    check("OOM snapshot counter present, 0", value(text, SNAPSHOTS, **me) == 0, f"{value(text, SNAPSHOTS, **me)}")

    # A real OOM: far past the card.
    def oom_now(nbytes):
        t = time.perf_counter()
        try:
            torch.empty(nbytes, dtype=torch.uint8, device=dev)
        except torch.cuda.OutOfMemoryError as e:
            return str(e).splitlines()[0], time.perf_counter() - t
        return None, time.perf_counter() - t

    (msg, secs), err = capture_stderr(lambda: oom_now(200 * GIB))
    for line in err.splitlines():
        info(f"stderr: {line}")
    check("200 GiB raised torch.cuda.OutOfMemoryError", msg is not None, msg or "no error")
    info(f"the failed allocation took {secs * 1000:.0f} ms, the snapshot written inside it")
    files = sorted(n for n in os.listdir(snapdir) if oom.NAME_RE.match(n))
    check("one snapshot file", len(files) == 1, f"{files}")
    if files:
        name = files[0]
        path = os.path.join(snapdir, name)
        check("named gpumem-oom-<this pid>-<UTC time>.pickle", oom.NAME_RE.match(name).group(1) == pid, name)
        check("its path printed on stderr", path in err, "")
        with open(path, "rb") as f:
            snap = pickle.load(f)
        keys = sorted(snap) if isinstance(snap, dict) else type(snap).__name__
        check("pickle.load reads it: segments and device_traces", isinstance(snap, dict) and "segments" in snap and "device_traces" in snap, f"keys {keys}")
        segs = [s for s in snap.get("segments", []) if s.get("device") == 0]
        traces = snap.get("device_traces", [[]])[0]
        actions = {}
        for e in traces:
            actions[e.get("action")] = actions.get(e.get("action"), 0) + 1
        check("segments of the GPU are there", len(segs) > 0, f"{len(segs)} segments")
        check("device_traces hold the OOM (history on)", actions.get("oom", 0) >= 1, f"{len(traces)} entries: {actions}")
        reserved = torch.cuda.memory_stats(dev)["reserved_bytes.all.current"]
        info(f"snapshot: {os.path.getsize(path)} bytes, {len(segs)} segments totalling {sum(s.get('total_size', 0) for s in segs)} bytes (reserved now {reserved})")
        emit(phase="oom", file=name, bytes=os.path.getsize(path), segments=len(segs), trace_entries=len(traces), actions=actions, oom_call_s=secs, message=msg)

    deadline = time.monotonic() + 8
    while time.monotonic() < deadline and value(scrape(), SNAPSHOTS, **me) != 1:
        time.sleep(INTERVAL)
    text = scrape()
    check("gpu_process_torch_oom_snapshots_total is 1", value(text, SNAPSHOTS, **me) == 1, f"{value(text, SNAPSHOTS, **me)}")
    ooms = torch.cuda.memory_stats(dev)["num_ooms"]
    check("gpu_process_torch_ooms_total == torch's num_ooms == 1", value(text, "gpu_process_torch_ooms_total", **me) == ooms == 1, f"{value(text, 'gpu_process_torch_ooms_total', **me)}, {ooms}")
    quiet_compare("after the OOM")

    # The limit: exported == what torch's allocator enforces.
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    check("torch tells the memory fraction (torch >= 2.6)", get is not None, torch.__version__)
    if get is None:
        return
    seen = []
    torch._C._cuda_attach_out_of_memory_observer(lambda d, a, limit, free: seen.append(limit))
    torch.cuda.set_per_process_memory_fraction(0.25, dev)
    total = torch.cuda.mem_get_info(dev)[1]
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline and value(scrape(), LIMIT, **me) is None:
        time.sleep(INTERVAL)
    exported = value(scrape(), LIMIT, **me)
    check("limit == size_t(0.25 x cudaMemGetInfo total)", exported == int(0.25 * total), f"{exported} vs {int(0.25 * total)}")
    (msg, _), err = capture_stderr(lambda: oom_now(int(0.3 * total)))
    check("an allocation past the limit raised OutOfMemoryError", msg is not None, msg or "no error")
    check("exported limit == the limit torch's allocator reported to its OOM observers", bool(seen) and seen[-1] == exported, f"{exported} vs {seen}")
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline and value(scrape(), SNAPSHOTS, **me) != 2:
        time.sleep(INTERVAL)
    check("second OOM: counter 2, two files", value(scrape(), SNAPSHOTS, **me) == 2 and len([n for n in os.listdir(snapdir) if oom.NAME_RE.match(n)]) == 2, "")
    emit(phase="limit", exported=exported, cudaMemGetInfo_total=total, observer_limit=seen[-1] if seen else None)
    torch.cuda.set_per_process_memory_fraction(1.0, dev)
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline and value(scrape(), LIMIT, **me) is not None:
        time.sleep(INTERVAL)
    check("fraction back to 1: no limit series", value(scrape(), LIMIT, **me) is None, "")
    gpumem_bridge.stop()


# ------------------------------------------------------------------ phase 4


def bench_phase(mode):
    import torch

    dev = torch.device("cuda", 0)
    torch.zeros(1, device=dev)
    torch.cuda.synchronize()
    if mode != "off":
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks=mode, max_entries=100000)
    sizes = (4096, 65536, 1 << 20, 8 << 20)

    def pairs(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(n):
            x = torch.empty(sizes[i & 3], dtype=torch.uint8, device=dev)
            del x
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e6

    pairs(2000)  # warm: a cached block of each size
    us = statistics.median(pairs(5000) for _ in range(3))
    emit(phase="bench", mode=mode, alloc_free_pair_us=us)

    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(256, 4096, device=dev, dtype=torch.bfloat16)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()
        opt.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats(dev)["allocation.all.allocated"]
    times = []
    for _ in range(30):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    allocs = (torch.cuda.memory_stats(dev)["allocation.all.allocated"] - before) / 30
    emit(phase="bench", mode=mode, step_ms=statistics.median(times) * 1000, allocs_per_step=allocs)

    t = time.perf_counter()
    snap = torch.cuda.memory._snapshot()
    snap_s = time.perf_counter() - t
    data = pickle.dumps(snap)
    entries = sum(len(tr) for tr in snap.get("device_traces", []))
    emit(phase="bench", mode=mode, snapshot_s=snap_s, snapshot_bytes=len(data), trace_entries=entries)


# -------------------------------------------------------------- orchestrator


def run_child(args, timeout, results, soft=False):
    """Run a phase, stream its output; (passes, fails). `soft`: a timeout
    is a measurement (what came before it stands), not a failure."""
    p = subprocess.Popen(
        [sys.executable, "-u", os.path.abspath(__file__)] + args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    counts = {"PASS": 0, "FAIL": 0}

    def read():
        for line in p.stdout:
            line = line.rstrip("\n")
            if line.startswith("RESULT "):
                try:
                    r = json.loads(line[7:])
                except ValueError:
                    print(line)
                    continue
                results.setdefault(r.pop("phase"), []).append(r)
                continue
            print(line, flush=True)
            for k in counts:
                if line.startswith(k + " "):
                    counts[k] += 1

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = p.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        reader.join(5)
        if soft:
            print(f"INFO  {' '.join(args[:2])}: stopped after {timeout:.0f} s; figures not printed above were not measured", flush=True)
            return counts["PASS"], counts["FAIL"]
        print(f"FAIL  {' '.join(args[:2])}: timed out after {timeout:.0f} s", flush=True)
        return counts["PASS"], counts["FAIL"] + 1
    reader.join(5)
    if rc != 0 and counts["FAIL"] == 0:
        print(f"FAIL  {' '.join(args[:2])}: exited {rc}", flush=True)
        counts["FAIL"] += 1
    return counts["PASS"], counts["FAIL"]


def main(bin_path, out):
    os.makedirs(out, exist_ok=True)
    start = time.monotonic()
    left = lambda: BUDGET_S - (time.monotonic() - start)  # noqa: E731
    results = {}
    passes = fails = 0
    print("## 1-3: pools, settings, a real OOM, the limit (one torch process with the bridge)\n", flush=True)
    p, f = run_child(["--oom", os.path.abspath(bin_path), os.path.abspath(out)], min(90, left() - 60), results)
    passes, fails = passes + p, fails + f
    print("\n## 4: cost of allocation history (one process per mode)\n", flush=True)
    for mode, cap in (("off", 20), ("python", 25), ("all", 40)):
        p, f = run_child(["--bench", mode], min(cap, left() - 2), results, soft=True)
        passes, fails = passes + p, fails + f
    bench = {}
    for r in results.get("bench", []):
        bench.setdefault(r.pop("mode"), {}).update(r)
    off = bench.get("off", {})
    print("\n| history | alloc+free pair | overhead per pair | MLP step (4x4096, bs 256, bf16) | allocations/step | step overhead | _snapshot() | pickle | trace entries |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in ("off", "python", "all"):
        b = bench.get(mode, {})
        f = lambda k, fmt: (fmt % b[k]) if k in b else "—"  # noqa: E731
        extra = (f"{b['alloc_free_pair_us'] - off['alloc_free_pair_us']:+.2f} µs") if "alloc_free_pair_us" in b and "alloc_free_pair_us" in off else "—"
        stepx = (f"{(b['step_ms'] / off['step_ms'] - 1) * 100:+.1f} %") if "step_ms" in b and "step_ms" in off else "—"
        print(f"| {mode} | {f('alloc_free_pair_us', '%.2f µs')} | {extra} | {f('step_ms', '%.2f ms')} | {f('allocs_per_step', '%.0f')} | {stepx} | {f('snapshot_s', '%.3f s')} | {f('snapshot_bytes', '%d B')} | {f('trace_entries', '%d')} |")
    results["bench"] = bench
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    print(f"\nresults: {os.path.join(out, 'results.json')}, snapshots: {os.path.join(out, 'snapshots')}, took {time.monotonic() - start:.0f} s")
    print(f"\n{passes} passed, {fails} failed: {'ALL PASS' if fails == 0 and passes > 0 else 'FAILED'}")
    return 0 if fails == 0 and passes > 0 else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--oom":
        try:
            oom_phase(sys.argv[2], sys.argv[3])
        except Exception as e:
            import traceback

            traceback.print_exc()
            check("phase 1-3 ran to the end", False, repr(e))
        sys.exit(1 if failures else 0)
    if len(sys.argv) == 3 and sys.argv[1] == "--bench":
        bench_phase(sys.argv[2])
        sys.exit(0)
    if len(sys.argv) > 2 or sys.argv[1:2] in (["--oom"], ["--bench"], ["-h"], ["--help"]):
        sys.exit(__doc__)
    out = os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu-torch-oom-out")
    gpucheck.time_limit(180)
    gpucheck.report_to(os.path.join(out, "report.txt"))
    sys.exit(main(gpucheck.exporter(".dev/gpumem-exporter"), out))
