"""Creating nodes that keep the pass invariants (see passes/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg
from torch.utils._pytree import tree_map_only

from .. import _torch


class NodeMaker:
    """``graph.call_function`` that also sets ``meta["val"]``, computed on fake tensors.

    The fake mode is the one the graph's values already live in (Inductor's, or
    make_fx's), found once per pass; for a graph traced with real tensors a fresh fake
    mode is used, so the pass also runs outside Inductor.
    """

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.mode = _torch.detect_fake_mode(
            [n.meta.get("val") for n in graph.find_nodes(op="placeholder")]
        ) or _torch.detect_fake_mode([n.meta.get("val") for n in graph.nodes])
        if self.mode is None:
            from torch._subclasses.fake_tensor import FakeTensorMode

            self.mode = FakeTensorMode(allow_non_fake_inputs=True)
            self._convert = True
        else:
            self._convert = False

    def __call__(
        self, target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> torch.fx.Node:
        kwargs = kwargs or {}
        node = self.graph.call_function(target, args, kwargs)
        fake_args, fake_kwargs = map_arg((args, kwargs), lambda n: n.meta["val"])
        if self._convert:
            fake_args, fake_kwargs = tree_map_only(
                torch.Tensor, self._from_tensor, (fake_args, fake_kwargs)
            )
        if target is torch.ops.aten.view.default and not fake_kwargs:
            node.meta["val"] = _torch.fake_view(self.mode, *fake_args)
            return node
        shortcut = _SHORTCUTS.get(target)
        with self.mode:
            if shortcut is not None and not fake_kwargs:
                node.meta["val"] = shortcut(*fake_args)
            else:
                node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node

    def _from_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t if isinstance(t, torch._subclasses.fake_tensor.FakeTensor) else self.mode.from_tensor(t)


def memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The order of ``t``'s dimensions from outermost to innermost in memory, if ``t``
    is dense and non-overlapping but not contiguous (a channels-last gradient, say):
    ``t.permute(order)`` is then a contiguous view of the same memory. None otherwise."""
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)))
    permuted = t.permute(order)
    if t.is_contiguous() or not permuted.is_contiguous():
        return None
    return order


def _scale(x: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    # div by a 0-d float32 tensor: a floating ``x`` keeps its dtype (a 0-d tensor does
    # not promote a dimensioned one of the same category)
    if not x.is_floating_point() or divisor.dim() != 0 or not divisor.is_floating_point():
        return torch.div(x, divisor)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    if any(t.dim() != 1 or t.dtype != tensors[0].dtype for t in tensors):
        return torch.cat(tensors)
    return tensors[0].new_empty(sum(t.numel() for t in tensors))


# Fake-tensor propagation is most of the pass's cost (a few nodes per gradient). Views
# skip fake dispatch (_torch.fake_view, same storage as under dispatch); the other
# nodes the pass makes per gradient or bucket get the fresh tensors their meta
# functions would return, made directly instead of through fake dispatch.
_SHORTCUTS: dict[Any, Callable[..., torch.Tensor]] = {
    torch.ops._c10d_functional.all_reduce.default: lambda x, *_: torch.empty_like(
        x, memory_format=torch.contiguous_format
    ),
    torch.ops._c10d_functional.wait_tensor.default: lambda x: torch.empty_like(x),
    torch.ops.aten.div.Tensor: _scale,
    torch.ops.aten.cat.default: _cat,
}
