"""The first training steps under the flag, against DDPOptimizer and ``torch.compile``
without DDP, with a cold and a warm Inductor cache, and where their time goes.

Each (model, mode) job runs on fresh rank processes (2 gloo ranks, CPU) twice: once with
an empty ``TORCHINDUCTOR_CACHE_DIR`` (cold) and once more, on new processes, with the
cache that run filled (warm: Inductor's FX graph cache and AOTAutograd's cache on,
compiled kernels reused; Dynamo and compiled autograd trace again, as in a restarted
job, and a forward whose backward compiled autograd runs misses AOTAutograd's cache).

Each job's first ``--steps`` steps (default 3: with ``.grad`` kept, the second step's
backward is the first to see ``.grad`` tensors) are timed one by one, between
barriers, compared with ``compute_only``'s, and split into torch's compile phases
(``dynamo_timed``), summed over those steps: the forwards' Dynamo tracing (its own
part, without AOTAutograd and Inductor) and their AOTAutograd + Inductor; the
backwards' compiled-autograd capture (the backward's wall time less the compiles in
it: compiled autograd's tracing of the autograd graph and the hooks, and running the
step), Dynamo's tracing of the captured graph, its AOTAutograd + Inductor; Inductor
alone (``compile_fx_inner``, forward and backward); and ddp_fusion's own parts.

Modes: ``ddp_fusion_stock`` (torch DDP with ``ddp_fusion.config.enabled = True``, as
an HF Trainer or Lightning run sees it), ``ddp_optimizer`` (torch DDP compiled with
Dynamo's DDPOptimizer) and ``compute_only`` (``torch.compile(model)``, no DDP, no
communication).

    python -m bench.first_step                          # hf_gpt2 and mlp
    python -m bench.first_step --model gpt --modes ddp_fusion_stock,ddp_optimizer
    python -m bench.first_step --model mlp --zero-grad zeros   # .grad kept

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
# dynamo_timed keys (nested ones are also counted in their parents)
DYNAMO, AOT, INDUCTOR = "_compile.compile_inner", "create_aot_dispatcher_function", "compile_fx_inner"
COLUMNS = ["fwd Dynamo", "fwd AOT+Inductor", "bwd capture", "bwd Dynamo", "bwd AOT+Inductor",
           "Inductor", "ready order", "pass"]


def run_job(model: str, mode: str, steps: int, cache_dir: str, set_to_none: bool) -> dict[str, Any]:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    job = Job(model, mode, None, set_to_none=set_to_none, graph_caches=True)
    try:
        job.start()
        per_rank = job.run(step.first_steps, steps)
    finally:
        job.stop()
    rank0 = per_rank[0]
    return {"times_s": [max(r["times_s"][i] for r in per_rank) for i in range(steps)],
            "compile_phases_s": rank0["compile_phases_s"], "steps": rank0["steps"],
            "ready_order_s": rank0["ddp_fusion ready order"], "pass_s": rank0["ddp_fusion pass"]}


def phase(phases: dict[str, float], key: str) -> float:
    return sum(v for k, v in phases.items() if k == key or k.endswith("." + key))


def split(rec: dict[str, Any]) -> list[float]:
    """Rank 0's seconds in each of :data:`COLUMNS`, summed over the timed steps."""
    out = dict.fromkeys(COLUMNS, 0.0)
    for st in rec["steps"]:
        for part in ("fwd", "bwd"):
            phases = st.get(("forward" if part == "fwd" else "backward") + "_phases_s", {})
            dyn, aot = phase(phases, DYNAMO), phase(phases, AOT)
            out[f"{part} Dynamo"] += dyn - aot
            out[f"{part} AOT+Inductor"] += aot
            out["Inductor"] += phase(phases, INDUCTOR)
            if part == "bwd":
                out["bwd capture"] += st.get("backward_s", 0.0) - dyn
    out["ready order"], out["pass"] = rec["ready_order_s"], rec["pass_s"]
    return [out[c] for c in COLUMNS]


def table(results: dict[str, dict[str, dict[str, Any]]], steps: int, zero_grad: str) -> list[str]:
    lines = []
    for model, by_mode in results.items():
        floor = by_mode.get("compute_only", {})
        lines += ["", f"{model}, `.grad` {'set to none' if zero_grad == 'none' else 'kept'}: the first "
                  f"{steps} steps (s), cold and warm Inductor cache, over `compute_only`'s; rank 0's "
                  f"phases (s) in them", "",
                  "| mode | cache | first steps | / compute_only | step 1 | " + " | ".join(COLUMNS) + " |",
                  "|---" * (5 + len(COLUMNS)) + "|"]
        for mode, rec in by_mode.items():
            if "error" in rec:
                lines.append(f"| {mode} | failed: {rec['error']} |")
                continue
            for cache in ("cold", "warm"):
                r, total = rec[cache], sum(rec[cache]["times_s"])
                ref = floor.get(cache)
                ratio = f"{total / sum(ref['times_s']):.2f}x" if ref else "-"
                cells = " | ".join(f"{v:.2f}" for v in split(r))
                lines.append(f"| {mode} | {cache} | {total:.1f} | {ratio} | {r['times_s'][0]:.1f} | "
                             f"{cells} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.first_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="hf_gpt2,mlp",
                   help=f"comma-separated, of: {', '.join(sorted(models.MODELS))} (default hf_gpt2,mlp)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated (default {','.join(MODES)})")
    p.add_argument("--steps", type=int, default=3, help="steps timed one by one (default 3)")
    p.add_argument("--zero-grad", choices=("none", "zeros"), default="none",
                   help="each step's optimizer.zero_grad: set_to_none=True (none, torch's default) "
                        "or False (zeros: .grad kept)")
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
                rec = {"cold": run_job(model, mode, args.steps, cache, args.zero_grad == "none")}
                rec["warm"] = run_job(model, mode, args.steps, cache, args.zero_grad == "none")
            except JobError as e:
                rec = {"error": str(e)}
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            results[model][mode] = rec
            print(f"{model} {mode}: " + (rec.get("error") or
                  f"cold {sum(rec['cold']['times_s']):.1f} s, warm {sum(rec['warm']['times_s']):.1f} s"),
                  flush=True)
    print("\n".join(table(results, args.steps, args.zero_grad)))
    out = {"provenance": provenance(), "zero_grad": args.zero_grad, "results": results}
    print(f"\nwrote {write_json('first_step.json', out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
