"""A stand-in for torch with only what gpumem_bridge uses, for CI without a
GPU. The figures come from the JSON file named by TORCH_STUB_STATE, re-read
on every call, so a test changes them by rewriting the file:

    {"initialized": true,
     "devices": [{"uuid": "8f2c...-...", "stats": {"allocated_bytes.all.current": 1, ...}}]}
"""

from . import cuda  # noqa: F401

__version__ = "0.0.0+stub"
