"""Insert one ``ddp_fusion::plan_guard`` per (process group, reduce op) at graph start.

    divisor = ddp_fusion.plan_guard('0', '<this group's bucket plan as JSON>', 'avg', cpu)
    ...
    flat = div(cat([...]), divisor)        # concat.py / coalesced.py

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

from ..verify import PLAN_GUARD
from ._graph import NodeMaker
from .bucketing import Bucket


def plan_fingerprint(buckets: list[Bucket], group_name: str) -> str:
    """The group's part of the plan: identical on every rank exactly when the ranks'
    collectives for this group match (device index left out: it differs by rank)."""
    return json.dumps(
        [
            {
                "dtype": str(b.key.dtype),
                "device": b.key.device.type,
                "reduce_op": b.key.reduce_op,
                **({"comm_dtype": str(b.key.comm_dtype)} if b.key.comm_dtype else {}),
                "bytes": b.nbytes,
                "grads": [g.label for g in b.grads],
            }
            for b in buckets
            if b.key.group_name == group_name
        ]
    )


def insert_plan_guards(
    make: NodeMaker, buckets: list[Bucket]
) -> dict[tuple[str, str, torch.device], torch.fx.Node]:
    """Guard nodes keyed by (group name, reduce op, device)."""
    guards: dict[tuple[str, str, torch.device], torch.fx.Node] = {}
    placeholders = make.graph.find_nodes(op="placeholder")
    start = placeholders[-1].next if placeholders else next(iter(make.graph.nodes))
    fingerprints: dict[str, str] = {}
    with make.graph.inserting_before(start):
        for b in buckets:
            k = (b.key.group_name, b.key.reduce_op, b.key.device)
            if k in guards:
                continue
            if b.key.group_name not in fingerprints:
                fingerprints[b.key.group_name] = plan_fingerprint(buckets, b.key.group_name)
            guards[k] = make(
                PLAN_GUARD,
                (b.key.group_name, fingerprints[b.key.group_name], b.key.reduce_op, b.key.device),
            )
    return guards
