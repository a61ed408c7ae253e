"""torch.optim as far as gpumem_bridge uses it: the global optimizer step
post-hooks (``torch.optim.optimizer.register_optimizer_step_post_hook``,
torch >= 2.0) and optimizers whose ``step()`` calls them, as torch's do.

    opt = torch.optim.SGD([], lr=0.1)   # params are ignored
    opt.step()                          # runs the global post hooks

``torch.optim.optimizer`` is not an attribute, as in torch 2.11:
``from torch.optim.optimizer import register_optimizer_step_post_hook``.
TORCH_STUB_NO_STEP_HOOK=1 (read at import) makes a torch without
``register_optimizer_step_post_hook`` (before 2.0).
"""

from . import optimizer  # noqa: F401
from .optimizer import Optimizer

# As in torch 2.11: the submodule is imported but is no attribute of
# torch.optim (``torch.optim.optimizer`` raises AttributeError); it is
# reached through sys.modules or ``from torch.optim.optimizer import ...``.
del optimizer


class SGD(Optimizer):
    def __init__(self, params=(), lr=0.001, **kwargs):
        super().__init__(params, dict(kwargs, lr=lr))


class Adam(Optimizer):
    def __init__(self, params=(), lr=0.001, **kwargs):
        super().__init__(params, dict(kwargs, lr=lr))
