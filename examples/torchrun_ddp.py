"""A torchrun script as users write it: torch DDP, then torch.compile. ddp_fusion needs
one line before the model is wrapped (or DDP_FUSION=1 in the environment).

    torchrun --nproc_per_node 2 examples/torchrun_ddp.py
"""

import torch
import torch.distributed as dist

import ddp_fusion
from _common import BUCKET_CAP_MB, count_all_reduces, finish, model, parse_args, rank_batches


def main() -> None:
    args = parse_args(__doc__)
    dist.init_process_group("gloo")
    if args.mode == "fused":
        ddp_fusion.config.enabled = True  # the one line: before wrapping
    ddp = torch.nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=BUCKET_CAP_MB)
    net = torch.compile(ddp) if args.mode == "fused" else ddp
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step(x):
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()

    batches = rank_batches(args.steps)
    for x in batches[:-1]:
        step(x)
    finish(args, ddp, count_all_reduces(lambda: step(batches[-1])))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
