"""ddp_fusion: DDP gradient all-reduce fusion for ``torch.compile``.

    import ddp_fusion
    ddp_fusion.config.enabled = True          # or DDP_FUSION=1; before torch.compile
    model = torch.compile(ddp_fusion.DistributedDataParallel(net))

See README.md, docs/user-guide.md and docs/design.md.
"""

# Importing is cheap (torch loads the package at its own import through an entry point,
# _autoload.py), and must never fail: nothing here touches torch internals, and a bad
# DDP_FUSION* value is a warning here and an error at the first DDP model built
# (config.check_env). ``_torch.check_torch()`` runs before ddp_fusion first touches
# internals (``enabled`` set in code, a model built, the pass run), and names any
# internal this torch lacks.
from . import _install, comm_hooks, ops, passes, plan_check
from . import config as _config_module
from .comm_hooks import CommHookError
from .config import config
from .host_group import HostGroupError
from .log import log as _log
from .ops import all_reduce_gradient
from .plan_check import PlanMismatchError
from .settings_check import SettingsMismatchError
from .wrapper import DistributedDataParallel

__all__ = [
    "CommHookError",
    "DistributedDataParallel",
    "HostGroupError",
    "PlanMismatchError",
    "SettingsMismatchError",
    "all_reduce_gradient",
    "config",
    "passes",
    "pending",
]


def pending() -> dict[str, int]:
    """ddp_fusion's per-step state still held: empty between steps, once every backward
    has completed. A backward that failed halfway may leave some; the next one clears it.

    Returns:
        Counts by kind, only those above 0: ``"gathered buckets"`` (kept ``.grad``s
        gathered into a buffer whose wait has not run), ``"plan checks"`` (started, not
        collected), ``"comm hooks in flight"`` (a hook's bucket not yet waited for).
    """
    counts = {"gathered buckets": ops.pending(), "plan checks": plan_check.pending(),
              "comm hooks in flight": comm_hooks.pending()}
    return {kind: n for kind, n in counts.items() if n}

def _apply_environment() -> None:
    for name, error in _config_module.apply_env().items():  # before on_change: installs nothing
        _log.warning(
            "ddp_fusion: %s; ignored, so ddp_fusion.config.%s keeps its default %r. Building a "
            "DDP model in this process raises this error until the variable is fixed or the "
            "setting is set in code", error, name, getattr(config, name),
        )
    _config_module.on_change(_install._on_change)
    try:
        _install.at_import()  # DDP_FUSION=1: torch DDP's constructor now, the rest at first use
    except Exception as e:  # noqa: BLE001 - never fail torch's import; enabled set in code raises it
        _log.warning(
            "ddp_fusion: could not patch torch DDP's constructor at import (%r); ddp_fusion stays "
            "off (setting ddp_fusion.config.enabled = True in code raises the error)", e,
        )
        config.enabled = False


_apply_environment()
