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


def _steps(model, batches, lr=0.05, before_step=None):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for i, x in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def training_semantics(rank, world_size):
    """Issue 5 on 2 gloo ranks: uncompiled bucketed path, unused parameters, comm dtype,
    and gradient accumulation, each against eager torch DDP."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    out = {}
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(8, 64, generator=gen) for _ in range(4)]
    base = mlp(bias=True)
    torch_ddp = lambda m, **kw: torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=0.03, **kw)
    ours = lambda m, **kw: ddp_fusion.DistributedDataParallel(m, bucket_cap_mb=0.03, **kw)

    # 1. uncompiled, bucketed: same parameters, and one collective per bucket
    want = _steps(torch_ddp(copy.deepcopy(base)), batches)
    model = ours(copy.deepcopy(base))
    got = _steps(model, batches[:-1])
    got_collectives = count_all_reduces(lambda: _steps(model, batches[-1:]))
    got = [p.detach() for p in model.parameters()]
    out["uncompiled"] = {
        "max_diff": max((g - w).abs().max().item() for g, w in zip(got, want)),
        "collectives": got_collectives,
        "buckets": len(model.reducer.buckets),
    }

    # 2. unused parameters: rank 1 never uses b; c is used by no rank
    class Unused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.c = (torch.nn.Linear(64, 64) for _ in range(3))

        def forward(self, x):
            x = self.a(x)
            return self.b(x) if rank == 0 else x

    m0 = Unused()
    want = _steps(torch_ddp(copy.deepcopy(m0), find_unused_parameters=True), batches)
    model = ours(copy.deepcopy(m0), find_unused_parameters=True)
    got = _steps(model, batches)
    out["unused"] = {
        "max_diff": max((g - w).abs().max().item() for g, w in zip(got, want)),
        "c_grad_is_none": model.module.c.weight.grad is None,
        "b_grad_set": model.module.b.weight.grad is not None,
    }
    try:
        _steps(ours(copy.deepcopy(m0)), batches[:1])
        out["unused_error"] = None
    except RuntimeError as e:
        out["unused_error"] = str(e)

    # 3. comm_dtype=fp16 against torch DDP with fp16_compress_hook
    ref = torch_ddp(copy.deepcopy(base))
    ref.register_comm_hook(ref.process_group, default_hooks.fp16_compress_hook)
    want = _steps(ref, batches)
    got_eager = _steps(ours(copy.deepcopy(base), comm_dtype=torch.float16), batches)
    torch._dynamo.reset()
    with ddp_fusion.config.patch(enabled=True):
        got_compiled = _steps(
            torch.compile(ours(copy.deepcopy(base), comm_dtype=torch.float16)), batches
        )
    out["fp16"] = {
        "eager_max_diff": max((g - w).abs().max().item() for g, w in zip(got_eager, want)),
        "compiled_max_diff": max((g - w).abs().max().item() for g, w in zip(got_compiled, want)),
    }

    # 4. gradient accumulation, compiled: no communication inside no_sync
    torch._dynamo.reset()
    ref = torch_ddp(copy.deepcopy(base))
    with ref.no_sync():
        for x in batches[:2]:
            ref(x).square().mean().backward()
    ref(batches[2]).square().mean().backward()
    with ddp_fusion.config.patch(enabled=True):
        ddp = ours(copy.deepcopy(base))
        model = torch.compile(ddp)

        def micro_steps():
            with ddp.no_sync():
                for x in batches[:2]:
                    model(x).square().mean().backward()

        inside = count_all_reduces(micro_steps)
        model(batches[2]).square().mean().backward()
    out["no_sync"] = {
        "collectives_inside": inside,
        "max_diff": max(
            (p.grad - q.grad).abs().max().item()
            for p, q in zip(ddp.module.parameters(), ref.module.parameters())
        ),
    }
    return out


def peer_dies_mid_step(rank, world_size, compiled):
    """Rank 1 leaves after the forward; rank 0's backward must raise (not hang).
    Returns (error type, seconds until the error) on rank 0."""
    import time

    with ddp_fusion.config.patch(enabled=compiled):
        ddp = ddp_fusion.DistributedDataParallel(mlp())
        model = torch.compile(ddp) if compiled else ddp
        if compiled:  # compile both graphs while both ranks are alive
            model(torch.randn(4, 64)).sum().backward()
        loss = model(torch.randn(4, 64)).sum()
        if rank == 1:
            return None  # gone: its process group is destroyed and the process exits
        start = time.monotonic()
        try:
            loss.backward()
        except Exception as e:  # noqa: BLE001 - what matters is that it raises
            return type(e).__name__, time.monotonic() - start, str(e)[:300]
        return "no error", time.monotonic() - start, ""


# -- DP x TP (hand-written Megatron-style tensor parallelism) ------------------------
import torch.distributed._functional_collectives as fcol  # noqa: E402


class _CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: sum the input gradient over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return fcol.all_reduce(grad, "sum", ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: sum partial outputs over the TP group. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return fcol.all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TPBlock(torch.nn.Module):
    """x + W2 gelu(W1 x + b1) + b2 with W1 split by rows and W2 by columns over TP."""

    def __init__(self, d, h, tp_group, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        tp_rank, tp_size = tp_group.rank(), tp_group.size()
        self.tp_group = tp_group
        self.w1 = torch.nn.Parameter((torch.randn(h, d, generator=g) / d**0.5).chunk(tp_size, 0)[tp_rank].clone())
        self.b1 = torch.nn.Parameter(torch.zeros(h).chunk(tp_size)[tp_rank].clone())
        self.w2 = torch.nn.Parameter((torch.randn(d, h, generator=g) / h**0.5).chunk(tp_size, 1)[tp_rank].clone())
        self.b2 = torch.nn.Parameter(torch.zeros(d))

    def forward(self, x):
        h = torch.nn.functional.gelu(
            torch.nn.functional.linear(_CopyToTP.apply(x, self.tp_group), self.w1, self.b1)
        )
        return x + _ReduceFromTP.apply(torch.nn.functional.linear(h, self.w2), self.tp_group) + self.b2


def dp_tp_compare(rank, world_size, dump_root):
    """DP=2 x TP=2: ddp_fusion over the DP sub-mesh vs eager torch DDP over the DP group,
    both with the same hand-written TP; returns max parameter difference and the TP
    all-reduce count in the backward graph before and after the pass."""
    import glob
    import os

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"].get_group(), mesh["dp"]
    make = lambda: torch.nn.Sequential(TPBlock(32, 64, tp, 0), TPBlock(32, 64, tp, 1))
    gen = torch.Generator().manual_seed(100 + dp.get_local_rank())  # data: per DP rank
    batches = [torch.randn(8, 32, generator=gen) for _ in range(3)]

    cap = 0.005  # MiB: several DP buckets, with the TP all-reduce between gradients
    want = _steps(
        torch.nn.parallel.DistributedDataParallel(make(), process_group=dp.get_group(), bucket_cap_mb=cap),
        batches,
    )
    dump_dir = os.path.join(dump_root, f"rank{rank}")
    torch._dynamo.reset()
    with ddp_fusion.config.patch(enabled=True, dump_dir=dump_dir):
        got = _steps(
            torch.compile(ddp_fusion.DistributedDataParallel(make(), device_mesh=dp, bucket_cap_mb=cap)),
            batches,
        )

    tp_name = tp.group_name
    stem = sorted(glob.glob(os.path.join(dump_dir, "*.buckets.json")))[-1][: -len(".buckets.json")]

    return {
        "max_diff": max((g - w).abs().max().item() for g, w in zip(got, want)),
        "tp_before": open(stem + ".before.txt").read().count(f"'{tp_name}')"),
        "tp_after": open(stem + ".after.txt").read().count(f"'{tp_name}')"),
        "dp_buckets": len(__import__("json").load(open(stem + ".buckets.json"))["buckets"]),
    }


def dtensor_tp_compare(rank, world_size, compiled):
    """DP=2 x TP=2 with DTensor parallelize_module (Colwise + Rowwise): ddp_fusion over
    the DP sub-mesh against one full, unparallelized model trained on both DP ranks'
    data. Returns the max difference of the full parameters (or the error raised)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    tp_model = parallelize_module(
        copy.deepcopy(full), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    gens = [torch.Generator().manual_seed(100 + r) for r in range(2)]
    with ddp_fusion.config.patch(enabled=compiled):
        ddp = ddp_fusion.DistributedDataParallel(tp_model, device_mesh=mesh["dp"])
        model = torch.compile(ddp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(full.parameters(), lr=0.1)
        try:
            for _ in range(3):
                xs = [torch.randn(4, 16, generator=g) for g in gens]
                opt.zero_grad()
                model(xs[mesh["dp"].get_local_rank()]).square().mean().backward()
                opt.step()
                ref_opt.zero_grad()
                torch.stack([full(x).square().mean() for x in xs]).mean().backward()
                ref_opt.step()
        except NotImplementedError as e:
            return str(e)
    return max((p.full_tensor() - q).abs().max().item() for p, q in zip(tp_model.parameters(), full.parameters()))


def upstream_dtensor_post_acc_grad_hook(rank, world_size):
    """Upstream limit, no ddp_fusion involved: a post-accumulate-grad hook on a DTensor
    parameter under compiled autograd fails (torch clones the parameter with as_strided,
    which DTensor does not implement)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from ddp_fusion import _torch

    mesh = init_device_mesh("cpu", (2,))
    model = parallelize_module(torch.nn.Linear(8, 8), mesh, ColwiseParallel())
    model.weight.register_post_accumulate_grad_hook(lambda p: None)
    with _torch.enable_compiled_autograd(torch.compile):
        torch.compile(model)(torch.randn(2, 8)).sum().backward()
