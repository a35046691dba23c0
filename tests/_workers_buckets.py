"""Rank bodies for tests/test_bucket_membership_gloo.py (importable by spawned ranks)."""

import copy
import glob
import json
import os

import torch

import ddp_fusion
from ddp_fusion import _torch
from ddp_fusion.plan import ddp_bucket_limits

from _workers import train

BUCKET_ARGS = {
    "default": {},
    "cap": {"bucket_cap_mb": 0.25},
    "cap_list": {"bucket_cap_mb_list": [0.25, 0.5, 1.0]},
}


def uneven_mlp():
    """Linear layers with biases and uneven widths (300 -> 700 -> 129 -> 1500 -> 64 ->
    900 -> 33): a Linear's bias gradient is ready before its weight gradient in eager
    autograd, after it in a compiled backward."""
    torch.manual_seed(0)
    dims = [300, 700, 129, 1500, 64, 900, 33]
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def eager_buckets(model, limits):
    """Eager DDP's rebuilt buckets by parameter name: eager autograd's ready order (from
    hooks on a plain copy) cut by torch's own C++ ``compute_bucket_assignment_by_size``."""
    order = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=n: order.append(n))
    model(torch.randn(2, 300)).sum().backward()
    params = dict(model.named_parameters())
    buckets = _torch.ddp.compute_bucket_assignment_by_size(
        [params[n] for n in order], limits, list(range(len(order)))
    )
    return [[order[i] for i in b] for b in buckets]


def bucket_membership(rank, world_size, dump_root, steps=3):
    """For each bucket argument set: torch DDP's rebuilt bucket sizes, the expected
    membership, ddp_fusion's compiled plan, collectives per step and the parameter
    difference to torch DDP after ``steps`` SGD steps."""
    base = uneven_mlp()
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(8, 300, generator=gen) for _ in range(steps)]

    out = {}
    for label, kwargs in BUCKET_ARGS.items():
        limits = ddp_bucket_limits(kwargs.get("bucket_cap_mb"), kwargs.get("bucket_cap_mb_list"))
        want = eager_buckets(copy.deepcopy(base), limits)
        with ddp_fusion.config.patch(enabled=False):
            ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), **kwargs)
            train(ref, batches)
        sizes = [int(s) for s in ref._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(",")]
        params = dict(base.named_parameters())
        dump_dir = os.path.join(dump_root, f"rank{rank}_{label}")
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False), ddp_fusion.config.patch(
            enabled=True, dump_dir=dump_dir
        ):
            model = torch.compile(ddp_fusion.DistributedDataParallel(copy.deepcopy(base), **kwargs))
            collectives = train(model, batches)
        plans = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(dump_dir, "*.buckets.json")))]
        out[label] = {
            "torch_rebuilt_sizes": sizes,
            "want": want,
            "want_sizes": [sum(params[n].numel() * 4 for n in b) for b in want],
            "got": [[b["grads"] for b in plan["buckets"]] for plan in plans],
            "collectives": collectives,
            "max_diff": max(
                (p - q).abs().max().item()
                for p, q in zip(model.module.parameters(), ref.module.parameters())
            ),
        }
    return out


class ShapeDependent(torch.nn.Module):
    """Runs ``a`` then ``b`` for batches over 4 rows, ``b`` then ``a`` otherwise: eager
    autograd's ready order depends on the first batch a rank sees."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x)) if x.shape[0] > 4 else self.a(self.b(x))


def first_batches_differ(rank, world_size):
    """Rank 0's first batch has 8 rows, rank 1's 3: each would learn another ready
    order. Every rank must take rank 0's (as eager DDP rebuilds from rank 0's), so the
    compiled plans agree; returns each rank's learned positions and any error."""
    from ddp_fusion import PlanMismatchError

    torch._dynamo.reset()
    with ddp_fusion.config.patch(enabled=True):
        wrapper = ddp_fusion.DistributedDataParallel(ShapeDependent(), bucket_cap_mb=0)
        model = torch.compile(wrapper)
        try:
            for rows in ((8, 3)[rank], 8, 8):
                model(torch.randn(rows, 4)).sum().backward()
        except PlanMismatchError as e:
            return wrapper._state.ready_position, str(e)
    return wrapper._state.ready_position, None
