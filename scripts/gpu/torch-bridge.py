#!/usr/bin/env python3
"""Real-GPU check of the torch bridge ("Real or cache?" in README.md): a real
torch process running gpumem_bridge allocates 4 GiB, frees half (kept in
torch's cache), calls torch.cuda.empty_cache(), then frees everything. At
each step it compares torch.cuda.memory_allocated()/memory_reserved(),
read in the process, with gpu_process_torch_allocated_bytes /
gpu_process_torch_reserved_bytes served by the exporter (must be equal),
and with NVML's per-process bytes (must be >= reserved).

    scripts/gpu/torch-bridge.py [path/to/gpumem-exporter]   # default .dev/gpumem-exporter
    sudo scripts/gpu/torch-bridge.py --nonroot [path/to/gpumem-exporter]

This process is the torch process: it starts gpumem_bridge (from python/),
which sends its figures over the exporter's socket and keeps its memfd.
By default the exporter runs as the same user (the socket in a temporary
directory). With --nonroot (run it as root) the torch process is root's
and the exporter runs as uid 65534 (TORCH_BRIDGE_UID) with no capability
at all (setpriv: no groups, empty bounding and inheritable sets; a copy
of the binary in a temporary directory that user can reach): CapEff 0 is
checked in /proc/<pid>/status, and since such an exporter cannot read a
root process's fds, exact figures can only have come over the socket.
Prints a markdown table; exits 1 if a check fails, 124 past 110 s. Needs
an NVIDIA GPU and python3 with torch.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import gpucheck

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

NONROOT = "--nonroot" in sys.argv
if NONROOT:
    sys.argv.remove("--nonroot")
UID = int(os.environ.get("TORCH_BRIDGE_UID", "65534"))
BIN = gpucheck.exporter(".dev/gpumem-exporter")
PORT = int(os.environ.get("TORCH_BRIDGE_PORT", "19879"))
INTERVAL = 0.5  # exporter sample_interval, seconds
GIB = 1 << 30
MIB = 1 << 20
failures = []

# Never run past two minutes, whatever hangs.
gpucheck.time_limit(110)

if not os.access(BIN, os.X_OK):
    sys.exit(f"exporter binary {BIN} not found or not executable (build it: cargo build --release)")

import torch  # noqa: E402
import gpumem_bridge  # noqa: E402

LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape():
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=5) as r:
        return r.read().decode()


def value(text, name, **labels):
    for line in text.splitlines():
        m = LINE.match(line)
        if m and m.group(1) == name:
            ls = dict(LABEL.findall(m.group(2) or ""))
            if all(ls.get(k) == v for k, v in labels.items()):
                try:
                    return int(m.group(3))
                except ValueError:
                    return int(float(m.group(3)))
    return None


def fmt(b):
    return "—" if b is None else f"{b} ({b / MIB:.1f} MiB)"


def check(name, ok, detail):
    print(f"- {'PASS' if ok else 'FAIL'} {name}: {detail}")
    if not ok:
        failures.append(name)


work = tempfile.mkdtemp(prefix="gpumem-torch-bridge-")
os.chmod(work, 0o755)
sock_dir = os.path.join(work, "run")
os.mkdir(sock_dir, 0o755)
socket_path = os.path.join(sock_dir, "bridge.sock")
config = os.path.join(work, "config.yaml")
with open(config, "w") as f:
    f.write(f"processes:\n  torch_bridge_socket: {socket_path}\n")
os.chmod(config, 0o644)
os.environ["GPUMEM_BRIDGE_SOCKET"] = socket_path
cmd = [BIN]
if NONROOT:
    if os.geteuid() != 0:
        sys.exit("--nonroot: run this as root (the torch process is root's; the exporter drops to an unprivileged uid)")
    exe = os.path.join(work, "gpumem-exporter")
    shutil.copy(BIN, exe)
    os.chmod(exe, 0o755)
    os.chown(sock_dir, UID, UID)
    cmd = ["setpriv", "--reuid", str(UID), "--regid", str(UID), "--clear-groups",
           "--inh-caps=-all", "--bounding-set=-all", "--", exe]
log = tempfile.TemporaryFile(mode="w+")
exporter = subprocess.Popen(
    cmd + ["--config.file", config, "--web.listen-address", f"127.0.0.1:{PORT}",
           "--sample-interval", f"{int(INTERVAL * 1000)}ms"],
    stderr=log,
)


def status_field(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key):
                return " ".join(line.split()[1:])
    return None


try:
    for _ in range(500):
        try:
            scrape()
            break
        except Exception:
            if exporter.poll() is not None:
                log.seek(0)
                sys.exit("exporter exited:\n" + log.read())
            time.sleep(0.02)

    for _ in range(250):
        if os.path.exists(socket_path):
            break
        time.sleep(0.02)
    uid_line, cap_eff = status_field(exporter.pid, "Uid:"), status_field(exporter.pid, "CapEff:")
    print(f"exporter pid {exporter.pid}: Uid {uid_line}, CapEff {cap_eff}; this (torch) process: uid {os.geteuid()}\n")
    if NONROOT:
        check("exporter runs as the unprivileged uid", (uid_line or "").split()[:1] == [str(UID)], uid_line)
        check("exporter has no capability (CapEff 0)", cap_eff == "0000000000000000", cap_eff)
    check("bridge socket listening", os.path.exists(socket_path), socket_path)

    assert gpumem_bridge.start(interval=0.2)
    check("bridge connected to the socket", gpumem_bridge.socket_connected(), socket_path)
    dev = torch.device("cuda", 0)
    torch.zeros(1, device=dev)  # CUDA context
    props = torch.cuda.get_device_properties(dev)
    uuid = gpumem_bridge.normalize_uuid(props.uuid)
    pid = str(os.getpid())
    nvidia = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", uuid],
        capture_output=True, text=True,
    ).stdout.strip()
    print(f"# torch bridge on {props.name}\n")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, driver {nvidia or '?'}, "
          f"str(props.uuid) = `{props.uuid}` → `{uuid}`, pid {pid}, exporter sample_interval {INTERVAL}s\n")

    held = []

    def step_alloc():
        for _ in range(4):
            t = torch.empty(GIB, dtype=torch.uint8, device=dev)
            t.fill_(1)
            held.append(t)

    def step_free_half():
        del held[2:]

    def step_empty_cache():
        torch.cuda.empty_cache()

    def step_free_all():
        held.clear()
        torch.cuda.empty_cache()

    steps = [
        ("CUDA context only", lambda: None),
        ("allocate 4 × 1 GiB", step_alloc),
        ("free half (cache kept)", step_free_half),
        ("torch.cuda.empty_cache()", step_empty_cache),
        ("free all + empty_cache()", step_free_all),
    ]
    rows = []
    for name, action in steps:
        action()
        torch.cuda.synchronize()
        alloc, reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
        gpumem_bridge.publish_now()
        time.sleep(2 * INTERVAL)
        # The figures are exact; allow a few more samples for scheduling.
        deadline = time.monotonic() + 5
        while True:
            text = scrape()
            ex_alloc = value(text, "gpu_process_torch_allocated_bytes", uuid=uuid, pid=pid)
            ex_res = value(text, "gpu_process_torch_reserved_bytes", uuid=uuid, pid=pid)
            nvml = value(text, "gpu_process_memory_used_bytes", uuid=uuid, pid=pid)
            if (ex_alloc, ex_res) == (alloc, reserved) or time.monotonic() > deadline:
                break
            time.sleep(INTERVAL)
        rows.append((name, alloc, ex_alloc, reserved, ex_res, nvml))

    print("| step | torch allocated | exported allocated | torch reserved | exported reserved | NVML per-process bytes | NVML ≥ reserved? |")
    print("|---|---|---|---|---|---|---|")
    for name, alloc, ex_alloc, reserved, ex_res, nvml in rows:
        ok = "yes" if nvml is not None and nvml >= reserved else "NO"
        print(f"| {name} | {fmt(alloc)} | {fmt(ex_alloc)} | {fmt(reserved)} | {fmt(ex_res)} | {fmt(nvml)} | {ok} |")
    print()
    print("NVML − torch reserved (CUDA context, libraries): "
          + ", ".join(f"{name}: {fmt(n - r) if n is not None else '—'}" for name, _, _, r, _, n in rows))
    print()
    for name, alloc, ex_alloc, reserved, ex_res, nvml in rows:
        check(f"{name}: exported allocated == torch", ex_alloc == alloc, f"{ex_alloc} vs {alloc}")
        check(f"{name}: exported reserved == torch", ex_res == reserved, f"{ex_res} vs {reserved}")
        check(f"{name}: NVML ≥ reserved", nvml is not None and nvml >= reserved, f"{nvml} vs {reserved}")
    if rows and rows[0][5] is None:
        print("\nNo NVML series for this pid: is this process in the host's PID namespace?")
    text = scrape()
    dropped = {r: value(text, 'gpumem_exporter_torch_reports_dropped_total', reason=r)
               for r in ('malformed', 'oversized', 'permission', 'identity')}
    print(f"\ngpumem_exporter_torch_reports_total {value(text, 'gpumem_exporter_torch_reports_total')}, "
          f"dropped {dropped}, bridge connections {value(text, 'gpumem_exporter_torch_bridge_connections')}")
    check("one bridge connection", value(text, "gpumem_exporter_torch_bridge_connections") == 1,
          str(value(text, "gpumem_exporter_torch_bridge_connections")))
    check("nothing dropped", all(v == 0 for v in dropped.values()), str(dropped))

    gpumem_bridge.stop()
    deadline = time.monotonic() + 5
    while value(scrape(), "gpu_process_torch_reserved_bytes", pid=pid) is not None and time.monotonic() < deadline:
        time.sleep(INTERVAL)
    check("bridge stopped: torch series gone", value(scrape(), "gpu_process_torch_reserved_bytes", pid=pid) is None, "")
finally:
    exporter.terminate()
    try:
        exporter.wait(timeout=5)
    except subprocess.TimeoutExpired:
        exporter.kill()
    shutil.rmtree(work, ignore_errors=True)

print(f"\n{'ALL PASS' if not failures else 'FAILED: ' + ', '.join(failures)}")
sys.exit(1 if failures else 0)
