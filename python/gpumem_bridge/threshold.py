"""The in-process memory threshold warning (``GPUMEM_BRIDGE_WARN_AT``).

``GPUMEM_BRIDGE_WARN_AT`` is either a fraction in (0, 1] or a byte size:

* a fraction (``0.9``, ``1``): of the allocator's limit when a per-process
  memory fraction below 1 is set (``torch.cuda.set_per_process_memory_fraction``,
  the ``limit`` of the document), else of the device's total memory
  (``torch.cuda.mem_get_info(i)[1]``, read once per device);
* a byte size: a whole number of bytes (``123456``, ``123456B``), or a
  number with a unit, binary ``KiB MiB GiB TiB`` or decimal ``KB MB GB TB``
  (``70GiB``, ``512MiB``, ``1.5GB``); units are case-insensitive.

A plain number is a fraction when it is at most 1, a byte count when it is
a whole number above 1; anything else (not a number, 0, negative, above 1
with a decimal point and no unit, an unknown unit) is refused: one logging
warning naming the variable and the value, and the feature is off.

Compared against **reserved** bytes, not allocated: reserved is what the
caching allocator holds from CUDA, so it is what the fraction's limit caps
(torch raises an out-of-memory error when reserved would pass it) and what
the other processes on the GPU no longer have; allocated can stay far
below the threshold while the cache fills the card.

Each upward crossing (reserved >= threshold while armed) gives one
:class:`GpuMemoryThresholdWarning` and one call of each ``on_threshold``
callback; then the watch is disarmed ("above") until reserved falls below
``REARM`` (95 %) of the threshold, so a figure hovering at the threshold
does not warn at every step.
"""

import collections
import decimal
import re

ENV = "GPUMEM_BRIDGE_WARN_AT"
#: Re-armed once reserved falls below this share of the threshold.
REARM = 0.95

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
GIB = float(1 << 30)


class GpuMemoryThresholdWarning(UserWarning):
    """Reserved GPU memory reached GPUMEM_BRIDGE_WARN_AT on a device."""


#: What an on_threshold callback gets: ``device`` (CUDA index), ``uuid``
#: (NVML's spelling), ``allocated``, ``reserved``, ``limit`` (bytes, None
#: without a memory fraction), ``threshold`` (bytes), ``crossings`` (on
#: this device so far, this one included). ``._asdict()`` gives a dict.
ThresholdCrossing = collections.namedtuple(
    "ThresholdCrossing", ["device", "uuid", "allocated", "reserved", "limit", "threshold", "crossings"]
)


class Spec:
    """A parsed GPUMEM_BRIDGE_WARN_AT: ``fraction`` or ``nbytes``."""

    def __init__(self, raw, fraction=None, nbytes=None):
        self.raw = raw
        self.fraction = fraction
        self.nbytes = nbytes

    def bytes_for(self, limit, total):
        """The threshold in bytes for a device with this ``limit`` (None
        without one) and ``total`` memory (None when unknown); None when it
        cannot be told."""
        if self.nbytes is not None:
            return self.nbytes
        base = limit if limit is not None else total
        return None if base is None else int(self.fraction * base)

    def __repr__(self):
        return "Spec(%r)" % self.raw


def parse(raw):
    """The Spec of ``raw``, or ValueError saying why not."""
    m = _SIZE.match(raw)
    if not m:
        raise ValueError("not a fraction in (0, 1] nor a byte size")
    number, unit = m.group(1), m.group(2).lower()
    if unit not in _UNITS:
        raise ValueError("unknown unit %r (KiB MiB GiB TiB, KB MB GB TB, or none)" % m.group(2))
    value = decimal.Decimal(number)
    if not unit:
        if 0 < value <= 1:
            return Spec(raw, fraction=float(value))
        if number.isdigit() and value > 1:
            return Spec(raw, nbytes=int(value))
        raise ValueError("a plain number is a fraction in (0, 1] or a whole number of bytes")
    n = int(value * _UNITS[unit])
    if n <= 0:
        raise ValueError("a size of 0 bytes")
    return Spec(raw, nbytes=n)


class Level:
    """One device's watch: its threshold in bytes (None while it cannot be
    told), the limit it was read with, the crossings and whether it is
    disarmed ("above")."""

    __slots__ = ("bytes", "limit", "above", "crossings")

    def __init__(self):
        self.bytes = None
        self.limit = None
        self.above = False
        self.crossings = 0

    def update(self, reserved):
        """True when ``reserved`` is an upward crossing (counted)."""
        if self.bytes is None:
            return False
        if not self.above:
            if reserved >= self.bytes:
                self.above = True
                self.crossings += 1
                return True
        elif reserved < REARM * self.bytes:
            self.above = False
        return False

    def published(self):
        return {"bytes": self.bytes, "crossings": self.crossings, "above": self.above}


def gib(n):
    return "%.2f GiB" % (n / GIB)


def message(spec, c):
    """The warning's text for crossing ``c`` (a ThresholdCrossing). It
    carries the crossing's number, so Python's default filter (each text
    once per location) shows every crossing."""
    if spec.fraction is not None:
        of = "%s=%s of the %s" % (ENV, spec.raw, "limit" if c.limit is not None else "total memory")
    else:
        of = "%s=%s" % (ENV, spec.raw)
    return (
        "gpumem_bridge: cuda:%d (%s) reserved %s >= threshold %s (%s); allocated %s, cache %s "
        "(reserved - allocated), %s; crossing %d on this device"
        % (
            c.device,
            c.uuid or "uuid unknown",
            gib(c.reserved),
            gib(c.threshold),
            of,
            gib(c.allocated),
            gib(max(c.reserved - c.allocated, 0)),
            "limit " + gib(c.limit) if c.limit is not None else "no limit",
            c.crossings,
        )
    )
