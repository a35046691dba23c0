"""Per-rank bodies of the stock torch DDP tests (issue 13): a
``torch.nn.parallel.DistributedDataParallel`` constructed with the flag on, against the
same model under eager torch DDP (flag off)."""

import copy
import inspect

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import ddp_fusion
from ddp_fusion import _torch

from _workers import count_all_reduces, mlp
from _workers import train as _train


def _max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


class BNNet(nn.Module):
    """BatchNorm running statistics: with rank-dependent data, ranks' statistics drift
    apart unless buffers are broadcast at each forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 32, bias=False)
        self.bn = nn.BatchNorm1d(32)
        self.b = nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


class OneUnused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.unused = (nn.Linear(32, 32) for _ in range(3))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def stock_ddp(rank, world_size):
    stock = torch.nn.parallel.DistributedDataParallel
    gen = torch.Generator().manual_seed(100 + rank)
    out = {}

    # 1. A torchrun-style script: torch DDP, then torch.compile; several buckets.
    base = mlp()
    batches = [torch.randn(8, 64, generator=gen) for _ in range(4)]
    ref = stock(copy.deepcopy(base), bucket_cap_mb=0.03)
    want_collectives = _train(ref, batches)
    torch._dynamo.reset()
    counters = _torch.dynamo.counters()
    counters.clear()
    with ddp_fusion.config.patch(enabled=True):
        ddp = stock(copy.deepcopy(base), bucket_cap_mb=0.03)
        got_collectives = _train(torch.compile(ddp), batches)
    out["plain"] = {
        "is_stock": isinstance(ddp, stock) and type(ddp).__name__ == "DistributedDataParallel",
        "adopted": hasattr(ddp, "_ddp_fusion"),
        "eager_buckets": len(ref._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(",")),
        "eager_collectives": want_collectives,
        "collectives": got_collectives,
        "max_diff": _max_diff(ddp.module.parameters(), ref.module.parameters()),
        "fused": dict(counters["ddp_fusion"]),
        "graph_breaks": sum(counters["graph_break"].values()),
    }

    # 2. Buffers broadcast at each forward (stock and wrapper), and not with
    # broadcast_buffers=False; data scaled per rank so statistics differ per rank.
    bn_batches = [torch.randn(8, 16, generator=gen) * (1 + 2 * rank) for _ in range(3)]
    for flag in (True, False):
        ref = stock(BNNet(), broadcast_buffers=flag)
        _train(ref, bn_batches)
        with ddp_fusion.config.patch(enabled=True):
            torch._dynamo.reset()
            for kind, make in (("stock", stock), ("wrapper", ddp_fusion.DistributedDataParallel)):
                model = make(BNNet(), broadcast_buffers=flag)
                _train(torch.compile(model), bn_batches)
                out[f"buffers_{kind}_{flag}"] = {
                    "buffers": _max_diff(model.module.buffers(), ref.module.buffers()),
                    "params": _max_diff(model.module.parameters(), ref.module.parameters()),
                }

    # torch 2.13's forward_sync_buffers=False (broadcast_buffers is deprecated since):
    # buffers broadcast at construction, not at forwards
    if "forward_sync_buffers" in inspect.signature(stock.__init__).parameters:
        ref = stock(BNNet(), forward_sync_buffers=False)
        _train(ref, bn_batches)
        with ddp_fusion.config.patch(enabled=True):
            torch._dynamo.reset()
            model = stock(BNNet(), forward_sync_buffers=False)
            _train(torch.compile(model), bn_batches)
        out["buffers_forward_sync_off"] = {
            "buffers": _max_diff(model.module.buffers(), ref.module.buffers()),
            "params": _max_diff(model.module.parameters(), ref.module.parameters()),
        }

    # 3. no_sync, find_unused_parameters, a process group that is not the world.
    group = torch.distributed.new_group(list(range(world_size)))
    ub = [torch.randn(8, 32, generator=gen) for _ in range(3)]
    ref = stock(OneUnused(), process_group=group, find_unused_parameters=True, bucket_cap_mb=0.005)
    with ref.no_sync():
        ref(ub[0]).square().mean().backward()
    ref(ub[1]).square().mean().backward()
    torch._dynamo.reset()
    with ddp_fusion.config.patch(enabled=True):
        ddp = stock(OneUnused(), process_group=group, find_unused_parameters=True, bucket_cap_mb=0.005)
        model = torch.compile(ddp)
        with ddp.no_sync():
            inside = count_all_reduces(lambda: model(ub[0]).square().mean().backward())
        model(ub[1]).square().mean().backward()
    grads = [p.grad for n, p in ddp.module.named_parameters() if "unused" not in n]
    want = [p.grad for n, p in ref.module.named_parameters() if "unused" not in n]
    out["no_sync_unused_group"] = {
        "collectives_inside": inside,
        "max_diff": _max_diff(grads, want),
        "unused_grad_none": ddp.module.unused.weight.grad is None and ref.module.unused.weight.grad is None,
    }

    # 4. torch's fp16 / bf16 compress hooks become the buckets' communication dtype.
    hooks = (("fp16", default_hooks.fp16_compress_hook), ("bf16", default_hooks.bf16_compress_hook))
    for name, hook in hooks:
        base = mlp(width=32, depth=3, bias=True)
        hb = [torch.randn(8, 32, generator=gen) * (1 + rank) for _ in range(3)]
        ref = stock(copy.deepcopy(base), bucket_cap_mb=0.005)
        # torch refuses bf16_compress_hook without NCCL/CUDA (an NCCL-version check);
        # gloo reduces bf16, so run torch's own hook code as the reference anyway
        ref._check_comm_hook = lambda hook: None
        ref.register_comm_hook(None, hook)
        _train(ref, hb)
        torch._dynamo.reset()
        with ddp_fusion.config.patch(enabled=True):
            ddp = stock(copy.deepcopy(base), bucket_cap_mb=0.005)
            ddp.register_comm_hook(None, hook)
            _train(torch.compile(ddp), hb)
        out[f"hook_{name}"] = {
            "max_diff": _max_diff(ddp.module.parameters(), ref.module.parameters()),
            "comm_dtype": str(ddp._ddp_fusion.state.comm_dtype),
        }

    # 5. Parameters and buffers marked to be ignored by DDP
    # (_set_params_and_buffers_to_ignore_for_model) are neither broadcast (at
    # construction, at forwards) nor reduced: each rank keeps its own.
    def marked():
        net = BNNet()
        with torch.no_grad():
            net.b.weight += rank  # differs per rank, and stays so
        stock._set_params_and_buffers_to_ignore_for_model(net, ["b.weight", "bn.running_mean"])
        return net

    ref = stock(marked())
    _train(ref, bn_batches)
    for kind, make in (("stock", stock), ("wrapper", ddp_fusion.DistributedDataParallel)):
        torch._dynamo.reset()
        with ddp_fusion.config.patch(enabled=True):
            model = make(marked())
            _train(torch.compile(model), bn_batches)
        out[f"ignored_{kind}"] = {
            "params": _max_diff(model.module.parameters(), ref.module.parameters()),
            "buffers": _max_diff(model.module.buffers(), ref.module.buffers()),
            "b_weight_from_rank_0": _max_diff([model.module.b.weight], [marked().b.weight - rank]),
        }
    return out
