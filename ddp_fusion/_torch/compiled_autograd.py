"""Compiled autograd: switching it on for every backward and off again, eager autograd
inside a block, and the DTensor clone work-around for tracing parameter hooks."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

REQUIRED = (
    "torch._C._dynamo.compiled_autograd.set_autograd_compiler",
    "torch._C._is_multithreading_enabled",
    "torch._C._set_multithreading_enabled",
    "torch._dynamo.compiled_autograd.AutogradCompilerInstance",
    "torch._dynamo.compiled_autograd.compiled_autograd_enabled",
    "torch._dynamo.compiled_autograd.maybe_clone",
    "torch._dynamo.compiled_autograd._disable",
)

UNCHECKED: dict[str, str] = {}


class Handle:
    """Compiled autograd switched on by :func:`install`, restorable."""

    def __init__(self, compiler_fn: Callable[..., Any], dynamic: bool) -> None:
        from torch._dynamo import compiled_autograd

        self._ca = compiled_autograd
        self.dynamic = dynamic
        # What torch's own `_enable` context installs, kept so we can tell it is ours.
        self.factory = functools.partial(compiled_autograd.AutogradCompilerInstance, compiler_fn)
        self.prior = self._set(self.factory, dynamic)
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


def install(compiler_fn: Callable[..., Any], dynamic: bool) -> Handle:
    """Compiled autograd on for every ``backward()`` in the process until the handle's
    ``restore()``. Unlike torch's ``_enable`` context, it need not be closed in LIFO
    order with contexts the user opened before it. (If ``torch._dynamo.reset()``
    switched it off meanwhile, ``restore`` leaves it off.) ``dynamic``: trace backward
    graphs with dynamic sizes (one graph serves every shape) rather than specialized to
    the sizes seen (faster code while shapes do not change)."""
    return Handle(compiler_fn, dynamic)


def active() -> bool:
    """Whether compiled autograd is on (for every backward, or in a context)."""
    from torch._dynamo import compiled_autograd

    return bool(compiled_autograd.compiled_autograd_enabled)


def disabled() -> AbstractContextManager[None]:
    """Eager autograd inside the block, even while compiled autograd is on."""
    from torch._dynamo import compiled_autograd

    return compiled_autograd._disable()


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
    from torch.distributed.tensor import DTensor

    original = compiled_autograd.maybe_clone

    def maybe_clone(x: torch.Tensor | None) -> torch.Tensor | None:
        return x.clone() if isinstance(x, DTensor) else original(x)

    compiled_autograd.maybe_clone = maybe_clone

    def undo() -> None:
        if compiled_autograd.maybe_clone is maybe_clone:
            compiled_autograd.maybe_clone = original

    return undo
