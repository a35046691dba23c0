"""Where a mode's step time goes: ``torch.profiler`` over 10 steps of one model per
mode (2 gloo ranks, one process pair per mode, as ``bench.step_time`` builds them),
then 30 timed steps; prints rank 0's per-step CPU time in the compiled regions,
ddp_fusion's ops and the collectives.

    python -m bench.profile_step --model hf_gpt2 --modes upstream_python_reducer_concat,ddp_fusion_stock
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ddp_fusion.launch import run_ranks

_KEYS = ("gloo:", "ddp_fusion::", "Torch-Compiled Region", "CompiledFunction", "Optimizer.step")


def profile_mode(rank: int, world_size: int, model: str, mode: str) -> dict | None:
    from bench import _step_time_worker as W
    from torch.profiler import profile

    torch.set_num_threads(1)
    torch._dynamo.reset()
    m = W.all_modes()[mode]
    with m.context():
        step, _ = W._build(model, m, None, W.make_batches(model, rank, 4))
        for _ in range(5):
            step()
        dist.barrier()
        with profile() as prof:
            for _ in range(10):
                step()
        times = []
        for _ in range(30):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
    if rank:
        return None
    per_step = {e.key: round(e.cpu_time_total / 10 / 1e3, 3)
                for e in prof.key_averages() if e.key.startswith(_KEYS)}
    return {"median_ms": round(statistics.median(times), 2), "cpu_ms_per_step": per_step}


def main() -> None:
    from bench._step_time_worker import MODELS, all_modes

    parser = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="hf_gpt2", choices=sorted(MODELS))
    parser.add_argument("--modes", default="upstream_python_reducer_concat,ddp_fusion_stock",
                        help=f"comma-separated, from: {','.join(all_modes())}")
    args = parser.parse_args()
    for mode in args.modes.split(","):
        result = run_ranks(profile_mode, world_size=MODELS[args.model]["world_size"],
                           args=(args.model, mode), timeout=900)[0]
        print(f"{mode}: median {result['median_ms']} ms; CPU ms per step: {result['cpu_ms_per_step']}",
              flush=True)


if __name__ == "__main__":
    main()
