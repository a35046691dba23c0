"""Place each bucket's wait for overlap: issue early, wait late.

A fused collective is inserted right after the last gradient of its bucket is computed
(concat.py, coalesced.py), with its wait and unpacking ("tail") right behind it. This
pass moves every tail to just before the first node that reads its result, so the
backward compute between the two runs while the collective is in flight. In a compiled
backward the readers are the graph's outputs (the reduced gradients), so all waits gather
at the end of the graph, unless ``config.max_in_flight_mb`` bounds the bytes in flight:
then a bucket's wait moves no later than the issue of the bucket that would exceed it.

Before::                                 After::

    red = all_reduce(flat)                   red = all_reduce(flat)
    red = wait_tensor(red)                   ... rest of backward ...
    parts = split_with_sizes(red)            red = wait_tensor(red)
    ... rest of backward ...                 parts = split_with_sizes(red)
    return (view(parts[0]), ...)             return (view(parts[0]), ...)
"""

from __future__ import annotations

import collections
import dataclasses

import torch.fx

from .bucketing import Bucket


@dataclasses.dataclass
class FusedBucket:
    bucket: Bucket
    collective: torch.fx.Node
    tails: list[list[torch.fx.Node]]
    """Chains that unpack the result, in order, each starting with or after a wait;
    a tail moves as a whole."""
    outputs: list[torch.fx.Node]
    """The reduced gradients, one per ``bucket.grads``."""
    mutated: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    """Graph inputs the collective reduces in place (in_place.py): their readers after
    the collective read the reduced values, so the wait goes before them too."""
    replaced: dict[torch.fx.Node, torch.fx.Node] = dataclasses.field(default_factory=dict)
    """Nodes the bucket makes redundant (in_place.py: each final copy into a kept
    ``.grad``) -> what their readers read instead; the driver rewrites the readers of
    every bucket's at once (one rewrite of the graph output, not one per gradient)."""


def sink_waits(graph: torch.fx.Graph, fused: list[FusedBucket], max_in_flight: int | None = None) -> None:
    """Move each tail to just before the first reader of any of its nodes, but with at
    most ``max_in_flight`` bytes of collectives issued and not yet waited for: before a
    bucket is issued that would exceed it, the oldest buckets still in flight are
    waited for (a bucket larger than the budget goes alone). ``fused`` is in issue
    order."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    deadline = _deadlines(fused, max_in_flight)
    for fb in fused:
        for tail in fb.tails:
            members = set(tail)
            readers = [u for n in tail for u in n.users if u not in members]
            issued = order[fb.collective]
            readers += [u for n in fb.mutated for u in n.users if u not in members and order[u] > issued]
            if fb.collective in deadline:
                readers.append(deadline[fb.collective])
            if not readers:
                continue
            first = min(readers, key=order.__getitem__)
            # Moving a tail leaves the relative order of all other nodes unchanged,
            # so the indices stay valid for later comparisons.
            for node in tail:
                first.prepend(node)


def _deadlines(fused: list[FusedBucket], budget: int | None) -> dict[torch.fx.Node, torch.fx.Node]:
    """Collective -> the collective of the later bucket before which it must be waited
    for, so that the bytes in flight stay within ``budget``."""
    if budget is None:
        return {}
    deadline: dict[torch.fx.Node, torch.fx.Node] = {}
    in_flight: collections.deque[tuple[torch.fx.Node, int]] = collections.deque()
    total = 0
    for fb in fused:
        nbytes = _bytes(fb.collective)
        while in_flight and total + nbytes > budget:
            done, done_bytes = in_flight.popleft()
            deadline[done] = fb.collective
            total -= done_bytes
        in_flight.append((fb.collective, nbytes))
        total += nbytes
    return deadline


def _bytes(collective: torch.fx.Node) -> int:
    """Bytes a collective sends: its input(s)."""
    inputs = collective.args[0]
    vals = []
    for n in inputs if isinstance(inputs, (list, tuple)) else [inputs]:
        val = n.meta["val"]  # a tensor, or (a _foreach op's) list of them
        vals += val if isinstance(val, (list, tuple)) else [val]
    return sum(v.numel() * v.element_size() for v in vals)
