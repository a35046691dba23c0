"""Fuse one bucket by concat-and-split: one flat buffer, one ``all_reduce``.

Before (n gradients of one bucket)::

    r1 = ddp_fusion.all_reduce_gradient(g1, group, "avg", ...)
    ...
    rn = ddp_fusion.all_reduce_gradient(gn, group, "avg", ...)
    return (r1, ..., rn)                # the hooks make each r_i its parameter's .grad

After (inserted right after the last of g1..gn is computed)::

    flat = cat([div(view(g1, [-1]), divisor)   # each gradient scaled as it is copied in:
                ...                            # Inductor writes g_i / divisor straight
                div(view(gn, [-1]), checked)]) # into its slice (one pass, one buffer)
    red  = _c10d_functional.all_reduce(flat, "sum", group)   # in place on flat
    red  = _c10d_functional.wait_tensor(red)                 # moved later by schedule.py
    parts = split_with_sizes(red, [numel1 ... numeln])
    r1 = view(parts[0], shape1) ... rn = view(parts[n-1], shapen)   # 1-D: parts[i]

The reduced gradients are views of the bucket's buffer: nothing is copied back. Each
``r_i`` has its gradient's strides (a channels-last gradient is flattened in memory
order, by a ``permute`` view, and comes back as one), so the hook that set ``.grad =
r_i`` keeps the gradient layout contract; a gradient that is not dense is reshaped (a
copy) and comes back contiguous. With a ``comm_dtype`` each gradient is cast before its
division, and the reduced buffer cast back after the wait.

``divisor`` and ``checked`` are the 0-d divisors from the group's ``plan_divisor`` and
``plan_guard`` (guard.py; the same value, the second after the cross-rank plan check;
``gn`` is the last gradient to be ready): the world size for ``avg``, 1 for ``sum`` and
for a comm hook's bucket. The division happens before the sum, as in eager DDP, so
low-precision gradients do not overflow.
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


def fuse_concat(
    make: NodeMaker,
    bucket: Bucket,
    after: torch.fx.Node,
    divisors: tuple[torch.fx.Node, torch.fx.Node],
    last: GradAllReduce,
    label: str,
    group_name: str | None = None,
) -> FusedBucket:
    """``divisors``: (divisor, checked divisor): ``last``, the bucket's last-ready
    gradient, is scaled by the checked one, the others by the other (guard.py).
    ``label``: the bucket's name (``bucket<i>``), which its nodes' names start with.
    ``group_name``: the group the bucket's collective goes to, if not the bucket's own
    (a comm hook's, see comm_hooks.py)."""
    key = bucket.key
    divisor, checked = divisors
    with make.graph.inserting_before(after.next):
        flats = []
        for g in bucket.grads:
            flat = _flatten(make, g)
            if key.comm_dtype is not None:
                flat = make(prims.convert_element_type.default, (flat, key.comm_dtype))
            flats.append(make(aten.div.Tensor, (flat, checked if g is last else divisor)))
        flat = make(aten.cat.default, (flats,), name=f"{label}_cat")
        collective = make(c10d.all_reduce.default, (flat, "sum", group_name or key.group_name),
                          name=f"{label}_all_reduce")
        wait = make(c10d.wait_tensor.default, (collective,), name=f"{label}_wait")
        tail = [wait]
        if key.comm_dtype is not None:
            wait = make(prims.convert_element_type.default, (wait, key.dtype))
            tail.append(wait)
        parts = make(aten.split_with_sizes.default, (wait, [g.numel for g in bucket.grads]),
                     name=f"{label}_split")
        tail.append(parts)
        outputs = []
        for i, g in enumerate(bucket.grads):
            out = make(operator.getitem, (parts, i))
            tail.append(out)
            for node in _unflatten(make, g, out):
                tail.append(node)
                out = node
            outputs.append(out)
    return FusedBucket(bucket, collective, [tail], outputs)


def _flatten(make: NodeMaker, g: GradAllReduce) -> torch.fx.Node:
    # Fake-tensor propagation dominates the pass's cost, so make no node where none is
    # needed: a 1-D gradient is already flat, a contiguous one only needs a view.
    val = g.grad.meta["val"]
    if val.dim() == 1:
        return g.grad
    if val.is_contiguous():
        return make(aten.view.default, (g.grad, [-1]))
    order = memory_order(val)
    if order is None:  # not dense: copy
        return make(aten.reshape.default, (g.grad, [-1]))
    permuted = make(aten.permute.default, (g.grad, list(order)))
    return make(aten.view.default, (permuted, [-1]))


def _unflatten(make: NodeMaker, g: GradAllReduce, part: torch.fx.Node) -> list[torch.fx.Node]:
    """Views of the flat ``part`` with the gradient's shape and (if dense) strides."""
    val = g.grad.meta["val"]
    if val.dim() == 1:
        return []
    order = None if val.is_contiguous() else memory_order(val)
    if order is None:
        return [make(aten.view.default, (part, list(g.shape)))]
    shaped = make(aten.view.default, (part, [g.shape[d] for d in order]))
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return [shaped, make(aten.permute.default, (shaped, inverse))]
