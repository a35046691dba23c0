"""The tagged per-gradient all-reduce: ``torch.ops.ddp_fusion.all_reduce_gradient``.

The tag *is* the op. Compiled autograd traces each hook's call to it, AOTAutograd keeps it
as an opaque node, and the post-grad pass finds exactly these nodes by target. Nothing
is inferred from the graph around them, so a world size of 1, a gradient that is already
scaled, or a tensor-parallel ``all_reduce`` in the same graph changes nothing.

Run eagerly (no compile, or compiled with the pass off) the op is a plain blocking
``all_reduce`` of one gradient: correct, one collective per gradient, ``avg`` dividing
by the group's divisor in this step (scaling.py: its size, or the ranks still
training under ``join()``). Called so from a model's hook (``model_id`` set), it warns
once per model: that model's compiled backward went without the pass.

Its eight arguments::

    all_reduce_gradient(grad, group_name, reduce_op, bucket_limits, name,
                        comm_dtype=None, ready_order=-1, model_id=-1)

``bucket_limits``, ``name``, ``ready_order`` and ``model_id`` are for the pass (the plan,
the dumps): ``ready_order`` is the gradient's position in eager autograd's ready order
(the order eager DDP buckets in), or -1 if unknown, or -2 if its model tried to learn
it and could not (the pass then uses graph order; for -1 of a model's gradient it
warns why the order is missing, for -2 the model warned already);
``model_id`` is the model whose hook made the call (its gradients never share a bucket
with another model's, as two eager DDP models never do), or -1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import _torch, effects, scaling
from .log import log
from .plan import ddp_bucket_limits, dims_in_memory, laid_out

REDUCE_OPS = ("avg", "sum")
"""``avg``: divide by the group size, then sum (DDP's mean). ``sum``: sum only."""

HOOK = "hook"
"""The reduce op of a gradient whose model has a comm hook: the hook reduces its bucket
(comm_hooks.py)."""

READY_UNKNOWN = -1
"""``ready_order`` of a gradient whose position in the ready order is not known."""
READY_NOT_LEARNED = -2
"""``ready_order`` of a gradient whose model tried to learn the ready order and could
not (and warned then)."""

#: Tags for ddp_fusion's ops: they talk to other ranks (and read values on the host),
#: so a CUDA graph must never capture them; Inductor splits graphs around such ops.
CUDAGRAPH_UNSAFE: tuple[torch.Tag, ...] = (
    (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
)


@torch.library.custom_op("ddp_fusion::all_reduce_gradient", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def _all_reduce_gradient(
    grad: torch.Tensor,
    group_name: str,
    reduce_op: str,
    bucket_limits: Sequence[int],
    name: str,
    comm_dtype: torch.dtype | None = None,
    ready_order: int = -1,
    model_id: int = -1,
) -> torch.Tensor:
    if model_id >= 0 and model_id not in _ran_unpassed:
        _warn_unpassed(model_id)
    return _reduce_one(grad, group_name, reduce_op, name, comm_dtype, None)


_ran_unpassed: set[int] = set()


def _warn_unpassed(model_id: int) -> None:
    """A model's hook traced this op, and the graph ran without the pass: a compiled
    backward that Inductor did not compile (a compiled-autograd compiler of the user's,
    ``backend="eager"`` or ``"aot_eager"``), or ddp_fusion's pass not installed there.
    Correct, but unfused and unchecked: said once per model."""
    _ran_unpassed.add(model_id)
    _torch.dynamo.counters()["ddp_fusion"]["unfused: backward compiled without the pass"] += 1
    log.warning(
        "ddp_fusion: model %d's compiled backward ran its gradient all-reduces unfused, one "
        "blocking all-reduce per gradient and without the per-step plan check: the backward "
        "was not compiled by Inductor with ddp_fusion's pass (a compiled-autograd compiler of "
        "your own, e.g. compiled_autograd._enable(torch.compile(backend='aot_eager'))?). Let "
        "ddp_fusion.config.enabled turn compiled autograd on, or compile it with Inductor",
        model_id,
    )


@_all_reduce_gradient.register_fake
def _(grad, group_name, reduce_op, bucket_limits, name, comm_dtype=None, ready_order=-1, model_id=-1):
    # The gradient's strides if it is dense (else contiguous), as empty_like gives:
    # what every fused form returns (views of the reduced bucket, passes/concat.py).
    return torch.empty_like(grad)


@torch.library.custom_op("ddp_fusion::all_reduce_checked", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def _all_reduce_checked(
    grad: torch.Tensor,
    divisor: torch.Tensor,
    group_name: str,
    reduce_op: str,
    name: str,
    comm_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """What the pass makes of a tagged all-reduce it cannot bucket (passes/__init__.py):
    the same blocking all-reduce of one gradient, scaled by ``divisor``, the group's
    divisor returned by the plan check's guard (a 0-d tensor on the gradient's device):
    so it is issued after the check, like a bucket, and divides as the buckets do."""
    return _reduce_one(grad, group_name, reduce_op, name, comm_dtype, divisor)


@_all_reduce_checked.register_fake
def _(grad, divisor, group_name, reduce_op, name, comm_dtype=None):
    return torch.empty_like(grad)


def _reduce_one(grad: torch.Tensor, group_name: str, reduce_op: str, name: str,
                comm_dtype: torch.dtype | None, divisor: torch.Tensor | None) -> torch.Tensor:
    if reduce_op == HOOK:
        raise RuntimeError(
            f"ddp_fusion: gradient {name!r} of a model with a comm hook reached its "
            "all-reduce unfused (the pass could not fuse it, or did not run on this graph; "
            "see the 'unfused' warning); a comm hook runs on fused buckets only"
        )
    group = _torch.distributed.resolve_process_group(group_name)
    if group is None:
        raise RuntimeError(
            f"ddp_fusion.all_reduce_gradient: process group {group_name!r} is not "
            "registered in this process"
        )
    # cast, scale, sum, cast back: the order of torch's fp16/bf16 compress hooks
    out = grad.to(comm_dtype or grad.dtype, copy=True)
    if divisor is not None:
        out.div_(divisor)
    elif reduce_op == "avg":
        out.div_(scaling.divisor(group))
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return torch.empty_like(grad).copy_(out)


def _all_reduce_in_place(
    grads: list[torch.Tensor], group_name: str, algorithm: str, layout: str = "",
) -> None:
    """Issue the sum of one bucket's kept ``.grad`` tensors over the group, in place, and
    return without waiting (``wait_in_place`` waits): what the pass makes of a bucket
    whose gradients accumulate into ``.grad`` tensors that exist before the backward
    (passes/in_place.py; the gradients are already scaled).

    Every rank issues the collective its bucket's plan names, whatever the layout of its
    ``.grad``s: ``concat``, one ``all_reduce`` of the bucket's elements; ``coalesced``,
    one ``all_reduce_coalesced`` of the tensors. For ``concat``, ``.grad``s that are one
    run of memory in bucket order (a bucket's ``.grad`` views, as the first step leaves
    them: its reduced buffer) are reduced right there; others are gathered into a buffer
    first, and after the wait either move into it (see :func:`_movable`: then they are
    one run from the next step on) or get their part copied back. The checks read
    metadata only (pointers, strides), never a value. ``layout``: the pass's name for
    the ``.grad``s' sizes, strides and dtype where they are static (``""`` where not):
    with it the one-run check is a comparison of pointers after the first step
    (:func:`_one_run`)."""
    if _torch.distributed.resolve_process_group(group_name) is None:
        raise RuntimeError(
            f"ddp_fusion.all_reduce_in_place: process group {group_name!r} is not "
            "registered in this process"
        )
    c10d = _torch.distributed.c10d_functional
    counts = _torch.dynamo.counters()["ddp_fusion"]
    if algorithm == "coalesced":
        counts["in place: coalesced"] += 1
        # a contiguous .grad as it is (a 1-D view of each costs about 1 us a step)
        c10d.all_reduce_coalesced_(
            [g if g.is_contiguous() else _memory(g) for g in grads], "sum", group_name
        )
        return
    run = _one_run(grads, layout)
    gathered = run is None
    if gathered:
        counts["in place: gathered"] += 1
        if not _told_gathered:
            _told_gathered.append(True)
            log.info(
                "ddp_fusion: a bucket's kept .grad tensors are not one run of memory (made "
                "before the first backward, or in a no_sync() step, say): they are gathered "
                "into a buffer for their all-reduce, and then move into it where they own "
                "their memory (else their parts are copied back, every step)"
            )
        run = torch.cat([_memory(g) for g in grads])
    else:
        counts["in place: one run"] += 1
    # (replaces an entry left by a step that failed before its wait)
    _in_flight[id(grads[0])] = (run, gathered)
    c10d.all_reduce_(run, "sum", group_name)


def _wait_in_place(grads: list[torch.Tensor]) -> None:
    """Wait for ``all_reduce_in_place`` of the same tensors (and copy a gathered bucket
    back): one wait for a ``concat`` bucket, one per storage for ``coalesced`` (the
    functional collectives keep a collective's work by storage)."""
    run, gathered = _in_flight.pop(id(grads[0]), (None, False))
    if run is not None:
        _torch.distributed.wait_tensors((run,))
        if not gathered:
            return
        if _movable(grads, run):
            _torch.dynamo.counters()["ddp_fusion"]["in place: moved into the bucket"] += 1
            offset = run.storage_offset()
            for g in grads:
                g.set_(run.untyped_storage(), offset, g.size(), g.stride())
                offset += g.numel()
        else:
            for g, part in zip(grads, run.split([g.numel() for g in grads])):
                _memory(g).copy_(part)
        return
    _torch.distributed.wait_tensors(grads)


def _movable(grads: list[torch.Tensor], run: torch.Tensor) -> bool:
    """Whether a gathered bucket's ``.grad``s may move into ``run``, the buffer they were
    gathered into (in bucket order, each in its own memory order), instead of getting
    their parts copied back: each ``.grad`` then keeps its tensor object, shape and
    strides, its memory becomes its part of ``run``, and from the next step on the bucket
    is one run, reduced where it lies (what torch DDP's ``gradient_as_bucket_view``
    does to a ``.grad`` once). Only ``.grad``s that own all of their memory move (made
    by autograd, in a ``no_sync()`` step, say, or by the user as a tensor of their own):
    a view into a buffer of the user's (a flat-buffer optimizer's) must keep receiving
    its gradient there. On a GPU, only where every ``.grad`` keeps 16-byte alignment,
    which Inductor may have assumed for its inputs (else it would copy them every
    step)."""
    for g in grads:
        if g.storage_offset() != 0 or g.untyped_storage().nbytes() != g.nbytes:
            return False
    if run.device.type == "cpu":
        return True
    address, size = run.data_ptr(), run.element_size()
    offset = 0
    for g in grads:
        if (address + offset * size) % 16:
            return False
        offset += g.numel()
    return True


# a concat bucket in flight, by its first .grad (the same object reaches the op and its
# wait; a .grad is in one bucket) -> (the memory reduced: the .grads' own run, or the
# buffer they were gathered into; whether gathered), until the wait
_in_flight: dict[int, tuple[torch.Tensor, bool]] = {}
_told_gathered: list[bool] = []


def pending() -> int:
    """Buckets of kept ``.grad``s gathered into a buffer whose wait has not run: none
    between steps (see ``ddp_fusion.pending``)."""
    return sum(gathered for _, gathered in _in_flight.values())


def _memory(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's memory as a 1-D view; a contiguous tensor as itself. (The pass
    reduces in place only ``.grad``s whose memory holds the elements in their bucket's
    order, the same on every rank: passes/in_place.py.)"""
    if t.is_contiguous():
        return t.view(-1)
    if not is_dense(t):
        raise RuntimeError(
            f"ddp_fusion.all_reduce_in_place: a kept .grad of shape {list(t.shape)} has "
            f"strides {list(t.stride())}, not one run of memory; the graph was compiled "
            "for dense gradients"
        )
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` fills one run of memory, in some order of its dimensions (contiguous,
    channels-last, a transposed parameter's gradient, ...): what the in-place op takes.
    From sizes and strides (plan.py), no tensor op: it runs per ``.grad`` per step."""
    return t.is_contiguous() or laid_out(t, dims_in_memory(t))


def _one_run(grads: list[torch.Tensor], layout: str = "") -> torch.Tensor | None:
    """The 1-D view of the memory that ``grads`` fill one after another, if they do
    (dense, each starting where the one before ends, inside the first one's storage);
    else None. (A bucket's ``.grad``s have its dtype and device: the compiled graph's
    guards hold them to it.)

    ``layout`` names the ``.grad``s' sizes, strides and dtype (passes/in_place.py), which
    are static there: Dynamo's guards hold every call of the graph to them, and the pass
    found each dense. Whether such ``.grad``s are one run then depends on their pointers
    alone, so the walk runs once per layout and pointers (the first step, and after the
    ``.grad``s moved): later calls compare the pointers with the last run found (one
    ``data_ptr`` per ``.grad``, not the walk's sizes and strides) and check its end."""
    first = grads[0]
    storage = first.untyped_storage()
    if layout:
        ptrs = tuple(map(torch.Tensor.data_ptr, grads))
        known = _runs.get(layout)
        if known is not None and known[0] == ptrs:
            if ptrs[0] + known[1] > storage.data_ptr() + storage.nbytes():
                return None
            return first.as_strided((known[1] // first.element_size(),), (1,), first.storage_offset())
    end = first.data_ptr()
    numel = 0
    for g in grads:
        if g.data_ptr() != end or not is_dense(g):
            return None
        end += g.nbytes
        numel += g.numel()
    if end > storage.data_ptr() + storage.nbytes():
        return None  # (adjacent memory of another allocation)
    if layout:
        _runs[layout] = (ptrs, end - first.data_ptr())
    return first.as_strided((numel,), (1,), first.storage_offset())


# a bucket's layout, named by the pass -> the pointers of its .grads and their bytes when
# last found one run (one entry per bucket of a compiled graph with static .grads; a
# model's go with it: forget_runs)
_runs: dict[str, tuple[tuple[int, ...], int]] = {}


def forget_runs(model_id: int) -> None:
    """Drop the one-run entries of ``model_id``'s buckets (its layouts' names start with
    it, passes/in_place.py): when the model is released. (A model made again with the
    same id walks its ``.grad``s once more.)"""
    prefix = f"{model_id}/"
    for layout in [k for k in _runs if k.startswith(prefix)]:
        del _runs[layout]


# -- a bucket's collective and its wait (passes/concat.py, passes/coalesced.py) -----------
#
# ``_c10d_functional``'s all_reduce_ / all_reduce_coalesced_ / wait_tensor, as ddp_fusion
# ops that mutate the bucket in place and are tagged cudagraph-unsafe: Inductor lowers
# them as it lowers the functional collectives (one call on the bucket's buffer, no
# copy), and under mode="reduce-overhead" partitions the graph around them, so a CUDA
# graph never captures a bucket's collective or its wait (where NCCL's watchdog and the
# flight recorder could not see it, and its buffer would live in the graph's pool).
# Defined with torch.library directly, not custom_op: a mutating custom_op costs about
# 40 us of Python per call, and bumps the version of each tensor it mutates in Python
# (per .grad of a bucket, for the in-place ops); these cost about 5 us.
_lib = torch.library.Library("ddp_fusion", "FRAGMENT")
_lib.define("all_reduce_bucket(Tensor(a!) flat, str group_name) -> ()", tags=CUDAGRAPH_UNSAFE)
_lib.define("all_reduce_bucket_coalesced(Tensor(a!)[] tensors, str group_name) -> ()", tags=CUDAGRAPH_UNSAFE)
_lib.define("wait_bucket(Tensor(a!)[] tensors) -> ()", tags=CUDAGRAPH_UNSAFE)
_lib.define("all_reduce_in_place(Tensor(a!)[] grads, str group_name, str algorithm, str layout=\"\") -> ()",
            tags=CUDAGRAPH_UNSAFE)
_lib.define("wait_in_place(Tensor(a!)[] grads) -> ()", tags=CUDAGRAPH_UNSAFE)


def _all_reduce_bucket(flat: torch.Tensor, group_name: str) -> None:
    """Issue the sum of a bucket's flat buffer over ``group_name``, in place, without
    waiting (:func:`_wait_bucket` waits)."""
    _torch.distributed.c10d_functional.all_reduce_(flat, "sum", group_name)


def _all_reduce_bucket_coalesced(tensors: list[torch.Tensor], group_name: str) -> None:
    """Issue the sum of a bucket's tensors over ``group_name`` in one coalesced
    collective, in place, without waiting."""
    _torch.distributed.c10d_functional.all_reduce_coalesced_(tensors, "sum", group_name)


def _wait_bucket(tensors: list[torch.Tensor]) -> None:
    """Wait for the collective issued on ``tensors`` (the functional collectives keep a
    collective's work by storage)."""
    _torch.distributed.wait_tensors(tensors)


for _name, _impl in (("all_reduce_bucket", _all_reduce_bucket),
                     ("all_reduce_bucket_coalesced", _all_reduce_bucket_coalesced),
                     ("wait_bucket", _wait_bucket),
                     ("all_reduce_in_place", _all_reduce_in_place),
                     ("wait_in_place", _wait_in_place)):
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"ddp_fusion::{_name}", lambda *args: None, lib=_lib)

ALL_REDUCE_BUCKET = torch.ops.ddp_fusion.all_reduce_bucket.default
ALL_REDUCE_BUCKET_COALESCED = torch.ops.ddp_fusion.all_reduce_bucket_coalesced.default
WAIT_BUCKET = torch.ops.ddp_fusion.wait_bucket.default

ALL_REDUCE_IN_PLACE = torch.ops.ddp_fusion.all_reduce_in_place.default
WAIT_IN_PLACE = torch.ops.ddp_fusion.wait_in_place.default

ALL_REDUCE_GRADIENT = torch.ops.ddp_fusion.all_reduce_gradient.default
ALL_REDUCE_CHECKED = torch.ops.ddp_fusion.all_reduce_checked.default


def default_group(group: dist.ProcessGroup | None, who: str) -> dist.ProcessGroup:
    """``group``, or the world if None. Raises ``RuntimeError`` naming ``who`` if
    ``torch.distributed`` is not initialized."""
    if group is not None:
        return group
    if not dist.is_initialized():
        raise RuntimeError(
            f"{who}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() first or pass a process group"
        )
    return dist.group.WORLD


def _in_use() -> None:
    effects.want(effects.IN_USE)


def all_reduce_gradient(
    grad: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    reduce_op: str = "avg",
    bucket_cap_mb: float | None = None,
    bucket_cap_mb_list: Sequence[float] | None = None,
    name: str = "",
    comm_dtype: torch.dtype | None = None,
    ready_order: int | None = None,
) -> torch.Tensor:
    """All-reduce one gradient over ``group``, tagged for fusion.

    Gradients reduced with the same group, dtype, device, reduce op and bucket arguments
    are bucketed together by the pass when a function that calls this is traced
    (``make_fx`` or ``torch.compile``); run eagerly it is one blocking all-reduce.

    Args:
        grad: the local gradient.
        group: the process group (default: the world).
        reduce_op: ``"avg"`` (the default, DDP's) divides by the group size before
            summing; ``"sum"`` only sums.
        bucket_cap_mb, bucket_cap_mb_list: as for
            :class:`torch.nn.parallel.DistributedDataParallel`.
        name: labels the gradient in dumps (a parameter's name, say).
        comm_dtype: cast to it, scale, sum and cast back (torch's fp16/bf16 compress
            hooks, or an fp32 reduction of bf16 gradients).
        ready_order: the gradient's position in the order eager autograd makes
            gradients ready, if known; the pass buckets in that order instead of the
            graph's when every gradient of the graph has one.

    Returns:
        A new tensor, the reduced gradient; ``grad`` is not modified.
    """
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"all_reduce_gradient: grad must be a Tensor, got {type(grad).__name__}")
    if reduce_op not in REDUCE_OPS:
        raise ValueError(
            f"all_reduce_gradient: reduce_op must be one of {REDUCE_OPS}, got {reduce_op!r}"
        )
    group = default_group(group, "all_reduce_gradient")
    limits = ddp_bucket_limits(bucket_cap_mb, bucket_cap_mb_list)
    if ready_order is not None and (
        isinstance(ready_order, bool) or not isinstance(ready_order, int) or ready_order < 0
    ):
        raise ValueError(
            f"all_reduce_gradient: ready_order must be a non-negative int or None, got {ready_order!r}"
        )
    ready = -1 if ready_order is None else ready_order
    _torch.dynamo.at_trace_time(_in_use)  # the pass in its slot before Inductor keys the graph
    return ALL_REDUCE_GRADIENT(grad, group.group_name, reduce_op, limits, name, comm_dtype, ready)
