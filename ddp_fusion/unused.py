"""Parameters unused on some ranks (``find_unused_parameters=True``), fused as eager DDP
reduces them.

Compiled autograd traces a parameter's hook only where the parameter gets a gradient,
so ranks that use different parameters (a mixture-of-experts expert that gets no token
here, a branch some samples take) compile different backward graphs. Eager torch DDP
keeps every bucket's full layout instead: a parameter unused here contributes zeros (or
its kept ``.grad``), and a used-parameter bitmap, all-reduced, tells each rank which
``.grad``s to set. ddp_fusion does the same inside the fused buckets:

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
  ``no_sync()``), else zeros; and its used flag (below). It is scaled and sent like any
  other gradient of the bucket.
* **Used flags.** Each such bucket sends, after its gradients and in the same
  collective, one flag per gradient: 1 for a gradient this rank's graph has, else
  whether the parameter got a gradient in a backward that did not reduce
  (``no_sync()``) since the last one that did (eager DDP marks those as used too;
  :class:`Unsynced`, set by the hooks). The flags are not scaled, so after the sum a
  flag is the number of ranks that used the parameter. No extra collective, no extra
  synchronising step: the agreement travels with the bucket (eager DDP all-reduces a
  separate bitmap).
* **Fix-up.** At the end of the graph (after the buckets' waits),
  ``ddp_fusion::unused_fixup`` gives each parameter absent here what eager DDP leaves:
  a kept ``.grad`` becomes the reduced gradient where some rank used the parameter and
  stays as it was where none did (``torch.where`` on the device: no host read); a
  ``.grad`` that is None becomes a copy of the reduced gradient only where some rank
  used the parameter, which is decided on the host: one read of those parameters'
  flags (a device sync on a GPU, as eager DDP's bitmap read), only in a step in which
  this rank has such a parameter. Cost O(parameters absent here); it also clears the
  no_sync marks.

Not covered (each keeps the old behaviour, where ranks that use different parameters
raise ``PlanMismatchError``): a model with a comm hook; a model whose gradient the pass
leaves unfused. A rank whose backward has no gradient of the model at all issues none
of its buckets (the others wait in the plan check until the group's timeout).
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from collections.abc import Sequence

import torch
import torch.fx

from . import _torch
from .ops import CUDAGRAPH_UNSAFE


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
    that reduces (the fix-up, or the eager reducer)."""

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
    flag_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a parameter this rank's graph has no gradient for contributes to its bucket
    (module docstring): a copy of its ``.grad`` (its local shard), or zeros, with the
    parameter's strides; and its used flag, 1 if it got a gradient under ``no_sync()``
    since the last backward that reduced, else 0 (a 1-element tensor of ``flag_dtype``;
    made by a fill on the device, no copy from the host)."""
    found = _live(model_id, "absent_grad")
    out = torch.empty_strided(size, stride, dtype=dtype, device=device)
    grad = found.param(index).grad
    if grad is None:
        out.zero_()
    else:
        out.copy_(_torch.tensors.local_tensor(grad))
    used = found.unsynced.marks[index]
    return out, torch.full((1,), 1.0 if used else 0.0, dtype=flag_dtype, device=device)


@_absent_grad.register_fake
def _(model_id, index, size, stride, dtype, device, flag_dtype):
    return (torch.empty_strided(size, stride, dtype=dtype, device=device),
            torch.empty((1,), dtype=flag_dtype, device=device))


@torch.library.custom_op("ddp_fusion::unused_fixup", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def _unused_fixup(
    flags: list[torch.Tensor],
    model_id: int,
    indices: Sequence[int],
    reduced: list[torch.Tensor],
    used: list[torch.Tensor],
) -> None:
    """After a backward of model ``model_id`` (module docstring): each parameter
    ``indices[i]`` that this rank's graph had no gradient for gets what eager DDP leaves
    in its ``.grad``, from its reduced gradient ``reduced[i]`` and its summed used flag
    ``used[i]`` (1 element); then the no_sync marks are cleared. ``flags``: the reduced
    flags of every bucket of the model in this graph, so that this runs after all of
    them (and after every ``absent_grad`` read the marks)."""
    found = _live(model_id, "unused_fixup")
    counts = _torch.dynamo.counters()["ddp_fusion"]
    counts["unused: absent gradients"] += len(indices)
    pending = []
    for index, red, flag in zip(indices, reduced, used):
        param = found.param(index)
        if param.grad is not None:
            # kept .grad: the reduced gradient where some rank used it, else unchanged
            grad = _torch.tensors.local_tensor(param.grad)
            grad.copy_(torch.where(flag > 0, red, grad))
        else:
            pending.append((param, red, flag))
    if pending:
        # None or a new .grad is a host decision: one read of these flags (eager DDP
        # reads its whole bitmap), only in a step with such a parameter
        counts["unused: host reads"] += 1
        seen = torch.cat([flag for *_, flag in pending]).tolist()
        for (param, red, _), count in zip(pending, seen):
            if count > 0:  # used on some rank: the average, as eager DDP gives it
                param.grad = _torch.tensors.as_like(param, red.clone(memory_format=torch.preserve_format))
    found.unsynced.settle()


@_unused_fixup.register_fake
def _(flags, model_id, indices, reduced, used):
    return None


ABSENT_GRAD = torch.ops.ddp_fusion.absent_grad.default
UNUSED_FIXUP = torch.ops.ddp_fusion.unused_fixup.default
# it returns nothing and mutates no argument: without this, FX and Inductor would
# drop it as dead code
torch.fx.node.has_side_effect(UNUSED_FIXUP)
