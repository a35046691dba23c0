"""One callback per backward against a hook per parameter, in one process, step by step.

On a VM whose speed drifts by tens of percent between rounds, two processes taking turns
(``bench.host_cost``) cannot resolve a change of a few percent. Here the two designs
live in one process: the same model built three times, wrapped twice with ddp_fusion
(one reducing from its callback, the default once compiled; one kept on a hook per
parameter), once bare (the compiled-autograd floor), all compiled, and the steps taken
in turn, A B F A B F ..., so that each triple runs in the same conditions. It prints
the median of the per-triple ratios and differences, and each design over the floor per
parameter. World size 1 (gloo), one thread::

    python -m bench.callback_ab --model mlp_params --zero-grad none --steps 600
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import ddp_fusion
from bench._lib import models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp_params", choices=["mlp_params", "mlp_host", "mlp"])
    ap.add_argument("--zero-grad", default="none", choices=["none", "zeros"])
    ap.add_argument("--steps", type=int, default=600, help="timed steps of each model")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    ddp_fusion.config.enabled = True
    (x, y), = models.make_batches(args.model, 0, 1)

    def build(kind: str):
        module = models.make_model(args.model)
        if kind == "floor":
            model = module
        else:
            model = ddp_fusion.DistributedDataParallel(module)
            if kind == "hooks":
                model._sync.use_callback = lambda: None  # keep a hook per parameter
        compiled = torch.compile(model)
        loss = models.loss_of(args.model, compiled)

        def step() -> float:
            module.zero_grad(set_to_none=args.zero_grad == "none")
            t = time.perf_counter()
            loss(x, y).backward()
            return time.perf_counter() - t

        return model, step

    kinds = ("callback", "hooks", "floor")
    built = {k: build(k) for k in kinds}
    for k in kinds:  # compile and warm up (the floor's backward turns compiled autograd on
        for _ in range(5):  # through the wrapped models' first compiled forward)
            built[k][1]()
    assert built["callback"][0]._sync.callback and not built["hooks"][0]._sync.callback
    n = sum(p.numel() > 0 for p in built["floor"][0].parameters())
    times = {k: [] for k in kinds}
    for _ in range(args.steps):
        for k in kinds:
            times[k].append(built[k][1]())
    ratio = [c / h for c, h in zip(times["callback"], times["hooks"])]
    diff = [(c - h) * 1e3 for c, h in zip(times["callback"], times["hooks"])]
    print(f"{args.model}, zero_grad set_to_none={args.zero_grad == 'none'}, {n} parameters, "
          f"{args.steps} steps each, torch {torch.__version__}")
    print(f"callback / hooks per triple: median {statistics.median(ratio):.3f}, "
          f"difference median {statistics.median(diff):+.3f} ms, callback faster in "
          f"{sum(d < 0 for d in diff)} of {len(diff)}")
    floor = statistics.median(times["floor"]) * 1e3
    for k in kinds:
        med = statistics.median(times[k]) * 1e3
        p10 = sorted(times[k])[len(times[k]) // 10] * 1e3
        over = ("" if k == "floor" else
                f", over the floor {med - floor:+.3f} ms = {(med - floor) / n * 1e3:+.2f} µs per parameter")
        print(f"  {k:9s} step median {med:.3f} ms (p10 {p10:.3f}){over}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
