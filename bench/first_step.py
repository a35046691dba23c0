"""The first training step under the flag, against DDPOptimizer and ``torch.compile``
without DDP, with a cold and a warm Inductor cache, and where its time goes.

Each (model, mode) job runs on fresh rank processes (2 gloo ranks, CPU) twice: once with
an empty ``TORCHINDUCTOR_CACHE_DIR`` (cold) and once more, on new processes, with the
cache that run filled (warm: Inductor's FX graph cache and AOTAutograd's cache on and
hit, compiled kernels reused; Dynamo and compiled autograd trace again, as in a
restarted job). Each of the first
``--steps`` steps is timed alone, between barriers; the time of the first is broken
down into torch's compile phases (``dynamo_timed``: Dynamo's tracing of a frame,
AOTAutograd, Inductor's lowering and code generation, the FX graph cache) and
ddp_fusion's own parts (learning eager autograd's ready order, the pass).

Modes: ``ddp_fusion_stock`` (torch DDP with ``ddp_fusion.config.enabled = True``, as
an HF Trainer or Lightning run sees it), ``ddp_optimizer`` (torch DDP compiled with
Dynamo's DDPOptimizer) and ``compute_only`` (``torch.compile(model)``, no DDP, no
communication).

    python -m bench.first_step                          # hf_gpt2 and mlp
    python -m bench.first_step --model gpt --modes ddp_fusion_stock,ddp_optimizer

Writes a table to stdout and ``bench/out/first_step.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any

from bench._lib import models, step
from bench._lib.jobs import Job, JobError
from bench._lib.modes import all_modes
from bench._lib.record import provenance, write_json

MODES = ["ddp_fusion_stock", "ddp_optimizer", "compute_only"]
# phases shown (dynamo_timed keys; nested ones are also inside their parents)
PHASES = {
    "dynamo": "_compile.compile_inner",
    "aot": "create_aot_dispatcher_function",
    "inductor": "compile_fx_inner",
    "codegen": "fx_codegen_and_compile",
}


def run_job(model: str, mode: str, steps: int, cache_dir: str) -> dict[str, Any]:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    job = Job(model, mode, None, graph_caches=True)
    try:
        job.start()
        per_rank = job.run(step.first_steps, steps)
    finally:
        job.stop()
    first = max(r["times_s"][0] for r in per_rank)
    rank0 = per_rank[0]
    return {"first_s": first,
            "later_s": [max(r["times_s"][i] for r in per_rank) for i in range(1, steps)],
            "compile_phases_s": rank0["compile_phases_s"],
            "ready_order_s": rank0["ddp_fusion ready order"],
            "pass_s": rank0["ddp_fusion pass"]}


def phase(rec: dict[str, Any], key: str) -> float:
    return sum(v for k, v in rec["compile_phases_s"].items() if k == key or k.endswith("." + key))


def table(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    lines = []
    for model, by_mode in results.items():
        lines += ["", f"{model}: first step (s), cold and warm Inductor cache; rank 0's first-step "
                  "compile phases (s) with the warm cache", "",
                  "| mode | cold | warm | warm / DDPOptimizer | step 2 (warm) | "
                  + " | ".join(PHASES) + " | ready order | pass |",
                  "|---" * (6 + len(PHASES)) + "|"]
        ref = by_mode.get("ddp_optimizer", {}).get("warm")
        for mode, rec in by_mode.items():
            if "error" in rec:
                lines.append(f"| {mode} | failed: {rec['error']} |")
                continue
            cold, warm = rec["cold"], rec["warm"]
            ratio = f"{warm['first_s'] / ref['first_s']:.2f}x" if ref else "-"
            step2 = f"{warm['later_s'][0]:.3f}" if warm["later_s"] else "-"
            cells = [f"{phase(warm, k):.2f}" for k in PHASES.values()]
            lines.append(f"| {mode} | {cold['first_s']:.1f} | {warm['first_s']:.1f} | {ratio} | {step2} | "
                         + " | ".join(cells) + f" | {warm['ready_order_s']:.2f} | {warm['pass_s']:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.first_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="hf_gpt2,mlp",
                   help=f"comma-separated, of: {', '.join(sorted(models.MODELS))} (default hf_gpt2,mlp)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated (default {','.join(MODES)})")
    p.add_argument("--steps", type=int, default=3, help="steps timed one by one (default 3)")
    args = p.parse_args(argv)
    names = [m for m in args.model.split(",") if m]
    bad = [m for m in names if m not in models.MODELS]
    if bad or args.steps < 1:
        p.error(f"unknown model {bad}" if bad else "--steps must be at least 1")
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in all_modes()]
    if unknown or not modes:
        p.error(f"unknown mode {unknown}; modes: {', '.join(all_modes())}" if unknown else "--modes is empty")
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for model in names:
        results[model] = {}
        for mode in modes:
            cache = tempfile.mkdtemp(prefix="first_step_cache_")
            try:
                rec = {"cold": run_job(model, mode, args.steps, cache)}
                rec["warm"] = run_job(model, mode, args.steps, cache)
            except JobError as e:
                rec = {"error": str(e)}
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            results[model][mode] = rec
            print(f"{model} {mode}: " + (rec.get("error") or
                  f"cold {rec['cold']['first_s']:.1f} s, warm {rec['warm']['first_s']:.1f} s"), flush=True)
    print("\n".join(table(results)))
    print(f"\nwrote {write_json('first_step.json', {'provenance': provenance(), 'results': results})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
