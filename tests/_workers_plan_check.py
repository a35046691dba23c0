"""Per-rank bodies of tests/test_plan_check_switch_gloo.py: ``config.plan_check`` off on
every rank trains as eager torch DDP with no per-step exchange, and ``join()`` with
uneven inputs still works (the check runs inside the join context only)."""

import copy

import torch
import torch.distributed as dist

import ddp_fusion
from ddp_fusion import host_group

from _workers import count_all_reduces, mlp


def _exchanges() -> int:
    """The exchanges asked of the world group's host group so far."""
    known = host_group.known(dist.group.WORLD.group_name)
    return 0 if known is None else known[1].tickets


def _train(net, model, batches, counts=None):
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for x in batches:
        before = _exchanges()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if counts is not None:
            counts.append(_exchanges() - before)


def train_with_and_without_the_check(rank, world_size, steps=3):
    """Compiled torch DDP under the flag with ``plan_check`` on, then off, each against
    eager torch DDP on the same data: the parameter difference and the host group's
    exchanges in each step after the first (which compiles and agrees on settings).
    Then, with the check off, the same compiled model in ``join()`` with rank 1 out of
    batches after 1 step where rank 0 has 3, against eager torch DDP's ``join()``."""
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(8, 64, generator=gen) for _ in range(steps)]
    uneven = [torch.randn(8, 64, generator=gen) for _ in range(3 if rank == 0 else 1)]
    base = mlp()

    want = copy.deepcopy(base)
    ref = torch.nn.parallel.DistributedDataParallel(want)
    _train(want, ref, batches + batches[:1])  # (the compiled runs count the last step's all-reduces)
    after_even = copy.deepcopy(want)
    with ref.join():
        _train(want, ref, uneven)
    out = {}
    for check in (True, False):
        torch._dynamo.reset()
        net = copy.deepcopy(base)
        with ddp_fusion.config.patch(enabled=True, plan_check=check):
            ddp = torch.nn.parallel.DistributedDataParallel(net)
            model = torch.compile(ddp)
            counts = []
            _train(net, model, batches, counts)
            # all-reduces in one more step: 1 bucket (4 gradients of 16 KiB); unfused, 4
            fused = count_all_reduces(lambda net=net, model=model: _train(net, model, batches[:1]))
            diff = max((a - b).abs().max().item() for a, b in zip(net.parameters(), after_even.parameters()))
            join_diff = None
            if not check:
                with ddp.join():
                    _train(net, model, uneven)
                join_diff = max((a - b).abs().max().item()
                                for a, b in zip(net.parameters(), want.parameters()))
        out[check] = {"diff": diff, "exchanges": counts[1:], "fused": fused, "join_diff": join_diff}
    return out
