"""Tensors: fake tensors made without fake dispatch, DTensor shards, the autograd
engine's per-backward hooks, and pytree."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

REQUIRED = (
    "torch._C._DisableTorchDispatch",
    "torch._C._current_graph_task_id",
    "torch._guards.detect_fake_mode",
    "torch._subclasses.fake_tensor.FakeTensor",
    "torch._subclasses.fake_tensor.FakeTensorMode",
    "torch.utils._pytree.tree_leaves",
    "torch.utils._pytree.tree_map",
    "torch.utils._pytree.tree_map_only",
    "torch.autograd.Variable._execution_engine.queue_callback",
)

UNCHECKED: dict[str, str] = {}


def detect_fake_mode(values: Any) -> Any:
    """The fake mode of the fake tensors among ``values``, or None."""
    from torch._guards import detect_fake_mode as _detect

    return _detect(values)


def fake_mode(allow_non_fake_inputs: bool = False) -> Any:
    """A new ``FakeTensorMode``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs)


def is_fake(t: Any) -> bool:
    """Whether ``t`` is itself a fake tensor: a Python ``FakeTensor`` or, from torch 2.14,
    a fake made in C++, which is no ``FakeTensor`` instance (torch's own
    ``is_fake_tensor`` knows both; older releases have only the Python kind)."""
    from torch._subclasses import fake_tensor

    either = getattr(fake_tensor, "is_fake_tensor", None)  # torch >= 2.14
    return either(t) if either is not None else isinstance(t, fake_tensor.FakeTensor)


def fake_view_op(mode: Any, op: Any, base: torch.Tensor, *args: Any) -> Any:
    """``op(base, *args)`` for a view op (view, permute, split_with_sizes) of a fake
    tensor, without a trip through fake dispatch (several times faster; the pass makes
    a few per gradient): the op runs on the meta data, and each meta view is wrapped as
    a fake tensor, sharing ``base``'s storage exactly as a dispatched view would."""
    with torch._C._DisableTorchDispatch():
        out = op(base, *args)
    if isinstance(out, (list, tuple)):
        return [_wrap_fake(mode, t, base.fake_device) for t in out]
    return _wrap_fake(mode, out, base.fake_device)


def fake_empty(mode: Any, like: torch.Tensor, dtype: torch.dtype | None = None,
               numel: int | None = None) -> torch.Tensor:
    """A fresh fake tensor (a new storage): ``like``'s shape and strides (or 1-D of
    ``numel`` elements), in ``dtype``, on ``like``'s device; what an op that returns a
    new tensor gives, made without fake dispatch."""
    dtype = dtype or like.dtype
    with torch._C._DisableTorchDispatch():  # a plain meta tensor, whatever mode is active
        if numel is not None:
            meta = torch.empty(numel, dtype=dtype, device="meta")
        else:
            meta = torch.empty_strided(like.shape, like.stride(), dtype=dtype, device="meta")
    return _wrap_fake(mode, meta, like.fake_device)


def _wrap_fake(mode: Any, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensor

    if is_fake(t):
        return t
    # a fresh meta tensor: nothing to look up in (or add to) the converter's memo
    return FakeTensor(mode, t, device)


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (what data parallelism reduces), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def as_like(ref: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` wrapped as a DTensor laid out like ``ref`` if ``ref`` is one, else itself."""
    from torch.distributed.tensor import DTensor

    if not is_dtensor(ref):
        return local
    return DTensor.from_local(
        local, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape, stride=ref.stride()
    )


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has finished (call from a hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def current_backward_id() -> int:
    """An id of the running backward pass (-1 outside one); differs between passes."""
    return torch._C._current_graph_task_id()


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    from torch.utils._pytree import tree_map as _tree_map

    return _tree_map(fn, tree)


def tree_map_only(cls: type, fn: Callable[[Any], Any], tree: Any) -> Any:
    from torch.utils._pytree import tree_map_only as _tree_map_only

    return _tree_map_only(cls, fn, tree)


def tree_leaves(tree: Any) -> list[Any]:
    from torch.utils._pytree import tree_leaves as _tree_leaves

    return _tree_leaves(tree)
