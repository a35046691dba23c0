"""Per-rank bodies of the comm-hook tests (issue 14): torch DDP's communication hooks on
ddp_fusion's buckets, uncompiled and compiled, against eager torch DDP with the same
hook and buckets."""

import copy
import glob
import os

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

import ddp_fusion

WIDTH = 512
CAP_SEVERAL = 0.25  # MiB: the 3-layer MLP below makes 3 buckets (one per Linear)
CAP_ONE = 25.0


def mlp3():
    """The issue's 3-layer MLP (each Linear 1 MiB of gradient)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
        torch.nn.Linear(WIDTH, WIDTH),
    )


def _bf16_hook(state, bucket):
    # torch DDP refuses bf16_compress_hook by name on gloo; the same hook, renamed
    return default_hooks.bf16_compress_hook(state, bucket)


def _waiting(hook):
    """``hook``, waiting for its own future before returning: one bucket at a time, so
    eager torch DDP on gloo issues PowerSGD's chained all-reduces in bucket order (the
    order ddp_fusion guarantees), and can serve as the reference with several buckets."""
    def waiting_hook(state, bucket):
        fut = hook(state, bucket)
        fut.wait()
        return fut
    return waiting_hook


def _powersgd_state():
    return psgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
        use_error_feedback=True, warm_start=True,
    )


# name -> (bucket cap, make (state, hook) for ddp_fusion, make (state, hook) for torch DDP)
CASES = {
    "allreduce_hook": (CAP_SEVERAL, lambda: (None, default_hooks.allreduce_hook), None),
    "fp16_compress_hook": (CAP_SEVERAL, lambda: (None, default_hooks.fp16_compress_hook), None),
    "bf16_compress_hook": (CAP_SEVERAL, lambda: (None, _bf16_hook), None),
    "fp16_compress_wrapper": (
        CAP_SEVERAL, lambda: (None, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)),
        None,
    ),
    "powerSGD_one_bucket": (CAP_ONE, lambda: (_powersgd_state(), psgd.powerSGD_hook), None),
    "powerSGD": (
        CAP_SEVERAL, lambda: (_powersgd_state(), psgd.powerSGD_hook),
        lambda: (_powersgd_state(), _waiting(psgd.powerSGD_hook)),
    ),
    "fp16_wrapped_powerSGD": (
        CAP_SEVERAL, lambda: (_powersgd_state(), default_hooks.fp16_compress_wrapper(psgd.powerSGD_hook)),
        lambda: (_powersgd_state(), _waiting(default_hooks.fp16_compress_wrapper(psgd.powerSGD_hook))),
    ),
}


def _train(model, batches, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x in batches:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _max_diff(got, want):
    return max((g - w).abs().max().item() for g, w in zip(got, want))


def hooks_against_eager(rank, world_size, dump_root, cases=tuple(CASES), steps=5):
    """Per case: parameters after ``steps`` SGD steps of ddp_fusion uncompiled and
    compiled against eager torch DDP with the same hook (or, where eager torch DDP on
    gloo cannot run the hook on several buckets, the hook made to finish each bucket
    before the next); plus, for a hook that counts its calls, the calls per step, and
    the hooked collectives in the compiled graph's dump."""
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(16, WIDTH, generator=gen) for _ in range(steps)]
    base = mlp3()
    out = {}
    for name in cases:
        cap, ours, theirs = CASES[name]
        ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
        ref.register_comm_hook(*(theirs or ours)())
        want = _train(ref, batches)
        buckets = len(ref._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))

        uncompiled = ddp_fusion.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
        uncompiled.register_comm_hook(*ours())
        got = _train(uncompiled, batches)

        torch._dynamo.reset()
        dump_dir = os.path.join(dump_root, name, str(rank))
        with torch._inductor.config.patch(fx_graph_cache=False), ddp_fusion.config.patch(
            enabled=True, dump_dir=dump_dir
        ):
            model = ddp_fusion.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
            model.register_comm_hook(*ours())
            compiled = _train(torch.compile(model), batches)
        afters = [open(f).read() for f in sorted(glob.glob(os.path.join(dump_dir, "*.after.txt")))]
        out[name] = {
            "buckets": buckets,
            "uncompiled": _max_diff(got, want),
            "compiled": _max_diff(compiled, want),
            "hooked_collectives": [a.count("'ddp_fusion_hook_") for a in afters],
            "dtype_casts": [a.count("convert_element_type") for a in afters],
        }
    out["calls"] = count_calls(base, batches)
    if "powerSGD" in cases:
        ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_SEVERAL)
        ref.register_comm_hook(*CASES["powerSGD"][2]())
        out["powerSGD_vs_plain"] = _max_diff(_train(ref, batches), _plain_ref(base, batches))
    return out


def count_calls(base, batches):
    """A user hook that counts its calls: (bucket index, is_last) per call, per step, for
    torch DDP, ddp_fusion uncompiled and compiled."""
    calls = []

    def counting(state, bucket):
        calls.append((bucket.index(), bucket.is_last(), len(bucket.parameters())))
        return default_hooks.allreduce_hook(state, bucket)

    got = {}
    for kind in ("torch", "uncompiled", "compiled"):
        torch._dynamo.reset()
        with ddp_fusion.config.patch(enabled=kind == "compiled"):
            if kind == "torch":
                model = torch.nn.parallel.DistributedDataParallel(
                    copy.deepcopy(base), bucket_cap_mb=CAP_SEVERAL)
            else:
                model = ddp_fusion.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_SEVERAL)
            model.register_comm_hook(None, counting)
            run = torch.compile(model) if kind == "compiled" else model
            per_step = []
            for x in batches:
                calls.clear()
                _train(run, [x])
                per_step.append(list(calls))
        got[kind] = per_step
    return got


def _plain_ref(base, batches):
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_SEVERAL)
    return _train(ref, batches)


def _done(value):
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


BAD_HOOKS = {
    "raises": lambda state, bucket: 1 / 0,
    "not_a_future": lambda state, bucket: bucket.buffer(),
    "wrong_shape": lambda state, bucket: _done(bucket.buffer()[:-1]),
    "wrong_dtype": lambda state, bucket: _done(bucket.buffer().to(torch.int32)),
    "never_completes": lambda state, bucket: torch.futures.Future(),
}


def bad_hooks(rank, world_size):
    """Each hook of ``BAD_HOOKS``, uncompiled and compiled: the error raised by the
    backward (type, message, seconds it took), and the error (None) of the next step
    of another model with a good hook: a hook left in flight by the failed backward
    must not hold it up (it would wait the process-group timeout for a future that
    never completes, and fail)."""
    import time

    out = {}
    for name, hook in BAD_HOOKS.items():
        for compiled in (False, True):
            torch._dynamo.reset()
            with ddp_fusion.config.patch(enabled=compiled):
                model = ddp_fusion.DistributedDataParallel(mlp3(), bucket_cap_mb=CAP_SEVERAL)
                model.register_comm_hook(None, hook)
                run = torch.compile(model) if compiled else model
                start = time.monotonic()
                try:
                    run(torch.randn(4, WIDTH)).sum().backward()
                    error = None
                except Exception as e:  # noqa: BLE001 - the test checks what it is
                    error = (type(e).__name__, str(e))
                seconds = time.monotonic() - start
                good = ddp_fusion.DistributedDataParallel(mlp3(), bucket_cap_mb=CAP_SEVERAL)
                # (a hook of its own: torch's allreduce_hook would be a comm dtype, no hook call)
                good.register_comm_hook(None, lambda st, bucket: default_hooks.allreduce_hook(st, bucket))
                try:
                    (torch.compile(good) if compiled else good)(torch.randn(4, WIDTH)).sum().backward()
                    after = None
                except Exception as e:  # noqa: BLE001
                    after = f"{type(e).__name__}: {e}"
                out[name, compiled] = (error, seconds, after)
    return out


def join_with_hook(rank, world_size):
    """``join()`` with a comm hook (rank 0: 4 batches, rank 1: 2): a joined rank runs the
    hook on buckets of zeros, as torch DDP does. Parameters against torch DDP's
    ``join()`` with the same hook, and the hook calls per step on each rank, uncompiled
    and compiled."""
    base = mlp3()
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(8, WIDTH, generator=gen) for _ in range((4, 2)[rank])]
    calls = []

    def counting(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    def run(model, ddp):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with ddp.join():
            for x in batches:
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
        return [p.detach().clone() for p in ddp.module.parameters()]

    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_SEVERAL)
    ref.register_comm_hook(None, counting)
    want = run(ref, ref)
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        calls.clear()
        with ddp_fusion.config.patch(enabled=compiled):
            ddp = ddp_fusion.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=CAP_SEVERAL)
            ddp.register_comm_hook(None, counting)
            got = run(torch.compile(ddp) if compiled else ddp, ddp)
        out[compiled] = {"max_diff": _max_diff(got, want), "calls": len(calls)}
    return out
