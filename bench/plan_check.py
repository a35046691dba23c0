"""Per-step cost of the cross-rank plan check (``ddp_fusion::plan_guard``).

Each fused backward graph has one plan check per process group: ``plan_check_start``
at graph start issues an async all-gather of one int64 per rank, and ``plan_guard``,
before the group's first bucket, waits for it and compares on the host. This times the
pair back to back on 2 local gloo ranks (so nothing hides the collective), next to a
bare all-gather of the same size, and prints microseconds per call (median and max over
rounds of the slower rank's mean).

Then, in the same run, the step time of a fused, compiled MLP (the demo's: 8 x
Linear(512, 512), batch 64) with the check and with its exchange patched out
(``ddp_fusion.plan_check.has_peers`` false), alternating per round on the same compiled
model, so the check's share of a step shows. The rank functions are in
bench/_lib/probes.py.

    python -m bench.plan_check [--calls 2000] [--rounds 5] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench._lib import probes
from ddp_fusion.launch import run_ranks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.plan_check", description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round and mode")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, 2 gloo ranks, {args.rounds} rounds x {args.calls} calls", flush=True)
    results = run_ranks(probes.plan_check_calls, world_size=2, args=(args.calls, args.rounds),
                        threads_per_rank=1)
    print(f"\n{'what':<46}{'median us':>11}{'max us':>9}")
    for mode in results[0]:
        per_round = [max(r[mode][i] for r in results) for i in range(args.rounds)]
        print(f"{mode:<46}{statistics.median(per_round):>11.1f}{max(per_round):>9.1f}")
    print(f"\nfused MLP step (8 x Linear(512, 512), batch 64), median of {args.steps} steps per "
          "round, slower rank", flush=True)
    steps = run_ranks(probes.plan_check_step, world_size=2, args=(args.rounds, args.steps), timeout=1200)
    print(f"{'mode':<46}{'median ms':>11}{'max ms':>9}")
    for mode in steps[0]:
        per_round = [max(r[mode][i] for r in steps) for i in range(args.rounds)]
        print(f"{mode:<46}{statistics.median(per_round):>11.2f}{max(per_round):>9.2f}")


if __name__ == "__main__":
    main()
