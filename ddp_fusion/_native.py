"""The C++ part of the per-step plan check (``csrc/host_check.cpp``), built on first use.

A steady step's plan check, written in Python, cost about 7 % of a small model's step on
2 gloo ranks: two Python ops entered cold between Inductor's kernels, and their work
(bench/results/plan_check_price_cpu_2026-11-28.md). The extension holds the host group's
two-rank (or relay) connection, which the Python exchanges use too, and kernels of the
plan ops for a plan already checked once, which run no Python (plan_check.py).

It is built with ``torch.utils.cpp_extension.load`` the first time a process needs it:
a C++ compiler and ``ninja`` (a dependency); about 25 s the first time on a machine,
then loaded from torch's extension cache (``TORCH_EXTENSIONS_DIR``). Where it cannot be
built, or ``ddp_fusion.config.native_check`` is False, the same exchanges run in Python,
with the same frames on the wire: ranks with and without it work together.
"""

from __future__ import annotations

import functools
import os
from typing import Any

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "host_check.cpp")

_failure: list[str] = []


@functools.cache
def load() -> Any | None:
    """The extension module, built or loaded once per process; None where it cannot be
    (:func:`failure` says why)."""
    try:
        from torch.utils.cpp_extension import load as build

        return build("ddp_fusion_host_check", [SOURCE], extra_cflags=["-O2"], verbose=False)
    except Exception as e:  # noqa: BLE001 - the Python path works without it; logged by the caller
        _failure.append(f"{type(e).__name__}: {e}".strip()[:2000])
        return None


def failure() -> str | None:
    """Why :func:`load` gave None (None: it did not, or was not called)."""
    return _failure[0] if _failure else None


def loaded() -> Any | None:
    """The extension module if :func:`load` has built it, without building it."""
    return load() if load.cache_info().currsize else None
