"""Per-step cost of the cross-rank plan check (``ddp_fusion::plan_guard``).

Each fused backward graph has one plan check per process group: ``plan_check_start``
at graph start starts the max of (h, -h) of the plan's hash over the host group
(ddp_fusion/host_group.py: recursive doubling over a gloo group's send and recv, run by a
C++ thread of the host group's own), and
``plan_guard``, before the group's first bucket, collects it. This times the pair back to
back on local gloo ranks (so nothing hides the exchange), next to the bare exchange and
to the all-gather of one int64 per rank that the check used before, and prints
microseconds per call (median and max over rounds of the slower rank's mean), and the
exchange started, the GIL held 2 ms (as a host launching backward holds it), then
collected: what of it needed this process's GIL waits past the 2 ms. With
``--world-size 4`` the exchange takes two rounds instead of one, and the
MLP step runs on 4 ranks too (on 2 cores the four ranks share them: an upper bound).

A steady step's check runs in the plan ops' C++ kernels (csrc/host_check.cpp) where the
C++ part is built (``config.native_check``); the pair of calls is timed as it ships.

Then, in the same run, the step time of a fused, compiled MLP (the demo's: 8 x
Linear(512, 512), batch 64) with the check as it ships (C++), with the check in Python
(``native_check`` off), with its work skipped (the Python plan ops entered but
returning only their divisor: no exchange), and with each Python plan op's main-thread
CPU timed, in turn per round on the same compiled model, so the check's share of a step
shows; and, with the Python check, whether each step's exchange had finished by the time
the guard collected it (the main thread running backward meanwhile), and how long the
guard blocked on it. The rank functions are in bench/_lib/probes.py.

    python -m bench.plan_check [--calls 2000] [--rounds 5] [--steps 20] [--world-size 2]
    python -m bench.plan_check --model hf_gpt2 --rounds 30 --steps 50   # a bench model's step
    python -m bench.plan_check --plan-sizes 1,1000,10000   # the ops' own cost vs plan size

``--plan-sizes`` times, in one process on a fake group (no exchange), one step's plan
ops as a fused graph of one group calls them (``plan_check_start``, ``plan_guard``,
through the dispatcher) for plans of N gradients: their cost must not grow with N.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from bench._lib import probes, step
from bench._lib.jobs import Job
from bench._lib.models import MODELS
from ddp_fusion.launch import run_ranks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.plan_check", description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round and mode")
    parser.add_argument("--world-size", type=int, default=2, choices=(2, 4))
    parser.add_argument("--no-step", action="store_true", help="only the calls, not the MLP step")
    parser.add_argument("--model", default=None, choices=sorted(MODELS),
                        help="time this bench.step_time model's ddp_fusion_concat step in the modes "
                             "above, instead of the demo MLP's (the calls are skipped)")
    parser.add_argument("--plan-sizes", default=None, metavar="N,N,...",
                        help="only the plan ops' per-step cost for plans of these numbers of gradients")
    args = parser.parse_args(argv)
    if args.plan_sizes:
        _plan_sizes([int(n) for n in args.plan_sizes.split(",")], args.calls, args.rounds)
        return
    if args.model:
        _model_step(args)
        return
    print(f"torch {torch.__version__}, {args.world_size} gloo ranks, {args.rounds} rounds x "
          f"{args.calls} calls", flush=True)
    results = run_ranks(probes.plan_check_calls, world_size=args.world_size,
                        args=(args.calls, args.rounds), threads_per_rank=1)
    print(f"\n{'what':<46}{'median us':>11}{'max us':>9}")
    for mode in results[0]:
        per_round = [max(r[mode][i] for r in results) for i in range(args.rounds)]
        print(f"{mode:<46}{statistics.median(per_round):>11.1f}{max(per_round):>9.1f}")
    if args.no_step:
        return
    steps = run_ranks(probes.plan_check_step, world_size=args.world_size, args=(args.rounds, args.steps),
                      timeout=1200)
    _print_steps("fused MLP step (8 x Linear(512, 512), batch 64)", args, steps)


def _plan_sizes(sizes: list[int], calls: int, rounds: int) -> None:
    import time

    import torch.distributed as dist

    from bench._lib import _torch
    from ddp_fusion import plan_check
    from ddp_fusion.plan import BucketPlan, PlannedBucket

    dist.init_process_group("fake", store=_torch.fake_store(), rank=0, world_size=2)
    name, cpu = dist.group.WORLD.group_name, torch.device("cpu")
    print(f"torch {torch.__version__}, fake group of 2 (no exchange), best of {rounds} x {calls} steps")
    print(f"{'gradients':>10}{'plan bytes':>12}{'in the graph':>14}{'plan ops per step, us':>24}")
    for n in sizes:
        grads = tuple(f"transformer.h.{i}.attn.c_attn.weight" for i in range(n))
        text = BucketPlan("concat", (PlannedBucket(name, torch.float32, "cpu", "avg", "concat",
                                                   grads, (1024,) * n),)).to_json()
        # as the graph has it
        size, h, text = len(text), plan_check.plan_hash(text), plan_check.graph_text(text)

        def step(text: str = text, h: int = h) -> None:
            divisor = plan_check.PLAN_CHECK_START(name, text, h, cpu, "avg")
            plan_check.PLAN_GUARD(divisor, name, h, "avg", cpu)

        best = float("inf")
        for _ in range(rounds + 1):  # the first round warms up
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        print(f"{n:>10}{size:>12}{len(text):>14}{best:>24.1f}", flush=True)
    dist.destroy_process_group()


def _model_step(args: argparse.Namespace) -> None:
    job = Job(args.model, "ddp_fusion_concat", None)
    try:
        job.start()
        job.run(step.warmup, 5)
        steps = job.run(probes.plan_check_job_step, args.rounds, args.steps)
    finally:
        job.stop()
    _print_steps(f"{args.model}, ddp_fusion_concat", args, steps)


def _print_steps(what: str, args: argparse.Namespace, steps: list[dict[str, list[float]]]) -> None:
    print(f"\n{what}: median of {args.steps} steps per round, slower rank", flush=True)
    print(f"{'mode':<46}{'median':>11}{'max':>9}   (step: ms, slower rank; the guard: worst rank)")
    for mode in steps[0]:
        worst = min if mode.endswith("%") else max
        per_round = [worst(r[mode][i] for r in steps) for i in range(args.rounds)]
        print(f"{mode:<46}{statistics.median(per_round):>11.2f}{max(per_round):>9.2f}")
    slower = {m: [max(r[m][i] for r in steps) for i in range(args.rounds)]
              for m in ("C++ check", "Python check", "check's work skipped") if m in steps[0]}
    for a, b in itertools.combinations(slower, 2):
        ratios = [x / y for x, y in zip(slower[a], slower[b])]
        print(f"{a} / {b}, per round: median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f}, the first slower in "
              f"{sum(r > 1 for r in ratios)} of {len(ratios)} rounds)")


if __name__ == "__main__":
    main()
