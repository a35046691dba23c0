"""Per-step cost of the cross-rank plan check (``ddp_fusion::plan_guard``).

Each fused backward graph has one plan check per process group: ``plan_check_start``
at graph start issues an async all-gather of one int64 per rank, and ``plan_guard``,
before the group's first bucket, waits for it and compares on the host. This times the
pair back to back on 2 local gloo ranks (so nothing hides the collective), next to a
bare all-gather of the same size, and prints microseconds per call (median and max over
rounds of the slower rank's mean).

Then, in the same run, the step time of a fused, compiled MLP (the demo's: 8 x
Linear(512, 512), batch 64) with the check and with it patched out, alternating per
round on the same compiled model, so the check's share of a step shows.

    python -m bench.plan_check [--calls 2000] [--rounds 5] [--steps 20]
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
    from ddp_fusion.verify import PLAN_CHECK_START, PLAN_GUARD

    group = dist.group.WORLD
    name = group.group_name
    plan = '[{"dtype": "torch.float32", "device": "cpu", "reduce_op": "avg", "bytes": 4096, "grads": ["w"]}]'
    cpu = torch.device("cpu")
    one, everyone = torch.zeros(1, dtype=torch.int64), torch.zeros(world_size, dtype=torch.int64)
    modes = {
        "bare all_gather of 1 int64 per rank": lambda: dist.all_gather_into_tensor(everyone, one),
        "plan_check_start + plan_guard, back to back": lambda: PLAN_GUARD(
            PLAN_CHECK_START(name, plan, cpu), name, plan, "avg", cpu
        ),
    }
    for fn in modes.values():  # warm up
        _time(fn, 50)
    out = {m: [] for m in modes}
    for _ in range(rounds):
        for m, fn in modes.items():
            out[m].append(_time(fn, calls))
    return out


def _step_rank(rank: int, world_size: int, rounds: int, steps: int) -> dict:
    import ddp_fusion
    from ddp_fusion import verify
    from ddp_fusion.demo import _model

    real_check = verify._needs_exchange
    with ddp_fusion.config.patch(enabled=True):
        model = torch.compile(ddp_fusion.DistributedDataParallel(_model(512, 8)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(64, 512)

        def step() -> None:
            opt.zero_grad(set_to_none=False)
            model(x).square().mean().backward()
            opt.step()

        for _ in range(3):  # compiles
            step()
        out: dict[str, list[float]] = {"with check": [], "check patched out": []}
        for _ in range(rounds):
            for mode in out:
                verify._needs_exchange = real_check if mode == "with check" else (lambda group: False)
                times = []
                for _ in range(steps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    step()
                    times.append((time.perf_counter() - t0) * 1e3)
                out[mode].append(statistics.median(times))
        verify._needs_exchange = real_check
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round and mode")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, 2 gloo ranks, {args.rounds} rounds x {args.calls} calls", flush=True)
    results = run_ranks(_rank, world_size=2, args=(args.calls, args.rounds), threads_per_rank=1)
    print(f"\n{'what':<42}{'median us':>11}{'max us':>9}")
    for mode in results[0]:
        per_round = [max(r[mode][i] for r in results) for i in range(args.rounds)]
        print(f"{mode:<42}{statistics.median(per_round):>11.1f}{max(per_round):>9.1f}")
    print(f"\nfused MLP step (8 x Linear(512, 512), batch 64), median of {args.steps} steps per "
          "round, slower rank", flush=True)
    steps = run_ranks(_step_rank, world_size=2, args=(args.rounds, args.steps), timeout=1200)
    print(f"{'mode':<42}{'median ms':>11}{'max ms':>9}")
    for mode in steps[0]:
        per_round = [max(r[mode][i] for r in steps) for i in range(args.rounds)]
        print(f"{mode:<42}{statistics.median(per_round):>11.2f}{max(per_round):>9.2f}")


if __name__ == "__main__":
    main()
