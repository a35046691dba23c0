"""FX dumps: what the pass saw, what it made, and the bucket plan.

With ``config.dump_dir`` set, every graph the pass changes gets three files under one
stem, ``rank<R>_graph<NNN>``: ``.before.txt`` and ``.after.txt`` (the graph as Python
code) and ``.buckets.json``, the bucket plan (``ddp_fusion.plan``, which documents its
JSON form). Its ``grads`` list each gradient's parameter name (or, from
``all_reduce_gradient`` called without ``name=``, its node's name) in the order they
became ready.
"""

from __future__ import annotations

import itertools
import os

import torch.distributed as dist
import torch.fx

from .plan import BucketPlan

_graph_ids = itertools.count()


def graph_code(graph: torch.fx.Graph) -> str:
    return graph.python_code(root_module="self").src


def write(dump_dir: str, before: str, after: str, plan: BucketPlan) -> str:
    """Write the three files; return their common path stem."""
    os.makedirs(dump_dir, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    stem = os.path.join(dump_dir, f"rank{rank}_graph{next(_graph_ids):03d}")
    with open(stem + ".before.txt", "w") as f:
        f.write(before)
    with open(stem + ".after.txt", "w") as f:
        f.write(after)
    with open(stem + ".buckets.json", "w") as f:
        f.write(plan.to_json(indent=1) + "\n")
    return stem
