"""Hand-written Megatron-style tensor parallelism with functional collectives.

Shared by the DP x TP step-time benchmark (``--model mlp_tp``) and the DP x TP tests:
the TP all-reduces are plain ``_c10d_functional.all_reduce`` on the TP group, so in a
compiled backward they sit between the DDP gradient all-reduces, which is the case
ddp_fusion must leave alone.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as fcol
import torch.nn.functional as F
from torch import nn


class CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: sum the input gradient over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return fcol.all_reduce(grad, "sum", ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """Forward: sum partial outputs over the TP group. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return fcol.all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TPBlock(nn.Module):
    """``x + W2 gelu(W1 x + b1) + b2`` with W1 split by rows and W2 by columns over TP.

    Each TP rank holds its slice of the same full weights (drawn from ``seed``), so the
    block computes what one unsplit block would."""

    def __init__(self, d: int, h: int, tp_group, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        tp_rank, tp_size = tp_group.rank(), tp_group.size()
        self.tp_group = tp_group
        w1 = torch.randn(h, d, generator=g) / d**0.5
        w2 = torch.randn(d, h, generator=g) / h**0.5
        self.w1 = nn.Parameter(w1.chunk(tp_size, 0)[tp_rank].clone())
        self.b1 = nn.Parameter(torch.zeros(h).chunk(tp_size)[tp_rank].clone())
        self.w2 = nn.Parameter(w2.chunk(tp_size, 1)[tp_rank].clone())
        self.b2 = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(CopyToTP.apply(x, self.tp_group), self.w1, self.b1))
        return x + ReduceFromTP.apply(F.linear(h, self.w2), self.tp_group) + self.b2
