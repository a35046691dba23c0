"""Bucket planning: which tagged gradient all-reduces share one collective.

The rule is eager DDP's, after its first-iteration rebuild (``Reducer::rebuild_buckets``
calling ``compute_bucket_assignment_by_size`` on the gradients in ready order):

* gradients are split by key (process group, dtype, device, reduce op, bucket limits);
* within a key, in backward-ready order, gradients join the open bucket; a bucket
  closes as soon as its bytes reach the current limit, and then the next limit in the
  list applies (the last one repeats);
* whatever is left open at the end forms a last, smaller bucket.

Ready order is eager autograd's when the hooks say it (``ready_order`` on each tagged
all-reduce: the wrapper learns it once from a fake-tensor run of the model in eager
autograd, see ``ddp_fusion/ready_order.py``), so buckets hold exactly the gradients
eager DDP's rebuilt buckets hold; each bucket's collective then goes right after the
last of its gradients is computed in the graph, and not before the previous bucket's. Otherwise it is the order the graph
computes the gradients in, which differs from eager autograd's inside a layer (a
compiled backward computes a Linear's weight gradient before its bias gradient).

The limits are DDP's: default ``[1 MiB, 25 MiB]`` (a small first bucket so the last
gradients of backward do not wait behind a big one), ``bucket_cap_mb=c`` gives ``[c]``,
``bucket_cap_mb_list=[a, b, ...]`` gives ``[a, b, ...]`` (all in MiB).

One case eager DDP never meets: in a hand-built graph a gradient may be computed from an
earlier gradient's *reduced* value. Then the earlier gradient's bucket (whatever its key)
must be issued before the dependent gradient exists, so it is closed there (and the cut
is recorded in the plan); otherwise two buckets could each wait for the other.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import torch.fx

from .. import _torch
from ..ready_order import graph_order
from .collectives import BucketKey, GradAllReduce

MiB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25


def ddp_bucket_limits(
    bucket_cap_mb: float | None = None, bucket_cap_mb_list: Sequence[float] | None = None
) -> list[int]:
    """Bucket byte limits, in order, that eager torch DDP uses for these arguments."""
    if bucket_cap_mb_list is not None:
        if isinstance(bucket_cap_mb_list, (str, bytes)) or not isinstance(
            bucket_cap_mb_list, Sequence
        ):
            raise ValueError(
                f"bucket_cap_mb_list must be a list of sizes in MiB, got {bucket_cap_mb_list!r}"
            )
        if len(bucket_cap_mb_list) == 0:
            raise ValueError("bucket_cap_mb_list must not be empty")
        return [_cap_bytes(f"bucket_cap_mb_list[{i}]", c) for i, c in enumerate(bucket_cap_mb_list)]
    if bucket_cap_mb is not None:
        return [_cap_bytes("bucket_cap_mb", bucket_cap_mb)]
    return [_torch.DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * MiB]


def _cap_bytes(setting: str, cap_mb: object) -> int:
    if (
        isinstance(cap_mb, bool)
        or not isinstance(cap_mb, numbers.Real)
        or not math.isfinite(cap_mb)
        or cap_mb < 0
    ):
        raise ValueError(f"{setting} must be a non-negative number of MiB, got {cap_mb!r}")
    return int(cap_mb * MiB)


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
    if any(g.key.owner >= 0 and g.ready_order < 0 for g in grads):
        graph_order(
            "a wrapper's gradients carry no ready order: its forward did not run with "
            "config.enabled and grad mode on before this backward was compiled (say, a "
            "compiled inner module called without the wrapper)"
        )
    return _plan_in_graph_order(graph, grads)


def _split(key: BucketKey, grads: list[GradAllReduce]) -> list[Bucket]:
    """DDP's rule over ``grads`` (one key, in ready order)."""
    buckets: list[Bucket] = []
    open_: list[GradAllReduce] = []
    nbytes, limit = 0, 0
    for g in grads:
        open_.append(g)
        nbytes += g.nbytes
        if nbytes >= key.limits[limit]:
            buckets.append(Bucket(key, open_))
            open_, nbytes, limit = [], 0, min(limit + 1, len(key.limits) - 1)
    if open_:
        buckets.append(Bucket(key, open_))
    return buckets


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
    limit_index: dict[BucketKey, int] = {}
    open_buckets: dict[BucketKey, Bucket] = {}
    closed: list[Bucket] = []
    # node -> ids of open buckets whose reduced gradients it (transitively) reads.
    depends_on: dict[torch.fx.Node, set[int]] = {}

    def close(bucket: Bucket) -> None:
        del open_buckets[bucket.key]
        closed.append(bucket)
        last = len(bucket.key.limits) - 1
        limit_index[bucket.key] = min(limit_index.get(bucket.key, 0) + 1, last)

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
                close(bucket)
            bucket = open_buckets.get(grad.key)
            if bucket is None:
                bucket = open_buckets[grad.key] = Bucket(grad.key, [])
            bucket.grads.append(grad)
            bucket_of[grad.node] = bucket
            if bucket.nbytes >= grad.key.limits[limit_index.get(grad.key, 0)]:
                close(bucket)
        if node in bucket_of:
            deps.add(id(bucket_of[node]))
        if deps:
            deps &= {id(b) for b in open_buckets.values()}
            if deps:
                depends_on[node] = deps
    closed.extend(open_buckets.values())
    return closed
