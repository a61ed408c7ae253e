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

Allocations in the process, without rewriting the state file (stub only):
``torch.cuda.stub_allocate(device, nbytes)`` adds ``nbytes`` to the
device's ``allocated_bytes.all.current`` (and ``active``, and the large
pool's when the state has pool keys) and grows ``reserved_bytes.all.current``
by what the cache cannot cover; ``torch.cuda.stub_free(device, nbytes)``
takes them off allocated and puts them in the cache (reserved unchanged)
until ``torch.cuda.empty_cache()``. So reserved = the file's reserved +
the stub's allocated + the stub's cache. Peaks follow. Past the memory
fraction's limit (or the total memory) ``stub_allocate`` fails as torch
does (``stub_out_of_memory``). ``torch.cuda.memory_stats_as_nested_dict``
is ``memory_stats()`` un-flattened. ``torch.optim`` has the global optimizer
step post-hooks and ``SGD``/``Adam`` whose ``step()`` calls them (see
``torch.optim``). A loop retaining 3 MiB per step::

    opt = torch.optim.SGD([], lr=0.1)
    for _ in range(100):
        torch.cuda.stub_allocate(0, 3 << 20)
        opt.step()

Environment, read at import: TORCH_STUB_NO_OOM_OBSERVER=1 makes a torch
without ``torch._C._cuda_attach_out_of_memory_observer`` (an older release),
TORCH_STUB_NO_FRACTION_GETTER=1 one without
``torch.cuda.get_per_process_memory_fraction`` (before 2.6),
TORCH_STUB_NO_STEP_HOOK=1 one without
``torch.optim.optimizer.register_optimizer_step_post_hook`` (before 2.0),
TORCH_STUB_NO_NESTED_STATS=1 one without
``torch.cuda.memory_stats_as_nested_dict``.
"""

from . import _C  # noqa: F401
from . import cuda  # noqa: F401
from . import optim  # noqa: F401

# The release the H200 checks ran (its PYTORCH_ALLOC_CONF rules apply).
__version__ = "2.11.0+stub"

OutOfMemoryError = cuda.OutOfMemoryError
