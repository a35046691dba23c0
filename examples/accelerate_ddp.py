"""Hugging Face Accelerate as its users run it: ``Accelerator(dynamo_backend="inductor")``,
``prepare(model, optimizer, dataloader)``, ``accelerator.backward(loss)``. Accelerate
wraps the model in torch DDP and then compiles the DDP; ddp_fusion needs one line
before ``prepare``. On CPU, Accelerate needs ``cpu=True`` (or ACCELERATE_USE_CPU=1).

    torchrun --nproc_per_node 2 examples/accelerate_ddp.py
"""

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs

import ddp_fusion
from _common import BUCKET_CAP_MB, count_all_reduces, dataset, finish, model, parse_args


def main() -> None:
    args = parse_args(__doc__)
    accelerator = Accelerator(
        cpu=True,
        dynamo_backend="inductor" if args.mode == "fused" else "no",
        kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=BUCKET_CAP_MB)],
    )
    if args.mode == "fused":
        ddp_fusion.config.enabled = True  # the one line: before prepare() wraps the model
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(dataset(args.steps), batch_size=8)
    net, opt, loader = accelerator.prepare(net, opt, loader)

    def step(x):
        opt.zero_grad()
        accelerator.backward(net(x).square().mean())
        opt.step()

    batches = [x for (x,) in loader][: args.steps]
    for x in batches[:-1]:
        step(x)
    collectives = count_all_reduces(lambda: step(batches[-1]))
    finish(args, _ddp(net), collectives)
    accelerator.end_training()


def _ddp(net):
    """The torch DDP inside what prepare() returned (OptimizedModule(DDP(model)))."""
    return getattr(net, "_orig_mod", net)


if __name__ == "__main__":
    main()
