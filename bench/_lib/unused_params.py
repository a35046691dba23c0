"""Rank function of ``bench.unused_params``: collectives and bytes of one step with
``find_unused_parameters``, eager torch DDP against ddp_fusion compiled."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.profiler import profile

import ddp_fusion
from bench._lib import _torch
from bench._lib.models import MLP
from bench._lib.record import event_dtypes, nbytes


@torch.compiler.disable
def _experts_hit(idx: torch.Tensor, n: int) -> tuple[bool, ...]:
    hit = set(idx.tolist())
    return tuple(e in hit for e in range(n))


class MoE(nn.Module):
    """``layers`` x (top-1 mixture of ``experts`` MLP experts, width ``width``); an
    expert that gets no token is not run."""

    def __init__(self, width: int = 256, experts: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.routers = nn.ModuleList(nn.Linear(width, experts, bias=False) for _ in range(layers))
        self.experts = nn.ModuleList(
            nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
                          for _ in range(experts))
            for _ in range(layers)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for router, experts in zip(self.routers, self.experts):
            gate, idx = router(x).softmax(-1).max(-1)
            hit = _experts_hit(idx, len(experts))
            y = x
            for e, expert in enumerate(experts):
                if hit[e]:
                    y = y + ((idx == e).to(x.dtype) * gate).unsqueeze(-1) * expert(x)
            x = y
        return self.head(x)


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MoE() if name == "moe" else MLP(width=256, depth=8)


def _batches(name: str, rank: int, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = 6 if name == "moe" else 8  # few tokens: experts without a token on some ranks
    return [torch.randn(tokens, 256, generator=gen) for _ in range(steps)]


def count_step(rank: int, world_size: int, name: str, mode: str, cap_mb: float,
               steps: int = 4) -> dict[str, Any]:
    """Train ``steps`` steps of model ``name`` in ``mode`` (``eager``: torch DDP, flag off,
    not compiled; ``fused``: the ddp_fusion wrapper, compiled; ``fused_all_used``: the
    same without ``find_unused_parameters``), profiling the last: the collectives the
    process group ran and their bytes, and (ddp_fusion) the parameters absent from this
    rank's graph in that step."""
    find_unused = mode != "fused_all_used"
    net = _model(name)
    batches = _batches(name, rank, steps)
    counters = _torch.counters()
    counters.clear()
    if mode == "eager":
        model: Any = nn.parallel.DistributedDataParallel(copy.deepcopy(net), bucket_cap_mb=cap_mb,
                                                         find_unused_parameters=True)
    else:
        ddp_fusion.config.enabled = True
        model = torch.compile(ddp_fusion.DistributedDataParallel(
            copy.deepcopy(net), bucket_cap_mb=cap_mb, find_unused_parameters=find_unused))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x: torch.Tensor) -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for x in batches[:-1]:
        step(x)
    absent = counters["ddp_fusion"]["unused: absent gradients"]
    with profile(record_shapes=True) as prof:
        step(batches[-1])
    collectives: dict[str, int] = {}
    sent = 0
    for e in prof.events():
        if e.name.startswith("gloo:"):
            collectives[e.name] = collectives.get(e.name, 0) + 1
            sent += nbytes(e.input_shapes, event_dtypes(e))
    params = sum(1 for p in net.parameters())
    return {
        "collectives": collectives,
        "bytes": sent,
        "parameters": params,
        "unused_here": sum(p.grad is None for p in model.parameters()) if mode == "eager" else None,
        "absent_last_step": counters["ddp_fusion"]["unused: absent gradients"] - absent,
        "eager_buckets": _torch.ddp_bucket_count(model) if mode == "eager" else None,
    }
