"""What an averaged (``avg``) bucket is divided by in this step.

The group size, read from the live group at run time (nothing about the group is baked
into a compiled graph), unless a ``join()`` context with
``divide_by_initial_world_size=False`` sets the number of ranks still training for the
step (join.py): a 0-d tensor on the model's device, the all-reduced count, never read
on the host. The plan guard (plan_check.py) and the eager reducer read it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _native

# group name -> divisor of the group's "avg" buckets, while a join context sets it
_divisors: dict[str, int | torch.Tensor] = {}


def divisor(group: dist.ProcessGroup) -> int | torch.Tensor:
    """What an ``avg`` bucket of ``group`` is divided by in this step: a number, or a
    0-d tensor on the group's device."""
    return _divisors.get(group.group_name, group.size())


def joining(group_name: str) -> bool:
    """Whether an enabled join context has set the divisor of group ``group_name``'s
    step (join.py: from an active rank's first forward in it until every rank joined)."""
    return group_name in _divisors


def set_divisor(group: dist.ProcessGroup, value: int | torch.Tensor | None) -> None:
    """Set (None: clear) the divisor of ``group``'s ``avg`` buckets. One per group: two
    models on one group inside join contexts with different
    ``divide_by_initial_world_size`` would share it (not supported)."""
    native = _native.loaded()
    if native is not None:  # (its steady plan checks hold the divisor: the Python ops mark them again)
        native.forget(group.group_name)
    if value is None:
        _divisors.pop(group.group_name, None)
    else:
        _divisors[group.group_name] = value
