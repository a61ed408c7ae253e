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


def memory_stats(device=None):
    st = _state()
    if not st.get("initialized", True):
        return {}
    i = _index(device)
    stats = dict(st["devices"][i].get("stats", {}))
    # Real torch returns many more keys; the bridge must ignore them.
    stats.setdefault("allocated_bytes.small_pool.current", 0)
    stats.setdefault("num_device_alloc", 0)
    stats["num_ooms"] = stats.get("num_ooms", 0) + _ooms.get(i, 0)
    return stats


def memory_allocated(device=None):
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def memory_reserved(device=None):
    return memory_stats(device).get("reserved_bytes.all.current", 0)


def mem_get_info(device=None):
    """(free, total) as cudaMemGetInfo says."""
    d = _state()["devices"][_index(device)]
    total = d.get("total_memory", _DEFAULT_TOTAL)
    return total - d.get("stats", {}).get("reserved_bytes.all.current", 0), total


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
