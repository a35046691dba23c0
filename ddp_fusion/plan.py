"""The bucket plan, and DDP's bucket rule.

A plan says which gradients share one collective, in the order the collectives are
issued. It has one typed form, :class:`BucketPlan` of :class:`PlannedBucket`, and one
JSON form (:meth:`BucketPlan.to_json` / :meth:`BucketPlan.from_json`), used alike by
the pass (which makes it), the per-step plan check (each rank's plan for a group, in a
fused graph), a joined rank replaying the others' plan, the dumps and the logs::

    {"algorithm": "concat",
     "buckets": [{"group": "0", "dtype": "float32", "device": "cpu", "reduce_op": "avg",
                  "algorithm": "concat", "bytes": 2048, "num_grads": 2, "numels": [256, 256],
                  "grads": ["module.fc2.bias", "module.fc2.weight"]}],
     "unfused": [{"grad": "module.emb.weight", "group": "0", "reason": "..."}]}

A bucket may also carry ``comm_dtype`` (gradients cast for the wire), ``hook`` (``[model
id, index, count]``: the model's comm hook reduces it), ``cut`` (why it closed
before its limit) and ``layout`` (a ``find_unused_parameters`` model's number among
the plan's such models, 0, 1, ...: its buckets hold all its parameters, with a gradient
on this rank or not; unused.py).
``device`` is the device type: the same on every rank.

The rule is eager DDP's, after its first-iteration rebuild (``Reducer::rebuild_buckets``
calling ``compute_bucket_assignment_by_size`` on the gradients in ready order): per key
(process group, dtype, device, ...), gradients join the open bucket in order; a bucket
closes as soon as its bytes reach the current limit, and the next limit in the list
then applies (the last repeats); what is left open at the end forms a last, smaller
bucket. The limits are DDP's: default ``[1 MiB, 25 MiB]`` (a small first bucket, so the
last gradients of backward do not wait behind a big one), ``bucket_cap_mb=c`` gives
``[c]``, ``bucket_cap_mb_list=[a, b, ...]`` gives ``[a, b, ...]`` (all in MiB).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from . import _torch

MiB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25

T = TypeVar("T")


def ddp_bucket_limits(
    bucket_cap_mb: float | None = None, bucket_cap_mb_list: Sequence[float] | None = None
) -> list[int]:
    """Bucket byte limits, in order, that eager torch DDP uses for these arguments.

    Raises ``ValueError`` naming the argument if a size is not a non-negative number.
    """
    if bucket_cap_mb_list is not None:
        if isinstance(bucket_cap_mb_list, (str, bytes)) or not isinstance(
            bucket_cap_mb_list, Sequence
        ):
            raise ValueError(
                f"bucket_cap_mb_list must be a list of sizes in MiB, got {bucket_cap_mb_list!r}"
            )
        if len(bucket_cap_mb_list) == 0:
            raise ValueError("bucket_cap_mb_list must not be empty")
        return [_cap_bytes(f"bucket_cap_mb_list[{i}]", c) for i, c in enumerate(bucket_cap_mb_list)]
    if bucket_cap_mb is not None:
        return [_cap_bytes("bucket_cap_mb", bucket_cap_mb)]
    return [_torch.ddp.DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * MiB]


def _cap_bytes(setting: str, cap_mb: object) -> int:
    if (
        isinstance(cap_mb, bool)
        or not isinstance(cap_mb, numbers.Real)
        or not math.isfinite(cap_mb)
        or cap_mb < 0
    ):
        raise ValueError(f"{setting} must be a non-negative number of MiB, got {cap_mb!r}")
    return int(cap_mb * MiB)


class BucketRule:
    """DDP's rule for one key's open bucket: when it is full, and which limit is next."""

    def __init__(self, limits: Sequence[int]) -> None:
        self.limits = tuple(limits)
        self._limit = 0
        self._bytes = 0

    def add(self, nbytes: int) -> bool:
        """Count a gradient into the open bucket. True if that filled it: the caller
        closes it, and the next limit applies to the next bucket."""
        self._bytes += nbytes
        if self._bytes >= self.limits[self._limit]:
            self.close()
            return True
        return False

    def close(self) -> None:
        """The open bucket closes (full, or cut early); the next limit applies."""
        self._bytes = 0
        self._limit = min(self._limit + 1, len(self.limits) - 1)


def split_by_rule(
    items: Iterable[T],
    nbytes: Callable[[T], int],
    limits: Sequence[int],
    key: Callable[[T], Hashable] = lambda _: None,
) -> list[list[T]]:
    """DDP's rule over ``items`` in order, each key on its own: buckets in the order
    they close, then the ones still open at the end, in the order they were opened."""
    rules: dict[Hashable, BucketRule] = {}
    open_: dict[Hashable, list[T]] = {}
    closed: list[list[T]] = []
    for item in items:
        k = key(item)
        open_.setdefault(k, []).append(item)
        rule = rules.get(k)
        if rule is None:
            rule = rules[k] = BucketRule(limits)
        if rule.add(nbytes(item)):
            closed.append(open_.pop(k))
    return closed + list(open_.values())


# Element order. An all-reduce adds the buffers of the ranks element by element, so a
# gradient must sit in its bucket in the same element order on every rank, whatever the
# layout of the tensor it comes from or goes into on each (a kept .grad a rank made
# itself, say). That order is its parameter's layout (the order of its dimensions in
# memory, as torch DDP's bucket views take it), the same on every rank: the models are
# compared across ranks with their parameters' strides (settings_check.py).

# model id -> parameter name -> its dimensions, outermost in memory first
_element_orders: dict[int, dict[str, tuple[int, ...]]] = {}


def laid_out(t: torch.Tensor, order: Sequence[int]) -> bool:
    """Whether ``t.permute(order)`` is contiguous: ``t``'s memory holds its elements in
    that order of its dimensions. From sizes and strides alone (no tensor op: the pass
    asks it of fake tensors, per gradient)."""
    if t.numel() == 0:
        return True  # (as is_contiguous says)
    step = 1
    for d in reversed(order):
        size = t.shape[d]
        if size != 1 and t.stride(d) != step:
            return False
        step *= size
    return True


def dims_in_memory(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s dimensions from outermost to innermost in memory if ``t`` is dense
    (``t.permute(order)`` is contiguous: channels last, a transposed weight, ...);
    its logical order otherwise."""
    logical = tuple(range(t.dim()))
    if laid_out(t, logical):
        return logical
    order = tuple(sorted(logical, key=lambda d: (-t.stride(d), d)))
    return order if laid_out(t, order) else logical


def register_element_orders(model_id: int, params: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """Each parameter's layout, as the element order of its gradient in a bucket (see
    above); returns what :func:`forget_element_orders` takes."""
    orders = {name: dims_in_memory(_torch.tensors.local_tensor(p.detach())) for name, p in params}
    _element_orders[model_id] = orders
    return orders


def forget_element_orders(model_id: int, orders: dict) -> None:
    """Forget a model's orders (it is garbage), unless a new model took its id."""
    if _element_orders.get(model_id) is orders:
        del _element_orders[model_id]


def element_orders_key() -> str | None:
    """The registered orders that are not a parameter's logical order, for the FX graph
    cache key (the pass lays gradients out by them); None where every registered
    parameter is contiguous, so that those graphs' keys do not change."""
    laid_out = sorted(f"{m}:{name}:{list(order)}" for m, orders in _element_orders.items()
                      for name, order in orders.items() if list(order) != sorted(order))
    return ",".join(laid_out) or None


def element_order(model_id: int, name: str) -> tuple[int, ...] | None:
    """The registered order of ``name``'s dimensions in its bucket; None where no model
    registered it (``ddp_fusion.all_reduce_gradient`` called directly)."""
    return _element_orders.get(model_id, {}).get(name)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"bucket plan: unknown dtype {name!r}")
    return dtype


@dataclasses.dataclass(frozen=True)
class PlannedBucket:
    """One bucket: one collective per step."""

    group: str
    """The process group's name."""
    dtype: torch.dtype
    """The gradients' dtype."""
    device: str
    """The gradients' device type."""
    reduce_op: str
    """``avg``, ``sum``, or ``hook`` (the model's comm hook reduces it)."""
    algorithm: str
    """``concat`` or ``coalesced`` (a hooked bucket is always ``concat``)."""
    grads: tuple[str, ...]
    """Each gradient's label (its parameter's name), in the order they became ready."""
    numels: tuple[int, ...]
    """Each gradient's number of elements."""
    comm_dtype: torch.dtype | None = None
    """The dtype the bucket is all-reduced in, if not ``dtype``."""
    hook: tuple[int, int, int] | None = None
    """(model id, index, count) when a comm hook reduces the bucket: its number among
    the model's hooked buckets (``GradBucket.index()``) and how many there are."""
    cut: str | None = None
    """Why the bucket closed before its limit."""
    layout: int | None = None
    """For a bucket that follows a ``find_unused_parameters`` model's registered layout
    (every parameter of its part of the model, used on this rank or not; the ranks agree
    on which were used: ddp_fusion/unused.py), the model's number among the plan's such
    models, in the order of their first buckets; else None."""

    @property
    def nbytes(self) -> int:
        return sum(self.numels) * self.dtype.itemsize

    @property
    def wire_dtype(self) -> torch.dtype:
        return self.comm_dtype or self.dtype

    def to_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "dtype": _dtype_name(self.dtype),
            "device": self.device,
            "reduce_op": self.reduce_op,
            **({"comm_dtype": _dtype_name(self.comm_dtype)} if self.comm_dtype else {}),
            "algorithm": self.algorithm,
            **({"hook": list(self.hook)} if self.hook else {}),
            "bytes": self.nbytes,
            "num_grads": len(self.grads),
            "numels": list(self.numels),
            "grads": list(self.grads),
            **({"cut": self.cut} if self.cut else {}),
            **({"layout": self.layout} if self.layout is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlannedBucket:
        return cls(
            group=d["group"],
            dtype=_dtype(d["dtype"]),
            device=d["device"],
            reduce_op=d["reduce_op"],
            algorithm=d["algorithm"],
            grads=tuple(d["grads"]),
            numels=tuple(d["numels"]),
            comm_dtype=_dtype(d["comm_dtype"]) if "comm_dtype" in d else None,
            hook=tuple(d["hook"]) if "hook" in d else None,  # type: ignore[arg-type]
            cut=d.get("cut"),
            layout=d.get("layout"),
        )


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """The buckets of one graph, in issue order, and the tagged all-reduces left
    unfused (``(gradient label, reason, process group)``: each is one all-reduce of its
    own, issued after the plan check like a bucket)."""

    algorithm: str
    buckets: tuple[PlannedBucket, ...]
    unfused: tuple[tuple[str, str, str], ...] = ()

    def of_group(self, group: str) -> BucketPlan:
        """The buckets and unfused all-reduces of one process group: what that group's
        ranks must agree on (the plan check), and what a joined rank of it replays."""
        return BucketPlan(self.algorithm, tuple(b for b in self.buckets if b.group == group),
                          tuple(u for u in self.unfused if u[2] == group))

    @property
    def groups(self) -> list[str]:
        """The process groups of the buckets, in order of their first bucket, then those
        of unfused all-reduces only."""
        return list(dict.fromkeys([*(b.group for b in self.buckets), *(u[2] for u in self.unfused)]))

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(
            {
                "algorithm": self.algorithm,
                "buckets": [b.to_dict() for b in self.buckets],
                "unfused": [{"grad": n, "group": g, "reason": r} for n, r, g in self.unfused],
            },
            indent=indent,
        )

    @classmethod
    def from_json(cls, text: str) -> BucketPlan:
        d = json.loads(text)
        return cls(
            d["algorithm"],
            tuple(PlannedBucket.from_dict(b) for b in d["buckets"]),
            tuple((u["grad"], u["reason"], u["group"]) for u in d.get("unfused", ())),
        )
