"""Process-wide effects that models ask for while ``config.enabled`` may be on or off.

A model that needs something of torch beyond what ``enabled`` always changes asks for it
here; ``_install`` applies it now if ``enabled`` is on, or when it is turned on, and
undoes it when it is turned off. Kept apart so that the models (below ``_install`` in
the layer map) never import ``_install``. The effects:

* ddp_fusion in use: everything ``enabled`` changes beyond torch DDP's constructor
  (``check_torch()``, the pass in Inductor's slot, torch DDP's forward), asked for when
  a model is wrapped or adopted, the tagged op is called, or the pass is run. With
  ``DDP_FUSION=1`` the import (at every ``import torch``) patches torch DDP's
  constructor only, so that it imports neither Dynamo nor Inductor; this is the rest;
* compiled autograd for every backward, asked for when a model's forward first runs
  compiled (so that a model that is never compiled keeps eager DDP's speed and nothing
  is compiled that the user did not compile);
* compiled autograd tracing with dynamic shapes, asked for when a model's forward is
  compiled with dynamic shapes (Dynamo's automatic dynamic after a shape changed, or
  ``torch.compile(dynamic=True)``): until then backward graphs are compiled for static
  shapes, as torch.compile's own forward graphs are;
* compiled autograd copying DTensor parameters with ``clone()``, asked for by a model
  with DTensor parameters (DP x TP).
"""

from __future__ import annotations

from collections.abc import Callable

IN_USE = "in_use"
"""ddp_fusion is used in this process: ``check_torch()``, the pass in Inductor's
post-grad slot, torch DDP's forward patched (``_install``). Ask before Inductor compiles
a graph that holds the tagged op: the pass's ``uuid()`` is part of Inductor's FX graph
cache key."""

COMPILED_AUTOGRAD = "compiled_autograd"
"""Compiled autograd on for every ``backward()`` (``_torch.compiled_autograd.install``)."""

DYNAMIC_BACKWARD = "dynamic_backward"
"""Compiled autograd traces backward with dynamic sizes (one graph for every shape)."""

DTENSOR_CLONE = "dtensor_clone"
"""Compiled autograd copies DTensor parameters with ``clone()``
(``_torch.compiled_autograd.allow_dtensor_post_accumulate_grad_hooks``)."""

_wanted: list[str] = []
_listeners: list[Callable[[str], None]] = []


def want(effect: str) -> None:
    """Ask for ``effect`` for the rest of the process (applied while enabled). Asking
    again is cheap, and re-applies an effect that something else undid (say,
    ``torch._dynamo.reset()`` turning compiled autograd off)."""
    if effect not in _wanted:
        _wanted.append(effect)
    for listener in _listeners:
        listener(effect)


def wanted() -> tuple[str, ...]:
    return tuple(_wanted)


def on_want(listener: Callable[[str], None]) -> None:
    """Call ``listener(effect)`` whenever an effect is asked for."""
    _listeners.append(listener)
