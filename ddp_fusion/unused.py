"""Parameters unused on some ranks (``find_unused_parameters=True``), fused as eager DDP
reduces them.

Compiled autograd traces a parameter's hook only where the parameter gets a gradient,
so ranks that use different parameters (a mixture-of-experts expert that gets no token
here, a branch some samples take) compile different backward graphs. Eager torch DDP
keeps every bucket's full layout instead: a parameter unused here contributes zeros (or
its kept ``.grad``), and a used-parameter bitmap, all-reduced on the device and read on
the host, tells each rank which ``.grad``s to set. ddp_fusion does the same with the
bitmap on the host:

* **Layout.** A model built with ``find_unused_parameters=True`` registers its
  parameters here (:func:`register`; names, shapes, strides, dtypes, in eager DDP's
  order for that flag: reverse parameter order). The pass (passes/bucketing.py) plans
  that model's buckets over this layout, not over the gradients this rank's graph
  happens to have, so the plan (and its hash, which the per-step plan check compares)
  is the same on every rank whichever parameters each rank used. The layout is part of
  the pass's FX-graph-cache key (:func:`cache_key`, read by ``_install``).
* **Absent gradients.** For a parameter of the layout that this rank's graph has no
  gradient for, the pass inserts ``ddp_fusion::absent_grad``, which returns at run time
  what eager DDP's reducer puts in its slot: the parameter's kept ``.grad`` (say, the
  zeros of ``zero_grad(set_to_none=False)``, or gradients accumulated under
  ``no_sync()``), else zeros. It is scaled and sent like any other gradient of its
  bucket: the buckets are eager DDP's, byte for byte.
* **Which parameters some rank used.** Each rank knows on the host which parameters it
  used in this step: those its graph has a gradient for (a constant of the graph), and
  those that got a gradient in a backward under ``no_sync()`` since the last one that
  reduced (eager DDP counts those as used; :class:`Unsynced`, marked by the hooks). At
  the start of the graph, right after the plan check's exchange,
  ``ddp_fusion::used_start`` starts the element-wise max of these bits (one int64 per
  parameter) over the model group's *host group* (host_group.py: host-side, O(log N)
  rounds, off the training process's GIL, like the plan check), and clears
  the no_sync marks. Nothing on the device: no extra collective on the model's group,
  no device tensor read on the host, and the wait (at the end of the graph) is for an
  exchange every rank started at the beginning of its backward.
* **Fix-up.** At the end of the graph (after the buckets' waits), where this rank's
  graph lacks some parameters, ``ddp_fusion::unused_fixup`` gives each of them what
  eager DDP leaves: the reduced gradient where some rank used it (copied into a kept
  ``.grad``, or a new ``.grad`` with the parameter's strides), and its ``.grad``
  untouched (None, or the tensor as it was) where no rank did. Cost O(parameters absent
  here).

A joined rank (``join()``) takes part in each exchange with zeros (:func:`shadow`).

Not covered (each keeps the old behaviour, where ranks that use different parameters
raise ``PlanMismatchError``): a model with a comm hook that reduces its buckets; a
model whose gradient the pass leaves unfused. A rank whose backward has no gradient of
the model at all issues none of its buckets (the others wait in the plan check until
the group's timeout).
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.fx

from . import _torch, host_group
from .ops import CUDAGRAPH_UNSAFE
from .plan import BucketPlan


@dataclasses.dataclass(frozen=True)
class Slot:
    """One parameter of a layout (its local shard, for a DTensor)."""

    name: str
    index: int
    """The parameter's index in the model's list of reduced parameters."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class Unsynced:
    """Which parameters got a gradient in a backward that did not reduce (``no_sync()``)
    since the last one that did: eager DDP counts them as used at the next backward
    that reduces. Set by the model's hooks (under compiled autograd a side effect that
    Dynamo replays after each such backward), read and cleared at the next backward
    that reduces (``used_start``, or the eager reducer)."""

    def __init__(self, n: int) -> None:
        self.marks = [False] * n
        self.dirty = False

    def settle(self) -> None:
        """Forget the marks (a backward that reduces has used them)."""
        if self.dirty:
            self.marks[:] = [False] * len(self.marks)  # in place: the hooks hold this list
            self.dirty = False


class Layout:
    """A ``find_unused_parameters`` model's parameters in bucket order."""

    def __init__(self, model_id: int, params: list[tuple[str, torch.Tensor]], order: Sequence[int]) -> None:
        self.model_id = model_id
        local = [_torch.tensors.local_tensor(p.detach()) for _, p in params]
        self.slots = tuple(
            Slot(params[i][0], i, tuple(local[i].shape), tuple(local[i].stride()), local[i].dtype)
            for i in order
        )
        self._params = [weakref.ref(p) for _, p in params]
        self.unsynced = Unsynced(len(params))
        # this step's exchange of used bits (host_group.max_async's), or the bits (no peers)
        self.pending: host_group.Exchange | list[int] | None = None
        text = repr([(s.name, s.index, s.shape, s.stride, str(s.dtype)) for s in self.slots])
        self.digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def param(self, index: int) -> torch.Tensor:
        p = self._params[index]()
        if p is None:
            raise RuntimeError(f"ddp_fusion: model {self.model_id}'s parameter #{index} no longer exists")
        return p


_layouts: dict[int, Layout] = {}


def register(model_id: int, params: list[tuple[str, torch.Tensor]], order: Sequence[int]) -> Layout:
    """Register a ``find_unused_parameters`` model (``order``: parameter indices in
    bucket order); it stays until :func:`unregister`."""
    layout = _layouts[model_id] = Layout(model_id, params, order)
    return layout


def unregister(model_id: int, layout: Layout) -> None:
    """Forget ``layout`` (its model is garbage), unless a new model took its id."""
    if _layouts.get(model_id) is layout:
        del _layouts[model_id]


def layout(model_id: int) -> Layout | None:
    """The registered layout of model ``model_id``, if it reduces with
    ``find_unused_parameters``."""
    return _layouts.get(model_id)


def cache_key() -> str | None:
    """What the pass reads from this registry, for the FX graph cache key (None when no
    ``find_unused_parameters`` model is alive, so other graphs' keys do not change)."""
    if not _layouts:
        return None
    return ",".join(f"{m}:{_layouts[m].digest}" for m in sorted(_layouts))


def _live(model_id: int, who: str) -> Layout:
    found = _layouts.get(model_id)
    if found is None:
        raise RuntimeError(
            f"ddp_fusion.{who}: no live find_unused_parameters model {model_id} in this "
            "process (was the model deleted after its backward was compiled?)"
        )
    return found


@torch.library.custom_op("ddp_fusion::absent_grad", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def _absent_grad(
    model_id: int,
    index: int,
    size: Sequence[int],
    stride: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """What a parameter this rank's graph has no gradient for contributes to its bucket
    (module docstring): a copy of its ``.grad`` (its local shard), or zeros, with the
    parameter's strides."""
    out = torch.empty_strided(size, stride, dtype=dtype, device=device)
    grad = _live(model_id, "absent_grad").param(index).grad
    if grad is None:
        return out.zero_()
    return out.copy_(_torch.tensors.local_tensor(grad))


@_absent_grad.register_fake
def _(model_id, index, size, stride, dtype, device):
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


@torch.library.custom_op("ddp_fusion::used_start", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def _used_start(after: torch.Tensor, group_name: str, model_id: int, present: Sequence[int]) -> torch.Tensor:
    """Start this step's agreement on which parameters of model ``model_id`` some rank
    used (module docstring): the max over the group's host group of one bit per
    parameter, 1 for those in ``present`` (this graph's gradients) and for those used
    under ``no_sync()`` since the last backward that reduced; then clear those marks.
    ``after``: the plan check's token (every rank starts its exchanges in the same
    order). Returns a token for :func:`_unused_fixup` (a 0-d CPU tensor)."""
    found = _live(model_id, "used_start")
    bits = [1 if used else 0 for used in found.unsynced.marks]
    for i in present:
        bits[i] = 1
    found.unsynced.settle()
    known = host_group.known(group_name)  # a steady step's (looked up the first time)
    if known is not None:
        host = known[1]
    else:
        group = _torch.distributed.resolve_process_group(group_name)
        host = host_group.of(group) if group is not None else None
    if host is None:
        found.pending = bits  # no peers: used anywhere is used here
    else:
        host.ticket()
        found.pending = host.max_async(bits)
    return torch.zeros((), device="cpu")  # host-side: a token the graph only orders by


@_used_start.register_fake
def _(after, group_name, model_id, present):
    return torch.empty((), device="cpu")


@torch.library.custom_op("ddp_fusion::unused_fixup", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def _unused_fixup(token: torch.Tensor, model_id: int, indices: Sequence[int],
                  reduced: list[torch.Tensor]) -> None:
    """After a backward of model ``model_id`` (module docstring): each parameter
    ``indices[i]`` that this rank's graph had no gradient for gets what eager DDP leaves
    in its ``.grad``, from its reduced gradient ``reduced[i]`` and the outcome of the
    exchange ``used_start`` began (``token``): nothing read from the device."""
    found = _live(model_id, "unused_fixup")
    pending, found.pending = found.pending, None
    if pending is not None and not isinstance(pending, list):
        try:
            pending = pending.result()
        except Exception as e:
            raise RuntimeError(
                f"ddp_fusion: the exchange of used parameters of model {model_id} failed (a "
                "rank died, or did not reach this step's backward within the group's "
                f"timeout): {type(e).__name__}: {e}"
            ) from e
    if pending is None:
        raise RuntimeError(f"ddp_fusion: model {model_id}'s backward ended without its used_start")
    _torch.dynamo.counters()["ddp_fusion"]["unused: absent gradients"] += len(indices)
    for index, red in zip(indices, reduced):
        if pending[index] <= 0:
            continue  # used by no rank: .grad untouched, as eager DDP leaves it
        param = found.param(index)
        if param.grad is not None:
            _torch.tensors.local_tensor(param.grad).copy_(red)
        else:
            param.grad = _torch.tensors.as_like(param, red.clone(memory_format=torch.preserve_format))


@_unused_fixup.register_fake
def _(token, model_id, indices, reduced):
    return None


ABSENT_GRAD = torch.ops.ddp_fusion.absent_grad.default
USED_START = torch.ops.ddp_fusion.used_start.default
UNUSED_FIXUP = torch.ops.ddp_fusion.unused_fixup.default
# they return nothing the graph uses (used_start: a token only the fix-up reads, where
# this rank's graph lacks a parameter): without this, FX and Inductor would drop them
# as dead code
torch.fx.node.has_side_effect(USED_START)
torch.fx.node.has_side_effect(UNUSED_FIXUP)


def models_of(plan: BucketPlan) -> list[tuple[int, int]]:
    """(number in the plan, number of parameters) of each model laid out in ``plan``, in
    the order its ``used_start`` runs (the order of the models' first buckets)."""
    counts: dict[int, int] = {}
    for b in plan.buckets:
        if b.layout is not None:
            counts[b.layout] = counts.get(b.layout, 0) + len(b.grads)
    return list(counts.items())


def shadow(group: dist.ProcessGroup, plan: BucketPlan) -> None:
    """A joined rank's part of one fused backward's agreements on used parameters (after
    the plan check's): each exchange, with nothing used."""
    host = host_group.of(group)
    for _, n in models_of(plan):
        host.ticket()
        host.max_async([0] * n).result()
