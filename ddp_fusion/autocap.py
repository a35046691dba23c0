"""``bucket_cap_mb="auto"``: bucket limits chosen for the link and the backward.

DDP's default caps (a 1 MiB first bucket, then 25 MiB) are a guess made for one kind of
cluster. With ``"auto"``, the first time the model's forward runs compiled, ddp_fusion
measures the two things that decide how much communication a bucket plan can hide:

* the link: ``alpha`` (a collective's fixed cost: the fastest all-reduce of a few bytes)
  and ``beta`` (its cost per byte: the difference between the fastest all-reduces of two
  larger sizes) on the model's process group, or taken from ``config.link``;
* the backward: when each gradient becomes ready, from one eager forward and backward
  of the model on inputs shaped like the real ones (real parameters, no ``.grad``
  written, buffers restored), which also gives eager autograd's ready order.

Then it predicts each candidate plan's exposed communication with the same model of
the link everywhere (buckets in DDP's order, each issued when its last gradient is
ready and the link is free, taking ``alpha + beta * bytes``; what finishes after the
last gradient is exposed), over uniform caps and a 1 MiB first bucket followed by
them. Each plan's cost is its predicted exposed communication plus ``alpha`` for every
collective it has more than DDP's default (minus for every one fewer): a collective's
fixed cost is paid somewhere even when the model says it is hidden. The model leaves
out how a transfer and the backward slow each other down when they share the host (on a
CPU with few cores, moving the bytes competes with backward for the cores), so it is
used cautiously: among the plans whose cost is within :data:`NEAR` of the best, the one
with the fewest buckets wins, and DDP's default stays unless that plan costs less by
more than :data:`MARGIN` of the backward. Candidate caps above
``config.max_in_flight_mb`` are not considered; DDP's default stays the fallback
whatever the budget (with a budget below a bucket, the pass waits for each earlier
bucket before issuing the next). Group rank 0's choice is broadcast, so
every rank runs the same plan (which the plan check verifies); it is made once per
model and holds for every graph the model compiles. It is logged at INFO with the
measured ``alpha``, ``beta`` and backward time and the predicted exposed communication
of the default and the chosen plan, and written to ``config.dump_dir`` as
``rank<R>_autocap_<model id>.json``.

Only the data-parallel buckets are sized: tensor-parallel collectives in the model are
not ddp_fusion's and run in the timing run as they would in a step. A model that never
runs compiled uses DDP's default caps (the eager reducer).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import _torch, ready_order
from .config import config
from .host_group import HostGroup
from .log import log
from .plan import DEFAULT_BUCKET_CAP_MB, MiB, split_by_rule

AUTO = "auto"
#: Candidate caps (MiB), uniform or after a 1 MiB first bucket.
CAPS_MB = (0.25, 0.5, 1, 2, 4, 8, 16, 25, 32, 64, 128, 256)
#: Keep DDP's default unless the chosen plan saves more than this share of the backward.
MARGIN = 0.05
#: Plans predicted within this share of the backward of the best count as as good; the
#: one with the fewest buckets among them is chosen.
NEAR = 0.05
#: Sizes (bytes) of the all-reduces that measure the link: ``alpha`` from the first,
#: ``beta`` from the difference of the other two; repetitions of each (the fastest
#: counts: noise only adds).
PROBE_BYTES = (1 << 10, 1 << 20, 1 << 22)
PROBE_REPS = 5


@dataclasses.dataclass
class Link:
    """A collective of ``n`` bytes on the link takes ``alpha + beta * n`` seconds."""

    alpha: float
    beta: float

    def time(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes


@dataclasses.dataclass
class Choice:
    """What ``"auto"`` chose, and why."""

    limits: list[int]
    link: Link
    backward_s: float
    exposed_default_s: float
    exposed_chosen_s: float
    buckets_default: int
    buckets_chosen: int
    measured_link: bool

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Choice:
        """The inverse of ``dataclasses.asdict``."""
        return cls(**{**d, "link": Link(**d["link"])})

    def describe(self) -> str:
        return (
            f"bucket caps {[round(c / MiB, 3) for c in self.limits]} MiB "
            f"({self.buckets_chosen} buckets; DDP's default: {self.buckets_default}); link "
            f"alpha {1e6 * self.link.alpha:.0f} us, beta {_gbps(self.link.beta):.2f} GB/s "
            f"({'measured' if self.measured_link else 'config.link'}); backward "
            f"{1e3 * self.backward_s:.1f} ms; predicted exposed communication "
            f"{1e3 * self.exposed_chosen_s:.2f} ms (DDP's default caps: "
            f"{1e3 * self.exposed_default_s:.2f} ms)"
        )


def _gbps(beta: float) -> float:
    return float("inf") if beta <= 0 else 1e-9 / beta


def default_limits() -> list[int]:
    return [_torch.ddp.DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * MiB]


def predict(sizes: Sequence[int], ready: Sequence[float], backward_s: float,
            limits: Sequence[int], link: Link) -> tuple[float, int]:
    """Exposed communication (seconds) and bucket count of DDP's buckets under
    ``limits``, for gradients of ``sizes`` bytes ready at ``ready`` seconds into a
    backward of ``backward_s`` seconds, in the order given (ready order)."""
    buckets = split_by_rule(range(len(sizes)), sizes.__getitem__, limits)
    free = 0.0  # when the link is next free
    for bucket in buckets:
        start = max(free, max(ready[i] for i in bucket))
        free = start + link.time(sum(sizes[i] for i in bucket))
    return max(0.0, free - backward_s), len(buckets)


def choose(sizes: Sequence[int], ready: Sequence[float], backward_s: float, link: Link,
           max_in_flight: int | None = None, measured_link: bool = True) -> Choice:
    """The limits to use (see the module docstring), for gradients in ready order."""
    default = default_limits()
    exposed_default, n_default = predict(sizes, ready, backward_s, default, link)
    candidates = [[int(c * MiB)] for c in CAPS_MB]
    candidates += [[MiB, int(c * MiB)] for c in CAPS_MB if c > 1]
    if max_in_flight is not None:
        candidates = [c for c in candidates if max(c) <= max_in_flight]
    scored = [(limits, *predict(sizes, ready, backward_s, limits, link)) for limits in candidates]

    def cost(exposed: float, n: int) -> float:
        # each collective more than DDP's default costs alpha, hidden or not
        return exposed + (n - n_default) * link.alpha

    lowest = min((cost(e, n) for _, e, n in scored), default=exposed_default)
    near = [s for s in scored if cost(s[1], s[2]) <= lowest + NEAR * backward_s]
    # fewest buckets, then least exposed, then the largest caps
    best, exposed_best, n_best = min(near, key=lambda s: (s[2], s[1], -max(s[0])),
                                     default=(default, exposed_default, n_default))
    if exposed_default - cost(exposed_best, n_best) <= MARGIN * backward_s:
        best, exposed_best, n_best = default, exposed_default, n_default
    return Choice(list(best), link, backward_s, exposed_default, exposed_best, n_default, n_best,
                  measured_link)


def measure_link(group: dist.ProcessGroup, device: torch.device, host: HostGroup | None) -> Link | str:
    """The link of ``group`` from the fastest of :data:`PROBE_REPS` all-reduces of each
    of :data:`PROBE_BYTES`: ``alpha`` is the time of the smallest, ``beta`` the slope
    between the two larger (every rank must call it). The probe tensors are made first,
    and the ranks agree on ``host`` that every one could make them before any probe is
    issued: if one could not (out of memory, say), none probes, and every rank gets why
    (a string) instead of a link.

    A slope between two large sizes, not a least-squares fit through all three, because
    what a small all-reduce costs is not on the line through the large ones: a shaped
    link's burst, or a small-message algorithm, makes the intercept of such a fit
    meaningless (it came out as 0 us or as 1.9 ms on the same loopback)."""
    try:
        probes = [torch.zeros(nbytes // 4, dtype=torch.float32, device=device) for nbytes in PROBE_BYTES]
        failed = None
    except Exception as e:  # noqa: BLE001 - every rank must hear of it before probing
        probes, failed = [], f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    if host is not None and host.max([failed is not None])[0]:
        return failed or "another rank could not make the link probe's tensors"
    if failed is not None:
        return failed
    fastest = []
    for t in probes:
        dist.all_reduce(t, group=group)  # warm-up: connections, buffers
        times = []
        for _ in range(PROBE_REPS):
            _sync(device)
            t0 = time.perf_counter()
            dist.all_reduce(t, group=group)
            _sync(device)
            times.append(time.perf_counter() - t0)
        fastest.append(min(times))
    (_, t_small), (n_mid, t_mid), (n_big, t_big) = zip(PROBE_BYTES, fastest)
    beta = max((t_big - t_mid) / (n_big - n_mid), 1e-13)
    return Link(t_small, beta)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def link_of(group: dist.ProcessGroup, device: torch.device,
            host: HostGroup | None) -> tuple[Link, bool] | str:
    """``config.link`` (latency in microseconds, bandwidth in GB/s), else the link
    measured now (every rank of ``group`` must call it then, with the same
    ``config.link``: the settings check, settings_check.py, compares it first); and
    whether measured. Why not, if it could not be measured."""
    if config.link is None:
        link = measure_link(group, device, host)
        return link if isinstance(link, str) else (link, True)
    return configured_link(config.link), False


def configured_link(link: tuple[float, float]) -> Link:
    """``config.link``'s ``(latency in microseconds, bandwidth in GB/s)`` as a Link."""
    latency_us, gbytes_per_s = link
    return Link(latency_us * 1e-6, 1e-9 / gbytes_per_s)


def decide(module: torch.nn.Module, names: list[str], local_sizes: list[int], link: Link,
           measured_link: bool, args: Any, kwargs: Any) -> tuple[list[int], Choice] | str:
    """Eager autograd's ready order (indices into ``names``) and the chosen limits, from
    a timed eager run on inputs like ``args``/``kwargs``; why not (a line, not logged)
    if the model cannot run so (DDP's caps then)."""
    timed = ready_order.timed_ready_order(module, names, args, kwargs)
    if isinstance(timed, str):
        return timed
    order, ready = timed  # ready[k]: when gradient order[k] became ready
    sizes = [local_sizes[i] for i in order]
    backward_s = max(ready, default=0.0)
    budget = None if config.max_in_flight_mb is None else int(config.max_in_flight_mb * MiB)
    return order, choose(sizes, ready, backward_s, link, budget, measured_link)


def show(choice: Choice, model_id: int, from_rank0: bool) -> None:
    """Log and dump the choice this rank runs (``from_rank0``: decided by group rank 0)."""
    log.info("ddp_fusion: bucket_cap_mb='auto' for model %d%s: %s", model_id,
             " (group rank 0's choice)" if from_rank0 else "", choice.describe())
    if config.dump_dir:
        os.makedirs(config.dump_dir, exist_ok=True)
        rank = dist.get_rank() if dist.is_initialized() else 0
        path = os.path.join(config.dump_dir, f"rank{rank}_autocap_{model_id}.json")
        with open(path, "w") as f:
            json.dump({**dataclasses.asdict(choice), "summary": choice.describe()}, f, indent=1)
