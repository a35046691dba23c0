"""The one place where ddp_fusion touches private torch APIs, one module per subsystem.

    inductor.py           the post-grad pass slot, pass hashing, the backward's backend
    compiled_autograd.py  compiled autograd on and off, the DTensor clone work-around
    dynamo.py             counters, trace-time callbacks, compile stance, DDP optimizer mode
    ddp.py                stock torch DDP internals (adoption, its C++ reducer)
    distributed.py        c10d: the group registry, stores, functional collectives, Join
    tensors.py            fake tensors, DTensor, the autograd engine, pytree
    logs.py               TORCH_LOGS names and artifacts, TORCH_TRACE artifacts
    patching.py           the one helper every process-wide change goes through, and
                          its undo (``Patches``; no private torch of its own)
    release.py            which torch release this is (``minor_version``), for what
                          differs between the releases of the tested window

Everything these modules reach is underscore-prefixed upstream and has moved between
releases. A torch upgrade that breaks ddp_fusion should break here, at its first use:
each module lists what it reaches in ``REQUIRED`` (dotted names), and
:func:`check_torch` resolves every one the first time ddp_fusion is used in the
process (``config.enabled`` set in code, a model wrapped or adopted, the tagged op
called, the pass run), not at ``import ddp_fusion``, which stays cheap (torch imports
it through its entry point at every ``import torch``). ``tests/test_torch_shim.py``
checks that the lists cover every private name the modules use, and that no other
module of the package touches private torch.

Tested: the torch releases in ``TESTED_TORCH`` (the whole suite passes on each,
``.ci/torch_window.py``). On another release :func:`check_torch` warns once, naming the
window, and goes on: the names it needs are still checked, and what differs between
releases is in docs/limits.md.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import torch

from . import compiled_autograd, ddp, distributed, dynamo, inductor, logs, patching, tensors
from .release import minor_version

__all__ = [
    "check_torch", "compiled_autograd", "ddp", "distributed", "dynamo", "inductor", "logs", "minor_version",
    "patching", "tensors",
]

#: torch minor releases the whole test suite has passed with (.ci/torch_window.py), oldest
#: first; pyproject.toml's lower bound is the first.
TESTED_TORCH = ("2.11", "2.12", "2.13", "2.14")

SUBSYSTEMS = (compiled_autograd, ddp, distributed, dynamo, inductor, logs, patching, tensors)


def required() -> tuple[str, ...]:
    """Every private torch name the shim reaches, as dotted paths."""
    return tuple(name for module in SUBSYSTEMS for name in module.REQUIRED)


def resolve(dotted: str) -> Any:
    """The object at ``dotted`` (a module path, then attributes); raises ``ImportError``
    or ``AttributeError`` if this torch lacks it."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


class UntestedTorchWarning(UserWarning):
    """ddp_fusion runs on a torch release outside its tested window."""


def in_tested_window(version: str | None = None) -> bool:
    return minor_version(version) in TESTED_TORCH


def window() -> str:
    return f"{TESTED_TORCH[0]} to {TESTED_TORCH[-1]}"


_checked = False


def check_torch() -> None:
    """Raise ``ImportError`` naming every private torch API ddp_fusion needs that this
    torch lacks, and warn (once, :class:`UntestedTorchWarning`) on a torch outside
    ``TESTED_TORCH``. Called before ddp_fusion first touches torch internals (turning
    ``enabled`` on, building a model, running the pass); checks once per process."""
    global _checked
    if _checked:
        return
    if not in_tested_window():
        warnings.warn(
            f"ddp_fusion is tested with torch {window()}; this is torch {torch.__version__}. "
            f"It checks the torch internals it needs (an error names any that are missing), "
            f"but behaviour that changed without a name changing is not tested here: compare a "
            f"few steps with eager torch DDP before you rely on it",
            UntestedTorchWarning, stacklevel=3,
        )
    missing = []
    for name in required():
        try:
            resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    if missing:
        raise ImportError(
            f"ddp_fusion needs torch internals that torch {torch.__version__} lacks: "
            f"{', '.join(missing)}. ddp_fusion is tested with torch {window()}; "
            f"see ddp_fusion/_torch/"
        )
    _checked = True
