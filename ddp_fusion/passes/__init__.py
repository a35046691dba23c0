"""The ddp_fusion post-grad passes, and the driver that runs them in order.

    collectives.py  find ``ddp_fusion::all_reduce_gradient`` nodes (the tag)
    bucketing.py    plan buckets per (group, dtype, device, reduce op, limits), DDP's rule
    guard.py        one cross-rank plan check per group, before its first bucket is issued
    concat.py       rewrite a bucket as cat + div + all_reduce + split
    scale.py        (for both) a gradient a sum makes: divided inside that sum
    coalesced.py    rewrite a bucket as _foreach_div + all_reduce_coalesced
    in_place.py     a bucket of kept .grads: write each into its .grad, reduce them in place
    absent.py       find_unused_parameters: gradients absent here, which were used, the fix-up
    schedule.py     move each bucket's wait to just before its first reader

Invariants every step keeps, checked by ``graph.lint()`` at the end:

* every new node has ``meta["val"]`` (a fake tensor, or a list of them; None for the
  in-place collective and its wait, which return nothing);
* nothing is mutated that was not mutated before: a kept ``.grad`` (a graph input the
  graph ends by copying its reduced gradient into) is written earlier, once, with its
  scaled gradient, and then reduced in place (in_place.py); the only
  new aliases are views (a gradient flattened, or permuted into memory order, on its
  way into a bucket; the reduced gradients, views of their bucket, which the graph
  returns: the hooks make them the new gradients, and a bucket's gradients share its
  buffer as with torch DDP's ``gradient_as_bucket_view``);
* only tagged all-reduces are touched: other collectives keep their place and order
  relative to their inputs and users;
* the plan is a function of the graph alone (and, for a ``find_unused_parameters``
  model, of its registered layout, which is part of the pass's cache key), so every
  rank reaches the same plan.

Cost is linear in the number of nodes: one walk to find, one to plan, one re-sort, one
to place waits. Python's cyclic garbage collector is paused while the pass runs: its
full collections walk every live object, most of them the graph's nodes and fake
tensors (measured: 15-27 % of the chain-shaped concat pass's median time at 3,200 gradients;
bench/results/pass_time_cpu_2026-11-26.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc

import torch.fx
from torch.fx.node import map_arg

from .. import _torch, comm_hooks, dump, effects, plan_check
from ..config import config
from ..log import log
from ..ops import ALL_REDUCE_CHECKED
from ..plan import MiB, BucketPlan
from . import absent
from ._graph import NodeMaker
from .bucketing import Bucket, plan_buckets, to_plan
from .coalesced import fuse_coalesced
from .collectives import Unfused, drop_unwritten_kept_grads, find_gradient_all_reduces, op_args
from .concat import fuse_concat
from .guard import group_plans, insert_plan_guards, place_guards
from .in_place import fuse_in_place, kept_grads
from .scale import erase_unread
from .schedule import sink_waits

__all__ = ["FusionResult", "fuse_ddp_allreduces"]

_FUSERS = {"concat": fuse_concat, "coalesced": fuse_coalesced}
_CONFIG = object()  # "take it from ddp_fusion.config"
_warned: set[str] = set()


@dataclasses.dataclass
class FusionResult:
    """What :func:`fuse_ddp_allreduces` did to a graph."""

    plan: BucketPlan
    """The bucket plan, as written to ``<stem>.buckets.json`` and logged."""
    buckets: list[Bucket]
    """The same buckets, with the graph nodes of their gradients."""
    unfused: list[Unfused]
    """Tagged all-reduces left as they were, with the reason."""
    dump_stem: str | None = None


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off inside (as torch.distributed.checkpoint's
    state_dict does); the pass's garbage is collected after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_collector_paused()
def fuse_ddp_allreduces(
    graph: torch.fx.Graph,
    *,
    algorithm: str | None = None,
    schedule_waits: bool | None = None,
    dump_dir: str | None = None,
    max_in_flight_mb: float | None | object = _CONFIG,
) -> FusionResult:
    """Bucket and fuse the tagged gradient all-reduces of a post-grad ``graph`` in place.

    Arguments left as None (``max_in_flight_mb``: not given) come from
    ``ddp_fusion.config``. Returns what was done.
    """
    effects.want(effects.IN_USE)  # called directly under DDP_FUSION=1: the rest of the flag's changes
    algorithm = config.algorithm if algorithm is None else algorithm
    if algorithm not in _FUSERS:
        raise ValueError(f"algorithm must be one of {sorted(_FUSERS)}, got {algorithm!r}")
    schedule_waits = config.schedule_waits if schedule_waits is None else schedule_waits
    dump_dir = config.dump_dir if dump_dir is None else dump_dir

    dropped = drop_unwritten_kept_grads(graph)
    if dropped:
        _torch.dynamo.counters()["ddp_fusion"]["kept .grads not written"] += len(dropped)
        log.info("ddp_fusion: %d kept .grad(s) this backward did not write are not reduced "
                 "(no gradient: as a hook per parameter would not fire): %s", len(dropped),
                 ", ".join(dropped[:5]) + (" ..." if len(dropped) > 5 else ""))
    grads, unfused = find_gradient_all_reduces(graph)
    _report_unfused(unfused)
    # an unfused all-reduce whose group is known is checked too: part of its group's
    # plan, issued after the guard like a bucket
    checked = [u for u in unfused if u.registered and isinstance(u.node.args[0], torch.fx.Node)]
    if not grads and not checked:
        return FusionResult(to_plan([], unfused, algorithm), [], unfused)
    before = dump.graph_code(graph) if dump.wanted(dump_dir) else None

    buckets = plan_buckets(graph, grads, unfused) if grads else []
    result = FusionResult(to_plan(buckets, unfused, algorithm), buckets, unfused)
    plans = group_plans(result.plan)
    plan_check.compiled_here(plans.values())
    make = NodeMaker(graph)
    devices = {b.key.group_name: b.key.device for b in buckets}
    unfused_keys = [(u.group_name, u.reduce_op, _device_of(u, devices)) for u in checked]
    guards, starts = insert_plan_guards(
        make, [(b.key.group_name, b.key.reduce_op, b.key.device) for b in buckets] + unfused_keys, plans,
        checks=plan_check.checks,
    )
    hooked = _hook_groups(result.plan, plans)
    order = {node: i for i, node in enumerate(graph.nodes)}
    fused = []
    anchor_at = -1  # graph position of the node the previous bucket was placed after
    for i, (bucket, planned) in enumerate(zip(buckets, result.plan.buckets)):
        key = bucket.key
        divisors = guards[key.group_name, key.reduce_op, key.device]
        # gradients of this graph (a find_unused_parameters bucket may also hold absent
        # ones, made here: absent.py)
        here = [g for g in bucket.grads if not g.is_absent]
        # After its last gradient, and after the bucket planned before it: collectives
        # are issued in plan order (the same on every rank with the same plan).
        after = max((g.grad for g in here), key=order.__getitem__) if here else divisors[0]
        if here and order[after] > anchor_at:
            anchor_at = order[after]
        elif fused:
            after = fused[-1].tails[-1][-1]  # the end of the previous bucket's nodes
        label = f"bucket{i}"
        if bucket.laid_out:  # its absent gradients, right after `after`
            after = absent.materialize(make, bucket, after, label)
        # scaled by the checked divisor: the last ready of those with elements (Inductor
        # drops the scaling of an empty gradient, and with it the check, were it the
        # check's only reader)
        last = max(here, key=lambda g: (g.numel > 0, order[g.grad])) if here else bucket.grads[-1]
        copies, why = kept_grads(Bucket(key, here), order, planned.hook is not None) if here else (None, None)
        if copies is not None and len(here) < len(bucket.grads):
            copies, why = None, "a parameter of it has no gradient on this rank (find_unused_parameters)"
        if why is not None:
            _note_copy_back(label, why)
        if planned.hook is not None:  # the model's comm hook reduces it (comm_hooks.py)
            fused.append(fuse_concat(make, bucket, after, divisors, last, label, hooked[i]))
        elif copies is not None:  # into kept .grads (in_place.py)
            fused.append(fuse_in_place(make, bucket, copies, after, divisors, last, label, algorithm))
        else:
            fused.append(_FUSERS[algorithm](make, bucket, after, divisors, last, label))
    new = {g.node: out for fb in fused for g, out in zip(fb.bucket.grads, fb.outputs) if not g.is_absent}
    _replace_all(graph, new | {old: out for fb in fused for old, out in fb.replaced.items()})
    erase_unread(graph, [g.grad for fb in fused for g in fb.bucket.grads if not g.is_absent])
    absent.insert_fixups(make, fused, absent.insert_used_starts(make, buckets, starts))
    for u, key in zip(checked, unfused_keys):
        _check_unfused(make, u, guards[key][1])
    # A reader of an early gradient in a bucket may sit before the bucket's collective
    # (never in a compiled backward, where readers are the graph's outputs, but
    # possible in hand-written graphs); move such readers after it.
    _torch.inductor.stable_topological_sort(graph)
    place_guards(graph, [checked for _, checked in guards.values()])
    if schedule_waits:
        budget = config.max_in_flight_mb if max_in_flight_mb is _CONFIG else max_in_flight_mb
        sink_waits(graph, fused, None if budget is None else int(budget * MiB))
    graph.lint()

    _record(result)
    result.dump_stem = dump.show(
        result.plan, before, graph, dump_dir, lowering_follows=_torch.inductor.lowering_watched()
    )
    return result


def _device_of(u: Unfused, devices: dict[str, torch.device]) -> torch.device:
    """Where an unfused all-reduce's divisor lives: its gradient's device, else that of
    its group's buckets, else the CPU (a 0-d CPU tensor divides a tensor anywhere)."""
    val = u.node.args[0].meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.device
    return devices.get(u.group_name, torch.device("cpu"))


def _check_unfused(make: NodeMaker, u: Unfused, checked: torch.fx.Node) -> None:
    """Make an unfused tagged all-reduce take the guard's divisor (``all_reduce_checked``):
    it is then issued after its group's plan check, and divides as the buckets do."""
    grad, group_name, reduce_op, _, name, comm_dtype, *_ = op_args(u.node)
    with make.graph.inserting_before(u.node):
        new = make.graph.call_function(
            ALL_REDUCE_CHECKED, (grad, checked, group_name, reduce_op, name, comm_dtype)
        )
    new.meta.update(u.node.meta)
    u.node.replace_all_uses_with(new)
    make.graph.erase_node(u.node)
    u.node = new


def _hook_groups(plan: BucketPlan, plans: dict[str, str]) -> dict[int, str]:
    """Bucket index -> the group its flat buffer goes to, for buckets a comm hook
    reduces (comm_hooks.py); registers those groups now (the plan check registers them
    when a graph served from Inductor's cache first runs)."""
    out: dict[int, str] = {}
    for group_name in {b.group for b in plan.buckets if b.hook is not None}:
        text = plans[group_name]
        plan_check.hook_groups(text, _torch.distributed.resolve_process_group(group_name))
        for i, b in enumerate(plan.buckets):
            if b.hook is not None and b.group == group_name:
                out[i] = comm_hooks.group_name(b.hook[0], plan_check.plan_id(text), b.hook[1])
    return out


def _replace_all(graph: torch.fx.Graph, new: dict[torch.fx.Node, torch.fx.Node]) -> None:
    """Point every reader of an old node at its new node, then erase the old nodes.

    One rewrite per reader, not per old node: the graph output reads every gradient,
    and rewriting it once per gradient would be quadratic.
    """
    readers = {user: None for old in new for user in old.users}
    for user in readers:
        user.args = map_arg(user.args, lambda n: new.get(n, n))
        user.kwargs = map_arg(user.kwargs, lambda n: new.get(n, n))
    for old in new:
        graph.erase_node(old)


def _note_copy_back(label: str, why: str) -> None:
    """A bucket of kept ``.grad``s not reduced in place (in_place.py): they get the
    reduced bucket by a copy back, with a bucket buffer beside them."""
    _torch.dynamo.counters()["ddp_fusion"]["kept .grads copied back"] += 1
    if why not in _warned:
        _warned.add(why)
        log.info("ddp_fusion: %s's kept .grads get the reduced gradient by a copy back, not "
                 "reduced in place: %s", label, why)


def _report_unfused(unfused: list[Unfused]) -> None:
    counters = _torch.dynamo.counters()["ddp_fusion"]
    for u in unfused:
        counters["unfused"] += 1
        counters[f"unfused: {u.reason}"] += 1
        if u.reason not in _warned:
            _warned.add(u.reason)
            log.warning(
                "ddp_fusion: left %s unfused (it runs as one blocking all-reduce): %s",
                u.node.name,
                u.reason,
            )


def _record(result: FusionResult) -> None:
    counters = _torch.dynamo.counters()["ddp_fusion"]
    counters["graphs"] += 1
    counters["buckets"] += len(result.buckets)
    counters["fused_all_reduces"] += sum(not g.is_absent for b in result.buckets for g in b.grads)
