"""DDP's ``join()`` (uneven inputs) for ddp_fusion models, compiled or not.

torch's :class:`~torch.distributed.algorithms.join.Join` runs the protocol: a rank that
has run out of inputs loops in ``Join.__exit__``, each round all-reducing a zero that
matches the ``Join.notify_join_context`` all-reduce of the ranks still training, then
calling every joinable's ``main_hook`` to shadow that training step's collectives.
What ddp_fusion adds is the two sides of one step, kept identical:

active rank, at each forward while its join context is enabled (run eagerly, outside
the compiled forward: :func:`prelude`)::

    all_reduce(1)                       Join.notify_join_context (+ the throw check)
    all_reduce(MAX rank), broadcast     buffers, from the highest active rank
                                        (only when buffers are synced this forward)
    all_reduce([1, sync, compiled])     how many ranks are active; whether this
                                        step's backward reduces, and how
    ... backward: the plan check and the buckets (compiled), or the eager reducer's
    buckets (+ the used-parameter bitmap with find_unused_parameters)

joined rank, in :class:`JoinHook.main_hook`: the same collectives with zeros, the
buckets taken from the plan the active ranks run (compiled: their plan hash arrives
in the plan check's all-gather, the plan itself from the store, where every rank
publishes a plan the first time it runs it; uncompiled: its own eager reducer's
buckets, which are every rank's). ``divide_by_initial_world_size=False`` divides by
the number of active ranks counted in the third all-reduce, read by the bucket
scaling at run time (``verify.divisor``), so no recompile. ``post_hook`` broadcasts the
parameters (and buffers) from the last rank to join, as torch DDP does.

Forwards inside an enabled join context therefore have a graph break at their start
(the prelude), and the in-graph buffer broadcast is replaced by the prelude's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from . import _torch, verify
from .config import config

if TYPE_CHECKING:
    from .ddp import GradSync

log = logging.getLogger("ddp_fusion")

def _find_common_rank(group: dist.ProcessGroup, device: torch.device, candidate: bool) -> int:
    """The highest group rank among those that pass ``candidate`` (torch DDP's rule)."""
    mine = dist.get_rank(group) if candidate else -1
    t = torch.tensor([mine], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


@torch.compiler.disable
def prelude(sync: GradSync, joinable: Any, buffers: list[torch.Tensor] | None) -> None:
    """An active rank's part of one step inside an enabled join context (above)."""
    Join.notify_join_context(joinable)
    group, state = sync.group, sync.state
    # what no_sync() asked for, decided now for this forward's backward (torch DDP's
    # rule; the joined ranks learn it below)
    state.require_backward_grad_sync = bool(joinable.require_backward_grad_sync)
    if buffers and state.forward_param_sync:
        src = _find_common_rank(group, sync.device, True)
        _broadcast_from(buffers, group, src)
    syncs = torch.is_grad_enabled() and state.require_backward_grad_sync
    flags = torch.tensor([1.0, float(syncs), float(config.enabled)], device=sync.device)
    dist.all_reduce(flags, group=group)
    active = int(flags[0].item())
    verify.set_divisor(group, group.size() if state.join_divide_by_initial else active)


class DDPJoinHook(JoinHook):
    """A joined rank's shadow of the active ranks' steps (module docstring)."""

    def __init__(self, sync: GradSync, divide_by_initial_world_size: bool) -> None:
        if not isinstance(divide_by_initial_world_size, bool):
            raise TypeError(
                "join(): divide_by_initial_world_size must be True or False, got "
                f"{divide_by_initial_world_size!r}"
            )
        self.sync = sync
        sync.state.join_divide_by_initial = divide_by_initial_world_size
        self.shadowed_steps = 0

    def main_hook(self) -> None:
        sync = self.sync
        group, state, device = sync.group, sync.state, sync.device
        buffers = sync.buffers_of()
        if buffers and state.forward_param_sync:
            src = _find_common_rank(group, device, False)
            _broadcast_from(buffers, group, src)
        flags = torch.zeros(3, device=device)
        dist.all_reduce(flags, group=group)
        syncs, compiled = flags[1].item() > 0, flags[2].item() > 0
        state.forward_param_sync = syncs
        if not syncs:
            return
        if compiled:
            verify.shadow_plan(group, device)
        else:
            sync.reducer.shadow()
        self.shadowed_steps += 1

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank ends with the model of the last rank to join (torch DDP's rule)."""
        sync = self.sync
        src = _find_common_rank(sync.group, sync.device, is_last_joiner)
        tensors = [p.detach() for n, p in sync.module.named_parameters() if n not in sync.ignored]
        tensors += sync.buffers_of() or []
        _broadcast_from(tensors, sync.group, src)
        # every rank has joined: buckets divide by the group size again (the next
        # enabled prelude, if any, sets the divisor for its own step)
        verify.set_divisor(sync.group, None)


@torch.no_grad()
def _broadcast_from(tensors: list[torch.Tensor], group: dist.ProcessGroup, src: int) -> None:
    """``tensors`` become group rank ``src``'s: one broadcast per (dtype, device)."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        t = _torch.local_tensor(t)
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for same in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.broadcast(flat, src=dist.get_global_rank(group, src), group=group)
        for t, part in zip(same, flat.split([t.numel() for t in same])):
            t.copy_(part.view_as(t))
