"""``GradSync``: the gradient machinery of one data-parallel model.

Shared by the wrapper (wrapper.py) and a torch DDP adopted under the flag (stock.py).
Each parameter gets a post-accumulate-grad hook. Traced by compiled autograd, the hook
calls the tagged ``ddp_fusion::all_reduce_gradient`` op and makes the result the
parameter's ``.grad``; the pass then buckets and fuses those ops as eager DDP would
have (the results become views of the reduced buckets). Run eagerly, the hook hands the
gradient to the eager bucketed reducer (reducer.py).

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
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from . import _torch, autocap, comm_hooks, effects, join, ready_order
from .config import config
from .log import log
from .ops import ALL_REDUCE_GRADIENT, HOOK
from .plan import MiB
from .plan_check import has_peers
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


def _make_hook(
    state: SyncState,
    reducer: EagerReducer,
    index: int,
    group_name: str,
    limits: list[int],
    name: str,
    model_id: int,
):
    def reduce_grad(param: torch.Tensor) -> None:
        if not state.require_backward_grad_sync or param.grad is None:
            return
        if torch.compiler.is_compiling():
            # Traced by compiled autograd: one tagged all-reduce, fused by the pass.
            # A DTensor gradient: reduce its local shard over the data-parallel group.
            grad = _torch.tensors.local_tensor(param.grad)
            ready = -1 if state.ready_position is None else state.ready_position[index]
            reduced = ALL_REDUCE_GRADIENT(
                grad, group_name, state.reduce_op, limits, name, state.comm_dtype, ready, model_id
            )
            # The reduced gradient becomes .grad (fused: a view of its bucket's
            # buffer), rather than being copied into the old one: no copy back.
            param.grad = _torch.tensors.as_like(param.grad, reduced)
            return
        if config.enabled and (state.compiled or state.compiled_while_disabled or not state.forwarded):
            _warn_unfused(state)
        reducer.grad_ready(index)

    return reduce_grad


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
    if sync is None:
        return
    state = sync.state
    if not traced:
        if state.holds_compiled_code is None:
            state.holds_compiled_code = _torch.dynamo.holds_compiled_code(sync.module)
        if not state.holds_compiled_code:
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
    group rank 0's."""
    order, choice = None, None
    # every rank measures the link together, whatever else happens
    link = autocap.link_of(sync.group, sync.device) if sync.auto else None
    try:
        args, kwargs = inputs()
    except Exception as e:  # noqa: BLE001 - an argument Dynamo cannot give
        ready_order.graph_order(f"forward arguments: {e}")
    else:
        if link is not None:
            sizes = [_torch.tensors.local_tensor(p.detach()).nbytes for _, p in sync.params]
            decided = autocap.decide(sync.module, sync.names, sizes, *link, sync.model_id, args, kwargs)
            if decided is not None:
                order, choice = decided
        if order is None:
            order = ready_order.learn(sync.module, sync.names, args, kwargs)
    order, choice = _from_rank0((order, choice), sync.group)
    if choice is not None:
        sync.limits[:] = choice.limits  # the hooks' and the eager reducer's limits
        sync.sizing = choice
        not_rank0 = has_peers(sync.group) and dist.get_rank(sync.group) != 0
        autocap.show(choice, sync.model_id, from_rank0=not_rank0)
    state = sync.state
    if order is not None:
        position = [0] * len(sync.names)
        for rank, i in enumerate(order):
            position[i] = rank
        state.ready_position = tuple(position)
    state.ready_learned = True


def _from_rank0(value: Any, group: dist.ProcessGroup) -> Any:
    if not has_peers(group):
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
    return shared[0]


def _model_id(names: list[str], group_name: str) -> int:
    """A model's id in its gradients' all-reduce tags: its parameters' names and group,
    hashed, and, if live models with the same names and group exist, which one of them
    it is (the first free number): the same in every process (ranks build their models
    in the same order) and for a re-created model, so graphs stay cacheable; two live
    models never share buckets or a comm hook."""
    key = "\0".join([group_name, *names])
    for k in itertools.count():
        model_id = zlib.crc32((key if k == 0 else f"{key}\0{k}").encode()) & 0x7FFFFFFF
        ref = _syncs.get(model_id)
        if ref is None or ref() is None:
            return model_id
    raise AssertionError("unreachable")


def _check_not_hooked(params: list[tuple[str, torch.Tensor]], who: str) -> None:
    for name, p in params:
        ref = _models.get(p)
        if ref is not None and ref() is not None:
            raise ValueError(
                f"{who}: parameter {name!r} already carries the gradient hooks of a live "
                f"ddp_fusion model ({type(ref()).__name__}); wrapping it again would reduce "
                "its gradient twice. Wrap the module once, or delete the other wrapper first"
            )


def _release(handles: list[Any], params: list[torch.Tensor], model_id: int) -> None:
    """Undo a model's hooks once it is garbage (weakref.finalize)."""
    ref = _syncs.get(model_id)
    if ref is not None and ref() is None:  # (the id may already be a new model's)
        del _syncs[model_id]
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
            at the first compiled forward (autocap.py).
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
        _torch.distributed.ensure_group_name(group)
        if gradient_as_bucket_view:
            for name, p in params:
                if _torch.tensors.is_dtensor(p):
                    raise NotImplementedError(
                        f"{who}: gradient_as_bucket_view with DTensor parameter {name!r} is "
                        "not supported"
                    )
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
        # parameter names DDP was told to ignore (torch DDP's parameters_to_ignore)
        self.ignored: set[str] = set()
        self.state = SyncState(comm_dtype)
        self.limits = limits
        self.auto = auto
        self.sizing: autocap.Choice | None = None  # what "auto" chose, and why
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
        self.handles = [
            p.register_post_accumulate_grad_hook(
                _make_hook(self.state, self.reducer, i, group.group_name, limits, n, self.model_id)
            )
            for i, (n, p) in enumerate(params)
        ]
        me = weakref.ref(model)
        for _, p in params:
            _models[p] = me
        weakref.finalize(model, _release, self.handles, [p for _, p in params], self.model_id)
        # The join prelude runs eagerly, outside a compiled forward (made here, not at
        # import: torch.compiler.disable imports Dynamo).
        self._join_prelude = torch.compiler.disable(join.prelude)
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
        _torch.dynamo.call_with_example_inputs(_on_forward, (self.model_id, traced), args, kwargs)
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
