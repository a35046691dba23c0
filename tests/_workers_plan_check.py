"""Per-rank bodies of tests/test_plan_check_switch_gloo.py: ``config.plan_check`` off on
every rank trains as eager torch DDP with no per-step exchange; ``join()`` is refused
then, on every rank."""

import copy

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join

import ddp_fusion
from ddp_fusion import host_group

from _workers import mlp


def _exchanges() -> int:
    """The exchanges asked of the world group's host group so far."""
    known = host_group.known(dist.group.WORLD.group_name)
    return 0 if known is None else known[1].tickets


def train_with_and_without_the_check(rank, world_size, steps=3):
    """Compiled torch DDP under the flag with ``plan_check`` on, then off, each against
    eager torch DDP on the same data: the parameter difference and the host group's
    exchanges during the steps (the first step's excluded: it compiles and agrees on
    settings)."""
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(8, 64, generator=gen) for _ in range(steps)]
    base = mlp()

    def train(net, model):
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        counts = []
        for x in batches:
            before = _exchanges()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            counts.append(_exchanges() - before)
        return counts[1:]

    want = copy.deepcopy(base)
    train(want, torch.nn.parallel.DistributedDataParallel(want))
    out = {}
    for check in (True, False):
        torch._dynamo.reset()
        net = copy.deepcopy(base)
        with ddp_fusion.config.patch(enabled=True, plan_check=check):
            model = torch.compile(torch.nn.parallel.DistributedDataParallel(net))
            exchanges = train(net, model)
            fused = torch._dynamo.utils.counters["ddp_fusion"]["fused_all_reduces"]
            try:
                with Join([model]):
                    pass
                join = None
            except ValueError as e:
                join = str(e)
        out[check] = {
            "diff": max((a - b).abs().max().item() for a, b in zip(net.parameters(), want.parameters())),
            "exchanges": exchanges, "fused": fused, "join": join,
        }
    return out
