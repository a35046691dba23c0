"""The per-step cross-rank plan check, in two parts (see ddp_fusion/plan_check.py)::

    divisor = ddp_fusion.plan_check_start('0', '<this group's bucket plan as JSON>', h, cpu, 'avg')
    ...                                                         # backward compute
    g1 / divisor, ..., g(n-1) / divisor                         # fused into their kernels
    checked = ddp_fusion.plan_guard(divisor, '0', h, 'avg', cpu)  # waits
    gn / checked                                                # the bucket's last gradient
    flat = cat([...]); all_reduce(flat)                         # concat.py / coalesced.py

one start per process group at graph start, which does not wait and returns the divisor
of the group's first (reduce op, device) (a ``plan_divisor`` gives any other's; the
guard takes the start's output as its token), one guard per (group, reduce op): each
bucket's last-ready gradient is scaled by the guard's divisor, so no
collective of the group can be issued before the check, and the guard's wait comes
where the group's first bucket is issued (``place_guards``), not at the start of
backward.

Every run checks that every rank of the group runs the same plan; both divisors are read
at run time (ddp_fusion/scaling.py): the graph holds no group size, so a cached or
reused graph stays correct at another world size.

With ``config.plan_check`` off, each group starts with a ``plan_start`` instead (the
plan's one-time work and the divisor, no exchange) and there is no guard: every
gradient is scaled by the divisor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

from ..plan import BucketPlan
from ..plan_check import PLAN_CHECK_START, PLAN_DIVISOR, PLAN_GUARD, PLAN_START, graph_text, plan_hash
from ._graph import NodeMaker


def group_plans(plan: BucketPlan) -> dict[str, str]:
    """Each process group's part of ``plan``, in the JSON the graph carries: identical
    on every rank exactly when the ranks' collectives for the group match, and enough
    to replay them (a joined rank does: join.py) and to find each hooked bucket's
    group (comm_hooks.py)."""
    return {group: plan.of_group(group).to_json() for group in plan.groups}


Divisors = dict[tuple[str, str, torch.device], tuple[torch.fx.Node, torch.fx.Node]]


def insert_plan_guards(
    make: NodeMaker, keys: list[tuple[str, str, torch.device]], plans: dict[str, str],
    checks: Callable[[str], bool] = lambda group: True,
) -> tuple[Divisors, dict[str, torch.fx.Node]]:
    """At graph start, one ``plan_check_start`` per group; for each key (group name,
    reduce op, device) of a bucket or an unfused all-reduce, in order, the divisor node
    (no wait: the group's start for its first key, which returns that key's divisor, a
    ``plan_divisor`` for any other; one op call fewer per group and step) and the guard
    node (the checked divisor, to be moved before its first user by ``place_guards``).
    ``plans``: each group's plan (:func:`group_plans`). A group for which ``checks``
    is False (``config.plan_check`` off, ``plan_check.checks``): a ``plan_start`` and no
    guard (the divisor stands in for it). Returns the divisors and each group's start."""
    guards: Divisors = {}
    starts: dict[str, torch.fx.Node] = {}
    placeholders = make.graph.find_nodes(op="placeholder")
    start = placeholders[-1].next if placeholders else next(iter(make.graph.nodes))
    with make.graph.inserting_before(start):
        for k in keys:
            if k in guards:
                continue
            group, reduce_op, device = k
            h = plan_hash(plans[group])  # (the ops key their state by it, never hash the text)
            check = checks(group)
            if group not in starts:
                start = PLAN_CHECK_START if check else PLAN_START
                divisor = starts[group] = make(start, (group, graph_text(plans[group]), h, device, reduce_op))
            else:
                divisor = make(PLAN_DIVISOR, (group, reduce_op, device))
            if check:
                guards[k] = (divisor, make(PLAN_GUARD, (starts[group], group, h, reduce_op, device)))
            else:
                guards[k] = (divisor, divisor)
    return guards, starts


def place_guards(graph: torch.fx.Graph, guards: list[torch.fx.Node]) -> None:
    """Move each guard (its only input is the start's token) to just before its first
    user (the first bucket's last gradient's scaling): its wait then comes after the
    backward compute that hides the all-gather, instead of blocking the host at graph
    start until the slowest rank gets there."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for guard in guards:
        if guard.target is not PLAN_GUARD:  # (the divisor: no check)
            continue
        first = min(guard.users, key=order.__getitem__)
        first.prepend(guard)
