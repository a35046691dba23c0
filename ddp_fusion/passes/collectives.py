"""Find the tagged gradient all-reduces (``ddp_fusion::all_reduce_gradient``) in a graph.

Only nodes whose target is that op are candidates; every other collective (tensor
parallel, user code, upstream DDP's) is invisible to ddp_fusion. A candidate the pass
cannot bucket is reported with a reason and left as it is: it still runs, as one
blocking all-reduce.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from .. import _torch
from ..ops import ALL_REDUCE_GRADIENT
from ..plan import dims_in_memory, element_order


@dataclasses.dataclass(frozen=True)
class BucketKey:
    """Gradients with equal keys may share a bucket; different keys never do."""

    group_name: str
    dtype: torch.dtype
    device: torch.device
    reduce_op: str
    limits: tuple[int, ...]
    comm_dtype: torch.dtype | None = None
    model_id: int = -1  # the model whose hook made the call (-1: all_reduce_gradient)


@dataclasses.dataclass
class GradAllReduce:
    node: torch.fx.Node | None  # the ddp_fusion::all_reduce_gradient call (None: absent)
    grad: torch.fx.Node | None  # its input: the local gradient (absent: made by the pass)
    key: BucketKey
    shape: tuple[int, ...]
    numel: int
    nbytes: int
    name: str  # parameter name given by the hook, may be ""
    ready_order: int = -1
    """Position in eager autograd's ready order, from the hook; -1: unknown."""
    absent: int = -1
    """A parameter of a ``find_unused_parameters`` model that this rank's graph has no
    gradient for: its index in the model (ddp_fusion/unused.py); -1: a gradient of
    the graph."""

    order: tuple[int, ...] | None = None
    """The order of its dimensions in its bucket, its parameter's layout, the same on
    every rank (plan.py: "Element order"); None: no model registered it."""

    def dims(self) -> tuple[int, ...]:
        """The order of its dimensions in its bucket: the registered one, else that of
        the gradient's own memory (a gradient of ``all_reduce_gradient`` called
        directly)."""
        return self.order if self.order is not None else dims_in_memory(self.grad.meta["val"])

    @property
    def label(self) -> str:
        return self.name or self.node.name

    @property
    def is_absent(self) -> bool:
        return self.absent >= 0


@dataclasses.dataclass
class Unfused:
    node: torch.fx.Node
    reason: str
    group_name: str
    reduce_op: str
    label: str  # the parameter name the hook gave, else the node's name (as found)
    registered: bool  # its process group is registered in this process


def find_gradient_all_reduces(
    graph: torch.fx.Graph,
) -> tuple[list[GradAllReduce], list[Unfused]]:
    """Tagged all-reduces in graph order, and the ones that cannot be bucketed."""
    found: list[GradAllReduce] = []
    unfused: list[Unfused] = []
    registered: dict[str, bool] = {}
    for node in graph.find_nodes(op="call_function", target=ALL_REDUCE_GRADIENT, sort=True):
        grad, group_name, reduce_op, limits, name, comm_dtype, ready_order, model_id = op_args(node)
        val = grad.meta.get("val") if isinstance(grad, torch.fx.Node) else None
        reason = None
        if not isinstance(val, torch.Tensor):
            reason = "the gradient has no tensor metadata (meta['val'])"
        elif val.layout != torch.strided:
            reason = f"the gradient's layout is {val.layout}; only dense (strided) gradients fuse"
        elif not all(isinstance(s, int) for s in val.shape):
            reason = "the gradient has a symbolic shape; bucket sizes must be static"
        else:
            if group_name not in registered:
                registered[group_name] = _torch.distributed.resolve_process_group(group_name) is not None
            if not registered[group_name]:
                reason = f"process group {group_name!r} is not registered in this process"
        if reason is not None:
            if group_name not in registered:
                registered[group_name] = _torch.distributed.resolve_process_group(group_name) is not None
            unfused.append(Unfused(node, reason, group_name, reduce_op, name or node.name,
                                   registered[group_name]))
            continue
        found.append(
            GradAllReduce(
                node=node,
                grad=grad,
                key=BucketKey(
                    group_name, val.dtype, val.device, reduce_op, tuple(limits),
                    None if comm_dtype == val.dtype else comm_dtype,
                    model_id,
                ),
                shape=tuple(val.shape),
                numel=val.numel(),
                nbytes=val.numel() * val.element_size(),
                name=name,
                ready_order=ready_order,
                order=_order(model_id, name, val),
            )
        )
    return found, unfused


def drop_unwritten_kept_grads(graph: torch.fx.Graph) -> list[str]:
    """Remove the tagged all-reduces of kept ``.grad``s that this backward did not write,
    and return their parameters' names.

    A compiled model's callback (grad_sync.py) reads every parameter's ``.grad`` when the
    backward ends, where a hook per parameter fired only for the gradients the backward
    made. A kept ``.grad`` the backward did not write is a graph input that its tagged
    all-reduce reads and whose result is copied back into it: it is not reduced, as its
    hook would not have fired (torch DDP without ``find_unused_parameters`` raises
    there; a parameter without a gradient on some ranks only still makes their plans
    differ, ``PlanMismatchError``). Only a model's calls (``model_id`` set): code that
    calls ``all_reduce_gradient`` on a graph input itself gets it reduced."""
    dropped = []
    for node in graph.find_nodes(op="call_function", target=ALL_REDUCE_GRADIENT, sort=False):
        grad = node.args[0]
        if not isinstance(grad, torch.fx.Node) or grad.op != "placeholder" or len(node.users) != 1:
            continue
        (copy,) = node.users
        if copy.target is not torch.ops.aten.copy_.default or copy.args != (grad, node):
            continue
        *_, name, _, _, model_id = op_args(node)
        if model_id < 0:
            continue
        copy.replace_all_uses_with(grad)  # (copy_ returns its destination)
        graph.erase_node(copy)
        graph.erase_node(node)
        dropped.append(name or grad.name)
    return dropped


def is_identity(order: tuple[int, ...]) -> bool:
    return all(i == d for i, d in enumerate(order))


def _order(model_id: int, name: str, val: torch.Tensor) -> tuple[int, ...] | None:
    order = element_order(model_id, name)
    return order if order is not None and len(order) == val.dim() else None


def op_args(node: torch.fx.Node) -> tuple:
    """A tagged all-reduce's arguments, all of them, in the op's order."""
    schema = node.target._schema.arguments  # type: ignore[union-attr]
    return tuple(
        node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
        for i, a in enumerate(schema)
    )
