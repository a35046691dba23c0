"""Cross-rank checks that turn would-be hangs into errors.

Collectives only work if every rank issues the same ones, in the same order, with the
same sizes. Two things can break that in data-parallel training:

* the ranks' models differ (checked once, when the wrapper is built:
  :func:`verify_params_across_ranks`);
* the ranks compile different backward graphs, so the pass plans different buckets
  (a parameter unused on some ranks only, rank-dependent control flow). Each fused
  graph therefore starts with one ``ddp_fusion::plan_guard`` per process group: the
  first time a plan runs, the ranks exchange it (one ``all_gather_object``) and every
  rank raises :class:`PlanMismatchError` naming the difference; afterwards the guard is
  a set lookup. The guard also yields the divisor of the bucket scaling, so Inductor
  cannot schedule a bucket's collective before it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import _torch


class PlanMismatchError(RuntimeError):
    """Ranks would issue different gradient collectives (which would hang)."""


_verified: set[tuple[str, str]] = set()


@torch.library.custom_op("ddp_fusion::plan_guard", mutates_args=())
def plan_guard(group_name: str, plan: str, value: float, device: torch.device) -> torch.Tensor:
    """``value`` as a 0-d float32 tensor, after checking (once) that every rank of the
    group runs the same bucket ``plan``."""
    if (group_name, plan) not in _verified:
        verify_plan_across_ranks(group_name, plan)
        _verified.add((group_name, plan))
    return torch.full((), value, dtype=torch.float32, device=device)


@plan_guard.register_fake
def _(group_name, plan, value, device):
    return torch.empty((), dtype=torch.float32, device=device)


PLAN_GUARD = torch.ops.ddp_fusion.plan_guard.default


def _needs_exchange(group: dist.ProcessGroup) -> bool:
    return group.size() > 1 and dist.get_backend(group) != "fake"


def verify_plan_across_ranks(group_name: str, plan: str) -> None:
    group = _torch.resolve_process_group(group_name)
    if group is None or not _needs_exchange(group):
        return
    plans: list[str | None] = [None] * group.size()
    dist.all_gather_object(plans, plan, group=group)
    if any(p != plan for p in plans):
        raise PlanMismatchError(_describe_mismatch(group_name, plans))


def _describe_mismatch(group_name: str, plans: Sequence[str | None]) -> str:
    decoded = [json.loads(p) if p else [] for p in plans]
    lines = [
        f"ddp_fusion: ranks of process group {group_name!r} compiled different gradient "
        "bucket plans, so their collectives would not match (a hang). Usually a "
        "parameter gets a gradient on some ranks only (unused in this step's forward), "
        "or the ranks run different code or models."
    ]
    for i, buckets in enumerate(decoded):
        lines.append(
            f"  group rank {i}: {len(buckets)} buckets, bytes "
            f"{[b['bytes'] for b in buckets]}"
        )
    names = [{n for b in buckets for n in b["grads"]} for buckets in decoded]
    everyone = set.union(*names) if names else set()
    for i, have in enumerate(names):
        missing = sorted(everyone - have)
        if missing:
            lines.append(f"  group rank {i} has no gradient for: {', '.join(missing[:20])}"
                         + (" ..." if len(missing) > 20 else ""))
    return "\n".join(lines)


def verify_params_across_ranks(
    named_params: Sequence[tuple[str, torch.Tensor]], group: dist.ProcessGroup
) -> None:
    """Raise ``ValueError`` on every rank if the ranks' parameters differ in name, shape
    or dtype (eager torch DDP checks the same at construction)."""
    if not _needs_exchange(group):
        return
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in named_params]
    everyone: list[list | None] = [None] * group.size()
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs == mine:
            continue
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                raise ValueError(
                    f"DistributedDataParallel: parameter #{i} differs across ranks: "
                    f"this rank has {a[0]!r} {a[1]} {a[2]}, group rank {rank} has "
                    f"{b[0]!r} {b[1]} {b[2]}; every rank must wrap the same model"
                )
        raise ValueError(
            f"DistributedDataParallel: this rank has {len(mine)} parameters, group rank "
            f"{rank} has {len(theirs)}; every rank must wrap the same model"
        )
