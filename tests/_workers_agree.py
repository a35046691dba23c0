"""Per-rank bodies of tests/test_agreement_gloo.py: settings given on some ranks only,
and a rank that fails where the others succeed, must end the same way on every rank."""

import time

import torch
from torch import nn

import ddp_fusion
from ddp_fusion import SettingsMismatchError, autocap, ready_order


class Net(nn.Module):
    """``a`` and ``b`` have parameters of equal sizes (a frozen one on one rank only
    would shift the others' buckets without changing their sizes)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _frozen(name):
    net = Net()
    net.get_parameter(name).requires_grad_(False)
    return net


def _timed(build):
    """(error text or None, seconds, error type name)."""
    t0 = time.perf_counter()
    try:
        build()
    except (SettingsMismatchError, ValueError) as e:
        return str(e), time.perf_counter() - t0, type(e).__name__
    return None, time.perf_counter() - t0, None


def _stock_auto_with_link(rank):
    with ddp_fusion.config.patch(enabled=True, bucket_cap_mb="auto", link=(30.0, 12.5) if rank else None):
        nn.parallel.DistributedDataParallel(Net())


def settings_differ_at_construction(rank, world_size):
    """Settings given on one rank only; every case must raise on every rank at
    construction, before any collective depends on the setting."""
    wrapper = ddp_fusion.DistributedDataParallel
    cases = {
        "auto on one rank": lambda: wrapper(Net(), bucket_cap_mb="auto" if rank == 0 else None),
        "bucket_cap_mb": lambda: wrapper(Net(), bucket_cap_mb=1 if rank == 0 else 2),
        "find_unused_parameters": lambda: wrapper(Net(), find_unused_parameters=rank == 0),
        "comm_dtype": lambda: wrapper(Net(), comm_dtype=torch.float16 if rank == 0 else None),
        "frozen weight (sizes shift)": lambda: wrapper(_frozen("a.weight") if rank == 1 else Net()),
        "frozen bias (equal sizes)": lambda: wrapper(_frozen("a.bias") if rank == 1 else Net()),
        "config.link with auto, torch DDP": lambda: _stock_auto_with_link(rank),
        "config.plan_check": lambda: _with_plan_check(rank != 1, lambda: wrapper(Net()), enabled=True),
    }
    return {name: _timed(build) for name, build in cases.items()}


def _with_plan_check(on, build, **settings):
    with ddp_fusion.config.patch(plan_check=on, **settings):
        build()


def settings_differ_at_first_forward(rank, world_size):
    """Settings that can change after construction, given on one rank only: the first
    forward raises on every rank, compiled or not."""
    out = {}

    def algorithm():
        torch._dynamo.reset()
        with ddp_fusion.config.patch(enabled=True):
            model = torch.compile(ddp_fusion.DistributedDataParallel(Net()))
            with ddp_fusion.config.patch(algorithm="coalesced" if rank == 1 else "concat"):
                model(torch.randn(4, 16)).sum().backward()

    def hook():
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model = ddp_fusion.DistributedDataParallel(Net())
        if rank == 0:
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        model(torch.randn(4, 16)).sum().backward()

    def plan_check():
        torch._dynamo.reset()
        with ddp_fusion.config.patch(enabled=True):
            model = torch.compile(ddp_fusion.DistributedDataParallel(Net()))
            _with_plan_check(rank != 1, lambda: model(torch.randn(4, 16)).sum().backward())

    cases = {"config.algorithm, compiled": algorithm, "comm hook, uncompiled": hook,
             "config.plan_check, compiled": plan_check}
    for name, build in cases.items():
        out[name] = _timed(build)
    return out


class Flaky(Net):
    """Its forward fails in ddp_fusion's eager runs (learning the ready order, timing
    the backward for ``auto``) when ``fail`` is set: as a model that runs out of memory
    there, or that the fake run cannot take, on one rank only."""

    def __init__(self, fail):
        super().__init__()
        self.fail = fail

    def forward(self, x):
        if self.fail and ready_order.running():
            raise RuntimeError("this rank's eager run fails")
        return super().forward(x)


class _Warnings(list):
    def __init__(self):
        import logging

        super().__init__()
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: self.append(record.getMessage())
        logging.getLogger("ddp_fusion").addHandler(handler)


def learning_fails_on_one_rank(rank, world_size, failing, what):
    """``what``: ``"eager run"`` (``failing``'s ready-order and timing runs raise) or
    ``"link probe"`` (``failing`` cannot make the link probe's tensors). Trains 3 steps
    compiled with ``bucket_cap_mb="auto"`` against eager torch DDP with DDP's default
    caps; returns what each rank learned and warned."""
    warnings = _Warnings()
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(8, 16, generator=gen) for _ in range(3)]

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in batches:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

    ref = nn.parallel.DistributedDataParallel(Net())
    train(ref)
    if what == "link probe" and rank == failing:
        autocap.PROBE_BYTES = (-4, *autocap.PROBE_BYTES[1:])  # torch.zeros(-1) raises
    with ddp_fusion.config.patch(enabled=True):
        net = Flaky(fail=what == "eager run" and rank == failing)
        ddp = ddp_fusion.DistributedDataParallel(net, bucket_cap_mb="auto")
        train(torch.compile(ddp))
    return {
        "position": ddp._state.ready_position,
        "graph_order": ddp._state.ready_failed,
        "limits": list(ddp._sync.limits),
        "sizing": ddp.bucket_sizing is not None,
        "warnings": list(warnings),
        "diff": max((p - q).abs().max().item() for p, q in zip(net.parameters(), ref.module.parameters())),
    }


def flag_on_one_rank(rank, world_size):
    """``config.enabled`` (say, ``DDP_FUSION=1`` on some nodes only) on group rank 0
    only, a torch DDP then built and stepped on both: rank 0's construction waits for
    the others to join its check, which ranks without the flag never do."""
    t0 = time.perf_counter()
    try:
        with ddp_fusion.config.patch(enabled=rank == 0):
            model = nn.parallel.DistributedDataParallel(Net())
            model(torch.randn(4, 16)).sum().backward()
    except Exception as e:  # noqa: BLE001 - what each rank ends with
        return type(e).__name__, str(e), time.perf_counter() - t0
    return None, None, time.perf_counter() - t0
