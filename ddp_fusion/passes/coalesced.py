"""Fuse one bucket with ``all_reduce_coalesced``: several buffers, one collective call.

Before: as in concat.py. After (inserted right after the last of g1..gn is computed)::

    s = _foreach_div([g1 ... gn], divisor)     # divisor: world size, or 1 for "sum"
    red = _c10d_functional.all_reduce_coalesced(s, "sum", group)
    r1 = wait_tensor(red[0]) ... rn = wait_tensor(red[n-1])   # moved later by schedule.py

No flat buffer and no copy out; the backend still sees one call per bucket. With a
``comm_dtype`` each gradient is cast before the division and cast back after its wait.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ._graph import NodeMaker
from .bucketing import Bucket
from .schedule import FusedBucket

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional


def fuse_coalesced(
    make: NodeMaker, bucket: Bucket, after: torch.fx.Node, divisor: torch.fx.Node
) -> FusedBucket:
    key = bucket.key
    with make.graph.inserting_before(after.next):
        # The result is contiguous, as the op promises (and as all_reduce_coalesced
        # returns at run time whatever its input's strides).
        grads = [
            g.grad
            if g.grad.meta["val"].is_contiguous()
            else make(aten.clone.default, (g.grad,), {"memory_format": torch.contiguous_format})
            for g in bucket.grads
        ]
        if key.comm_dtype is not None:
            grads = [
                make(prims.convert_element_type.default, (g, key.comm_dtype))
                for g in grads
            ]
        inputs = make(aten._foreach_div.Tensor, (grads, divisor))
        wire_dtype = key.comm_dtype or key.dtype
        if any(v.dtype != wire_dtype for v in inputs.meta["val"]):
            # _foreach_div by the fp32 divisor promotes (some) bf16/fp16 tensors to fp32;
            # round those back (the same result as eager DDP's div_ of a bf16 bucket).
            items = [make(operator.getitem, (inputs, i)) for i in range(len(grads))]
            inputs = [
                item
                if item.meta["val"].dtype == wire_dtype
                else make(prims.convert_element_type.default, (item, wire_dtype))
                for item in items
            ]
        collective = make(
            c10d.all_reduce_coalesced.default, (inputs, "sum", key.group_name)
        )
        tails, outputs = [], []
        for i in range(len(bucket.grads)):
            item = make(operator.getitem, (collective, i))
            tail = [item, make(c10d.wait_tensor.default, (item,))]
            if key.comm_dtype is not None:
                tail.append(
                    make(prims.convert_element_type.default, (tail[-1], key.dtype))
                )
            tails.append(tail)
            outputs.append(tail[-1])
    return FusedBucket(bucket, collective, tails, outputs)
