"""``ddp_fusion.DistributedDataParallel``: a drop-in for torch DDP whose gradient
reduction the compiler can see (grad_sync.py).

Comm hooks (``register_comm_hook``) run on the buckets (comm_hooks.py); torch's
allreduce / fp16 / bf16 compress hooks over the model's group are a communication dtype
instead. Not supported (yet): sparse gradients (refused), ``static_graph``. DTensor parameters
(tensor parallelism on another mesh dimension) have their local shards reduced over the
data-parallel group. Under ``torch.compile``, ``find_unused_parameters`` covers
parameters unused on some ranks only, as eager DDP does (unused.py); without it, such a
parameter makes the ranks' plans differ, which raises ``PlanMismatchError`` at that step
(plan_check.py). Parameters must all live on one kind of device per process, as with
torch DDP.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from . import _torch
from .autocap import AUTO
from .config import check_env
from .grad_sync import GradSync, broadcast, not_copyable
from .ops import default_group
from .plan import ddp_bucket_limits

__all__ = ["DistributedDataParallel"]


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
    Parameters and buffers named by torch DDP's
    ``_set_params_and_buffers_to_ignore_for_model`` are neither broadcast nor reduced.
    Without ``torch.compile`` (or with the pass off) gradients go through an eager
    bucketed reducer with the same bucket limits, overlapping communication with the
    rest of backward. ``comm_dtype`` (alias ``reduce_dtype``) all-reduces gradients in
    that dtype and casts back, like torch's fp16/bf16 compress hooks.

    Compiled and fused, a new ``.grad`` is a view of its bucket's buffer (nothing is
    copied back), whatever ``gradient_as_bucket_view`` says; a ``.grad`` that exists
    before the backward stays the same tensor, and its bucket is reduced in place in
    the ``.grad``s (after a first step with no ``.grad``, one buffer per bucket).
    Uncompiled, ``gradient_as_bucket_view=True`` makes ``.grad`` views of the eager
    reducer's persistent buckets, as in torch DDP.

    ``bucket_cap_mb="auto"`` chooses the bucket limits for the link and the backward at
    the first compiled forward (autocap.py); the choice is in ``.bucket_sizing``.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | str | None = None,
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
        check_env()  # a DDP_FUSION* value ignored at import raises here
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
        self.process_group = default_group(process_group, "DistributedDataParallel")
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.comm_dtype = comm_dtype or reduce_dtype
        self.bucket_cap_mb = bucket_cap_mb
        self.bucket_cap_mb_list = None if bucket_cap_mb_list is None else list(bucket_cap_mb_list)
        auto = bucket_cap_mb == AUTO
        if auto and bucket_cap_mb_list is not None:
            raise ValueError("give bucket_cap_mb='auto' or bucket_cap_mb_list, not both")
        if auto and find_unused_parameters:
            raise ValueError(
                "bucket_cap_mb='auto' with find_unused_parameters=True is not supported (its "
                "buckets keep the parameters' reverse order, for which 'auto' does not plan)"
            )
        # with "auto": DDP's default until the first compiled forward chooses (autocap.py)
        self.bucket_bytes_limits = ddp_bucket_limits(None if auto else bucket_cap_mb, bucket_cap_mb_list)

        # as torch DDP: names marked by _set_params_and_buffers_to_ignore_for_model are
        # neither broadcast nor reduced (each rank keeps its own)
        self.parameters_to_ignore = _torch.ddp.module_ignored_names(module)
        ignored = self.parameters_to_ignore
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignored]
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

        # collective: the ranks' parameters and settings are compared first (and raise on
        # every rank if they differ), then rank 0's parameters and buffers are broadcast
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
            auto,
            {"broadcast_buffers": broadcast_buffers},
        )
        self._sync.ignored = ignored
        named = (*module.named_parameters(), *module.named_buffers())
        broadcast([t.detach() for n, t in named if n not in ignored], self.process_group)
        # Hooks hold no reference to the wrapper; once it is garbage, they go with it,
        # and the bare module trains locally again.
        self._state = self._sync.state
        self.reducer = self._sync.reducer
        self._sync_requested = True
        self._params = params
        me_ = weakref.ref(self)
        self._sync.buffers_of = lambda: _wrapper_buffers(me_())
        self._sync.wrapped_with_buffers = any(n not in ignored for n, _ in module.named_buffers())

    @property
    def bucket_sizing(self) -> Any:
        """With ``bucket_cap_mb="auto"``: what was chosen and why (an ``autocap.Choice``),
        once the first compiled forward has run; else None."""
        return self._sync.sizing

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag (``no_sync()`` clears it). Outside a join context it takes
        effect at the next backward (so toggling it recompiles no forward); inside an
        enabled one, at the next forward, as in torch DDP (join.py announces it there)."""
        return self._sync_requested

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync_requested = value
        if not _torch.distributed.join_enabled(self):
            self._state.require_backward_grad_sync = value

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._sync.before_forward(args, kwargs, _wrapper_buffers(self), self, None)
        return self.module(*args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise not_copyable("DistributedDataParallel")

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
    """The buffers the model broadcasts at a forward (None: it does not; see
    ``GradSync.wrapped_with_buffers``)."""
    if wrapper is None or not wrapper.broadcast_buffers or not wrapper._sync.wrapped_with_buffers:
        return None
    if wrapper.parameters_to_ignore:
        return [b for n, b in wrapper.module.named_buffers() if n not in wrapper.parameters_to_ignore]
    return list(wrapper.module.buffers())
