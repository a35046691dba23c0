"""The demo behind ``python -m ddp_fusion``: a small fused training demo on 2 CPU ranks (gloo).

Trains the same MLP three times under ``torch.compile`` (see MODES): with
``ddp_fusion.config.enabled`` off (the eager bucketed reducer), with compiled autograd
but no fusion (one all-reduce per gradient), and fused (one per bucket). Prints rank 0's
bucket plan, collectives per step and median step time for each.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import statistics
import tempfile
import time

import torch

import ddp_fusion
from ddp_fusion import _torch
from ddp_fusion.config import ALGORITHMS
from ddp_fusion.launch import run_ranks


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _collectives(step) -> int:
    with torch.profiler.profile() as prof:
        step()
    return sum(1 for e in prof.events() if e.name == "gloo:all_reduce")


MODES = ("eager_reducer", "unfused", "fused")
"""eager_reducer: compiled forward/backward, ``enabled = False``, gradients through the
wrapper's eager bucketed reducer. unfused: compiled autograd, the pass removed, one
blocking all-reduce per gradient. fused: compiled autograd and the pass."""


def _without_pass():
    return _torch.inductor.without_post_grad_pass()


def _run(rank: int, world_size: int, args: argparse.Namespace, dump_dir: str) -> dict:
    results = {}
    for mode in MODES:
        enabled = mode != "eager_reducer"
        torch.compiler.reset()
        with ddp_fusion.config.patch(
            enabled=enabled, algorithm=args.algorithm, dump_dir=dump_dir if mode == "fused" else None
        ), _without_pass() if mode == "unfused" else contextlib.nullcontext():
            ddp = ddp_fusion.DistributedDataParallel(
                _model(args.width, args.depth), bucket_cap_mb=args.bucket_cap_mb
            )
            model = torch.compile(ddp)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            x = torch.randn(args.batch, args.width)

            def step(model=model, opt=opt, x=x) -> None:
                opt.zero_grad(set_to_none=False)
                model(x).square().mean().backward()
                opt.step()

            t0 = time.perf_counter()
            for _ in range(3):  # compiles: first step (no .grad yet) and the next
                step()
            compile_s = time.perf_counter() - t0
            times = []
            for _ in range(args.steps):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            results[mode] = {
                "step_ms": 1e3 * statistics.median(times),
                "spread_ms": 1e3 * (max(times) - min(times)),
                "collectives": _collectives(step),
                "compile_s": compile_s,
                "num_params": sum(1 for _ in ddp.parameters()),
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m ddp_fusion", description=__doc__.split("\n")[0])
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="concat")
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="as for torch DDP (default: DDP's)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dump-dir", default=None, help="keep the FX dumps here")
    args = parser.parse_args()

    dump_dir = args.dump_dir or tempfile.mkdtemp(prefix="ddp_fusion_dumps_")
    print(f"ddp_fusion demo: {args.depth} x Linear({args.width}, {args.width}) on 2 gloo ranks, "
          f"torch {torch.__version__}; compiling (about a minute on 2 cores)...", flush=True)
    results = run_ranks(_run, world_size=2, args=(args, dump_dir), timeout=1200)[0]

    plans = sorted(glob.glob(os.path.join(dump_dir, "rank0_*.buckets.json")))
    plan = json.load(open(plans[-1]))
    print(f"\nbucket plan (rank 0, steady-state backward graph), algorithm={plan['algorithm']}:")
    for i, b in enumerate(plan["buckets"]):
        print(f"  bucket {i}: {b['num_grads']:3d} grads  {b['bytes'] / 2**20:8.3f} MiB  "
              f"{b['dtype']} group={b['group']}  [{', '.join(b['grads'])}]")
    for u in plan["unfused"]:
        print(f"  unfused: {u['node']}: {u['reason']}")
    print(f"\n{'mode':<14}{'all-reduces/step':>18}{'step ms (median)':>18}{'spread ms':>11}{'compile s':>11}")
    for mode in MODES:
        r = results[mode]
        print(f"{mode:<14}{r['collectives']:>18}{r['step_ms']:>18.2f}{r['spread_ms']:>11.2f}{r['compile_s']:>11.1f}")
    speedup = results["unfused"]["step_ms"] / results["fused"]["step_ms"]
    print(f"\nfused is {speedup:.2f}x the speed of unfused (both compiled autograd); "
          f"dumps in {dump_dir}")


if __name__ == "__main__":
    main()
