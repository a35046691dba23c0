"""Reduce a bucket in place in its kept ``.grad`` tensors: no bucket buffer, no copy.

Where a parameter's ``.grad`` exists before the backward (``zero_grad(set_to_none=False)``,
gradient accumulation), the hook copies the reduced gradient back into it (grad_sync.py),
and the graph ends with that copy, as AOTAutograd writes every input mutation::

    g1 = addmm(grad1, ...)                         # the accumulation, old .grad + new
    r1 = ddp_fusion.all_reduce_gradient(g1, ...)
    ...
    copy_(grad1, r1)                               # the kept .grad receives it
    return (..., copy_(grad1, r1), ...)

Rewritten (each write right after its gradient; the collective after the bucket's last)::

    w1 = copy_(grad1, div(g1, divisor))            # Inductor fuses the scaling (and a
    ...                                            # pointwise producer) into the write
    wn = copy_(gradn, div(gn, checked))
    ddp_fusion.all_reduce_in_place([w1 ... wn], group, "concat")   # sum, in place, async
    ddp_fusion.wait_in_place([w1 ... wn])          # moved later by schedule.py
    return (..., grad1, ...)

The ``.grad`` tensors are then the bucket: torch DDP's ``gradient_as_bucket_view``
layout. After a first step with no ``.grad`` they are views of that step's reduced
bucket, one run of memory in bucket order, so the collective (``concat``) is one
``all_reduce`` on that memory (ops.py checks, from pointers and strides; ``.grad``s
laid out otherwise are gathered into a buffer for the same ``all_reduce`` and copied
back). With ``coalesced`` it is one ``all_reduce_coalesced`` of the ``.grad``s.
Memory: what eager DDP with ``gradient_as_bucket_view`` holds, the ``.grad`` tensors and
the local gradients of kernels that cannot write into them (an ``mm``'s output).

A bucket is reduced this way when each of its gradients goes, and only goes, into the
final copy to a graph input (a kept ``.grad``) of its shape, dtype and device, nothing
reads that input after the gradient is computed, the input is dense and laid out as its
parameter (its memory then holds the elements in the bucket's order, the same on every
rank: plan.py, "Element order"; a ``.grad`` a rank made otherwise gets a copy back),
and the bucket has no communication dtype and no comm hook (those keep a buffer of
their own).
"""

from __future__ import annotations

import operator
import zlib

import torch
import torch.fx

from ..ops import ALL_REDUCE_IN_PLACE, WAIT_IN_PLACE
from ..plan import laid_out
from ._graph import NodeMaker
from .bucketing import Bucket
from .collectives import GradAllReduce
from .schedule import FusedBucket

aten = torch.ops.aten


def kept_grads(bucket: Bucket, order: dict[torch.fx.Node, int],
               hooked: bool) -> tuple[list[torch.fx.Node] | None, str | None]:
    """``(copies, None)``: each gradient's final copy into its kept ``.grad`` (a graph
    input); the bucket can be reduced in place (module docstring). ``(None, why)``: its
    gradients go into kept ``.grad``s but it cannot be (they get a copy back).
    ``(None, None)``: its gradients become new ``.grad``s. ``hooked``: a comm hook
    reduces the bucket."""
    copies = [_final_copy(g) for g in bucket.grads]
    if not any(copies):
        return None, None
    if not all(copies):
        return None, "some of its gradients go into kept .grads and some become new ones"
    if hooked:
        return None, "the model's comm hook reduces a bucket buffer"
    if bucket.key.comm_dtype is not None:
        return None, f"it is reduced in {bucket.key.comm_dtype} (a buffer of that dtype)"
    for g, copy in zip(bucket.grads, copies):
        dst = copy.args[0]
        if any(u is not copy and order.get(u, len(order)) > order[g.grad] for u in _readers(dst)):
            return None, f"the graph reads the old .grad of {g.label} after its new gradient is made"
        want, got = dst.meta.get("val"), g.grad.meta.get("val")
        if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)
                and want.shape == got.shape and want.dtype == got.dtype and want.device == got.device):
            return None, f"the .grad of {g.label} is not of its gradient's shape, dtype and device"
        if not laid_out(want, g.dims()):
            # not one run of memory, or (reduced in place) its memory would meet other
            # ranks' in another order
            return None, (f"the .grad of {g.label} (strides {list(want.stride())}) is not laid out as "
                          "its parameter (its bucket's element order, the same on every rank)")
    return copies, None


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that read ``node``'s memory: its users and, through views of it, theirs."""
    out, todo = [], [node]
    while todo:
        for user in todo.pop().users:
            out.append(user)
            if _is_view(user):
                todo.append(user)
    return out


def _is_view(node: torch.fx.Node) -> bool:
    if node.target is operator.getitem:  # (an item of a view op's list: split, unbind)
        return True
    schema = getattr(node.target, "_schema", None)
    alias = schema.returns[0].alias_info if schema is not None and schema.returns else None
    return alias is not None and not alias.is_write


def _final_copy(g: GradAllReduce) -> torch.fx.Node | None:
    """The graph's final ``copy_`` of ``g``'s reduced gradient into a graph input (a kept
    ``.grad``), if that is all that reads it."""
    (copy, *more) = list(g.node.users) or [None]
    if more or copy is None or copy.target is not aten.copy_.default or copy.args[1] is not g.node:
        return None
    dst = copy.args[0]
    if not isinstance(dst, torch.fx.Node) or dst.op != "placeholder" or dst is g.grad:
        return None
    return copy


def fuse_in_place(
    make: NodeMaker,
    bucket: Bucket,
    copies: list[torch.fx.Node],
    after: torch.fx.Node,
    divisors: tuple[torch.fx.Node, torch.fx.Node],
    last: GradAllReduce,
    label: str,
    algorithm: str,
) -> FusedBucket:
    """``copies``: from :func:`kept_grads`. ``after``: the node the collective follows.
    ``divisors``, ``last``, ``label``: as for concat.py's ``fuse_concat``. ``algorithm``:
    the plan's (``concat``: one ``all_reduce`` of the bucket's elements; ``coalesced``:
    one ``all_reduce_coalesced`` of its tensors), so that every rank issues what the
    plan says, and a joined rank's replay of it matches (join.py)."""
    divisor, checked = divisors
    writes, kept = [], []
    for g, copy in zip(bucket.grads, copies):
        dst = copy.args[0]
        with make.graph.inserting_after(g.grad):
            scaled = make(aten.div.Tensor, (g.grad, checked if g is last else divisor))
        with make.graph.inserting_after(scaled):
            writes.append(make(aten.copy_.default, (dst, scaled), name=f"{label}_write"))
        kept.append(dst)
    anchor = after if after is not last.grad else writes[bucket.grads.index(last)]
    args = (writes, bucket.key.group_name, algorithm)
    if algorithm == "concat" and (name := _static_layout(bucket, kept, label)):
        args += (name,)
    with make.graph.inserting_after(anchor):
        collective = make(ALL_REDUCE_IN_PLACE, args, name=f"{label}_all_reduce_in_place")
    with make.graph.inserting_after(collective):
        wait = make(WAIT_IN_PLACE, (writes,), name=f"{label}_wait")
    # the hooks' results become the kept .grads: the driver points the final copies'
    # readers at them and erases the copies, with every bucket's in one rewrite
    return FusedBucket(bucket, collective, [[wait]], kept, mutated=kept, replaced=dict(zip(copies, kept)))


def _static_layout(bucket: Bucket, kept: list[torch.fx.Node], label: str) -> str:
    """A name for the kept ``.grad``s' sizes, strides and dtype, if all are static (else
    ``""``): the op checks once per name and pointers that they are one run of memory
    (ops.py ``_one_run``; Dynamo's guards hold every call of this graph to these sizes
    and strides). It names the model, group and bucket too, so that two buckets of the
    same shapes keep their own entries."""
    meta = [node.meta.get("val") for node in kept]
    if not all(isinstance(t, torch.Tensor) for t in meta):
        return ""
    described = [(tuple(t.shape), t.stride(), str(t.dtype)) for t in meta]
    if not all(isinstance(n, int) for shape, stride, _ in described for n in (*shape, *stride)):
        return ""
    digest = zlib.crc32(repr(described).encode())
    return f"{bucket.key.model_id}/{bucket.key.group_name}/{label}/{len(meta)}/{digest:08x}"
