"""Fuse one bucket with ``all_reduce_coalesced``: several buffers, one collective call.

Before: as in concat.py. After (inserted right after the last of g1..gn is computed)::

    s = _foreach_div([g1 ... gn], divisor)     # divisor: world size, or 1 for "sum";
                                               # a bias's gradient: divided inside its
                                               # sum instead (scale.py)
    ddp_fusion.all_reduce_bucket_coalesced([s1 ... sn], group)   # in place; returns at once
    ddp_fusion.wait_bucket([s1 ... sn])                           # moved later by schedule.py
    r1 = alias(s1) ... rn = alias(sn)          # (or the cast back, or the permute back)

No flat buffer and no copy out: the reduced tensors become the gradients; the backend
still sees one call per bucket. The collective and its wait are ddp_fusion's ops
(ops.py), tagged cudagraph-unsafe (see concat.py); the views after the wait (or the
casts back) are what the rest of the graph reads, so every reader follows the wait.
Each gradient is reduced in its parameter's layout (plan.py, "Element order": the
same element order on every rank): permuted to that order of its dimensions (a view),
cloned contiguous where its memory is not in that order, and permuted back after.
With a ``comm_dtype`` each gradient is cast before the division and
cast back after the wait.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..ops import ALL_REDUCE_BUCKET_COALESCED, WAIT_BUCKET
from ._graph import NodeMaker
from .bucketing import Bucket
from .collectives import GradAllReduce, is_identity as _is_identity
from .scale import divided_inside_sum
from .schedule import FusedBucket

aten = torch.ops.aten
prims = torch.ops.prims


def fuse_coalesced(
    make: NodeMaker,
    bucket: Bucket,
    after: torch.fx.Node,
    divisors: tuple[torch.fx.Node, torch.fx.Node],
    last: GradAllReduce,
    label: str,
) -> FusedBucket:
    """``divisors``: (divisor, checked divisor): ``last``, the bucket's last-ready
    gradient, is scaled by the checked one, the others by the other (guard.py).
    ``label``: the bucket's name (``bucket<i>``), which its nodes' names start with."""
    key = bucket.key
    divisor, checked = divisors
    with make.graph.inserting_before(after.next):
        # each gradient contiguous in its bucket order (a view where it already is)
        orders = [g.dims() for g in bucket.grads]
        grads = [_in_order(make, g, order) for g, order in zip(bucket.grads, orders)]
        if key.comm_dtype is not None:
            grads = [
                make(prims.convert_element_type.default, (g, key.comm_dtype))
                for g in grads
            ]
        at = bucket.grads.index(last)
        items: list[torch.fx.Node | None] = [None] * len(grads)
        if key.comm_dtype is None:  # a gradient a sum makes: divided inside it (scale.py)
            for i, g in enumerate(bucket.grads):
                if i != at:
                    items[i] = divided_inside_sum(make, g, divisor)
        rest = [i for i in range(len(grads)) if i != at and items[i] is None]
        if rest:
            scaled = make(aten._foreach_div.Tensor, ([grads[i] for i in rest], divisor),
                          name=f"{label}_scale")
            for j, i in enumerate(rest):
                items[i] = make(operator.getitem, (scaled, j))
        items[at] = make(aten.div.Tensor, (grads[at], checked), name=f"{label}_scale_checked")
        # the fp32 divisor promotes a 0-d bf16/fp16 gradient to fp32; round those back
        # (the same result as eager DDP's div_ of a bf16 bucket)
        wire_dtype = key.comm_dtype or key.dtype
        inputs = [
            item
            if item.meta["val"].dtype == wire_dtype
            else make(prims.convert_element_type.default, (item, wire_dtype))
            for item in items
        ]
        collective = make(ALL_REDUCE_BUCKET_COALESCED, (inputs, key.group_name),
                          name=f"{label}_all_reduce_coalesced")
        tail = [make(WAIT_BUCKET, (inputs,), name=f"{label}_wait")]
        outputs = []
        for i, item in enumerate(inputs):
            out = item
            if key.comm_dtype is not None:
                out = make(prims.convert_element_type.default, (out, key.dtype))
                tail.append(out)
            if not _is_identity(orders[i]):
                inverse = sorted(range(len(orders[i])), key=orders[i].__getitem__)
                out = make(aten.permute.default, (out, inverse))
                tail.append(out)
            if out is item:  # a node after the wait, so that every reader follows it
                out = make(aten.alias.default, (item,))
                tail.append(out)
            outputs.append(out)
    return FusedBucket(bucket, collective, [tail], outputs, mutated=inputs)


def _in_order(make: NodeMaker, g: GradAllReduce, order: tuple[int, ...]) -> torch.fx.Node:
    out = g.grad if _is_identity(order) else make(aten.permute.default, (g.grad, list(order)))
    if out.meta["val"].is_contiguous():
        return out
    return make(aten.clone.default, (out,), {"memory_format": torch.contiguous_format})
