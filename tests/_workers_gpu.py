"""Per-rank bodies of tests/test_gpu.py: ddp_fusion's paths on a device, against eager
torch DDP on the same device, with the per-step plan check forced on at world size 1
(``host_group.FORCE``) and, on CUDA, every steady step run under
``torch.cuda.set_sync_debug_mode("error")`` (a device sync raises).

Written for one GPU (NCCL at world size 1; 2 processes sharing it over gloo), and run on
the CPU too (gloo) so that the logic is exercised where there is no GPU."""

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn

import ddp_fusion
from ddp_fusion import host_group

STEPS = 4


class Net(nn.Module):
    """Two buckets at ``bucket_cap_mb=0.01``; ``unused`` never gets a gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@contextlib.contextmanager
def no_device_sync(device: torch.device, on: bool):
    """Inside the block, a CUDA operation that synchronises the host with the device
    raises (``torch.cuda.set_sync_debug_mode("error")``); nothing on the CPU."""
    if not (on and device.type == "cuda"):
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _train(model, params, batches, device, check_syncs, join=None):
    opt = torch.optim.SGD(params, lr=0.1)
    ctx = join() if join is not None else contextlib.nullcontext()
    with ctx:
        for i, x in enumerate(batches):
            # the first steps compile and learn; the rest are steady
            with no_device_sync(device, check_syncs and i >= 2):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()


def _reference(net, batches, device, **kwargs):
    ref = copy.deepcopy(net)
    ddp = nn.parallel.DistributedDataParallel(ref, **kwargs)
    _train(ddp, ddp.parameters(), batches, device, check_syncs=False)
    return ref


def _diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _counting_hook(calls):
    def hook(state, bucket):
        calls.append(bucket.index())
        buf = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])
    return hook


def paths(rank, world_size, device_type):
    """Each of ddp_fusion's paths at world size 1 (the plan check forced on), against
    eager torch DDP: returns ``{path: max parameter difference}``; raises on a device
    sync in a steady compiled step."""
    host_group.FORCE = True
    device = torch.device(device_type, torch.cuda.current_device() if device_type == "cuda" else 0)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(16, 64, generator=gen).to(device) for _ in range(STEPS)]
    base = Net().to(device)
    want = _reference(base, batches, device, bucket_cap_mb=0.01, find_unused_parameters=True)
    out = {}

    def run(name, build, compiled, check_syncs=True, join=False):
        torch._dynamo.reset()
        net = copy.deepcopy(base)
        with ddp_fusion.config.patch(enabled=True):
            model = build(net)
            calls_before = len(hook_calls)
            _train(torch.compile(model) if compiled else model, model.parameters(), batches, device,
                   check_syncs, join=model.join if join else None)
        out[name] = {"diff": _diff(net, want), "hook_calls": len(hook_calls) - calls_before}

    hook_calls: list[int] = []
    wrapper = ddp_fusion.DistributedDataParallel

    def hooked(net):
        model = wrapper(net, bucket_cap_mb=0.01, find_unused_parameters=True)
        model.register_comm_hook(None, _counting_hook(hook_calls))
        return model

    run("wrapper, compiled, find_unused_parameters",
        lambda net: wrapper(net, bucket_cap_mb=0.01, find_unused_parameters=True), compiled=True)
    # the used-parameter bitmap is read on the host at the end of backward, as torch DDP does
    run("wrapper, uncompiled, find_unused_parameters",
        lambda net: wrapper(net, bucket_cap_mb=0.01, find_unused_parameters=True), compiled=False,
        check_syncs=False)
    run("torch DDP under the flag, compiled",
        lambda net: nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.01, find_unused_parameters=True),
        compiled=True)
    run("comm hook, compiled", hooked, compiled=True)
    run("join(), compiled",
        lambda net: wrapper(net, bucket_cap_mb=0.01, find_unused_parameters=True), compiled=True, join=True)
    torch._dynamo.reset()
    net = copy.deepcopy(base)
    net.unused = nn.Identity()  # find_unused_parameters is refused with "auto"
    ref_net = copy.deepcopy(net)
    ref = _reference(ref_net, batches, device)
    with ddp_fusion.config.patch(enabled=True):
        model = wrapper(net, bucket_cap_mb="auto")
        _train(torch.compile(model), model.parameters(), batches, device, check_syncs=True)
    out["bucket_cap_mb='auto', compiled"] = {"diff": _diff(net, ref), "hook_calls": 0,
                                             "chosen": model.bucket_sizing is not None}
    return out


def shared_device(rank, world_size, device_type):
    """2 processes, one device, gloo with the device's tensors: the multi-rank semantics
    (buckets over ranks with different data, a plan that diverges at a later step) on
    that device. Returns the parameter difference to eager torch DDP and the step at
    which each rank raised PlanMismatchError."""
    from ddp_fusion import PlanMismatchError

    device = torch.device(device_type, 0)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(16, 64, generator=gen).to(device) for _ in range(STEPS)]
    base = Net().to(device)
    base.unused = nn.Identity()
    want = _reference(base, batches, device, bucket_cap_mb=0.01)
    torch._dynamo.reset()
    net = copy.deepcopy(base)
    with ddp_fusion.config.patch(enabled=True):
        model = ddp_fusion.DistributedDataParallel(net, bucket_cap_mb=0.01)
        _train(torch.compile(model), model.parameters(), batches, device, check_syncs=False)
        diff = _diff(net, want)
        # rank 1 stops using ``b`` at the third step: its plan has fewer gradients
        torch._dynamo.reset()
        diverging = _Diverging().to(device)
        model = torch.compile(ddp_fusion.DistributedDataParallel(diverging))
        raised = None
        for step in range(4):
            diverging.use_b = not (rank == 1 and step >= 2)
            try:
                model(batches[0]).sum().backward()
            except PlanMismatchError:
                raised = step
                break
    return {"diff": diff, "raised_at": raised}


class _Diverging(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        self.use_b = True

    def forward(self, x):
        x = self.a(x)
        return self.b(x) if self.use_b else x


def reduce_overhead(rank, world_size, device_type):
    """``torch.compile(mode="reduce-overhead")`` (CUDA graphs) for the forward, and the
    same mode for the backward (``config.backward_compile_kwargs``): does a fused step
    run, and train as eager torch DDP? Returns the difference and Inductor's counters
    (CUDA graph skips say where ddp_fusion's ops kept a graph out)."""
    from torch._dynamo.utils import counters

    device = torch.device(device_type, torch.cuda.current_device() if device_type == "cuda" else 0)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(16, 64, generator=gen).to(device) for _ in range(STEPS)]
    base = Net().to(device)
    base.unused = nn.Identity()
    want = _reference(base, batches, device, bucket_cap_mb=0.01)
    torch._dynamo.reset()
    counters.clear()
    net = copy.deepcopy(base)
    with ddp_fusion.config.patch(enabled=True, backward_compile_kwargs={"mode": "reduce-overhead"}):
        model = ddp_fusion.DistributedDataParallel(net, bucket_cap_mb=0.01)
        _train(torch.compile(model, mode="reduce-overhead"), model.parameters(), batches, device,
               check_syncs=False)
    return {"diff": _diff(net, want), "inductor": {k: v for k, v in counters["inductor"].items()
                                                     if "cudagraph" in k},
            "ddp_fusion": dict(counters["ddp_fusion"])}
