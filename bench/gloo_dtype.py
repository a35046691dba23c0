"""gloo all-reduce time per dtype for the same element count (2 local ranks).

The cost model calibrates on fp32 and takes an fp16 bucket as half the bytes, so half
the time. This measures whether gloo on this machine agrees: ``dist.all_reduce`` of
1 MiB and 5 MiB worth of fp32 elements, in fp32 and in fp16 (and bf16), median of
``--reps`` calls after a barrier each, max over ranks.

    python -m bench.gloo_dtype [--reps 40]
"""

from __future__ import annotations

import argparse

import torch

from bench._lib import comm
from ddp_fusion.launch import run_ranks

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NUMELS = (262_144, 1_310_720)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gloo_dtype", description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args(argv)
    ranks = run_ranks(comm.dtype_times, world_size=2, args=(NUMELS, DTYPES, args.reps), threads_per_rank=1)
    print(f"bench.gloo_dtype: torch {torch.__version__}, 2 gloo ranks, median of {args.reps} calls, "
          "max over ranks")
    print(f"{'elements':>10}{'dtype':>16}{'MB':>8}{'ms':>8}{'ms / fp32 ms':>14}")
    for numel in NUMELS:
        fp32 = max(r[numel, str(torch.float32)] for r in ranks)
        for dtype in DTYPES:
            ms = max(r[numel, str(dtype)] for r in ranks)
            mb = numel * dtype.itemsize / 1e6
            print(f"{numel:>10,}{str(dtype):>16}{mb:>8.2f}{ms:>8.3f}{ms / fp32:>14.2f}")


if __name__ == "__main__":
    main()
