"""Per-rank bodies of the join() tests (issue 16): ranks with different numbers of
batches, against eager torch DDP with ``join()``."""

import copy
import gc

import torch
from torch import nn

import ddp_fusion
from ddp_fusion import _torch

BATCHES = (5, 3, 4)  # per rank: rank 1 runs out first, then rank 2


class Net(nn.Module):
    """Two buckets at ``bucket_cap_mb=0.005``, and BatchNorm buffers (broadcast at each
    forward, from the highest active rank under join, as torch DDP)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 32, bias=False)
        self.bn = nn.BatchNorm1d(32)
        self.b = nn.Linear(32, 32)

    def forward(self, x):
        return self.b(torch.tanh(self.bn(self.a(x))))


def _all_reduces(fn):
    with _torch.distributed.AllReduces() as n:
        out = fn()
    return out, n.count


def _train_joined(model, ddp, batches, divide, throw=False):
    """SGD inside ``ddp.join()``; returns all-reduces per step (each step) and in the
    join loop at the end (exit)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = []
    ctx = ddp.join(divide_by_initial_world_size=divide, throw_on_early_termination=throw)
    ctx.__enter__()
    try:
        for x in batches:
            def step(x=x):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
            per_step.append(_all_reduces(step)[1])
    except BaseException as e:
        ctx.__exit__(type(e), e, e.__traceback__)
        raise
    _, exit_count = _all_reduces(lambda: ctx.__exit__(None, None, None))
    return per_step, exit_count


def join_uneven(rank, world_size, kind):
    """``kind``: ``wrapper_compiled``, ``stock_compiled`` (torch DDP built with the flag
    on), ``wrapper_uncompiled`` (the eager bucketed reducer), or
    ``wrapper_flag_uncompiled`` / ``stock_flag_uncompiled`` (the flag on, the model not
    compiled: the eager bucketed reducer too)."""
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(8, 32, generator=gen) * (1 + rank) for _ in range(BATCHES[rank])]
    base = Net()
    out = {}
    refs = {}
    for divide in (True, False):
        ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.005)
        _train_joined(ref, ref, batches, divide)
        refs[divide] = ref.module

    compiled = kind.endswith("_compiled") and not kind.endswith("_uncompiled")
    torch._dynamo.reset()
    with ddp_fusion.config.patch(enabled=compiled or "_flag_" in kind):
        if kind.startswith("stock"):
            ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.005)
        else:
            ddp = ddp_fusion.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.005)
        model = torch.compile(ddp) if compiled else ddp
        for divide in (True, False):
            ddp.module.load_state_dict(base.state_dict())  # same compiled model, fresh state
            per_step, exit_count = _train_joined(model, ddp, batches, divide)
            want = refs[divide]
            out[f"divide_{divide}"] = {
                "params": max((p - q).abs().max().item()
                              for p, q in zip(ddp.module.parameters(), want.parameters())),
                "buffers": max((p.float() - q.float()).abs().max().item()
                               for p, q in zip(ddp.module.buffers(), want.buffers())),
                "per_step": per_step,
                "exit": exit_count,
                "shadowed": max(BATCHES[:world_size]) - BATCHES[rank],
            }
        # throw_on_early_termination: every rank raises, none hangs
        try:
            _train_joined(model, ddp, batches, True, throw=True)
            out["throw"] = None
        except RuntimeError as e:
            out["throw"] = str(e)
        if compiled:
            from torch._dynamo.utils import counters

            out["unfused"] = {k: v for k, v in counters["ddp_fusion"].items() if k.startswith("unfused")}
            # the model made again (a k-fold loop): the same names, so the same model id,
            # and Dynamo runs the forward it traced for the one before
            del model, ddp
            gc.collect()
            stock = kind.startswith("stock")
            make = nn.parallel.DistributedDataParallel if stock else ddp_fusion.DistributedDataParallel
            ddp = make(copy.deepcopy(base), bucket_cap_mb=0.005)
            try:
                _train_joined(torch.compile(ddp), ddp, batches, True)
                out["made_again"] = max((p - q).abs().max().item()
                                        for p, q in zip(ddp.module.parameters(), refs[True].parameters()))
            except RuntimeError as e:
                out["made_again"] = str(e)
    return out


def join_with_zero(rank, world_size):
    """``Join([model, ZeroRedundancyOptimizer])``, compiled wrapper, against torch DDP
    with the same: the optimizer's join hook shadows its parameter broadcasts after
    ddp_fusion's hook shadows the step's gradient collectives."""
    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer

    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(8, 32, generator=gen) * (1 + rank) for _ in range(BATCHES[rank])]
    base = Net()

    def run(model, ddp):
        opt = ZeroRedundancyOptimizer(ddp.module.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        with Join([ddp, opt]):
            for x in batches:
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
        return [p.detach() for p in ddp.module.parameters()]

    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.005)
    want = run(ref, ref)
    torch._dynamo.reset()
    with ddp_fusion.config.patch(enabled=True):
        ddp = ddp_fusion.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.005)
        got = run(torch.compile(ddp), ddp)
    return max((g - w).abs().max().item() for g, w in zip(got, want))
