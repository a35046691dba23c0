"""Process-wide effects that a model asks for while ``config.enabled`` may be on or off.

A model that needs something of torch beyond what ``enabled`` always changes (today:
compiled autograd copying DTensor parameters with ``clone()``, for DP x TP) asks for it
here; ``_install`` applies it now if ``enabled`` is on, or when it is turned on, and
undoes it when it is turned off. Kept apart so that the models (below ``_install`` in
the layer map) never import ``_install``.
"""

from __future__ import annotations

from collections.abc import Callable

DTENSOR_CLONE = "dtensor_clone"
"""Compiled autograd copies DTensor parameters with ``clone()``
(``_torch.compiled_autograd.allow_dtensor_post_accumulate_grad_hooks``)."""

_wanted: list[str] = []
_listeners: list[Callable[[str], None]] = []


def want(effect: str) -> None:
    """Ask for ``effect`` for the rest of the process (applied while enabled)."""
    if effect not in _wanted:
        _wanted.append(effect)
        for listener in _listeners:
            listener(effect)


def wanted() -> tuple[str, ...]:
    return tuple(_wanted)


def on_want(listener: Callable[[str], None]) -> None:
    """Call ``listener(effect)`` whenever an effect is asked for the first time."""
    _listeners.append(listener)
