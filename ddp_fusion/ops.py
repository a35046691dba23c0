"""The tagged per-gradient all-reduce: ``torch.ops.ddp_fusion.all_reduce_gradient``.

The tag *is* the op. Compiled autograd traces each hook's call to it, AOTAutograd keeps it
as an opaque node, and the post-grad pass finds exactly these nodes by target. Nothing
is inferred from the graph around them, so a world size of 1, a gradient that is already
scaled, or a tensor-parallel ``all_reduce`` in the same graph changes nothing.

Run eagerly (no compile, or compiled with the pass off) the op is a plain blocking
``all_reduce`` of one gradient: correct, one collective per gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import _torch

REDUCE_OPS = ("avg", "sum")
"""``avg``: divide by the group size, then sum (DDP's mean). ``sum``: sum only. (The
hooks also tag ``"hook"``: the model's comm hook reduces the bucket, comm_hooks.py.)"""


@torch.library.custom_op("ddp_fusion::all_reduce_gradient", mutates_args=(), tags=_torch.CUDAGRAPH_UNSAFE)
def _all_reduce_gradient(
    grad: torch.Tensor,
    group_name: str,
    reduce_op: str,
    bucket_limits: Sequence[int],
    name: str,
    comm_dtype: torch.dtype | None = None,
    ready_order: int = -1,
    owner: int = -1,
) -> torch.Tensor:
    # bucket_limits, name, ready_order and owner are for the pass (bucket plan, dumps);
    # unused here. ready_order: this gradient's position in eager autograd's ready order
    # (the order eager DDP buckets in), or -1 if unknown (the pass then uses graph
    # order). owner: the wrapper whose hook made the call (its gradients never share a
    # bucket with another wrapper's, as two eager DDP models never do), or -1.
    if reduce_op == "hook":
        raise RuntimeError(
            f"ddp_fusion: gradient {name!r} of a model with a comm hook reached its "
            "all-reduce unfused (the pass could not fuse it, or did not run on this graph; "
            "see the 'unfused' warning); a comm hook runs on fused buckets only"
        )
    group = _torch.resolve_process_group(group_name)
    if group is None:
        raise RuntimeError(
            f"ddp_fusion.all_reduce_gradient: process group {group_name!r} is not "
            "registered in this process"
        )
    # cast, scale, sum, cast back: the order of torch's fp16/bf16 compress hooks
    out = grad.to(comm_dtype or grad.dtype, copy=True)
    if reduce_op == "avg":
        out.div_(group.size())
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return torch.empty_like(grad).copy_(out)


@_all_reduce_gradient.register_fake
def _(grad, group_name, reduce_op, bucket_limits, name, comm_dtype=None, ready_order=-1, owner=-1):
    # The gradient's strides if it is dense (else contiguous), as empty_like gives:
    # what every fused form returns (views of the reduced bucket, passes/concat.py).
    return torch.empty_like(grad)


ALL_REDUCE_GRADIENT = torch.ops.ddp_fusion.all_reduce_gradient.default

