"""The caching-allocator settings that change what the figures mean, parsed
from ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` the way torch
parses them (``c10/core/AllocatorConfig.cpp``), so that what the bridge
publishes is what the allocator runs with. Only three settings leave this
module, as a small dict; the variable itself is never published:

* ``backend``: ``native`` or ``cudaMallocAsync`` (torch's ``async`` is the
  same backend). With ``cudaMallocAsync`` most of ``memory_stats()`` is
  zero: the pools and segment counts say nothing.
* ``expandable_segments``: ``True``/``False`` (exactly so; torch refuses
  ``true``). Expandable segments grow instead of being split, so the
  segment count stays small and inactive-split bytes mean less.
* ``max_split_size``: bytes (``max_split_size_mb`` × 1 MiB), or None
  (unlimited, the default): blocks larger than this are never split.

The grammar, as torch lexes it: the characters ``, : [ ]`` are tokens of
their own, spaces are dropped, anything else runs into a word; options are
``name:value`` separated by commas (a trailing comma is allowed); a value
is a word or a bracketed list (``roundup_power2_divisions:[256:1,>:4]``).
Options other than the three above are skipped without a look at their
value, so a newer torch's options do not make the whole setting
"malformed". A value torch itself refuses for one of the three (e.g.
``expandable_segments:true``, ``max_split_size_mb:16``) is malformed here
too: such a process fails at its first CUDA allocation anyway.

Not seen: settings changed at run time with
``torch.cuda.memory._set_allocator_settings()``.
"""

__all__ = ["Malformed", "lex", "parse", "source"]

_MIB = 1 << 20
#: torch: max_split_size_mb must be greater than kLargeBuffer (20 MiB).
_MIN_SPLIT_MB = 20
#: torch reads the number with std::stoi.
_INT_MAX = (1 << 31) - 1
_PUNCT = (",", ":", "[", "]")
_BACKENDS = {"native": "native", "cudaMallocAsync": "cudaMallocAsync", "async": "cudaMallocAsync"}
# Settings this module reads; every other option's value is skipped.
_READ = ("backend", "expandable_segments", "max_split_size_mb")


class Malformed(ValueError):
    """The setting cannot be what the allocator runs with."""


def lex(text):
    """torch's tokens of ``text``."""
    tokens, word = [], []
    for c in text:
        if c in _PUNCT:
            if word:
                tokens.append("".join(word))
                word = []
            tokens.append(c)
        elif c != " ":
            word.append(c)
    if word:
        tokens.append("".join(word))
    return tokens


def _apply(out, key, value):
    if key == "backend":
        if value not in _BACKENDS:
            raise Malformed("backend must be native, async or cudaMallocAsync, not %r" % value)
        out["backend"] = _BACKENDS[value]
    elif key == "expandable_segments":
        if value not in ("True", "False"):
            raise Malformed("expandable_segments must be True or False, not %r" % value)
        out["expandable_segments"] = value == "True"
    elif key == "max_split_size_mb":
        if not (value.isascii() and value.isdigit()):
            raise Malformed("max_split_size_mb must be a whole number of MiB, not %r" % value)
        mb = int(value)
        if mb <= _MIN_SPLIT_MB or mb > _INT_MAX:
            raise Malformed("max_split_size_mb must be above %d (and fit an int), not %d" % (_MIN_SPLIT_MB, mb))
        out["max_split_size"] = mb * _MIB


def parse(text):
    """``{"backend", "expandable_segments", "max_split_size"}`` for the
    setting ``text`` (empty: torch's defaults); raises Malformed."""
    out = {"backend": "native", "expandable_segments": False, "max_split_size": None}
    t = lex(text)
    i, n = 0, len(t)
    while i < n:
        key = t[i]
        if key in _PUNCT:
            raise Malformed("expected an option name, found %r" % key)
        if i + 1 >= n or t[i + 1] != ":":
            raise Malformed("expected ':' after %r" % key)
        i += 2
        if i >= n:
            raise Malformed("%r has no value" % key)
        if t[i] == "[":
            j = i + 1
            while j < n and t[j] != "]":
                if t[j] == "[":
                    raise Malformed("nested '[' in the value of %r" % key)
                j += 1
            if j >= n:
                raise Malformed("unclosed '[' in the value of %r" % key)
            if key in _READ:
                raise Malformed("%r takes one value, not a list" % key)
            i = j
        elif t[i] in _PUNCT:
            raise Malformed("%r has no value" % key)
        elif key in _READ:
            _apply(out, key, t[i])
        i += 1
        if i < n:
            if t[i] != ",":
                raise Malformed("expected ',' after the value of %r, found %r" % (key, t[i]))
            i += 1
    return out


def _at_least(version, want):
    """Whether torch ``version`` (e.g. ``2.11.0+cu130``) is at least
    ``want`` (major, minor); an unreadable version counts as new."""
    parts = str(version).split("+")[0].split(".")
    try:
        have = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return True
    return have >= want


def source(environ, torch_version):
    """``(name, value)`` of the variable torch reads, or ``(None, None)``.

    torch >= 2.9 reads PYTORCH_ALLOC_CONF and, only when that is unset,
    PYTORCH_CUDA_ALLOC_CONF (deprecated there); older releases read only
    PYTORCH_CUDA_ALLOC_CONF."""
    names = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF") if _at_least(torch_version, (2, 9)) else ("PYTORCH_CUDA_ALLOC_CONF",)
    for name in names:
        if name in environ:
            return name, environ[name]
    return None, None
