"""Compiled autograd: switching it on for every backward and off again, eager autograd
inside a block, and the DTensor clone work-around for tracing parameter hooks."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from . import patching

REQUIRED = (
    "torch._C._dynamo.compiled_autograd.set_autograd_compiler",
    "torch._C._is_multithreading_enabled",
    "torch._C._set_multithreading_enabled",
    "torch._dynamo.compiled_autograd.AutogradCompilerInstance",
    "torch._dynamo.compiled_autograd.compiled_autograd_enabled",
    "torch._dynamo.compiled_autograd.depth",
    "torch._dynamo.compiled_autograd.maybe_clone",
    "torch._dynamo.compiled_autograd._disable",
    "torch.autograd.Variable._execution_engine.queue_callback",
    "torch._dynamo.error_on_graph_break",
)

UNCHECKED: dict[str, str] = {
    "_post_accumulate_grad_hooks": "a tensor's post-accumulate-grad hooks (None: none); set to "
                                   "None only where torch's own handles left it empty",
}


@dataclasses.dataclass(frozen=True)
class _State:
    """Compiled autograd's process-wide state, as ddp_fusion sets and restores it."""

    factory: Any
    """The compiler factory compiled autograd calls (None: off)."""
    dynamic: bool
    enabled: bool
    """``compiled_autograd.compiled_autograd_enabled``, which Dynamo reads."""
    multithreading: bool
    """Autograd's multithreading (torch's context turns it off, and so does ddp_fusion)."""
    depth: int
    """How many of torch's ``_enable`` contexts are open (read only)."""


def _get() -> _State:
    from torch._dynamo import compiled_autograd

    factory, dynamic = _set_compiler(None, False)
    _set_compiler(factory, dynamic)
    return _State(factory, dynamic, bool(compiled_autograd.compiled_autograd_enabled),
                  torch._C._is_multithreading_enabled(), compiled_autograd.depth)


def _set(state: _State) -> None:
    from torch._dynamo import compiled_autograd

    _set_compiler(state.factory, state.dynamic)
    compiled_autograd.compiled_autograd_enabled = state.enabled
    torch._C._set_multithreading_enabled(state.multithreading)


def _set_compiler(factory: Any, dynamic: bool) -> tuple[Any, bool]:
    return torch._C._dynamo.compiled_autograd.set_autograd_compiler(factory, dynamic)


def _whose(current: _State, ours: _State) -> str:
    """torch's ``_enable`` context saves the compiler (and multithreading) it finds and
    puts it back when it closes; ``depth`` counts the open ones. So with ours not in
    place: a context opened after ours is open (deeper than where ours was set) and
    will put ours back; or the context ours was set in has closed (shallower), which
    put back what was there before it, ours gone with it. ``compiled_autograd.reset()``
    (``torch._dynamo.reset()``) clears the compiler where ours was set, and leaves
    multithreading as ours had it: still ours to restore."""
    if current.factory is ours.factory:
        return patching.OURS
    if current.depth > ours.depth:
        return patching.COVERED
    if current.depth == ours.depth and current.factory is None:
        return patching.OURS
    return patching.REPLACED


STATE = patching.Setting(
    "compiled autograd (compiler, compiled_autograd_enabled, autograd multithreading)",
    _get, _set, _whose,
    refusal="ddp_fusion.config.enabled = False: a compiled-autograd context opened after "
            "ddp_fusion turned compiled autograd on is still open (torch would restore "
            "ddp_fusion's compiler when it closes); turn ddp_fusion off after leaving that context",
)
"""Compiled autograd's process-wide state, as one setting of :class:`patching.Patches`."""


def install(patches: patching.Patches, compiler_fn: Callable[..., Any], dynamic: bool) -> None:
    """Compiled autograd on for every ``backward()`` in the process, until ``patches``
    is restored, with autograd's multithreading off (as torch's ``_enable`` context
    does). Unlike that context, it need not be closed in LIFO order with contexts the
    user opened before it. Nothing to do while ours is on with the same ``dynamic``, or
    covered by a context the user opened after it (torch puts ours back when that
    closes). ``dynamic``: trace backward graphs with dynamic sizes (one graph serves
    every shape) rather than specialized to the sizes seen (faster code while shapes
    do not change)."""
    from torch._dynamo import compiled_autograd

    whose = patches.whose(STATE)
    if whose == patching.COVERED:
        return
    if whose == patching.OURS:
        ours, now = patches.ours(STATE), _get()
        if (ours.dynamic == dynamic and now.factory is ours.factory and now.enabled
                and not now.multithreading):
            return  # (a reset inside a context opened after ours leaves the flag off)
    factory = functools.partial(compiled_autograd.AutogradCompilerInstance, compiler_fn)
    patches.set(STATE, _State(factory, dynamic, True, False, compiled_autograd.depth))


def active() -> bool:
    """Whether compiled autograd is on (for every backward, or in a context)."""
    from torch._dynamo import compiled_autograd

    return bool(compiled_autograd.compiled_autograd_enabled)


def disabled() -> AbstractContextManager[None]:
    """Eager autograd inside the block, even while compiled autograd is on."""
    from torch._dynamo import compiled_autograd

    return compiled_autograd._disable()


def queue_callback(callback: Callable[[], None]) -> None:
    """From a hook during a backward: call ``callback`` when the backward ends. Compiled
    autograd traces it at the end of its graph. Dynamo traces the call only where a graph
    break would raise (it asserts so), which the block says for this call alone, whether
    or not the backward is compiled with ``fullgraph=True``."""
    with torch._dynamo.error_on_graph_break(True):
        torch.autograd.Variable._execution_engine.queue_callback(callback)


def drop_empty_post_accumulate_grad_hooks(param: torch.Tensor) -> None:
    """Where every post-accumulate-grad hook of ``param`` was removed: no hooks at all.
    torch leaves an empty table in place, and a hook object on the gradient's
    accumulation that compiled autograd still visits at every backward."""
    hooks = param._post_accumulate_grad_hooks
    if hooks is not None and not hooks:
        param._post_accumulate_grad_hooks = None


def allow_dtensor_post_accumulate_grad_hooks(patches: patching.Patches) -> None:
    """Let compiled autograd trace post-accumulate-grad hooks of DTensor parameters,
    until ``patches`` is restored.

    Tracing such a hook, compiled autograd copies the parameter with
    ``clone_preserve_strides``, which calls ``as_strided``; DTensor does not implement
    ``as_strided``, so the backward fails (torch 2.13). A DTensor's own
    ``clone()`` keeps its placements and its local shard's strides, which is what that
    copy is for; every other tensor still goes through torch's function.
    """
    from torch._dynamo import compiled_autograd
    from torch.distributed.tensor import DTensor

    def make(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def maybe_clone(x: torch.Tensor | None) -> torch.Tensor | None:
            return x.clone() if isinstance(x, DTensor) else original(x)

        return maybe_clone

    patches.wrap(patching.attribute(compiled_autograd, "maybe_clone"), make)
