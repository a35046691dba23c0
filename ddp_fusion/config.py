"""``ddp_fusion.config``: the switches, read by the pass at compile time.

Set them before ``torch.compile``::

    ddp_fusion.config.enabled = True               # or DDP_FUSION=1
    ddp_fusion.config.algorithm = "coalesced"      # or DDP_FUSION_ALGORITHM=coalesced
    with ddp_fusion.config.patch(schedule_waits=False):
        ...

Every value set in code is checked when it is set; a bad one raises ``ValueError``
naming the setting.

Environment variables (``DDP_FUSION``, ``DDP_FUSION_ALGORITHM``, ...) are read once,
when ``ddp_fusion`` is imported, which torch does at every ``import torch`` through its
entry point: so a bad value must never fail there. It is a warning instead (naming the
variable, the value and what is accepted), its setting keeps its default, and the
``ValueError`` naming the variable is raised where ddp_fusion is first used: when a
``torch.nn.parallel.DistributedDataParallel`` or a ``ddp_fusion.DistributedDataParallel``
is constructed (:func:`check_env`).

Code beats the environment: a setting set in code (``config.enabled = False`` under
``DDP_FUSION=1``, say) keeps the value the code gave it, and clears the error of a bad
value of its variable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

ALGORITHMS = ("concat", "coalesced")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass
class Config:
    enabled: bool = False
    """Fuse DDP gradient all-reduces. Setting it installs the post-grad pass in Inductor
    (next to any pass already there) and adopts torch DDP models built from then on;
    compiled autograd turns on for ``backward()`` once such a model's forward runs
    compiled (effects.py). Clearing it undoes all of these. Env: ``DDP_FUSION``
    (``1``/``0``, ``true``/``false``, ``yes``/``no``, ``on``/``off``, any case); then
    torch DDP's constructor is patched at import and the rest waits for the first
    model (``_install.py``). Code beats the environment: ``config.enabled = False``
    under ``DDP_FUSION=1`` turns it off."""

    algorithm: str = "concat"
    """``"concat"``: flatten + cat each bucket into one buffer, one ``all_reduce``, split
    back. ``"coalesced"``: ``_foreach_div`` + one ``all_reduce_coalesced`` over the
    bucket's gradients, no copies. Env: ``DDP_FUSION_ALGORITHM``."""

    schedule_waits: bool = True
    """Move each bucket's wait to just before the first use of its result, so backward
    compute overlaps communication, and compile compiled-autograd backward graphs with
    Inductor's ``reorder_for_peak_memory`` off (it would move the waits back up).
    False waits right after issuing. Env: ``DDP_FUSION_SCHEDULE_WAITS``."""

    max_in_flight_mb: float | None = 5120.0
    """With ``schedule_waits``: at most this many MiB of bucket collectives in flight
    (issued, not yet waited for) at once; before a bucket is issued that would exceed
    it, the oldest buckets are waited for (as upstream's overlap scheduler bounds
    ``max_in_flight_gb``). None: no bound. Env: ``DDP_FUSION_MAX_IN_FLIGHT_MB``
    (a number, or ``none``)."""

    bucket_cap_mb: str | float | None = None
    """For every torch DDP adopted under the flag, instead of its own ``bucket_cap_mb`` /
    ``bucket_cap_mb_list``: ``"auto"``, bucket limits chosen for the link and the
    backward (autocap.py); a positive number, that cap in MiB (as DDP's
    ``bucket_cap_mb``). None: each DDP's own arguments. The wrapper takes its own
    arguments (``bucket_cap_mb="auto"`` included) and ignores this. Env:
    ``DDP_FUSION_BUCKET_CAP_MB`` (``auto`` or a number)."""

    link: tuple[float, float] | None = None
    """For ``bucket_cap_mb="auto"``: the link as ``(latency in microseconds, bandwidth
    in GB/s)`` of one all-reduce, instead of measuring it at the first compiled step.
    Env: ``DDP_FUSION_LINK`` (``"latency_us,gbytes_per_s"``)."""

    dump_dir: str | None = None
    """Write ``<stem>.before.txt``, ``<stem>.after.txt`` and ``<stem>.buckets.json`` here
    for every graph the pass changes. None: no dumps. Env: ``DDP_FUSION_DUMP_DIR``."""

    backward_compile_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """``torch.compile`` arguments for the backward graphs compiled autograd hands to
    Inductor: any of ``mode``, ``dynamic``, ``options``, ``fullgraph`` (the backend is
    always Inductor, where the pass runs). Give the ones you give ``torch.compile`` for
    the forward, e.g. ``{"mode": "max-autotune"}``. Env:
    ``DDP_FUSION_BACKWARD_COMPILE_KWARGS`` (JSON)."""

    plan_check: bool = True
    """Check at every compiled step, before a model's first bucket is issued, that every
    rank of its group runs the same bucket plan (plan_check.py): ranks whose compiled
    backwards differ then raise ``PlanMismatchError`` on every rank instead of hanging or
    mixing gradients. It costs one small host-side exchange a step, in flight during
    backward. False: no such exchange (a divergence then hangs, or, where the sizes
    match, reduces the wrong gradients together); ``find_unused_parameters`` models
    still exchange their used parameters, and the check still runs inside an enabled
    ``join()`` context. Compared across the ranks at construction and at the first
    forward; the pass gives a group's graphs the value its ranks agreed on then. Env:
    ``DDP_FUSION_PLAN_CHECK``."""

    native_check: bool = True
    """Run a steady step's plan check (and the rounds of the host group's exchanges, on
    a thread that never needs the GIL) in C++, built on first use with a C++ compiler and ninja
    (``ddp_fusion/_native.py``); where it cannot be built, a warning says why and the
    Python code runs, with the same messages (ranks may differ in this).
    False: always the Python code. Read when a host group is made (the model's
    construction) and when a plan's check passes in Python; turning it off takes the C++
    kernels back at once. Env: ``DDP_FUSION_NATIVE_CHECK``."""

    def __setattr__(self, name: str, value: Any) -> None:
        validate = _VALIDATORS.get(name)
        if validate is None:
            raise AttributeError(
                f"ddp_fusion.config has no setting {name!r}; settings are "
                f"{', '.join(f.name for f in dataclasses.fields(Config))}"
            )
        value = validate(name, value)
        _env_errors.pop(name, None)  # code beats the environment
        old = self.__dict__.get(name, _UNSET)
        object.__setattr__(self, name, value)
        if old is not _UNSET and old != value:
            try:
                for listener in _LISTENERS:
                    listener(name, value)
            except BaseException:
                object.__setattr__(self, name, old)  # the change did not take effect
                raise

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


def _bucket_cap(name: str, value: Any) -> str | float | None:
    if value is None or value == "auto":  # autocap.AUTO
        return value
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value <= 0):
        raise ValueError(
            f"ddp_fusion.config.{name} must be 'auto', a positive number of MiB, or None (then "
            f"each DDP's own bucket_cap_mb applies), got {value!r}"
        )
    return float(value)


def _link(name: str, value: Any) -> tuple[float, float] | None:
    if value is None:
        return None
    ok = (
        isinstance(value, (tuple, list)) and len(value) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
        and value[0] >= 0 and value[1] > 0
    )
    if not ok:
        raise ValueError(
            f"ddp_fusion.config.{name} must be (latency in microseconds >= 0, bandwidth in "
            f"GB/s > 0) or None, got {value!r}"
        )
    return (float(value[0]), float(value[1]))


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


def _megabytes(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value <= 0):
        raise ValueError(
            f"ddp_fusion.config.{name} must be a positive number of MiB or None, got {value!r}"
        )
    return float(value)


COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_COMPILE_KWARGS = {
    "mode": lambda v: v in COMPILE_MODES,
    "dynamic": lambda v: v is None or isinstance(v, bool),
    "fullgraph": lambda v: isinstance(v, bool),
    "options": lambda v: v is None or (isinstance(v, dict) and all(isinstance(k, str) for k in v)),
}


def _compile_kwargs(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(
            f"ddp_fusion.config.{name} must be a dict of torch.compile arguments, got {value!r}"
        )
    for key, v in value.items():
        check = _COMPILE_KWARGS.get(key)
        if check is None:
            raise ValueError(
                f"ddp_fusion.config.{name}: unsupported torch.compile argument {key!r}; "
                f"give any of {', '.join(_COMPILE_KWARGS)} (the backend is always Inductor)"
            )
        if not check(v):
            raise ValueError(f"ddp_fusion.config.{name}[{key!r}] has an invalid value {v!r}")
    return dict(value)


_VALIDATORS: dict[str, Callable[[str, Any], Any]] = {
    "enabled": _bool,
    "algorithm": _algorithm,
    "schedule_waits": _bool,
    "max_in_flight_mb": _megabytes,
    "bucket_cap_mb": _bucket_cap,
    "link": _link,
    "dump_dir": _dump_dir,
    "backward_compile_kwargs": _compile_kwargs,
    "plan_check": _bool,
    "native_check": _bool,
}


_BOOLEANS = "1, 0, true, false, yes, no, on, off (any case)"


def _env_bool(var: str, raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"environment variable {var} must be one of {_BOOLEANS}, got {raw!r}")


def _env_algorithm(var: str, raw: str) -> str:
    if raw not in ALGORITHMS:
        raise ValueError(f"environment variable {var} must be one of {', '.join(ALGORITHMS)}, got {raw!r}")
    return raw


def _env_in_flight(var: str, raw: str) -> float | None:
    try:
        return None if raw.lower() == "none" else _megabytes("max_in_flight_mb", float(raw))
    except ValueError:
        raise ValueError(f"environment variable {var} must be a positive number of MiB or 'none', "
                         f"got {raw!r}") from None


def _env_bucket_cap(var: str, raw: str) -> str | float:
    try:
        return "auto" if raw == "auto" else _bucket_cap("bucket_cap_mb", float(raw))
    except ValueError:
        raise ValueError(f"environment variable {var} must be 'auto' or a positive number of MiB, "
                         f"got {raw!r}") from None


def _env_link(var: str, raw: str) -> tuple[float, float] | None:
    try:
        return _link("link", tuple(float(v) for v in raw.split(",")))
    except ValueError:
        raise ValueError(f"environment variable {var} must be 'latency_us,gbytes_per_s' (two numbers, "
                         f"e.g. '30,12.5'), got {raw!r}") from None


def _env_compile_kwargs(var: str, raw: str) -> dict[str, Any]:
    try:
        return _compile_kwargs("backward_compile_kwargs", json.loads(raw))
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"environment variable {var} must be a JSON object of torch.compile "
                         f"arguments (any of {', '.join(_COMPILE_KWARGS)}), got {raw!r}: {e}") from None


#: setting -> (its environment variable, the parser of the variable's value)
ENV: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "enabled": ("DDP_FUSION", _env_bool),
    "algorithm": ("DDP_FUSION_ALGORITHM", _env_algorithm),
    "schedule_waits": ("DDP_FUSION_SCHEDULE_WAITS", _env_bool),
    "max_in_flight_mb": ("DDP_FUSION_MAX_IN_FLIGHT_MB", _env_in_flight),
    "bucket_cap_mb": ("DDP_FUSION_BUCKET_CAP_MB", _env_bucket_cap),
    "link": ("DDP_FUSION_LINK", _env_link),
    "dump_dir": ("DDP_FUSION_DUMP_DIR", lambda var, raw: raw),
    "backward_compile_kwargs": ("DDP_FUSION_BACKWARD_COMPILE_KWARGS", _env_compile_kwargs),
    "plan_check": ("DDP_FUSION_PLAN_CHECK", _env_bool),
    "native_check": ("DDP_FUSION_NATIVE_CHECK", _env_bool),
}


def from_env(
    environ: dict[str, str] | os._Environ[str] = os.environ,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The settings ``DDP_FUSION*`` environment variables give (validated), and for each
    setting whose variable has a bad value, the error naming the variable, its value and
    what is accepted. An empty (or blank) variable counts as unset."""
    values: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name, (var, parse) in ENV.items():
        raw = environ.get(var, "").strip()
        if not raw:
            continue
        try:
            values[name] = parse(var, raw)
        except ValueError as e:
            errors[name] = str(e)
    return values, errors


# setting -> the error of its environment variable's bad value, until code sets it
_env_errors: dict[str, str] = {}


def apply_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """Set what the ``DDP_FUSION*`` variables give. A bad value leaves its setting at its
    default; its error is returned (for a warning) and kept for :func:`check_env` until
    code sets that setting."""
    values, errors = from_env(environ)
    for name, value in values.items():
        setattr(config, name, value)
    _env_errors.clear()
    _env_errors.update(errors)
    return errors


def env_errors() -> dict[str, str]:
    """setting -> the error of its variable's bad value, for those code has not set since."""
    return dict(_env_errors)


def check_env() -> None:
    """Raise the ``ValueError`` of every ``DDP_FUSION*`` variable whose bad value was
    ignored at import, unless code has set its setting since. Called where ddp_fusion
    is first used: a torch DDP or a ddp_fusion wrapper constructed."""
    if _env_errors:
        fixes = ", ".join(f"ddp_fusion.config.{name}" for name in _env_errors)
        raise ValueError(
            f"{'; '.join(_env_errors.values())} (ignored at import, so ddp_fusion used the "
            f"default; fix the environment, or set {fixes} in code, which takes precedence)"
        )


config = Config()
