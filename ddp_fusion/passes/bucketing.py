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

A model built with ``find_unused_parameters=True`` has its layout registered
(ddp_fusion/unused.py): its buckets are planned over every parameter of the layout, in
its order, whatever gradients this rank's graph has, so ranks that use different
parameters plan the same buckets. A parameter missing here is an *absent* entry of its
bucket (the pass makes its contribution: absent.py; ``Bucket.laid_out``).

One case eager DDP never meets: in a hand-built graph a gradient may be computed from an
earlier gradient's *reduced* value. Then the earlier gradient's bucket (whatever its key)
must be issued before the dependent gradient exists, so it is closed there (and the cut
is recorded in the plan); otherwise two buckets could each wait for the other.
"""

from __future__ import annotations

import dataclasses

import torch.fx

from .. import _torch, unused
from ..log import log
from ..ops import HOOK, READY_UNKNOWN
from ..plan import BucketPlan, BucketRule, PlannedBucket, element_order, split_by_rule
from ..ready_order import graph_order
from .collectives import BucketKey, GradAllReduce, Unfused, op_args


@dataclasses.dataclass
class Bucket:
    key: BucketKey
    grads: list[GradAllReduce]
    cut_reason: str | None = None
    """Why this bucket closed early (the next gradient of its key depends on it)."""
    laid_out: bool = False
    """A bucket of a ``find_unused_parameters`` model's layout: it may hold absent
    entries (ddp_fusion/unused.py)."""

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.grads)


def plan_buckets(graph: torch.fx.Graph, grads: list[GradAllReduce],
                 unfused: list[Unfused] = ()) -> list[Bucket]:
    """Buckets in the order their collectives are to be issued: each after the last of
    its gradients and after the bucket before it (passes/__init__.py). ``unfused``: the
    tagged all-reduces left unfused (a model with one of those keeps its graph's
    buckets, not its layout's)."""
    laid, grads = _laid_out(grads, unfused)
    buckets = _plan(graph, grads) if grads else []
    if not laid:
        return buckets
    laid_buckets = _plan_in_ready_order(graph, laid)
    for b in laid_buckets:
        b.laid_out = True
    return _merge(graph, buckets, laid_buckets)


def _plan(graph: torch.fx.Graph, grads: list[GradAllReduce]) -> list[Bucket]:
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
            at = max(at, *(position.get(g.grad, -1) for g in b.grads))  # absent: -1
            ready_at.append((at, k, i, b))
    return [b for *_, b in sorted(ready_at, key=lambda t: t[:3])]


def _laid_out(grads: list[GradAllReduce],
              unfused: list[Unfused]) -> tuple[list[GradAllReduce], list[GradAllReduce]]:
    """(every parameter of the layouts of the ``find_unused_parameters`` models that
    ``grads`` has gradients of, in each layout's order, with absent entries for the
    parameters missing here; the other gradients). A model whose gradients do not fit
    its layout, whose comm hook reduces its buckets, or with an unfused gradient keeps
    its graph's buckets (a warning says why)."""
    by_model: dict[int, list[GradAllReduce]] = {}
    for g in grads:
        if g.key.model_id >= 0 and unused.layout(g.key.model_id) is not None:
            by_model.setdefault(g.key.model_id, []).append(g)
    if not by_model:
        return [], grads
    with_unfused = {op_args(u.node)[7] for u in unfused}
    laid: list[GradAllReduce] = []
    taken: set[int] = set()
    for model_id, mine in by_model.items():
        entries, why = _expand(unused.layout(model_id), mine)
        if model_id in with_unfused:
            why = "a gradient of the model is left unfused (see the 'unfused' warning)"
        elif mine[0].key.reduce_op == HOOK:
            why = "its comm hook reduces its buckets (a buffer of gradients only)"
        if why is not None:
            _torch.dynamo.counters()["ddp_fusion"]["find_unused_parameters: graph's buckets"] += 1
            if why not in _warned:
                _warned.add(why)
                log.warning(
                    "ddp_fusion: model %d has find_unused_parameters=True, but its buckets follow "
                    "this rank's graph, not the model's layout, so ranks that use different "
                    "parameters raise PlanMismatchError: %s", model_id, why,
                )
            continue
        laid += entries
        taken.update(map(id, mine))
    return laid, [g for g in grads if id(g) not in taken]


_warned: set[str] = set()


def _expand(layout: unused.Layout, mine: list[GradAllReduce]) -> tuple[list[GradAllReduce], str | None]:
    """Every parameter of ``layout`` in its order: this rank's gradient where the graph
    has one (``mine``), else an absent entry of the same key (the dtype's)."""
    first = mine[0]
    comm_dtype = op_args(first.node)[5]
    at: dict[int, GradAllReduce] = {}
    def settings(g: GradAllReduce) -> tuple:
        k = g.key
        return k.group_name, k.reduce_op, k.limits, k.device, op_args(g.node)[5]

    for g in mine:
        k = g.key
        if settings(g) != settings(first):
            return [], f"its gradients {first.label} and {g.label} differ in group, device or settings"
        r = g.ready_order
        slot = layout.slots[r] if 0 <= r < len(layout.slots) else None
        if slot is None or r in at or (slot.name, slot.shape, slot.dtype) != (g.name, g.shape, k.dtype):
            return [], (f"gradient {g.label} {list(g.shape)} {k.dtype} at ready position {r} is not "
                        "the layout's parameter there")
        at[r] = g
    entries = []
    for r, slot in enumerate(layout.slots):
        g = at.get(r)
        if g is None:
            wire = None if comm_dtype in (None, slot.dtype) else comm_dtype
            key = dataclasses.replace(first.key, dtype=slot.dtype, comm_dtype=wire)
            g = GradAllReduce(None, None, key, slot.shape, slot.numel, slot.numel * slot.dtype.itemsize,
                              slot.name, ready_order=r, absent=slot.index,
                              order=element_order(first.key.model_id, slot.name))
        entries.append(g)
    return entries, None


def _merge(graph: torch.fx.Graph, first: list[Bucket], second: list[Bucket]) -> list[Bucket]:
    """Two lists of buckets (of different keys) in one issue order, each list's order
    kept: by where each bucket can first be issued in the graph."""
    position = {node: i for i, node in enumerate(graph.nodes)}

    def ready(buckets: list[Bucket]) -> list[int]:
        out, at = [], -1
        for b in buckets:
            at = max(at, *(position.get(g.grad, -1) for g in b.grads))
            out.append(at)
        return out

    a, b = ready(first), ready(second)
    merged, i, j = [], 0, 0
    while i < len(first) or j < len(second):
        if j == len(second) or (i < len(first) and a[i] <= b[j]):
            merged.append(first[i])
            i += 1
        else:
            merged.append(second[j])
            j += 1
    return merged


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
    # a laid-out model's number among the plan's (not its id: ids count the live models
    # with the same parameter names, which ranks that collect garbage at different
    # times can see differently)
    laid_out: dict[int, int] = {}
    for b in buckets:
        if b.laid_out:
            laid_out.setdefault(b.key.model_id, len(laid_out))
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
                layout=laid_out.get(b.key.model_id) if b.laid_out else None,
            )
            for i, b in enumerate(buckets)
        ),
        tuple((u.label, u.reason, u.group_name) for u in unfused),
    )
