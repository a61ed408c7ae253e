"""Per-step figures and the threshold watch, process-wide.

A training step ends when the optimizer's ``step()`` returns: torch (>= 2.0)
calls the global post hooks registered with
``torch.optim.optimizer.register_optimizer_step_post_hook`` then, in the
training thread, for every optimizer (two optimizers: two steps). The
bridge registers one such hook (:meth:`Tracker.register`) and
``gpumem_bridge.step()`` does the same for loops without an optimizer.

Each step counts one (a process-wide counter) and, per CUDA device the
process uses, appends ``(step, time.time() rounded to ms, allocated
bytes)`` to a ring of the last ``RING`` steps. Cheap on purpose: one lock,
``torch.cuda.memory_stats_as_nested_dict(i)`` per used device (what
``memory_stats`` flattens), no synchronisation, no peak reset, no device
touched that the process has not used. "Used" is the document's rule
(a peak or an OOM above 0), cached: refreshed by each publish, computed in
the hook only while the cache is empty. Before CUDA is initialised a step
is only counted.

The threshold (module ``threshold``) is checked at each step, against the
figures just read, and at each publish, against the document's. A
crossing seen at a step warns and calls the callbacks in the training
thread (inside ``optimizer.step()``); one seen at a publish does so in the
bridge's thread.
"""

import collections
import logging
import os
import sys
import threading
import time
import warnings

from . import base, threshold

#: Steps kept per device.
RING = 128

_log = logging.getLogger("gpumem_bridge")

# Top-level modules whose frames the warning skips, so that it points at the
# training program's line (the optimizer.step() or gpumem_bridge.step() call).
_INTERNAL = frozenset(("gpumem_bridge", "torch", "threading", "runpy"))


def _stacklevel():
    """warnings.warn's stacklevel, called from here, for the first frame
    outside the bridge, torch and threading; 2 when there is none (the
    bridge's own thread)."""
    f, level = sys._getframe(1), 1
    while f is not None:
        name = f.f_globals.get("__name__") or ""
        if name.split(".", 1)[0] not in _INTERNAL:
            return level
        f, level = f.f_back, level + 1
    return 2


def _hook(optimizer, args, kwargs):
    """torch's global optimizer step post hook."""
    tracker.step()


class Tracker:
    """The process's step counter, rings and threshold watch (one, ``tracker``)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.warn = base.Warn()
        self.callbacks = []
        self.handle = None  # of the registered hook
        self.no_hook = False  # this torch has no global step post hook
        self.reset()

    def reset(self):
        self.total = 0
        self.active = False  # the hook registered or step() called
        self.rings = {}  # CUDA index -> deque of (step, t, allocated)
        self.used = ()  # CUDA indices of the devices used
        self.devices = {}  # CUDA index -> base.Device
        self.spec_read = False
        self.spec = None  # threshold.Spec, None when off
        self.levels = {}  # CUDA index -> threshold.Level

    def after_fork_in_child(self):
        # A new process: its own counts. torch's hooks are inherited, ours too.
        self.lock = threading.Lock()
        self.reset()
        self.active = self.handle is not None

    def threshold_spec(self):
        """GPUMEM_BRIDGE_WARN_AT, parsed once; None when off."""
        if not self.spec_read:
            self.spec_read = True
            raw = os.environ.get(threshold.ENV, "")
            if raw.strip():
                try:
                    self.spec = threshold.parse(raw)
                except ValueError as e:
                    self.warn(
                        "warn-at",
                        "gpumem_bridge: %s=%r is not a fraction in (0, 1] nor a byte size such as 70GiB (%s); no threshold warning",
                        threshold.ENV,
                        raw[:200],
                        e,
                    )
        return self.spec

    # -- the training thread ------------------------------------------------

    def register(self, torch):
        """Register the step hook once (torch fully imported, >= 2.0)."""
        if self.handle is not None or self.no_hook:
            return
        if getattr(getattr(torch, "__spec__", None), "_initializing", False):
            return  # torch is still being imported: at the next publish
        # By sys.modules: torch 2.11's torch.optim has no attribute "optimizer".
        optim = sys.modules.get("torch.optim.optimizer") or getattr(getattr(torch, "optim", None), "optimizer", None)
        register = getattr(optim, "register_optimizer_step_post_hook", None)
        if register is None:
            self.no_hook = True
            _log.debug(
                "gpumem_bridge: torch %s has no torch.optim.optimizer.register_optimizer_step_post_hook (torch < 2.0): "
                "no per-step figures unless the program calls gpumem_bridge.step()",
                getattr(torch, "__version__", "?"),
            )
            return
        handle = register(_hook)
        with self.lock:
            self.handle = handle
            self.active = True

    def unregister(self):
        h, self.handle = self.handle, None
        if h is not None:
            try:
                h.remove()
            except Exception as e:
                self.warn("unhook", "gpumem_bridge: removing the optimizer step hook failed: %r", e)

    def step(self):
        """One step; never raises."""
        try:
            self.record()
        except Exception as e:
            self.warn("step", "gpumem_bridge: recording a training step failed: %r; training goes on", e)

    def record(self):
        crossings = []
        with self.lock:
            self.total += 1
            self.active = True
            torch = sys.modules.get("torch")
            cuda = getattr(torch, "cuda", None) if torch is not None else None
            if cuda is None or not cuda.is_initialized():
                return
            n = self.total
            used = self.used
            if not used:
                used = self.used = tuple(i for i in range(cuda.device_count()) if base.used(cuda, i))
            t = round(time.time(), 3)
            spec = self.threshold_spec()
            for i in used:
                allocated, reserved = base.current(cuda, i)
                ring = self.rings.get(i)
                if ring is None:
                    ring = self.rings[i] = collections.deque(maxlen=RING)
                ring.append((n, t, allocated))
                if spec is not None:
                    level = self.level(i)
                    if level.bytes is None:
                        self.measure(cuda, i, spec, level, None, from_document=False)
                    if level.update(reserved):
                        crossings.append(self.crossing(i, allocated, reserved, level))
        for c in crossings:
            self.emit(spec, c)

    # -- shared ---------------------------------------------------------------

    def device(self, cuda, i):
        dev = self.devices.get(i)
        if dev is None:
            dev = self.devices[i] = base.Device(cuda, i)
        return dev

    def level(self, i):
        level = self.levels.get(i)
        if level is None:
            level = self.levels[i] = threshold.Level()
        return level

    def measure(self, cuda, i, spec, level, limit, from_document):
        """Set ``level``'s threshold in bytes (and limit): with the
        document's ``limit``, else read here (the first steps before a
        publish)."""
        try:
            if not from_document:
                limit = self.device(cuda, i).limit(cuda, i)
            total = None
            if spec.fraction is not None and limit is None:
                total = self.device(cuda, i).total_memory(cuda, i)
            level.limit = limit
            level.bytes = spec.bytes_for(limit, total)
        except Exception as e:
            self.warn("threshold-bytes", "gpumem_bridge: cannot tell the threshold's bytes on cuda:%d: %r", i, e)

    def crossing(self, i, allocated, reserved, level):
        dev = self.devices.get(i)
        return threshold.ThresholdCrossing(
            device=i,
            uuid=dev.uuid if dev is not None else None,
            allocated=allocated,
            reserved=reserved,
            limit=level.limit,
            threshold=level.bytes,
            crossings=level.crossings,
        )

    def emit(self, spec, c):
        """The warning and the callbacks of crossing ``c``, in this thread,
        with no lock held; never raises."""
        try:
            warnings.warn(threshold.message(spec, c), threshold.GpuMemoryThresholdWarning, stacklevel=_stacklevel())
        except Exception as e:  # a warnings filter "error": still never raised into the program
            self.warn("warning-raised", "gpumem_bridge: the threshold warning raised %r; not raised into the program", e)
        for callback in list(self.callbacks):
            try:
                callback(c)
            except Exception as e:
                self.warn("callback", "gpumem_bridge: an on_threshold callback (%r) raised %r; it is still called at later crossings", callback, e)

    # -- the bridge's thread --------------------------------------------------

    def annotate(self, cuda, pairs):
        """Add ``steps`` and ``threshold`` to the document's device entries
        (``pairs``: CUDA index, entry) and take their indices as the used
        devices. Returns (spec, crossings) to be emitted once the caller's
        lock is released."""
        crossings = []
        with self.lock:
            self.used = tuple(i for i, _ in pairs)
            spec = self.threshold_spec()
            for i, entry in pairs:
                if self.active:
                    ring = self.rings.get(i)
                    entry["steps"] = {"total": self.total, "ring": [list(e) for e in ring] if ring else []}
                if spec is None:
                    continue
                self.device(cuda, i)  # its uuid, for the crossing
                level = self.level(i)
                self.measure(cuda, i, spec, level, entry.get("limit"), from_document=True)
                if level.bytes is None:
                    continue
                if level.update(entry["reserved"]):
                    crossings.append(self.crossing(i, entry["allocated"], entry["reserved"], level))
                entry["threshold"] = level.published()
        return spec, crossings


#: The one tracker of this process.
tracker = Tracker()
# Whether or not a bridge runs (step() works without one), a forked child
# starts its own counts, with a lock no other thread of the parent holds.
# Registered at import, so it runs before the bridge restarts in the child.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=tracker.after_fork_in_child)
