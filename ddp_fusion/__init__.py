"""ddp_fusion: DDP gradient all-reduce fusion for ``torch.compile``.

    import ddp_fusion
    ddp_fusion.config.enabled = True          # or DDP_FUSION=1; before torch.compile
    model = torch.compile(ddp_fusion.DistributedDataParallel(net))

See README.md, docs/user-guide.md and docs/design.md.
"""

from . import _torch

_torch.check_torch()  # a torch without an internal ddp_fusion needs fails here, naming it

from . import config as _config_module  # noqa: E402
from . import passes  # noqa: E402
from ._install import _on_change  # noqa: E402
from .comm_hooks import CommHookError  # noqa: E402
from .config import config  # noqa: E402
from .ops import all_reduce_gradient  # noqa: E402
from .plan_check import PlanMismatchError  # noqa: E402
from .wrapper import DistributedDataParallel  # noqa: E402

__all__ = [
    "CommHookError",
    "DistributedDataParallel",
    "PlanMismatchError",
    "all_reduce_gradient",
    "config",
    "passes",
]

_config_module.on_change(_on_change)
for _name, _value in _config_module.from_env().items():
    setattr(config, _name, _value)  # DDP_FUSION=1 installs the pass here
