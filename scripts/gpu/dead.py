#!/usr/bin/env python3
"""Real-GPU check of memory held by the dead and the orphaned (GPU 0):
what NVML, nvidia-smi and /proc say when a CUDA process dies in awkward
ways, and what the exporter exports then (`gpu_memory_stale_bytes`,
`gpu_process_stale_info`, `gpu_memory_unattributed_bytes`,
`gpu_process_idle_seconds`, `gpu_memory_idle_held_bytes`), about 2 minutes:

    python3 scripts/gpu/dead.py [path/to/gpumem-exporter]   # default .dev/gpumem-exporter
    python3 scripts/gpu/dead.py --dry-run                   # no GPU: the script's own logic
    OUT=DIR ... --cases fork,reparent,zombie,residual --port 19885 --limit 240

Each case starts its own exporter (`--sample-interval 500ms
--processes.idle-after 5s`, 127.0.0.1:19885) and its children (python3,
torch for CUDA; each case's children in a process group of their own,
this script their subreaper so that orphans are reaped), and records,
after at least 3 full samples of the exporter (its
`gpumem_exporter_sample_duration_seconds_count`): NVML's process list
(pynvml `nvmlDeviceGetComputeRunningProcesses`, pids and bytes) and used
memory (`nvmlDeviceGetMemoryInfo` v2, as the exporter reads it),
nvidia-smi's view, `/proc/<pid>/stat` state and parent pid (or "gone"),
and the exporter's stale, unattributed and idle series.

fork:     a CUDA parent holding 8 GiB forks a sleeping child (no CUDA call:
          it only inherits the /dev/nvidia* fds) and is SIGKILLed.
          Observed: does NVML keep listing the dead pid, with what bytes,
          or nothing (and is the memory still used)? Checked: if NVML lists
          it, the exporter says reason="exited" with NVML's bytes (1 MiB)
          and the identity it had alive; if not, nothing stale for it.
          Then the child is killed: the memory must be freed within 10 s.
reparent: a plain python3 parent spawns a CUDA child (4 GiB) and is
          SIGKILLed once the exporter has seen the child: the child's
          ppid changes (check), reason="reparented" with NVML's bytes.
zombie:   a CUDA thread holds 4 GiB while the main thread calls
          pthread_exit (ctypes; `--zombie-exit syscall`: a bare exit
          syscall instead): the leader is `Z` with live threads (check);
          observed whether NVML lists it; if it does, reason="zombie"
          with NVML's bytes.
residual: `used - sum(listed)` with no process and with 3 idle torch
          processes (1, 2, 3 GiB) against `gpu_memory_unattributed_bytes`
          (2 MiB) and against the exporter's own used minus its processes
          (1 MiB); nothing stale; the 3 holders counted in
          `gpu_memory_idle_held_bytes` within 30 s of their start;
          0 after they went.

After the last holder of each case is killed, NVML's used memory is
polled for up to 10 s: it must come back within 64 MiB of the case's
baseline. Lines marked OBSERVED record what the driver did (the
question, not a check).

Prints markdown, also to $OUT/gpu-dead.md (OUT: a new temporary folder
when unset); exits 1 if a check fails, 124 past the limit (240 s).
Needs an NVIDIA GPU with nothing else on it, nvidia-smi, python3 with
torch and pynvml (nvidia-ml-py). `--dry-run` needs none of them: it
checks the argument parsing, the report writer, /proc parsing on live
local processes, the exposition parsing and verdicts on canned text,
and runs each case with CPU stand-ins for the CUDA children (the zombie,
the reparenting and the fork happen for real), printing what it would
run and check.
"""
import argparse
import ctypes
import os
import platform
import select
import signal
import subprocess
import sys
import tempfile
import time

import gpucheck
from gpucheck import check, failures, series

GIB = 1 << 30
MIB = 1 << 20
REASONS = ("exited", "zombie", "uninterruptible", "reparented", "owner_deleted")
CASES = ("fork", "reparent", "zombie", "residual")
FREED_SLACK = 64 * MIB
EXPORTER_ARGS = ["--sample-interval", "500ms", "--processes.idle-after", "5s"]

# ------------------------------------------------------------ child programs
# argv: MODE ("cuda", or "cpu" for the dry run's stand-ins), GiB, extra.
PRELUDE = r'''
import os, sys, time
MODE, SIZE = sys.argv[1], float(sys.argv[2])
def hold(gib):
    if MODE == "cpu":
        return bytearray(1 << 20)
    import torch
    x = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda:0")
    x.fill_(1)
    torch.cuda.synchronize()
    return x
def forever():
    while True:
        time.sleep(3600)
'''

HOLDER = PRELUDE + r'''
x = hold(SIZE)
print("ready", os.getpid(), flush=True)
forever()
'''

# The forked child makes no CUDA call: it only keeps the parent's
# /dev/nvidia* file descriptors open.
FORKER = PRELUDE + r'''
x = hold(SIZE)
child = os.fork()
if child == 0:
    forever()
print("ready", os.getpid(), child, flush=True)
forever()
'''

# No CUDA here: the holder (argv[3], the HOLDER program) is its child.
SPAWNER = PRELUDE + r'''
import subprocess
c = subprocess.Popen([sys.executable, "-u", sys.argv[3], MODE, str(SIZE)], stdout=subprocess.PIPE, text=True)
words = c.stdout.readline().split()
print("ready", os.getpid(), words[1], flush=True)
forever()
'''

# A thread holds the memory; the main thread exits alone, leaving the
# thread-group leader a zombie while the process lives on.
ZOMBIE = PRELUDE + r'''
import ctypes, platform, threading
ready = threading.Event()
def worker():
    x = hold(SIZE)
    ready.set()
    forever()
threading.Thread(target=worker).start()
ready.wait()
print("ready", os.getpid(), flush=True)
libc = ctypes.CDLL(None)  # a CDLL call releases the GIL
if sys.argv[3] == "syscall":
    libc.syscall({"x86_64": 60, "aarch64": 93}[platform.machine()], 0)
else:
    libc.pthread_exit(None)
print("the main thread did not exit", flush=True)
'''

PROGRAMS = {"holder": HOLDER, "forker": FORKER, "spawner": SPAWNER, "zombie": ZOMBIE}


# ------------------------------------------------------------ parsing
def parser():
    ap = argparse.ArgumentParser(description="memory held by dead and orphaned GPU processes")
    ap.add_argument("exporter", nargs="?", default=os.path.join(gpucheck.ROOT, ".dev", "gpumem-exporter"))
    ap.add_argument("--dry-run", action="store_true", help="no GPU: check this script's own logic")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of " + ",".join(CASES))
    ap.add_argument("--port", type=int, default=int(os.environ.get("DEAD_PORT", "19885")))
    ap.add_argument("--limit", type=int, default=240, help="seconds for the whole check")
    ap.add_argument("--zombie-exit", choices=("pthread_exit", "syscall"), default="pthread_exit")
    return ap


def parse_args(argv):
    a = parser().parse_args(argv)
    a.cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    bad = [c for c in a.cases if c not in CASES]
    if bad:
        parser().error(f"unknown case(s) {bad}; known: {','.join(CASES)}")
    return a


def parse_stat(text):
    """State, parent pid and comm from the text of /proc/<pid>/stat
    (fields counted after the last ')', as the exporter does)."""
    head, _, after = text.rpartition(")")
    fields = after.split()
    return {"state": fields[0], "ppid": int(fields[1]), "comm": head.partition("(")[2]}


def proc(pid):
    """/proc/<pid>/stat parsed, with its live thread count; None: gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            st = parse_stat(f.read())
        st["threads"] = len(os.listdir(f"/proc/{pid}/task"))
        return st
    except (FileNotFoundError, ProcessLookupError):
        return None


def proc_text(pid):
    st = proc(pid)
    if st is None:
        return "gone"
    return f"state {st['state']}, ppid {st['ppid']}, comm {st['comm']}, {st['threads']} thread(s)"


def exposition(text, gpu="0"):
    """The series of GPU `gpu` this check reads, from the text format."""
    def on(name):
        return [(l, v) for l, v in series(text, name) if l.get("gpu") == gpu]

    def one(name):
        v = on(name)
        return v[0][1] if v else None

    return {
        "used": one("gpu_memory_used_bytes"),
        "unattributed": one("gpu_memory_unattributed_bytes"),
        "stale_bytes": {l.get("reason"): v for l, v in on("gpu_memory_stale_bytes")},
        "stale_info": [l for l, v in on("gpu_process_stale_info") if v == 1],
        "procs": {l["pid"]: (v, l.get("process", "")) for l, v in on("gpu_process_memory_used_bytes")},
        "idle_s": {l["pid"]: v for l, v in on("gpu_process_idle_seconds")},
        "idle_held": one("gpu_memory_idle_held_bytes"),
        "samples": sum(v for _, v in series(text, "gpumem_exporter_sample_duration_seconds_count")),
    }


def stale_of(ex, pid):
    return [l for l in ex["stale_info"] if l.get("pid") == str(pid)]


def mib(b):
    return "n/a" if b is None else f"{b / MIB:.1f} MiB"


# ------------------------------------------------------------ children and cleanup
GROUPS = []    # process groups of the children (their leaders' pids)
CHILDREN = []  # Popen objects
ADOPTED = []   # orphans this script reaps as their subreaper


def become_subreaper():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except Exception:
        return False


def reap(pid, timeout=10.0):
    """Wait for a child that is not a Popen (an adopted orphan)."""
    end = time.time() + timeout
    while time.time() < end:
        try:
            got, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if got == pid:
            return True
        time.sleep(0.05)
    return False


def kill_groups():
    for g in GROUPS:
        try:
            os.killpg(g, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in CHILDREN:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            print(f"- pid {p.pid} still there 10 s after SIGKILL: {proc_text(p.pid)}")
    for pid in ADOPTED:
        reap(pid, 5)
    GROUPS.clear()
    CHILDREN.clear()
    ADOPTED.clear()


def read_line(p, timeout):
    """One line of a child's stdout, or None at EOF or after `timeout` s."""
    r, _, _ = select.select([p.stdout], [], [], timeout)
    return p.stdout.readline().split() if r else None


class Rig:
    """Children, the exporter and the observers (NVML, nvidia-smi); in a
    dry run the CUDA children are CPU stand-ins and nothing reads a GPU."""

    def __init__(self, args, out):
        self.args, self.out, self.dry = args, out, args.dry_run
        self.mode = "cpu" if self.dry else "cuda"
        self.exp = None
        self.paths = {}
        for name, code in PROGRAMS.items():
            self.paths[name] = os.path.join(out, f"dead-{name}.py")
            with open(self.paths[name], "w") as f:
                f.write(code)
        self.h = None
        if not self.dry:
            import pynvml
            self.nv = pynvml
            pynvml.nvmlInit()
            self.h = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"}

    def spawn(self, program, size, *extra):
        cmd = [sys.executable, "-u", self.paths[program], self.mode, str(size), *map(str, extra)]
        print(f"- run{' (CPU stand-in)' if self.dry else ''}: `{' '.join(os.path.basename(c) for c in cmd)}`")
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=self.env, start_new_session=True)
        GROUPS.append(p.pid)
        CHILDREN.append(p)
        return p

    # -- the exporter
    def start(self, case):
        cmd = [self.args.exporter, "--web.listen-address", f"127.0.0.1:{self.args.port}", *EXPORTER_ARGS]
        print(f"- exporter: `{' '.join(cmd)}`")
        if self.dry:
            return
        log = open(os.path.join(self.out, f"exporter-dead-{case}.log"), "w")
        self.exp = subprocess.Popen(cmd, stderr=log)
        end = time.time() + 20
        while time.time() < end:
            try:
                if exposition(gpucheck.scrape(self.args.port))["samples"] >= 1:
                    return
            except Exception:
                if self.exp.poll() is not None:
                    sys.exit(f"the exporter exited ({self.exp.returncode}); see {log.name}")
            time.sleep(0.05)
        sys.exit("the exporter did not answer in 20 s")

    def stop(self):
        if self.exp is not None:
            self.exp.terminate()
            try:
                self.exp.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.exp.kill()
                self.exp.wait()
            self.exp = None

    def exported(self):
        return None if self.dry else exposition(gpucheck.scrape(self.args.port))

    def wait_samples(self, n):
        """Until the exporter has taken `n` more full samples."""
        if self.dry:
            time.sleep(0.3)
            return
        c0 = self.exported()["samples"]
        end = time.time() + 5 + n
        while time.time() < end and self.exported()["samples"] < c0 + n:
            time.sleep(0.1)

    # -- NVML and nvidia-smi
    def used(self):
        if self.dry:
            return None
        try:
            return self.nv.nvmlDeviceGetMemoryInfo(self.h, version=self.nv.nvmlMemory_v2).used
        except (TypeError, AttributeError, self.nv.NVMLError):  # v1 (used includes reserved)
            return self.nv.nvmlDeviceGetMemoryInfo(self.h).used

    def listed(self):
        """{pid: bytes or None} of NVML's compute processes."""
        if self.dry:
            return None
        return {p.pid: p.usedGpuMemory for p in self.nv.nvmlDeviceGetComputeRunningProcesses(self.h)}

    def smi(self):
        if self.dry:
            return None
        try:
            gpu = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=memory.used", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip()
            apps = subprocess.run(["nvidia-smi", "-i", "0", "--query-compute-apps=pid,process_name,used_memory",
                                   "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
            return f"memory.used {gpu}; compute-apps: {'; '.join(apps.splitlines()) or 'none'}"
        except Exception as e:
            return f"unavailable ({e})"

    def poll_freed(self, baseline, timeout=10.0):
        """(freed, seconds, used): NVML's used back within FREED_SLACK of
        `baseline`, polled every 0.1 s for up to `timeout` s."""
        if self.dry:
            print(f"- would poll NVML used for up to {timeout:.0f} s for the case's baseline + 64 MiB")
            return None
        t0 = time.time()
        while True:
            u = self.used()
            if u <= baseline + FREED_SLACK or time.time() - t0 >= timeout:
                return u <= baseline + FREED_SLACK, time.time() - t0, u

    def snapshot(self, title, pids, n=3):
        """After `n` more full samples: NVML, nvidia-smi, /proc of `pids`
        ({role: pid}) and the exporter, printed; returned as a dict."""
        self.wait_samples(n)
        s = {"listed": self.listed(), "used": self.used(), "smi": self.smi(),
             "proc": {r: proc(p) for r, p in pids.items()}, "ex": self.exported()}
        print(f"\n**{title}**\n")
        if self.dry:
            print("- NVML, nvidia-smi, exporter: not read (dry run)")
        else:
            listed = s["listed"]
            known = [b for b in listed.values() if b is not None]
            s["residual"] = max(0, s["used"] - sum(known)) if len(known) == len(listed) else None
            rows = ", ".join(f"pid {p} {mib(b)}" for p, b in sorted(listed.items())) or "none"
            print(f"- NVML: used {mib(s['used'])}; listed: {rows}; used − Σ listed {mib(s['residual'])}")
            print(f"- nvidia-smi: {s['smi']}")
        for r, p in pids.items():
            print(f"- /proc {r} {p}: {proc_text(p) if s['proc'][r] else 'gone'}")
        ex = s["ex"]
        if ex is not None:
            sb = ", ".join(f"{k}={mib(v)}" for k, v in sorted(ex["stale_bytes"].items())) or "absent"
            si = "; ".join(f"pid={l.get('pid')} process={l.get('process', '')} user={l.get('user', '')} "
                           f"reason={l.get('reason')}" for l in ex["stale_info"]) or "none"
            pr = ", ".join(f"pid {p} ({c}) {mib(b)}" for p, (b, c) in sorted(ex["procs"].items())) or "none"
            idle = ", ".join(f"pid {p} {v:.1f} s" for p, v in sorted(ex["idle_s"].items())) or "none"
            print(f"- exporter ({ex['samples']:.0f} full samples): used {mib(ex['used'])}, "
                  f"unattributed {mib(ex['unattributed'])}; per process: {pr}")
            print(f"- exporter gpu_memory_stale_bytes: {sb}")
            print(f"- exporter gpu_process_stale_info: {si}")
            print(f"- exporter idle: gpu_process_idle_seconds {idle}; gpu_memory_idle_held_bytes {mib(ex['idle_held'])}")
        return s


def verdict(rig, name, ok, detail):
    """A check on NVML's or the exporter's figures (lambdas, evaluated
    only when not a dry run)."""
    if rig.dry:
        print(f"(dry run) would check  {name}")
    else:
        check(name, ok(), detail())


def observed(rig, name, detail):
    if rig.dry:
        print(f"(dry run) would record OBSERVED  {name}")
    else:
        print(f"OBSERVED  {name}: {detail()}")


def near(a, b, tol):
    return a is not None and b is not None and abs(a - b) <= tol


def check_stale(rig, case, s, pid, reason, ident=None):
    """The exporter says `pid` is stale for `reason` with NVML's bytes."""
    def rows():
        return stale_of(s["ex"], pid)
    verdict(rig, f"{case}: gpu_process_stale_info reason={reason} for pid {pid}",
            lambda: [l.get("reason") for l in rows()] == [reason], lambda: f"{rows()}")
    nv = None if rig.dry else s["listed"].get(pid)
    verdict(rig, f"{case}: gpu_memory_stale_bytes{{reason=\"{reason}\"}} = NVML's bytes of pid {pid} (1 MiB)",
            lambda: near(s["ex"]["stale_bytes"].get(reason), nv, MIB),
            lambda: f"exporter {mib(s['ex']['stale_bytes'].get(reason))}, NVML {mib(nv)}")
    if ident is not None:
        verdict(rig, f"{case}: the stale series keeps the identity seen alive",
                lambda: [l.get("process") for l in rows()] == [ident],
                lambda: f"process={[l.get('process') for l in rows()]}, alive: {ident!r}")


def check_residual(rig, case, s):
    ex = s["ex"]
    verdict(rig, f"{case}: unattributed = NVML's used − Σ listed (2 MiB)",
            lambda: near(ex["unattributed"], s["residual"], 2 * MIB),
            lambda: f"exporter {mib(ex['unattributed'])}, NVML {mib(s['residual'])}")


def freed(rig, case, baseline, what):
    got = rig.poll_freed(baseline)
    if got is not None:
        ok, secs, used = got
        check(f"{case}: memory freed after {what}", ok,
              f"NVML used {mib(used)} {secs:.1f} s after, baseline {mib(baseline)}")


def ready(rig, p, words, timeout=90):
    line = read_line(p, timeout)
    if not line or line[0] != "ready" or len(line) != words + 1:
        check("child started", False, f"{os.path.basename(p.args[2])} said {line!r}")
        return None
    return [int(w) for w in line[1:]]


# ------------------------------------------------------------ the cases
def case_fork(rig):
    print("\n## fork: a CUDA parent holding 8 GiB forks a sleeping child and is SIGKILLed\n")
    rig.start("fork")
    baseline = rig.used()
    p = rig.spawn("forker", 8)
    got = ready(rig, p, 2)
    if got is None:
        return
    parent, child = got
    a = rig.snapshot("before the kill", {"parent": parent, "forked child": child})
    ident = None if rig.dry else a["ex"]["procs"].get(str(parent), (None, None))[1]
    observed(rig, "fork: NVML lists the forked child before the kill",
             lambda: f"{child in a['listed']} ({mib(a['listed'].get(child))})")
    os.kill(parent, signal.SIGKILL)
    p.wait(timeout=30)
    ADOPTED.append(child)
    b = rig.snapshot("the parent SIGKILLed and reaped, the forked child alive", {"parent": parent, "forked child": child}, 4)
    check("fork: the parent is gone from /proc", b["proc"]["parent"] is None, proc_text(parent))
    check("fork: the forked child lives on, reparented", b["proc"]["forked child"] is not None
          and b["proc"]["forked child"]["ppid"] != parent, proc_text(child))
    observed(rig, "fork: NVML lists the dead parent's pid",
             lambda: f"{parent in b['listed']}, {mib(b['listed'].get(parent))}; the forked child listed: "
                     f"{child in b['listed']}; used {mib(b['used'])} against {mib(baseline)} before the case "
                     f"({'still held' if b['used'] > baseline + GIB else 'freed'})")
    if rig.dry:
        check_stale(rig, "fork", b, parent, "exited", "<its process label alive>")
    elif parent in b["listed"]:
        check_stale(rig, "fork", b, parent, "exited", ident)
    else:
        check("fork: nothing stale for a pid NVML no longer lists", not stale_of(b["ex"], parent),
              f"{stale_of(b['ex'], parent)}")
    check_residual(rig, "fork", b)
    os.kill(child, signal.SIGKILL)
    reap(child)
    freed(rig, "fork", baseline, "the forked child (the last holder) went")
    c = rig.snapshot("the forked child killed too", {"parent": parent, "forked child": child})
    verdict(rig, "fork: no stale series after", lambda: not c["ex"]["stale_info"]
            and not any(c["ex"]["stale_bytes"].values()), lambda: f"{c['ex']['stale_bytes']} {c['ex']['stale_info']}")


def case_reparent(rig):
    print("\n## reparent: a spawned CUDA child (4 GiB) whose parent is SIGKILLed\n")
    rig.start("reparent")
    baseline = rig.used()
    p = rig.spawn("spawner", 4, rig.paths["holder"])
    got = ready(rig, p, 2)
    if got is None:
        return
    parent, child = got
    a = rig.snapshot("before the kill", {"parent": parent, "CUDA child": child})
    ident = None if rig.dry else a["ex"]["procs"].get(str(child), (None, None))[1]
    check("reparent: the child's ppid is the spawner", a["proc"]["CUDA child"] is not None
          and a["proc"]["CUDA child"]["ppid"] == parent, proc_text(child))
    verdict(rig, "reparent: NVML lists the CUDA child", lambda: child in a["listed"], lambda: f"{a['listed']}")
    verdict(rig, "reparent: nothing stale before the kill", lambda: not a["ex"]["stale_info"],
            lambda: f"{a['ex']['stale_info']}")
    os.kill(parent, signal.SIGKILL)
    p.wait(timeout=30)
    ADOPTED.append(child)
    b = rig.snapshot("the parent SIGKILLed", {"parent": parent, "CUDA child": child}, 4)
    check("reparent: the child's ppid changed", b["proc"]["CUDA child"] is not None
          and b["proc"]["CUDA child"]["ppid"] != parent, proc_text(child))
    observed(rig, "reparent: NVML after the parent's death",
             lambda: f"child listed {child in b['listed']} with {mib(b['listed'].get(child))}")
    check_stale(rig, "reparent", b, child, "reparented", ident)
    check_residual(rig, "reparent", b)
    os.kill(child, signal.SIGKILL)
    reap(child)
    freed(rig, "reparent", baseline, "the child went")


def case_zombie(rig):
    how = rig.args.zombie_exit
    print(f"\n## zombie: the main thread exits ({how}) while a CUDA thread holding 4 GiB lives on\n")
    rig.start("zombie")
    baseline = rig.used()
    p = rig.spawn("zombie", 4, "syscall" if how == "syscall" else "pthread")
    got = ready(rig, p, 1)
    if got is None:
        return
    pid, = got
    s = rig.snapshot("the main thread gone", {"process": pid}, 4)
    st = s["proc"]["process"]
    check("zombie: the leader is Z with live threads", st is not None and st["state"] == "Z" and st["threads"] >= 2,
          proc_text(pid))
    observed(rig, "zombie: NVML lists the zombie leader's pid", lambda: f"{pid in s['listed']}, {mib(s['listed'].get(pid))}")
    if rig.dry or pid in s["listed"]:
        check_stale(rig, "zombie", s, pid, "zombie")
    check_residual(rig, "zombie", s)
    os.kill(pid, signal.SIGKILL)
    p.wait(timeout=30)
    freed(rig, "zombie", baseline, "the process was killed")


def case_residual(rig):
    print("\n## residual: used − Σ listed with no process and with 3 idle torch processes\n")
    rig.start("residual")
    a = rig.snapshot("no process", {})
    baseline = a["used"]
    if not rig.dry:
        observed(rig, "residual: NVML lists with no process", lambda: f"{a['listed'] or 'none'}")
        check_residual(rig, "residual idle", a)
        ex = a["ex"]
        check("residual idle: unattributed = the exporter's used − its processes (1 MiB)",
              near(ex["unattributed"], max(0, ex["used"] - sum(b for b, _ in ex["procs"].values())), MIB),
              f"unattributed {mib(ex['unattributed'])}, used {mib(ex['used'])}, processes {len(ex['procs'])}")
    procs = [rig.spawn("holder", g) for g in (1, 2, 3)]
    pids = []
    for p in procs:
        got = ready(rig, p, 1)
        if got is None:
            return
        pids.append(got[0])
    t0 = time.time()
    if not rig.dry:
        end = time.time() + 10
        while time.time() < end and not all(str(q) in rig.exported()["procs"] for q in pids):
            time.sleep(0.1)
    b = rig.snapshot("3 torch processes holding 1, 2 and 3 GiB", {f"holder {i + 1}": q for i, q in enumerate(pids)})
    if not rig.dry:
        check_residual(rig, "residual 3 processes", b)
        ex = b["ex"]
        check("residual 3 processes: unattributed = the exporter's used − its processes (1 MiB)",
              near(ex["unattributed"], max(0, ex["used"] - sum(v for v, _ in ex["procs"].values())), MIB),
              f"unattributed {mib(ex['unattributed'])}, used {mib(ex['used'])}, "
              f"Σ {mib(sum(v for v, _ in ex['procs'].values()))}")
        check("residual 3 processes: the exporter's bytes per pid = NVML's (1 MiB)",
              all(near(ex["procs"].get(str(q), (None,))[0], b["listed"].get(q), MIB) for q in pids),
              ", ".join(f"{q}: {mib(ex['procs'].get(str(q), (None,))[0])} / {mib(b['listed'].get(q))}" for q in pids))
        check("residual 3 processes: nothing stale", not ex["stale_info"] and not any(ex["stale_bytes"].values())
              and len(ex["stale_bytes"]) == len(REASONS), f"{ex['stale_bytes']} {ex['stale_info']}")
        observed(rig, "residual: 3 contexts against none",
                 lambda: f"used − Σ listed {mib(b['residual'])} with 3, {mib(a['residual'])} with none")
        held = sum(b["listed"].get(q) or 0 for q in pids)
        idle = None
        while time.time() - t0 < 30:
            idle = rig.exported()
            if near(idle["idle_held"], held, MIB):
                break
            time.sleep(0.5)
        check("residual 3 processes: idle held = the 3 holders' bytes within 30 s (idle after 5s)",
              idle is not None and near(idle["idle_held"], held, MIB),
              f"gpu_memory_idle_held_bytes {mib(idle and idle['idle_held'])} {time.time() - t0:.1f} s after they were ready, "
              f"holders {mib(held)}; idle seconds {idle and idle['idle_s']}")
    else:
        print("(dry run) would check  residual: unattributed against NVML and the exporter's own figures, "
              "per-pid bytes, nothing stale, gpu_memory_idle_held_bytes = the holders' within 30 s")
    kill_groups()
    if baseline is not None:
        freed(rig, "residual", baseline, "the 3 processes were killed")
    c = rig.snapshot("the 3 processes killed", {f"holder {i + 1}": q for i, q in enumerate(pids)})
    check("residual: the holders are gone from /proc", all(v is None for v in c["proc"].values()),
          ", ".join(f"{q}: {proc_text(q)}" for q in pids))
    verdict(rig, "residual: gpu_memory_idle_held_bytes 0 after they went",
            lambda: c["ex"]["idle_held"] == 0, lambda: f"{mib(c['ex']['idle_held'])}")


# ------------------------------------------------------------ dry-run self-checks
CANNED = """# HELP gpu_memory_stale_bytes x
# TYPE gpu_memory_stale_bytes gauge
gpu_memory_used_bytes{gpu="0",uuid="GPU-a"} 9663676416
gpu_memory_used_bytes{gpu="1",uuid="GPU-b"} 1
gpu_memory_unattributed_bytes{gpu="0",uuid="GPU-a"} 536870912
gpu_memory_stale_bytes{gpu="0",uuid="GPU-a",reason="exited"} 8589934592
gpu_memory_stale_bytes{gpu="0",uuid="GPU-a",reason="zombie"} 0
gpu_memory_stale_bytes{gpu="0",uuid="GPU-a",reason="uninterruptible"} 0
gpu_memory_stale_bytes{gpu="0",uuid="GPU-a",reason="reparented"} 0
gpu_memory_stale_bytes{gpu="0",uuid="GPU-a",reason="owner_deleted"} 0
gpu_memory_stale_bytes{gpu="1",uuid="GPU-b",reason="exited"} 7
gpu_process_stale_info{gpu="0",uuid="GPU-a",pid="4242",process="python3",user="root",namespace="",pod="",container="",slurm_job="",reason="exited"} 1
gpu_process_memory_used_bytes{gpu="0",uuid="GPU-a",pid="4242",process="python3"} 8589934592
gpu_process_memory_used_bytes{gpu="0",uuid="GPU-a",pid="77",process="we \\"q\\" (x)"} 536870912
gpu_process_idle_seconds{gpu="0",uuid="GPU-a",pid="77",process="x",user="root",namespace="",pod="",container="",slurm_job=""} 12.5
gpu_memory_idle_held_bytes{gpu="0",uuid="GPU-a"} 536870912
gpumem_exporter_sample_duration_seconds_count 17
"""


def dry_selfchecks(out, report):
    print("\n## the script's own logic\n")
    a = parse_args([])
    check("args: defaults", a.cases == list(CASES) and a.port == int(os.environ.get("DEAD_PORT", "19885"))
          and a.limit == 240 and not a.dry_run and a.exporter.endswith(os.path.join(".dev", "gpumem-exporter")),
          f"{vars(a)}")
    a = parse_args(["/x/gpumem-exporter", "--dry-run", "--cases", "zombie, fork", "--port", "1", "--zombie-exit", "syscall"])
    check("args: given", a.exporter == "/x/gpumem-exporter" and a.dry_run and a.cases == ["zombie", "fork"]
          and a.port == 1 and a.zombie_exit == "syscall", f"{vars(a)}")
    try:
        with open(os.devnull, "w") as devnull:
            err, sys.stderr = sys.stderr, devnull
            try:
                parse_args(["--cases", "nope"])
            finally:
                sys.stderr = err
        check("args: an unknown case is refused", False, "accepted")
    except SystemExit as e:
        check("args: an unknown case is refused", e.code == 2, f"exit {e.code}")

    st = parse_stat("123 (a) b (c)) S 1 123 123 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 99 0 0")
    check("/proc stat: a comm with spaces and parentheses", st == {"state": "S", "ppid": 1, "comm": "a) b (c)"}, f"{st}")
    sl = subprocess.Popen(["sleep", "30"], start_new_session=True)
    GROUPS.append(sl.pid)
    CHILDREN.append(sl)
    time.sleep(0.2)
    st = proc(sl.pid)
    check("/proc stat: a live local process", st is not None and st["state"] == "S" and st["ppid"] == os.getpid()
          and st["comm"] == "sleep" and st["threads"] == 1, f"{st}")
    mine = proc(os.getpid())
    check("/proc stat: this process", mine is not None and mine["state"] == "R" and mine["ppid"] == os.getppid(), f"{mine}")
    sl.kill()
    sl.wait()
    check("/proc stat: a reaped pid is gone", proc(sl.pid) is None, proc_text(sl.pid))

    ex = exposition(CANNED)
    check("exposition: GPU 0's stale bytes by reason", ex["stale_bytes"] == {"exited": 8 * GIB, "zombie": 0,
          "uninterruptible": 0, "reparented": 0, "owner_deleted": 0}, f"{ex['stale_bytes']}")
    check("exposition: stale info", [(l["pid"], l["process"], l["reason"]) for l in stale_of(ex, 4242)]
          == [("4242", "python3", "exited")] and stale_of(ex, 77) == [], f"{ex['stale_info']}")
    check("exposition: used, unattributed, idle, samples", ex["used"] == 9 * GIB and ex["unattributed"] == 512 * MIB
          and ex["idle_held"] == 512 * MIB and ex["idle_s"] == {"77": 12.5} and ex["samples"] == 17
          and ex["procs"]["77"][0] == 512 * MIB, f"{ex}")
    check("exposition: GPU 1 kept apart", exposition(CANNED, "1")["stale_bytes"] == {"exited": 7}, "")

    # The verdicts on canned figures: a fake rig that is not dry.
    class Fake:
        dry = False
    n = len(failures)
    s = {"ex": ex, "listed": {4242: 8 * GIB}, "residual": 512 * MIB}
    check_stale(Fake, "canned", s, 4242, "exited", "python3")
    check_residual(Fake, "canned", s)
    passed = len(failures) == n
    s_bad = {"ex": ex, "listed": {4242: 8 * GIB + 2 * MIB}, "residual": 600 * MIB}
    check_stale(Fake, "canned, off by 2 MiB (must FAIL)", s_bad, 4242, "exited", "python2")
    check_residual(Fake, "canned, off by 88 MiB (must FAIL)", s_bad)
    wrong = failures[n:]
    del failures[n:]
    check("verdicts: canned agreement passes, canned disagreement fails",
          passed and len(wrong) == 3, f"{len(wrong)} FAIL lines expected 3: {wrong}")

    # The report writer: what was printed so far is in the file.
    sys.stdout.flush()
    with open(report) as f:
        text = f.read()
    check("report: the markdown file holds what was printed", "## the script's own logic" in text
          and "PASS  exposition: GPU 1 kept apart" in text, f"{report}, {len(text)} characters")


# ------------------------------------------------------------ main
def main():
    args = parse_args(sys.argv[1:])
    out = os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-dead-")
    os.makedirs(out, exist_ok=True)
    report = os.path.join(out, "gpu-dead-dry-run.md" if args.dry_run else "gpu-dead.md")
    gpucheck.time_limit(args.limit)
    expire = signal.getsignal(signal.SIGALRM)

    def expire_all(*a):
        kill_groups_quick()
        expire(*a)

    def terminate(sig, _):
        kill_groups_quick()
        print(f"FAIL  stopped by signal {sig}")
        os._exit(128 + sig)

    signal.signal(signal.SIGALRM, expire_all)
    signal.signal(signal.SIGINT, terminate)
    signal.signal(signal.SIGTERM, terminate)
    gpucheck.report_to(report)
    sub = become_subreaper()

    print(f"# memory held by the dead and the orphaned, {os.uname().nodename}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
    print(f"- {'DRY RUN: no GPU, CPU stand-ins for the CUDA children; ' if args.dry_run else ''}"
          f"exporter {args.exporter}; cases {','.join(args.cases)}; limit {args.limit} s; report {report}")
    print(f"- python {platform.python_version()} on {platform.machine()}; this script is the children's "
          f"subreaper: {sub}")
    if not args.dry_run:
        if not os.access(args.exporter, os.X_OK):
            sys.exit(f"exporter binary {args.exporter} not found or not executable (build it: cargo build --release)")
        print("```")
        print(subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,memory.used,driver_version",
                              "--format=csv"], capture_output=True, text=True).stdout.strip())
        print("```")
    else:
        dry_selfchecks(out, report)
    rig = Rig(args, out)
    if not args.dry_run:
        print(f"- NVML memory info: {'v2' if hasattr(rig.nv, 'nvmlMemory_v2') else 'v1 (used includes reserved)'}")
    for case in args.cases:
        t = time.time()
        try:
            {"fork": case_fork, "reparent": case_reparent, "zombie": case_zombie, "residual": case_residual}[case](rig)
        except Exception as e:  # the case is lost, not the others
            check(f"{case}: ran to the end", False, f"{type(e).__name__}: {e}")
        finally:
            kill_groups()
            rig.stop()
        print(f"\n_{case}: {time.time() - t:.1f} s_")
    print(f"\n{'all checks pass' if not failures else 'FAILED: ' + ', '.join(failures)}")
    sys.exit(1 if failures else 0)


def kill_groups_quick():
    for g in GROUPS:
        try:
            os.killpg(g, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


if __name__ == "__main__":
    try:
        main()
    finally:
        kill_groups_quick()
