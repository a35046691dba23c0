"""Does a comm hook whose futures issue more collectives (PowerSGD) survive several
buckets on gloo? Eager torch DDP against ddp_fusion, same model, same buckets.

PowerSGD all-reduces a bucket's uncompressed tensors, then from that future's callback
its P matrices, then from the next callback its Q matrices. gloo completes futures on
its own threads, so with several buckets in flight the ranks can issue these chained
all-reduces in different orders, and the collectives do not match (a hang until the
process-group timeout, or gloo's size-mismatch error). ddp_fusion calls each bucket's
hook only once the previous bucket's future has completed (ddp_fusion/comm_hooks.py).

Each trial (``bench/_lib/probes.py``): 2 fresh gloo ranks, the 3-layer MLP of
tests/_workers_hooks.py (3 buckets of 1 MiB at ``bucket_cap_mb=0.25``), ``powerSGD_hook``
(rank 1, compression from step 2), ``--steps`` SGD steps, process-group timeout
``--pg-timeout`` s. A trial still running ``3 * pg-timeout + 60`` s after it started is
killed and reported as not finished (eager torch DDP was seen to hang well past its
process-group timeout).

    python -m bench.hook_order                 # 3 trials per mode
    python -m bench.hook_order --trials 5 --modes eager_ddp

Prints one line per trial and a summary.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench._lib import probes
from ddp_fusion.launch import run_ranks

MODES = ("eager_ddp", "ddp_fusion_uncompiled", "ddp_fusion_compiled")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.hook_order", description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pg-timeout", type=float, default=30.0)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    print(f"bench.hook_order: torch {torch.__version__}, 2 gloo ranks, powerSGD_hook on 3 buckets, "
          f"{args.steps} steps, process-group timeout {args.pg_timeout:g} s", flush=True)
    summary = {}
    for mode in args.modes.split(","):
        ok = 0
        for trial in range(args.trials):
            t = time.perf_counter()
            try:
                run_ranks(probes.powersgd_trial, world_size=2, args=(mode, args.steps),
                          timeout=args.pg_timeout * 3 + 60, pg_timeout=args.pg_timeout)
                outcome = "ok"
                ok += 1
            except RuntimeError as e:  # what failed is the result
                lines = [ln.strip() for ln in str(e).splitlines() if "Error" in ln]
                outcome = "FAILED: " + (lines[-1][:160] if lines else str(e).splitlines()[0][:160])
            print(f"{mode:<24} trial {trial + 1}: {outcome} ({time.perf_counter() - t:.0f} s)", flush=True)
        summary[mode] = ok
    print("\nsummary (trials that completed):")
    for mode, ok in summary.items():
        print(f"  {mode:<24} {ok}/{args.trials}")


if __name__ == "__main__":
    main()
