"""Lightning Fabric as its users run it: ``Fabric(strategy="ddp")`` on CPU, a
``torch.compile``d model given to ``fabric.setup`` (Fabric wraps the module in torch
DDP and compiles the DDP again with the same settings), ``fabric.backward(loss)``.
ddp_fusion needs one line before ``setup``.

    torchrun --nproc_per_node 2 examples/fabric_ddp.py
"""

import lightning  # noqa: F401  (before torch.compile: Lightning records compile settings)
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy

import ddp_fusion
from _common import BUCKET_CAP_MB, count_all_reduces, dataset, finish, model, parse_args


def main() -> None:
    args = parse_args(__doc__)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(bucket_cap_mb=BUCKET_CAP_MB))
    fabric.launch()
    if args.mode == "fused":
        ddp_fusion.config.enabled = True  # the one line: before setup() wraps the model
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    fnet, opt = fabric.setup(torch.compile(net) if args.mode == "fused" else net, opt)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset(args.steps), batch_size=8))

    def step(x):
        opt.zero_grad()
        fabric.backward(fnet(x).square().mean())
        opt.step()

    batches = [x for (x,) in loader][: args.steps]
    for x in batches[:-1]:
        step(x)
    collectives = count_all_reduces(lambda: step(batches[-1]))
    forward = fnet._forward_module
    finish(args, getattr(forward, "_orig_mod", forward), collectives)


if __name__ == "__main__":
    main()
