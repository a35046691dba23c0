"""Stock ``torch.nn.parallel.DistributedDataParallel`` under the flag.

Lightning, Accelerate and most torchrun scripts build torch's own DDP. While
``config.enabled`` is on, every torch DDP constructed is *adopted* right after torch's
constructor has run (its checks, the parameter broadcast, its C++ reducer):

* the C++ reducer is taken out of the gradients' path (its autograd hooks removed;
  compiled autograd cannot run them) and forward takes the path torch takes for its
  own python reducer, so DDPOptimizer never splits the graph;
* the parameters get ddp_fusion's per-parameter hooks (``grad_sync.GradSync``), with this
  DDP's process group, ``bucket_cap_mb`` / ``bucket_cap_mb_list`` (or
  ``config.bucket_cap_mb``, ``"auto"`` or a number, where set) and
  ``find_unused_parameters``; the pass fuses them as it fuses the wrapper's;
* each forward does what eager DDP's does around the module: move inputs to
  ``device_ids``, read ``require_backward_grad_sync`` (``no_sync()``; decided at
  forward, as eager DDP), learn the ready order once, broadcast buffers
  (``broadcast_buffers``);
* ``register_comm_hook`` maps torch's allreduce / fp16 / bf16 compress hooks over the
  model's group onto the fused buckets' communication dtype, and calls any other hook
  on each bucket (comm_hooks.py); ``join()`` shadows the fused buckets (join.py);
* torch's C++ reducer is replaced by a placeholder (it held a bucket buffer for every
  gradient, ``_torch.ddp.detach_cpp_reducer``).

torch's composable ``replicate(module)`` builds a torch DDP over an ``nn.ParameterList``
of ``module``'s parameters at the module's first forward, and calls that DDP's
``_pre_forward`` / ``_post_forward`` from forward hooks on ``module``. Adopted the same
way, its parameters carry ``module``'s names and the ready order is learned on
``module`` (``_torch.ddp.replicated_module``); replicate's hook marks the DDP active for
DDPOptimizer, which an adopted DDP is hidden from (``_torch.ddp.patch_forward``). As
with eager ``replicate()``, no buffers are broadcast (the DDP's module, the
ParameterList, holds none).

The instance's class becomes a subclass of its own (same name; ``isinstance`` holds),
whose few overrides are in ``_torch.ddp.adopted_class``. A DDP adopted stays adopted
when the flag goes off (its hooks then go through the eager bucketed reducer). A torch
DDP constructed while the flag was off keeps torch's C++ reducer; its forward with the
flag on raises (``_install._refuse_cpp_reducer``).
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from . import _torch, ready_order
from .autocap import AUTO
from .config import config
from .grad_sync import GradSync, not_copyable
from .log import log
from .plan import ddp_bucket_limits

WHO = "torch.nn.parallel.DistributedDataParallel (ddp_fusion)"


def refuse_arguments(arguments: dict[str, Any]) -> None:
    """Before torch's constructor: what ddp_fusion cannot honour, refused by name."""
    # bad bucket sizes get ddp_fusion's message naming the argument (torch's own check
    # fails on some, e.g. NaN, with "cannot convert float NaN to integer")
    ddp_bucket_limits(arguments.get("bucket_cap_mb"), arguments.get("bucket_cap_mb_list"))
    if _torch.dynamo.optimize_ddp_mode() == "python_reducer":
        raise ValueError(
            "torch._dynamo.config.optimize_ddp is 'python_reducer' (upstream's compiled "
            "DDP) and ddp_fusion.config.enabled is on: both would reduce this model's "
            "gradients. ddp_fusion replaces the python reducer; leave optimize_ddp at its "
            "default"
        )
    for name in ("mixed_precision", "delay_all_reduce_named_params", "param_to_hook_all_reduce"):
        if arguments.get(name) is not None:
            raise NotImplementedError(
                f"{WHO}: {name} is not supported with ddp_fusion.config.enabled; turn the "
                "flag off before wrapping this model to use torch's eager reducer"
            )
    if arguments.get("skip_all_reduce_unused_params"):
        raise NotImplementedError(
            f"{WHO}: skip_all_reduce_unused_params is not supported with "
            "ddp_fusion.config.enabled"
        )


def adopt(ddp: nn.parallel.DistributedDataParallel, arguments: dict[str, Any]) -> None:
    """Right after torch's constructor: reduce ``ddp``'s gradients with ddp_fusion."""
    ignored = set(_torch.ddp.ignored_names(ddp))  # fixed with the parameters it filters
    module = ddp.module
    params = [
        (n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignored
    ]
    replicated = _torch.ddp.replicated_module(ddp)
    if replicated is not None:
        # replicate()'s DDP wraps a ParameterList of the module's parameters, which
        # cannot be called: the ready order is learned on the module itself, and the
        # parameters carry the module's names (in the logs, the dumps, the model id)
        module, names = replicated
        name_of = dict(zip((n for n, _ in ddp.module.named_parameters()), names))
        params = [(name_of[n], p) for n, p in params]
    if not params:
        return  # torch DDP has already refused this; nothing to reduce
    find_unused = bool(arguments.get("find_unused_parameters"))
    cap = config.bucket_cap_mb  # None, "auto", or a number of MiB: instead of this DDP's own
    auto = cap == AUTO
    if auto and find_unused:
        log.warning(
            "ddp_fusion: config.bucket_cap_mb='auto' does not plan for a DDP with "
            "find_unused_parameters=True (its buckets keep the parameters' reverse order); "
            "this one keeps its own bucket caps"
        )
        auto = False
    if auto:
        limits = ddp_bucket_limits()  # DDP's default until the first compiled forward chooses
    elif cap is not None and cap != AUTO:
        limits = ddp_bucket_limits(cap)
    else:
        limits = ddp_bucket_limits(arguments.get("bucket_cap_mb"), arguments.get("bucket_cap_mb_list"))
    sync = GradSync(
        ddp,
        module,
        params,
        ddp.process_group,
        limits,
        None,
        find_unused,
        WHO,
        bool(arguments.get("gradient_as_bucket_view")),
        auto,
        {"broadcast_buffers": _torch.ddp.forward_sync_buffers(ddp)},
    )
    _torch.ddp.detach_cpp_reducer(ddp)
    ddp._ddp_fusion = sync
    me = weakref.ref(ddp)
    sync.buffers_of = lambda: _buffers(me())
    sync.wrapped_with_buffers = any(n not in ignored for n, _ in ddp.module.named_buffers())
    sync.ignored = ignored
    ddp.__class__ = _torch.ddp.adopted_class(type(ddp), _BEHAVIOUR)


def adopted(ddp: Any) -> GradSync | None:
    return getattr(ddp, "_ddp_fusion", None)


class _Behaviour(_torch.ddp.AdoptedBehaviour):
    def pre_forward(self, ddp: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if ready_order.running():
            # replicate()'s module calls its DDP's _pre_forward from a forward pre-hook,
            # so the fake run that learns the ready order on that module calls it again:
            # nothing to do there (no broadcast of fake buffers, no second learning)
            return inputs, kwargs
        if _torch.ddp.has_buffer_comm_hook(ddp):
            raise NotImplementedError(
                f"{WHO}: register_buffer_comm_hook is not supported with ddp_fusion"
            )
        inputs, kwargs = _torch.ddp.move_inputs(ddp, inputs, kwargs)
        sync: GradSync = ddp._ddp_fusion
        sync.before_forward(inputs, kwargs, _buffers(ddp), ddp, ddp.require_backward_grad_sync)
        return inputs, kwargs

    def register_comm_hook(self, ddp: Any, state: Any, hook: Any) -> None:
        ddp._ddp_fusion.register_comm_hook(state, hook, WHO)

    def register_builtin_comm_hook(self, ddp: Any, kind: Any) -> None:
        ddp._ddp_fusion.register_builtin_comm_hook(kind, WHO)

    def join_hook(self, ddp: Any, **kwargs: Any) -> Any:
        return ddp._ddp_fusion.join_hook(**kwargs)

    def reduce_ex(self, ddp: Any, protocol: int) -> Any:
        raise not_copyable(WHO)


def _buffers(ddp: Any) -> list | None:
    """The buffers torch DDP broadcasts at a forward (None: broadcast_buffers off, or no
    buffers when adopted: ``GradSync.wrapped_with_buffers``)."""
    if ddp is None or not _torch.ddp.forward_sync_buffers(ddp) or not ddp._ddp_fusion.wrapped_with_buffers:
        return None
    ignored = _torch.ddp.ignored_names(ddp)
    return [b for n, b in ddp.module.named_buffers() if n not in ignored]


_BEHAVIOUR = _Behaviour()

__all__ = ["adopt", "adopted", "refuse_arguments"]
