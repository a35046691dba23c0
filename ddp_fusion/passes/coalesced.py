"""Fuse one bucket with ``all_reduce_coalesced``: several buffers, one collective call.

Before: as in concat.py. After (inserted right after the last of g1..gn is computed)::

    s = _foreach_div([g1 ... gn], divisor)     # divisor: world size, or 1 for "sum"
    red = _c10d_functional.all_reduce_coalesced(s, "sum", group)
    r1 = wait_tensor(red[0]) ... rn = wait_tensor(red[n-1])   # moved later by schedule.py

No flat buffer and no copy out: the reduced tensors become the gradients; the backend
still sees one call per bucket. A dense gradient that is not contiguous (channels last)
is reduced as its contiguous ``permute`` view and permuted back, so it keeps its strides;
one that is not dense is cloned contiguous. With a ``comm_dtype`` each gradient is cast
before the division and cast back after its wait.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .. import _torch
from ._graph import NodeMaker, memory_order
from .bucketing import Bucket
from .collectives import GradAllReduce
from .schedule import FusedBucket

aten = torch.ops.aten
prims = torch.ops.prims
c10d = _torch.distributed.c10d_functional


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
        collective = make(
            c10d.all_reduce_coalesced.default, (inputs, "sum", key.group_name),
            name=f"{label}_all_reduce_coalesced",
        )
        tails, outputs = [], []
        for i in range(len(bucket.grads)):
            item = make(operator.getitem, (collective, i))
            tail = [item, make(c10d.wait_tensor.default, (item,), name=f"{label}_wait")]
            if key.comm_dtype is not None:
                tail.append(
                    make(prims.convert_element_type.default, (tail[-1], key.dtype))
                )
            if orders[i]:
                inverse = sorted(range(len(orders[i])), key=orders[i].__getitem__)
                tail.append(make(aten.permute.default, (tail[-1], inverse)))
            tails.append(tail)
            outputs.append(tail[-1])
    return FusedBucket(bucket, collective, tails, outputs)


def _order(val: torch.Tensor) -> tuple[int, ...] | None:
    """``()``: contiguous; a dimension order: dense, reduced as that permute view;
    None: not dense (cloned)."""
    return () if val.is_contiguous() else memory_order(val)
