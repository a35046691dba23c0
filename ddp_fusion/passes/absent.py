"""Buckets of a ``find_unused_parameters`` model: the gradients this rank's graph lacks,
the agreement on which parameters some rank used, and the fix-up at the end of the
graph (the design is in ddp_fusion/unused.py).

A bucket planned over the model's layout (bucketing.py, ``Bucket.laid_out``) may hold
parameters that this rank's graph has no gradient for (unused here, or ``requires_grad``
switched off here). Right after the bucket's last gradient here (for a bucket with none,
right after the bucket before it), with p2 absent::

    bucket0_absent = ddp_fusion.absent_grad(model, 7, [64, 64], [64, 1], float32, cpu)
    ... concat.py / coalesced.py: the bucket, bucket0_absent scaled and sent like g1, g3 ...

At the start of the graph, right after its group's plan check starts (every rank, every
step: the plan, which says which models are laid out, is the same on every rank)::

    used_start = ddp_fusion.used_start(plan_check_start, '0', model, [0, 1, 3, ...])

(after its ``plan_start`` where the check is off, guard.py)

and, where this rank's graph lacks some of the model's parameters, at its end (after
the buckets' waits, which schedule.py puts there anyway)::

    ddp_fusion.unused_fixup(used_start, model, [7], [r2])

A bucket with an absent gradient is not reduced in place in kept ``.grad``s (in_place.py:
the absent gradient has no ``.grad`` of this graph to live in): it gets a bucket buffer
and a copy back, as a bucket with a communication dtype does.
"""

from __future__ import annotations

import torch
import torch.fx

from .. import unused
from ._graph import NodeMaker
from .bucketing import Bucket
from .schedule import FusedBucket


def materialize(make: NodeMaker, bucket: Bucket, after: torch.fx.Node, label: str) -> torch.fx.Node:
    """Insert, right after ``after``, each absent entry's contribution (which becomes its
    ``grad``); returns the last node inserted (``after`` if none)."""
    key = bucket.key
    layout = unused.layout(key.model_id)
    assert layout is not None, "planned over a layout that is gone"  # (the same pass run)
    with make.graph.inserting_before(after.next):
        for g in bucket.grads:
            if g.is_absent:
                slot = layout.slots[g.ready_order]
                g.grad = after = make(unused.ABSENT_GRAD, (
                    key.model_id, slot.index, list(slot.shape), list(slot.stride), slot.dtype, key.device,
                ), name=f"{label}_absent")
    return after


def insert_used_starts(make: NodeMaker, buckets: list[Bucket], group_starts: dict[str, torch.fx.Node]
                       ) -> dict[int, torch.fx.Node]:
    """Right after each group's plan check starts, one ``used_start`` per laid-out model
    (in the order of their first buckets, which every rank shares), with the parameters
    this graph has gradients for; returns model id -> its token."""
    present: dict[int, list[int]] = {}
    starts: dict[int, torch.fx.Node] = {}
    for b in buckets:
        if b.laid_out:
            slots = unused.layout(b.key.model_id).slots
            present.setdefault(b.key.model_id, []).extend(
                slots[g.ready_order].index for g in b.grads if not g.is_absent
            )
            starts.setdefault(b.key.model_id, group_starts[b.key.group_name])  # its plan check's start
    tokens: dict[int, torch.fx.Node] = {}
    last: dict[torch.fx.Node, torch.fx.Node] = {}  # the group's start -> the last node after it
    for model_id, start in starts.items():
        with make.graph.inserting_after(last.get(start, start)):
            args = (start, start.args[0], model_id, sorted(present[model_id]))
            tokens[model_id] = last[start] = make(unused.USED_START, args, name="used_start")
    return tokens


def insert_fixups(make: NodeMaker, fused: list[FusedBucket], tokens: dict[int, torch.fx.Node]) -> None:
    """Just before the graph's output, one ``unused_fixup`` per model whose gradients
    this graph partly lacks: it reads their reduced gradients and the model's token."""
    absent: dict[int, tuple[list[int], list[torch.fx.Node]]] = {}
    for fb in fused:
        for g, out in zip(fb.bucket.grads, fb.outputs):
            if g.is_absent:
                indices, reduced = absent.setdefault(fb.bucket.key.model_id, ([], []))
                indices.append(g.absent)
                reduced.append(out)
    output = make.graph.find_nodes(op="output")[0]
    with make.graph.inserting_before(output):
        for model_id, (indices, reduced) in absent.items():
            make(unused.UNUSED_FIXUP, (tokens[model_id], model_id, indices, reduced), name="unused_fixup")
