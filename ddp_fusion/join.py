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
in the plan check's exchange on the host group, to which a joined rank adds nothing,
and the plan itself from the store, where it is published the first time it runs,
:func:`shadow_plan`; uncompiled: its own eager reducer's buckets, which are every
rank's). Whether the active ranks' backward is fused is whether their model's forward
ran compiled with ``config.enabled`` on (the model's ``state.compiled``), not the flag
alone: a model that is not compiled reduces through the eager reducer even with the
flag on. ``divide_by_initial_world_size=False``
divides by the number of active ranks counted in the third all-reduce, read by the
bucket scaling at run time (``scaling.divisor``), so no recompile. ``post_hook``
broadcasts the parameters (and buffers) from the last rank to join, as torch DDP does.

The model's side is :class:`Joining`: what a data-parallel model offers the protocol
(``GradSync`` is one).

Forwards inside an enabled join context therefore have a graph break at their start
(the prelude), and the in-graph buffer broadcast is replaced by the prelude's.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from . import _torch, comm_hooks, plan_check, scaling, unused
from .config import config


class Joining(Protocol):
    """What a model offers the join protocol."""

    group: dist.ProcessGroup
    device: torch.device
    module: torch.nn.Module
    ignored: set[str]
    """Parameter names the model does not reduce."""
    state: Any
    """Reads and sets ``require_backward_grad_sync``, ``forward_param_sync`` and
    ``join_divide_by_initial``; reads ``compiled`` (the model's forward ran compiled with
    ``config.enabled`` on)."""

    def buffers_of(self) -> list[torch.Tensor] | None:
        """The buffers the model broadcasts at a forward (None: it does not)."""

    def broadcast(self, tensors: list[torch.Tensor], src: int) -> None:
        """``tensors`` become group rank ``src``'s."""

    def shadow_uncompiled(self) -> None:
        """A joined rank's part of one uncompiled backward (the eager reducer's)."""


def _find_common_rank(group: dist.ProcessGroup, device: torch.device, candidate: bool) -> int:
    """The highest group rank among those that pass ``candidate`` (torch DDP's rule)."""
    mine = dist.get_rank(group) if candidate else -1
    t = torch.tensor([mine], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def prelude(sync: Joining, joinable: Any, buffers: list[torch.Tensor] | None) -> None:
    """An active rank's part of one step inside an enabled join context (above). Runs
    eagerly: call it through ``torch.compiler.disable(prelude)`` (grad_sync.py makes
    that wrapper per model, so that importing ddp_fusion does not import Dynamo)."""
    Join.notify_join_context(joinable)
    group, state = sync.group, sync.state
    # what no_sync() asked for, decided now for this forward's backward (torch DDP's
    # rule; the joined ranks learn it below)
    state.require_backward_grad_sync = bool(joinable.require_backward_grad_sync)
    if buffers and state.forward_param_sync:
        sync.broadcast(buffers, _find_common_rank(group, sync.device, True))
    syncs = torch.is_grad_enabled() and state.require_backward_grad_sync
    fused = state.compiled and config.enabled  # else the eager reducer's buckets
    # filled on the device: torch.tensor([...], device=) would copy from pageable host
    # memory, which on a GPU blocks the host until the device's queue reaches the copy
    flags = torch.ones(3, device=sync.device)
    flags[1].fill_(float(syncs))
    flags[2].fill_(float(fused))
    dist.all_reduce(flags, group=group)
    # the ranks still training, as a 0-d tensor on the device: the divisor, never read
    # on the host (on a GPU that would stall the host in every step, which torch DDP's
    # active ranks do not)
    scaling.set_divisor(group, group.size() if state.join_divide_by_initial else flags[0])


class DDPJoinHook(JoinHook):
    """A joined rank's shadow of the active ranks' steps (module docstring)."""

    def __init__(self, sync: Joining, divide_by_initial_world_size: bool) -> None:
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
            sync.broadcast(buffers, _find_common_rank(group, device, False))
        flags = torch.zeros(3, device=device)
        dist.all_reduce(flags, group=group)
        syncs, compiled = flags[1].item() > 0, flags[2].item() > 0
        state.forward_param_sync = syncs
        if not syncs:
            return
        if compiled:
            shadow_plan(group, device)
        else:
            sync.shadow_uncompiled()
        self.shadowed_steps += 1

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank ends with the model of the last rank to join (torch DDP's rule)."""
        sync = self.sync
        src = _find_common_rank(sync.group, sync.device, is_last_joiner)
        tensors = [p.detach() for n, p in sync.module.named_parameters() if n not in sync.ignored]
        tensors += sync.buffers_of() or []
        sync.broadcast(tensors, src)
        # every rank has joined: buckets divide by the group size again (the next
        # enabled prelude, if any, sets the divisor for its own step)
        scaling.set_divisor(sync.group, None)


def shadow_plan(group: dist.ProcessGroup, device: torch.device) -> None:
    """A joined rank's part of one fused backward of ``group``'s active ranks: the plan
    check's exchange (``plan_check.shadow_exchange``), which brings the active ranks'
    plan; then that plan's buckets, all-reduced as zeros in the same order, sizes and
    dtypes, with the same collective (``concat``: one flat all-reduce per bucket;
    ``coalesced``: one coalesced all-reduce of the bucket's gradients; a hooked bucket:
    the model's comm hook, on zeros, as torch DDP)."""
    plan = plan_check.shadow_exchange(group)
    plan_check.hook_groups(plan, group)
    unused.shadow(group, plan_check.parse(plan))  # find_unused_parameters' used bits
    funcol = _torch.distributed.c10d_functional
    for b in plan_check.parse(plan).buckets:
        if b.hook is not None:
            flat = torch.zeros(sum(b.numels), dtype=b.wire_dtype, device=device)
            name = comm_hooks.group_name(b.hook[0], plan_check.plan_id(plan), b.hook[1])
            funcol.wait_tensor(funcol.all_reduce(flat, "sum", name))
        elif b.algorithm == "coalesced":
            zeros = [torch.zeros(n, dtype=b.wire_dtype, device=device) for n in b.numels]
            for t in funcol.all_reduce_coalesced(zeros, "sum", group.group_name):
                funcol.wait_tensor(t)
        else:
            flat = torch.zeros(sum(b.numels), dtype=b.wire_dtype, device=device)
            funcol.wait_tensor(funcol.all_reduce(flat, "sum", group.group_name))
