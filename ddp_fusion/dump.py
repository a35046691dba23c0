"""What the pass did, shown where torch users look.

For every graph the pass changes:

* ``TORCH_TRACE=<dir>``: structured artifacts under the graph's compile id, which
  ``tlparse`` shows: ``ddp_fusion_plan`` (the bucket plan, JSON), ``ddp_fusion_before``
  and ``ddp_fusion_after`` (the graph as Python code).
* ``TORCH_LOGS=ddp_fusion_graphs``: the same two graphs; ``TORCH_LOGS=ddp_fusion``: the
  plan (INFO).
* ``config.dump_dir``: three files under one stem,
  ``rank<R>_<NNN>_<compile id>_<first|steady>``: ``.before.txt``, ``.after.txt`` and
  ``.buckets.json`` (the plan; ``ddp_fusion.plan`` documents its JSON). The compile id
  is the one TORCH_LOGS and tlparse print, with ``_`` for ``/`` and ``ca`` for the
  ``!`` of compiled autograd's graphs (``[!1/2/0]`` -> ``ca1_2_0``). ``first``: the
  first graph compiled with this bucket plan in this process (the first step, whose
  backward finds no ``.grad`` yet); ``steady``: a later graph with the same plan (from
  the second step on, ``.grad`` exists).

In the after graph each bucket's nodes are named after it (``bucket2_all_reduce``,
``bucket2_wait``, ``bucket2_split``; plan order, from 0), and it is the graph Inductor
lowers to code (after its own last passes: ``all_reduce_`` in place of
``all_reduce``) for every graph compiled by ddp_fusion's backward compiler (all
compiled-autograd graphs); elsewhere (the pass called directly, say) it is the pass's
output.

A graph served from Inductor's FX graph cache was not compiled in this process, so the
pass did not run on it: the first time its plan runs, that is logged at INFO (with how
to force a fresh compile) and the plan is written to the dump directory as
``rank<R>_<NNN>_cached_<plan id>.buckets.json`` (the cache entry holds no graph).
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref

import torch.distributed as dist
import torch.fx

from . import _torch
from .log import graphs_log, log
from .plan import BucketPlan

_numbers = itertools.count()
_plans_seen: set[str] = set()
# id(graph) -> (the graph, path of its after file or None, compile id): the pass's
# graphs whose final form Inductor has yet to reach (lowered())
_awaiting_lowering: dict[int, tuple[weakref.ref, str | None, str | None]] = {}


def graph_code(graph: torch.fx.Graph) -> str:
    return graph.python_code(root_module="self").src


def wanted(dump_dir: str | None) -> bool:
    """Whether the graphs are shown anywhere (so worth printing)."""
    return bool(dump_dir) or graphs_log.isEnabledFor(logging.DEBUG) or _torch.logs.tracing()


def show(plan: BucketPlan, before: str | None, graph: torch.fx.Graph, dump_dir: str | None,
         lowering_follows: bool) -> str | None:
    """Show a graph the pass changed (``before``: its code before, if :func:`wanted`).
    ``lowering_follows``: Inductor will call :func:`lowered` with its final form.
    Returns the dump files' stem, if any."""
    compile_id = _torch.dynamo.current_compile_id()
    plan_json = plan.to_json(indent=1)
    key = BucketPlan(plan.algorithm, plan.buckets).to_json()
    phase = "steady" if key in _plans_seen else "first"
    _plans_seen.add(key)
    if log.isEnabledFor(logging.INFO):
        log.info("ddp_fusion: bucket plan of graph %s (%s): %s", compile_id, phase, plan.to_json())
    _torch.logs.trace_artifact("ddp_fusion_plan", "json", lambda: plan_json)
    if before is None:
        return None
    _torch.logs.trace_artifact("ddp_fusion_before", "string", lambda: before)
    graphs_log.debug("ddp_fusion: graph %s before fusion:\n%s", compile_id, before)
    stem = None
    if dump_dir:
        stem = _stem(dump_dir, f"{_slug(compile_id)}_{phase}")
        _write(stem + ".before.txt", before)
        _write(stem + ".buckets.json", plan_json + "\n")
    if lowering_follows:
        _awaiting_lowering[id(graph)] = (weakref.ref(graph), stem and stem + ".after.txt", compile_id)
    else:
        _show_after(graph_code(graph), stem and stem + ".after.txt", compile_id)
    return stem


def lowered(gm: torch.fx.GraphModule) -> None:
    """Inductor is about to lower ``gm``: if the pass changed it, show its final form."""
    pending = _awaiting_lowering.pop(id(gm.graph), None)
    if pending is not None and pending[0]() is gm.graph:
        _show_after(graph_code(gm.graph), *pending[1:])


def _show_after(after: str, path: str | None, compile_id: str | None) -> None:
    _torch.logs.trace_artifact("ddp_fusion_after", "string", lambda: after)
    graphs_log.debug("ddp_fusion: graph %s after fusion:\n%s", compile_id, after)
    if path:
        _write(path, after)


def show_cached(group_name: str, plan: str, plan_id: str, dump_dir: str | None) -> None:
    """A plan of a graph served from Inductor's FX graph cache runs for the first time."""
    log.info(
        "ddp_fusion: bucket plan %s of process group %r runs in a graph served from "
        "Inductor's FX graph cache: it was fused when the cache entry was made, and the "
        "pass did not run in this process (no graphs to dump). To compile it afresh, set "
        "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 or use another TORCHINDUCTOR_CACHE_DIR",
        plan_id, group_name,
    )
    if dump_dir:
        _write(_stem(dump_dir, f"cached_{plan_id}") + ".buckets.json", plan + "\n")


def _slug(compile_id: str | None) -> str:
    if compile_id is None:
        return "nocompile"
    return compile_id.strip("[]").replace("!", "ca").replace("/", "_")


def _stem(dump_dir: str, name: str) -> str:
    os.makedirs(dump_dir, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return os.path.join(dump_dir, f"rank{rank}_{next(_numbers):03d}_{name}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
