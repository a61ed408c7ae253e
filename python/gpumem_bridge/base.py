"""What the parts of the bridge share: the once-per-kind warning, a CUDA
device's identity and memory, and reading the two allocator figures the
step hook needs, cheaply."""

import logging

_log = logging.getLogger("gpumem_bridge")


def normalize_uuid(raw):
    """NVML's spelling of a torch device UUID: ``GPU-`` + the bare UUID,
    lower case; a UUID already prefixed ``GPU-`` or ``MIG-`` is kept."""
    s = str(raw).strip().lower()
    if s.startswith(("gpu-", "mig-")):
        return s[:3].upper() + s[3:]
    return "GPU-" + s


class Warn:
    """Each kind of warning once (per bridge, or per process for the step
    tracker)."""

    def __init__(self):
        self.warned = set()

    def __call__(self, what, msg, *args):
        if what not in self.warned:
            self.warned.add(what)
            _log.warning(msg, *args)


class Device:
    """What never changes about a device: its UUID and total memory."""

    def __init__(self, cuda, i):
        raw = getattr(cuda.get_device_properties(i), "uuid", None)
        self.uuid = normalize_uuid(raw) if raw is not None else None
        self.total = None

    def total_memory(self, cuda, i):
        """cudaMemGetInfo's total, read once (the device is in use, so this
        creates no context)."""
        if self.total is None:
            self.total = int(cuda.mem_get_info(i)[1])
        return self.total

    def limit(self, cuda, i):
        """The allocator's limit in bytes when a per-process memory fraction
        below 1 is set, else None. torch stores the limit as
        ``size_t(fraction * total)`` (cudaMemGetInfo's total) and gives back
        ``limit / total``: rounding undoes that division exactly."""
        get = getattr(cuda, "get_per_process_memory_fraction", None)
        if get is None:  # torch < 2.6
            return None
        f = float(get(i))
        if not 0.0 <= f < 1.0:
            return None
        return int(round(f * self.total_memory(cuda, i)))


def _dig(d, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return 0
        d = d.get(k, 0)
    return d if isinstance(d, int) and not isinstance(d, bool) and d >= 0 else 0


def current(cuda, i):
    """(allocated, reserved) bytes of device ``i`` now, from
    ``memory_stats_as_nested_dict`` (what ``memory_stats`` flattens, so
    cheaper) when torch has it, else ``memory_stats``. Never synchronises,
    never resets a peak."""
    nested = getattr(cuda, "memory_stats_as_nested_dict", None)
    if nested is not None:
        d = nested(i)
        return _dig(d, "allocated_bytes", "all", "current"), _dig(d, "reserved_bytes", "all", "current")
    d = cuda.memory_stats(i)
    return _dig(d, "allocated_bytes.all.current"), _dig(d, "reserved_bytes.all.current")


def used(cuda, i):
    """Whether this process has used device ``i``: allocated or reserved
    there at some point, or failed to (the rule the document uses)."""
    nested = getattr(cuda, "memory_stats_as_nested_dict", None)
    if nested is not None:
        d = nested(i)
        peaks = (_dig(d, "allocated_bytes", "all", "peak"), _dig(d, "reserved_bytes", "all", "peak"), _dig(d, "num_ooms"))
    else:
        d = cuda.memory_stats(i)
        peaks = (_dig(d, "allocated_bytes.all.peak"), _dig(d, "reserved_bytes.all.peak"), _dig(d, "num_ooms"))
    return any(peaks)
