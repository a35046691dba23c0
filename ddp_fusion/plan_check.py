"""The per-step cross-rank check of the bucket plan: would-be hangs become errors.

Collectives only work if every rank issues the same ones, in the same order, with the
same sizes. Ranks whose backward graphs differ (a parameter unused on some ranks only,
rank-dependent control flow, one rank recompiling) would plan different buckets, at the
first step or at any later one. Each fused graph therefore starts with one
``ddp_fusion::plan_check_start`` per process group, which issues an async all-gather of
a hash of the group's plan (one int64 per rank: one small collective per group per
step, overlapped with backward compute), and has one ``ddp_fusion::plan_guard`` right
before the group's first bucket is issued, which waits for it. If the hashes differ,
every rank reads the others' plans from the process group's store (no collective) and
raises :class:`PlanMismatchError` naming the difference, before any bucket is issued.

The divisor of the bucket scaling is read at run time (scaling.py): nothing about the
group is baked into the graph, so a graph served from Inductor's FX graph cache, or
reused after the group changed size, divides correctly. Gradients are scaled by
``ddp_fusion::plan_divisor``, which does not wait, so Inductor can fuse the scaling into
the kernels that compute them; only each bucket's last gradient is scaled by the
divisor the guard returns (the same value, after the check). So every bucket's
collective depends on the guard, and the guard's wait comes just before the first
bucket is issued, not at the start of backward (which would make the ranks wait for
each other there, as eager DDP never does).

The plan travels in the graph as the group's :class:`~ddp_fusion.plan.BucketPlan` in
JSON (``BucketPlan.of_group(...).to_json()``). A joined rank (join.py) learns which plan
the active ranks run from this same all-gather, and reads it from the store, where every
rank publishes a plan the first time it runs it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from . import _torch, comm_hooks, dump, scaling
from .config import config
from .log import log
from .ops import CUDAGRAPH_UNSAFE
from .plan import BucketPlan


class PlanMismatchError(RuntimeError):
    """Ranks would issue different gradient collectives (which would hang)."""


_plan_hashes: dict[str, int] = {}
_reported: set[tuple[str, str]] = set()
_published: set[str] = set()
#: What a joined rank sends in the plan check: "I shadow whatever plan you run"
#: (join.py). No plan hashes to it.
JOINED = 0
# (group name, plan) -> the plan check in flight: (work, everyone's hashes, this rank's)
_pending: dict[tuple[str, str], tuple[dist.Work, torch.Tensor, torch.Tensor]] = {}


def _group(group_name: str) -> dist.ProcessGroup:
    group = _torch.distributed.resolve_process_group(group_name)
    if group is None:
        raise RuntimeError(
            f"ddp_fusion: process group {group_name!r} is not registered in this process "
            "(was it destroyed after the model was compiled?)"
        )
    return group


@torch.library.custom_op("ddp_fusion::plan_check_start", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def plan_check_start(group_name: str, plan: str, device: torch.device) -> torch.Tensor:
    """Start this step's cross-rank check of the group's bucket ``plan``: an async
    all-gather of the plan's hash, one int64 per rank, sized by the live group. Returns
    a token for :func:`plan_guard`, which finishes the check."""
    group = _group(group_name)
    # A backward that completed waited for all of its hooks: one still in flight is
    # left by a backward that failed halfway, and must not hold this one up.
    comm_hooks.drop_in_flight()
    hook_groups(plan, group)
    if has_peers(group):
        _publish(plan)
        mine = torch.full((1,), _plan_hash(plan), dtype=torch.int64, device=device)
        everyone = torch.empty(group.size(), dtype=torch.int64, device=device)
        work = dist.all_gather_single(everyone, mine, group=group, async_op=True)
        _pending[group_name, plan] = (work, everyone, mine)
    return torch.zeros((), dtype=torch.float32, device=device)


@plan_check_start.register_fake
def _(group_name, plan, device):
    return torch.empty((), dtype=torch.float32, device=device)


@torch.library.custom_op("ddp_fusion::plan_guard", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def plan_guard(
    token: torch.Tensor, group_name: str, plan: str, reduce_op: str, device: torch.device
) -> torch.Tensor:
    """The bucket divisor for ``reduce_op`` as a 0-d float32 tensor on ``device``, after
    the check :func:`plan_check_start` began shows that every rank of the group runs the
    same bucket ``plan`` in this step (else :class:`PlanMismatchError` on every rank)."""
    group = _group(group_name)
    if (group_name, plan) not in _reported:
        _reported.add((group_name, plan))
        _report_plan(group_name, plan)
    pending = _pending.pop((group_name, plan), None)  # None: checked by this group's other guard
    if pending is not None:
        work, everyone, mine = pending
        work.wait()
        if not bool((everyone[everyone != JOINED] == mine).all()):
            raise PlanMismatchError(_describe_mismatch(group_name, _plans_of(everyone, plan)))
    return torch.full((), _divisor(group, reduce_op), dtype=torch.float32, device=device)


@plan_guard.register_fake
def _(token, group_name, plan, reduce_op, device):
    return torch.empty((), dtype=torch.float32, device=device)


@torch.library.custom_op("ddp_fusion::plan_divisor", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def plan_divisor(group_name: str, reduce_op: str, device: torch.device) -> torch.Tensor:
    """What :func:`plan_guard` returns, without waiting for the check: the bucket divisor
    for ``reduce_op`` as a 0-d float32 tensor on ``device``."""
    return torch.full((), _divisor(_group(group_name), reduce_op), dtype=torch.float32, device=device)


@plan_divisor.register_fake
def _(group_name, reduce_op, device):
    return torch.empty((), dtype=torch.float32, device=device)


def _divisor(group: dist.ProcessGroup, reduce_op: str) -> int:
    return scaling.divisor(group) if reduce_op == "avg" else 1  # "sum"; "hook": the hook scales


PLAN_CHECK_START = torch.ops.ddp_fusion.plan_check_start.default
PLAN_GUARD = torch.ops.ddp_fusion.plan_guard.default
PLAN_DIVISOR = torch.ops.ddp_fusion.plan_divisor.default


def plan_id(plan: str) -> str:
    """A short name of a bucket plan (its hash, as hex)."""
    return f"{_plan_hash(plan) & 0xFFFFFFFFFFFFFFFF:016x}"


@functools.lru_cache(maxsize=64)
def parse(plan: str) -> BucketPlan:
    """The plan a fused graph carries, parsed (once per plan text)."""
    return BucketPlan.from_json(plan)


# plan -> the names of its hooked buckets' groups
_hook_groups: dict[str, list[str]] = {}


def hook_groups(plan: str, group: dist.ProcessGroup) -> None:
    """Make sure the groups of the plan's hooked buckets (comm_hooks.py) are registered:
    a graph served from Inductor's cache was not compiled in this process, and
    ``destroy_process_group`` unregisters every group. The plan is read once."""
    names = _hook_groups.get(plan)
    if names is not None and comm_hooks.registered(names):
        return
    per_model: dict[int, list[tuple[str, ...]]] = {}
    for b in parse(plan).buckets:
        if b.hook is not None:
            per_model.setdefault(b.hook[0], []).append(b.grads)
    _hook_groups[plan] = [
        name
        for model_id, buckets in per_model.items()
        for name in comm_hooks.ensure_groups(model_id, plan_id(plan), buckets, group)
    ]


def has_peers(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` has other ranks to exchange with (not size 1, not the ``fake``
    backend of graph tests)."""
    return group.size() > 1 and dist.get_backend(group) != "fake"


def _plan_hash(plan: str) -> int:
    h = _plan_hashes.get(plan)
    if h is None:
        digest = hashlib.blake2b(plan.encode(), digest_size=8).digest()
        h = int.from_bytes(digest, "little", signed=True)
        h = _plan_hashes[plan] = h if h != JOINED else 1
    return h


def _publish(plan: str) -> None:
    """Put a plan in the store under its hash, once per process: a joined rank (or a
    mismatch report) reads it from there."""
    if plan not in _published:
        _torch.distributed.default_store().set(f"ddp_fusion/plan/{_plan_hash(plan)}", plan)
        _published.add(plan)


def published_plan(plan_hash: int) -> str:
    """The plan some rank published under ``plan_hash`` (blocks until one has)."""
    return _torch.distributed.default_store().get(f"ddp_fusion/plan/{plan_hash}").decode()


_compiled_here: set[str] = set()


def compiled_here(plans: Iterable[str]) -> None:
    """The pass made these plans in this process (others come from Inductor's cache)."""
    _compiled_here.update(plans)


def _report_plan(group_name: str, plan: str) -> None:
    """Count and log (INFO) a plan the first time this process runs it, whether the
    graph was compiled here or served from Inductor's FX graph cache (then the pass
    did not run: dump.py says so, and dumps the plan)."""
    _torch.dynamo.counters()["ddp_fusion"]["plans_run"] += 1
    if plan not in _compiled_here:
        dump.show_cached(group_name, plan, plan_id(plan), config.dump_dir)
    if log.isEnabledFor(logging.INFO):
        buckets = parse(plan).buckets
        log.info(
            "ddp_fusion: running bucket plan of process group %r: %d buckets, bytes %s: %s",
            group_name,
            len(buckets),
            [b.nbytes for b in buckets],
            plan,
        )


def _plans_of(hashes: torch.Tensor, plan: str) -> list[str]:
    """Every rank's plan, by its hash, through the store: no collective, so ranks whose
    graphs differ cannot block each other in different exchanges (several groups)."""
    _publish(plan)
    by_hash = {h: published_plan(h) for h in set(hashes.tolist()) if h != JOINED}
    return [by_hash.get(h, "") for h in hashes.tolist()]


def _describe_mismatch(group_name: str, plans: Sequence[str]) -> str:
    decoded = [parse(p).buckets if p else () for p in plans]
    lines = [
        f"ddp_fusion: ranks of process group {group_name!r} compiled different gradient "
        "bucket plans, so their collectives would not match (a hang). Usually a "
        "parameter gets a gradient on some ranks only (unused in this step's forward), "
        "or the ranks run different code or models."
    ]
    joined = {i for i, p in enumerate(plans) if not p}
    for i, buckets in enumerate(decoded):
        lines.append(
            f"  group rank {i}: joined (join(): shadows the others' plan)" if i in joined
            else f"  group rank {i}: {len(buckets)} buckets, bytes {[b.nbytes for b in buckets]}"
        )
    names = [{n for b in buckets for n in b.grads} for i, buckets in enumerate(decoded)
             if i not in joined]
    everyone = set.union(*names) if names else set()
    active = [i for i in range(len(decoded)) if i not in joined]
    for i, have in zip(active, names):
        missing = sorted(everyone - have)
        if missing:
            lines.append(f"  group rank {i} has no gradient for: {', '.join(missing[:20])}"
                         + (" ..." if len(missing) > 20 else ""))
    if all(have == everyone for have in names):
        lines.append(
            "  every rank reduces the same gradients, in different buckets: the ranks' "
            "bucket arguments, dtypes or learned ready orders differ"
        )
    return "\n".join(lines)
