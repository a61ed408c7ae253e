"""A stand-in for torch with only what gpumem_bridge uses, for CI without a
GPU. The figures come from the JSON file named by TORCH_STUB_STATE, re-read
on every call, so a test changes them by rewriting the file:

    {"initialized": true,
     "devices": [{"uuid": "8f2c...-...", "total_memory": 150754820096,
                  "stats": {"allocated_bytes.all.current": 1, ...}}],
     "snapshot_pad": 0, "snapshot_fails": false}

What happens inside the process (an out-of-memory error, a memory fraction
set, allocation history switched on) is kept in memory, as torch keeps it:
``torch.cuda.stub_out_of_memory(device)`` (stub only) does what the caching
allocator does when it cannot allocate: counts ``num_ooms``, calls the OOM
observers attached through ``torch._C`` and raises
``torch.cuda.OutOfMemoryError``.

Environment, read at import: TORCH_STUB_NO_OOM_OBSERVER=1 makes a torch
without ``torch._C._cuda_attach_out_of_memory_observer`` (an older release),
TORCH_STUB_NO_FRACTION_GETTER=1 one without
``torch.cuda.get_per_process_memory_fraction`` (before 2.6).
"""

from . import _C  # noqa: F401
from . import cuda  # noqa: F401

# The release the H200 checks ran (its PYTORCH_ALLOC_CONF rules apply).
__version__ = "2.11.0+stub"

OutOfMemoryError = cuda.OutOfMemoryError
