"""What the example scripts share: a small model, each rank's batches, and the result
file a test compares (parameters, collectives in the last step, eager DDP's buckets)."""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn

BUCKET_CAP_MB = 0.03  # small, so the 4-layer model below has several buckets


def parse_args(doc: str, extra=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc)
    if extra is not None:
        extra(parser)
    parser.add_argument("--mode", choices=["fused", "eager"], default="fused",
                        help="fused: ddp_fusion on + torch.compile; eager: neither (torch's eager DDP)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None, help="write this rank's result here (JSON + .pt)")
    return parser.parse_args()


def model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def dataset(steps: int, batch: int = 8, ranks: int = 2) -> torch.utils.data.TensorDataset:
    """``steps`` batches for each of ``ranks`` ranks; the same on every run (a sampler
    shards it)."""
    gen = torch.Generator().manual_seed(100)
    return torch.utils.data.TensorDataset(torch.randn(steps * batch * ranks, 64, generator=gen))


def rank_batches(steps: int, batch: int = 8) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    return [torch.randn(batch, 64, generator=gen) for _ in range(steps)]


def count_all_reduces(step) -> int:
    """All-reduces the process group ran during ``step()`` (gloo or NCCL)."""
    from ddp_fusion._torch.distributed import AllReduces

    with AllReduces() as n:
        step()
    return n.count


def finish(args, ddp, collectives: int) -> None:
    """Report (and with --out, save) what a test compares across modes."""
    from torch._dynamo.utils import counters

    info = {
        "rank": dist.get_rank(),
        # what torchrun told this process, and which agent (its parent) started it
        "env": {k: os.environ.get(k) for k in
                ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")},
        "agent_pid": os.getppid(),
        "mode": args.mode,
        "collectives_last_step": collectives,
        "ddp": f"{type(ddp).__module__}.{type(ddp).__name__}",
        "adopted_by_ddp_fusion": hasattr(ddp, "_ddp_fusion"),
        "fused_plans_run": counters["ddp_fusion"]["plans_run"],
        "unfused": {k: v for k, v in counters["ddp_fusion"].items() if k.startswith("unfused")},
        "ready_order_unknown": counters["ddp_fusion"]["ready order: graph's"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }
    if args.mode == "eager":  # eager DDP's own bucket count after its rebuild
        # (never rebuilt with find_unused_parameters, which the HF Trainer sets by default;
        # eager DDP then also all-reduces a used-parameter bitmap each step)
        data = ddp._get_ddp_logging_data()
        info["eager_buckets"] = len(data.get("rebuilt_bucket_sizes", data["bucket_sizes"]).split(","))
        info["find_unused_parameters"] = ddp.find_unused_parameters
    print(json.dumps(info), flush=True)
    if args.out:
        with open(f"{args.out}.{dist.get_rank()}.json", "w") as f:
            json.dump(info, f)
        params = {n: p.detach().cpu() for n, p in ddp.module.named_parameters()}
        torch.save(params, f"{args.out}.{dist.get_rank()}.pt")
