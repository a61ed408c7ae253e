"""Publish PyTorch's CUDA caching-allocator figures to gpumem-exporter.

Enable it with one line::

    import gpumem_bridge; gpumem_bridge.start()

or without changing the program::

    python -m gpumem_bridge train.py --lr 0.1
    python -m gpumem_bridge -m my.package.main --lr 0.1

About once a second a daemon thread reads ``torch.cuda.memory_stats(i)``
for every CUDA device this process has used and sends the figures to
gpumem-exporter over its Unix socket (module ``channel``:
``/run/gpumem-exporter/bridge.sock``, or ``GPUMEM_BRIDGE_SOCKET``); the
kernel, not the document, tells the exporter which process sent them, so
neither side needs a privilege. For exporters before the socket it also
keeps them in an anonymous memory file (``memfd_create("gpumem-bridge")``),
which such an exporter reads through ``/proc/<pid>/fd`` (that takes
``CAP_SYS_PTRACE`` there). Nothing is listened on and no file is written
to disk.

Opt-in, ``GPUMEM_BRIDGE_OOM_SNAPSHOT_DIR``: when torch runs out of memory
the bridge writes ``torch.cuda.memory._snapshot()`` to that directory,
bounded in files and bytes, and says where on stderr (module ``oom``).

Per-step figures, with no code change (module ``steps``): once torch is
imported the bridge registers torch's global optimizer step post hook
(torch >= 2.0), so each ``optimizer.step()`` counts a step and records the
allocated bytes of each device used, in a ring of the last 128 steps;
``gpumem_bridge.step()`` does the same for loops without an optimizer.
Opt-in, ``GPUMEM_BRIDGE_WARN_AT`` (a fraction of the memory limit or of the
device, or a size such as ``70GiB``; module ``threshold``): one
:class:`GpuMemoryThresholdWarning` and a call of each ``on_threshold``
callback when reserved bytes reach it, re-armed below 95 % of it.

Protocol, version 1 (the exporter's side is ``src/attribute/torch/``):

* Over the socket each document is one ``SOCK_SEQPACKET`` packet,
  ``gpumem-bridge 1\n`` and the document (module ``channel``).
* The memfd is named ``gpumem-bridge``, so ``/proc/<pid>/fd/<n>`` reads
  ``/memfd:gpumem-bridge (deleted)``. It holds one UTF-8 JSON document of at
  most 64 KiB::

      {"v": 1, "seq": 7,
       "allocator": {"backend": "native", "expandable_segments": false,
                     "max_split_size": null},
       "devices": [
        {"uuid": "GPU-8f2c...", "allocated": 0, "reserved": 0,
         "allocated_peak": 0, "reserved_peak": 0, "active": 0,
         "inactive_split": 0, "alloc_retries": 0, "ooms": 0,
         "pools": {"large": {"allocated": 0, "reserved": 0,
                             "inactive_split": 0, "segments": 0},
                   "small": {...the same four...}},
         "limit": 75377410048, "oom_snapshots": 0,
         "steps": {"total": 1200, "ring": [[1073, 1767225600.125, 4194304],
                                           ..., [1200, 1767225662.5, 536870912]]},
         "threshold": {"bytes": 67839669043, "crossings": 1, "above": true}}]}

  The first eight device fields are required non-negative integers. The
  rest are optional, each all or nothing when present: ``pools`` (from
  ``memory_stats()``' ``*.large_pool.current`` / ``*.small_pool.current``
  and ``segment.*.current``), ``limit`` (bytes, only when a per-process
  memory fraction below 1 is set), ``oom_snapshots`` (only when
  GPUMEM_BRIDGE_OOM_SNAPSHOT_DIR is on) and, for the whole process,
  ``allocator`` (parsed from PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF,
  see ``allocconf``; absent when that is malformed; ``max_split_size`` in
  bytes or null for unlimited). Other fields are ignored. There is no pid:
  the document is about the process holding it.
* Added within version 1 (an exporter that does not know them ignores
  them; a bridge without them leaves them out), per device entry, each all
  or nothing:

  - ``steps``, present once the optimizer step hook is registered or
    ``step()`` was called (then ``total`` may be 0 and ``ring`` empty):
    ``total``, int, the process-wide count of steps (every device entry
    has the same); ``ring``, the last steps recorded on this device, at
    most 128, oldest first, each ``[step, t, allocated]``: ``step`` an int
    strictly increasing along the ring (the value of ``total`` at that
    step; steps taken before the device was used have no entry), ``t``
    the step's end as float Unix seconds (ms resolution), ``allocated``
    int bytes (``allocated_bytes.all.current`` then). A document over 64
    KiB has its rings cut to their last 64 entries, then 16, then emptied
    (``"ring": []``, ``total`` kept), so rings never stop a publish.
  - ``threshold``, present only while GPUMEM_BRIDGE_WARN_AT is valid and
    its bytes are known for the device: ``bytes``, int, the threshold;
    ``crossings``, int, upward crossings of reserved bytes so far (a
    counter); ``above``, bool, true from a crossing until reserved falls
    below 95 % of ``bytes`` (the warning is disarmed meanwhile).
* Each document is written into a fresh memfd, sealed (no write, grow or
  shrink) and then ``dup2``-ed onto the same fd number, so a reader opening
  the fd sees one whole, immutable document, never a half-written one. The
  exporter ignores an unsealed file (a document still being written).
* ``uuid`` is the device's UUID as NVML spells it: torch gives the bare
  ``8-4-4-4-12`` string (``str(get_device_properties(i).uuid)``; older
  releases gave a string already prefixed), the bridge adds ``GPU-``. Under
  MIG, CUDA's UUID is the MIG instance's, which NVML spells ``MIG-...``; the
  exporter compares the part after the prefix, so both match. Joining by
  UUID (never by index) keeps ``CUDA_VISIBLE_DEVICES`` remapping harmless.

The bridge never imports torch itself: if the program has not imported
torch, or has not initialised CUDA, it publishes an empty device list.
Only the standard library is used. Linux only (memfd), Python >= 3.8.
"""

import fcntl
import json
import logging
import os
import sys
import threading

from . import allocconf, channel, oom, steps
from .base import Device as _Device
from .base import Warn as _Warn
from .base import normalize_uuid
from .threshold import GpuMemoryThresholdWarning, ThresholdCrossing

__all__ = [
    "start",
    "stop",
    "running",
    "publish_now",
    "document",
    "fd",
    "socket_connected",
    "step",
    "on_threshold",
    "GpuMemoryThresholdWarning",
    "ThresholdCrossing",
    "normalize_uuid",
    "NAME",
]
__version__ = "0.4.0"

#: Name of the memfd; the exporter looks for ``/memfd:<NAME> (deleted)``.
NAME = "gpumem-bridge"
#: Protocol version, the ``v`` field.
VERSION = 1
#: The exporter drops (and counts) larger documents.
MAX_BYTES = 64 * 1024
#: Seconds between documents, unless GPUMEM_BRIDGE_INTERVAL says otherwise.
DEFAULT_INTERVAL = 1.0
_MIN_INTERVAL, _MAX_INTERVAL = 0.05, 60.0

# torch.cuda.memory_stats() key -> document field.
STAT_KEYS = (
    ("allocated", "allocated_bytes.all.current"),
    ("reserved", "reserved_bytes.all.current"),
    ("allocated_peak", "allocated_bytes.all.peak"),
    ("reserved_peak", "reserved_bytes.all.peak"),
    ("active", "active_bytes.all.current"),
    ("inactive_split", "inactive_split_bytes.all.current"),
    ("alloc_retries", "num_alloc_retries"),
    ("ooms", "num_ooms"),
)
#: Per pool: document field -> memory_stats() key (with the pool's name).
POOLS = ("large", "small")
POOL_KEYS = (
    ("allocated", "allocated_bytes.%s_pool.current"),
    ("reserved", "reserved_bytes.%s_pool.current"),
    ("inactive_split", "inactive_split_bytes.%s_pool.current"),
    ("segments", "segment.%s_pool.current"),
)

_log = logging.getLogger("gpumem_bridge")
_lock = threading.Lock()
_bridge = None
_fork_hook_installed = False


def _int(stats, key):
    v = stats.get(key, 0)
    return int(v) if isinstance(v, (int, float)) and v >= 0 else 0


def _pools(stats):
    """The pools' figures, or None unless every one is there."""
    out = {}
    for pool in POOLS:
        p = {}
        for field, key in POOL_KEYS:
            v = stats.get(key % pool)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                return None
            p[field] = v
        out[pool] = p
    return out


class AllocatorSettings:
    """The allocator settings, read once: torch reads its variable once,
    when CUDA's allocator starts, so later changes to os.environ do not
    count."""

    def __init__(self, warn=None):
        self.warn = warn or _Warn()
        self.read = False
        self.value = None

    def get(self, torch):
        if not self.read:
            self.read = True
            name, raw = allocconf.source(os.environ, getattr(torch, "__version__", ""))
            try:
                self.value = allocconf.parse(raw or "")
            except allocconf.Malformed as e:
                self.value = None
                self.warn(
                    "allocconf",
                    "gpumem_bridge: %s=%r is malformed (%s); torch will refuse it too. The allocator settings are not published; every other figure is",
                    name,
                    raw[:200],
                    e,
                )
        return self.value


def document(seq=0, devices=None, snapshots=None, settings=None, warn=None):
    """The document this process would publish now, as a dict, without the
    per-step figures and the threshold (which the bridge adds).

    ``devices`` caches device index -> _Device (properties never change);
    ``snapshots``: the OOM snapshots written (oom.Snapshots), if on;
    ``settings``: the AllocatorSettings read once per bridge."""
    return _collect(seq, devices, snapshots, settings, warn)[0]


def _collect(seq, devices, snapshots, settings, warn):
    """document()'s work: (doc, torch.cuda or None, [(CUDA index, entry)])."""
    warn = warn or _Warn()
    out = []
    pairs = []
    doc = {"v": VERSION, "seq": seq, "devices": out}
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    if cuda is None or not cuda.is_initialized():
        return doc, None, pairs
    devices = {} if devices is None else devices
    settings = settings or AllocatorSettings(warn)
    allocator = settings.get(torch)
    if allocator is not None:
        doc["allocator"] = allocator
    for i in range(cuda.device_count()):
        stats = cuda.memory_stats(i)
        entry = {field: _int(stats, key) for field, key in STAT_KEYS}
        written = snapshots.count(i) if snapshots is not None else 0
        # A device this process never allocated on (nor failed to): not "used".
        if entry["reserved_peak"] == 0 and entry["allocated_peak"] == 0 and entry["ooms"] == 0 and written == 0:
            continue
        if i not in devices:
            devices[i] = _Device(cuda, i)
        dev = devices[i]
        if dev.uuid is None:
            continue  # torch too old to tell the UUID: cannot be joined
        entry = dict(uuid=dev.uuid, **entry)
        pools = _pools(stats)
        if pools is not None:
            entry["pools"] = pools
        try:
            limit = dev.limit(cuda, i)
        except Exception as e:  # the rest of the document still goes out
            warn("limit", "gpumem_bridge: reading the per-process memory fraction failed: %r", e)
            limit = None
        if limit is not None:
            entry["limit"] = limit
        if snapshots is not None:
            entry["oom_snapshots"] = written
        out.append(entry)
        pairs.append((i, entry))
    return doc, cuda, pairs


#: Ring lengths tried, in turn, when a document is too large; then none.
_TRIM = (64, 16, 0)


def _encode(doc, warn):
    """The document's bytes, at most MAX_BYTES when shortening the step
    rings can make it so (the last 64 entries, then 16, then none; the step
    total stays); larger only when it is too large without rings."""
    data = json.dumps(doc, separators=(",", ":")).encode()
    rings = [e["steps"] for e in doc["devices"] if "steps" in e]
    for keep in _TRIM:
        if len(data) <= MAX_BYTES or not rings:
            break
        for s in rings:
            s["ring"] = s["ring"][-keep:] if keep else []
        data = json.dumps(doc, separators=(",", ":")).encode()
        if len(data) <= MAX_BYTES:
            warn("trim", "gpumem_bridge: the document passed %d bytes; step rings shortened to their last %d entries (0: emptied)", MAX_BYTES, keep)
    return data


def _sealed_memfd(data):
    """A new memfd named NAME holding ``data``, sealed against any change."""
    fd = os.memfd_create(NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        fcntl.fcntl(
            fd,
            fcntl.F_ADD_SEALS,
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL,
        )
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Bridge:
    def __init__(self, interval):
        self.interval = interval
        self.fd = None
        self.seq = 0
        self.devices = {}
        self.warn = _Warn()
        self.settings = AllocatorSettings(self.warn)
        self.publish_lock = threading.Lock()
        self.stopped = threading.Event()
        self.wake = threading.Event()  # an OOM snapshot: publish its count now
        self.snapshots = None
        path = channel.path_from_env(os.environ)
        self.channel = channel.Channel(path, self.warn) if path is not None else None
        cfg = oom.Config.from_env(os.environ, self.warn)
        if cfg is not None:
            try:
                self.snapshots = oom.Snapshots(cfg, self.warn, on_written=self.wake.set)
            except OSError as e:
                self.warn("oom-dir", "gpumem_bridge: %s=%r cannot be used (%s); no OOM snapshots", oom.ENV_DIR, cfg.directory, e)
        oom.set_active(self.snapshots)
        try:
            self.publish()  # the memfd exists before start() returns
        except BaseException:
            oom.set_active(None)
            raise
        self.thread = threading.Thread(target=self._run, name="gpumem-bridge", daemon=True)
        self.thread.start()

    def publish(self):
        spec, crossings = None, ()
        with self.publish_lock:
            if self.stopped.is_set():
                return
            torch = sys.modules.get("torch")
            if torch is not None:
                try:
                    steps.tracker.register(torch)
                except Exception as e:
                    self.warn("step-hook", "gpumem_bridge: cannot register the optimizer step hook: %r; no per-step figures", e)
            if self.snapshots is not None and torch is not None:
                try:
                    oom.prepare(torch)
                except Exception as e:
                    self.warn("oom-hook", "gpumem_bridge: cannot watch for out-of-memory errors: %r; no OOM snapshots", e)
            try:
                if self.snapshots is not None and oom.hooked() == "none" and torch.cuda.is_initialized():
                    # No observer in this torch: look at num_ooms instead.
                    cuda = torch.cuda
                    ooms = {i: _int(cuda.memory_stats(i), "num_ooms") for i in range(cuda.device_count())}
                    self.snapshots.after_the_fact(torch, ooms)
                doc, cuda, pairs = _collect(self.seq + 1, self.devices, self.snapshots, self.settings, self.warn)
                spec, crossings = steps.tracker.annotate(cuda, pairs)
            except Exception as e:  # keep the last document; training goes on
                self.warn("collect", "gpumem_bridge: reading torch.cuda.memory_stats failed: %r", e)
                return
            data = _encode(doc, self.warn)
            if len(data) <= MAX_BYTES:
                self.write(data)
                self.seq += 1
            else:
                self.warn("size", "gpumem_bridge: document of %d bytes exceeds %d; not published", len(data), MAX_BYTES)
        # Crossings seen now: warned about in this thread (the bridge's,
        # or the caller's of publish_now), with no lock held.
        for c in crossings:
            try:
                steps.tracker.emit(spec, c)
            except BaseException as e:  # e.g. SystemExit from a callback: the thread goes on
                self.warn("emit", "gpumem_bridge: the threshold callbacks raised %r", e)

    def write(self, data):
        """Publish raw bytes: over the socket, and in the memfd (replaced
        atomically)."""
        if self.channel is not None:
            self.channel.send(data)
        fd = _sealed_memfd(data)
        if self.fd is None:
            self.fd = fd
            return
        try:
            os.dup2(fd, self.fd, inheritable=False)
        finally:
            os.close(fd)

    def _run(self):
        while True:
            self.wake.wait(self.interval)
            self.wake.clear()
            if self.stopped.is_set():
                return
            try:
                self.publish()
            except Exception as e:
                self.warn("publish", "gpumem_bridge: publishing failed: %r", e)

    def close(self):
        with self.publish_lock:
            self.stopped.set()
            steps.tracker.unregister()
            self.wake.set()
            if oom._active is self.snapshots:
                oom.set_active(None)
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            if self.channel is not None:
                self.channel.close()


def _interval_from_env():
    raw = os.environ.get("GPUMEM_BRIDGE_INTERVAL", "")
    try:
        v = float(raw) if raw else DEFAULT_INTERVAL
    except ValueError:
        _log.warning("gpumem_bridge: GPUMEM_BRIDGE_INTERVAL=%r is not a number; using %s", raw, DEFAULT_INTERVAL)
        v = DEFAULT_INTERVAL
    return min(max(v, _MIN_INTERVAL), _MAX_INTERVAL)


def _after_fork_in_child():
    # The publishing thread does not survive fork, and the inherited fd
    # holds the parent's figures: close it, and start afresh for the child
    # (e.g. a worker forked before CUDA was initialised, then using a GPU).
    global _bridge, _lock
    _lock = threading.Lock()  # another thread may have held it at fork time
    oom.after_fork_in_child()  # (steps resets itself: its own at-fork hook)
    old, _bridge = _bridge, None
    if old is None:
        return
    if old.fd is not None:
        try:
            os.close(old.fd)
        except OSError:
            pass
    if old.channel is not None:
        old.channel.forget_after_fork()
    try:
        start(old.interval)
    except Exception as e:
        _log.warning("gpumem_bridge: could not restart in the forked child: %r", e)


def start(interval=None):
    """Start publishing (idempotent). Returns True when running.

    ``interval``: seconds between documents (default: the environment
    variable GPUMEM_BRIDGE_INTERVAL, else 1). On a platform without memfd
    (not Linux) it warns and returns False; it never raises into the
    training program for that."""
    global _bridge, _fork_hook_installed
    with _lock:
        if _bridge is not None:
            return True
        if not hasattr(os, "memfd_create") or not hasattr(fcntl, "F_ADD_SEALS"):
            _log.warning("gpumem_bridge: needs Linux and Python >= 3.8 (memfd_create); not started")
            return False
        iv = _interval_from_env() if interval is None else min(max(float(interval), _MIN_INTERVAL), _MAX_INTERVAL)
        try:
            _bridge = _Bridge(iv)
        except OSError as e:
            steps.tracker.unregister()  # its first publish may have hooked
            _log.warning("gpumem_bridge: cannot create the memfd: %s; not started", e)
            return False
        if not _fork_hook_installed:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _fork_hook_installed = True
        return True


def stop():
    """Stop publishing and close the memfd: the exporter's series vanish."""
    global _bridge
    with _lock:
        b, _bridge = _bridge, None
    if b is not None:
        b.close()


def running():
    return _bridge is not None


def publish_now():
    """Publish a document immediately (e.g. right after a phase change)."""
    b = _bridge
    if b is not None:
        b.publish()


def fd():
    """The fd number of the published memfd, or None."""
    b = _bridge
    return None if b is None else b.fd


def socket_connected():
    """Whether the bridge holds a connection to the exporter's socket."""
    b = _bridge
    return b is not None and b.channel is not None and b.channel.connected


def step():
    """Count one training step and record the figures of each device used
    (allocated bytes, and the threshold check): what the optimizer step
    hook does, for loops without a torch optimizer (or a torch older than
    2.0). Works whether the bridge runs or not; returns nothing; never
    raises. With an optimizer, do not call it too: each call is a step."""
    steps.tracker.step()


def on_threshold(callback):
    """Call ``callback(crossing)`` at each upward crossing of
    GPUMEM_BRIDGE_WARN_AT (after the GpuMemoryThresholdWarning).
    ``crossing`` is a ThresholdCrossing (``device``, ``uuid``,
    ``allocated``, ``reserved``, ``limit``, ``threshold``, ``crossings``;
    ``._asdict()`` for a dict). It runs in the training thread when the
    crossing is seen at an optimizer step (or step()), in the bridge's
    thread when seen at a publish. An exception it raises is logged once
    and never reaches the program. Returns ``callback`` (a decorator too)."""
    steps.tracker.callbacks.append(callback)
    return callback
