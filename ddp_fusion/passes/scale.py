"""A gradient that a sum makes is divided inside that sum.

concat.py and coalesced.py divide each gradient of a bucket by the divisor before the
sum across ranks, as eager DDP divides its bucket. The gradient of a bias or of a norm
layer's weight is a sum over the batch (``sum(t, dims)``, often viewed to 1-D); such a
gradient is divided inside its sum instead::

    before:  s = sum(t, [0], True)               after:  s' = sum(div(t, divisor), [0])
             g = view(s, [n])                            (s' is the scaled gradient;
             scaled = div(g, divisor)                     s and g go)

Inductor folds the division into the reduction's loads, so the reduction writes its
result straight into the gradient's slice of the bucket (concat) or is itself the
tensor reduced (coalesced): no buffer of its own, and no statements to allocate and free
one in the step's generated code. (On a model of 400 small parameters, 300 of them a
bias's or a norm's: 300 allocations and 300 frees fewer per step.)

The result differs from dividing after the sum by rounding alone (not at all where the
divisor is a power of two), as reordering a sum does. Only for float32 and float64
gradients (no low-precision rounding of each divided term), without a ``comm_dtype``, of
static shapes, where nothing else reads the sum or the views between it and the
gradient. Never for the bucket's last gradient, which the checked divisor scales
(guard.py): a division inside its reduction would hold the reduction back until the
plan check.
"""

from __future__ import annotations

import torch
import torch.fx

from ._graph import NodeMaker
from .collectives import GradAllReduce

aten = torch.ops.aten

_VIEWS = (aten.view.default, aten.reshape.default, aten.squeeze.dim, aten.squeeze.dims)
_DTYPES = (torch.float32, torch.float64)


def divided_inside_sum(make: NodeMaker, g: GradAllReduce, divisor: torch.fx.Node) -> torch.fx.Node | None:
    """The new node ``sum(div(t, divisor), dims)``, 1-D, equal to ``g``'s gradient
    divided by ``divisor``, placed where the gradient's sum was; None (and the graph
    untouched) where ``g`` is not 1-D, float32/float64 and made by a ``sum`` over
    dimensions (through views) that nothing else reads. The old sum and its views go
    once the gradient's all-reduce does (:func:`erase_unread`)."""
    val = g.grad.meta["val"]
    if val.dim() != 1 or val.dtype not in _DTYPES:
        return None
    node = g.grad
    while node.target in _VIEWS and len(_readers(node)) == 1:
        node = node.args[0]
    if node.target is not aten.sum.dim_IntList or len(_readers(node)) != 1 or node.kwargs:
        return None
    t, dims = node.args[0], node.args[1]
    if not dims or not isinstance(t, torch.fx.Node):  # (an empty list sums over every dimension)
        return None
    shape = t.meta["val"].shape
    if not all(isinstance(n, int) for n in shape):
        return None  # (a symbolic batch: comparing sizes could add guards)
    reduced = {d % len(shape) for d in dims}
    if [n for d, n in enumerate(shape) if d not in reduced] != list(val.shape):
        return None  # (the views between regroup the elements)
    if node.meta["val"].dtype != val.dtype:
        return None
    with make.graph.inserting_before(node):
        scaled = make(aten.div.Tensor, (t, divisor))
        return make(aten.sum.dim_IntList, (scaled, sorted(reduced)))


def erase_unread(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    """Erase each of ``nodes`` that nothing reads any more, and then what it read, as
    far as nodes go that nothing reads and that have no effect: the sums and views
    :func:`divided_inside_sum` replaced, once the gradient's all-reduce is gone."""
    stack, erased = list(nodes), set()
    while stack:
        node = stack.pop()
        if node in erased or node.op != "call_function" or node.is_impure():
            continue
        for reader in list(node.users):
            if reader.target is aten.new_empty_strided.default and not reader.users:
                graph.erase_node(reader)
                erased.add(reader)
        if node.users:
            continue
        stack.extend(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node``'s readers, less the unread ``new_empty_strided`` that compiled
    autograd's capture leaves beside a gradient (it reads only its metadata)."""
    return [u for u in node.users if not (u.target is aten.new_empty_strided.default and not u.users)]
