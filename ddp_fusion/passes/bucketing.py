"""Bucket planning: which tagged gradient all-reduces share one collective.

The rule is eager DDP's (``ddp_fusion.plan``: per key, in ready order, a bucket closes
once its bytes reach the current limit); gradients are split by key (process group,
dtype, device, reduce op, bucket limits, communication dtype, model).

Ready order is eager autograd's when the hooks say it (``ready_order`` on each tagged
all-reduce: the wrapper learns it once from a fake-tensor run of the model in eager
autograd, see ``ddp_fusion/ready_order.py``), so buckets hold exactly the gradients
eager DDP's rebuilt buckets hold; each bucket's collective then goes right after the
last of its gradients is computed in the graph, and not before the previous bucket's.
Otherwise it is the order the graph computes the gradients in, which differs from eager
autograd's inside a layer (a compiled backward computes a Linear's weight gradient
before its bias gradient).

One case eager DDP never meets: in a hand-built graph a gradient may be computed from an
earlier gradient's *reduced* value. Then the earlier gradient's bucket (whatever its key)
must be issued before the dependent gradient exists, so it is closed there (and the cut
is recorded in the plan); otherwise two buckets could each wait for the other.
"""

from __future__ import annotations

import dataclasses

import torch.fx

from ..ops import HOOK, READY_UNKNOWN
from ..plan import BucketPlan, BucketRule, PlannedBucket, split_by_rule
from ..ready_order import graph_order
from .collectives import BucketKey, GradAllReduce, Unfused


@dataclasses.dataclass
class Bucket:
    key: BucketKey
    grads: list[GradAllReduce]
    cut_reason: str | None = None
    """Why this bucket closed early (the next gradient of its key depends on it)."""

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.grads)


def plan_buckets(graph: torch.fx.Graph, grads: list[GradAllReduce]) -> list[Bucket]:
    """Buckets in the order their collectives are to be issued: each after the last of
    its gradients and after the bucket before it (passes/__init__.py)."""
    if grads and all(g.ready_order >= 0 for g in grads) and not _reads_reduced(graph, grads):
        return _plan_in_ready_order(graph, grads)
    if any(g.key.model_id >= 0 and g.ready_order == READY_UNKNOWN for g in grads):
        graph_order(
            "a model's gradients carry no ready order: its forward did not run compiled "
            "with config.enabled and grad mode on before this backward was compiled. Either "
            "config.enabled was turned on after the model's forward was compiled (set it "
            "before the first torch.compile call, or call torch._dynamo.reset() after "
            "setting it), or its .module was called instead of the model"
        )
    return _plan_in_graph_order(graph, grads)


def _split(key: BucketKey, grads: list[GradAllReduce]) -> list[Bucket]:
    """DDP's rule over ``grads`` (one key, in ready order)."""
    return [Bucket(key, same) for same in split_by_rule(grads, lambda g: g.nbytes, key.limits)]


def _plan_in_ready_order(graph: torch.fx.Graph, grads: list[GradAllReduce]) -> list[Bucket]:
    """Per key, DDP's rule over the ready order, and the key's buckets issued in that
    order (as eager DDP launches its buckets strictly in order), so ranks with the same
    buckets issue them in the same order even where their graphs compute gradients in
    different orders. Across keys (another group, dtype or wrapper), buckets interleave
    by where they can first be issued in the graph."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    by_key: dict[BucketKey, list[GradAllReduce]] = {}
    for g in grads:
        by_key.setdefault(g.key, []).append(g)
    ready_at: list[tuple[int, int, int, Bucket]] = []
    for k, (key, same) in enumerate(by_key.items()):
        at = -1
        for i, b in enumerate(_split(key, sorted(same, key=lambda g: g.ready_order))):
            at = max(at, *(position[g.grad] for g in b.grads))
            ready_at.append((at, k, i, b))
    return [b for *_, b in sorted(ready_at, key=lambda t: t[:3])]


def _reads_reduced(graph: torch.fx.Graph, grads: list[GradAllReduce]) -> bool:
    """Whether some gradient is computed from a reduced gradient (possible only in
    hand-built graphs). Ready-order buckets could then wait on each other, so the plan
    falls back to graph order, which cuts buckets where needed."""
    reduced = {g.node for g in grads}
    inputs = {g.grad for g in grads}
    for node in graph.nodes:
        if node not in reduced and any(i in reduced for i in node.all_input_nodes):
            if node in inputs:
                return True
            reduced.add(node)
    return False


def _plan_in_graph_order(graph: torch.fx.Graph, grads: list[GradAllReduce]) -> list[Bucket]:
    """Buckets in the order they close (so, the order their collectives are issued).

    A gradient is *ready* where its value is computed: the position of the all-reduce's
    input, not of the all-reduce (Inductor may sink an all-reduce whose only reader is
    the graph output, as in the first step's backward, where ``.grad`` is still None).

    One walk over the graph; the only state beyond the open buckets is, for nodes that
    depend on a gradient in a still-open bucket, which open buckets they depend on (in a
    compiled backward that is just the graph's output).
    """
    ready_at: dict[torch.fx.Node, list[GradAllReduce]] = {}
    for g in grads:
        ready_at.setdefault(g.grad, []).append(g)
    bucket_of: dict[torch.fx.Node, Bucket] = {}
    rules: dict[BucketKey, BucketRule] = {}
    open_buckets: dict[BucketKey, Bucket] = {}
    closed: list[Bucket] = []
    # node -> ids of open buckets whose reduced gradients it (transitively) reads.
    depends_on: dict[torch.fx.Node, set[int]] = {}

    def close(bucket: Bucket) -> None:
        del open_buckets[bucket.key]
        closed.append(bucket)

    for node in graph.nodes:
        deps: set[int] = set()
        for inp in node.all_input_nodes:
            deps.update(depends_on.get(inp, ()))
        for grad in ready_at.get(node, ()):
            # A gradient computed from reduced values of open buckets (of any key) can
            # only be produced after those buckets' collectives: close them here.
            for bucket in [b for b in open_buckets.values() if id(b) in deps]:
                bucket.cut_reason = (
                    f"gradient {grad.label} is computed from the reduced value of a "
                    "gradient in this bucket"
                )
                rules[bucket.key].close()
                close(bucket)
            bucket = open_buckets.get(grad.key)
            if bucket is None:
                bucket = open_buckets[grad.key] = Bucket(grad.key, [])
            bucket.grads.append(grad)
            bucket_of[grad.node] = bucket
            rule = rules.get(grad.key) or rules.setdefault(grad.key, BucketRule(grad.key.limits))
            if rule.add(grad.nbytes):
                close(bucket)
        if node in bucket_of:
            deps.add(id(bucket_of[node]))
        if deps:
            deps &= {id(b) for b in open_buckets.values()}
            if deps:
                depends_on[node] = deps
    closed.extend(open_buckets.values())
    return closed


def to_plan(buckets: list[Bucket], unfused: list[Unfused], algorithm: str) -> BucketPlan:
    """The typed plan of ``buckets`` (same order). A bucket a comm hook reduces is
    numbered among its model's hooked buckets (as the hook sees it:
    ``bucket.index()``, ``bucket.is_last()``) and always fused by concat."""
    per_model: dict[int, list[int]] = {}
    for i, b in enumerate(buckets):
        if b.key.reduce_op == HOOK:
            per_model.setdefault(b.key.model_id, []).append(i)
    hook = {i: (model_id, n, len(same)) for model_id, same in per_model.items()
            for n, i in enumerate(same)}
    return BucketPlan(
        algorithm,
        tuple(
            PlannedBucket(
                group=b.key.group_name,
                dtype=b.key.dtype,
                device=b.key.device.type,
                reduce_op=b.key.reduce_op,
                algorithm="concat" if i in hook else algorithm,
                grads=tuple(g.label for g in b.grads),
                numels=tuple(g.numel for g in b.grads),
                comm_dtype=b.key.comm_dtype,
                hook=hook.get(i),
                cut=b.cut_reason,
            )
            for i, b in enumerate(buckets)
        ),
        tuple((u.label, u.reason, u.group_name) for u in unfused),
    )
