"""Per-rank body of the real-model tests (issue 13): a ``transformers`` model under
stock torch DDP with ddp_fusion on and torch.compile, against eager torch DDP."""

import copy

import torch

import ddp_fusion
from ddp_fusion import _torch

from _workers import count_all_reduces
from bench._hf_models import MODELS, build, inputs_of, loss_of


def _steps(model, batches, lr=1e-3):
    """AdamW steps; returns (the first step's gradients, all-reduces in the last step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    first = {}

    def step(batch):
        opt.zero_grad()
        loss_of(model, batch).backward()
        if not first:
            first.update({n: p.grad.clone() for n, p in model.module.named_parameters()
                          if p.grad is not None})
        opt.step()

    for b in batches[:-1]:
        step(b)
    return first, count_all_reduces(lambda: step(batches[-1]))


def _grad_error(got, want):
    """Largest |got - want| over all gradients, relative to the largest |want| of all
    (not per tensor: some gradients are zero up to rounding, as a key projection's
    bias, whose exact gradient is 0)."""
    scale = max(w.abs().max().item() for w in want.values())
    return max((got[n] - w).abs().max().item() for n, w in want.items()) / scale


def _param_diff(model, ref):
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    return max((got[n] - want[n]).abs().max().item() for n in want)


def _gather_max_spread(tensors, group=None):
    """Largest difference between ranks, over ``tensors`` (buffers)."""
    spread = 0.0
    for t in tensors:
        parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(parts, t.contiguous())
        spread = max(spread, max((p.double() - parts[0].double()).abs().max().item() for p in parts))
    return spread


def real_model(rank, world_size, name, steps=3, bucket_cap_mb=0.05, floor=True):
    """With ``floor``, also the same run compiled without ddp_fusion (one graph,
    ``optimize_ddp=False``; torch's C++ reducer all-reduces): how
    far compiling the compute alone moves the parameters from eager's after AdamW steps
    (AdamW turns a gradient that is zero up to rounding into a step of about ``lr``
    whose sign is the rounding's, so compiled and eager runs differ there)."""
    spec = MODELS[name]
    base = build(name)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [spec.batch(gen) for _ in range(steps)]
    kw = dict(bucket_cap_mb=bucket_cap_mb, find_unused_parameters=spec.find_unused_parameters)
    stock = torch.nn.parallel.DistributedDataParallel

    ref = stock(copy.deepcopy(base), **kw)
    ref_grads, ref_collectives = _steps(ref, batches)
    # with find_unused_parameters eager DDP never rebuilds its buckets
    logged = ref._get_ddp_logging_data()
    eager_buckets = len(logged.get("rebuilt_bucket_sizes", logged["bucket_sizes"]).split(","))

    torch._dynamo.reset()
    counters = _torch.dynamo.counters()
    counters.clear()
    with ddp_fusion.config.patch(enabled=True):
        ddp = stock(copy.deepcopy(base), **kw)
        grads, collectives = _steps(torch.compile(ddp), batches)
        seen = {
            "graph_breaks": dict(counters["graph_break"]),
            "unique_graphs": counters["stats"]["unique_graphs"],
            "unfused": {k: v for k, v in counters["ddp_fusion"].items() if k.startswith("unfused")},
            "plans_run": counters["ddp_fusion"]["plans_run"],
        }
        # a forward without grad syncs the buffers once more (eager DDP's rule), so
        # every rank ends with rank 0's running statistics
        with torch.no_grad():
            ddp.eval()(**inputs_of(batches[0]))
    with torch.no_grad():
        ref.eval()(**inputs_of(batches[0]))
    floor_diff = None
    if floor:
        torch._dynamo.reset()
        other = stock(copy.deepcopy(base), **kw)
        with torch._dynamo.config.patch(optimize_ddp=False):
            _steps(torch.compile(other), batches)
        floor_diff = _param_diff(other.module, ref.module)
    got = dict(ddp.module.named_parameters())
    want = dict(ref.module.named_parameters())
    diffs = {n: (got[n] - want[n]).abs().max().item() for n in want}
    worst = max(diffs, key=diffs.get)
    buffers = [b for _, b in ddp.module.named_buffers() if b.is_floating_point()]
    return {
        "eager_buckets": eager_buckets,
        "eager_collectives": ref_collectives,
        "collectives": collectives,
        "grad_error_step1": _grad_error(grads, ref_grads),
        "same_grads_step1": sorted(grads) == sorted(ref_grads),
        "max_diff": diffs[worst],
        "worst_param": worst,
        "floor_max_diff": floor_diff,
        "buffer_diff_vs_eager": max(
            ((a.double() - b.double()).abs().max().item()
             for a, b in zip(ddp.module.buffers(), ref.module.buffers())), default=0.0),
        "buffer_spread_across_ranks": _gather_max_spread(buffers),
        "n_buffers": len(buffers),
        **seen,
    }
