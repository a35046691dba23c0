"""``ddp_fusion.DistributedDataParallel``: DDP as per-parameter hooks the compiler can see.

Eager torch DDP reduces gradients from a C++ reducer that compiled autograd cannot
trace, so under ``torch.compile`` it either breaks the graph at every bucket
(DDPOptimizer) or is swapped for upstream's Python reducer. In this wrapper each
parameter gets a post-accumulate-grad hook. Traced by compiled autograd, the hook calls
the tagged ``ddp_fusion::all_reduce_gradient`` op and makes the result the parameter's
``.grad``; the pass then buckets and fuses those ops as eager DDP would have (the
results become views of the reduced buckets). Run eagerly, the hook
hands the gradient to a Python bucketed reducer (reducer.py).

Comm hooks (``register_comm_hook``) run on the buckets (comm_hooks.py); torch's
allreduce / fp16 / bf16 compress hooks over the model's group are a communication dtype
instead. Not supported (yet): sparse gradients, ``static_graph``. DTensor parameters (tensor parallelism on
another mesh dimension) have their local shards reduced over the data-parallel group.
Under ``torch.compile``,
``find_unused_parameters`` covers parameters unused on every rank; one unused on some
ranks only makes the ranks' plans differ, which raises ``PlanMismatchError`` at that
step (see verify.py). At its first forward with ``config.enabled`` on, the wrapper
learns eager autograd's ready order from a fake-tensor run (ready_order.py), so the
pass buckets as eager DDP does. Parameters must all live on one kind of device per process,
as with torch DDP.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import weakref
import zlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.utils.weak import WeakIdKeyDictionary

from . import _install, _torch, comm_hooks, ready_order
from . import join as _join
from .config import config
from .ops import ALL_REDUCE_GRADIENT, REDUCE_OPS
from .passes.bucketing import ddp_bucket_limits
from .reducer import EagerReducer
from .verify import verify_params_across_ranks

__all__ = ["DistributedDataParallel", "all_reduce_gradient"]

log = logging.getLogger("ddp_fusion")


def all_reduce_gradient(
    grad: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    reduce_op: str = "avg",
    bucket_cap_mb: float | None = None,
    bucket_cap_mb_list: Sequence[float] | None = None,
    name: str = "",
    comm_dtype: torch.dtype | None = None,
    ready_order: int | None = None,
) -> torch.Tensor:
    """All-reduce one gradient over ``group`` (default: the world), tagged for fusion.

    ``reduce_op="avg"`` (the default, DDP's) divides by the group size before summing;
    ``"sum"`` only sums. The bucket arguments mean what they mean for
    :class:`torch.nn.parallel.DistributedDataParallel`; gradients reduced with the same
    group, dtype, device, reduce op and bucket arguments are bucketed together by the
    pass. ``name`` (a parameter's name, say) labels the gradient in dumps. With
    ``comm_dtype`` the gradient is cast to it, scaled, summed and cast back (torch's
    fp16/bf16 compress hooks, or an fp32 reduction of bf16 gradients). ``ready_order``
    (a gradient's position in the order eager autograd makes gradients ready, if you
    know it) makes the pass bucket in that order instead of the graph's, when every
    gradient of the graph has one. Returns a new tensor; ``grad`` is not modified.
    """
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"all_reduce_gradient: grad must be a Tensor, got {type(grad).__name__}")
    if reduce_op not in REDUCE_OPS:
        raise ValueError(
            f"all_reduce_gradient: reduce_op must be one of {REDUCE_OPS}, got {reduce_op!r}"
        )
    group = _default_group(group, "all_reduce_gradient")
    limits = ddp_bucket_limits(bucket_cap_mb, bucket_cap_mb_list)
    if ready_order is not None and (isinstance(ready_order, bool) or not isinstance(ready_order, int) or ready_order < 0):
        raise ValueError(
            f"all_reduce_gradient: ready_order must be a non-negative int or None, got {ready_order!r}"
        )
    ready = -1 if ready_order is None else ready_order
    return ALL_REDUCE_GRADIENT(grad, group.group_name, reduce_op, limits, name, comm_dtype, ready)


class _SyncState:
    """What the hooks read; kept off the module so hooks hold no reference to it."""

    def __init__(self, comm_dtype: torch.dtype | None) -> None:
        self.require_backward_grad_sync = True
        self.ready_learned = False
        # parameter index -> position in eager autograd's ready order (ready_order.py)
        self.ready_position: tuple[int, ...] | None = None
        self.comm_dtype = comm_dtype
        # eager DDP's require_forward_param_sync: sync buffers at the next forward
        self.forward_param_sync = True
        self.forwarded = False
        self.comm_hook: str | None = None  # the registered comm hook's name
        # "avg", or comm_hooks.HOOK: the model's comm hook reduces its buckets
        self.reduce_op = "avg"
        # join(divide_by_initial_world_size=...) of the current join context (join.py)
        self.join_divide_by_initial = True


def _make_hook(
    state: _SyncState,
    reducer: EagerReducer,
    index: int,
    group_name: str,
    limits: list[int],
    name: str,
    owner: int,
):
    def reduce_grad(param: torch.Tensor) -> None:
        if not state.require_backward_grad_sync or param.grad is None:
            return
        if torch.compiler.is_compiling():
            # Traced by compiled autograd: one tagged all-reduce, fused by the pass.
            # A DTensor gradient: reduce its local shard over the data-parallel group.
            grad = _torch.local_tensor(param.grad)
            ready = -1 if state.ready_position is None else state.ready_position[index]
            reduced = ALL_REDUCE_GRADIENT(
                grad, group_name, state.reduce_op, limits, name, state.comm_dtype, ready, owner
            )
            # The reduced gradient becomes .grad (fused: a view of its bucket's
            # buffer), rather than being copied into the old one: no copy back.
            param.grad = _torch.as_like(param.grad, reduced)
            return
        if config.enabled:
            _warn_not_compiled()
        reducer.grad_ready(index)

    return reduce_grad


def _warn_not_compiled() -> None:
    _torch.counters()["ddp_fusion"]["unfused: compiled autograd not active"] += 1
    if not _warned_not_compiled:
        _warned_not_compiled.append(True)
        log.warning(
            "ddp_fusion: config.enabled is on but a gradient hook ran outside compiled "
            "autograd (backward not compiled, or a graph break in it); its gradients are "
            "reduced one by one, unfused"
        )


_warned_not_compiled: list[bool] = []

# parameter -> weak reference to the live model (wrapper or adopted torch DDP) whose
# hooks it carries
_owners: WeakIdKeyDictionary = WeakIdKeyDictionary()
# GradSync key (an int, so traced code can name it) -> weak reference to it
_syncs: dict[int, weakref.ref] = {}
_keys = itertools.count()


def _learn_ready_order(key: int, inputs: Any) -> None:
    """Called at each eager forward, or once when Dynamo traces the forward: learn eager
    autograd's ready order the first time compiled autograd will need it, and take
    group rank 0's (eager DDP also rebuilds its buckets from rank 0's order)."""
    ref = _syncs.get(key)
    sync = ref() if ref is not None else None
    if sync is None or sync.state.ready_learned:
        return
    if not config.enabled or not torch.is_grad_enabled():
        return  # only compiled autograd needs it; the eager reducer watches its hooks
    try:
        args, kwargs = inputs()
    except Exception as e:  # noqa: BLE001 - an argument Dynamo cannot give
        ready_order.graph_order(f"forward arguments: {e}")
        order = None
    else:
        order = ready_order.learn(sync.module, sync.names, args, kwargs)
    order = _from_rank0(order, sync.group)
    state = sync.state
    if order is not None:
        position = [0] * len(sync.names)
        for rank, i in enumerate(order):
            position[i] = rank
        state.ready_position = tuple(position)
    state.ready_learned = True


def _from_rank0(value: Any, group: dist.ProcessGroup) -> Any:
    if group.size() == 1 or dist.get_backend(group) == "fake":
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
    return shared[0]


def _owner_id(names: list[str], group_name: str) -> int:
    """A model's id in its gradients' all-reduce tags: its parameters' names and group,
    hashed, and, if live models with the same names and group exist, which one of them
    it is (the first free number): the same in every process (ranks build their models
    in the same order) and for a re-created model, so graphs stay cacheable; two live
    models never share buckets or a comm hook."""
    key = "\0".join([group_name, *names])
    for k in itertools.count():
        owner = zlib.crc32((key if k == 0 else f"{key}\0{k}").encode()) & 0x7FFFFFFF
        ref = _live_owners.get(owner)
        if ref is None or ref() is None:
            return owner


# owner id -> weak reference to the live GradSync that has it
_live_owners: dict[int, weakref.ref] = {}


def _check_not_hooked(params: list[tuple[str, torch.Tensor]], who: str) -> None:
    for name, p in params:
        ref = _owners.get(p)
        if ref is not None and ref() is not None:
            raise ValueError(
                f"{who}: parameter {name!r} already carries the gradient hooks of a live "
                f"ddp_fusion model ({type(ref()).__name__}); wrapping it again would reduce "
                "its gradient twice. Wrap the module once, or delete the other wrapper first"
            )


def _release(handles: list[Any], params: list[torch.Tensor], key: int) -> None:
    """Undo a model's hooks once it is garbage (weakref.finalize)."""
    _syncs.pop(key, None)
    for h in handles:
        h.remove()
    for p in params:
        ref = _owners.get(p)
        if ref is not None and ref() is None:
            del _owners[p]


# torch's DDP comm hooks that are a communication dtype on fused buckets
_HOOK_DTYPES = {"allreduce": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class GradSync:
    """The gradient machinery of one data-parallel model, shared by
    :class:`DistributedDataParallel` and a torch DDP adopted under the flag (stock.py):
    one post-accumulate-grad hook per parameter (a tagged all-reduce when traced by
    compiled autograd, the eager bucketed reducer otherwise), the ready order learned
    at the first forward, buffer broadcast at each forward, comm-dtype hooks.

    ``owner`` is the model object; the hooks hold no reference to it or to this object
    and are removed once ``owner`` is garbage."""

    def __init__(
        self,
        owner: nn.Module,
        module: nn.Module,
        params: list[tuple[str, torch.Tensor]],
        group: dist.ProcessGroup,
        limits: list[int],
        comm_dtype: torch.dtype | None,
        find_unused_parameters: bool,
        who: str,
        gradient_as_bucket_view: bool = False,
    ) -> None:
        _check_not_hooked(params, who)
        _torch.ensure_group_name(group)
        if gradient_as_bucket_view:
            for name, p in params:
                if _torch.is_dtensor(p):
                    raise NotImplementedError(
                        f"{who}: gradient_as_bucket_view with DTensor parameter {name!r} is "
                        "not supported"
                    )
        if any(_torch.is_dtensor(p) for _, p in params):
            _install.need_dtensor_clone()
        self.module = module
        self.names = [n for n, _ in params]
        self.group = group
        self.group_size = group.size()
        self.device = _torch.local_tensor(params[0][1].detach()).device
        # the owner's buffers to broadcast (None: broadcast_buffers off), for a joined
        # rank's shadow of the buffer broadcast (join.py); set by the owner
        self.buffers_of: Any = lambda: None
        # parameter names DDP was told to ignore (torch DDP's parameters_to_ignore)
        self.ignored: set[str] = set()
        self.state = _SyncState(comm_dtype)
        self.key = next(_keys)
        if find_unused_parameters:
            # Eager DDP never rebuilds its buckets with this flag: they stay in reverse
            # parameter order (the eager reducer's order too); nothing to learn.
            self.state.ready_position = tuple(reversed(range(len(params))))
            self.state.ready_learned = True
        self.reducer = EagerReducer(
            params, group, limits, comm_dtype, find_unused_parameters, gradient_as_bucket_view
        )
        owner_id = self.owner_id = _owner_id(self.names, group.group_name)
        _live_owners[owner_id] = weakref.ref(self)
        self.params = params
        self.handles = [
            p.register_post_accumulate_grad_hook(
                _make_hook(self.state, self.reducer, i, group.group_name, limits, n, owner_id)
            )
            for i, (n, p) in enumerate(params)
        ]
        me = weakref.ref(owner)
        for _, p in params:
            _owners[p] = me
        _syncs[self.key] = weakref.ref(self)
        weakref.finalize(owner, _release, self.handles, [p for _, p in params], self.key)

    def before_forward(
        self,
        args: Any,
        kwargs: Any,
        buffers: list[torch.Tensor] | None,
        joinable: Any,
        sync_grads: bool | None,
    ) -> None:
        """At the start of each forward (eager or traced). ``buffers``: the module
        buffers to broadcast from the group's rank 0 (None: ``broadcast_buffers`` off).
        ``joinable``: the model, whose join context (if one is enabled) makes this
        forward run join.py's prelude, eagerly. ``sync_grads``: the model's
        ``require_backward_grad_sync`` (``no_sync()``), which, as in torch DDP, decides
        at the forward whether this forward's backward reduces gradients (None: the
        owner sets the state itself; the prelude latches it under join)."""
        state = self.state
        state.forwarded = True
        if sync_grads is not None:
            state.require_backward_grad_sync = sync_grads
        _torch.call_with_example_inputs(_learn_ready_order, self.key, args, kwargs)
        joining = _torch.join_enabled(joinable)
        if joining:
            _join.prelude(self, joinable, buffers)
        # As eager DDP: sync buffers at a forward that follows a forward whose backward
        # reduces gradients (and at the first one). Only a model with buffers reads
        # these flags (a compiled forward guards on what it reads).
        elif buffers and state.forward_param_sync and self.group_size > 1:
            _broadcast_buffers(buffers, self.group)
        if buffers or joining:
            state.forward_param_sync = torch.is_grad_enabled() and state.require_backward_grad_sync

    def join_hook(self, **kwargs: Any) -> Any:
        """The joined rank's side of ``join()`` (join.py)."""
        return _join.DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    def register_comm_hook(self, hook_state: object, hook: Any, who: str) -> None:
        """torch DDP's ``register_comm_hook``. torch's allreduce, fp16 and bf16
        compression hooks over the model's own group become the fused buckets'
        communication dtype (a cast in the graph); any other hook is called on each
        bucket (comm_hooks.py)."""
        if not callable(hook):
            raise TypeError(f"{who}.register_comm_hook: hook must be callable, got {hook!r}")
        name = getattr(hook, "__qualname__", None) or repr(hook)
        roles = {fn: role for role, fn in _torch.stock_ddp_comm_hooks().items()}
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
        comm_hooks.register(self.owner_id, comm_hook)  # weakly: the reducer holds it
        self.state.comm_hook = name
        self.state.reduce_op = comm_hooks.HOOK
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


@torch.no_grad()
def _broadcast_buffers(buffers: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Every rank's ``buffers`` become the group's rank 0's: one
    broadcast per (dtype, device), traceable (a functional collective in the forward
    graph under torch.compile)."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for b in buffers:
        by_kind.setdefault((b.dtype, b.device), []).append(_torch.local_tensor(b))
    for same in by_kind.values():
        flat = torch.cat([b.reshape(-1) for b in same])
        flat = _torch.broadcast_traceable(flat, 0, group)
        for b, part in zip(same, flat.split([b.numel() for b in same])):
            b.copy_(part.view_as(b))


class DistributedDataParallel(nn.Module, Joinable):
    """Drop-in for :class:`torch.nn.parallel.DistributedDataParallel`.

    Same meaning for ``process_group`` (or ``device_mesh``, a 1-D data-parallel
    sub-mesh), ``bucket_cap_mb``, ``bucket_cap_mb_list``, ``find_unused_parameters`` and
    ``broadcast_buffers``: with ``ddp_fusion.config.enabled`` and ``torch.compile``,
    gradients are reduced in the buckets eager DDP would build (after its
    first-iteration rebuild). Parameters and buffers are broadcast from the group's
    rank 0 at construction, and buffers again at each forward that follows a forward
    with gradient sync (``broadcast_buffers=True``, as torch DDP). ``.module`` is
    the wrapped module; ``no_sync()`` skips gradient reduction inside its block.
    Without ``torch.compile`` (or with the pass off) gradients go through an eager
    bucketed reducer with the same bucket limits, overlapping communication with the
    rest of backward. ``comm_dtype`` (alias ``reduce_dtype``) all-reduces gradients in
    that dtype and casts back, like torch's fp16/bf16 compress hooks.

    Compiled and fused, each reduced ``.grad`` is a view of its bucket's buffer (made
    afresh each step; nothing is copied back), whatever ``gradient_as_bucket_view``
    says. Uncompiled, ``gradient_as_bucket_view=True`` makes ``.grad`` views of the
    eager reducer's persistent buckets, as in torch DDP.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        bucket_cap_mb_list: Sequence[float] | None = None,
        *,
        device_mesh: Any = None,
        find_unused_parameters: bool = False,
        comm_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = False,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, (DistributedDataParallel, nn.parallel.DistributedDataParallel)):
            raise ValueError(
                f"module is already wrapped in {type(module).__module__}."
                f"{type(module).__name__}; wrap the inner module once"
            )
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup or None, "
                f"got {type(process_group).__name__}"
            )
        for arg, flag in (
            ("find_unused_parameters", find_unused_parameters),
            ("broadcast_buffers", broadcast_buffers),
            ("gradient_as_bucket_view", gradient_as_bucket_view),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{arg} must be True or False, got {flag!r}")
        for arg, value in (("comm_dtype", comm_dtype), ("reduce_dtype", reduce_dtype)):
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"{arg} must be a floating-point torch.dtype or None, got {value!r}")
        if comm_dtype is not None and reduce_dtype is not None and comm_dtype != reduce_dtype:
            raise ValueError(
                f"comm_dtype ({comm_dtype}) and reduce_dtype ({reduce_dtype}) name the same "
                "thing, the dtype gradients are all-reduced in; give one"
            )
        if device_mesh is not None:
            if process_group is not None:
                raise ValueError("give process_group or device_mesh, not both")
            if getattr(device_mesh, "ndim", None) != 1:
                raise ValueError(
                    "device_mesh must be the 1-D data-parallel sub-mesh (e.g. mesh['dp']), "
                    f"got {device_mesh!r}"
                )
            process_group = device_mesh.get_group()
        self.module = module
        self.process_group = _default_group(process_group, "DistributedDataParallel")
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.comm_dtype = comm_dtype or reduce_dtype
        self.bucket_cap_mb = bucket_cap_mb
        self.bucket_cap_mb_list = None if bucket_cap_mb_list is None else list(bucket_cap_mb_list)
        self.bucket_bytes_limits = ddp_bucket_limits(bucket_cap_mb, bucket_cap_mb_list)

        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not params:
            raise ValueError("DistributedDataParallel: module has no parameter that requires grad")
        for n, p in params:
            if p.layout != torch.strided or not (p.is_floating_point() or p.is_complex()):
                raise ValueError(
                    f"DistributedDataParallel: parameter {n!r} is {p.dtype} with layout "
                    f"{p.layout}; only dense floating-point parameters are supported"
                )
        devices = {p.device.type for _, p in params}
        if len(devices) > 1:
            raise ValueError(
                f"DistributedDataParallel: parameters span device types {sorted(devices)}; "
                "put the module on one device per process"
            )

        verify_params_across_ranks(list(module.named_parameters()), self.process_group)
        _broadcast_from_rank0(
            [_torch.local_tensor(t.detach()) for t in (*module.parameters(), *module.buffers())],
            self.process_group,
        )
        self._sync = GradSync(
            self,
            module,
            params,
            self.process_group,
            self.bucket_bytes_limits,
            self.comm_dtype,
            find_unused_parameters,
            "DistributedDataParallel",
            gradient_as_bucket_view,
        )
        # Hooks hold no reference to the wrapper; once it is garbage, they go with it,
        # and the bare module trains locally again.
        self._state = self._sync.state
        self.reducer = self._sync.reducer
        self._sync_requested = True
        self._params = params
        me_ = weakref.ref(self)
        self._sync.buffers_of = lambda: _wrapper_buffers(me_())

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag (``no_sync()`` clears it). Outside a join context it takes
        effect at the next backward (so toggling it recompiles no forward); inside an
        enabled one, at the next forward, as in torch DDP (join.py announces it there)."""
        return self._sync_requested

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync_requested = value
        if not _torch.join_enabled(self):
            self._state.require_backward_grad_sync = value

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._sync.before_forward(args, kwargs, _wrapper_buffers(self), self, None)
        return self.module(*args, **kwargs)

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """torch DDP's ``join()``: a context manager for ranks with different numbers
        of batches. A rank that runs out shadows the others' collectives (compiled or
        not) until all have; then every rank takes the last one's parameters.
        ``divide_by_initial_world_size=False`` averages over the ranks still training.
        Composes with other joinables through ``torch.distributed.algorithms.join.Join``
        (this model first)."""
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> Any:
        return self._sync.join_hook(**kwargs)

    @property
    def join_device(self) -> torch.device:
        return self._sync.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """torch DDP's ``register_comm_hook``: ``hook(state, bucket)`` reduces each fused
        bucket (torch's allreduce / fp16 / bf16 compress hooks over the model's group
        become its communication dtype instead); call it before the first forward."""
        self._sync.register_comm_hook(state, hook, "DistributedDataParallel")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside the block; the first
        backward after it reduces the accumulated gradients (see
        ``require_backward_grad_sync`` for when the flag takes effect)."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous


def _wrapper_buffers(wrapper: DistributedDataParallel | None) -> list[torch.Tensor] | None:
    if wrapper is None or not wrapper.broadcast_buffers:
        return None
    return list(wrapper.module.buffers())


def _default_group(group: dist.ProcessGroup | None, who: str) -> dist.ProcessGroup:
    if group is not None:
        return group
    if not dist.is_initialized():
        raise RuntimeError(
            f"{who}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() first or pass a process group"
        )
    return dist.group.WORLD


@torch.no_grad()
def _broadcast_from_rank0(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Make every rank's ``tensors`` equal to the group's rank 0's: one broadcast per
    (dtype, device)."""
    if group.size() == 1 or not tensors:
        return
    src = dist.get_global_rank(group, 0)
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        by_kind[(t.dtype, t.device)].append(t)
    for same in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.broadcast(flat, src=src, group=group)
        for t, part in zip(same, flat.split([t.numel() for t in same])):
            t.copy_(part.view_as(t))
