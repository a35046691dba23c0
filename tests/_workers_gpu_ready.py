"""Per-rank bodies of tests/test_gpu_ready_gloo.py: what a GPU would punish and gloo on
the CPU forgives (a tensor on the wrong device in a collective, a host read of a device
tensor in a steady step, a per-step collective that grows with the world size)."""

import contextlib
import unittest.mock

import torch
import torch.distributed as dist
from torch import nn

import ddp_fusion
from ddp_fusion import _torch, host_group, plan_check

#: Tensor methods that read a tensor's value on the host (on a GPU: a device sync).
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


class Net(nn.Module):
    """Two buckets at ``bucket_cap_mb=0.002``; ``c`` is used only when asked."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 32)

    def forward(self, x, use_c=False):
        x = self.b(torch.tanh(self.a(x)))
        return self.c(x) if use_c else x


@contextlib.contextmanager
def _applied(patches):
    """Every ``unittest.mock.patch`` of ``patches`` in force inside the block."""
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


@contextlib.contextmanager
def count_host_reads():
    """Counts, by method, calls of :data:`HOST_READS` on any tensor inside the block,
    and of ``torch.tensor`` / ``torch.as_tensor`` given a ``device``."""
    counts: dict[str, int] = {}
    patches = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(self, *args, **kwargs)

        patches.append(unittest.mock.patch.object(torch.Tensor, name, counted))
    # a tensor made from host data on a given device: on a GPU, a copy from pageable
    # host memory that blocks the host until the device's queue reaches it
    for name in ("tensor", "as_tensor"):
        original = getattr(torch, name)

        def made(data, *args, _name=name, _original=original, **kwargs):
            if kwargs.get("device") is not None:
                counts[f"torch.{_name}"] = counts.get(f"torch.{_name}", 0) + 1
            return _original(data, *args, **kwargs)

        patches.append(unittest.mock.patch.object(torch, name, made))
    with _applied(patches):
        yield counts


@contextlib.contextmanager
def count_group_lookups():
    """Counts calls of the plan check's lookups of a process group by name and of its
    host group inside the block: the first step of a plan's check makes them, a steady
    step finds them with ``host_group.known``. (Counted wherever they are called.)"""
    counts: dict[str, int] = {}

    def counted(key, original):
        def call(*args, **kwargs):
            counts[key] = counts.get(key, 0) + 1
            return original(*args, **kwargs)
        return call

    patches = [
        unittest.mock.patch.object(module, name, counted(f"{module.__name__}.{name}", getattr(module, name)))
        for module, name in ((plan_check, "_group"), (host_group, "of"))
    ]
    with _applied(patches):
        yield counts


def steady_steps(rank, world_size, steps):
    """A compiled, fused model after its first steps: per steady step (forward,
    backward, SGD step), the host reads of tensor values, and the collectives c10d's
    flight recorder saw, by process group; then the same with ``.grad``s kept
    (``zero_grad(set_to_none=False)``), under ``"kept_reads"`` and ``"kept_collectives"``;
    then, still kept, inside ``join()`` (with ``divide_by_initial_world_size=False``: the
    divisor is the count of ranks still training, all of them here), under
    ``"join_reads"`` and ``"join_collectives"``. Under ``"lookups"`` (and with the
    same prefixes), the plan check's group lookups in those steps (:func:`count_group_lookups`)."""
    torch._dynamo.reset()
    with ddp_fusion.config.patch(enabled=True):
        ddp = ddp_fusion.DistributedDataParallel(Net(), bucket_cap_mb=0.002)  # 2 buckets
        model = torch.compile(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)

        set_to_none = True

        def step():
            opt.zero_grad(set_to_none=set_to_none)
            model(torch.randn(8, 32, generator=gen)).square().mean().backward()
            opt.step()

        for _ in range(3):  # compile, learn, settle
            step()
        out = {"group": ddp.process_group.group_name}
        # (kept before join: a join context's prelude stays on after it, as torch DDP's)
        for label in ("", "kept_", "join_"):
            with contextlib.ExitStack() as stack:
                if label == "join_":
                    stack.enter_context(ddp.join(divide_by_initial_world_size=False))
                    for _ in range(2):  # the prelude's first steps
                        step()
                if label == "kept_":  # .grads kept: each bucket reduced in place in them
                    set_to_none = False
                    for _ in range(3):  # compile, settle
                        step()
                seen: set = set()
                _torch.distributed.collectives_since(seen)
                with count_host_reads() as reads, count_group_lookups() as lookups:
                    for _ in range(steps):
                        step()
                out[f"{label}reads"] = reads
                out[f"{label}lookups"] = lookups
                out[f"{label}collectives"] = _torch.distributed.collectives_since(seen)
    return out


_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "reduce_scatter_tensor", "all_to_all_single", "barrier")


@contextlib.contextmanager
def record_collective_devices():
    """(collective, device type) of every tensor handed to ``torch.distributed``'s
    collectives inside the block."""
    seen: list[tuple[str, str]] = []
    patches = []
    for name in _COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def recording(*args, _name=name, _original=original, **kwargs):
            for t in _torch.tensors.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    seen.append((_name, t.device.type))
            return _original(*args, **kwargs)

        patches.append(unittest.mock.patch.object(dist, name, recording))
    with _applied(patches):
        yield seen


def collectives_on_the_group_device(rank, world_size):
    """The model on the CPU, every tensor factory without ``device=`` making ``meta``
    tensors (``torch.set_default_device("meta")``): a factory that forgets its device
    hands a meta tensor to a collective, as it would hand a CPU tensor to a NCCL group.
    Runs the uncompiled wrapper with ``find_unused_parameters`` (the used-parameter
    bitmap), ``bucket_cap_mb="auto"`` (the link probe) and ``join()`` (a joined rank's
    shadow of the eager reducer); returns the device types the collectives saw."""
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(8, 32, generator=gen) for _ in range(2 + rank)]  # rank 0 joins first
    nets = [Net(), Net()]
    with record_collective_devices() as seen:
        torch.set_default_device("meta")
        try:
            unused = ddp_fusion.DistributedDataParallel(nets[0], bucket_cap_mb=0.005,
                                                        find_unused_parameters=True)
            auto = ddp_fusion.DistributedDataParallel(nets[1], bucket_cap_mb="auto")
            for model in (unused, auto):
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                with model.join():
                    for x in batches:
                        opt.zero_grad()
                        use_c = rank == 1 if model is unused else True  # c: unused on rank 0
                        model(x, use_c=use_c).square().mean().backward()
                        opt.step()
        finally:
            torch.set_default_device(None)
    return sorted(set(seen))
