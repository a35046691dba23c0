"""The per-step cross-rank check of the bucket plan: would-be hangs become errors.

Collectives only work if every rank issues the same ones, in the same order, with the
same sizes. Ranks whose backward graphs differ (a parameter unused on some ranks only,
rank-dependent control flow, one rank recompiling) would plan different buckets, at the
first step or at any later one. Each fused graph therefore starts with one
``ddp_fusion::plan_check_start`` per process group, which starts an exchange of a hash
h of the group's plan on the group's host group (host_group.py: the max of (h, -h) over
the ranks, O(log N) rounds on the host over a gloo group, run by a C++ thread, never a
device tensor),
and has one ``ddp_fusion::plan_guard`` right before the group's
first bucket is issued, which collects it. Every rank runs the same plan exactly when
both maxima give back its own h; if not, every rank raises :class:`PlanMismatchError`,
before any bucket is issued, with a description that group rank 0 assembles from the
store (host_group.HostGroup.report; on this error path only). No device tensor is read
on the host: the check never waits for the GPU, only for the other ranks' hosts.

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
JSON (``BucketPlan.of_group(...).to_json()``). A joined rank (join.py) takes part in the
same exchange sending ``host_group.NEUTRAL``, learns the active ranks' plan hash from
it, and reads the plan from the store, where one rank (the first to claim it) publishes
each plan the first time it is run.

``config.plan_check`` off: the graphs start each group with ``ddp_fusion::plan_start``
instead, the same one-time work and divisor without the exchange, and have no guard
(inside an enabled join context it runs the check, start and guard, at once).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
import weakref
import zlib
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from . import _torch, comm_hooks, dump, host_group, scaling
from .config import config, on_change
from .host_group import NEUTRAL, has_peers
from .log import log
from .ops import CUDAGRAPH_UNSAFE
from .plan import BucketPlan

__all__ = ["PlanMismatchError", "has_peers"]


class PlanMismatchError(RuntimeError):
    """Ranks would issue different gradient collectives (which would hang)."""


_plan_hashes: dict[str, int] = {}
_reported: set[tuple[str, int]] = set()
_published: set[int] = set()
# plan hash -> the plan's text, as the graphs' plan_check_start ops passed it
_texts: dict[int, str] = {}
# (group name, plan) -> the plan check in flight: (host group, its ticket, the exchange)
_pending: dict[tuple[str, int], tuple[host_group.HostGroup, int, host_group.Exchange]] = {}


def pending() -> int:
    """Plan checks started whose guard has not collected them: none between steps (see
    ``ddp_fusion.pending``)."""
    native = host_group.native_loaded()
    return len(_pending) + (0 if native is None else native.pending())


def _group(group_name: str) -> dist.ProcessGroup:
    group = _torch.distributed.resolve_process_group(group_name)
    if group is None:
        raise RuntimeError(
            f"ddp_fusion: process group {group_name!r} is not registered in this process "
            "(was it destroyed after the model was compiled?)"
        )
    return group


# Defined with torch.library directly, as ops.py's bucket ops are: custom_op's wrapper
# (its autograd function and its ``torch._disable_dynamo`` context) cost more Python per
# call than these ops' own bodies, twice per group per step.
_lib = torch.library.Library("ddp_fusion", "FRAGMENT")
_lib.define("plan_check_start(str group_name, str plan, int plan_hash, Device device, str reduce_op=\"avg\") "
            "-> Tensor", tags=CUDAGRAPH_UNSAFE)
_lib.define("plan_guard(Tensor token, str group_name, int plan_hash, str reduce_op, Device device) -> Tensor",
            tags=CUDAGRAPH_UNSAFE)
_lib.define("plan_divisor(str group_name, str reduce_op, Device device) -> Tensor", tags=CUDAGRAPH_UNSAFE)
_lib.define("plan_start(str group_name, str plan, int plan_hash, Device device, str reduce_op=\"avg\") "
            "-> Tensor", tags=CUDAGRAPH_UNSAFE)


def plan_check_start(group_name: str, plan: str, plan_hash: int, device: torch.device,
                     reduce_op: str = "avg") -> torch.Tensor:
    """Start this step's cross-rank check of the group's bucket plan (``plan``: as
    :func:`graph_text` gives it): the max of
    (h, -h) of the plan's hash h (``plan_hash``, :func:`plan_hash` of it, computed by
    the pass) over the group's host group, in the background. Returns what
    :func:`plan_divisor` would for ``reduce_op`` (the group's first: the graph needs no
    ``plan_divisor`` op for it, bench/results/plan_ops_cpu_2026-11-28.md), which is also
    the token :func:`plan_guard` takes, after the start, to finish the check.

    State is keyed by the hash: a step never hashes the plan's text, which grows with
    the number of parameters. Only this op takes the text (a graph served from
    Inductor's cache, in a process that did not compile it, needs it here), and a long
    one compressed (:func:`graph_text`, read once per process); the guards find it by
    the hash. The dispatcher copies a str argument twice per call: 16 µs a call for the
    46 KB plan of 1,000 gradients. A steady step finds the group and its host group
    with :func:`host_group.known`, not looked up again."""
    # A backward that completed waited for all of its hooks: one still in flight is
    # left by a backward that failed halfway, and must not hold this one up.
    comm_hooks.drop_in_flight()
    known = host_group.known(group_name)
    if known is None or (group_name, plan_hash) not in _started:
        group = _group(group_name)
        if plan_hash not in _texts:
            _texts[plan_hash] = from_graph_text(plan)
        hook_groups(_texts[plan_hash], group, plan_hash)
        host = host_group.of(group)
        if host is None:
            return _divisor_tensor(group, reduce_op, device)
        _publish(_texts[plan_hash], plan_hash)
        _started.add((group_name, plan_hash))
    else:
        group, host = known
        if _hook_groups[plan_hash]:
            hook_groups(_texts[plan_hash], group, plan_hash)
    _pending[group_name, plan_hash] = (host, host.ticket(), host.max_async([plan_hash, -plan_hash]))
    return _divisor_tensor(group, reduce_op, device)


# (group name, plan hash) of the checks started the long way, which also ran the plan's
# one-time work: later steps find the group and its host group with host_group.known
_started: set[tuple[str, int]] = set()
# (group name, plan hash) of the plans of graphs compiled without the check whose
# one-time work ran
_unchecked: set[tuple[str, int]] = set()
# group name -> (the group, config.plan_check as its ranks compared it at a model's first
# forward, grad_sync.py): what the pass compiles the group's graphs with
_agreed: dict[str, tuple[weakref.ref, bool]] = {}


def agree(group: dist.ProcessGroup, value: bool) -> None:
    """Record ``config.plan_check`` as the ranks of ``group`` agreed on it."""
    _agreed[group.group_name] = (weakref.ref(group), value)


def _agreed_value(group_name: str) -> bool | None:
    """The value agreed for the live group of that name (None: none, or one agreed for a
    group since destroyed or replaced under its name)."""
    entry = _agreed.get(group_name)
    if entry is None:
        return None
    group = entry[0]()
    if group is None or group is not _torch.distributed.resolve_process_group(group_name):
        del _agreed[group_name]
        return None
    return entry[1]


def checks(group_name: str) -> bool:
    """Whether the pass gives ``group_name``'s graphs the check: the value its ranks
    agreed on at a model's first forward (``config.plan_check`` changed on some rank
    since would make the ranks' graphs differ: it is then ignored, with a warning), else
    ``config.plan_check``."""
    agreed = _agreed_value(group_name)
    if agreed is None:
        return config.plan_check
    if agreed != config.plan_check and group_name not in _warned_changed:
        _warned_changed.add(group_name)
        log.warning(
            "ddp_fusion: config.plan_check is %s now, but the ranks of process group %r agreed on "
            "%s at their model's first forward: its graphs keep %s (a setting that decides which "
            "exchanges a rank posts must change on every rank at once: set it before the first "
            "forward)", config.plan_check, group_name, agreed, agreed)
    return agreed


_warned_changed: set[str] = set()


def cache_key() -> list[tuple[str, bool]] | None:
    """What ``checks`` depends on beyond ``config.plan_check``, for the pass's key in
    Inductor's FX graph cache."""
    live = {name: _agreed_value(name) for name in list(_agreed)}
    return sorted((name, v) for name, v in live.items() if v is not None) or None


def plan_start(group_name: str, plan: str, plan_hash: int, device: torch.device,
               reduce_op: str = "avg") -> torch.Tensor:
    """:func:`plan_check_start` without the check, for graphs compiled with
    ``config.plan_check`` off: the plan's one-time work (its text, its comm hooks'
    groups, its log line) and the divisor for ``reduce_op``; posts no exchange, but
    inside an enabled join context, where a joined rank learns the plan from the check
    (join.py), it runs the check at once (start and guard, waiting here)."""
    if scaling.joining(group_name):
        token = plan_check_start(group_name, plan, plan_hash, device, reduce_op)
        return plan_guard(token, group_name, plan_hash, reduce_op, device)
    comm_hooks.drop_in_flight()
    key = (group_name, plan_hash)
    if key not in _unchecked:
        group = _group(group_name)
        if plan_hash not in _texts:
            _texts[plan_hash] = from_graph_text(plan)
        hook_groups(_texts[plan_hash], group, plan_hash)
        if key not in _reported:
            _reported.add(key)
            _report_plan(group_name, _texts[plan_hash])
        _unchecked.add(key)
    else:
        group = _known_group(group_name)
        if _hook_groups[plan_hash]:
            hook_groups(_texts[plan_hash], group, plan_hash)
    return _divisor_tensor(group, reduce_op, device)


def _known_group(group_name: str) -> dist.ProcessGroup:
    """The process group named ``group_name``: as its host group holds it, else looked up."""
    known = host_group.known(group_name)
    return _group(group_name) if known is None else known[0]


def plan_guard(
    token: torch.Tensor, group_name: str, plan_hash: int, reduce_op: str, device: torch.device
) -> torch.Tensor:
    """The bucket divisor for ``reduce_op`` as a 0-d float32 tensor on ``device``, after
    the check :func:`plan_check_start` began (``token``: its output) shows that every
    rank of the group runs the same bucket plan in this step (else
    :class:`PlanMismatchError` on every rank)."""
    key = (group_name, plan_hash)
    group = _known_group(group_name)
    if key not in _reported:
        _reported.add(key)
        _report_plan(group_name, _texts[plan_hash])  # (the start, which this guard follows, put it there)
    pending = _pending.pop(key, None) or _cpp_pending(group_name, plan_hash)
    if pending is not None:  # (None: checked by this group's other guard)
        host, ticket, exchange = pending
        _check(host, ticket, exchange, group_name, plan_hash)
        _mark_steady(group_name, group, host, plan_hash)
    return _divisor_tensor(group, reduce_op, device)


def _cpp_pending(group_name: str, plan_hash: int
                 ) -> tuple[host_group.HostGroup, int, host_group.Exchange] | None:
    """A check the C++ start began whose guard runs here (the C++ kernels were taken
    back in between: ``native_check`` turned off): as ``_pending`` holds one."""
    native = host_group.native_loaded()
    taken = None if native is None else native.take_pending(group_name, plan_hash)
    if taken is None:
        return None
    core, seq, ticket = taken
    host = _steady_hosts[group_name]
    if host.exchanger is None or host.exchanger.core is not core:
        raise RuntimeError(f"ddp_fusion: the host group of process group {group_name!r} was replaced "
                           "between this step's plan check and its guard")
    return host, ticket, host_group.NativeMax(host.exchanger, seq)


def _check(host: host_group.HostGroup, ticket: int, exchange: host_group.Exchange, group_name: str,
           plan_hash: int) -> None:
    """Raise unless the exchange shows every rank running the plan ``plan_hash``."""
    top, neg_bottom = outcome(exchange, group_name)
    if not (top == plan_hash and -neg_bottom == plan_hash):
        raise PlanMismatchError(describe_mismatch(host, ticket, group_name, plan_hash, _texts[plan_hash]))


# group name -> the host group whose C++ exchanger its steady checks use (for their errors)
_steady_hosts: dict[str, host_group.HostGroup] = {}


def _mark_steady(group_name: str, group: dist.ProcessGroup, host: host_group.HostGroup,
                 plan_hash: int) -> None:
    """After a plan's check passed in Python: from the next step, the C++ kernels
    (csrc/host_check.cpp) run its check, where they can. Not for a plan with hooked
    buckets, nor while any comm hook exists (a steady step skips ``drop_in_flight``),
    nor while a join context sets the divisor, nor without the C++ exchanger."""
    exchanger = host.exchanger
    divisor = scaling.divisor(group)
    if not (exchanger is not None and config.native_check
            and not _hook_groups.get(plan_hash) and not comm_hooks.any_registered()
            and isinstance(divisor, int)):
        return
    native = host_group.native()
    if native is None:
        return
    if not native.kernels_registered():
        native.register_kernels(plan_check_start, plan_guard, _steady_start_failed, _steady_failed)
    _steady_hosts[group_name] = host
    native.mark_steady(group_name, exchanger.core, plan_hash, float(divisor))


def _steady_start_failed(group_name: str, status: int) -> None:
    """The C++ start could not post its exchange (``status``: the exchanger's outcome):
    the error the Python start raises for it."""
    raise _steady_hosts[group_name].exchanger.error(status, "")


def _steady_failed(token: torch.Tensor, group_name: str, plan_hash: int, reduce_op: str, device: torch.device,
                   seq: int, ticket: int, status: int, top: list[int], text: str) -> torch.Tensor:
    """The C++ guard's check of exchange ``seq`` did not pass (``status``: the
    exchanger's outcome, ``top``: the max, ``text``: why it failed): the error the
    Python guard raises for it."""
    host = _steady_hosts[group_name]
    exchanger = host.exchanger

    def taken() -> list[int]:
        if status != host_group.OK:
            raise exchanger.error(status, text)
        return list(top)

    exchange = host_group.NativeMax(exchanger, seq, taken)
    _check(host, ticket, exchange, group_name, plan_hash)
    return _divisor_tensor(_known_group(group_name), reduce_op, device)  # (passed after all: not reached)


def _native_check_changed(name: str, value: object) -> None:
    """``config.native_check`` turned off: the Python kernels again, at the next step."""
    native = host_group.native_loaded()
    if name == "native_check" and not value and native is not None:
        native.forget_all()
        native.unregister_kernels()


on_change(_native_check_changed)


def plan_divisor(group_name: str, reduce_op: str, device: torch.device) -> torch.Tensor:
    """What :func:`plan_guard` returns, without waiting for the check: the bucket divisor
    for ``reduce_op`` as a 0-d float32 tensor on ``device``."""
    return _divisor_tensor(_known_group(group_name), reduce_op, device)


def _empty_divisor(*args: object) -> torch.Tensor:
    """What ``plan_guard`` and ``plan_divisor`` return, for fake tensors: a 0-d float32
    on the op's device (their last argument)."""
    return torch.empty((), dtype=torch.float32, device=args[-1])


def _empty_start_divisor(group_name: str, plan: str, plan_hash: int, device: torch.device,
                         reduce_op: str = "avg") -> torch.Tensor:
    """What ``plan_check_start`` returns, for fake tensors."""
    return torch.empty((), dtype=torch.float32, device=device)


for _name, _impl, _fake in (("plan_check_start", plan_check_start, _empty_start_divisor),
                            ("plan_start", plan_start, _empty_start_divisor),
                            ("plan_guard", plan_guard, _empty_divisor),
                            ("plan_divisor", plan_divisor, _empty_divisor)):
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"ddp_fusion::{_name}", _fake, lib=_lib)


def outcome(exchange: host_group.Exchange, group_name: str) -> list[int]:
    """The result of a plan check's exchange, waited for (bench.plan_check times it)."""
    try:
        return exchange.result()
    except Exception as e:
        raise RuntimeError(
            f"ddp_fusion: the per-step plan check of process group {group_name!r} failed "
            f"(a rank died, or did not reach this step's backward within the group's "
            f"timeout): {type(e).__name__}: {e}"
        ) from e


def shadow_exchange(group: dist.ProcessGroup) -> str:
    """A joined rank's part of one plan check of ``group`` (join.py): the exchange, with
    nothing of its own in it; returns the plan the active ranks run (from the store).
    Raises :class:`PlanMismatchError` where they run different plans (they raise too)."""
    host = host_group.of(group)
    if host is None:
        raise RuntimeError(f"ddp_fusion: join(): process group {group.group_name!r} has no peers")
    ticket = host.ticket()
    top, neg_bottom = outcome(host.max_async([NEUTRAL, NEUTRAL]), group.group_name)
    if top != -neg_bottom:
        raise PlanMismatchError(describe_mismatch(host, ticket, group.group_name, None))
    return published_plan(top)


def _divisor_tensor(group: dist.ProcessGroup, reduce_op: str, device: torch.device) -> torch.Tensor:
    """The bucket divisor for ``reduce_op`` as a new 0-d float32 tensor on ``device``."""
    d = scaling.divisor(group) if reduce_op == "avg" else 1  # "sum"; "hook": the hook scales
    if isinstance(d, torch.Tensor):  # the ranks still training in a join context
        return d.to(device=device, dtype=torch.float32, copy=True)
    return torch.full((), d, dtype=torch.float32, device=device)


PLAN_CHECK_START = torch.ops.ddp_fusion.plan_check_start.default
PLAN_GUARD = torch.ops.ddp_fusion.plan_guard.default
PLAN_DIVISOR = torch.ops.ddp_fusion.plan_divisor.default
PLAN_START = torch.ops.ddp_fusion.plan_start.default
# the check runs whether or not anything reads the guard's divisor (the pass gives it a
# reader, a gradient with elements: this keeps FX and Inductor from dropping the check
# as dead code should that reader go)
torch.fx.node.has_side_effect(PLAN_CHECK_START)
torch.fx.node.has_side_effect(PLAN_GUARD)
torch.fx.node.has_side_effect(PLAN_START)


#: Plans longer than this go into the graph compressed (:func:`graph_text`).
GRAPH_TEXT_RAW_MAX = 4096
_COMPRESSED = "zlib+b85:"


def graph_text(plan: str) -> str:
    """The plan as the graph passes it to ``plan_check_start`` each step: the JSON
    itself (readable in graph dumps) up to :data:`GRAPH_TEXT_RAW_MAX` characters, else
    zlib-compressed and base85-encoded (about 15x shorter: a plan's gradient names
    repeat their prefixes). Always encoded in a graph that gets C++ wrapper code, which
    writes a ``str`` argument into a C++ string literal as it is (the JSON's quotes
    would end it); base85's characters need no escape there."""
    if len(plan) <= GRAPH_TEXT_RAW_MAX and not _torch.inductor.cpp_wrapper():
        return plan
    return _COMPRESSED + base64.b85encode(zlib.compress(plan.encode(), 6)).decode("ascii")


def from_graph_text(text: str) -> str:
    """The plan :func:`graph_text` gave ``text`` for."""
    if text.startswith(_COMPRESSED):
        return zlib.decompress(base64.b85decode(text[len(_COMPRESSED):])).decode()
    return text


def plan_id(plan: str) -> str:
    """A short name of a bucket plan (its hash, as hex)."""
    return f"{plan_hash(plan) & 0xFFFFFFFFFFFFFFFF:016x}"


@functools.lru_cache(maxsize=64)
def parse(plan: str) -> BucketPlan:
    """The plan a fused graph carries, parsed (once per plan text)."""
    return BucketPlan.from_json(plan)


# plan hash -> the names of its hooked buckets' groups
_hook_groups: dict[int, list[str]] = {}


def hook_groups(plan: str, group: dist.ProcessGroup, h: int | None = None) -> None:
    """Make sure the groups of the plan's hooked buckets (comm_hooks.py) are registered:
    a graph served from Inductor's cache was not compiled in this process, and
    ``destroy_process_group`` unregisters every group. The plan is read once."""
    h = plan_hash(plan) if h is None else h
    names = _hook_groups.get(h)
    if names is not None and comm_hooks.registered(names):
        return
    per_model: dict[int, list[tuple[str, ...]]] = {}
    for b in parse(plan).buckets:
        if b.hook is not None:
            per_model.setdefault(b.hook[0], []).append(b.grads)
    _hook_groups[h] = [
        name
        for model_id, buckets in per_model.items()
        for name in comm_hooks.ensure_groups(model_id, plan_id(plan), buckets, group)
    ]


def plan_hash(plan: str) -> int:
    """The plan's hash, as the plan check exchanges it (never :data:`NEUTRAL`)."""
    h = _plan_hashes.get(plan)
    if h is None:
        digest = hashlib.blake2b(plan.encode(), digest_size=8).digest()
        h = int.from_bytes(digest, "little", signed=True)
        # never NEUTRAL: the check sends -h too, and a joined rank sends NEUTRAL
        h = _plan_hashes[plan] = h if h != NEUTRAL else NEUTRAL + 1
    return h


def _publish(plan: str, h: int) -> None:
    """Put a plan in the store under its hash, the first time this process runs it:
    one rank of those that run it (the first to claim it) writes it, the others add one
    to a counter, so the store gets each plan once, not once per rank. A joined rank,
    and a mismatch report, read it from there."""
    if h in _published:
        return
    _published.add(h)
    store = _torch.distributed.default_store()
    key = f"ddp_fusion/plan/{h}"
    if store.add(f"{key}/claim", 1) == 1:
        store.set(key, plan)


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


JOINED = "joined"


def describe_mismatch(host: host_group.HostGroup, ticket: int, group_name: str, mine: int | None,
                      plan: str | None = None) -> str:
    """Every rank's side of a failed plan check (``mine``: this rank's plan hash, None
    for a joined rank; ``plan``: its plan), described by group rank 0 from the store (or
    this rank's side alone, where group rank 0 cannot)."""
    known = {} if mine is None or plan is None else {str(mine): plan}
    return host.report("plan", ticket, JOINED if mine is None else str(mine),
                       lambda payloads: _describe(group_name, payloads, host.ranks, known))


def _describe(group_name: str, payloads: dict[int, str],
              show_ranks: Callable[[Sequence[int]], str] = str, known: dict[str, str] | None = None) -> str:
    """The ranks' plans (hashes, or :data:`JOINED`; by group rank), grouped by plan:
    which ranks run what, and which gradients some ranks lack. ``known``: plans by hash
    that need not be read from the store."""
    ranks_of: dict[str, list[int]] = {}
    for rank, p in sorted(payloads.items()):
        ranks_of.setdefault(p, []).append(rank)
    lines = [
        f"ddp_fusion: ranks of process group {group_name!r} compiled different gradient "
        "bucket plans, so their collectives would not match (a hang). Usually a "
        "parameter gets a gradient on some ranks only (unused in this step's forward: "
        "build the DDP with find_unused_parameters=True), or the ranks run different "
        "code or models."
    ]
    known = known or {}
    plans = {p: parse(known.get(p) or published_plan(int(p))).buckets for p in ranks_of if p != JOINED}
    names = {p: {n for b in buckets for n in b.grads} for p, buckets in plans.items()}
    everyone = set.union(*names.values()) if names else set()
    for p, ranks in ranks_of.items():
        who = f"group rank{'s' if len(ranks) > 1 else ''} {show_ranks(ranks)}"
        if p == JOINED:
            lines.append(f"  {who}: joined (join(): shadows the others' plan)")
            continue
        buckets = plans[p]
        lines.append(f"  {who}: {len(buckets)} buckets, bytes {[b.nbytes for b in buckets]}")
        missing = sorted(everyone - names[p])
        if missing:
            lines.append(f"  {who} {'have' if len(ranks) > 1 else 'has'} no gradient for: "
                         f"{', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else ""))
    if len(names) > 1 and all(have == everyone for have in names.values()):
        lines.append(
            "  every rank reduces the same gradients, in different buckets: the ranks' "
            "bucket arguments, dtypes or learned ready orders differ"
        )
    return "\n".join(lines)
