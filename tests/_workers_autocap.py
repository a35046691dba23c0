"""Rank bodies for tests/test_autocap.py (importable by spawned ranks)."""

import copy
import logging

import torch

import ddp_fusion
from ddp_fusion.plan import MiB

from _workers import train
from _workers_buckets import uneven_mlp


def auto_caps_against_eager_ddp(rank, world_size, steps=3):
    """``bucket_cap_mb="auto"`` on 2 ranks with the link measured (gloo): each rank's
    choice, its collectives per step, and the parameter difference to eager torch DDP
    given the caps that were chosen."""
    base = uneven_mlp()
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(8, 300, generator=gen) for _ in range(steps)]
    torch._dynamo.reset()
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("ddp_fusion")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    with torch._inductor.config.patch(fx_graph_cache=False), ddp_fusion.config.patch(enabled=True):
        wrapper = ddp_fusion.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb="auto")
        collectives = train(torch.compile(wrapper), batches)
    logger.removeHandler(handler)
    choice = wrapper.bucket_sizing
    caps_mb = [c / MiB for c in choice.limits]
    with ddp_fusion.config.patch(enabled=False):
        ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb_list=caps_mb)
        eager_collectives = train(ref, batches)
    return {
        "limits": choice.limits,
        "link": (choice.link.alpha, choice.link.beta),
        "measured": choice.measured_link,
        "collectives": collectives,
        "eager_collectives": eager_collectives,
        "logged": [m for m in said if "bucket_cap_mb='auto'" in m],
        "max_diff": max((p - q).abs().max().item()
                        for p, q in zip(wrapper.module.parameters(), ref.module.parameters())),
    }
