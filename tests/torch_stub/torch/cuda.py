"""torch.cuda as far as gpumem_bridge uses it; see the package docstring."""

import json
import os


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
        self.total_memory = d.get("total_memory", 150754820096)
        if "uuid" in d:
            self.uuid = _CUuuid(d["uuid"])


def is_available():
    return bool(_state()["devices"])


def is_initialized():
    return bool(_state().get("initialized", True))


def device_count():
    return len(_state()["devices"])


def get_device_properties(i):
    return _CudaDeviceProperties(_state()["devices"][i])


def memory_stats(device=None):
    st = _state()
    if not st.get("initialized", True):
        return {}
    i = 0 if device is None else int(device)
    stats = dict(st["devices"][i].get("stats", {}))
    # Real torch returns many more keys; the bridge must ignore them.
    stats.setdefault("allocated_bytes.small_pool.current", 0)
    stats.setdefault("num_device_alloc", 0)
    return stats


def memory_allocated(device=None):
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def memory_reserved(device=None):
    return memory_stats(device).get("reserved_bytes.all.current", 0)
