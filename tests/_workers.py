"""Per-rank bodies of the multi-process tests (importable by spawned ranks)."""

import copy

import torch
from torch.profiler import profile

import ddp_fusion


def mlp(width=64, depth=4, seed=0, bias=False):
    """Bias-free by default: then the order gradients become ready is the same in eager
    autograd and in a compiled backward, so bucket counts can be compared exactly (with
    biases, the compiled backward computes a layer's weight gradient before its bias
    gradient, eager autograd the other way round; see README, "Limits")."""
    torch.manual_seed(seed)
    layers = []
    for i in range(depth):
        layers += [torch.nn.Linear(width, width, bias=bias), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def count_all_reduces(step):
    """Collectives the process group actually ran during ``step()``."""
    with profile() as prof:
        step()
    return sum(1 for e in prof.events() if e.name == "gloo:all_reduce")


def train(model, batches, lr=0.05):
    """SGD over ``batches``; returns the all-reduce count of the last step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step(x):
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()

    for x in batches[:-1]:
        step(x)
    return count_all_reduces(lambda: step(batches[-1]))


def compare_with_eager_ddp(rank, world_size, algorithms, steps=4, bucket_cap_mb=0.03):
    """Train the same model with eager torch DDP and with ddp_fusion (each algorithm);
    return per-algorithm max parameter difference and collective counts."""
    base = mlp()
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    batches = [torch.randn(8, 64, generator=gen) for _ in range(steps)]

    with ddp_fusion.config.patch(enabled=False):
        ref = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb
        )
        eager_collectives = train(ref, batches)
        eager_buckets = len(ref._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))
    want = [p.detach() for p in ref.module.parameters()]

    out = {"eager_collectives": eager_collectives, "eager_buckets": eager_buckets}
    for algorithm in algorithms:
        torch._dynamo.reset()
        with ddp_fusion.config.patch(enabled=True, algorithm=algorithm):
            model = torch.compile(
                ddp_fusion.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb)
            )
            collectives = train(model, batches)
        got = [p.detach() for p in model.module.parameters()]
        out[algorithm] = {
            "collectives": collectives,
            "max_diff": max((g - w).abs().max().item() for g, w in zip(got, want)),
        }
    return out


class TwoBranch(torch.nn.Module):
    """``b`` is used only when ``use_b``: set it per rank for rank-dependent graphs."""

    def __init__(self, use_b=True):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.use_b = use_b

    def forward(self, x):
        x = self.a(x)
        return self.b(x) if self.use_b else x


def mismatched_plans(rank, world_size):
    """Rank 1 never uses ``b``: its backward reduces fewer gradients. Returns the error
    each rank raised (there must be one, not a hang)."""
    from ddp_fusion.verify import PlanMismatchError

    with ddp_fusion.config.patch(enabled=True):
        model = torch.compile(ddp_fusion.DistributedDataParallel(TwoBranch(use_b=rank == 0)))
        try:
            model(torch.randn(4, 8)).sum().backward()
        except PlanMismatchError as e:
            return str(e)
    return None


def different_models(rank, world_size):
    try:
        ddp_fusion.DistributedDataParallel(torch.nn.Linear(8, 8 + rank))
    except ValueError as e:
        return str(e)
    return None
