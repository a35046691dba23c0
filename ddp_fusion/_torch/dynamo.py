"""Dynamo: its counters, a callback at trace time, the compile stance, DDP's optimizer mode."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from .release import minor_version

REQUIRED = (
    "torch._dynamo.utils.counters",
    "torch._dynamo.utils.get_optimize_ddp_mode",
    "torch._dynamo.comptime.comptime",
    "torch._dynamo.eval_frame._stance",
    "torch._dynamo.eval_frame.DynamoStance",
    "torch._dynamo.variables.ConstDictVariable",
    "torch._dynamo.variables.TensorVariable",
    "torch._dynamo.variables.lists.BaseListVariable",
    "torch._dynamo.eval_frame.OptimizedModule",
    "torch._guards.CompileContext.current_compile_id",
)

#: Attributes of objects (not importable names) this module reads, and why that is safe.
UNCHECKED = {
    "_ComptimeVar__variable": "the VariableTracker of a comptime local; used only while "
                              "learning the ready order, whose failure is caught and logged",
    "_compiled_call_impl": "set by nn.Module.compile() (None until then); read with getattr "
                           "and a default",
    "_torchdynamo_orig_callable": "set on every function torch.compile returns; only tested "
                                  "for with hasattr",
}


def counters() -> dict[str, Any]:
    """``torch._dynamo.utils.counters``: a ``defaultdict(Counter)`` shared with Dynamo."""
    from torch._dynamo.utils import counters as _counters

    return _counters


def optimize_ddp_mode() -> str:
    """``torch._dynamo.config.optimize_ddp`` as torch DDP reads it at construction."""
    from torch._dynamo.utils import get_optimize_ddp_mode

    return get_optimize_ddp_mode()


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


def call_with_example_inputs(fn: Callable[..., None], key: Any, args: Any, kwargs: Any) -> None:
    """``fn(key, inputs)``, where ``inputs()`` returns ``(args, kwargs)``: right away
    with the real values when running eagerly; at trace time when traced by
    torch.compile (through ``torch._dynamo.comptime``: nothing enters the graph, no graph
    break), with Dynamo's fake example values for tensors and the objects themselves for
    other arguments. ``inputs()`` may raise for an argument it cannot give; ``fn``
    calls it only if it needs the inputs. ``fn`` must be a module-level function and
    ``key`` a constant (ints and bools, or a tuple of them)."""
    from torch._dynamo.comptime import comptime

    comptime(_call_at_trace_time, lambda: fn(key, lambda: (args, kwargs)))


def at_trace_time(fn: Callable[[], None]) -> None:
    """``fn()`` right away when running eagerly; at trace time when traced by
    torch.compile (through ``torch._dynamo.comptime``: nothing enters the graph, no graph
    break, and ``fn``'s effects are not replayed at run time). ``fn`` must be a
    module-level function."""
    import torch

    if not torch.compiler.is_compiling():
        fn()
        return
    from torch._dynamo.comptime import comptime

    comptime(_call_fn_at_trace_time)


def _call_fn_at_trace_time(ctx: Any) -> None:
    ctx.get_local("fn").as_python_constant()()


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


# torch 2.11's Dynamo leaves a module parameter's requires_grad out of a compiled
# forward's guards: switched on after the compile, the parameter keeps being treated as
# frozen (no gradient) and nothing is traced again. 2.12 and later guard it.
_GUARDS_REQUIRES_GRAD = minor_version() not in ("2.11",)


def guard_requires_grad(params: Any) -> None:
    """Inside a forward Dynamo traces: make this frame's guards hold each of ``params``'
    ``requires_grad`` where the torch release does not by itself (torch 2.11), so that
    switching one makes the forward be traced again (and checked). Elsewhere nothing:
    the parameters' own guards already hold it, at no cost per step."""
    if _GUARDS_REQUIRES_GRAD:
        return
    for p in params:
        if p.requires_grad:  # read: a guard on the flag
            return


def concrete_int(x: Any) -> int:
    """An int, or the example value (hint) of a symbolic one, without adding a guard."""
    return x if isinstance(x, int) else int(x.node.hint)


def holds_compiled_code(module: Any) -> bool:
    """Whether ``module`` or a submodule is compiled (``torch.compile(module)``,
    ``module.compile()``) or holds a compiled function in place of a method (Lightning
    compiles a LightningModule by replacing its ``forward`` and ``training_step`` with
    ``torch.compile``'d functions): then calling it runs compiled code."""
    from torch._dynamo.eval_frame import OptimizedModule

    def compiled(m: Any) -> bool:
        return (
            isinstance(m, OptimizedModule)
            or getattr(m, "_compiled_call_impl", None) is not None
            or any(hasattr(v, "_torchdynamo_orig_callable") for v in vars(m).values() if callable(v))
        )

    return any(compiled(m) for m in module.modules())


def current_compile_id() -> str | None:
    """The compile id of the graph being compiled (``"0/0"``; ``"!1/2/0"`` for the
    second graph compiled autograd captured), as TORCH_LOGS and tlparse print it; None
    outside a compile."""
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    return None if cid is None else str(cid)
