"""Per-rank bodies of tests/test_slow_backend_gloo.py (and, on CUDA tensors, of
tests/test_gpu.py): ddp_fusion's paths on the "slow" test backend
(tests/_slow_backend.py: every all-reduce completes late, its tensors NaN until then; on
CUDA written by a side stream that sleeps first), against eager torch DDP on the default
gloo group, with nothing of ddp_fusion's per-step state left after any step
(``ddp_fusion.pending()``)."""

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn

import ddp_fusion
from ddp_fusion import _torch

import _slow_backend

STEPS = 4
CAP = 0.02  # MiB: a bucket per weight or two of the MLP below (16 KiB each)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _loss(model, x):
    return model(x).square().mean()


def _train(model, params, batches, set_to_none, after_step=None, join=None):
    opt = torch.optim.SGD(params, lr=0.1)
    with join() if join is not None else contextlib.nullcontext():
        for x in batches:
            opt.zero_grad(set_to_none=set_to_none)
            _loss(model, x).backward()
            opt.step()
            if after_step is not None:
                after_step()


def _hook(state, bucket):
    """torch's allreduce hook, by hand: average the flat bucket over the model's group."""
    group = state
    buf = bucket.buffer().div_(group.size())
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def _read_before_wait(slow):
    """The backend is slow: what a reduced tensor holds before its wait, and after."""
    t = torch.ones(4)
    work = dist.all_reduce(t, group=slow, async_op=True)
    before = t.clone()
    work.wait()
    return bool(before.isnan().all()), t.tolist()


def slow_paths(rank, world_size, device_type="cpu"):
    """Each path trained for STEPS steps on the slow group against eager torch DDP on
    the world group, on ``device_type``: returns ``{path: {"diff", "left", "issued",
    "waited", ...}}``, with ``left`` the non-empty ``ddp_fusion.pending()`` after any
    step."""
    _slow_backend.register()
    slow = dist.new_group(backend=_slow_backend.NAME)
    out = {"read before wait": _read_before_wait(slow)}  # (on the CPU: a deliberate race)
    device = torch.device(device_type, 0)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(8, 64, generator=gen) * (1 + rank)).to(device) for _ in range(STEPS)]
    base = MLP().to(device)
    counters = _torch.dynamo.counters()

    def run(name, set_to_none=True, compiled=True, hooked=False, grads_first=False, uneven=False,
            **config):
        steps = batches[:STEPS - rank] if uneven else batches  # rank 1: one batch fewer
        ref_net = copy.deepcopy(base)
        ref = nn.parallel.DistributedDataParallel(ref_net, bucket_cap_mb=CAP)
        if hooked:
            ref.register_comm_hook(dist.group.WORLD, _hook)
        if grads_first:
            for p in ref_net.parameters():
                p.grad = torch.zeros_like(p)
        _train(ref, ref.parameters(), steps, set_to_none, join=ref.join if uneven else None)

        torch._dynamo.reset()
        counters["ddp_fusion"].clear()
        net = copy.deepcopy(base)
        left = []
        issued, waited = slow.issued, slow.waited
        with ddp_fusion.config.patch(enabled=compiled, **config):
            model = ddp_fusion.DistributedDataParallel(net, process_group=slow, bucket_cap_mb=CAP)
            if hooked:
                model.register_comm_hook(slow, _hook)
            if grads_first:  # made by the user before the first backward: not one run
                for p in net.parameters():
                    p.grad = torch.zeros_like(p)
            _train(torch.compile(model) if compiled else model, net.parameters(), steps, set_to_none,
                   after_step=lambda: left.append(ddp_fusion.pending()),
                   join=model.join if uneven else None)
        out[name] = {
            "diff": max((a - b).abs().max().item() for a, b in zip(net.parameters(), ref_net.parameters())),
            "left": [p for p in left if p],
            "issued": slow.issued - issued,
            "waited": slow.waited - waited,
            "steps": len(left),
            "ddp_fusion": {k: v for k, v in counters["ddp_fusion"].items() if k.startswith("in place")},
        }

    run("concat")
    run("coalesced", algorithm="coalesced")
    run("kept .grads, one run", set_to_none=False)
    run("kept .grads, gathered", set_to_none=False, grads_first=True)
    run("comm hook", hooked=True)
    run("join()", uneven=True)
    run("uncompiled", compiled=False)
    return out
