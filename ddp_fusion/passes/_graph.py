"""Creating nodes that keep the pass invariants (see passes/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg
from torch.utils._pytree import tree_map_only

from .. import _torch


def call_function(
    graph: torch.fx.Graph,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
) -> torch.fx.Node:
    """``graph.call_function`` that also sets ``meta["val"]``, computed on fake tensors.

    The fake mode is the one the inputs' (or else the graph inputs') values already live
    in (Inductor's, or make_fx's); for a graph traced with real tensors a fresh fake mode
    is used, so the pass also runs outside Inductor.
    """
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    fake_args, fake_kwargs = map_arg((args, kwargs), lambda n: n.meta["val"])
    mode = _torch.detect_fake_mode((fake_args, fake_kwargs))
    if mode is None:  # no tensor inputs: use the graph's own fake mode
        mode = _torch.detect_fake_mode(
            [n.meta.get("val") for n in graph.find_nodes(op="placeholder")]
        )
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake_args, fake_kwargs = tree_map_only(
            torch.Tensor, mode.from_tensor, (fake_args, fake_kwargs)
        )
    with mode:
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node
