"""The plan check's C++ steady path against DDPOptimizer: a bench model's step (2 gloo
ranks) under DDPOptimizer, under ddp_fusion concat as it ships (a steady step's plan
check in the C++ kernels, csrc/host_check.cpp), and under ddp_fusion concat with the
check in Python (``config.native_check`` off), timed round-robin on kept ranks (the two
ddp_fusion modes on the same compiled model), and each pair's per-round ratio of the
slower rank's median step.

    python -m bench.compiled_check --model hf_gpt2 --rounds 30 --steps 20
"""

from __future__ import annotations

import argparse
import itertools
import statistics

from bench._lib import probes, step
from bench._lib.jobs import Job
from bench._lib.models import MODELS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.compiled_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="hf_gpt2", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round and mode")
    args = parser.parse_args(argv)
    peer, fused = Job(args.model, "ddp_optimizer", None), Job(args.model, "ddp_fusion_concat", None)
    if peer.world_size != 2:
        parser.error(f"{args.model} runs on {peer.world_size} ranks; this compares two")
    modes = {"ddp_optimizer": (peer, step.time_steps),
             "ddp_fusion, Python check": (fused, probes.time_steps_python_check),
             "ddp_fusion, C++ check (shipped)": (fused, step.time_steps)}
    medians: dict[str, list[float]] = {m: [] for m in modes}
    names = list(modes)
    try:
        for job in (peer, fused):
            job.start()
            job.run(step.warmup, 3)
        for i in range(args.rounds):
            for name in names[i % 3:] + names[:i % 3]:
                job, fn = modes[name]
                ranks = job.run(fn, args.steps)
                medians[name].append(statistics.median(max(r["times_ms"][s] for r in ranks)
                                                       for s in range(args.steps)))
    finally:
        peer.stop()
        fused.stop()
    print(f"\n{args.model}: {args.rounds} rounds x {args.steps} steps; per round the median over steps "
          "of the slower rank's step, ms")
    for name, per_round in medians.items():
        print(f"{name:<36}{statistics.median(per_round):>8.3f}   best round {min(per_round):.3f}")
    for a, b in itertools.combinations(names, 2):
        ratios = [x / y for x, y in zip(medians[b], medians[a])]
        print(f"{b} / {a}: per round median {statistics.median(ratios):.3f} "
              f"(the first slower in {sum(r > 1 for r in ratios)} of {len(ratios)} rounds)")


if __name__ == "__main__":
    main()
