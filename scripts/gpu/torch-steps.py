#!/usr/bin/env python3
"""Real-GPU check of the bridge's per-step figures, the exporter's forecast
and the threshold warning (GPUMEM_BRIDGE_WARN_AT), and what the step hook costs.

    scripts/gpu/torch-steps.py --exporter .dev/gpumem-exporter --out docs/results/torch-steps
    scripts/gpu/torch-steps.py --exporter ... --out ... --only a,c,d   # skip the 4-minute fill

It starts the exporter itself (sample interval 500 ms, as smoke.py) and
torch children (this same file, ``--child MODE``), all as this user, so the
exporter reads their /proc/<pid>/fd without a capability. Checks, in the
order they run (b first, so the exporter's used-memory history holds
nothing but its ramp; the others free what they took when they exit):

b. forecast: a child allocates 256 MiB every X s, X chosen from
   ``torch.cuda.mem_get_info()`` at its start so the free memory fills in
   about --fill-seconds (240), until torch raises OutOfMemoryError. When the
   GPU's used memory (from /api/v1/snapshot) has grown by half of what was
   free at the start, ``gpus[i].forecast.full_in_seconds`` is read; it must
   be within 15 % of the time the OOM really came after that snapshot
   (``taken_at``).
a. growth per step: two children under ``python -m gpumem_bridge`` (no code
   change) train a small MLP with SGD, one keeping a 4 MiB tensor per step:
   once ``gpu_process_torch_steps_total`` >= 80 for both (the last 64 steps
   then leave out the first ones, where cuBLAS takes its workspace),
   ``gpu_process_torch_step_allocated_growth_bytes`` must be within 2 % of
   4194304 for the leak and below 65536 in absolute value without it.
c. threshold: a child with ``set_per_process_memory_fraction(0.25)`` and
   GPUMEM_BRIDGE_WARN_AT=0.9 grows reserved past 90 % of the limit, stays
   there for some steps and publishes, allocates once more: exactly one
   GpuMemoryThresholdWarning (``warnings.catch_warnings(record=True)``
   with the filter "always", so a second emission could not hide), exactly
   one on_threshold call, and gpu_process_torch_threshold_crossings_total
   == 1 for its pid.
d. cost: N=2000 optimizer steps of an MLP (3 x Linear(1024, 1024), batch 64,
   SGD) timed without the hook, with the bridge running, and with the hook
   timed from inside the loop, interleaved, 3 times each
   (torch.cuda.synchronize() only around each timed block), and the hook
   function called alone 10000 times: microseconds added per step (the
   difference of medians, which blocks of the same kind blur by several %),
   the hook's own time inside the loop (the precise figure) and % of the
   step, and the hook alone. FAIL only when the hook takes 100 us or more
   inside the loop, or it did not count every step.

One PASS/FAIL line per check with its figures; the output also goes to
<out>/torch-steps.txt and the figures to <out>/torch-steps.json. Exit 1 on
any FAIL, 124 past the time limit (420 s). Needs an NVIDIA GPU (an H200:
the fill assumes ~140 GiB, it adapts to less) with nothing else on GPU 0,
and python3 with torch (>= 2.6 for the limit-relative threshold).
"""
import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
PYTHON_DIR = os.path.join(ROOT, "python")
MIB = 1 << 20
GIB = 1 << 30
LEAK = 4 * MIB
CHUNK = 256 * MIB
TIME_LIMIT = 420

# -- the children (torch imported only here) ---------------------------------


def say(**event):
    print(json.dumps(event), flush=True)


def mlp(torch, width=1024, layers=3):
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1]).cuda()


def child_train(leak):
    """a: train until killed, keeping 4 MiB per step when ``leak``."""
    import torch
    import gpumem_bridge

    dev = torch.device("cuda", 0)
    model = mlp(torch)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(64, 1024, device=dev)
    y = torch.randn(64, 1024, device=dev)
    uuid = gpumem_bridge.normalize_uuid(torch.cuda.get_device_properties(dev).uuid)
    say(event="start", pid=os.getpid(), uuid=uuid, running=gpumem_bridge.running())
    kept = []
    for _ in range(2000):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if leak:
            kept.append(torch.empty(LEAK // 4, dtype=torch.float32, device=dev))
        opt.step()
        time.sleep(0.04)
    say(event="done", steps=gpumem_bridge.steps.tracker.total)


def child_fill(fill_seconds):
    """b: 256 MiB every X s until torch runs out of memory."""
    import torch
    import gpumem_bridge

    dev = torch.device("cuda", 0)
    torch.zeros(1, device=dev)  # the context first, then measure
    free, total = torch.cuda.mem_get_info(dev)
    every = fill_seconds * CHUNK / free
    uuid = gpumem_bridge.normalize_uuid(torch.cuda.get_device_properties(dev).uuid)
    oom = getattr(torch.cuda, "OutOfMemoryError", RuntimeError)
    held = []
    t0 = time.time()
    say(event="start", pid=os.getpid(), uuid=uuid, free=free, total=total, every=every, t0=t0)
    k = 0
    while True:
        k += 1
        wait = t0 + k * every - time.time()
        if wait > 0:
            time.sleep(wait)
        try:
            held.append(torch.empty(CHUNK, dtype=torch.uint8, device=dev))
        except oom as e:
            t = time.time()
            held.clear()
            say(event="oom", t=t, chunks=k - 1, elapsed=t - t0, error=str(e).splitlines()[0][:200])
            return


def child_threshold():
    """c: reserved past 90 % of a 0.25 limit, with the warning counted."""
    import warnings

    import torch

    dev = torch.device("cuda", 0)
    torch.cuda.set_per_process_memory_fraction(0.25, dev)
    import gpumem_bridge

    calls = []
    gpumem_bridge.on_threshold(lambda c: calls.append(dict(c._asdict(), thread=threading.current_thread().name)))
    assert gpumem_bridge.start()
    model = mlp(torch, 256, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(64, 256, device=dev)

    def train_step():
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    total = torch.cuda.mem_get_info(dev)[1]
    limit = int(0.25 * total)
    target = int(0.93 * limit)
    held = []
    uuid = gpumem_bridge.normalize_uuid(torch.cuda.get_device_properties(dev).uuid)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train_step()
        while torch.cuda.memory_reserved(dev) + GIB <= target:
            held.append(torch.empty(GIB, dtype=torch.uint8, device=dev))
            train_step()
        rest = (target - torch.cuda.memory_reserved(dev)) // (2 * MIB) * (2 * MIB)
        if rest > 0:
            held.append(torch.empty(rest, dtype=torch.uint8, device=dev))
        for _ in range(10):  # above, across publishes and steps
            train_step()
            time.sleep(0.1)
        held.append(torch.empty(CHUNK, dtype=torch.uint8, device=dev))  # one more
        for _ in range(10):
            train_step()
            time.sleep(0.1)
        gpumem_bridge.publish_now()
        ours = [w for w in seen if issubclass(w.category, gpumem_bridge.GpuMemoryThresholdWarning)]
    say(
        event="result",
        pid=os.getpid(),
        uuid=uuid,
        warnings=len(ours),
        messages=[str(w.message) for w in ours],
        warning_files=sorted({os.path.basename(w.filename) for w in ours}),
        callbacks=calls,
        limit=limit,
        reserved=torch.cuda.memory_reserved(dev),
        allocated=torch.cuda.memory_allocated(dev),
        fraction=torch.cuda.get_per_process_memory_fraction(dev) if hasattr(torch.cuda, "get_per_process_memory_fraction") else None,
    )
    sys.stdin.read()  # hold the memory until the exporter was read


def child_cost(n, rounds=3):
    """d: N steps without the hook, with the bridge running (hook and
    publishing thread), and with the hook alone timed inside the loop;
    ``rounds`` times each, interleaved (blocks of the same kind differ by
    several % on their own). Then the hook called alone, 10000 times."""
    import statistics

    import torch
    import gpumem_bridge
    from gpumem_bridge import steps
    # Not torch.optim.optimizer...: torch 2.11's torch.optim has no such attribute.
    from torch.optim.optimizer import register_optimizer_step_post_hook

    dev = torch.device("cuda", 0)
    model = mlp(torch)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(64, 1024, device=dev)
    y = torch.randn(64, 1024, device=dev)
    inside = [0.0]

    def timed_hook(o, a, k):
        t = time.perf_counter()
        steps._hook(o, a, k)
        inside[0] += time.perf_counter() - t

    def block():
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e6

    block()  # warm up: cuBLAS, the allocator's cache
    off, on, in_loop, counted = [], [], [], []
    for _ in range(rounds):
        assert steps.tracker.handle is None
        off.append(block())
        assert gpumem_bridge.start()
        assert steps.tracker.handle is not None, "hook not registered"
        before = steps.tracker.total
        on.append(block())
        counted.append(steps.tracker.total - before)
        gpumem_bridge.stop()
        h = register_optimizer_step_post_hook(timed_hook)
        inside[0] = 0.0
        block()
        h.remove()
        in_loop.append(inside[0] / n * 1e6)
    assert gpumem_bridge.start()
    calls = 10000
    t = time.perf_counter()
    for _ in range(calls):
        steps._hook(opt, (), {})
    hook_us = (time.perf_counter() - t) / calls * 1e6
    nested = hasattr(torch.cuda, "memory_stats_as_nested_dict")
    t = time.perf_counter()
    for _ in range(1000):
        torch.cuda.memory_stats_as_nested_dict(0) if nested else torch.cuda.memory_stats(0)
    stats_us = (time.perf_counter() - t) / 1000 * 1e6
    gpumem_bridge.stop()
    say(event="result", off_us=off, on_us=on, in_loop_us=in_loop, counted=counted, n=n, hook_us=hook_us,
        stats_us=stats_us, nested=nested, torch=torch.__version__,
        off_median=statistics.median(off), on_median=statistics.median(on), in_loop_median=statistics.median(in_loop))


# -- the parent: stdlib and urllib only ------------------------------------------


class Child:
    """A torch child: its JSON lines on a queue; killed by close()."""

    def __init__(self, mode, args=(), env=None, bridge_main=False):
        full = dict(os.environ)
        full["PYTHONPATH"] = os.pathsep.join([PYTHON_DIR] + [p for p in full.get("PYTHONPATH", "").split(os.pathsep) if p])
        full["GPUMEM_BRIDGE_INTERVAL"] = "0.2"
        full.pop("GPUMEM_BRIDGE_WARN_AT", None)
        full.update(env or {})
        me = os.path.abspath(__file__)
        cmd = [sys.executable, "-u"] + (["-m", "gpumem_bridge"] if bridge_main else []) + [me, "--child", mode] + list(args)
        self.mode = mode
        self.p = subprocess.Popen(cmd, env=full, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.p.pid
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                print(f"  [{self.mode} {self.pid}] {line.rstrip()}")
        self.lines.put(None)

    def expect(self, event, timeout):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                msg = self.lines.get(timeout=left)
            except queue.Empty:
                return None
            if msg is None:  # exited
                return None
            if msg.get("event") == event:
                return msg

    def close(self):
        """Close its stdin (a child waiting on it exits), then terminate."""
        try:
            self.p.stdin.close()
        except OSError:
            pass
        for stop, wait in ((None, 2), (self.p.terminate, 3), (self.p.kill, None)):
            if self.p.poll() is not None:
                return
            if stop is not None:
                stop()
            try:
                self.p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass


def main_parent(opts):
    sys.path.insert(0, HERE)
    import gpucheck
    from gpucheck import check, failures, series

    gpucheck.time_limit(TIME_LIMIT)
    os.makedirs(opts.out, exist_ok=True)
    gpucheck.report_to(os.path.join(opts.out, "torch-steps.txt"))
    results = {}
    port = opts.port
    base = f"http://127.0.0.1:{port}"

    def metrics():
        return gpucheck.scrape(port)

    def snapshot():
        with urllib.request.urlopen(base + "/api/v1/snapshot", timeout=5) as r:
            return json.loads(r.read())

    def of_pid(text, name, pid):
        v = [val for labels, val in series(text, name) if labels.get("pid") == str(pid)]
        return v[0] if len(v) == 1 else None

    def gpu_of(snap, uuid):
        for g in snap.get("gpus", []):
            if g.get("uuid") == uuid:
                return g
        return None

    if not os.access(opts.exporter, os.X_OK):
        sys.exit(f"exporter binary {opts.exporter} not found or not executable (cargo build --release)")
    log = open(os.path.join(opts.out, "exporter.log"), "w")
    exporter = subprocess.Popen(
        [opts.exporter, "--web.listen-address", f"127.0.0.1:{port}", "--sample-interval", "500ms"], stderr=log
    )
    children = []
    try:
        for _ in range(500):
            try:
                metrics()
                break
            except Exception:
                if exporter.poll() is not None:
                    sys.exit("exporter exited; see exporter.log")
                time.sleep(0.02)
        print(f"# torch steps, forecast and threshold; exporter {opts.exporter} on :{port}, python {sys.version.split()[0]}\n")
        only = set(opts.only.split(",")) if opts.only else set("abcd")

        # b. forecast ----------------------------------------------------------
        if "b" in only:
            time.sleep(3)  # a little flat history
            c = Child("fill", ["--fill-seconds", str(opts.fill_seconds)])
            children.append(c)
            start = c.expect("start", 60)
            if start is None:
                check("b. forecast", False, "the fill child did not start")
            else:
                deadline = time.monotonic() + opts.fill_seconds * 2 + 60
                g0 = gpu_of(snapshot(), start["uuid"])
                if g0 is None or g0.get("memory") is None:
                    check("b. forecast", False, f"no GPU {start['uuid']} with memory in /api/v1/snapshot")
                    deadline = 0
                # What was free when the child started (its context already in).
                used0 = g0["memory"]["used_bytes"] if deadline else 0
                free0 = start["free"]
                half, forecast, taken_at = None, None, None
                while time.monotonic() < deadline:
                    snap = snapshot()
                    g = gpu_of(snap, start["uuid"])
                    used = g["memory"]["used_bytes"] if g and g.get("memory") else 0
                    if half is None and used - used0 >= free0 / 2:
                        half = used
                    if half is not None:
                        f = g.get("forecast")
                        if f and f.get("full_in_seconds") is not None:
                            forecast, taken_at, fdoc = f["full_in_seconds"], snap["taken_at"], f
                            break
                        if used - used0 >= free0 * 0.6:
                            break  # no forecast near halfway
                    time.sleep(0.5)
                oom = c.expect("oom", max(deadline - time.monotonic(), 1)) if deadline else None
                if not deadline:
                    pass
                elif forecast is None or oom is None:
                    check("b. forecast", False, f"forecast {forecast}, oom {oom}, used at halfway {half}")
                else:
                    actual = oom["t"] - taken_at
                    err = abs(forecast - actual) / actual
                    results["b"] = dict(start=start, oom=oom, forecast=fdoc, taken_at=taken_at, actual_remaining=actual, error=err)
                    check(
                        "b. forecast.full_in_seconds at halfway vs the real OOM",
                        err <= 0.15,
                        f"forecast {forecast:.1f} s, OOM came {actual:.1f} s later, error {100 * err:.1f} % (limit 15 %); "
                        f"{fdoc.get('growth_bytes_per_second', 0) / MIB:.1f} MiB/s over {fdoc.get('window_seconds')} s; "
                        f"child: 256 MiB every {start['every']:.3f} s from {start['free'] / GIB:.1f} GiB free, OOM after {oom['elapsed']:.1f} s",
                    )
            c.close()

        # a. growth per step ---------------------------------------------------
        if "a" in only:
            leak = Child("train", ["--leak"], bridge_main=True)
            flat = Child("train", [], bridge_main=True)
            children += [leak, flat]
            ls, fs = leak.expect("start", 60), flat.expect("start", 60)
            got = {}
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and ls and fs:
                text = metrics()
                steps = {n: of_pid(text, "gpu_process_torch_steps_total", ch.pid) for n, ch in (("leak", leak), ("flat", flat))}
                growth = {n: of_pid(text, "gpu_process_torch_step_allocated_growth_bytes", ch.pid) for n, ch in (("leak", leak), ("flat", flat))}
                if all(s is not None and s >= 80 for s in steps.values()) and all(v is not None for v in growth.values()):
                    got = dict(steps=steps, growth=growth, allocated={n: of_pid(text, "gpu_process_torch_step_allocated_bytes", ch.pid) for n, ch in (("leak", leak), ("flat", flat))})
                    break
                time.sleep(0.5)
            results["a"] = got
            if not got:
                check("a. growth per step", False, f"no growth series with >= 80 steps for both children in 90 s (started: {bool(ls)}, {bool(fs)})")
            else:
                g, s = got["growth"]["leak"], got["steps"]["leak"]
                check("a. leak of 4 MiB per step: growth within 2 % of 4194304",
                      abs(g - LEAK) <= 0.02 * LEAK, f"{g:.0f} B/step ({100 * (g - LEAK) / LEAK:+.3f} %) after {s:.0f} steps (python -m gpumem_bridge, SGD)")
                g, s = got["growth"]["flat"], got["steps"]["flat"]
                check("a. no leak: |growth| < 65536", abs(g) < 65536, f"{g:.0f} B/step after {s:.0f} steps")
            leak.close()
            flat.close()

        # c. threshold ---------------------------------------------------------
        if "c" in only:
            c = Child("threshold", env={"GPUMEM_BRIDGE_WARN_AT": "0.9"})
            children.append(c)
            r = c.expect("result", 120)
            if r is None:
                check("c. threshold", False, "no result from the child")
            else:
                crossings, tbytes = None, None
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    text = metrics()
                    crossings = of_pid(text, "gpu_process_torch_threshold_crossings_total", r["pid"])
                    tbytes = of_pid(text, "gpu_process_torch_threshold_bytes", r["pid"])
                    if crossings is not None and tbytes is not None:
                        break
                    time.sleep(0.5)
                results["c"] = dict(r, exported_crossings=crossings, exported_threshold_bytes=tbytes)
                want = int(0.9 * r["limit"])
                check("c. exactly one GpuMemoryThresholdWarning", r["warnings"] == 1,
                      f"{r['warnings']} warnings (from {r['warning_files']}); limit {r['limit'] / GIB:.2f} GiB, reserved {r['reserved'] / GIB:.2f} GiB; "
                      f"first: {r['messages'][0] if r['messages'] else '-'}")
                check("c. exactly one on_threshold call", len(r["callbacks"]) == 1,
                      f"{len(r['callbacks'])} calls: {r['callbacks']}")
                check("c. gpu_process_torch_threshold_crossings_total == 1", crossings == 1,
                      f"{crossings}; gpu_process_torch_threshold_bytes {tbytes} (0.9 x limit = {want})")
            c.close()

        # d. cost ------------------------------------------------------------------
        if "d" in only:
            c = Child("cost", ["--steps", "2000"], env={"GPUMEM_BRIDGE_INTERVAL": "1"})
            children.append(c)
            r = c.expect("result", 150)
            if r is None:
                check("d. step hook cost", False, "no result from the child")
            else:
                off, on, inl = r["off_median"], r["on_median"], r["in_loop_median"]
                added = on - off
                spread = max(r["off_us"]) - min(r["off_us"])
                results["d"] = dict(r, added_us=added, added_percent=100 * added / off, in_loop_percent=100 * inl / off)
                check("d. step hook cost", inl < 100 and all(n == r["n"] for n in r["counted"]),
                      f"step {off:.1f} us without the hook, {on:.1f} us with the bridge (medians of {len(r['off_us'])} x {r['n']} steps; "
                      f"blocks without it spread over {spread:.1f} us): {added:+.1f} us/step ({100 * added / off:+.2f} %); "
                      f"timed inside the loop the hook takes {inl:.1f} us/step ({100 * inl / off:.2f} % of the step); "
                      f"called alone {r['hook_us']:.2f} us, of which memory_stats{'_as_nested_dict' if r['nested'] else ''} "
                      f"{r['stats_us']:.2f} us; counted {r['counted']}; torch {r['torch']}")
            c.close()
    finally:
        for c in children:
            c.close()
        exporter.terminate()
        try:
            exporter.wait(timeout=5)
        except subprocess.TimeoutExpired:
            exporter.kill()
        with open(os.path.join(opts.out, "torch-steps.json"), "w") as f:
            json.dump(dict(results, failures=failures), f, indent=2, default=str)

    print(f"\n{'ALL PASS' if not failures else 'FAILED: ' + ', '.join(failures)}")
    return 1 if failures else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exporter", default=os.path.join(ROOT, ".dev", "gpumem-exporter"), help="the gpumem-exporter binary")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "torch-steps"), help="directory for the summary")
    ap.add_argument("--port", type=int, default=int(os.environ.get("TORCH_STEPS_PORT", "19881")))
    ap.add_argument("--only", default="", help="a subset of a,b,c,d")
    ap.add_argument("--fill-seconds", type=float, default=240.0, help="b: time to fill the free memory")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--leak", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=2000, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.child == "train":
        return child_train(opts.leak)
    if opts.child == "fill":
        return child_fill(opts.fill_seconds)
    if opts.child == "threshold":
        return child_threshold()
    if opts.child == "cost":
        return child_cost(opts.steps)
    return main_parent(opts)


if __name__ == "__main__":
    sys.exit(main())
