"""Where a mode's step time goes: one model per mode (2 gloo ranks, or NCCL with
``--device cuda``; one job per mode, built by bench.step_time's worker,
bench/_lib/step.py): 30 timed steps, each in order with its main-thread CPU, then
``torch.profiler`` over 10 steps, then 30 timed steps again. Prints rank 0's per-step CPU
time in the compiled regions, ddp_fusion's ops and the collectives, the ops that take the
most CPU, the CUDA caching allocator's device mallocs and frees over each phase, and
with ``--trace DIR`` writes rank 0's Chrome trace of the profiled steps there.

    python -m bench.profile_step --model hf_gpt2 --modes upstream_python_reducer_concat,ddp_fusion_stock
    python -m bench.profile_step --device cuda --model mlp_host --modes ddp_fusion_concat --timed 60
"""

from __future__ import annotations

import argparse
import os
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
    parser.add_argument("--trace", metavar="DIR", help="write rank 0's Chrome trace of the profiled "
                        "steps to DIR/<model>_<mode>.json")
    args = parser.parse_args(argv)
    bad = [m for m in args.modes.split(",") if m not in all_modes()]
    if bad:
        parser.error(f"unknown modes {bad}")
    for mode in args.modes.split(","):
        job = Job(args.model, mode, None, device=args.device, set_to_none=args.zero_grad == "none")
        path = None
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            path = os.path.join(args.trace, f"{args.model}_{mode}.json")
        try:
            job.start()
            job.run(step.warmup, args.warmup)
            alloc = [job.run(step.allocator)[0]]
            before = job.run(step.time_steps, args.timed)
            alloc.append(job.run(step.allocator)[0])
            top = job.run(step.op_profile, args.profiled, path)[0]
            alloc.append(job.run(step.allocator)[0])
            after = job.run(step.time_steps, args.timed)
            alloc.append(job.run(step.allocator)[0])
        finally:
            job.stop()
        print(f"{mode}: rank 0's CPU ms per step: {top['cpu_ms']}", flush=True)
        for label, times in (("before the profile", before), ("after the profile", after)):
            per_step = [max(ts) for ts in zip(*(r["times_ms"] for r in times))]
            # each step in order, and rank 0's main-thread CPU in it (a step that jumps
            # between two levels shows here; on CUDA a blocking wait spins, so it counts)
            print(f"  {label}: median {statistics.median(per_step):.2f} ms (max over ranks), "
                  f"recompiles {times[0]['recompiles']}", flush=True)
            print(f"    steps ms: {' '.join(f'{t:.1f}' for t in per_step)}", flush=True)
            main = times[0]["main_cpu_ms"]
            print(f"    main-thread CPU ms: {' '.join(f'{t:.1f}' for t in main)}", flush=True)
        print(f"  most self CPU, ms per step (calls per step), rank 0 over {args.profiled} profiled steps:")
        for key, ms in top["self_cpu_ms"].items():
            print(f"    {ms:9.3f}  ({top['calls'][key]:g})  {key}", flush=True)
        if alloc[0]:
            phases = ("timed", "profiled", "timed again")
            print("  CUDA allocator, rank 0, change over each phase: " + "; ".join(
                f"{phase}: " + ", ".join(f"{k} {b[k] - a[k]}" for k in a)
                for phase, a, b in zip(phases, alloc, alloc[1:])), flush=True)
        if path:
            print(f"  trace: {path}", flush=True)

if __name__ == "__main__":
    main()
