"""Stock ``torch.nn.parallel.DistributedDataParallel``: patching its constructor and
forward, taking its C++ reducer out of the gradients' path, its bucket defaults,
torch's own comm hooks, and the torch DDP that the composable ``replicate()`` builds."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Set as AbstractSet
from typing import Any

import torch
import torch.distributed as dist

from . import patching

REQUIRED = (
    "torch.distributed._DEFAULT_FIRST_BUCKET_BYTES",
    "torch.distributed._compute_bucket_assignment_by_size",
    "torch.distributed.Reducer",
    "torch.distributed.Logger",
    "torch.nn.parallel.DistributedDataParallel._pre_forward",
    "torch.nn.parallel.DistributedDataParallel._post_forward",
    "torch.nn.parallel.DistributedDataParallel._remove_autograd_hooks",
    "torch.nn.parallel.DistributedDataParallel._register_builtin_comm_hook",
    "torch.nn.parallel.DistributedDataParallel._get_active_ddp_module",
    "torch.nn.parallel.distributed._to_kwargs",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook",
    "torch.distributed._composable.replicate._ReplicateState.init",
)

#: Attributes of torch DDP instances this module reads or sets: set by torch DDP's
#: constructor (torch 2.13), which runs before any of these functions.
UNCHECKED = {
    "_use_python_reducer": "read with getattr and a default; set to take torch's "
                           "python-reducer forward path",
    "_param_list": "set by _ReplicateState.__init__ (torch 2.13); read with getattr and a "
                   "default (a replicate() DDP not recognised is adopted as a plain DDP)",
    "_param_names": "set by _ReplicateState.__init__ and filled before _ReplicateState.init "
                    "builds its DDP; checked to have one name per parameter",
}

#: DDP's default size of the first (latency-sensitive) bucket, in bytes.
DEFAULT_FIRST_BUCKET_BYTES: int = dist._DEFAULT_FIRST_BUCKET_BYTES

DDP = torch.nn.parallel.DistributedDataParallel


def compute_bucket_assignment_by_size(
    tensors: list[torch.Tensor], limits: list[int], tensor_indices: list[int]
) -> list[list[int]]:
    """Eager DDP's own C++ bucketing, used by tests as the reference for our planner."""
    indices, _ = dist._compute_bucket_assignment_by_size(
        tensors, limits, [False] * len(tensors), tensor_indices
    )
    return [list(b) for b in indices]


def patch_forward(patches: patching.Patches, check: Callable[[Any], None]) -> None:
    """Call ``check(ddp)`` at the start of every forward of a torch DDP that ddp_fusion
    did not adopt (see :func:`adopted_class`), and keep adopted ones away from
    DDPOptimizer, until ``patches`` is restored.

    Dynamo wraps the backend of every frame it compiles in DDPOptimizer while
    ``DistributedDataParallel._active_ddp_module`` is set. torch DDP's own forward sets
    it only on the C++-reducer path, which an adopted DDP does not take, but
    ``replicate()``'s forward pre-hook sets it itself before calling the DDP's
    ``_pre_forward``; so ``_get_active_ddp_module()``, which Dynamo reads, answers None
    for an adopted DDP."""

    def make_pre_forward(original: Callable[..., Any]) -> Callable[..., Any]:
        def _pre_forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
            check(self)
            return original(self, *inputs, **kwargs)

        return _pre_forward

    def make_active(original: classmethod) -> classmethod:
        def _get_active_ddp_module(cls: type) -> Any:
            active = original.__get__(None, cls)()
            return None if active is not None and is_adopted(active) else active

        return classmethod(_get_active_ddp_module)

    patches.wrap(patching.attribute(DDP, "_pre_forward"), make_pre_forward)
    patches.wrap(patching.attribute(DDP, "_get_active_ddp_module"), make_active)


def uses_cpp_reducer(ddp: Any) -> bool:
    """Whether a torch DDP reduces through its C++ reducer (which compiled autograd
    cannot trace) rather than upstream's python reducer (``optimize_ddp="python_reducer"``)."""
    return not getattr(ddp, "_use_python_reducer", False)


def patch_init(
    patches: patching.Patches,
    before: Callable[[dict[str, Any]], None],
    after: Callable[[Any, dict[str, Any]], None] | None = None,
    replicate: bool = True,
) -> None:
    """Around torch DDP's ``__init__`` (subclasses' ``super().__init__()`` included),
    until ``patches`` is restored: ``before(arguments)`` may refuse the arguments
    before torch's constructor runs; ``after(ddp, arguments)`` runs right after it.
    ``arguments`` maps every constructor argument's name to its value (defaults filled
    in). With ``replicate``, also around the composable ``replicate()``'s construction
    of its DDP, so that :func:`replicated_module` knows the module it replicates."""

    def make_init(original: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - replaces DDP's
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            arguments = dict(list(bound.arguments.items())[1:])
            before(arguments)
            original(self, *args, **kwargs)
            if after is not None:
                after(self, arguments)

        return __init__

    patches.wrap(patching.attribute(DDP, "__init__"), make_init)
    if not replicate:
        return
    from torch.distributed._composable.replicate import _ReplicateState

    def make_replicate_init(original: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(original)
        def replicate_init(self: Any, *args: Any, **kwargs: Any) -> None:
            _replicating.append(self)
            try:
                original(self, *args, **kwargs)
            finally:
                _replicating.pop()

        return replicate_init

    patches.wrap(patching.attribute(_ReplicateState, "init"), make_replicate_init)


# replicate() states whose DDP is being built (innermost last)
_replicating: list[Any] = []


def detach_cpp_reducer(ddp: Any) -> None:
    """Take a constructed torch DDP's C++ reducer out of its gradients' path: remove its
    autograd hooks (compiled autograd cannot run them) and take the forward path torch
    takes for its own python reducer (no reducer calls, no DDPOptimizer). Then replace
    it (and the logger, which holds it) by a reducer of one one-element placeholder:
    the C++ reducer holds a bucket buffer for every gradient (on a GPU, as much device
    memory as the gradients), which nothing would use any more. The logger gets the
    construction data torch DDP gave it (module name, device ids, broadcast_buffers,
    static_graph), so ``_get_ddp_logging_data()`` still answers; its parameter and
    bucket fields now describe the placeholder."""
    ddp._remove_autograd_hooks()
    ddp._use_python_reducer = True
    device = next((p.device for p in ddp.module.parameters()), torch.device("cpu"))
    placeholder = torch.nn.Parameter(torch.zeros(1, device=device))
    reducer = dist.Reducer(
        [placeholder], [[0]], [1], ddp.process_group, [False], 1, False, False,
        {0: "ddp_fusion.placeholder"}, 1,
    )
    logger = dist.Logger(reducer)
    reducer.set_logger(logger)  # weakly, as torch DDP does
    logger.set_construction_data_and_log(
        type(ddp.module).__name__,
        list(ddp.device_ids or []),
        -1 if ddp.output_device is None else ddp.output_device,
        forward_sync_buffers(ddp),
        any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.module.modules()),
        bool(getattr(ddp, "static_graph", False)),
    )
    ddp.reducer, ddp.logger = reducer, logger  # (the reducer keeps the placeholder)


def forward_sync_buffers(ddp: Any) -> bool:
    """Whether torch DDP broadcasts the module's buffers at each forward: its
    ``forward_sync_buffers`` from torch 2.13 (where ``broadcast_buffers`` is a deprecated
    property over it), ``broadcast_buffers`` before."""
    sync = getattr(ddp, "forward_sync_buffers", None)
    return bool(ddp.broadcast_buffers if sync is None else sync)


def module_ignored_names(module: torch.nn.Module) -> set[str]:
    """Parameter and buffer names a module was marked to have DDP ignore
    (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``), as torch
    DDP's constructor reads them: neither broadcast nor reduced."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def ignored_names(ddp: Any) -> AbstractSet[str]:
    """Parameter and buffer names DDP was told to ignore
    (``_set_params_and_buffers_to_ignore_for_model``): DDP's own set, not a copy (for
    membership tests; the forward reads it, and torch 2.11's Dynamo fails to trace
    ``set()`` of it)."""
    return ddp.parameters_to_ignore


def move_inputs(ddp: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What torch DDP's forward does with ``device_ids``: move inputs to that device."""
    if not ddp.device_ids:
        return inputs, kwargs
    from torch.nn.parallel.distributed import _to_kwargs

    moved, moved_kwargs = _to_kwargs(
        inputs,
        kwargs,
        torch.device(ddp.device_type, ddp.device_ids[0]),
        ddp.use_side_stream_for_tensor_copies,
    )
    return moved[0], moved_kwargs[0]


def replicated_module(ddp: Any) -> tuple[torch.nn.Module, list[str]] | None:
    """For the torch DDP that torch's composable ``replicate(module)`` builds (at the
    module's first forward, over an ``nn.ParameterList`` of the module's parameters):
    ``module`` and the names ``replicate()`` gives those parameters (``module``'s own
    names), in the order of the ParameterList's ``named_parameters()``. None for any
    other DDP. Call it from within the DDP's constructor (:func:`patch_init`'s
    ``after``)."""
    state = _replicating[-1] if _replicating else None
    if state is None or getattr(state, "_param_list", None) is not ddp.module:
        return None
    names = list(state._param_names)
    if len(names) != len(ddp.module) or len(set(names)) != len(names):
        return None
    # the ParameterList names its parameters "0", "1", ... and skips a repeat (a tied
    # parameter collected twice) as named_parameters() does
    return state.module, [names[int(n)] for n, _ in ddp.module.named_parameters()]


def has_buffer_comm_hook(ddp: Any) -> bool:
    return hasattr(ddp, "buffer_hook")


def builtin_comm_hooks() -> dict[str, Any]:
    """torch's own DDP comm hooks that ddp_fusion maps onto fused buckets, by role."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {
        "allreduce": default_hooks.allreduce_hook,
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook,
    }


class AdoptedBehaviour:
    """What an adopted torch DDP does instead of torch's reducer steps (stock.py)."""

    def pre_forward(self, ddp: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def register_comm_hook(self, ddp: Any, state: Any, hook: Any) -> None:
        raise NotImplementedError

    def register_builtin_comm_hook(self, ddp: Any, kind: Any) -> None:
        raise NotImplementedError

    def join_hook(self, ddp: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def reduce_ex(self, ddp: Any, protocol: int) -> Any:
        """``copy.deepcopy`` / ``pickle`` of the adopted model."""
        raise NotImplementedError


_adopted_classes: dict[tuple[type, int], type] = {}


def is_adopted(ddp: Any) -> bool:
    """Whether ``ddp``'s class is one that :func:`adopted_class` made."""
    return type(ddp) in _adopted_classes.values()


def adopted_class(base: type, behaviour: AdoptedBehaviour) -> type:
    """A subclass of ``base`` (torch DDP or a subclass of it, such as torchft's) whose
    reducer steps are ``behaviour``'s; a DDP instance is adopted by setting its
    ``__class__`` to it (as FSDP2's ``fully_shard`` does), so ``isinstance`` checks and
    the rest of torch DDP's behaviour stay. Same name as ``base``."""
    key = (base, id(behaviour))
    if key in _adopted_classes:
        return _adopted_classes[key]

    def _pre_forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        return behaviour.pre_forward(self, inputs, kwargs)

    def _post_forward(self: Any, output: Any) -> Any:
        return output

    def register_comm_hook(self: Any, state: object, hook: Callable) -> None:
        behaviour.register_comm_hook(self, state, hook)

    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        behaviour.register_builtin_comm_hook(self, comm_hook_type)

    def join_hook(self: Any, **kwargs: Any) -> Any:
        return behaviour.join_hook(self, **kwargs)

    def reduce_ex(self: Any, protocol: Any) -> Any:
        return behaviour.reduce_ex(self, protocol)

    cls = type(
        base.__name__,
        (base,),
        {
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
            "_pre_forward": _pre_forward,
            "_post_forward": _post_forward,
            "register_comm_hook": register_comm_hook,
            "_register_builtin_comm_hook": _register_builtin_comm_hook,
            "join_hook": join_hook,
            "__reduce_ex__": reduce_ex,
        },
    )
    _adopted_classes[key] = cls
    return cls
