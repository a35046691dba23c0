"""Fuse one bucket by concat-and-split: one flat buffer, one ``all_reduce``.

Before (n gradients of one bucket)::

    r1 = ddp_fusion.all_reduce_gradient(g1, group, "avg", ...)
    ...
    rn = ddp_fusion.all_reduce_gradient(gn, group, "avg", ...)
    copy_(p1_grad, r1) ... copy_(pn_grad, rn)

After (inserted right after the last of g1..gn is computed)::

    flat = cat([view(g1, [-1]) ... view(gn, [-1])])   # Inductor: one copy-in kernel,
    flat = div(flat, divisor)                           # the scaling fused into it
                                                        # (with comm_dtype: cast first,
                                                        # and cast back after the wait)
    red  = _c10d_functional.all_reduce(flat, "sum", group)
    red  = _c10d_functional.wait_tensor(red)            # moved later by schedule.py
    parts = split_with_sizes(red, [numel1 ... numeln])
    r1 = view(parts[0], shape1) ... rn = view(parts[n-1], shapen)

``divisor`` is the 0-d tensor from the group's ``plan_guard`` (see verify.py): the world
size for ``avg``, 1 for ``sum``. The division happens before the sum, as in eager DDP,
so low-precision gradients do not overflow.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ._graph import call_function
from .bucketing import Bucket
from .schedule import FusedBucket

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional


def fuse_concat(
    graph: torch.fx.Graph, bucket: Bucket, after: torch.fx.Node, divisor: torch.fx.Node
) -> FusedBucket:
    key = bucket.key
    with graph.inserting_before(after.next):
        flats = [call_function(graph, aten.reshape.default, (g.grad, [-1])) for g in bucket.grads]
        flat = call_function(graph, aten.cat.default, (flats,))
        if key.comm_dtype is not None:
            flat = call_function(graph, prims.convert_element_type.default, (flat, key.comm_dtype))
        flat = call_function(graph, aten.div.Tensor, (flat, divisor))
        collective = call_function(graph, c10d.all_reduce.default, (flat, "sum", key.group_name))
        wait = call_function(graph, c10d.wait_tensor.default, (collective,))
        tail = [wait]
        if key.comm_dtype is not None:
            wait = call_function(graph, prims.convert_element_type.default, (wait, key.dtype))
            tail.append(wait)
        parts = call_function(
            graph, aten.split_with_sizes.default, (wait, [g.numel for g in bucket.grads])
        )
        tail.append(parts)
        outputs = []
        for i, g in enumerate(bucket.grads):
            part = call_function(graph, operator.getitem, (parts, i))
            out = call_function(graph, aten.view.default, (part, list(g.shape)))
            tail += [part, out]
            outputs.append(out)
    return FusedBucket(bucket, collective, [tail], outputs)
