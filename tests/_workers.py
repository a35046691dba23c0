"""Per-rank bodies of the multi-process tests (importable by spawned ranks)."""

import copy
import os
import time

import torch

import ddp_fusion
from ddp_fusion import _torch


def mlp(width=64, depth=4, seed=0, bias=False):
    """Bias-free by default: then the order gradients become ready is the same in eager
    autograd and in a compiled backward, so bucket counts can be compared exactly (with
    biases, the compiled backward computes a layer's weight gradient before its bias
    gradient, eager autograd the other way round; see README, "Limits")."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width, bias=bias), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def count_all_reduces(step):
    """All-reduces this process ran during ``step()``, on any process group and thread
    (c10d's flight recorder, which ``conftest.py`` turns on for every rank)."""
    with _torch.distributed.AllReduces() as n:
        step()
    return n.count


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
    from ddp_fusion import PlanMismatchError

    with ddp_fusion.config.patch(enabled=True):
        model = torch.compile(ddp_fusion.DistributedDataParallel(TwoBranch(use_b=rank == 0)))
        try:
            model(torch.randn(4, 8)).sum().backward()
        except PlanMismatchError as e:
            return str(e)
    return None


def plans_diverge_at_step_3(rank, world_size, native=(True, True)):
    """Both ranks use ``b`` for two steps; at the third, rank 1 stops using it (its
    backward recompiles with fewer gradients). Returns (step, error, the C++ plan ops'
    steady checks (starts, guards) before that step) on each rank: every rank must raise
    PlanMismatchError at that step, not hang in mismatched collectives. ``native``:
    each rank's ``config.native_check``."""
    from ddp_fusion import PlanMismatchError, host_group

    with ddp_fusion.config.patch(enabled=True, native_check=native[rank]):
        net = TwoBranch()
        model = torch.compile(ddp_fusion.DistributedDataParallel(net))
        steady = (0, 0)
        for step in range(4):
            net.use_b = not (rank == 1 and step >= 2)
            try:
                model(torch.randn(4, 8)).sum().backward()
            except PlanMismatchError as e:
                return step, str(e), steady
            cpp = host_group.native_loaded()
            steady = cpp.counts() if cpp is not None else (0, 0)
    return None, None, steady


def different_models(rank, world_size):
    try:
        ddp_fusion.DistributedDataParallel(torch.nn.Linear(8, 8 + rank))
    except ValueError as e:
        return str(e)
    return None


def _steps(model, batches, lr=0.05, before_step=None):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x in batches:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def training_semantics(rank, world_size, dump_root):
    """Issues 5 and 12 on 2 gloo ranks: uncompiled bucketed path, unused parameters,
    gradient accumulation, communication dtypes, bucket_cap_mb_list, and unused
    parameters under torch.compile, each against eager torch DDP."""
    import os

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

    # 3. gradient accumulation, compiled: no communication inside no_sync
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

    # 4-6. issue 12: each section compiles its own models (after torch._dynamo.reset())
    out["comm_dtype"] = comm_dtype_grads(rank, world_size)
    out["bucket_cap_list"] = bucket_cap_lists(rank, world_size, os.path.join(dump_root, str(rank)))
    out["unused_compiled"] = unused_compiled(rank, world_size)
    return out


def peer_dies_mid_step(rank, world_size, compiled, kill=False):
    """Rank 1 leaves after the forward (``kill``: SIGKILLed a second later, its process
    group never destroyed); the others' backward must raise (not hang). Returns (error
    type as ``module.qualname``, seconds until the error, message, child processes of
    this rank after it) on the others."""
    import signal
    import threading
    import time

    from _workers_host_group import _children

    with ddp_fusion.config.patch(enabled=compiled):
        ddp = ddp_fusion.DistributedDataParallel(mlp())
        model = torch.compile(ddp) if compiled else ddp
        if compiled:  # compile both graphs while both ranks are alive
            model(torch.randn(4, 64)).sum().backward()
        loss = model(torch.randn(4, 64)).sum()
        if rank == 1:
            if kill:
                threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
            return None  # gone: its process group is destroyed and the process exits
        start = time.monotonic()
        try:
            loss.backward()
        except Exception as e:  # noqa: BLE001 - the test checks what it is
            kind = f"{type(e).__module__}.{type(e).__qualname__}"
            return kind, time.monotonic() - start, str(e)[:1000], _children()
        return "no error", time.monotonic() - start, "", _children()


# -- DP x TP (hand-written Megatron-style tensor parallelism) ------------------------
from bench._tp import TPBlock  # noqa: E402


def dp_tp_compare(rank, world_size, dump_root):
    """DP=2 x TP=2: ddp_fusion over the DP sub-mesh vs eager torch DDP over the DP group,
    both with the same hand-written TP; returns max parameter difference and the TP
    all-reduce count in the backward graph before and after the pass."""
    import glob
    import json
    import os

    from torch.distributed.device_mesh import init_device_mesh

    from ddp_fusion.plan import BucketPlan, MiB

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

    out = {
        "max_diff": max((g - w).abs().max().item() for g, w in zip(got, want)),
        "tp_before": open(stem + ".before.txt").read().count(f"'{tp_name}')"),
        "tp_after": open(stem + ".after.txt").read().count(f"'{tp_name}')"),
        "dp_buckets": len(json.load(open(stem + ".buckets.json"))["buckets"]),
    }

    # bucket_cap_mb="auto" on a wider model (4 blocks of 0.5 MiB of local gradients) and
    # a slow link given in config.link, where what counts is how early the first bucket
    # starts: it sizes the DP buckets from the local shards (smaller than DDP's 2), each
    # DP group runs its rank 0's choice, and the TP all-reduces stay where they were.
    wide = lambda: torch.nn.Sequential(*(TPBlock(256, 512, tp, seed) for seed in range(4)))
    batches = [torch.randn(8, 256, generator=gen) for _ in range(3)]
    auto_dir = os.path.join(dump_root, f"auto_rank{rank}")
    torch._dynamo.reset()
    with ddp_fusion.config.patch(enabled=True, dump_dir=auto_dir, link=(10.0, 0.01)):
        wrapper = ddp_fusion.DistributedDataParallel(wide(), device_mesh=dp, bucket_cap_mb="auto")
        got = _steps(torch.compile(wrapper), batches)
    limits = wrapper.bucket_sizing.limits
    want = _steps(torch.nn.parallel.DistributedDataParallel(
        wide(), process_group=dp.get_group(), bucket_cap_mb_list=[c / MiB for c in limits]), batches)
    stem = sorted(glob.glob(os.path.join(auto_dir, "*.buckets.json")))[-1][: -len(".buckets.json")]
    plan = BucketPlan.from_json(open(stem + ".buckets.json").read())
    out["auto"] = {
        "limits": limits,
        "max_diff": max((g - w).abs().max().item() for g, w in zip(got, want)),
        "tp_before": open(stem + ".before.txt").read().count(f"'{tp_name}')"),
        "tp_after": open(stem + ".after.txt").read().count(f"'{tp_name}')"),
        "dp_buckets": len(plan.buckets),
        "default_buckets": wrapper.bucket_sizing.buckets_default,
        "dp_groups": {b.group for b in plan.buckets} == {dp.get_group().group_name},
        "local_grad_bytes": sum(p.numel() * p.element_size() for p in wrapper.module.parameters()),
        "planned_bytes": sum(b.nbytes for b in plan.buckets),
    }
    return out


def dtensor_tp_compare(rank, world_size, compiled, set_to_none=True):
    """DP=2 x TP=2 with DTensor parallelize_module (Colwise + Rowwise): ddp_fusion over
    the DP sub-mesh against one full, unparallelized model trained on both DP ranks'
    data (``zero_grad(set_to_none=...)``; False: the first step makes the ``.grad``s,
    later ones accumulate into them, and they stay the same DTensors). Returns the max
    difference of the full parameters, whether ``.grad`` stayed the same objects, and
    ddp_fusion's counters."""
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
        kept = None
        for _ in range(3):
            xs = [torch.randn(4, 16, generator=g) for g in gens]
            opt.zero_grad(set_to_none=set_to_none)
            model(xs[mesh["dp"].get_local_rank()]).square().mean().backward()
            kept = kept or [p.grad for p in tp_model.parameters()]
            opt.step()
            ref_opt.zero_grad()
            torch.stack([full(x).square().mean() for x in xs]).mean().backward()
            ref_opt.step()
    return {
        "max_diff": max((p.full_tensor() - q).abs().max().item()
                        for p, q in zip(tp_model.parameters(), full.parameters())),
        "same_grads": all(p.grad is g for p, g in zip(tp_model.parameters(), kept)),
        "ddp_fusion": dict(_torch.dynamo.counters()["ddp_fusion"]),
    }


# -- several process groups, fp32 + bf16 parameters (issue 4) ------------------------
class MixedPrecisionBlock(torch.nn.Module):
    """An fp32 Linear, then a bf16 Linear (activations cast to bf16 and back to fp32):
    one DDP wrapper around it holds parameters of both dtypes."""

    def __init__(self, width):
        super().__init__()
        self.b_fp32 = torch.nn.Linear(width, width)
        self.b_bf16 = torch.nn.Linear(width, width).to(torch.bfloat16)

    def forward(self, x):
        x = torch.tanh(self.b_fp32(x))
        return self.b_bf16(x.to(torch.bfloat16)).float()


class TwoGroupModel(torch.nn.Module):
    """``a`` (fp32) wrapped by ``wrap(module, group_a)``, then ``b`` (fp32 + bf16) by
    ``wrap(module, group_b)``. Parameter names differ between the two parts, so a
    gradient's name in a bucket plan tells which wrapper it belongs to."""

    def __init__(self, wrap, group_a, group_b, width=32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        from collections import OrderedDict

        self.a = wrap(
            torch.nn.Sequential(
                OrderedDict(
                    a1=torch.nn.Linear(16, width), act=torch.nn.Tanh(), a2=torch.nn.Linear(width, width)
                )
            ),
            group_a,
        )
        self.b = wrap(MixedPrecisionBlock(width), group_b)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _train_from_zero_grads(model, batches, lr=0.1):
    """SGD over ``batches``; returns the all-reduce count of the last step. The loss sums
    over features so that updates are well above bf16's resolution (a bf16 gradient
    reduced wrongly then shows). ``.grad`` starts as zeros (not None), so compiled
    autograd builds one backward graph (the steady-state one) instead of two: it keeps
    the test fast, and the math is the same."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def step(x):
        opt.zero_grad(set_to_none=False)
        model(x).square().sum(-1).mean().backward()
        opt.step()

    for x in batches[:-1]:
        step(x)
    return count_all_reduces(lambda: step(batches[-1]))


def groups_and_dtypes(rank, world_size, algorithms, dump_root, steps=4):
    """Two DDP wrappers on two different process groups (same ranks), one of them with
    fp32 and bf16 parameters: eager torch DDP (reference) and ddp_fusion compiled with
    each algorithm. Returns parameters (dtype name, values as lists: tensors do not
    travel through the result queue once the rank has exited), collectives per step,
    ddp_fusion counters and bucket plans, and which group and dtype each parameter has."""
    import glob
    import json
    import os

    import torch.distributed as dist
    from torch._dynamo.utils import counters

    group_a, group_b = dist.new_group([0, 1]), dist.new_group([0, 1])
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    batches = [torch.randn(8, 16, generator=gen) for _ in range(steps)]
    params = lambda m: {
        n: (str(p.dtype).removeprefix("torch."), p.detach().float().tolist())
        for n, p in m.named_parameters()
    }

    ref = TwoGroupModel(
        lambda m, g: torch.nn.parallel.DistributedDataParallel(m, process_group=g), group_a, group_b
    )
    ref_collectives = _train_from_zero_grads(ref, batches)
    out = {
        "groups": (group_a.group_name, group_b.group_name),
        "ref": {
            "params": params(ref),
            "collectives": ref_collectives,
            "buckets": sum(
                len(w._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))
                for w in (ref.a, ref.b)
            ),
        },
    }
    for algorithm in algorithms:
        torch._dynamo.reset()  # before the patch: reset turns compiled autograd off
        counters.clear()
        dump_dir = os.path.join(dump_root, algorithm)
        # The FX graph cache off: a graph served from it skips the pass, and then there
        # would be no plan (dump, counters) to check.
        with torch._inductor.config.patch(fx_graph_cache=False), ddp_fusion.config.patch(
            enabled=True, algorithm=algorithm, dump_dir=dump_dir
        ):
            model = TwoGroupModel(
                lambda m, g: ddp_fusion.DistributedDataParallel(m, process_group=g),
                group_a,
                group_b,
            )
            collectives = _train_from_zero_grads(torch.compile(model), batches)
        out[algorithm] = {
            "params": params(model),
            "collectives": collectives,
            "counters": dict(counters["ddp_fusion"]),
            "plans": [
                json.load(open(f))
                for f in sorted(glob.glob(os.path.join(dump_dir, f"rank{rank}_*.buckets.json")))
            ],
            # gradient name in the plan -> (group, dtype) of its parameter
            "grad_keys": {
                n: (w.process_group.group_name, str(p.dtype).removeprefix("torch."))
                for w in (model.a, model.b)
                for n, p in w.module.named_parameters()
            },
        }
    return out


# -- issue 12 item 7: communication dtypes, bucket lists, unused parameters ----------
class GradIs(torch.nn.Module):
    """Parameters whose gradient is the input, bit for bit: the loss is
    ``sum((p * x).sum())``, so ``dloss/dp = x`` eagerly and compiled alike, and reduced
    gradients can be compared exactly."""

    SHAPES = {"a": (64, 48), "b": (300,), "c": (16, 16, 3), "d": (5,)}

    def __init__(self, dtype=torch.float32):
        super().__init__()
        for name, shape in self.SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=dtype)))

    def forward(self, xs):
        return sum((p * x).sum() for p, x in zip(self.parameters(), xs))


def wide_range(rank, lo, hi, step=0):
    """Rank ``rank``'s gradients for ``GradIs``: both signs, full float32 mantissas,
    magnitudes spread over 2**lo .. 2**hi (every rank can rebuild every rank's)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for shape in GradIs.SHAPES.values():
        magnitude = torch.exp2(torch.empty(shape).uniform_(lo, hi, generator=gen))
        out.append(magnitude * (torch.randint(0, 2, shape, generator=gen) * 2 - 1))
    return out


def _grads(module):
    return [p.grad.detach().clone() for p in module.parameters()]


def _equal(got, want):
    return len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


def _max_diff(got, want):
    return max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))


def _frac_differ(got, want):
    n = sum(g.numel() for g in got)
    return sum((g != w).sum().item() for g, w in zip(got, want)) / n


COMM_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}


class CommDtypeParts(torch.nn.Module):
    """One ``GradIs`` per communication dtype, each wrapped by ``wrap(module, name)``;
    every part gets the same input, so the parts differ only in how they communicate."""

    def __init__(self, wrap):
        super().__init__()
        self.parts = torch.nn.ModuleDict({name: wrap(GradIs(), name) for name in COMM_DTYPES})

    def forward(self, xs):
        return sum(part(xs) for part in self.parts.values())


COMM_DATA = {"normal": (-13, 13), "fp16_subnormal": (-24, -13)}
"""Gradient magnitudes (powers of 2) for ``comm_dtype_grads``: halves stay fp16 normals,
or are fp16 subnormals (below 2**-14)."""


def comm_dtype_grads(rank, world_size, cap=0.004):
    """Backward of ``CommDtypeParts`` on each ``COMM_DATA`` set (both signs, full float32
    mantissas, so fp16 and bf16 rounding shows in almost every element): reduced
    gradients of ddp_fusion with ``comm_dtype`` fp16 / bf16 / None, uncompiled and
    compiled (both algorithms), and of eager torch DDP with ``fp16_compress_hook`` /
    ``bf16_compress_hook`` / no hook, and what those hooks compute elementwise."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def bf16_hook(process_group, bucket):
        # torch's own hook; DDP refuses it by name unless NCCL is there, gloo sums bf16
        return default_hooks.bf16_compress_hook(process_group, bucket)

    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": bf16_hook, "fp32": None}
    groups = {name: dist.new_group(list(range(world_size))) for name in COMM_DTYPES}

    def torch_ddp(module, name):
        ddp = torch.nn.parallel.DistributedDataParallel(
            module, process_group=groups[name], bucket_cap_mb=cap
        )
        if hooks[name] is not None:
            ddp.register_comm_hook(groups[name], hooks[name])
        return ddp

    def ours(module, name):
        return ddp_fusion.DistributedDataParallel(
            module, bucket_cap_mb=cap, comm_dtype=COMM_DTYPES[name]
        )

    def data(r, which):
        return wide_range(r, *COMM_DATA[which], step=list(COMM_DATA).index(which))

    def reduced(model):
        """{data set: {comm dtype: gradients}}; .grad is None before each backward, so a
        compiled model reuses its one backward graph."""
        out = {}
        for which in COMM_DATA:
            for p in model.parameters():
                p.grad = None
            model(data(rank, which)).backward()
            out[which] = {name: _grads(part.module) for name, part in model.parts.items()}
        return out

    ref = reduced(CommDtypeParts(torch_ddp))
    out = {"ref_is_oracle": {}, "frac_differ_from_fp32": {}}
    for which in COMM_DATA:
        # what the hooks compute, element by element: cast, divide, sum in the dtype
        everyone = [data(r, which) for r in range(world_size)]
        oracle = {
            name: [
                sum(x.to(dtype or torch.float32) / world_size for x in xs).float()
                for xs in zip(*everyone)
            ]
            for name, dtype in COMM_DTYPES.items()
        }
        out["ref_is_oracle"][which] = {n: _equal(ref[which][n], oracle[n]) for n in COMM_DTYPES}
        out["frac_differ_from_fp32"][which] = {
            n: _frac_differ(ref[which][n], ref[which]["fp32"]) for n in ("fp16", "bf16")
        }
    got = {"uncompiled": reduced(CommDtypeParts(ours))}
    for algorithm in ("concat", "coalesced"):
        torch._dynamo.reset()  # before the patch: reset turns compiled autograd off
        counters.clear()
        with torch._inductor.config.patch(fx_graph_cache=False), ddp_fusion.config.patch(
            enabled=True, algorithm=algorithm
        ):
            got[algorithm] = reduced(torch.compile(CommDtypeParts(ours)))
        out[f"{algorithm}_counters"] = dict(counters["ddp_fusion"])
    for mode, grads in got.items():
        out[mode] = {
            which: {
                n: {"equal": _equal(grads[which][n], ref[which][n]),
                    "max_diff": _max_diff(grads[which][n], ref[which][n])}
                for n in COMM_DTYPES
            }
            for which in COMM_DATA
        }
    return out


def bucket_cap_lists(rank, world_size, dump_dir, caps=(0.01, 0.04, 0.02), steps=3):
    """``bucket_cap_mb_list`` against eager torch DDP given the same list: parameters after
    ``steps`` SGD steps, and bucket sizes in bytes (torch's rebuilt buckets; the eager
    reducer's; the compiled plan). Eight bias-free 64x64 layers, 16 KiB of gradient
    each, in the same ready order eagerly and compiled."""
    import glob
    import json
    import os

    base = mlp(depth=8)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(8, 64, generator=gen) for _ in range(steps)]
    lr = 10  # gradients are ~1e-5 here; a wrong reduction then moves parameters by ~1e-4
    torch_ddp = torch.nn.parallel.DistributedDataParallel
    ref = torch_ddp(copy.deepcopy(base), bucket_cap_mb_list=list(caps))
    want = _steps(ref, batches, lr)
    ours = lambda: ddp_fusion.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb_list=caps)
    eager = ours()
    got_eager = _steps(eager, batches, lr)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), ddp_fusion.config.patch(
        enabled=True, dump_dir=dump_dir
    ):
        got_compiled = _steps(torch.compile(ours()), batches, lr)
    (plan,) = glob.glob(os.path.join(dump_dir, f"rank{rank}_*.buckets.json"))
    torch_sizes = ref._get_ddp_logging_data()["rebuilt_bucket_sizes"]
    return {
        "torch_sizes": [int(b) for b in torch_sizes.split(",")],
        "eager_sizes": [b.buffer.numel() * b.buffer.element_size() for b in eager.reducer.buckets],
        "compiled_sizes": [b["bytes"] for b in json.load(open(plan))["buckets"]],
        "eager_max_diff": _max_diff(got_eager, want),
        "compiled_max_diff": _max_diff(got_compiled, want),
    }


class UnusedEverywhere(torch.nn.Module):
    """``c`` takes part in no forward, on any rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def unused_compiled(rank, world_size, steps=3):
    """``find_unused_parameters=True`` under torch.compile with fusion on, a parameter
    unused on every rank: against eager torch DDP with the same flag."""
    from torch._dynamo.utils import counters

    base = UnusedEverywhere()
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(8, 64, generator=gen) for _ in range(steps)]
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True)
    want = _steps(ref, batches)
    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), ddp_fusion.config.patch(enabled=True):
        ddp = ddp_fusion.DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True)
        got = _steps(torch.compile(ddp), batches)
    return {
        "max_diff": _max_diff(got, want),
        "grad_is_none": [n for n, p in ddp.module.named_parameters() if p.grad is None],
        "torch_grad_is_none": [n for n, p in ref.module.named_parameters() if p.grad is None],
        "counters": dict(counters["ddp_fusion"]),
    }


def reduce_dtype_bf16(rank, world_size, steps=3, cap=0.002):
    """bf16 parameters with ``reduce_dtype=torch.float32``, uncompiled and compiled
    (``concat``; ``coalesced``'s casts are covered by ``comm_dtype_grads``), against
    eager torch DDP with torch's ``_compress_hook(torch.float32)`` (cast the bf16 bucket
    to fp32, divide, all-reduce, cast back): parameters after ``steps`` SGD steps and the
    last step's reduced gradients, compared exactly.

    On 4 ranks dividing by the world size is exact, and these gradients (bf16,
    magnitudes 2**-3 .. 2**4) sum exactly in fp32 in any order, so the fp32 reduction is
    deterministic; communicating in bf16 instead (no ``reduce_dtype``) rounds partial
    sums. On 2 ranks the two are bit-identical (one rounding of ``a/2 + b/2`` either way),
    so a 2-rank test could not tell ``reduce_dtype`` from no ``reduce_dtype``."""
    from torch._dynamo.utils import counters
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def data(r, step):
        return [x.to(torch.bfloat16) for x in wide_range(r, -3, 4, step)]

    def train(model, module):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            model(data(rank, step)).backward()
            opt.step()
        return [p.detach().clone() for p in module.parameters()], _grads(module)

    def fp32_hook(process_group, bucket):
        return default_hooks._compress_hook(torch.float32, process_group, bucket)

    def ours(**kw):
        return ddp_fusion.DistributedDataParallel(GradIs(torch.bfloat16), bucket_cap_mb=cap, **kw)

    ref = torch.nn.parallel.DistributedDataParallel(GradIs(torch.bfloat16), bucket_cap_mb=cap)
    ref.register_comm_hook(None, fp32_hook)
    want_params, want_grads = train(ref, ref.module)
    # the last step's mean, exact in float64, rounded once to bf16
    everyone = [data(r, steps - 1) for r in range(world_size)]
    oracle = [(sum(x.double() for x in xs) / world_size).bfloat16() for xs in zip(*everyone)]
    out = {"ref_is_oracle": _equal(want_grads, oracle)}

    bf16 = ours()  # no reduce_dtype: communicates in bf16
    params, grads = train(bf16, bf16.module)
    out["bf16_comm"] = {
        "frac_grads_differ": _frac_differ(grads, want_grads),
        "frac_params_differ": _frac_differ(params, want_params),
    }
    uncompiled = ours(reduce_dtype=torch.float32)
    runs = {"uncompiled": train(uncompiled, uncompiled.module)}
    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), ddp_fusion.config.patch(enabled=True):
        compiled = ours(reduce_dtype=torch.float32)
        runs["concat"] = train(torch.compile(compiled), compiled.module)
    for mode, (params, grads) in runs.items():
        out[mode] = {
            "params_equal": _equal(params, want_params),
            "grads_equal": _equal(grads, want_grads),
            "max_diff": _max_diff(params, want_params),
        }
    out["concat"]["counters"] = dict(counters["ddp_fusion"])
    return out


def fail_on_ranks(rank, world_size, failing, wait_s=30.0):
    """Raise on the ranks in ``failing``; the others wait ``wait_s`` (as a rank waiting
    in a collective for a failed peer would)."""
    if rank in failing:
        raise ValueError(f"rank {rank} fails on purpose")
    time.sleep(wait_s)
