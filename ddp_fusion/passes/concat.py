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
    ddp_fusion.all_reduce_bucket(flat, group)  # the sum, in place on flat; returns at once
    ddp_fusion.wait_bucket([flat])             # moved later by schedule.py
    parts = split_with_sizes(flat, [numel1 ... numeln])
    r1 = view(parts[0], shape1) ... rn = view(parts[n-1], shapen)   # 1-D: parts[i]

The collective and its wait are ddp_fusion's ops (ops.py: ``_c10d_functional``'s
``all_reduce_`` and ``wait_tensor`` underneath), tagged cudagraph-unsafe, so that a
CUDA graph never captures them. They return nothing: the unpacking reads ``flat``, and
stays after the wait because the whole tail moves as one (schedule.py) and Inductor
orders reads of a buffer after the op that mutates it.

The reduced gradients are views of the bucket's buffer: nothing is copied back. Each
gradient sits in the bucket in its parameter's layout (plan.py, "Element order": the
same element order on every rank), so ``r_i`` has the parameter's strides, as torch
DDP's bucket views do (the gradient layout contract). A gradient already laid out so
(a channels-last one of a channels-last convolution) is flattened by a ``permute``
view; one that is not is copied in that order by the ``cat``. With a ``comm_dtype``
each gradient is cast before its division, and the reduced buffer cast back after the
wait.

``divisor`` and ``checked`` are the 0-d divisors from the group's ``plan_check_start``
(or a ``plan_divisor``) and ``plan_guard`` (guard.py; the same value, the second after
the cross-rank plan check; ``gn`` is the last gradient to be ready): the world size for
``avg``, 1 for ``sum`` and for a comm hook's bucket. The division happens before the
sum, as in eager DDP, so low-precision gradients do not overflow. A gradient that a sum
over the batch makes (a bias's) is divided inside that sum instead (scale.py), and the
reduction writes it into its slice.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..ops import ALL_REDUCE_BUCKET, WAIT_BUCKET
from ..plan import laid_out
from ._graph import NodeMaker
from .bucketing import Bucket
from .collectives import GradAllReduce, is_identity as _is_identity
from .scale import divided_inside_sum
from .schedule import FusedBucket

aten = torch.ops.aten
prims = torch.ops.prims


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
            inside = None if g is last or key.comm_dtype is not None else divided_inside_sum(make, g, divisor)
            if inside is not None:  # (scale.py)
                flats.append(inside)
                continue
            flat = _flatten(make, g)
            if key.comm_dtype is not None:
                flat = make(prims.convert_element_type.default, (flat, key.comm_dtype))
            flats.append(make(aten.div.Tensor, (flat, checked if g is last else divisor)))
        flat = make(aten.cat.default, (flats,), name=f"{label}_cat")
        collective = make(ALL_REDUCE_BUCKET, (flat, group_name or key.group_name), name=f"{label}_all_reduce")
        tail = [make(WAIT_BUCKET, ([flat],), name=f"{label}_wait")]
        reduced = flat
        if key.comm_dtype is not None:
            reduced = make(prims.convert_element_type.default, (flat, key.dtype))
            tail.append(reduced)
        parts = make(aten.split_with_sizes.default, (reduced, [g.numel for g in bucket.grads]),
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
    return FusedBucket(bucket, collective, [tail], outputs, mutated=[flat])


def _flatten(make: NodeMaker, g: GradAllReduce) -> torch.fx.Node:
    """``g``'s elements in its bucket's order (plan.py: its parameter's layout, the
    same on every rank): a view where its memory is in that order, else a copy.
    Fake-tensor propagation dominates the pass's cost, so no node where none is needed:
    a 1-D gradient is already flat, a contiguous one only needs a view."""
    val, order = g.grad.meta["val"], g.dims()
    if val.dim() == 1:
        return g.grad
    in_order = laid_out(val, order)
    if _is_identity(order) and in_order:
        return make(aten.view.default, (g.grad, [-1]))
    permuted = g.grad if _is_identity(order) else make(aten.permute.default, (g.grad, list(order)))
    if in_order:
        return make(aten.view.default, (permuted, [-1]))
    return make(aten.reshape.default, (permuted, [-1]))  # a copy, in the bucket's order


def _unflatten(make: NodeMaker, g: GradAllReduce, part: torch.fx.Node) -> list[torch.fx.Node]:
    """Views of the flat ``part`` with the gradient's shape, laid out in the bucket's
    order (its parameter's layout)."""
    val, order = g.grad.meta["val"], g.dims()
    if val.dim() == 1:
        return []
    if _is_identity(order):
        return [make(aten.view.default, (part, list(g.shape)))]
    shaped = make(aten.view.default, (part, [g.shape[d] for d in order]))
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return [shaped, make(aten.permute.default, (shaped, inverse))]

