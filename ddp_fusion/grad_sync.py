"""``GradSync``: the gradient machinery of one data-parallel model.

Shared by the wrapper (wrapper.py) and a torch DDP adopted under the flag (stock.py).
Each parameter gets a post-accumulate-grad hook; from the model's first compiled
forward on, one callback per backward does their work (:meth:`GradSync.use_callback`).
Traced by compiled autograd, the hook (the callback, for each parameter) calls the
tagged ``ddp_fusion::all_reduce_gradient`` op and makes the result the parameter's
``.grad``; the pass then buckets and fuses those ops as eager DDP would have (the
results become views of the reduced buckets). Run eagerly, the hook hands the gradient
to the eager bucketed reducer (reducer.py).

Around each forward (:meth:`GradSync.before_forward`): buffers are broadcast as torch
DDP does, and inside an enabled ``join()`` context join.py's prelude runs. The first
time the forward runs compiled (traced by Dynamo, or calling compiled submodules) with
``config.enabled`` on, compiled autograd is turned on for the process (effects.py) and
eager autograd's ready order is learned (ready_order.py, taken from the group's rank 0,
as eager DDP rebuilds its buckets from rank 0's order). A model whose forward never
runs compiled keeps the eager bucketed reducer: eager DDP's speed, no compile.

A model has one id (``GradSync.model_id``), carried by every tagged all-reduce its hooks
make: a hash of its parameter names and group, so that it is the same in every process
and for a re-created model (graphs stay cacheable), made unique among live models.
Dynamo may run a re-created model's forward with the code it traced for the model that
had its id before (its guards pass: the same program), where the first-forward work
above never runs: the re-created model takes what that one learned (:class:`_Learned`).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import weakref
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from . import _torch, autocap, comm_hooks, effects, host_group, join, plan_check, ready_order, settings_check
from . import unused
from .config import config
from .log import log
from .ops import ALL_REDUCE_GRADIENT, HOOK, READY_NOT_LEARNED, READY_UNKNOWN, forget_runs
from .plan import MiB, dims_in_memory, forget_element_orders, register_element_orders
from .reducer import EagerReducer


@dataclasses.dataclass
class SyncState:
    """What the hooks read; kept off the model so the hooks hold no reference to it."""

    comm_dtype: torch.dtype | None
    """All-reduce gradients in this dtype (torch's fp16/bf16 compress hooks)."""
    require_backward_grad_sync: bool = True
    """torch DDP's flag (``no_sync()``), as the hooks see it in this backward."""
    ready_learned: bool = False
    ready_position: tuple[int, ...] | None = None
    """Parameter index -> position in eager autograd's ready order (ready_order.py)."""
    ready_failed: bool = False
    """Learning the ready order was tried and failed (on group rank 0, whose outcome
    every rank takes): buckets follow the graph's order, as was warned then."""
    settings_checked: bool = False
    """The settings were compared across the ranks at the first forward."""
    inherited: tuple[Any, ...] | None = None
    """Set while the fields above are the ones the model that had this id before
    learned (:class:`_Learned`): what they were before, put back when this model's own
    first-forward work runs after all (a forward Dynamo traces for it, or eager)."""
    failed: BaseException | None = None
    """What the first forward's checks raised: raised again at every forward (the
    model's ranks disagree; it cannot train)."""
    forward_param_sync: bool = True
    """eager DDP's ``require_forward_param_sync``: sync buffers at the next forward."""
    forwarded: bool = False
    comm_hook: str | None = None
    """The registered comm hook's name."""
    reduce_op: str = "avg"
    """``avg``, or ``ops.HOOK``: the model's comm hook reduces its buckets."""
    join_divide_by_initial: bool = True
    """``join(divide_by_initial_world_size=...)`` of the current join context."""
    compiled: bool = False
    """A forward ran compiled with ``config.enabled`` on: backward goes through
    compiled autograd and the pass."""
    compiled_while_disabled: bool = False
    """A forward ran compiled while ``config.enabled`` was off (its compiled code has
    no ddp_fusion in it)."""
    holds_compiled_code: bool | None = None
    """Whether the module calls compiled submodules (checked at the first eager forward)."""


@dataclasses.dataclass
class _HookData:
    """What a model's gradient hooks read, besides their own parameter: one object per
    model, reached by every hook through the same registry entry (:data:`_hook_data`).

    Compiled autograd traces all of a backward's hooks into one graph, and Dynamo
    guards what each hook reads, every step. A hook closing over the model's objects
    reaches the same object through each hook's own closure, which Dynamo guards with
    one aliasing check per hook and object, in Python (1,600 of them, ~40 % of the step,
    on a model of 400 parameters). Read through ``_hook_data[model_id]``, every hook
    reaches them by the same path, guarded once; what is a hook's own, its traced form
    reads from one string (:func:`_traced_hook`)."""

    state: SyncState
    reducer: EagerReducer
    group_name: str
    limits: list[int]
    """Changed in place by ``bucket_cap_mb="auto"`` (before the first compiled step)."""
    names: tuple[str, ...]
    unsynced: unused.Unsynced | None
    """``find_unused_parameters``: the no_sync() marks (unused.py); else None."""
    params: tuple[torch.Tensor, ...] = ()
    """The reduced parameters, in index order (read by the model's one callback)."""
    tags: str = ""
    """Every parameter's tag (:func:`_tag`), joined by newlines: one string, guarded once."""
    queued: bool = False
    """Whether this backward's callback is queued (one callback, however many of the
    model's hooks fire; cleared by the callback and at each forward)."""


# model id -> what its hooks read (removed with the model)
_hook_data: dict[int, _HookData] = {}


@dataclasses.dataclass(frozen=True)
class _Learned:
    """What a model's first compiled forward learned, kept by model id for a model made
    again with the same id (the same parameter names and group, the last one released).

    Its first-forward work (:func:`_on_forward`) runs when Dynamo traces the forward, and
    Dynamo may instead run the code it traced for the model before (a k-fold loop, a
    sweep: its guards pass, the same program), so the work never runs for the new one,
    which would then bucket in the graph's order, and look uncompiled to ``join()``. A
    model made again starts with these (group rank 0's order, as every rank took it);
    if its own first-forward work runs after all, it starts from scratch there, so the
    ranks run the same collective checks as for any new model."""

    ready_position: tuple[int, ...] | None
    ready_failed: bool
    limits: tuple[int, ...]
    sizing: Any
    settings: tuple[bool, bool]
    """(find_unused_parameters, bucket_cap_mb="auto"): taken only by a model with the same."""


# model id -> what the last model with that id learned at its first compiled forward
_learned: dict[int, _Learned] = {}


def _make_hook(model_id: int, index: int, tag: str):
    """Parameter ``index``'s hook. ``tag`` (:func:`_tag`) is all that its traced form
    reads of the parameter's own: the model's :meth:`GradSync.retag` sets it again when
    what it holds changes (the ready order learned), which Dynamo's guard on it sees."""
    def reduce_grad(param: torch.Tensor) -> None:
        if torch.compiler.is_compiling():
            _traced_hook(param, tag)
            return
        _ready_eagerly(_hook_data[model_id], param, index)

    return reduce_grad


def _ready_eagerly(data: _HookData, param: torch.Tensor, index: int) -> None:
    """A gradient to the eager bucketed reducer (a backward compiled autograd does not
    compile), with the warning that a model meant to run fused gets there."""
    state = data.state
    if _not_syncing(data, param, index) or param.grad is None:
        return
    if config.enabled and (state.compiled or state.compiled_while_disabled or not state.forwarded):
        _warn_unfused(state)  # (counted per gradient, said once)
    data.reducer.grad_ready(index)


def _callback_hook(model_id: int) -> Any:
    """The post-accumulate-grad hook that queues the model's one callback for a backward
    (:meth:`GradSync.use_callback`): the same function object for a model made again
    with the same id, so that Dynamo's guards on it hold for that model too."""
    hook = _callbacks.get(model_id)
    if hook is not None:
        return hook

    def run() -> None:
        data = _hook_data[model_id]
        data.queued = False
        if torch.compiler.is_compiling():
            for param, tag in zip(data.params, data.tags.split("\n")):
                _traced_hook(param, tag)
            return
        for index, param in enumerate(data.params):
            _ready_eagerly(data, param, index)

    def queue(param: torch.Tensor) -> None:
        data = _hook_data[model_id]
        if not data.queued:
            data.queued = True
            _torch.compiled_autograd.queue_callback(run)

    hook = _callbacks[model_id] = queue
    return hook


CALLBACK_HOOKS = 8
"""How many parameters keep a hook that queues the model's callback (:meth:`GradSync._callback_params`)."""

# model id -> its callback's hook (kept for a model made again with the same id)
_callbacks: dict[int, Any] = {}


def _tag(model_id: int, index: int, name: str, state: SyncState) -> str:
    """What a parameter's hook passes to the pass, as one string (see
    :func:`_traced_hook`): its model, index, position in the ready order, and name."""
    ready = (state.ready_position[index] if state.ready_position is not None
             else READY_NOT_LEARNED if state.ready_failed else READY_UNKNOWN)
    return f"{model_id}:{index}:{ready}:{name}"


def _traced_hook(param: torch.Tensor, tag: str) -> None:
    """A gradient hook as compiled autograd traces it (the hook's eager form: the eager
    bucketed reducer).

    Compiled autograd traces all of a backward's hooks into one graph, and Dynamo guards,
    at every backward, each value a hook reads. What is the same for every hook of a
    model is read through ``_hook_data[model_id]`` (one path, guarded once); what is a
    parameter's own comes from the one closure cell ``tag`` (one string: per hook 5 guard
    nodes and 2 checks, the hook's code and the string, where a guard on each of its
    model id, index, name and ready position made 8 and 5)."""
    model_id, index, ready, name = _untag(tag)
    data = _hook_data[model_id]
    state = data.state
    if _not_syncing(data, param, index) or param.grad is None:
        return
    # One tagged all-reduce, fused by the pass. A DTensor gradient: reduce its local
    # shard over the data-parallel group.
    grad = _torch.tensors.local_tensor(param.grad)
    # The reduced gradient goes into .grad, which stays the same tensor: as under torch
    # DDP, code that keeps a .grad (zero_grad(set_to_none=False), accumulation) sees
    # every step's reduced gradient. The pass turns this copy into the bucket's own
    # memory: a .grad made in this backward becomes a view of the reduced bucket (no
    # copy), and a bucket of .grads that existed before it is reduced in place in them
    # (passes/in_place.py).
    grad.copy_(ALL_REDUCE_GRADIENT(
        grad, data.group_name, state.reduce_op, data.limits, name, state.comm_dtype, ready, model_id,
    ))


def _not_syncing(data: _HookData, param: torch.Tensor, index: int) -> bool:
    """Whether this backward does not reduce (``no_sync()``). Then, with
    ``find_unused_parameters``, a parameter with a gradient is marked used: eager DDP
    counts it as used at the next backward that reduces (unused.py). Traced, the marks
    are a side effect Dynamo replays after the graph."""
    if data.state.require_backward_grad_sync:
        return False
    if data.unsynced is not None and param.grad is not None:
        data.unsynced.marks[index] = True
        data.unsynced.dirty = True
    return True


def _untag(tag: str) -> tuple[int, int, int, str]:
    model_id, index, ready, name = tag.split(":", 3)
    return int(model_id), int(index), int(ready), name


def _warn_unfused(state: SyncState) -> None:
    """A model whose forward ran compiled reduced its gradients eagerly (bucketed,
    correct, but outside the compiled backward)."""
    _torch.dynamo.counters()["ddp_fusion"]["unfused: compiled autograd not active"] += 1
    if not state.forwarded:
        reason = (
            "a model's gradient hooks ran, but its forward never did (was its .module "
            "called instead of the model?): its gradients went through the eager bucketed "
            "reducer, unfused. Call the data-parallel model itself"
        )
    elif state.compiled:
        reason = (
            "a gradient hook ran outside compiled autograd (a graph break in backward, or "
            "compiled autograd turned off); its gradients went through the eager bucketed "
            "reducer, unfused"
        )
    else:
        reason = (
            "config.enabled was turned on after this model's forward was compiled, so its "
            "compiled code has no ddp_fusion in it and its gradients go through the eager "
            "bucketed reducer, unfused. Set ddp_fusion.config.enabled = True (or "
            "DDP_FUSION=1) before the first torch.compile call, or call "
            "torch._dynamo.reset() after setting it"
        )
    if reason not in _warned:
        _warned.add(reason)
        log.warning("ddp_fusion: %s", reason)


_warned: set[str] = set()

# parameter -> weak reference to the live model (wrapper or adopted torch DDP) whose
# hooks it carries
_models: WeakIdKeyDictionary = WeakIdKeyDictionary()
# model id -> weak reference to its live GradSync
_syncs: dict[int, weakref.ref] = {}


def _on_forward(key: tuple[int, bool], inputs: Any) -> None:
    """Called at each eager forward, and when Dynamo traces the forward (``key``: the
    model id, and whether traced). If the forward runs compiled (traced, or eager but
    calling compiled submodules) with ``config.enabled`` on: compiled autograd on for
    the process, and eager autograd's ready order learned, the first time, and taken
    from group rank 0 (eager DDP also rebuilds its buckets from rank 0's order)."""
    model_id, traced = key
    ref = _syncs.get(model_id)
    sync = ref() if ref is not None else None
    if sync is None or sync.state.failed is not None:
        return
    try:
        _first_forward_checks(sync, traced, inputs)
    except Exception as e:  # noqa: BLE001 - GradSync.before_forward raises it, outside the trace
        sync.state.failed = e


def _first_forward_checks(sync: GradSync, traced: bool, inputs: Any) -> None:
    state = sync.state
    if not traced and state.holds_compiled_code is None:
        state.holds_compiled_code = _torch.dynamo.holds_compiled_code(sync.module)
    if traced or not state.settings_checked or not state.holds_compiled_code:
        # traced: at each compile of the forward (free per step); eager and uncompiled:
        # each step, beside the eager hooks' Python per parameter; an eager forward
        # around compiled submodules: the first forward only (its steady step is lean)
        sync.check_frozen()
    compiled = traced or bool(state.holds_compiled_code)
    if state.inherited is not None:
        sync.forget_learned()  # its own first-forward work runs: as any model's
    if not state.settings_checked:
        state.settings_checked = True
        settings_check.check(sync.host, sync.who, "at their first forward", sync.forward_settings(compiled))
        if compiled and config.enabled:
            plan_check.agree(sync.group, config.plan_check)  # what the pass gives its graphs
    if not compiled:
        return  # eager: the eager reducer (no compile the user did not ask for)
    if not config.enabled:
        state.compiled_while_disabled = True
        return
    state.compiled = True
    if traced and _has_dynamic_shapes(inputs):
        effects.want(effects.DYNAMIC_BACKWARD)  # before: compiled autograd starts dynamic
    effects.want(effects.COMPILED_AUTOGRAD)
    if not state.ready_learned and torch.is_grad_enabled():
        _learn_ready_order(sync, inputs)
    sync.use_callback()  # (after the order is learned: it picks the hooked parameters)
    if traced and state.ready_learned:  # (at trace time only: eager forwards come here each step)
        _learned[sync.model_id] = _Learned(
            state.ready_position, state.ready_failed, tuple(sync.limits), sync.sizing,
            (sync.layout is not None, sync.auto),
        )


def _raise_failed(state: SyncState) -> None:
    raise state.failed  # type: ignore[misc]


def _has_dynamic_shapes(inputs: Any) -> bool:
    """Whether Dynamo traces this forward with a symbolic size (automatic dynamic
    after a shape changed, or ``dynamic=True``); then backward is traced dynamic too."""
    try:
        args, kwargs = inputs()
    except Exception:  # noqa: BLE001 - an argument Dynamo cannot give: assume static
        return False
    return any(
        isinstance(s, torch.SymInt)
        for t in _torch.tensors.tree_leaves((args, kwargs))
        if isinstance(t, torch.Tensor)
        for s in t.shape
    )


def _learn_ready_order(sync: GradSync, inputs: Any) -> None:
    """The ready order (with ``bucket_cap_mb="auto"``: and the bucket limits, autocap.py),
    group rank 0's: each rank tries on its own (the runs issue no collective of the
    model's group, and a failure is caught), then group rank 0's outcome is broadcast
    on the host group and every rank takes it, failure included. So every rank runs the
    same plan whichever ranks failed, and no rank leaves the others waiting."""
    mine = _learn_here(sync, inputs)
    host = sync.host
    if host:
        order, choice, why_order, why_caps = host.broadcast_json(
            [mine[0], mine[1] and dataclasses.asdict(mine[1]), mine[2], mine[3]])
        choice = choice and autocap.Choice.from_dict(choice)
    else:
        order, choice, why_order, why_caps = mine
    rank0 = host is None or host.rank == 0

    def whose(why: str | None) -> str:
        return f"{why}" if rank0 else f"on group rank 0, whose choice every rank takes: {why}"

    if order is None:  # group rank 0 could not: every rank buckets in the graph's order
        ready_order.graph_order(whose(why_order))
        sync.state.ready_failed = True
    elif mine[0] is None:
        log.warning(
            "ddp_fusion: this rank could not learn eager autograd's ready order (%s); it "
            "runs group rank 0's, as every rank of the group does", mine[2],
        )
    if sync.auto and choice is None:
        log.warning("ddp_fusion: bucket_cap_mb='auto' for model %d keeps DDP's default bucket "
                    "caps: %s", sync.model_id, whose(why_caps))
    elif sync.auto and mine[1] is None:
        log.warning("ddp_fusion: this rank could not choose bucket caps for bucket_cap_mb='auto' "
                    "(%s); it runs group rank 0's choice, as every rank of the group does", mine[3])
    if choice is not None:
        sync.limits[:] = choice.limits  # the hooks' and the eager reducer's limits
        sync.sizing = choice
        autocap.show(choice, sync.model_id, from_rank0=not rank0)
    if order is not None:
        position = [0] * len(sync.names)
        for rank, i in enumerate(order):
            position[i] = rank
        sync.state.ready_position = tuple(position)
    sync.state.ready_learned = True
    sync.retag()


def _learn_here(sync: GradSync, inputs: Any) -> tuple[list[int] | None, Any, str | None, str | None]:
    """This rank's ready order and (``auto``) choice of caps, each with why not where
    it could not make it. Never raises."""
    try:
        args, kwargs = inputs()
    except Exception as e:  # noqa: BLE001 - an argument Dynamo cannot give
        return None, None, f"forward arguments: {e}", f"forward arguments: {e}"
    order, choice, why_caps = None, None, None
    link = sync.link()
    if isinstance(link, str):
        why_caps = f"the link could not be measured: {link}"
    elif link is not None:
        sizes = [_torch.tensors.local_tensor(p.detach()).nbytes for _, p in sync.params]
        decided = autocap.decide(sync.module, sync.names, sizes, *link, args, kwargs)
        if isinstance(decided, str):
            why_caps = decided
        else:
            order, choice = decided
    if order is not None:
        return order, choice, None, why_caps
    learned = ready_order.learn(sync.module, sync.names, args, kwargs)
    if isinstance(learned, str):
        return None, choice, learned, why_caps
    return learned, choice, None, why_caps


def _model_id(names: list[str], group_name: str) -> int:
    """A model's id in its gradients' all-reduce tags: its parameters' names and group,
    hashed, and, if live models with the same names and group exist, which one of them
    it is (the first free number): the same in every process (ranks build their models
    in the same order) and for a re-created model, so graphs stay cacheable; two live
    models never share buckets or a comm hook."""
    key = "\0".join([group_name, *names])
    collected = False
    for k in itertools.count():
        model_id = zlib.crc32((key if k == 0 else f"{key}\0{k}").encode()) & 0x7FFFFFFF
        ref = _syncs.get(model_id)
        if ref is not None and ref() is not None and not collected:
            # a model released but not yet collected (a reference cycle) must not hold
            # its id on some ranks only: the ids, and what the model then takes from
            # the one before (_Learned), would differ between the ranks
            gc.collect()
            collected = True
        if ref is None or ref() is None:
            return model_id
    raise AssertionError("unreachable")


def not_copyable(who: str) -> TypeError:
    """What ``copy.deepcopy`` or ``pickle`` of a model reducing with ddp_fusion raises,
    in place of an error about whichever of its objects fails to pickle first. (torch
    DDP's copy builds a reducer of its own; ddp_fusion's construction is collective, so
    a copy made on some ranks only could not build one.)"""
    return TypeError(
        f"{who}: a model that reduces its gradients with ddp_fusion cannot be copied or "
        "pickled (its gradient hooks, process group and per-step checks are this "
        "model's). Copy or save what it wraps instead: copy.deepcopy(model.module) (for "
        "an EMA copy, say) or model.state_dict()"
    )


def _refuse_sparse_gradients(module: nn.Module, params: list[tuple[str, torch.Tensor]], who: str) -> None:
    """An embedding with ``sparse=True`` whose weight is reduced: its gradient is a sparse
    tensor, which no bucket holds (an uncompiled backward would fail in the hook, a
    compiled one on NCCL in the all-reduce): refused here, on every rank alike."""
    reduced = {id(p) for _, p in params}
    for name, mod in module.named_modules():
        if (isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse
                and id(mod.weight) in reduced):
            raise NotImplementedError(
                f"{who}: module {name or '(root)'!r} is an embedding with sparse=True; "
                "sparse gradients are not supported with ddp_fusion (use sparse=False, or "
                "turn ddp_fusion off for this model)"
            )


def _check_not_hooked(params: list[tuple[str, torch.Tensor]], who: str) -> None:
    for name, p in params:
        ref = _models.get(p)
        if ref is not None and ref() is not None:
            raise ValueError(
                f"{who}: parameter {name!r} already carries the gradient hooks of a live "
                f"ddp_fusion model ({type(ref()).__name__}); wrapping it again would reduce "
                "its gradient twice. Wrap the module once, or delete the other wrapper first"
            )


def _release(handles: list[Any], params: list[torch.Tensor], model_id: int,
             layout: unused.Layout | None, orders: dict, data: _HookData) -> None:
    """Undo a model's hooks once it is garbage (weakref.finalize)."""
    ref = _syncs.get(model_id)
    if ref is not None and ref() is None:  # (the id may already be a new model's)
        del _syncs[model_id]
    if _hook_data.get(model_id) is data:  # (it holds the reducer, and so the group)
        del _hook_data[model_id]
    if layout is not None:
        unused.unregister(model_id, layout)
    forget_element_orders(model_id, orders)
    forget_runs(model_id)
    for h in handles:
        h.remove()
    for p in params:
        ref = _models.get(p)
        if ref is not None and ref() is None:
            del _models[p]


@torch.no_grad()
def broadcast(tensors: list[torch.Tensor], group: dist.ProcessGroup, src: int = 0) -> None:
    """Every rank's ``tensors`` become group rank ``src``'s (DTensors: their local
    shards): one broadcast per (dtype, device), a functional collective, so it is
    traced into the graph under torch.compile (no graph break)."""
    if group.size() == 1 or not tensors:
        return
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        t = _torch.tensors.local_tensor(t)
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for same in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        flat = _torch.distributed.broadcast_traceable(flat, src, group)
        for t, part in zip(same, flat.split([t.numel() for t in same])):
            t.copy_(part.view_as(t))


# torch's DDP comm hooks that are a communication dtype on fused buckets
_HOOK_DTYPES = {"allreduce": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class GradSync:
    """The gradient machinery of one data-parallel model (module docstring).

    Args:
        model: the model object (the wrapper, or the adopted torch DDP); the hooks hold
            no reference to it or to this object, and are removed once it is garbage.
        module: the module whose parameters are reduced.
        params: ``(name, parameter)`` of the parameters to reduce, in module order.
        group: the data-parallel process group.
        limits: bucket byte limits (``plan.ddp_bucket_limits``); with ``auto``, the
            start (DDP's default), changed in place at the first compiled forward.
        comm_dtype: all-reduce in this dtype, or None.
        find_unused_parameters, gradient_as_bucket_view: torch DDP's arguments.
        who: the model's name in error messages.
        auto: ``bucket_cap_mb="auto"``: choose the limits for the link and the backward
            at the first compiled forward (autocap.py); the link is measured here.
        settings: more of the model's settings that decide its collectives (say,
            ``broadcast_buffers``), compared across the ranks with the others here.

    Construction is collective over ``group``: every rank's settings (the module's
    parameters, which of them are reduced, the bucket arguments) are compared first
    (settings_check.py), and raise on every rank if they differ.
    """

    def __init__(
        self,
        model: nn.Module,
        module: nn.Module,
        params: list[tuple[str, torch.Tensor]],
        group: dist.ProcessGroup,
        limits: list[int],
        comm_dtype: torch.dtype | None,
        find_unused_parameters: bool,
        who: str,
        gradient_as_bucket_view: bool = False,
        auto: bool = False,
        settings: dict[str, Any] | None = None,
    ) -> None:
        _torch.check_torch()
        effects.want(effects.IN_USE)  # under DDP_FUSION=1, the pass goes into its slot now
        for name, p in params:
            if p.device.type == "meta":
                raise ValueError(
                    f"{who}: parameter {name!r} is on the meta device (it has no data, so "
                    "there is nothing to reduce); materialize the module before wrapping it, "
                    "e.g. module.to_empty(device=...) and initialize its parameters"
                )
        _check_not_hooked(params, who)
        _refuse_sparse_gradients(module, params, who)
        _torch.distributed.ensure_group_name(group)
        if gradient_as_bucket_view:
            for name, p in params:
                if _torch.tensors.is_dtensor(p):
                    raise NotImplementedError(
                        f"{who}: gradient_as_bucket_view with DTensor parameter {name!r} is "
                        "not supported"
                    )
        self.who = who
        self.host = host_group.of(group)
        reduced = {n for n, _ in params}
        settings_check.check(self.host, who, "at construction", {
            # with each one's layout: its gradient's element order in a bucket (plan.py)
            "parameters": [[n, list(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad,
                            list(dims_in_memory(_torch.tensors.local_tensor(p.detach())))]
                           for n, p in module.named_parameters()],
            "parameters not reduced": [n for n, p in module.named_parameters()
                                       if p.requires_grad and n not in reduced],
            "bucket caps (bytes)": "auto" if auto else list(limits),
            "link (config.link)": config.link if auto else None,
            "comm_dtype": str(comm_dtype).removeprefix("torch.") if comm_dtype else None,
            "find_unused_parameters": find_unused_parameters,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "config.plan_check": config.plan_check if config.enabled else None,
            **(settings or {}),
        })
        if any(_torch.tensors.is_dtensor(p) for _, p in params):
            effects.want(effects.DTENSOR_CLONE)
        self.module = module
        self.names = [n for n, _ in params]
        self.params = params
        self.group = group
        self.device = _torch.tensors.local_tensor(params[0][1].detach()).device
        # the model's buffers to broadcast (None: broadcast_buffers off), for a joined
        # rank's shadow of the buffer broadcast (join.py); set by the model
        self.buffers_of: Any = lambda: None
        # whether the module had buffers DDP does not ignore when it was wrapped (set by
        # the model). As torch DDP (its modules_buffers), a model without any never
        # broadcasts buffers, and so its forward, traced, does not walk every module
        # for them: Dynamo would guard each module's buffers and submodules at every step
        self.wrapped_with_buffers = True
        # parameter names DDP was told to ignore (torch DDP's parameters_to_ignore)
        self.ignored: set[str] = set()
        # the module's parameters that did not require grad at construction: no hook,
        # so one switched on later would train unreduced (checked when a forward is traced)
        reduced_params = {id(p) for _, p in params}
        self.frozen = [(n, p) for n, p in module.named_parameters()
                       if not p.requires_grad and id(p) not in reduced_params]
        self.state = SyncState(comm_dtype)
        self.limits = limits
        self.auto = auto
        self.sizing: autocap.Choice | None = None  # what "auto" chose, and why
        # "auto": the link measured now, outside any compile, every rank together (or
        # why not); config.link, if set by the first compiled forward, wins
        self._measured_link = (autocap.measure_link(group, self.device, self.host)
                               if auto and config.link is None else None)
        if find_unused_parameters:
            # Eager DDP never rebuilds its buckets with this flag: they stay in reverse
            # parameter order (the eager reducer's order too); nothing to learn.
            self.state.ready_position = tuple(reversed(range(len(params))))
            self.state.ready_learned = True
        self.reducer = EagerReducer(
            params, group, limits, comm_dtype, find_unused_parameters, gradient_as_bucket_view
        )
        self.model_id = _model_id(self.names, group.group_name)
        _syncs[self.model_id] = weakref.ref(self)
        # find_unused_parameters: the buckets' layout, for the pass (every parameter,
        # used here or not: unused.py), and the no_sync() marks
        self.layout = (unused.register(self.model_id, params, list(reversed(range(len(params)))))
                       if find_unused_parameters else None)
        unsynced = self.layout.unsynced if self.layout is not None else None
        self.reducer.unsynced = unsynced
        self._take_learned(_learned.get(self.model_id))  # (before the hooks' tags are made)
        orders = register_element_orders(self.model_id, params)
        data = _hook_data[self.model_id] = _HookData(self.state, self.reducer, group.group_name, limits,
                                                     tuple(self.names), unsynced)
        data.params = tuple(p for _, p in params)
        self.data = data
        self.hooks = [_make_hook(self.model_id, i, tag) for i, tag in enumerate(self._set_tags())]
        self.handles = [p.register_post_accumulate_grad_hook(hook)
                        for (_, p), hook in zip(params, self.hooks)]
        self.callback = False
        """Whether the model reduces from one callback per backward (:meth:`use_callback`)
        rather than a hook per parameter."""
        self.hooked: tuple[int, ...] = ()
        """With the callback: the parameters whose hooks queue it (indices)."""
        self._hooked_by: tuple[int, ...] | None = None  # the ready order they were picked by
        me = weakref.ref(model)
        for _, p in params:
            _models[p] = me
        weakref.finalize(model, _release, self.handles, [p for _, p in params], self.model_id, self.layout,
                         orders, data)
        # The join prelude runs eagerly, outside a compiled forward (made here, not at
        # import: torch.compiler.disable imports Dynamo).
        self._join_prelude = torch.compiler.disable(join.prelude)
        self._raise_failed = torch.compiler.disable(_raise_failed)
        if log.isEnabledFor(logging.INFO):
            nbytes = sum(_torch.tensors.local_tensor(p.detach()).nbytes for _, p in params)
            log.info(
                "ddp_fusion: %s reduces %d parameters (%.2f MiB) over process group %r "
                "(%d ranks); bucket caps %s MiB; algorithm %s%s%s",
                who, len(params), nbytes / MiB, group.group_name, group.size(),
                [round(c / MiB, 3) for c in limits], config.algorithm,
                ", find_unused_parameters" if find_unused_parameters else "",
                f", comm dtype {comm_dtype}" if comm_dtype else "",
            )

    def _take_learned(self, learned: _Learned | None) -> None:
        """Take what the model that had this id before learned at its first compiled
        forward (:class:`_Learned`), if it had the same settings: what it runs with if
        Dynamo runs that model's traced forward for it (then its own first-forward work
        never runs; where it does run, :meth:`forget_learned` puts back its own state
        first, so every rank runs the same collective checks as for any new model)."""
        if learned is None or learned.settings != (self.layout is not None, self.auto):
            return
        if learned.ready_position is not None and len(learned.ready_position) != len(self.names):
            return  # (a hash collision)
        state = self.state
        state.inherited = (state.ready_learned, state.ready_position, state.ready_failed,
                           state.settings_checked, state.compiled, list(self.limits), self.sizing)
        state.ready_position, state.ready_failed = learned.ready_position, learned.ready_failed
        state.ready_learned = state.settings_checked = state.compiled = True
        if self.auto and learned.sizing is not None:
            self.limits[:] = learned.limits
            self.sizing = learned.sizing

    def forget_learned(self) -> None:
        """Put back what :meth:`_take_learned` replaced."""
        state = self.state
        (state.ready_learned, state.ready_position, state.ready_failed, state.settings_checked,
         state.compiled, limits, self.sizing) = state.inherited
        self.limits[:] = limits
        state.inherited = None
        self.retag()

    def retag(self) -> None:
        """Set each hook's tag again from the model's state (after the ready order is
        learned): the next backward's guards see the change and recompile it."""
        tags = self._set_tags()
        for hook, tag in zip(self.hooks, tags):
            hook.__closure__[hook.__code__.co_freevars.index("tag")].cell_contents = tag

    def _set_tags(self) -> list[str]:
        """Every parameter's tag, joined into the one string the callback reads."""
        tags = [_tag(self.model_id, i, name, self.state) for i, name in enumerate(self.names)]
        self.data.tags = "\n".join(tags)
        return tags

    def use_callback(self) -> None:
        """At the first compiled forward: reduce from one callback per backward instead of
        a hook per parameter.

        Compiled autograd traces every hook a backward runs into its graph, and Dynamo
        guards each of them at every backward (its code and what it reads): a hook per
        parameter costs ~2 µs per parameter a step, which a compiled step should pay per
        bucket. So a few parameters (:data:`CALLBACK_HOOKS`, :meth:`_callback_params`) keep
        a hook, and the first of them to fire in a backward queues the model's callback,
        which runs when the backward ends, after every gradient is accumulated, and
        makes each parameter's tagged all-reduce there (:func:`_traced_hook`). The pass
        still issues each bucket as soon as its last gradient is made, not where the
        callback runs (passes/__init__.py): the overlap is that of a hook per parameter.

        A parameter without a gradient in a backward whose other parameters have one is
        what ``find_unused_parameters`` is for (eager DDP raises without it): with the
        flag, the hook per parameter stays, since whether a kept ``.grad`` was made in
        this backward is what a parameter's own hook tells. Without it, the callback is
        lost only if every hooked parameter has no gradient on every rank while others
        have one (on some ranks only: ``PlanMismatchError`` as before).

        Called again once the ready order is learned (a first compiled forward without
        grad learns none), before any backward of it is compiled: the hooks move to the
        parameters that order puts first."""
        position = self.state.ready_position
        if self.layout is not None or (self.callback and position is self._hooked_by):
            return  # (an eager forward around compiled submodules comes here each step)
        self._hooked_by = position
        chosen = self._callback_params()
        if self.callback and chosen == self.hooked:
            return
        hook = _callback_hook(self.model_id)
        for h in self.handles:
            h.remove()
        for _, p in self.params:
            _torch.compiled_autograd.drop_empty_post_accumulate_grad_hooks(p)
        self.handles[:] = [self.params[i][1].register_post_accumulate_grad_hook(hook) for i in chosen]
        self.hooked = chosen
        self.callback = True

    def _callback_params(self) -> tuple[int, ...]:
        """Which parameters keep the hook that queues the callback: half of
        :data:`CALLBACK_HOOKS` the first in the learned ready order (the first gradients
        the fake backward made, so parameters that got one: a submodule the forward
        never calls cannot hold them all), the rest spread over the model in index
        order (a part used only in some steps); spread alone while no order is known."""
        n = len(self.params)
        k = min(n, CALLBACK_HOOKS)
        position = self.state.ready_position
        first = sorted(range(n), key=position.__getitem__)[:k // 2] if position is not None else []
        m = k - len(first)
        spread = (round(i * (n - 1) / max(m - 1, 1)) for i in range(m))
        return tuple(sorted({*first, *spread}))

    def link(self) -> tuple[autocap.Link, bool] | str | None:
        """For ``auto``: the link to plan for (``config.link`` if set, else the one
        measured at construction) and whether measured, or why there is none; None
        without ``auto``."""
        if not self.auto:
            return None
        if config.link is not None:
            return autocap.configured_link(config.link), False
        if self._measured_link is None:  # config.link was set at construction, then cleared
            return "config.link was cleared after the model was built"
        return self._measured_link if isinstance(self._measured_link, str) else (self._measured_link, True)

    def check_frozen(self) -> None:
        """Raise if a parameter that did not require grad at construction does now
        (unless ignored): it has no hook, so its gradient would not be reduced and the
        ranks' copies would drift apart (torch DDP's reducer, built at construction
        too, leaves it unreduced without a word). Run at the first forward and whenever
        Dynamo traces one (switching ``requires_grad`` fails a compiled forward's guards,
        so a compiled model is checked at the step that follows, at no cost per step),
        and at every forward of a model with no compiled code."""
        thawed = [n for n, p in self.frozen if p.requires_grad and n not in self.ignored]
        if thawed:
            more = f" and {len(thawed) - 3} more" if len(thawed) > 3 else ""
            raise RuntimeError(
                f"{self.who}: parameter(s) {', '.join(map(repr, thawed[:3]))}{more} did not require "
                "grad when the model was wrapped and do now: their gradients would not be "
                "all-reduced (the gradient hooks are registered at construction, as torch DDP's "
                "reducer is built then), and the ranks' copies would diverge. Wrap the module "
                "again after changing which parameters train."
            )

    def forward_settings(self, compiled: bool) -> dict[str, Any]:
        """What the ranks must agree on at the first forward (settings_check.py): what
        may have changed since construction and decides this model's collectives."""
        state = self.state
        return {
            "runs fused (compiled, with config.enabled)": compiled and config.enabled,
            "config.algorithm": config.algorithm if compiled and config.enabled else None,
            "config.plan_check": config.plan_check if compiled and config.enabled else None,
            "comm hook": state.comm_hook,
            "comm_dtype": str(state.comm_dtype).removeprefix("torch.") if state.comm_dtype else None,
            "link (config.link)": config.link if self.auto else None,
        }

    def before_forward(
        self,
        args: Any,
        kwargs: Any,
        buffers: list[torch.Tensor] | None,
        joinable: Any,
        sync_grads: bool | None,
    ) -> None:
        """At the start of each forward (eager or traced).

        Args:
            args, kwargs: the forward's inputs (for learning the ready order).
            buffers: the module buffers to broadcast from the group's rank 0 (None:
                ``broadcast_buffers`` off).
            joinable: the model, whose join context (if one is enabled) makes this
                forward run join.py's prelude, eagerly.
            sync_grads: the model's ``require_backward_grad_sync`` (``no_sync()``),
                which, as in torch DDP, decides at the forward whether this forward's
                backward reduces gradients (None: the model sets the state itself; the
                prelude latches it under join).
        """
        state = self.state
        state.forwarded = True
        if sync_grads is not None:
            state.require_backward_grad_sync = sync_grads
        traced = torch.compiler.is_compiling()
        if traced:
            _torch.dynamo.guard_requires_grad(p for _, p in self.frozen)
        _torch.dynamo.call_with_example_inputs(_on_forward, (self.model_id, traced), args, kwargs)
        if self.callback:  # (read after _on_forward, which may have just set it)
            self.data.queued = False  # (a backward that raised left it set)
        if state.failed is not None:
            # raised where the forward runs, not inside Dynamo's trace (where it would
            # reach the user wrapped in an InternalTorchDynamoError): compiled, reading
            # the field after the trace-time callback makes Dynamo break the graph here
            self._raise_failed(state)
        joining = _torch.distributed.join_enabled(joinable)
        if joining:
            self._join_prelude(self, joinable, buffers)
        # As eager DDP: sync buffers at a forward that follows a forward whose backward
        # reduces gradients (and at the first one). Only a model with buffers reads
        # these flags (a compiled forward guards on what it reads).
        elif buffers and state.forward_param_sync:
            broadcast(buffers, self.group)
        if buffers or joining:
            state.forward_param_sync = torch.is_grad_enabled() and state.require_backward_grad_sync

    # -- join.Joining ---------------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], src: int) -> None:
        broadcast(tensors, self.group, src)

    def shadow_uncompiled(self) -> None:
        self.reducer.shadow()

    def join_hook(self, **kwargs: Any) -> Any:
        """The joined rank's side of ``join()`` (join.py)."""
        return join.DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    # -- comm hooks -----------------------------------------------------------------
    def register_comm_hook(self, hook_state: object, hook: Any, who: str) -> None:
        """torch DDP's ``register_comm_hook``. torch's allreduce, fp16 and bf16
        compression hooks over the model's own group become the fused buckets'
        communication dtype (a cast in the graph); any other hook is called on each
        bucket (comm_hooks.py)."""
        if not callable(hook):
            raise TypeError(f"{who}.register_comm_hook: hook must be callable, got {hook!r}")
        name = getattr(hook, "__qualname__", None) or repr(hook)
        roles = {fn: role for role, fn in _torch.ddp.builtin_comm_hooks().items()}
        own_group = hook_state is self.group or (
            hook_state is None and self.group is dist.group.WORLD
        )
        if hook in roles and own_group:
            self._set_comm_dtype(_HOOK_DTYPES[roles[hook]], name, who)
            return
        self._claim_hook(name, who)
        if self.state.comm_dtype is not None:
            raise ValueError(
                f"{who}.register_comm_hook: the model was given comm_dtype "
                f"{self.state.comm_dtype}, and {name} reduces the buckets itself; give one "
                "(wrap the hook in torch's fp16_compress_wrapper / bf16_compress_wrapper "
                "to communicate in a lower precision)"
            )
        comm_hook = comm_hooks.CommHook(hook_state, hook, self.group, self.params, who)
        comm_hooks.register(self.model_id, comm_hook)  # weakly: the reducer holds it
        self.state.comm_hook = name
        self.state.reduce_op = HOOK
        self.reducer.set_comm_hook(comm_hook)

    def register_builtin_comm_hook(self, kind: Any, who: str) -> None:
        dtypes = {
            dist.BuiltinCommHookType.ALLREDUCE: None,
            dist.BuiltinCommHookType.FP16_COMPRESS: torch.float16,
        }
        if kind not in dtypes:
            raise NotImplementedError(f"{who}: builtin comm hook {kind} is not supported")
        self._set_comm_dtype(dtypes[kind], str(kind), who)

    def _set_comm_dtype(self, dtype: torch.dtype | None, name: str, who: str) -> None:
        self._claim_hook(name, who)
        state = self.state
        if state.comm_dtype is not None and dtype is not None and dtype != state.comm_dtype:
            raise ValueError(
                f"{who}: {name} reduces in {dtype} but the model was given comm_dtype "
                f"{state.comm_dtype}"
            )
        state.comm_hook = name
        if dtype is not None:
            state.comm_dtype = dtype
            self.reducer.set_comm_dtype(dtype)

    def _claim_hook(self, name: str, who: str) -> None:
        state = self.state
        if state.comm_hook is not None:
            raise RuntimeError(
                f"{who}: a comm hook ({state.comm_hook}) is already registered; torch DDP "
                "takes one comm hook per model"
            )
        if state.forwarded:
            raise RuntimeError(
                f"{who}: register the comm hook ({name}) before the model's first forward"
            )


def live_models() -> int:
    """How many ddp_fusion models (wrappers, adopted torch DDPs) are alive."""
    return sum(1 for ref in _syncs.values() if ref() is not None)
