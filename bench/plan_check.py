"""Per-step cost of the cross-rank plan check (``ddp_fusion::plan_guard``).

Each fused backward graph starts with one plan check per process group: an all-gather
of one int64 per rank and a read of the result on the host. This times that check on 2
local gloo ranks, next to a bare all-gather of the same size and the guard op as the
compiled graph calls it, and prints microseconds per call (median and max over rounds
of the slower rank's mean).

    python -m bench.plan_check [--calls 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ddp_fusion.launch import run_ranks


def _time(fn, calls: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _rank(rank: int, world_size: int, calls: int, rounds: int) -> dict:
    from ddp_fusion.verify import PLAN_GUARD, check_plan_across_ranks

    group = dist.group.WORLD
    name = group.group_name
    plan = '[{"dtype": "torch.float32", "device": "cpu", "reduce_op": "avg", "bytes": 4096, "grads": ["w"]}]'
    cpu = torch.device("cpu")
    one, everyone = torch.zeros(1, dtype=torch.int64), torch.zeros(world_size, dtype=torch.int64)
    modes = {
        "bare all_gather of 1 int64 per rank": lambda: dist.all_gather_into_tensor(everyone, one),
        "plan check (all_gather + compare)": lambda: check_plan_across_ranks(group, name, plan, cpu),
        "plan_guard op (check + divisor tensor)": lambda: PLAN_GUARD(name, plan, "avg", cpu),
    }
    for fn in modes.values():  # warm up
        _time(fn, 50)
    out = {m: [] for m in modes}
    for _ in range(rounds):
        for m, fn in modes.items():
            out[m].append(_time(fn, calls))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, 2 gloo ranks, {args.rounds} rounds x {args.calls} calls", flush=True)
    results = run_ranks(_rank, world_size=2, args=(args.calls, args.rounds), threads_per_rank=1)
    print(f"\n{'what':<42}{'median us':>11}{'max us':>9}")
    for mode in results[0]:
        per_round = [max(r[mode][i] for r in results) for i in range(args.rounds)]
        print(f"{mode:<42}{statistics.median(per_round):>11.1f}{max(per_round):>9.1f}")


if __name__ == "__main__":
    main()
