#!/usr/bin/env python3
"""Series churn per `processes.series` mode: how many series one node
creates per hour when it runs 1,000 short processes an hour, on the fake
NVML (the series budget and per-workload series).

The node: 8 GPUs; every process holds memory for `--lifetime` seconds and
belongs to a job (a pod, by its cgroup path in a fake /proc root) that
starts `--per-job` processes on its GPU (job % 8), so 1,000 processes an
hour are 1,000 / per-job jobs an hour. The exporter
samples every 100 ms and is scraped every `--scrape` seconds; a series is
"created" when a scrape shows a name + label set no scrape of that run
showed before (the exporter's own gpumem_exporter_* families left out).
Created-per-hour is what a time-series database pays in new series (its
index grows by that much, whatever the retention).

Time is compressed by `--speedup` (default 100): process starts, process
lifetimes and the scrape interval are all divided by it, so one hour of
the node is 36 s here. That is honest for this figure because which
series exist depends only on which processes are alive at each scrape,
not on how long a second is: every process is still seen by
lifetime / scrape scrapes (24 at the defaults, 6 min and 15 s), and the
exporter samples 10× per compressed scrape. Real time would matter for
values (byte-seconds), not for series identities. Pids are never reused
(an upper bound: a reused pid on the same GPU with the same labels would
be no new series). A warm-up of one lifetime fills the node first; the
first measured scrape is the baseline.

    scripts/bench/churn.py target/debug/gpumem-exporter target/debug/libfake_nvml.so \\
        [--modes pid,workload,off] [--per-hour 1000] [--per-job 10] \\
        [--lifetime 360] [--scrape 15] [--speedup 100]

Prints one line per mode: series created per hour, series per body (mean
and max), scrapes; and which families created the most. Series per body
overstate the workload counters (`gpu_workload_*_seconds_total`): their
300 s grace after a workload's last process is real time, not divided by
the speedup, so here they outlive every job of the hour.
"""
import argparse
import collections
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

GPUS = 8


def uuid(g):
    return f"GPU-c4{g:06d}-0000-0000-0000-000000000000"


def pod_uid(job):
    h = f"{job:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def cgroup_of(job):
    uid = pod_uid(job).replace("-", "_")
    cid = f"{job:064x}"
    return (
        "0::/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{uid}.slice/cri-containerd-{cid}.scope\n"
    )


def write_proc(root, pid, job):
    cg = cgroup_of(job)
    path = cg.split("::", 1)[1].strip().lstrip("/")
    os.makedirs(os.path.join(root, "cgroupfs", "unified", path), exist_ok=True)
    d = os.path.join(root, str(pid))
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "comm"), "w") as f:
        f.write("python3\n")
    with open(os.path.join(d, "stat"), "w") as f:
        f.write(f"{pid} (python3) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {1000 + pid}\n")
    with open(os.path.join(d, "status"), "w") as f:
        f.write("Name:\tpython3\nUid:\t1000\t1000\t1000\t1000\n")
    with open(os.path.join(d, "cgroup"), "w") as f:
        f.write(cg)
    with open(os.path.join(d, "cmdline"), "w") as f:
        f.write("python3\0")


def scenario(live):
    per_gpu = collections.defaultdict(list)
    for pid, (gpu, used) in live.items():
        per_gpu[gpu].append((pid, used))
    out = ["devices:"]
    for g in range(GPUS):
        procs = sorted(per_gpu[g])
        used = sum(u for _, u in procs)
        out.append(f"  - uuid: {uuid(g)}")
        out.append(f"    memory: {{total: 150000000000, reserved: 0, used: {used}}}")
        if procs:
            out.append("    processes:")
            out += [f"      - {{pid: {p}, used: {u}}}" for p, u in procs]
        else:
            out.append("    processes: []")
    return "\n".join(out) + "\n"


def write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def series_of(body):
    out = set()
    for line in body.splitlines():
        if not line or line.startswith("#") or line.startswith("gpumem_exporter_"):
            continue
        out.add(line.rsplit(" ", 1)[0])
    return out


def family(series):
    return series.split("{", 1)[0]


def run(mode, a):
    rng = random.Random(38)
    tmp = tempfile.mkdtemp(prefix="churn-")
    try:
        proc_root = os.path.join(tmp, "proc")
        os.makedirs(proc_root)
        sc = os.path.join(tmp, "scenario.yaml")
        write_atomic(sc, scenario({}))
        cfg = os.path.join(tmp, "config.yaml")
        with open(cfg, "w") as f:
            f.write(
                "sample_interval: 100ms\nmemory_sample_interval: 100ms\n"
                f"path:\n  procfs: {proc_root}\n  cgroupfs: {proc_root}/cgroupfs\n"
                f"processes:\n  series: {mode}\n  torch_bridge: false\n"
            )
        port = free_port()
        env = dict(os.environ, FAKE_NVML_CONFIG=sc, HOME=tmp)
        for k in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "NODE_NAME"):
            env.pop(k, None)
        ex = subprocess.Popen(
            [a.exporter, "--nvml.library", a.library, "--config.file", cfg,
             "--web.listen-address", f"127.0.0.1:{port}"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            return measure(ex, port, sc, proc_root, rng, a)
        finally:
            ex.terminate()
            ex.wait(timeout=10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def measure(ex, port, sc, proc_root, rng, a):
    speed = a.speedup
    hour = 3600.0 / speed
    life = a.lifetime / speed
    every = a.scrape / speed
    warm = life
    # Process k starts at warm-up + k * gap (uniform starts), the first
    # ones before 0 so the node is full when the hour begins.
    gap = hour / a.per_hour
    first = -int(warm / gap)
    starts = [(k, k * gap) for k in range(first, a.per_hour)]
    deadline = time.time() + 20
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).read()
            break
        except OSError:
            if time.time() > deadline or ex.poll() is not None:
                raise SystemExit("exporter did not start")
            time.sleep(0.1)
    t0 = time.time() + warm
    live, written = {}, set()
    seen, baseline, bodies = set(), None, []
    created = collections.Counter()
    next_scrape = t0
    last = None
    while True:
        now = time.time() - t0
        if now > hour:
            break
        want = {}
        for k, s in starts:
            if s <= now < s + life:
                pid = 100_000 + k - first
                job = (k - first) // a.per_job
                want[pid] = live[pid] if pid in live else (job % GPUS, (1 + rng.randrange(64)) << 26)
                if pid not in written:
                    write_proc(proc_root, pid, job)
                    written.add(pid)
        if want != last:
            write_atomic(sc, scenario(want))
            last = dict(want)
        live = want
        if time.time() >= next_scrape:
            next_scrape += every
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            s = series_of(body)
            bodies.append(len(s))
            if baseline is None:
                baseline = s
                seen |= s
            else:
                new = s - seen
                for x in new:
                    created[family(x)] += 1
                seen |= new
        time.sleep(min(0.02, every / 4))
    return sum(created.values()), bodies, created


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("exporter")
    p.add_argument("library")
    p.add_argument("--modes", default="pid,workload,off")
    p.add_argument("--per-hour", type=int, default=1000)
    p.add_argument("--per-job", type=int, default=10)
    p.add_argument("--lifetime", type=float, default=360.0)
    p.add_argument("--scrape", type=float, default=15.0)
    p.add_argument("--speedup", type=float, default=100.0)
    a = p.parse_args()
    print(
        f"# {a.per_hour} processes/hour, {a.per_job} per job ({a.per_hour // a.per_job} jobs/hour), "
        f"{a.lifetime:.0f} s each, 8 GPUs, scrape every {a.scrape:.0f} s; time x{a.speedup:.0f}"
    )
    for mode in a.modes.split(","):
        n, bodies, created = run(mode, a)
        mean = sum(bodies) / max(1, len(bodies))
        top = ", ".join(f"{f} {c}" for f, c in created.most_common(4))
        print(
            f"{mode:9} created/hour {n:6d}   series/body mean {mean:7.0f} max {max(bodies, default=0):6d}"
            f"   scrapes {len(bodies)}   most: {top}"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
