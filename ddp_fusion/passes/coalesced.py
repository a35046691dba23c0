"""Fuse one bucket with ``all_reduce_coalesced``: several buffers, one collective call.

Before: as in concat.py. After (inserted right after the last of g1..gn is computed)::

    s = _foreach_div([g1 ... gn], divisor)     # divisor: world size, or 1 for "sum"
    ddp_fusion.all_reduce_bucket_coalesced([s1 ... sn], group)   # in place; returns at once
    ddp_fusion.wait_bucket([s1 ... sn])                           # moved later by schedule.py
    r1 = alias(s1) ... rn = alias(sn)          # (or the cast back, or the permute back)

No flat buffer and no copy out: the reduced tensors become the gradients; the backend
still sees one call per bucket. The collective and its wait are ddp_fusion's ops
(ops.py), tagged cudagraph-unsafe (see concat.py); the views after the wait (or the
casts back) are what the rest of the graph reads, so every reader follows the wait.
A dense gradient that is not contiguous (channels last) is reduced as its contiguous
``permute`` view and permuted back, so it keeps its strides; one that is not dense is
cloned contiguous. With a ``comm_dtype`` each gradient is cast before the division and
cast back after the wait.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..ops import ALL_REDUCE_BUCKET_COALESCED, WAIT_BUCKET
from ._graph import NodeMaker, memory_order
from .bucketing import Bucket
from .collectives import GradAllReduce
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
        # all_reduce_coalesced returns contiguous tensors whatever its inputs' strides
        orders = [_order(g.grad.meta["val"]) for g in bucket.grads]
        grads = [
            g.grad
            if order == ()
            else make(aten.permute.default, (g.grad, list(order)))
            if order is not None
            else make(aten.clone.default, (g.grad,), {"memory_format": torch.contiguous_format})
            for g, order in zip(bucket.grads, orders)
        ]
        if key.comm_dtype is not None:
            grads = [
                make(prims.convert_element_type.default, (g, key.comm_dtype))
                for g in grads
            ]
        at = bucket.grads.index(last)
        rest = grads[:at] + grads[at + 1:]
        items = []
        if rest:
            scaled = make(aten._foreach_div.Tensor, (rest, divisor), name=f"{label}_scale")
            items = [make(operator.getitem, (scaled, i)) for i in range(len(rest))]
        items.insert(at, make(aten.div.Tensor, (grads[at], checked), name=f"{label}_scale_checked"))
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
            if orders[i]:
                inverse = sorted(range(len(orders[i])), key=orders[i].__getitem__)
                out = make(aten.permute.default, (out, inverse))
                tail.append(out)
            if out is item:  # a node after the wait, so that every reader follows it
                out = make(aten.alias.default, (item,))
                tail.append(out)
            outputs.append(out)
    return FusedBucket(bucket, collective, [tail], outputs, mutated=inputs)


def _order(val: torch.Tensor) -> tuple[int, ...] | None:
    """``()``: contiguous; a dimension order: dense, reduced as that permute view;
    None: not dense (cloned)."""
    return () if val.is_contiguous() else memory_order(val)
