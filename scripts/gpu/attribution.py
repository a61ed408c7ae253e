#!/usr/bin/env python3
"""Real-GPU attribution check: two torch processes, owned by different users
and placed in cgroups shaped like Kubernetes pods (containerd, systemd
driver), must each get their own series with the right pid, name, user,
container id and pod UID. Needs root (to make cgroups and switch user), an
NVIDIA GPU and python3 with torch.

    scripts/gpu/attribution.py [path/to/gpumem-exporter]   (default: target/release/gpumem-exporter)
"""
import os
import re
import subprocess
import sys
import time
import urllib.request

import gpucheck
from gpucheck import check, failures, series

BIN = gpucheck.exporter("target/release/gpumem-exporter")
PORT = int(os.environ.get("ATTR_PORT", "19878"))


def scrape():
    return gpucheck.scrape(PORT)


# cgroup v2 (unified) root: /sys/fs/cgroup itself, or /sys/fs/cgroup/unified on hybrid hosts.
cg_root = "/sys/fs/cgroup/unified" if os.path.exists("/sys/fs/cgroup/unified/cgroup.procs") else "/sys/fs/cgroup"
pods = [
    # (pod uid, container id, user id, GiB)
    ("11111111-2222-3333-4444-555555555555", "a" * 64, 0, 2),
    ("66666666-7777-8888-9999-000000000000", "b" * 64, 65534, 3),
]
cgroups = []
for uid, cid, _, _ in pods:
    path = os.path.join(
        cg_root, "kubepods.slice", "kubepods-burstable.slice",
        f"kubepods-burstable-pod{uid.replace('-', '_')}.slice", f"cri-containerd-{cid}.scope")
    try:
        os.makedirs(path, exist_ok=True)
        cgroups.append(path)
    except OSError as e:
        print(f"cannot create cgroup {path}: {e}")
        cgroups.append(None)

exporter = subprocess.Popen([BIN, "--web.listen-address", f"127.0.0.1:{PORT}", "--sample-interval", "500ms"],
                            stderr=subprocess.PIPE, text=True)
for _ in range(500):
    try:
        scrape()
        break
    except Exception:
        time.sleep(0.02)

holder_src = """
import os, sys, time, torch
x = torch.empty(int(sys.argv[1]) * (1 << 30), dtype=torch.uint8, device='cuda'); x.fill_(1)
torch.cuda.synchronize(); print(os.getpid(), flush=True); sys.stdin.read()
"""
holders = []
for (uid, cid, user, gib), cg in zip(pods, cgroups):
    def pre(cg=cg, user=user):
        if cg:
            with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        if user:
            os.setgroups([])
            os.setgid(user)
            os.setuid(user)
    env = dict(os.environ, HOME="/tmp")
    p = subprocess.Popen([sys.executable, "-c", holder_src, str(gib)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, preexec_fn=pre, env=env)
    line = p.stdout.readline()
    if not line:
        print(f"holder for uid {user} did not start")
        p.wait()
        continue
    holders.append((int(line.split()[0]), uid, cid, user, gib, p))
    print(f"holder pid {holders[-1][0]}: user {user}, {gib} GiB, cgroup {cg}")
time.sleep(1.5)

text = scrape()
apps = subprocess.check_output(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                                "--format=csv,noheader,nounits"], text=True)
print("\n--- scrape: gpu_process_memory_used_bytes and gpu_process_info ---")
for line in text.splitlines():
    if line.startswith(("gpu_process_memory_used_bytes", "gpu_process_info")):
        print(line)
print("--- nvidia-smi --query-compute-apps ---")
print(apps.strip())
print()
smi = {int(l.split(",")[0]): l for l in apps.strip().splitlines() if l.strip()}
names = {0: "root", 65534: None}
for pid, uid, cid, user, gib, _ in holders:
    used = [(l, v) for l, v in series(text, "gpu_process_memory_used_bytes") if l.get("pid") == str(pid)]
    info = [l for l, _ in series(text, "gpu_process_info") if l.get("pid") == str(pid)]
    check(f"pid {pid} has its own series", len(used) == 1 and len(info) == 1, f"{len(used)} value, {len(info)} info")
    if not used or not info:
        continue
    l, v = used[0]
    i = info[0]
    smi_mib = int(smi[pid].split(",")[2]) if pid in smi else None
    check(f"pid {pid} bytes", smi_mib is not None and abs(v - smi_mib * (1 << 20)) <= (1 << 20),
          f"exporter {v / (1 << 20):.1f} MiB, nvidia-smi {smi_mib} MiB")
    check(f"pid {pid} name", l.get("process") == "python3", f"process={l.get('process')!r}")
    want_user = subprocess.run(["getent", "passwd", str(user)], capture_output=True, text=True).stdout.split(":")[0] or str(user)
    check(f"pid {pid} user", i.get("user") == want_user, f"user={i.get('user')!r}, expected {want_user!r}")
    check(f"pid {pid} container_id", i.get("container_id") == cid, f"{i.get('container_id')!r}")
    check(f"pid {pid} pod_uid", i.get("pod_uid") == uid, f"{i.get('pod_uid')!r}")

for h in holders:
    h[5].stdin.close()
    h[5].wait()
exporter.terminate()
exporter.wait(timeout=5)
for cg in cgroups:
    # Remove the scopes and the slices made above, innermost first.
    path = cg
    while path and path != cg_root:
        try:
            os.rmdir(path)
        except OSError:
            break
        path = os.path.dirname(path)
print(f"\n{len(failures)} failed: {failures}" if failures else "\nall checks passed")
sys.exit(1 if failures else 0)
