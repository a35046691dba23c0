"""Where a mode's step time goes: ``torch.profiler`` over 10 steps of one model per
mode (2 gloo ranks, one job per mode, built by bench.step_time's worker,
bench/_lib/step.py), then 30 timed steps; prints rank 0's per-step CPU time in the
compiled regions, ddp_fusion's ops and the collectives.

    python -m bench.profile_step --model hf_gpt2 --modes upstream_python_reducer_concat,ddp_fusion_stock
    python -m bench.profile_step --device cuda --model mlp_host --modes ddp_fusion_concat --timed 60
"""

from __future__ import annotations

import argparse
import statistics

from bench._lib import step
from bench._lib.jobs import Job
from bench._lib.models import MODELS
from bench._lib.modes import all_modes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="hf_gpt2", choices=sorted(MODELS))
    parser.add_argument("--modes", default="upstream_python_reducer_concat,ddp_fusion_stock",
                        help=f"comma-separated, from: {','.join(all_modes())}")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profiled", type=int, default=10)
    parser.add_argument("--timed", type=int, default=30)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: NCCL, one rank per GPU (world size 1 on one GPU)")
    parser.add_argument("--zero-grad", choices=("none", "zeros"), default="none",
                        help="each step's optimizer.zero_grad: set_to_none=True (none) or False (zeros)")
    args = parser.parse_args(argv)
    bad = [m for m in args.modes.split(",") if m not in all_modes()]
    if bad:
        parser.error(f"unknown modes {bad}")
    for mode in args.modes.split(","):
        job = Job(args.model, mode, None, device=args.device, set_to_none=args.zero_grad == "none")
        try:
            job.start()
            job.run(step.warmup, args.warmup)
            cpu_ms = job.run(step.op_times, args.profiled)[0]
            times = job.run(step.time_steps, args.timed)
        finally:
            job.stop()
        per_step = [max(ts) for ts in zip(*(r["times_ms"] for r in times))]
        print(f"{mode}: median {statistics.median(per_step):.2f} ms (max over ranks); rank 0's CPU "
              f"ms per step: {cpu_ms}", flush=True)
        # each step in order, and rank 0's main-thread CPU in it (a step that jumps between
        # two levels shows here; on CUDA a blocking wait spins, so it counts as CPU)
        print(f"  steps ms: {' '.join(f'{t:.1f}' for t in per_step)}", flush=True)
        print(f"  main-thread CPU ms: {' '.join(f'{t:.1f}' for t in times[0]['main_cpu_ms'])}", flush=True)


if __name__ == "__main__":
    main()
