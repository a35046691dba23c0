"""Fuse one bucket by concat-and-split: one flat buffer, one ``all_reduce``.

Before (n gradients of one bucket)::

    r1 = ddp_fusion.all_reduce_gradient(g1, group, "avg", ...)
    ...
    rn = ddp_fusion.all_reduce_gradient(gn, group, "avg", ...)
    copy_(p1_grad, r1) ... copy_(pn_grad, rn)

After (inserted right after the last of g1..gn is computed)::

    flat = cat([view(g1, [-1]) ... view(gn, [-1])])   # Inductor: one copy-in kernel,
                                                        # (reshape if not contiguous;
                                                        # nothing for 1-D gradients)
    flat = div(flat, divisor)                           # the scaling fused into it
                                                        # (with comm_dtype: cast first,
                                                        # and cast back after the wait)
    red  = _c10d_functional.all_reduce(flat, "sum", group)
    red  = _c10d_functional.wait_tensor(red)            # moved later by schedule.py
    parts = split_with_sizes(red, [numel1 ... numeln])
    r1 = view(parts[0], shape1) ... rn = view(parts[n-1], shapen)   # 1-D: parts[i]

``divisor`` is the 0-d tensor from the group's ``plan_guard`` (see verify.py): the world
size for ``avg``, 1 for ``sum``. The division happens before the sum, as in eager DDP,
so low-precision gradients do not overflow.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ._graph import NodeMaker
from .bucketing import Bucket
from .collectives import GradAllReduce
from .schedule import FusedBucket

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional


def fuse_concat(
    make: NodeMaker, bucket: Bucket, after: torch.fx.Node, divisor: torch.fx.Node
) -> FusedBucket:
    key = bucket.key
    with make.graph.inserting_before(after.next):
        flats = [_flatten(make, g) for g in bucket.grads]
        flat = make(aten.cat.default, (flats,))
        if key.comm_dtype is not None:
            flat = make(prims.convert_element_type.default, (flat, key.comm_dtype))
        flat = make(aten.div.Tensor, (flat, divisor))
        collective = make(c10d.all_reduce.default, (flat, "sum", key.group_name))
        wait = make(c10d.wait_tensor.default, (collective,))
        tail = [wait]
        if key.comm_dtype is not None:
            wait = make(prims.convert_element_type.default, (wait, key.dtype))
            tail.append(wait)
        parts = make(
            aten.split_with_sizes.default, (wait, [g.numel for g in bucket.grads])
        )
        tail.append(parts)
        outputs = []
        for i, g in enumerate(bucket.grads):
            part = make(operator.getitem, (parts, i))
            out = part if len(g.shape) == 1 else make(aten.view.default, (part, list(g.shape)))
            tail += [part] if out is part else [part, out]
            outputs.append(out)
    return FusedBucket(bucket, collective, [tail], outputs)


def _flatten(make: NodeMaker, g: GradAllReduce) -> torch.fx.Node:
    # Fake-tensor propagation dominates the pass's cost, so make no node where none is
    # needed: a 1-D gradient is already flat, a contiguous one only needs a view.
    if len(g.shape) == 1:
        return g.grad
    contiguous = g.grad.meta["val"].is_contiguous()
    return make(aten.view.default if contiguous else aten.reshape.default, (g.grad, [-1]))

