"""One process of tests/test_world_size.py.

``python _world_size_worker.py WORLD_SIZE``:
Joins a fake process group of WORLD_SIZE ranks as rank 0, compiles a one-layer model
with ddp_fusion, runs one backward and prints JSON: how far the gradient is from the
local gradient divided by WORLD_SIZE (the fake all-reduce sums nothing, so that is the
right mean), the FX graph cache counters, and whether the bucket plan was reported.
Inductor's cache directory comes from TORCHINDUCTOR_CACHE_DIR (set by the test).

``python _world_size_worker.py elastic``: trains at world size 2, re-creates the default
group at size 4 (as an elastic restart does) and keeps the compiled model; prints the
gradient error at each size and how many graphs the pass compiled.
"""

import json
import logging
import sys

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

import ddp_fusion
from ddp_fusion import _torch


def main(world_size: int) -> None:
    dist.init_process_group("fake", store=_torch.distributed.fake_store(), rank=0, world_size=world_size)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("ddp_fusion").addHandler(handler)
    logging.getLogger("ddp_fusion").setLevel(logging.INFO)

    torch.manual_seed(0)
    net = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    local = torch.autograd.grad(net(x).square().sum(), list(net.parameters()))
    ddp_fusion.config.enabled = True
    model = torch.compile(ddp_fusion.DistributedDataParallel(net))
    model(x).square().sum().backward()
    print(json.dumps({
        "max_error": max(
            (p.grad - g / world_size).abs().max().item() for p, g in zip(net.parameters(), local)
        ),
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "pass_ran": counters["ddp_fusion"]["graphs"],
        "plans_run": counters["ddp_fusion"]["plans_run"],
        "plan_logged": any("running bucket plan" in m for m in records),
    }))


def elastic() -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    local = torch.autograd.grad(net(x).sum(), list(net.parameters()))
    ddp_fusion.config.enabled = True
    errors = {}
    for world_size in (2, 4):
        dist.init_process_group("fake", store=_torch.distributed.fake_store(), rank=0, world_size=world_size)
        if world_size == 2:
            model = torch.compile(ddp_fusion.DistributedDataParallel(net))
        for p in net.parameters():
            p.grad = None
        model(x).sum().backward()
        errors[world_size] = max(
            (p.grad - g / world_size).abs().max().item() for p, g in zip(net.parameters(), local)
        )
        dist.destroy_process_group()
    print(json.dumps({"max_error": errors, "pass_ran": counters["ddp_fusion"]["graphs"]}))


if __name__ == "__main__":
    elastic() if sys.argv[1] == "elastic" else main(int(sys.argv[1]))
