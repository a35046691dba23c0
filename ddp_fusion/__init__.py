"""ddp_fusion: DDP gradient all-reduce fusion for ``torch.compile``.

    import ddp_fusion
    ddp_fusion.config.enabled = True          # or DDP_FUSION=1; before torch.compile
    model = torch.compile(ddp_fusion.DistributedDataParallel(net))

See README.md, docs/user-guide.md and docs/design.md.
"""

# Importing is cheap (torch loads the package at its own import through an entry point,
# _autoload.py): nothing here touches torch internals. ``_torch.check_torch()`` runs
# before ddp_fusion first does (turning ``enabled`` on, building a model, running the
# pass), and names any internal this torch lacks.
from . import config as _config_module
from . import passes
from ._install import _on_change
from .comm_hooks import CommHookError
from .config import config
from .ops import all_reduce_gradient
from .plan_check import PlanMismatchError
from .settings_check import SettingsMismatchError
from .wrapper import DistributedDataParallel

__all__ = [
    "CommHookError",
    "DistributedDataParallel",
    "PlanMismatchError",
    "SettingsMismatchError",
    "all_reduce_gradient",
    "config",
    "passes",
]

_config_module.on_change(_on_change)
for _name, _value in _config_module.from_env().items():
    setattr(config, _name, _value)  # DDP_FUSION=1 installs the pass here
