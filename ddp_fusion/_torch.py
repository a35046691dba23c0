"""The one place where ddp_fusion touches private torch APIs.

Everything here is underscore-prefixed upstream and has moved between releases. A torch
upgrade that breaks ddp_fusion should break in this file only, and at import: every
internal it reaches is listed in ``_REQUIRED`` and checked by ``check_torch()``. Tested:
torch 2.13 (``TESTED_TORCH``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

c10d_functional = torch.ops._c10d_functional

#: Tags for ddp_fusion's ops: they talk to other ranks (and read values on the host),
#: so a CUDA graph must never capture them; Inductor splits graphs around such ops.
CUDAGRAPH_UNSAFE: tuple[Any, ...] = (
    (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
)

#: DDP's default size of the first (latency-sensitive) bucket, in bytes.
DEFAULT_FIRST_BUCKET_BYTES: int = dist._DEFAULT_FIRST_BUCKET_BYTES


def counters() -> dict[str, Any]:
    """``torch._dynamo.utils.counters``: a ``defaultdict(Counter)`` shared with Dynamo."""
    from torch._dynamo.utils import counters as _counters

    return _counters


def resolve_process_group(group_name: str) -> dist.ProcessGroup | None:
    """The process group registered under ``group_name`` in this process, or None."""
    try:
        return torch._C._distributed_c10d._resolve_process_group(group_name)
    except (RuntimeError, ValueError):
        return None


def register_process_group(name: str, group: dist.ProcessGroup) -> None:
    """Name ``group`` ``name`` and make it resolvable by that name (functional
    collectives name groups)."""
    group._set_group_name(name)
    torch._C._distributed_c10d._register_process_group(name, group)


def ensure_group_name(group: dist.ProcessGroup) -> str:
    """``group``'s name, as functional collectives (and ddp_fusion's graphs) name groups.
    A group made outside ``torch.distributed.new_group`` may have none (torchft's
    ``ProcessGroupDummy``, which its DDP is built on): it gets one, and is registered
    under it."""
    try:
        return group.group_name
    except (RuntimeError, ValueError):  # "ProcessGroup name not set"
        # numbered in the order they are met: the same on every rank, which build their
        # models in the same order (the name is part of the bucket plan the ranks check)
        while True:
            name = f"ddp_fusion_unnamed_{next(_unnamed)}"
            if resolve_process_group(name) is None:
                break
        register_process_group(name, group)
        return name


_unnamed = itertools.count()


def is_future(x: Any) -> bool:
    """A ``torch.futures.Future``, or the C++ future that its ``then`` returns."""
    return isinstance(x, torch._C.Future)


def group_timeout(group: dist.ProcessGroup) -> Any:
    """The timeout (a ``datetime.timedelta``) of ``group``'s backend, or torch's default
    for a group that does not say (a Python process group)."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - no backend for that device, or no options
            continue
    return dist.default_pg_timeout


def compute_bucket_assignment_by_size(
    tensors: list[torch.Tensor], limits: list[int], tensor_indices: list[int]
) -> list[list[int]]:
    """Eager DDP's own C++ bucketing, used by tests as the reference for our planner."""
    indices, _ = dist._compute_bucket_assignment_by_size(
        tensors, limits, [False] * len(tensors), tensor_indices
    )
    return [list(b) for b in indices]


def detect_fake_mode(values: Any) -> Any:
    from torch._guards import detect_fake_mode as _detect

    return _detect(values)


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Re-sort ``graph`` so every node follows its inputs, moving as few nodes as
    possible (nodes that are already in order keep it)."""
    from torch._inductor.pattern_matcher import stable_topological_sort as _sort

    _sort(graph)


class CompiledAutogradHandle:
    """Compiled autograd switched on by :func:`install_compiled_autograd`, restorable."""

    def __init__(self, compiler_fn: Callable[..., Any]) -> None:
        import functools

        from torch._dynamo import compiled_autograd

        self._ca = compiled_autograd
        # What torch's own `_enable` context installs, kept so we can tell it is ours.
        self.factory = functools.partial(compiled_autograd.AutogradCompilerInstance, compiler_fn)
        self.prior = self._set(self.factory, True)
        self.prior_multithreading = torch._C._is_multithreading_enabled()
        torch._C._set_multithreading_enabled(False)  # as torch's `_enable` does
        compiled_autograd.compiled_autograd_enabled = True

    def _set(self, factory: Any, dynamic: bool) -> tuple[Any, bool]:
        return torch._C._dynamo.compiled_autograd.set_autograd_compiler(factory, dynamic)

    def current(self) -> Any:
        """The compiler factory compiled autograd uses now (None: off)."""
        current = self._set(None, False)
        self._set(*current)
        return current[0]

    def restore(self) -> None:
        """Put back what was there before. Refused (``RuntimeError``) while a compiled
        autograd context opened later is still open: torch would put ddp_fusion's
        compiler back when that context closes."""
        current = self.current()
        if current is not self.factory and current is not None:
            raise RuntimeError(
                "ddp_fusion.config.enabled = False: a compiled-autograd context opened after "
                "ddp_fusion was enabled is still open (torch would restore ddp_fusion's "
                "compiler when it closes); turn ddp_fusion off after leaving that context"
            )
        if current is self.factory:
            self._set(*self.prior)
            self._ca.compiled_autograd_enabled = bool(self.prior[0])
        else:  # None: torch._dynamo.reset() switched it off meanwhile
            self._ca.compiled_autograd_enabled = False
        torch._C._set_multithreading_enabled(self.prior_multithreading)


def install_compiled_autograd(compiler_fn: Callable[..., Any]) -> CompiledAutogradHandle:
    """Compiled autograd on for every ``backward()`` in the process until the handle's
    ``restore()``. Unlike torch's ``_enable`` context, it need not be closed in LIFO
    order with contexts the user opened before it. (If ``torch._dynamo.reset()``
    switched it off meanwhile, ``restore`` leaves it off.)"""
    return CompiledAutogradHandle(compiler_fn)


def inductor_backend(
    mode: str | None, options: dict[str, Any] | None, dynamic: bool | None,
    extra_patches: Callable[[torch.fx.GraphModule], dict[str, Any]],
) -> Any:
    """The backend ``torch.compile(backend="inductor", mode=, options=, dynamic=)`` uses,
    plus ``extra_patches(graph)``: Inductor config patches chosen per Dynamo graph."""
    from torch import _TorchCompileInductorWrapper

    class Backend(_TorchCompileInductorWrapper):
        def __call__(self, model_: Any, inputs_: Any, *, config_patches: Any = None) -> Any:
            patches = {**(config_patches or {}), **extra_patches(model_)}
            return super().__call__(model_, inputs_, config_patches=patches)

    return Backend(mode, options, dynamic)


def patch_stock_ddp_forward(check: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``check(ddp)`` at the start of every forward of a
    ``torch.nn.parallel.DistributedDataParallel`` that ddp_fusion did not adopt (see
    :func:`adopted_ddp_class`). Returns the function that undoes it."""
    cls = torch.nn.parallel.DistributedDataParallel
    original = cls._pre_forward

    def _pre_forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        check(self)
        return original(self, *inputs, **kwargs)

    cls._pre_forward = _pre_forward

    def undo() -> None:
        if cls._pre_forward is _pre_forward:
            cls._pre_forward = original

    return undo


def stock_ddp_uses_cpp_reducer(ddp: Any) -> bool:
    """Whether a torch DDP reduces through its C++ reducer (which compiled autograd
    cannot trace) rather than upstream's python reducer (``optimize_ddp="python_reducer"``)."""
    return not getattr(ddp, "_use_python_reducer", False)


# -- stock torch DDP, adopted by ddp_fusion (stock.py) ---------------------------------


def patch_stock_ddp_init(
    before: Callable[[dict[str, Any]], None], after: Callable[[Any, dict[str, Any]], None]
) -> Callable[[], None]:
    """Around ``torch.nn.parallel.DistributedDataParallel.__init__`` (subclasses'
    ``super().__init__()`` included): ``before(arguments)`` may refuse the arguments
    before torch's constructor runs; ``after(ddp, arguments)`` runs right after it.
    ``arguments`` maps every constructor argument's name to its value (defaults
    filled in). Returns the function that undoes it."""
    import functools
    import inspect

    cls = torch.nn.parallel.DistributedDataParallel
    original = cls.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(list(bound.arguments.items())[1:])
        before(arguments)
        original(self, *args, **kwargs)
        after(self, arguments)

    cls.__init__ = __init__

    def undo() -> None:
        if cls.__init__ is __init__:
            cls.__init__ = original

    return undo


def dynamo_optimize_ddp_mode() -> str:
    """``torch._dynamo.config.optimize_ddp`` as torch DDP reads it at construction."""
    from torch._dynamo.utils import get_optimize_ddp_mode

    return get_optimize_ddp_mode()


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
        getattr(ddp, "forward_sync_buffers", ddp.broadcast_buffers),
        any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.module.modules()),
        bool(getattr(ddp, "static_graph", False)),
    )
    ddp.reducer, ddp.logger = reducer, logger  # (the reducer keeps the placeholder)


def stock_ddp_ignored_names(ddp: Any) -> set[str]:
    """Parameter and buffer names DDP was told to ignore
    (``_set_params_and_buffers_to_ignore_for_model``)."""
    return set(ddp.parameters_to_ignore)


def stock_ddp_move_inputs(ddp: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
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


def stock_ddp_has_buffer_comm_hook(ddp: Any) -> bool:
    return hasattr(ddp, "buffer_hook")


class AdoptedDDPBehaviour:
    """What an adopted torch DDP does instead of torch's reducer steps (stock.py)."""

    def pre_forward(self, ddp: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def register_comm_hook(self, ddp: Any, state: Any, hook: Any) -> None:
        raise NotImplementedError

    def register_builtin_comm_hook(self, ddp: Any, kind: Any) -> None:
        raise NotImplementedError

    def join_hook(self, ddp: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


_adopted_classes: dict[tuple[type, int], type] = {}


def adopted_ddp_class(base: type, behaviour: AdoptedDDPBehaviour) -> type:
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
        },
    )
    _adopted_classes[key] = cls
    return cls


def broadcast_traceable(tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor`` as ``group``'s rank ``src`` (a rank *in the group*, unlike
    ``dist.broadcast``) has it: a functional collective, so torch.compile traces it into
    the graph (no graph break)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.broadcast(tensor, src, group))


def join_enabled(joinable: Any) -> bool:
    """Whether ``joinable`` is in an enabled join context (torch's ``Join`` sets its
    ``_join_config``; it stays set after the context, as for torch DDP)."""
    return joinable is not None and joinable._join_config.enable


def stock_ddp_comm_hooks() -> dict[str, Any]:
    """torch's own DDP comm hooks that ddp_fusion maps onto fused buckets, by role."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {
        "allreduce": default_hooks.allreduce_hook,
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook,
    }


def inductor_options_without_upstream_ddp_fusion() -> dict[str, Any]:
    """Keep upstream's ``_fuse_ddp_communication`` pass (which torch DDP turns on
    process-wide under ``optimize_ddp="python_reducer"``) off a graph ddp_fusion fuses."""
    if hasattr(inductor_config(), "_fuse_ddp_communication"):
        return {"_fuse_ddp_communication": False}
    return {}


def inductor_options_keeping_node_order() -> dict[str, Any]:
    """Inductor options that keep a post-grad graph's node order through scheduling.

    Inductor's ``reorder_for_peak_memory`` (on by default since torch 2.6) re-sorts the
    scheduled nodes to lower the estimated peak memory. For a fused bucket that pulls
    the wait and unpacking of the reduced buffer up to right after the collective and
    pushes the collective down (both shorten the buffer's life), which undoes
    ``schedule.sink_waits``: no backward compute is left between issue and wait.
    """
    if hasattr(inductor_config(), "reorder_for_peak_memory"):
        return {"reorder_for_peak_memory": False}
    return {}


def inductor_options_emulating_precision_casts() -> dict[str, Any]:
    """Inductor options that keep each cast to a lower precision (a rounding) where the
    graph has one, instead of fusing it into fp32 math around it."""
    if hasattr(inductor_config(), "emulate_precision_casts"):
        return {"emulate_precision_casts": True}
    return {}


def allow_dtensor_post_accumulate_grad_hooks() -> Callable[[], None]:
    """Let compiled autograd trace post-accumulate-grad hooks of DTensor parameters.

    Tracing such a hook, compiled autograd copies the parameter with
    ``clone_preserve_strides``, which calls ``as_strided``; DTensor does not implement
    ``as_strided``, so the backward fails (torch 2.13). A DTensor's own
    ``clone()`` keeps its placements and its local shard's strides, which is what that
    copy is for; every other tensor still goes through torch's function. Returns the
    function that puts torch's back.
    """
    from torch._dynamo import compiled_autograd

    original = compiled_autograd.maybe_clone

    def maybe_clone(x: torch.Tensor | None) -> torch.Tensor | None:
        return x.clone() if x is not None and is_dtensor(x) else original(x)

    compiled_autograd.maybe_clone = maybe_clone

    def undo() -> None:
        if compiled_autograd.maybe_clone is maybe_clone:
            compiled_autograd.maybe_clone = original

    return undo


def compiled_autograd_active() -> bool:
    from torch._dynamo import compiled_autograd

    return bool(compiled_autograd.compiled_autograd_enabled)


def hash_files(paths: tuple[str, ...], extra: str) -> bytes:
    from torch._inductor.custom_graph_pass import get_hash_for_files

    return get_hash_for_files(paths, extra)


def inductor_config() -> Any:
    import torch._inductor.config as inductor_config

    return inductor_config


def custom_graph_pass_base() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def default_store() -> Any:
    """The store of the default process group (every rank can set and get keys)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def fake_store() -> Any:
    """A store for ``backend="fake"`` process groups (graph tests, examples)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()



def disable_compiled_autograd() -> AbstractContextManager[None]:
    """Eager autograd inside the block, even while compiled autograd is on."""
    from torch._dynamo import compiled_autograd

    return compiled_autograd._disable()


@contextlib.contextmanager
def run_compiled_code_eagerly() -> Iterator[None]:
    """torch.compile'd functions called inside the block run their Python eagerly (no
    compile, no cached compiled code): ``torch.compiler.set_stance("force_eager")``,
    which torch refuses to set while Dynamo traces (the ready order is learned while
    Dynamo traces the wrapper's forward), so the stance is set directly."""
    from torch._dynamo import eval_frame

    prior = eval_frame._stance
    eval_frame._stance = eval_frame.DynamoStance("force_eager")
    try:
        yield
    finally:
        eval_frame._stance = prior


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has finished (call from a hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def current_backward_id() -> int:
    """An id of the running backward pass (-1 outside one); differs between passes."""
    return torch._C._current_graph_task_id()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (what data parallelism reduces), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def as_like(ref: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` wrapped as a DTensor laid out like ``ref`` if ``ref`` is one, else itself."""
    from torch.distributed.tensor import DTensor

    if not is_dtensor(ref):
        return local
    return DTensor.from_local(
        local, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape, stride=ref.stride()
    )


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def fake_view_op(mode: Any, op: Any, base: torch.Tensor, *args: Any) -> Any:
    """``op(base, *args)`` for a view op (view, permute, split_with_sizes) of a fake
    tensor, without a trip through fake dispatch (several times faster; the pass makes
    a few per gradient): the op runs on the meta data, and each meta view is wrapped as
    a fake tensor, sharing ``base``'s storage exactly as a dispatched view would."""
    with torch._C._DisableTorchDispatch():
        out = op(base, *args)
    if isinstance(out, (list, tuple)):
        return [_wrap_fake(mode, t, base.fake_device) for t in out]
    return _wrap_fake(mode, out, base.fake_device)


def fake_empty(mode: Any, like: torch.Tensor, dtype: torch.dtype | None = None,
               numel: int | None = None) -> torch.Tensor:
    """A fresh fake tensor (a new storage): ``like``'s shape and strides (or 1-D of
    ``numel`` elements), in ``dtype``, on ``like``'s device; what an op that returns a
    new tensor gives, made without fake dispatch."""
    dtype = dtype or like.dtype
    with torch._C._DisableTorchDispatch():  # a plain meta tensor, whatever mode is active
        if numel is not None:
            meta = torch.empty(numel, dtype=dtype, device="meta")
        else:
            meta = torch.empty_strided(like.shape, like.stride(), dtype=dtype, device="meta")
    return _wrap_fake(mode, meta, like.fake_device)


def _wrap_fake(mode: Any, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(t, FakeTensor):
        return t
    # a fresh meta tensor: nothing to look up in (or add to) the converter's memo
    return FakeTensor(mode, t, device)


def call_with_example_inputs(fn: Callable[..., None], key: int, args: Any, kwargs: Any) -> None:
    """``fn(key, inputs)``, where ``inputs()`` returns ``(args, kwargs)``: right away
    with the real values when running eagerly; at trace time when traced by
    torch.compile (through ``torch._dynamo.comptime``: nothing enters the graph, no graph
    break), with Dynamo's fake example values for tensors and the objects themselves for
    other arguments. ``inputs()`` may raise for an argument it cannot give; ``fn``
    calls it only if it needs the inputs. ``fn`` must be a module-level function and
    ``key`` an int."""
    from torch._dynamo.comptime import comptime

    comptime(_call_at_trace_time, lambda: fn(key, lambda: (args, kwargs)))


def _call_at_trace_time(ctx: Any) -> None:
    def inputs() -> tuple[Any, Any]:
        return tuple(_example_of(ctx.get_local(n)._ComptimeVar__variable) for n in ("args", "kwargs"))

    ctx.get_local("fn").as_python_constant()(ctx.get_local("key").as_python_constant(), inputs)


def _example_of(vt: Any) -> Any:
    """The example value of a Dynamo VariableTracker: a fake tensor for a tensor, the
    constant or object for others; containers element by element. Raises
    ``TypeError`` for anything else."""
    from torch._dynamo.variables import ConstDictVariable, TensorVariable
    from torch._dynamo.variables.lists import BaseListVariable

    if isinstance(vt, TensorVariable):
        return vt.as_proxy().node.meta["example_value"]
    if vt.is_python_constant():
        return vt.as_python_constant()
    if isinstance(vt, BaseListVariable):
        return vt.python_type()(_example_of(v) for v in vt.items)
    if isinstance(vt, ConstDictVariable):
        return {k.vt.as_python_constant(): _example_of(v) for k, v in vt.items.items()}
    for attr in ("value", "fn"):  # user objects, functions
        if hasattr(vt, attr):
            return getattr(vt, attr)
    raise TypeError(f"cannot give an example value for {type(vt).__name__}")


def concrete_int(x: Any) -> int:
    """An int, or the example value (hint) of a symbolic one, without adding a guard."""
    return x if isinstance(x, int) else int(x.node.hint)


#: What this module reaches into, as (module, attribute path). Checked once at import
#: (:func:`check_torch`), so a torch without one of them fails there, naming it, rather
#: than deep inside a forward or backward.
_REQUIRED = (
    ("torch", "_C._dynamo.compiled_autograd.set_autograd_compiler"),
    ("torch._dynamo.compiled_autograd", "AutogradCompilerInstance"),
    ("torch._dynamo.compiled_autograd", "maybe_clone"),
    ("torch._dynamo.comptime", "comptime"),
    ("torch._dynamo.eval_frame", "_stance"),
    ("torch._dynamo.eval_frame", "DynamoStance"),
    ("torch", "_TorchCompileInductorWrapper"),
    ("torch._inductor.custom_graph_pass", "CustomGraphPass"),
    ("torch._inductor.custom_graph_pass", "get_hash_for_files"),
    ("torch", "_C._distributed_c10d._resolve_process_group"),
    ("torch", "_C._distributed_c10d._register_process_group"),
    ("torch.distributed", "ProcessGroup._set_group_name"),
    ("torch", "_C.Future"),
    ("torch.distributed.distributed_c10d", "_get_default_store"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel._pre_forward"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel._post_forward"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel._remove_autograd_hooks"),
    ("torch.distributed", "Reducer"),
    ("torch.distributed", "Logger"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel._register_builtin_comm_hook"),
    ("torch.nn.parallel.distributed", "_to_kwargs"),
    ("torch._dynamo.utils", "get_optimize_ddp_mode"),
    ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks", "fp16_compress_hook"),
)

#: torch versions a full test run has passed with.
TESTED_TORCH = ("2.13",)


def check_torch() -> None:
    """Raise ``ImportError`` naming every private torch API ddp_fusion needs that this
    torch lacks."""
    import importlib

    missing = []
    for module, path in _REQUIRED:
        try:
            obj: Any = importlib.import_module(module)
            for name in path.split("."):
                obj = getattr(obj, name)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{path}")
    if missing:
        raise ImportError(
            f"ddp_fusion needs torch internals that torch {torch.__version__} lacks: "
            f"{', '.join(missing)}. ddp_fusion is tested with torch "
            f"{', '.join(TESTED_TORCH)}; see ddp_fusion/_torch.py"
        )
