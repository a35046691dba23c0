"""Per-rank bodies of the gradient-storage tests (issue 15): ``.grad`` as views of the
bucket buffers, compiled and not, against eager torch DDP."""

import copy

import torch

import ddp_fusion

from _workers import mlp


def _train(model, batches, set_to_none, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x in batches:
        opt.zero_grad(set_to_none=set_to_none)
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _storages(module):
    """Per parameter: the id of the storage its ``.grad`` lives in."""
    return [p.grad.untyped_storage().data_ptr() for p in module.parameters()]


def _model_and_batches(rank, steps):
    """The test MLP (same on every rank) and ``steps`` batches of this rank's data."""
    gen = torch.Generator().manual_seed(100 + rank)
    return mlp(bias=True), [torch.randn(8, 64, generator=gen) for _ in range(steps)]


def _max_diff(got, want):
    return max((g - w).abs().max().item() for g, w in zip(got, want))


def grads_as_bucket_views(rank, world_size, cap=0.03, steps=4):
    """For ``zero_grad(set_to_none=True)`` and ``False``: parameters after ``steps`` SGD
    steps against torch DDP (``gradient_as_bucket_view=True``), and how the ``.grad``
    storages are laid out (how many distinct storages; whether they stay put across
    steps), for ddp_fusion uncompiled with ``gradient_as_bucket_view=True`` and
    compiled (default arguments)."""
    base, batches = _model_and_batches(rank, steps)
    out = {}
    for set_to_none in (True, False):
        ref = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(base), bucket_cap_mb=cap, gradient_as_bucket_view=True
        )
        want = _train(ref, batches, set_to_none)
        buckets = len(ref._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))

        eager = ddp_fusion.DistributedDataParallel(
            copy.deepcopy(base), bucket_cap_mb=cap, gradient_as_bucket_view=True
        )
        got = _train(eager, batches[:-1], set_to_none)
        before = _storages(eager.module)
        got = _train(eager, batches[-1:], set_to_none)

        torch._dynamo.reset()
        with ddp_fusion.config.patch(enabled=True):
            ddp = ddp_fusion.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
            compiled = _train(torch.compile(ddp), batches, set_to_none)
        out[set_to_none] = {
            "torch_buckets": buckets,
            "uncompiled": {
                "max_diff": _max_diff(got, want),
                "storages": len(set(_storages(eager.module))),
                "kept_storages": before == _storages(eager.module),
                "views_of_buckets": [p.grad.untyped_storage().data_ptr() for p in eager.module.parameters()]
                == [eager.reducer.buckets[eager.reducer.bucket_of[i][0]].buffer.untyped_storage().data_ptr()
                    for i in range(len(eager.reducer.params))],
            },
            "compiled": {
                "max_diff": _max_diff(compiled, want),
                "storages": len(set(_storages(ddp.module))),
                "contiguous": all(p.grad.is_contiguous() for p in ddp.module.parameters()),
            },
        }
    return out


def _train_kept_grads(model, batches, lr=0.05, keep_after=2):
    """SGD by hand from the ``.grad`` tensors kept after step ``keep_after``, as
    flat-buffer and fused optimizers do (``zero_grad(set_to_none=False)``): each later
    step must find the reduced gradient in those same tensors. (Not after step 1:
    torch DDP itself rebuilds its buckets at step 2, and with
    ``gradient_as_bucket_view=True`` its ``.grad`` then move into the new buckets.)"""
    params = list(model.parameters())
    kept = None
    for step, x in enumerate(batches, 1):
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        model(x).square().mean().backward()
        if step == keep_after:
            kept = [p.grad for p in params]
        with torch.no_grad():
            for p, g in zip(params, kept or [p.grad for p in params]):
                p.sub_(lr * g)
    same = all(p.grad is g for p, g in zip(params, kept))
    return [p.detach().clone() for p in params], same


def _train_no_sync(ddp, model, batches, lr=0.05, micro=3):
    """Gradient accumulation: per step, ``micro - 1`` micro-batches under
    ``ddp.no_sync()`` and one synced (``model``: ``ddp`` or its compiled self), then SGD
    by hand from the ``.grad``s kept since the first step, which ``zero_()`` clears
    (``.grad``s start as None: the first no-sync backward makes them)."""
    params = list(ddp.parameters())
    kept = None
    for i in range(0, len(batches), micro):
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        with ddp.no_sync():
            for x in batches[i:i + micro - 1]:
                model(x).square().mean().backward()
        model(batches[i + micro - 1]).square().mean().backward()
        kept = kept or [p.grad for p in params]
        with torch.no_grad():
            for p, g in zip(params, kept):
                p.sub_(lr * g)
    same = all(p.grad is g for p, g in zip(params, kept))
    return [p.detach().clone() for p in params], same


def kept_grads_no_sync(rank, world_size, cap=0.03, steps=3, micro=3):
    """Issue 36 item 7: ``.grad``s first made by a ``no_sync()`` backward (one storage
    each), kept, ``steps`` accumulation steps of ``micro`` micro-batches: parameters
    against eager torch DDP, whether ``.grad`` stayed the same object, how many
    storages the compiled ``.grad``s end in, and how each bucket was reduced in place."""
    from torch._dynamo.utils import counters

    base, batches = _model_and_batches(rank, steps * micro)
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    want, _ = _train_no_sync(ref, ref, batches)
    torch._dynamo.reset()
    counters["ddp_fusion"].clear()
    with ddp_fusion.config.patch(enabled=True):
        ddp = ddp_fusion.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
        got, same = _train_no_sync(ddp, torch.compile(ddp), batches)
    return _compiled_record(got, same, want, base, ddp)


def _compiled_record(got, same, want, base, ddp):
    """What the kept-``.grad`` probes report of a compiled run: its parameters against
    eager torch DDP's (``want``), whether ``.grad`` stayed the same object, how far
    training moved them from ``base``, the storages of the ``.grad``s and how each
    bucket was reduced in place (ddp_fusion's counters)."""
    from torch._dynamo.utils import counters

    return {
        "compiled": _max_diff(got, want), "compiled_same": same,
        "moved": _max_diff(want, [p.detach() for p in base.parameters()]),
        "params": [p.tolist() for p in got],
        "storages": len(set(_storages(ddp))),
        "in_place": {k.removeprefix("in place: "): v for k, v in counters["ddp_fusion"].items()
                     if k.startswith("in place: ")},
    }


def kept_grads(rank, world_size, cap=0.03, steps=6):
    """The held-out probe of issue 32 on every path: parameters after ``steps`` steps
    taken from the ``.grad`` tensors kept after step 2, against eager torch DDP, for
    ``gradient_as_bucket_view`` off and on, compiled and not. Also whether ``.grad``
    stayed the same object, how many storages the compiled ``.grad``s live in, and how
    the compiled steps reduced them in place (one run of memory, or coalesced). The key
    ``"made"``: compiled, with ``.grad``s the user made before the first backward (one
    storage each: gathered for their bucket's all-reduce the first time, then moved
    into it); ``"mixed"``: so on rank 1 only (the ranks' layouts differ, their
    collectives must not)."""
    from torch._dynamo.utils import counters

    base, batches = _model_and_batches(rank, steps)
    out = {}
    for gbav in (False, True, "made", "mixed"):
        made = gbav == "made" or (gbav == "mixed" and rank == 1)
        ref = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(base), bucket_cap_mb=cap, gradient_as_bucket_view=gbav is True)
        if made:
            _make_grads(ref)
        want, _ = _train_kept_grads(ref, batches)
        got_eager, same_eager = None, None
        if gbav in (False, True):
            eager = ddp_fusion.DistributedDataParallel(
                copy.deepcopy(base), bucket_cap_mb=cap, gradient_as_bucket_view=gbav)
            got_eager, same_eager = _train_kept_grads(eager, batches)
        torch._dynamo.reset()
        counters["ddp_fusion"].clear()
        with ddp_fusion.config.patch(enabled=True):
            ddp = ddp_fusion.DistributedDataParallel(
                copy.deepcopy(base), bucket_cap_mb=cap, gradient_as_bucket_view=gbav is True)
            if made:
                _make_grads(ddp)
            got, same = _train_kept_grads(torch.compile(ddp), batches)
        out[gbav] = {
            "uncompiled": got_eager and _max_diff(got_eager, want), "uncompiled_same": same_eager,
            **_compiled_record(got, same, want, base, ddp),
        }
    return out


def _make_grads(model):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


class _Layouts(torch.nn.Module):
    """Parameters in three layouts: a channels-last convolution, a weight stored
    transposed, and plain ones."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1).to(memory_format=torch.channels_last)
        self.w = torch.nn.Parameter(torch.randn(16, 8 * 6 * 6).t() / 20)  # (288, 16), strides (1, 288)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.conv(x.to(memory_format=torch.channels_last))).flatten(1)
        return self.head(torch.tanh(h @ self.w))


def _train_remade_grads(model, module, batches, rank, lr=0.1):
    """``zero_grad(set_to_none=False)`` SGD; after step 1, rank 1 replaces the
    convolution's and the transposed weight's ``.grad`` with contiguous zeros (a
    layout unlike its parameter's, and unlike rank 0's)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step, x in enumerate(batches, 1):
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()
        if step == 1 and rank == 1:
            for p in (module.conv.weight, module.w):
                p.grad = torch.zeros(p.shape)
    return [p.detach().clone() for p in module.parameters()]


def layouts_per_rank(rank, world_size, steps=5):
    """Issue 37: kept ``.grad``s laid out differently on the two ranks. Parameters after
    ``steps`` steps, compiled (stock torch DDP + flag, concat; the wrapper, coalesced),
    against eager torch DDP trained the same way; and the in-place counters."""
    from torch._dynamo.utils import counters

    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(4, 3, 6, 6, generator=gen) for _ in range(steps)]
    base = _Layouts()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    want = _train_remade_grads(ref, ref.module, batches, rank)
    out = {"moved": _max_diff(want, [p.detach() for p in base.parameters()])}
    for label, algorithm in (("stock", "concat"), ("wrapper", "coalesced")):
        torch._dynamo.reset()
        counters["ddp_fusion"].clear()
        with ddp_fusion.config.patch(enabled=True, algorithm=algorithm):
            ddp = (torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base)) if label == "stock"
                   else ddp_fusion.DistributedDataParallel(copy.deepcopy(base)))
            got = _train_remade_grads(torch.compile(ddp), ddp.module, batches, rank)
        out[label] = {"diff": _max_diff(got, want), "params": [p.tolist() for p in got],
                      "counters": dict(counters["ddp_fusion"])}
    return out
