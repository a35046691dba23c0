"""Buckets of a ``find_unused_parameters`` model: the gradients this rank's graph lacks,
the used flags, and the fix-up at the end of the graph (the design is in
ddp_fusion/unused.py).

A bucket planned over the model's layout (bucketing.py, ``Bucket.flags``) may hold
parameters that this rank's graph has no gradient for (unused here, or
``requires_grad`` switched off here). Right after the bucket's last gradient here (for
a bucket with none, right after the bucket before it), with p2 absent::

    a2 = ddp_fusion.absent_grad(model, 7, [64, 64], [64, 1], float32, cpu, float32)
    getitem = a2[0]                 # its kept .grad, or zeros: scaled and sent like g1, g3
    flags = cat([full([1], 1.0), a2[1], full([1], 1.0)])  # 1: a gradient of this graph
    ... concat.py / coalesced.py: the bucket, its flags sent after its gradients ...

and at the end of the graph, once per model (after every bucket of the model, whose
waits schedule.py then moves there)::

    ddp_fusion.unused_fixup([flags_0, ...], model, [7], [r2], [slice(flags_0, 0, 1, 2)])

Buckets with flags are not reduced in place in kept ``.grad``s (in_place.py): they get a
bucket buffer and a copy back, as buckets with a communication dtype do.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .. import unused
from ._graph import NodeMaker
from .bucketing import Bucket
from .schedule import FusedBucket

aten = torch.ops.aten


def materialize(make: NodeMaker, bucket: Bucket, after: torch.fx.Node, label: str) -> torch.fx.Node:
    """Insert, right after ``after``, each absent entry's contribution (which becomes its
    ``grad``) and the bucket's used flags (1-D, in the wire dtype); returns the flags
    node, the last node inserted."""
    key = bucket.key
    layout = unused.layout(key.model_id)
    assert layout is not None, "planned over a layout that is gone"  # (the same pass run)
    wire = key.comm_dtype or key.dtype
    pieces: list[torch.fx.Node] = []
    run = 0  # gradients of this graph since the last absent one: flags of 1
    with make.graph.inserting_before(after.next):
        for g in bucket.grads:
            if not g.is_absent:
                run += 1
                continue
            if run:
                pieces.append(_ones(make, run, wire, key.device))
                run = 0
            slot = layout.slots[g.ready_order]
            both = make(unused.ABSENT_GRAD, (key.model_id, slot.index, list(slot.shape), list(slot.stride),
                                             slot.dtype, key.device, wire), name=f"{label}_absent")
            g.grad = make(operator.getitem, (both, 0))
            pieces.append(make(operator.getitem, (both, 1)))
        if run:
            pieces.append(_ones(make, run, wire, key.device))
        flags = pieces[0] if len(pieces) == 1 else make(aten.cat.default, (pieces,), name=f"{label}_flags")
    return flags


def _ones(make: NodeMaker, n: int, dtype: torch.dtype, device: torch.device) -> torch.fx.Node:
    return make(aten.full.default, ([n], 1.0), {"dtype": dtype, "device": device, "pin_memory": False})


def insert_fixups(make: NodeMaker, fused: list[FusedBucket]) -> None:
    """One ``unused_fixup`` per model with flagged buckets, just before the graph's
    output: it reads each bucket's reduced flags, and the absent entries' reduced
    gradients and flags."""
    by_model: dict[int, list[FusedBucket]] = {}
    for fb in fused:
        if fb.flags is not None:
            by_model.setdefault(fb.bucket.key.model_id, []).append(fb)
    if not by_model:
        return
    output = make.graph.find_nodes(op="output")[0]
    with make.graph.inserting_before(output):
        for model_id, mine in by_model.items():
            indices, reduced, used = [], [], []
            for fb in mine:
                for k, (g, out) in enumerate(zip(fb.bucket.grads, fb.outputs)):
                    if g.is_absent:
                        indices.append(g.absent)
                        reduced.append(out)
                        used.append(make(aten.slice.Tensor, (fb.flags, 0, k, k + 1)))
            make(unused.UNUSED_FIXUP, ([fb.flags for fb in mine], model_id, indices, reduced, used),
                 name="unused_fixup")
