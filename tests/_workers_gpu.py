"""Per-rank bodies of tests/test_gpu.py: ddp_fusion's paths on a device, against eager
torch DDP on the same device, with the per-step plan check forced on at world size 1
(``host_group.FORCE``) and, on CUDA, every steady step run under
``torch.cuda.set_sync_debug_mode("error")`` (a device sync raises).

Written for one GPU (NCCL at world size 1; 2 processes sharing it over gloo), and run on
the CPU too (gloo) so that the logic is exercised where there is no GPU. The paths on
the "slow" backend (a side stream that sleeps before it writes each result) are
tests/_workers_slow.py's, given the device."""

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


class ConvNet(nn.Module):
    """Gradients in three layouts: a channels-last convolution, a weight stored
    transposed (its ``.grad`` follows its strides), and plain ones."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1).to(memory_format=torch.channels_last)
        self.w = nn.Parameter(torch.randn(64, 8 * 8 * 8).t() / 20)  # (512, 64), strides (1, 512)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        h = torch.relu(self.conv(x.to(memory_format=torch.channels_last))).flatten(1)
        return self.head(torch.tanh(h @ self.w))


def _train(model, params, batches, device, check_syncs, join=None, set_to_none=True, after_step=None):
    opt = torch.optim.SGD(params, lr=0.1)
    ctx = join() if join is not None else contextlib.nullcontext()
    with ctx:
        for i, x in enumerate(batches):
            # the first steps compile and learn; the rest are steady
            with no_device_sync(device, check_syncs and i >= 2):
                opt.zero_grad(set_to_none=set_to_none)
                model(x).square().mean().backward()
                opt.step()
            if after_step is not None:
                after_step()


def _reference(net, batches, device, set_to_none=True, **kwargs):
    ref = copy.deepcopy(net)
    ddp = nn.parallel.DistributedDataParallel(ref, **kwargs)
    _train(ddp, ddp.parameters(), batches, device, check_syncs=False, set_to_none=set_to_none)
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

    def run(name, build, compiled, check_syncs=True, join=False, set_to_none=True, net=None, want=want,
            data=batches):
        torch._dynamo.reset()
        net = copy.deepcopy(base) if net is None else net
        with ddp_fusion.config.patch(enabled=True):
            model = build(net)
            calls_before = len(hook_calls)
            _train(torch.compile(model) if compiled else model, model.parameters(), data, device,
                   check_syncs, join=model.join if join else None, set_to_none=set_to_none)
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
    # kept .grads: reduced in place in them (the first step leaves them views of its buckets)
    want_kept = _reference(base, batches, device, set_to_none=False, bucket_cap_mb=0.01,
                           find_unused_parameters=True)
    run("wrapper, compiled, kept .grads",
        lambda net: wrapper(net, bucket_cap_mb=0.01, find_unused_parameters=True), compiled=True,
        set_to_none=False, want=want_kept)
    # a channels-last convolution and a transposed weight, new and kept .grads
    conv_batches = [torch.randn(8, 3, 8, 8, generator=gen).to(device) for _ in range(STEPS)]
    conv = ConvNet().to(device)
    for set_to_none in (True, False):
        kept = "new" if set_to_none else "kept"
        run(f"channels-last convolution and transposed weight, compiled, {kept} .grads",
            lambda net: wrapper(net, bucket_cap_mb=0.01), compiled=True, set_to_none=set_to_none,
            net=copy.deepcopy(conv), data=conv_batches,
            want=_reference(conv, conv_batches, device, set_to_none=set_to_none, bucket_cap_mb=0.01))
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


REDUCE_OVERHEAD_STEPS = 6


def reduce_overhead(rank, world_size, device_type):
    """``torch.compile(mode="reduce-overhead")`` (CUDA graphs) for the forward, and the
    same mode for the backward (``config.backward_compile_kwargs``), with kept ``.grad``s
    (reduced in place) and the plan check forced on, for REDUCE_OVERHEAD_STEPS steps:
    does it train as eager torch DDP, with every bucket's collective issued through its
    process group at every step (none captured in a CUDA graph, whose replays c10d would
    not see)? Returns the difference, the model group's all-reduces per step as c10d's
    flight recorder saw them (needs ``TORCH_FR_BUFFER_SIZE`` set before the group is
    made), and Inductor's CUDA-graph counters (partitions around ddp_fusion's ops, or
    graphs skipped)."""
    from torch._dynamo.utils import counters

    from ddp_fusion import _torch

    host_group.FORCE = True
    device = torch.device(device_type, torch.cuda.current_device() if device_type == "cuda" else 0)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(16, 64, generator=gen).to(device) for _ in range(REDUCE_OVERHEAD_STEPS)]
    base = Net().to(device)
    base.unused = nn.Identity()
    want = _reference(base, batches, device, set_to_none=False, bucket_cap_mb=0.01)
    torch._dynamo.reset()
    counters.clear()
    group = dist.group.WORLD.group_name
    seen: set = set()
    _torch.distributed.collectives_since(seen)
    per_step = []

    def count_step():
        new = _torch.distributed.collectives_since(seen)
        per_step.append(sum("all_reduce" in name for name, pg in new if pg == group))

    net = copy.deepcopy(base)
    with ddp_fusion.config.patch(enabled=True, backward_compile_kwargs={"mode": "reduce-overhead"}):
        model = ddp_fusion.DistributedDataParallel(net, bucket_cap_mb=0.01)
        _train(torch.compile(model, mode="reduce-overhead"), model.parameters(), batches, device,
               check_syncs=False, set_to_none=False, after_step=count_step)
    return {"diff": _diff(net, want), "all_reduces_per_step": per_step,
            "inductor": {k: v for k, v in counters["inductor"].items() if "cudagraph" in k},
            "ddp_fusion": dict(counters["ddp_fusion"])}
