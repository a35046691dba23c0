"""Place each bucket's wait for overlap: issue early, wait late.

A fused collective is inserted right after the last gradient of its bucket is computed
(concat.py, coalesced.py), with its wait and unpacking ("tail") right behind it. This
pass moves every tail to just before the first node that reads its result, so the
backward compute between the two runs while the collective is in flight. In a compiled
backward the readers are the final ``copy_`` into ``.grad``, so all waits gather at the
end of the graph.

Before::                                 After::

    red = all_reduce(flat)                   red = all_reduce(flat)
    red = wait_tensor(red)                   ... rest of backward ...
    parts = split_with_sizes(red)            red = wait_tensor(red)
    ... rest of backward ...                 parts = split_with_sizes(red)
    copy_(p_grad, parts[0])                  copy_(p_grad, parts[0])
"""

from __future__ import annotations

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


def sink_waits(graph: torch.fx.Graph, fused: list[FusedBucket]) -> None:
    """Move each tail to just before the first reader of any of its nodes."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for fb in fused:
        for tail in fb.tails:
            members = set(tail)
            readers = [u for n in tail for u in n.users if u not in members]
            if not readers:
                continue
            first = min(readers, key=order.__getitem__)
            # Moving a tail leaves the relative order of all other nodes unchanged,
            # so the indices stay valid for later comparisons.
            for node in tail:
                first.prepend(node)
