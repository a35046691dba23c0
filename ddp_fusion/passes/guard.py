"""The per-step cross-rank plan check, in two parts (see ddp_fusion/verify.py)::

    token = ddp_fusion.plan_check_start('0', '<this group's bucket plan as JSON>', cpu)
    ...                                                 # backward compute
    flat = cat([...])                                   # concat.py / coalesced.py
    divisor = ddp_fusion.plan_guard(token, '0', '<plan>', 'avg', cpu)
    flat = div(flat, divisor)

one start per process group at graph start, one guard per (group, reduce op) just
before the first bucket that uses it.

Every run checks that every rank of the group runs the same plan, and returns the
divisor read from the live group (see ddp_fusion/verify.py): the graph holds no group
size, so a cached or reused graph stays correct at another world size. The divisor
makes every bucket of the group depend on the guard, so no collective can be issued
before the check.
"""

from __future__ import annotations

import json

import torch
import torch.fx

from ..comm_hooks import HOOK
from ..verify import PLAN_CHECK_START, PLAN_GUARD
from ._graph import NodeMaker
from .bucketing import Bucket


def hook_numbering(buckets: list[Bucket]) -> dict[int, tuple[int, int, int]]:
    """For each bucket a comm hook reduces (by ``id``): (model, index, count), the
    bucket's number among its model's buckets in plan order, as the hook sees it
    (``bucket.index()``, ``bucket.is_last()``)."""
    per_owner: dict[int, list[Bucket]] = {}
    for b in buckets:
        if b.key.reduce_op == HOOK:
            per_owner.setdefault(b.key.owner, []).append(b)
    return {
        id(b): (owner, i, len(same))
        for owner, same in per_owner.items()
        for i, b in enumerate(same)
    }


def plan_fingerprint(buckets: list[Bucket], group_name: str, algorithm: str) -> str:
    """The group's part of the plan: identical on every rank exactly when the ranks'
    collectives for this group match (device index left out: it differs by rank), and
    enough to replay them (a joined rank does: join.py) and to find each hooked
    bucket's group (comm_hooks.py)."""
    hooks = hook_numbering(buckets)
    return json.dumps(
        [
            {
                "dtype": str(b.key.dtype),
                "device": b.key.device.type,
                "reduce_op": b.key.reduce_op,
                **({"comm_dtype": str(b.key.comm_dtype)} if b.key.comm_dtype else {}),
                "bytes": b.nbytes,
                "algorithm": "concat" if id(b) in hooks else algorithm,
                **({"hook": list(hooks[id(b)])} if id(b) in hooks else {}),
                "numels": [g.numel for g in b.grads],
                "grads": [g.label for g in b.grads],
            }
            for b in buckets
            if b.key.group_name == group_name
        ]
    )


def insert_plan_guards(
    make: NodeMaker, buckets: list[Bucket], algorithm: str
) -> dict[tuple[str, str, torch.device], torch.fx.Node]:
    """At graph start, one ``plan_check_start`` per group; guard nodes keyed by (group
    name, reduce op, device), to be moved before their first user by ``place_guards``."""
    guards: dict[tuple[str, str, torch.device], torch.fx.Node] = {}
    starts: dict[str, torch.fx.Node] = {}
    fingerprints: dict[str, str] = {}
    placeholders = make.graph.find_nodes(op="placeholder")
    start = placeholders[-1].next if placeholders else next(iter(make.graph.nodes))
    with make.graph.inserting_before(start):
        for b in buckets:
            group = b.key.group_name
            k = (group, b.key.reduce_op, b.key.device)
            if k in guards:
                continue
            if group not in starts:
                fingerprints[group] = plan_fingerprint(buckets, group, algorithm)
                starts[group] = make(PLAN_CHECK_START, (group, fingerprints[group], b.key.device))
            guards[k] = make(
                PLAN_GUARD, (starts[group], group, fingerprints[group], b.key.reduce_op, b.key.device)
            )
    return guards


def place_guards(graph: torch.fx.Graph, guards: list[torch.fx.Node]) -> None:
    """Move each guard (its only input is the start's token) to just before its first
    user: its wait then comes after the backward compute that hides the all-gather,
    instead of blocking the host at graph start until the slowest rank gets there."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for guard in guards:
        first = min(guard.users, key=order.__getitem__)
        first.prepend(guard)
