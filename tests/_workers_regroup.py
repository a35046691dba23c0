"""Per-rank bodies of tests/test_regroup_gloo.py: ddp_fusion's per-group state (a host
group: a thread, a gloo group, its sockets) ends with its process group when the group
is destroyed and made again in the same process (a new ``init_process_group``, an
in-process restart)."""

import copy
import gc
import os
import threading

import torch
import torch.distributed as dist

import ddp_fusion

from _workers import mlp


def _resources() -> dict:
    """Python threads (names), threads that are not Python's (gloo's, torch's pools) and
    open files of this process."""
    names = sorted(t.name for t in threading.enumerate())
    return {
        "python_threads": names,
        "other_threads": len(os.listdir("/proc/self/task")) - len(names),
        "files": len(os.listdir("/proc/self/fd")),
    }


def _round(rank, world_size, init_file, flag, compiled, steps=3):
    """init_process_group; torch DDP with ``flag`` (``compiled``: torch.compile'd;
    else ddp_fusion's wrapper, uncompiled) for ``steps`` steps, and eager torch DDP on
    the same data; destroy_process_group; collect garbage. Returns the resources left
    and the parameter difference between the two."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(8, 64, generator=gen) for _ in range(steps)]
    base = mlp()
    nets = []
    for fused in (False, flag):
        if compiled:
            torch._dynamo.reset()
        with ddp_fusion.config.patch(enabled=fused and compiled):
            net = copy.deepcopy(base)
            if fused and not compiled:
                model = ddp_fusion.DistributedDataParallel(net)
            else:
                model = torch.nn.parallel.DistributedDataParallel(net)
            model = torch.compile(model) if fused and compiled else model
            opt = torch.optim.SGD(net.parameters(), lr=0.05)
            for x in batches:
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
            nets.append(net)
        del model, opt
    diff = max((a - b).abs().max().item() for a, b in zip(*(n.parameters() for n in nets)))
    del nets, net
    if compiled:
        torch._dynamo.reset()
    dist.destroy_process_group()
    gc.collect()
    return {**_resources(), "diff": diff}


def regroup(rank, world_size, tmpdir, compiled, rounds=3):
    """The group made and destroyed once with the flag off, then ``rounds`` times with
    it on, training each time. Returns the resources after each round (the first: flag
    off). Leaves a group initialized (run_ranks destroys it)."""
    dist.destroy_process_group()  # run_ranks's group: every round makes its own
    out = [_round(rank, world_size, os.path.join(tmpdir, f"round{i}"), i > 0, compiled)
           for i in range(rounds + 1)]
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmpdir, 'last')}",
                            rank=rank, world_size=world_size)
    return out
