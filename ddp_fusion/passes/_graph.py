"""Creating nodes that keep the pass invariants (see passes/__init__.py)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg

from .. import _torch
from ..ops import ALL_REDUCE_BUCKET, ALL_REDUCE_BUCKET_COALESCED, ALL_REDUCE_IN_PLACE, WAIT_BUCKET, \
    WAIT_IN_PLACE


class NodeMaker:
    """``graph.call_function`` that also sets ``meta["val"]``, computed on fake tensors.

    The fake mode is the one the graph's values already live in (Inductor's, or
    make_fx's), found once per pass; for a graph traced with real tensors a fresh fake
    mode is used, so the pass also runs outside Inductor.
    """

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.mode = _torch.tensors.detect_fake_mode(
            [n.meta.get("val") for n in graph.find_nodes(op="placeholder")]
        ) or _torch.tensors.detect_fake_mode([n.meta.get("val") for n in graph.nodes])
        if self.mode is None:
            self.mode = _torch.tensors.fake_mode(allow_non_fake_inputs=True)
            self._convert = True
        else:
            self._convert = False

    def __call__(
        self,
        target: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        name: str | None = None,
    ) -> torch.fx.Node:
        """``name``: the node's name (made unique by the graph), else one from ``target``."""
        kwargs = kwargs or {}
        node = self.graph.call_function(target, args, kwargs, name=name)
        fake_args, fake_kwargs = map_arg((args, kwargs), lambda n: n.meta["val"])
        if self._convert:
            fake_args, fake_kwargs = _torch.tensors.tree_map_only(
                torch.Tensor, self._from_tensor, (fake_args, fake_kwargs)
            )
        val = None
        if not fake_kwargs and not self._convert:
            shortcut = _SHORTCUTS.get(target)
            val = shortcut(self.mode, target, *fake_args) if shortcut is not None else None
        if val is None:
            with self.mode:
                val = target(*fake_args, **fake_kwargs)
        elif val is _RETURNS_NONE:
            val = None
        node.meta["val"] = val
        return node

    def _from_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t if _torch.tensors.is_fake(t) else self.mode.from_tensor(t)


# Fake-tensor propagation is most of the pass's cost (a few nodes per gradient). The
# nodes the pass makes per gradient or bucket get their values without fake dispatch:
# views are computed on the meta data (_torch.tensors.fake_view_op), fresh results are new fake
# tensors of the shape, strides and dtype the op's meta function gives. A shortcut
# returns None where it does not apply; the node then goes through fake dispatch.
_Shortcut = Callable[..., Any]


def _view(mode: Any, op: Any, base: Any, *args: Any) -> Any:
    return _torch.tensors.fake_view_op(mode, op, base, *args)


def _getitem(mode: Any, op: Any, seq: Any, i: Any) -> Any:
    return seq[i] if isinstance(seq, (list, tuple)) else None


def _scale(mode: Any, op: Any, x: Any, divisor: Any) -> Any:
    # div by the guard's 0-d float32 tensor: a floating ``x`` keeps its dtype (a 0-d
    # tensor does not promote a dimensioned one of the same category)
    if not (isinstance(x, torch.Tensor) and isinstance(divisor, torch.Tensor) and x.is_floating_point()
            and x.dim() > 0 and divisor.dim() == 0 and divisor.is_floating_point()
            and _strictly_contiguous(x)):
        return None
    return _torch.tensors.fake_empty(mode, x)


def _strictly_contiguous(x: torch.Tensor) -> bool:
    """Strides exactly those of a new contiguous tensor, which the op returns
    (``is_contiguous()`` also holds for, e.g., size (1,) with stride (2,))."""
    step = 1
    for size, stride in zip(reversed(x.shape), reversed(x.stride())):
        if stride != step:
            return False
        step *= max(int(size), 1)
    return True


def _scale_all(mode: Any, op: Any, xs: Any, divisor: Any) -> Any:
    # _foreach_div promotes some low-precision tensors by a float32 divisor (see
    # coalesced.py); the shortcut takes only tensors of the divisor's dtype
    if not (isinstance(divisor, torch.Tensor) and divisor.dim() == 0
            and all(x.dtype == divisor.dtype and _strictly_contiguous(x) for x in xs)):
        return None
    return [_torch.tensors.fake_empty(mode, x) for x in xs]


def _cat(mode: Any, op: Any, tensors: Any, dim: int = 0) -> Any:
    if dim != 0 or any(t.dim() != 1 or t.dtype != tensors[0].dtype for t in tensors):
        return None
    return _torch.tensors.fake_empty(mode, tensors[0], numel=sum(t.numel() for t in tensors))


def _sum(mode: Any, op: Any, x: Any, dims: Any, keepdim: bool = False) -> Any:
    # a sum over every dimension but one, none kept: a bias's gradient (scale.py)
    if keepdim or not dims or not (isinstance(x, torch.Tensor) and x.is_floating_point()):
        return None
    reduced = {d % x.dim() for d in dims}
    left = [n for d, n in enumerate(x.shape) if d not in reduced]
    if len(left) != 1 or not isinstance(left[0], int):
        return None
    return _torch.tensors.fake_empty(mode, x, numel=left[0])


def _copy(mode: Any, op: Any, dst: Any, src: Any) -> Any:
    # copy_ returns its destination (a gradient copied into its kept .grad)
    if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and dst.shape == src.shape:
        return dst
    return None


_RETURNS_NONE = object()
"""A shortcut's answer for an op that returns nothing (the bucket collectives and waits)."""


def _returns_none(mode: Any, op: Any, *args: Any) -> Any:
    return _RETURNS_NONE


def _convert(mode: Any, op: Any, x: Any, dtype: Any) -> Any:
    return _torch.tensors.fake_empty(mode, x, dtype) if _strictly_contiguous(x) else None


_aten = torch.ops.aten
_SHORTCUTS: dict[Any, _Shortcut] = {
    _aten.view.default: _view,
    _aten.permute.default: _view,
    _aten.alias.default: _view,
    _aten.split_with_sizes.default: _view,
    operator.getitem: _getitem,
    _aten.div.Tensor: _scale,
    _aten._foreach_div.Tensor: _scale_all,
    _aten.cat.default: _cat,
    _aten.sum.dim_IntList: _sum,
    torch.ops.prims.convert_element_type.default: _convert,
    _aten.copy_.default: _copy,
    # the bucket collectives and their waits, in place (ops.py)
    ALL_REDUCE_BUCKET: _returns_none,
    ALL_REDUCE_BUCKET_COALESCED: _returns_none,
    WAIT_BUCKET: _returns_none,
    ALL_REDUCE_IN_PLACE: _returns_none,
    WAIT_IN_PLACE: _returns_none,
}
