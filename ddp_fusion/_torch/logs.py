"""``torch._logging``: registering ddp_fusion's log names and artifacts (so ``TORCH_LOGS``
accepts and lists them), artifact loggers, and ``TORCH_TRACE`` structured artifacts
(which tlparse shows per compile id)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .release import minor_version

REQUIRED = (
    "torch._logging._internal.register_log",
    "torch._logging._internal.register_artifact",
    "torch._logging._internal.LOG_TRACE_HANDLER",
    "torch._logging._internal.trace_log.handlers",
    "torch._logging.getArtifactLogger",
    "torch._logging.trace_structured",
)

UNCHECKED: dict[str, str] = {}

# torch 2.11 and 2.12 parse TORCH_LOGS at ``import torch`` before they load the
# ``torch.backends`` entry points (2.13 loads them first), so there ddp_fusion's names
# are registered too late for TORCH_LOGS: ``ddp_fusion`` passes as a module's logger,
# ``ddp_fusion_graphs`` is refused.
_PARSED_BEFORE_ENTRY_POINTS = minor_version() in ("2.11", "2.12")


def torch_logs_sees_entry_points() -> bool:
    """Whether ``TORCH_LOGS`` at ``import torch`` knows the names ddp_fusion's entry point
    registers (torch 2.13 and later)."""
    return not _PARSED_BEFORE_ENTRY_POINTS


def register(log_name: str, artifacts: dict[str, tuple[str, bool]]) -> None:
    """Register ``log_name`` (a logger name and its ``TORCH_LOGS`` setting) and
    ``artifacts`` (name -> (description, off by default)) with torch's logging, so that
    ``TORCH_LOGS`` accepts them and ``TORCH_LOGS=help`` lists them. Must run before torch
    parses ``TORCH_LOGS`` (torch's entry point loading does so)."""
    from torch._logging import _internal

    _internal.register_log(log_name, log_name)
    for name, (description, off_by_default) in artifacts.items():
        _internal.register_artifact(name, description, visible=True, off_by_default=off_by_default)


def artifact_logger(module: str, artifact: str) -> logging.Logger:
    """The logger of a registered artifact (enabled by ``TORCH_LOGS=<artifact>``)."""
    from torch._logging import getArtifactLogger

    return getArtifactLogger(module, artifact)


def tracing() -> bool:
    """Whether ``TORCH_TRACE`` structured logging is on in this process."""
    from torch._logging import _internal

    handler = _internal.LOG_TRACE_HANDLER
    return bool(_internal.trace_log.handlers) and getattr(handler, "root_dir", None) is not None


def trace_artifact(name: str, encoding: str, payload: Callable[[], Any]) -> None:
    """A ``TORCH_TRACE`` artifact under the current compile id (tlparse shows it)."""
    from torch._logging import trace_structured

    trace_structured(
        "artifact", metadata_fn=lambda: {"name": name, "encoding": encoding}, payload_fn=payload
    )
