"""torch.optim.optimizer as far as gpumem_bridge uses it; see the package
docstring of torch.optim."""

import collections
import itertools
import os

#: handle id -> hook ``(optimizer, args, kwargs)``, as torch keeps them.
_global_optimizer_post_hooks = collections.OrderedDict()
_next_id = itertools.count()


class RemovableHandle:
    """Like torch.utils.hooks.RemovableHandle: ``remove()`` unregisters the
    hook (twice is harmless)."""

    def __init__(self, hooks):
        self.hooks = hooks
        self.id = next(_next_id)

    def remove(self):
        self.hooks.pop(self.id, None)


def register_optimizer_step_post_hook(hook):
    handle = RemovableHandle(_global_optimizer_post_hooks)
    _global_optimizer_post_hooks[handle.id] = hook
    return handle


if os.environ.get("TORCH_STUB_NO_STEP_HOOK"):
    del register_optimizer_step_post_hook


class Optimizer:
    """A step that does nothing but what torch's wrapper around every
    ``step()`` does afterwards: call the optimizer's own post hooks, then
    the global ones, each with ``(optimizer, args, kwargs)``."""

    def __init__(self, params, defaults):
        self.param_groups = [dict(defaults, params=list(params))]
        self.defaults = defaults
        self._optimizer_step_post_hooks = collections.OrderedDict()
        self.steps = 0

    def register_step_post_hook(self, hook):
        handle = RemovableHandle(self._optimizer_step_post_hooks)
        self._optimizer_step_post_hooks[handle.id] = hook
        return handle

    def zero_grad(self, set_to_none=True):
        pass

    def step(self, *args, **kwargs):
        self.steps += 1
        hooks = list(self._optimizer_step_post_hooks.values()) + list(_global_optimizer_post_hooks.values())
        for hook in hooks:
            hook(self, args, kwargs)
        return None
