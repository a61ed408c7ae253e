"""torch.cuda as far as gpumem_bridge uses it; see the package docstring."""

import json
import os

from . import memory  # noqa: F401

_DEFAULT_TOTAL = 150754820096


class OutOfMemoryError(RuntimeError):
    """torch.cuda.OutOfMemoryError (torch.OutOfMemoryError)."""


# In-process allocator state, as torch keeps it (not in the state file):
# OOMs counted per device, the limit set by set_per_process_memory_fraction
# (allowed bytes, as torch stores it), the OOM events history recorded.
_ooms = {}
_allowed = {}
_events = {}
# What stub_allocate / stub_free did, per device: bytes allocated, bytes
# freed but kept reserved (the cache), the peaks seen (allocated, reserved).
_alloc = {}
_cache = {}
_peaks = {}
# torch.cuda._lazy_call's queue: run once CUDA is initialised.
_queued_calls = []


def _state():
    path = os.environ.get("TORCH_STUB_STATE")
    if not path:
        return {"initialized": False, "devices": []}
    with open(path) as f:
        return json.load(f)


class _CUuuid:
    """Like torch._C._CUuuid: str() is the bare 8-4-4-4-12 UUID."""

    def __init__(self, s):
        self._s = s

    def __str__(self):
        return self._s


class _CudaDeviceProperties:
    def __init__(self, d):
        self.name = d.get("name", "NVIDIA H200")
        self.total_memory = d.get("total_memory", _DEFAULT_TOTAL)
        if "uuid" in d:
            self.uuid = _CUuuid(d["uuid"])


def _index(device):
    return 0 if device is None else int(device)


def is_available():
    return bool(_state()["devices"])


def is_initialized():
    return bool(_state().get("initialized", True))


def init():
    """Run what _lazy_call queued, once the state says CUDA is up."""
    if is_initialized():
        calls, _queued_calls[:] = list(_queued_calls), []
        for call in calls:
            call()


def _lazy_call(callable, **kwargs):
    if is_initialized():
        callable()
    else:
        _queued_calls.append(callable)


def device_count():
    return len(_state()["devices"])


def get_device_properties(i):
    return _CudaDeviceProperties(_state()["devices"][_index(i)])


def _stats(st, i):
    """The state file's figures of device ``i`` plus what stub_allocate /
    stub_free did in this process (only for a device they touched)."""
    stats = dict(st["devices"][i].get("stats", {}))
    if i in _alloc:
        alloc, cache = _alloc[i], _cache.get(i, 0)
        keys = [("all", alloc, cache)]
        if "allocated_bytes.large_pool.current" in stats:
            keys.append(("large_pool", alloc, cache))
        for pool, a, c in keys:
            stats["allocated_bytes.%s.current" % pool] = stats.get("allocated_bytes.%s.current" % pool, 0) + a
            stats["reserved_bytes.%s.current" % pool] = stats.get("reserved_bytes.%s.current" % pool, 0) + a + c
        stats["active_bytes.all.current"] = stats.get("active_bytes.all.current", 0) + alloc
        peak_a, peak_r = _peaks.get(i, (0, 0))
        peak_a = max(peak_a, stats["allocated_bytes.all.current"])
        peak_r = max(peak_r, stats["reserved_bytes.all.current"])
        _peaks[i] = (peak_a, peak_r)
        stats["allocated_bytes.all.peak"] = max(stats.get("allocated_bytes.all.peak", 0), peak_a)
        stats["reserved_bytes.all.peak"] = max(stats.get("reserved_bytes.all.peak", 0), peak_r)
    return stats


def memory_stats(device=None):
    st = _state()
    if not st.get("initialized", True):
        return {}
    i = _index(device)
    stats = _stats(st, i)
    # Real torch returns many more keys; the bridge must ignore them.
    stats.setdefault("allocated_bytes.small_pool.current", 0)
    stats.setdefault("num_device_alloc", 0)
    stats["num_ooms"] = stats.get("num_ooms", 0) + _ooms.get(i, 0)
    return stats


def memory_stats_as_nested_dict(device=None):
    """What torch.cuda.memory_stats() flattens: ``"a.b.c": v`` is
    ``d["a"]["b"]["c"]``."""
    out = {}
    for key, v in memory_stats(device).items():
        d = out
        parts = key.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = v
    return out


if os.environ.get("TORCH_STUB_NO_NESTED_STATS"):
    del memory_stats_as_nested_dict


def memory_allocated(device=None):
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def memory_reserved(device=None):
    return memory_stats(device).get("reserved_bytes.all.current", 0)


def mem_get_info(device=None):
    """(free, total) as cudaMemGetInfo says."""
    st = _state()
    i = _index(device)
    d = st["devices"][i]
    total = d.get("total_memory", _DEFAULT_TOTAL)
    return total - _stats(st, i).get("reserved_bytes.all.current", 0), total


def set_per_process_memory_fraction(fraction, device=None):
    if not 0 <= fraction <= 1:
        raise ValueError("Invalid fraction value: %s. Allowed range: 0~1" % fraction)
    i = _index(device)
    # torch: allowed_memory_maximum = size_t(fraction * total)
    _allowed[i] = int(fraction * mem_get_info(i)[1])


def get_per_process_memory_fraction(device=None):
    # torch: 1.0 when never set, else allowed / total
    i = _index(device)
    if i not in _allowed:
        return 1.0
    return _allowed[i] / mem_get_info(i)[1]


if os.environ.get("TORCH_STUB_NO_FRACTION_GETTER"):
    del get_per_process_memory_fraction


def stub_out_of_memory(device=None, size=1 << 40):
    """Stub only: what the caching allocator does when an allocation of
    ``size`` bytes fails for good."""
    from .. import _C

    i = _index(device)
    _ooms[i] = _ooms.get(i, 0) + 1
    free, total = mem_get_info(i)
    if memory._history is not None:
        _events.setdefault(i, []).append({"action": "oom", "size": size, "device_free": free})
    for observer in list(_C._oom_observers):
        observer(i, size, _allowed.get(i, total), free)
    raise OutOfMemoryError("CUDA out of memory. Tried to allocate %d bytes (stub)" % size)


def stub_allocate(device=None, nbytes=0):
    """Stub only: allocate ``nbytes`` on ``device`` as the caching allocator
    would, in this process (the state file is not rewritten): allocated
    grows by ``nbytes``; reserved grows by what the cache (bytes freed by
    stub_free) cannot cover. Past the memory fraction's limit, or the
    device's total memory, it fails as torch does (stub_out_of_memory)."""
    i = _index(device)
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    st = _state()
    reserved = _stats(st, i).get("reserved_bytes.all.current", 0)
    from_cache = min(_cache.get(i, 0), nbytes)
    grown = reserved + nbytes - from_cache
    total = st["devices"][i].get("total_memory", _DEFAULT_TOTAL)
    if grown > _allowed.get(i, total) or grown > total:
        stub_out_of_memory(i, nbytes)
    _cache[i] = _cache.get(i, 0) - from_cache
    _alloc[i] = _alloc.get(i, 0) + nbytes
    _stats(st, i)  # the peaks


def stub_free(device=None, nbytes=0):
    """Stub only: free ``nbytes`` that stub_allocate allocated: allocated
    shrinks, reserved stays (the bytes go to the cache) until empty_cache()."""
    i = _index(device)
    nbytes = int(nbytes)
    if not 0 <= nbytes <= _alloc.get(i, 0):
        raise ValueError("stub_free(%d): only %d bytes were stub_allocate-d" % (nbytes, _alloc.get(i, 0)))
    _alloc[i] -= nbytes
    _cache[i] = _cache.get(i, 0) + nbytes


def empty_cache():
    """Give the cache back: reserved falls to allocated (for what
    stub_allocate / stub_free did; the state file's figures stay)."""
    _cache.clear()
