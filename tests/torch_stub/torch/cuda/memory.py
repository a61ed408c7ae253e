"""torch.cuda.memory as far as gpumem_bridge uses it: allocation history and
the snapshot memory_viz reads."""

import sys

#: Arguments of the last _record_memory_history call that switched it on.
_history = None


def _record_memory_history(enabled="all", context="all", stacks="all", max_entries=sys.maxsize, device=None):
    global _history
    if enabled not in (None, "state", "all"):
        raise ValueError("enabled must be None, 'state' or 'all'")
    if stacks not in ("python", "all"):
        raise ValueError("stacks must be 'python' or 'all'")
    _history = None if enabled is None else {
        "enabled": enabled,
        "context": context,
        "stacks": stacks,
        "max_entries": max_entries,
    }


def _snapshot(device=None):
    """Like torch's: ``segments`` (one per device here, from the state's
    reserved bytes) and ``device_traces`` (per device, the OOM events seen
    while history was recorded)."""
    from . import _events, _state

    st = _state()
    if st.get("snapshot_fails"):
        raise RuntimeError("stub: snapshot failed")
    segments = []
    for i, d in enumerate(st["devices"]):
        s = d.get("stats", {})
        segments.append(
            {
                "device": i,
                "address": (i + 1) << 40,
                "total_size": s.get("reserved_bytes.all.current", 0),
                "allocated_size": s.get("allocated_bytes.all.current", 0),
                "segment_type": "large",
                "blocks": [],
            }
        )
    traces = [list(_events.get(i, [])) for i in range(len(st["devices"]))]
    snap = {"segments": segments, "device_traces": traces}
    pad = int(st.get("snapshot_pad", 0))
    if pad:
        snap["stub_pad"] = "x" * pad
    return snap
