"""``ddp_fusion.config``: the switches, read by the pass at compile time.

Set them before ``torch.compile``::

    ddp_fusion.config.enabled = True               # or DDP_FUSION=1
    ddp_fusion.config.algorithm = "coalesced"      # or DDP_FUSION_ALGORITHM=coalesced
    with ddp_fusion.config.patch(schedule_waits=False):
        ...

Every value is checked when it is set; a bad one raises ``ValueError`` naming the
setting (or the environment variable it came from). Environment variables are read once,
when ``ddp_fusion`` is imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

ALGORITHMS = ("concat", "coalesced")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclasses.dataclass
class Config:
    enabled: bool = False
    """Fuse DDP gradient all-reduces. Setting it installs the post-grad pass in Inductor
    (next to any pass already there) and turns on compiled autograd for ``backward()``;
    clearing it undoes both. Env: ``DDP_FUSION``."""

    algorithm: str = "concat"
    """``"concat"``: flatten + cat each bucket into one buffer, one ``all_reduce``, split
    back. ``"coalesced"``: ``_foreach_div`` + one ``all_reduce_coalesced`` over the
    bucket's gradients, no copies. Env: ``DDP_FUSION_ALGORITHM``."""

    schedule_waits: bool = True
    """Move each bucket's wait to just before the first use of its result, so backward
    compute overlaps communication, and compile compiled-autograd backward graphs with
    Inductor's ``reorder_for_peak_memory`` off (it would move the waits back up).
    False waits right after issuing. Env: ``DDP_FUSION_SCHEDULE_WAITS``."""

    dump_dir: str | None = None
    """Write ``<stem>.before.txt``, ``<stem>.after.txt`` and ``<stem>.buckets.json`` here
    for every graph the pass changes. None: no dumps. Env: ``DDP_FUSION_DUMP_DIR``."""

    def __setattr__(self, name: str, value: Any) -> None:
        validate = _VALIDATORS.get(name)
        if validate is None:
            raise AttributeError(
                f"ddp_fusion.config has no setting {name!r}; settings are "
                f"{', '.join(f.name for f in dataclasses.fields(Config))}"
            )
        value = validate(name, value)
        old = self.__dict__.get(name, _UNSET)
        object.__setattr__(self, name, value)
        if old is not _UNSET and old != value:
            for listener in _LISTENERS:
                listener(name, value)

    @contextlib.contextmanager
    def patch(self, **changes: Any) -> Iterator[Config]:
        """Set ``changes`` for the duration of the ``with`` block, then restore."""
        saved = {name: getattr(self, name) for name in changes if name in _VALIDATORS}
        try:
            for name, value in changes.items():
                setattr(self, name, value)
            yield self
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_UNSET = object()
_LISTENERS: list[Callable[[str, Any], None]] = []


def on_change(listener: Callable[[str, Any], None]) -> None:
    """Call ``listener(name, value)`` whenever a setting changes value."""
    _LISTENERS.append(listener)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"ddp_fusion.config.{name} must be True or False, got {value!r}")
    return value


def _algorithm(name: str, value: Any) -> str:
    if value not in ALGORITHMS:
        raise ValueError(
            f"ddp_fusion.config.{name} must be one of {', '.join(map(repr, ALGORITHMS))}, "
            f"got {value!r}"
        )
    return value


def _dump_dir(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise ValueError(
            f"ddp_fusion.config.{name} must be a directory path or None, got {value!r}"
        )
    return value


_VALIDATORS: dict[str, Callable[[str, Any], Any]] = {
    "enabled": _bool,
    "algorithm": _algorithm,
    "schedule_waits": _bool,
    "dump_dir": _dump_dir,
}


def _env_bool(var: str, raw: str) -> bool:
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ValueError(f"environment variable {var} must be 1 or 0 (true/false), got {raw!r}")


def from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, Any]:
    """The settings given by ``DDP_FUSION*`` environment variables (validated)."""
    values: dict[str, Any] = {}
    if "DDP_FUSION" in environ:
        values["enabled"] = _env_bool("DDP_FUSION", environ["DDP_FUSION"])
    if "DDP_FUSION_ALGORITHM" in environ:
        raw = environ["DDP_FUSION_ALGORITHM"].strip()
        if raw not in ALGORITHMS:
            raise ValueError(
                f"environment variable DDP_FUSION_ALGORITHM must be one of "
                f"{', '.join(ALGORITHMS)}, got {raw!r}"
            )
        values["algorithm"] = raw
    if "DDP_FUSION_SCHEDULE_WAITS" in environ:
        values["schedule_waits"] = _env_bool(
            "DDP_FUSION_SCHEDULE_WAITS", environ["DDP_FUSION_SCHEDULE_WAITS"]
        )
    if environ.get("DDP_FUSION_DUMP_DIR"):
        values["dump_dir"] = environ["DDP_FUSION_DUMP_DIR"]
    return values


config = Config()
