"""An allocator snapshot written when PyTorch runs out of memory (opt-in).

With ``GPUMEM_BRIDGE_OOM_SNAPSHOT_DIR`` set, each out-of-memory error of
torch's CUDA caching allocator makes the bridge write
``torch.cuda.memory._snapshot()`` (the pickle https://pytorch.org/memory_viz
opens) to that directory as ``gpumem-oom-<pid>-<UTC time>.pickle``, e.g.
``gpumem-oom-4242-20261201T101530.123456Z.pickle``, print its path on
stderr and count it in the published document (``oom_snapshots``, which
the exporter serves as ``gpu_process_torch_oom_snapshots_total``).

How an OOM is seen. torch's allocator calls its out-of-memory observers
(``torch._C._cuda_attach_out_of_memory_observer``; older releases lack it) when an
allocation fails for good, after it has freed its cache and retried, and
before it raises ``torch.cuda.OutOfMemoryError``: in the allocating thread,
with the memory as it is at the failure, whether the program then catches
the error or dies of it. The bridge attaches one observer once CUDA is
initialised (torch attaches observers to each device's allocator, and there
is none before): queued with ``torch.cuda._lazy_call`` when the bridge sees
torch imported first, else at its next publish. Limits, stated:

* OOMs before the observer is attached (between CUDA's initialisation and
  the bridge's next publish, when torch was imported after the bridge
  started and CUDA came up before the bridge looked) are caught up at
  attach time: ``num_ooms`` above 0 then gives one snapshot of the memory
  as it is then, marked "after the fact" on stderr.
* A torch without the observer gets the same after-the-fact snapshot at
  the publish after ``num_ooms`` rose (up to GPUMEM_BRIDGE_INTERVAL late),
  one per publish however many OOMs.
* Only the caching allocator's OOMs: not a ``cudaErrorMemoryAllocation``
  from a library's own ``cudaMalloc`` (cuBLAS workspaces, NCCL), nor the
  ``cudaMallocAsync`` backend's.

Bounds: ``GPUMEM_BRIDGE_OOM_SNAPSHOT_MAX_FILES`` (default 5) files and
``GPUMEM_BRIDGE_OOM_SNAPSHOT_MAX_BYTES`` (default 1 GiB) in the directory,
counting only files named as above, of any process: before a snapshot is
written the oldest are deleted until it fits; a snapshot larger than the
byte bound alone is not written (a warning says so). The bounds count,
and the bridge deletes, only files of its own user: in a directory shared
by several users each keeps its own bounds, and none deletes another's
snapshots. The check and the write hold an flock on the directory, so a
user's processes sharing it keep the bounds together; the lock is taken
without blocking, retried for at most LOCK_WAIT seconds (the observer runs
in the allocating thread, and anyone who can open the directory can hold
its flock), then the snapshot is written without it (a warning says so).
Files are written under a temporary name and renamed, mode 0600, all
relative to the directory's fd (no path is looked up twice).

The directory must be the user's own, and writable by no one else, or
sticky (``/tmp``-like: others cannot delete or rename what is not theirs);
any other directory is refused (a warning, no snapshots), checked when the
bridge starts and again at each snapshot.

Allocation history (``GPUMEM_BRIDGE_OOM_HISTORY=python`` or ``all``, off by
default): ``torch.cuda.memory._record_memory_history(stacks=...,
max_entries=GPUMEM_BRIDGE_OOM_HISTORY_ENTRIES)`` (default 100000), so the
snapshot carries the last allocations and frees with their stack traces
(Python frames; ``all`` adds C++ frames). It costs time on every
allocation and free; docs/torch-bridge.md has what it cost on an H200.
"""

import fcntl
import os
import pickle
import re
import stat
import sys
import threading
import time

__all__ = [
    "Config",
    "Snapshots",
    "snapshot_name",
    "NAME_RE",
    "prepare",
    "ENV_DIR",
    "DEFAULT_MAX_FILES",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_HISTORY_ENTRIES",
]

ENV_DIR = "GPUMEM_BRIDGE_OOM_SNAPSHOT_DIR"
ENV_MAX_FILES = "GPUMEM_BRIDGE_OOM_SNAPSHOT_MAX_FILES"
ENV_MAX_BYTES = "GPUMEM_BRIDGE_OOM_SNAPSHOT_MAX_BYTES"
ENV_HISTORY = "GPUMEM_BRIDGE_OOM_HISTORY"
ENV_HISTORY_ENTRIES = "GPUMEM_BRIDGE_OOM_HISTORY_ENTRIES"
DEFAULT_MAX_FILES = 5
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_HISTORY_ENTRIES = 100000
#: Seconds a snapshot waits for the directory's lock, at most.
LOCK_WAIT = 1.0

#: Names of the snapshot files (the only files the bounds count or delete).
NAME_RE = re.compile(r"^gpumem-oom-(\d+)-(\d{8}T\d{6}\.\d{6})Z\.pickle$")

VIEWER = "https://pytorch.org/memory_viz"


def snapshot_name(pid, t):
    """The file name of a snapshot taken by ``pid`` at Unix time ``t``."""
    micros = int(round(t * 1e6))
    sec, us = divmod(micros, 1000000)
    return "gpumem-oom-%d-%s.%06dZ.pickle" % (pid, time.strftime("%Y%m%dT%H%M%S", time.gmtime(sec)), us)


def _positive_int(environ, name, default, warn):
    raw = environ.get(name, "")
    if not raw:
        return default
    try:
        v = int(raw)
    except ValueError:
        v = 0
    if v < 1:
        warn(name, "gpumem_bridge: %s=%r is not a positive whole number; using %d", name, raw, default)
        return default
    return v


class Config:
    """The snapshot settings from the environment; ``from_env`` gives None
    when snapshots are off."""

    def __init__(self, directory, max_files, max_bytes, history, history_entries):
        self.directory = directory
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.history = history  # None, "python" or "all"
        self.history_entries = history_entries

    @classmethod
    def from_env(cls, environ, warn):
        directory = environ.get(ENV_DIR, "")
        if not directory:
            return None
        history = environ.get(ENV_HISTORY, "").strip().lower()
        if history in ("", "0", "off", "false", "no"):
            history = None
        elif history not in ("python", "all"):
            warn(ENV_HISTORY, "gpumem_bridge: %s=%r is not off, python or all; allocation history stays off", ENV_HISTORY, history)
            history = None
        return cls(
            os.path.abspath(directory),
            _positive_int(environ, ENV_MAX_FILES, DEFAULT_MAX_FILES, warn),
            _positive_int(environ, ENV_MAX_BYTES, DEFAULT_MAX_BYTES, warn),
            history,
            _positive_int(environ, ENV_HISTORY_ENTRIES, DEFAULT_HISTORY_ENTRIES, warn),
        )


class Snapshots:
    """Writes the snapshots of one bridge and counts them per device."""

    def __init__(self, config, warn, on_written=None):
        self.config = config
        self.warn = warn
        self.on_written = on_written
        # Re-entrant: an observer call while this thread writes must not hang.
        self.lock = threading.RLock()
        self.written = {}  # device index -> snapshots written for its OOMs
        self.seen_ooms = {}  # device index -> num_ooms accounted for (no observer)
        self.last_t = 0.0
        os.makedirs(config.directory, mode=0o700, exist_ok=True)
        if not os.access(config.directory, os.W_OK | os.X_OK):
            raise PermissionError("%s is not writable" % config.directory)
        os.close(open_dir(config.directory))

    def count(self, device):
        return self.written.get(device, 0)

    def write(self, torch, device, late=False):
        """Write one snapshot for an OOM on ``device``; its path, or None
        (and a warning) when it could not be written."""
        with self.lock:
            path, size = self._write_locked(torch)
            if path is None:
                return None
            self.written[device] = self.written.get(device, 0) + 1
        when = (
            " (seen after the fact, so it shows the memory now, not at the OOM: %s)"
            % ("the OOM happened before the bridge could attach its observer" if late == "catch-up" else "this torch has no OOM observer")
            if late
            else ""
        )
        # Straight to stderr, not through logging: the path must be seen
        # whatever the program did to its log configuration.
        try:
            sys.stderr.write(
                "gpumem_bridge: PyTorch ran out of memory on cuda:%d; allocator snapshot written to %s (%d bytes)%s; open it at %s\n"
                % (device, path, size, when, VIEWER)
            )
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        if self.on_written is not None:
            self.on_written()
        return path

    def _write_locked(self, torch):
        cfg = self.config
        try:
            data = pickle.dumps(torch.cuda.memory._snapshot())
        except Exception as e:
            self.warn("snapshot", "gpumem_bridge: torch.cuda.memory._snapshot() failed: %r; no OOM snapshot", e)
            return None, 0
        if len(data) > cfg.max_bytes:
            self.warn(
                "too-big",
                "gpumem_bridge: an OOM snapshot of %d bytes exceeds %s=%d; not written",
                len(data),
                ENV_MAX_BYTES,
                cfg.max_bytes,
            )
            return None, 0
        t = max(time.time(), self.last_t + 1e-6)
        self.last_t = t
        name = snapshot_name(os.getpid(), t)
        path = os.path.join(cfg.directory, name)
        tmp = ".%s.tmp" % name
        try:
            dfd = open_dir(cfg.directory)
        except OSError as e:
            self.warn("write", "gpumem_bridge: cannot write OOM snapshots to %s: %s", cfg.directory, e)
            return None, 0
        try:
            if not lock(dfd, LOCK_WAIT):
                self.warn(
                    "lock",
                    "gpumem_bridge: the OOM snapshot directory %s stayed locked by another process for %.1f s; writing the snapshot without the lock (the bounds are kept by this process alone)",
                    cfg.directory,
                    LOCK_WAIT,
                )
            if not self._make_room(dfd, len(data)):
                return None, 0
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as e:
            self.warn("write", "gpumem_bridge: cannot write OOM snapshot %s: %s", path, e)
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            return None, 0
        finally:
            os.close(dfd)  # releases the flock
        return path, len(data)

    def _make_room(self, dfd, size):
        """Delete this user's oldest snapshot files until one of ``size``
        bytes fits both bounds; False (and a warning) if it cannot. Files
        of other users are neither counted nor touched."""
        cfg = self.config
        me = os.geteuid()
        files = []
        with os.scandir(dfd) as it:
            for e in it:
                if NAME_RE.match(e.name) and e.is_file(follow_symlinks=False):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if st.st_uid != me:
                        continue
                    files.append((st.st_mtime_ns, e.name, st.st_size))
        files.sort()
        total = sum(f[2] for f in files)
        while files and (len(files) + 1 > cfg.max_files or total + size > cfg.max_bytes):
            _, name, n = files.pop(0)
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if st.st_uid != me:  # replaced meanwhile: not ours to delete
                    continue
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                pass
            except OSError as e:
                self.warn("prune", "gpumem_bridge: cannot delete the old OOM snapshot %s: %s; not writing a new one", name, e)
                return False
            total -= n
        return len(files) + 1 <= cfg.max_files and total + size <= cfg.max_bytes

    def after_the_fact(self, torch, ooms):
        """At a publish, when torch has no OOM observer: one snapshot if
        ``num_ooms`` (device index -> count) rose since the last look,
        counted on the first device whose count rose."""
        rose = [i for i in sorted(ooms) if ooms[i] > self.seen_ooms.get(i, 0)]
        self.seen_ooms.update(ooms)
        if rose:
            self.write(torch, rose[0], late="no-observer")


def open_dir(path):
    """An fd of the snapshot directory, if it is one this user may trust:
    its own and writable by no one else, or sticky. PermissionError
    (saying why) otherwise."""
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.fstat(dfd)
        sticky = bool(st.st_mode & stat.S_ISVTX)
        others_write = bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
        if not sticky and (st.st_uid != os.geteuid() or others_write):
            raise PermissionError(
                "%s is %s (mode %o, owner uid %d): another user could replace or delete the snapshots; use a directory of your own, or a sticky one"
                % (path, "not this user's own" if st.st_uid != os.geteuid() else "writable by others", st.st_mode & 0o7777, st.st_uid)
            )
    except BaseException:
        os.close(dfd)
        raise
    return dfd


def lock(dfd, wait, sleep=time.sleep, clock=time.monotonic):
    """flock(LOCK_EX) on ``dfd`` without ever blocking: retried with short
    sleeps for at most ``wait`` seconds. True when held."""
    deadline = clock() + wait
    pause = 0.005
    while True:
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError:
            return False
        left = deadline - clock()
        if left <= 0:
            return False
        sleep(min(pause, left))
        pause = min(pause * 2, 0.1)


# The observer is attached once per process and outlives a stop()/start()
# (torch cannot detach it): it writes through whichever Snapshots is active.
_hook_lock = threading.Lock()
_hooked = None  # None: not yet; "observer": attached; "none": this torch has none
_queued = False
_active = None


def after_fork_in_child():
    """In a forked child: another thread may have held the lock, and the
    parent's Snapshots (its counts, its lock) are not the child's."""
    global _hook_lock, _active
    _hook_lock = threading.Lock()
    _active = None


def set_active(snapshots):
    global _active
    _active = snapshots


def hooked():
    """None (not yet), "observer" or "none"."""
    return _hooked


def _observer(device, alloc, device_allocated, device_free):
    # Called by torch's allocator in the thread whose allocation failed,
    # just before it raises OutOfMemoryError: it must never raise itself.
    s = _active
    if s is None:
        return
    try:
        s.write(sys.modules["torch"], int(device))
    except Exception as e:
        try:
            s.warn("observer", "gpumem_bridge: writing the OOM snapshot failed: %r", e)
        except Exception:
            pass


def _hook():
    """Switch on allocation history (if asked) and attach the observer;
    once, after CUDA is initialised."""
    global _hooked
    torch = sys.modules.get("torch")
    s = _active
    if torch is None or s is None:
        return
    with _hook_lock:
        if _hooked is not None:
            return
        cuda = torch.cuda
        if s.config.history is not None:
            try:
                cuda.memory._record_memory_history(
                    enabled="all", context="all", stacks=s.config.history, max_entries=s.config.history_entries
                )
            except Exception as e:
                s.warn("history", "gpumem_bridge: torch.cuda.memory._record_memory_history failed: %r; snapshots carry no history", e)
        attach = getattr(getattr(torch, "_C", None), "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            _hooked = "none"
            s.warn(
                "no-observer",
                "gpumem_bridge: this torch has no out-of-memory observer; OOM snapshots are written at the next publish after an OOM, not at the OOM",
            )
            return
        # OOMs before the observer: read first, so none is counted twice.
        try:
            before = {i: int(cuda.memory_stats(i).get("num_ooms", 0)) for i in range(cuda.device_count())}
        except Exception:
            before = {}
        attach(_observer)
        _hooked = "observer"
    early = [i for i in sorted(before) if before[i] > 0]
    if early:
        s.write(torch, early[0], late="catch-up")


def _hook_at_init():
    # Run by torch.cuda._lazy_init right after CUDA is up: an exception here
    # would become the program's DeferredCudaCallError, so none escapes.
    try:
        _hook()
    except Exception:
        pass


def prepare(torch):
    """At each publish: attach once CUDA is initialised, or queue the
    attach to run when it is."""
    global _queued
    if _hooked is not None:
        return
    cuda = torch.cuda
    if cuda.is_initialized():
        _hook()
    elif not _queued and hasattr(cuda, "_lazy_call"):
        _queued = True
        cuda._lazy_call(_hook_at_init)
