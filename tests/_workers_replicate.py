"""Per-rank body of the composable ``replicate()`` test: torch's
``torch.distributed._composable.replicate`` with the flag on and ``torch.compile``,
against eager ``replicate()`` (flag off, not compiled)."""

import copy
import logging

import torch
from torch.distributed._composable.replicate import replicate

import ddp_fusion
from ddp_fusion import _torch

from _workers import mlp, train


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _ddp_of(model):
    """The torch DDP that replicate() built (lazily, at the first forward)."""
    return replicate.state(model)._ddp


def replicate_fused(rank, world_size, caps, steps=3):
    """For each bucket cap (None: DDP's default), train a biased MLP of about 1 MiB
    (several buckets at 0.5 MB) with eager replicate() and with replicate() under the
    flag and torch.compile; report the parameter difference, the all-reduces of the last
    step and eager DDP's bucket count. A failure of the fused run is reported, not raised,
    so that every cap is reported."""
    records = _Records()
    logging.getLogger("ddp_fusion").addHandler(records)
    gen = torch.Generator().manual_seed(100 + rank)
    base = mlp(width=256, depth=4, bias=True)
    batches = [torch.randn(8, 256, generator=gen) for _ in range(steps)]
    out = {}
    for cap in caps:
        kwargs = {} if cap is None else {"bucket_cap_mb": cap}
        ref = replicate(copy.deepcopy(base), **kwargs)
        eager_collectives = train(ref, batches)
        got = {
            "eager_collectives": eager_collectives,
            "eager_buckets": len(_ddp_of(ref)._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(",")),
        }
        torch._dynamo.reset()
        counters = _torch.dynamo.counters()
        counters.clear()
        records.messages.clear()
        try:
            with ddp_fusion.config.patch(enabled=True):
                model = replicate(copy.deepcopy(base), **kwargs)
                got["collectives"] = train(torch.compile(model), batches)
        except Exception as e:  # noqa: BLE001 - reported to the test
            got["error"] = f"{type(e).__name__}: {e}"
        else:
            got["adopted"] = hasattr(_ddp_of(model), "_ddp_fusion")
            got["max_diff"] = max(
                (a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())
            )
        got["fused"] = dict(counters["ddp_fusion"])
        got["warnings"] = list(records.messages)
        out[cap] = got
    return out
