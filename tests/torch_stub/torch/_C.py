"""torch._C as far as gpumem_bridge uses it: the caching allocator's
out-of-memory observers."""

import os

#: Callables ``(device, alloc, device_allocated, device_free)``, called in
#: order when an allocation fails for good.
_oom_observers = []


def _cuda_attach_out_of_memory_observer(observer):
    # As in torch: the observer is attached to each device's allocator, and
    # before CUDA is initialised there is none, so it is silently lost.
    from . import cuda

    if cuda.is_initialized():
        _oom_observers.append(observer)


if os.environ.get("TORCH_STUB_NO_OOM_OBSERVER"):
    del _cuda_attach_out_of_memory_observer
