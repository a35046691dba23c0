"""Per-step training time on 2 gloo ranks (CPU) for several data-parallel paths.

Modes (each trains a fresh copy of the same model, same seed, same data, same buckets):

* ``eager_ddp``: ``torch.nn.parallel.DistributedDataParallel``, no compile.
* ``ddp_optimizer``: ``torch.compile`` of torch DDP, ``optimize_ddp=True`` (graph breaks
  at buckets, eager C++ reducer).
* ``upstream_python_reducer_concat`` / ``_coalesced``: torch DDP with
  ``optimize_ddp="python_reducer"``, compiled autograd, and Inductor's
  ``_fuse_ddp_communication`` with ``fuse_ddp_with_{concat,coalesced}_op`` +
  ``schedule_comm_wait``.
* ``upstream_bucket_all_reduces_fx``: python reducer + compiled autograd +
  ``torch._inductor.config.bucket_all_reduces_fx = "all"`` (its default bucket sizes).
* ``compiled_autograd_nofusion``: python reducer + compiled autograd, no fusion.
* ``ddp_fusion_concat`` / ``ddp_fusion_coalesced``: ``torch.compile(
  ddp_fusion.DistributedDataParallel(...))`` with ``ddp_fusion.config.enabled``.
* bounds: ``compute_only`` (``torch.compile(model)``, no communication) and
  ``comm_only`` (one ``all_reduce`` of a flat tensor of all gradient bytes). Lower
  bound = max of the two medians; efficiency = bound / mode's median.

Modes run round-robin for several rounds (every round: ``torch._dynamo.reset()``, fresh
model, warm-up, timed steps), so drift on the (shared) machine hits all modes alike.
A step is zero_grad, forward, loss, backward, SGD step; each timed step starts after a
``dist.barrier()``, and the time of a step is the max over ranks. All-reduces per step
are counted with ``torch.profiler`` (``gloo:*`` events) over one extra step. After the
run each mode's parameters are compared with eager DDP's (same data, same steps).

    python -m bench.step_time                  # both models, default buckets
    python -m bench.step_time --quick          # 2 rounds x 5 steps
    python -m bench.step_time --model mlp --modes eager_ddp,ddp_fusion_concat
    python -m bench.step_time --sweep 1,5,25   # eager + ddp_fusion over bucket caps, PNG

Writes a table per model to stdout and ``bench/out/step_time.json``
(``step_time_sweep.{json,png}`` for ``--sweep``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from typing import Any

import torch

from bench._step_time_worker import MODELS, all_modes, rank_main
from ddp_fusion.launch import run_ranks

OUT_DIR = os.path.join(os.path.dirname(__file__), "out")
BOUNDS = ("compute_only", "comm_only")
SWEEP_MODES = ("eager_ddp", "ddp_fusion_concat", "ddp_fusion_coalesced")


def _machine() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Model name")), "?")
    except OSError:
        name = platform.processor() or "?"
    return f"{name}, {os.cpu_count()} CPUs"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    k = q * (len(xs) - 1)
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _merge(per_rank: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per job: step time = max over ranks per step; failures from any rank."""
    merged: dict[str, dict[str, Any]] = {}
    for key, rec0 in per_rank[0]["records"].items():
        recs = [pr["records"].get(key, {}) for pr in per_rank]
        out: dict[str, Any] = {k: rec0[k] for k in ("model", "mode", "cap")}
        fails = [r.get("failed") for r in recs if r.get("failed")]
        if fails:
            out["failed"] = fails[0]
            out["traceback"] = next(r["traceback"] for r in recs if r.get("traceback"))
        rounds = min(len(r.get("times_ms", [])) for r in recs)
        steps: list[float] = []
        for i in range(rounds):
            steps += [max(ts) for ts in zip(*(r["times_ms"][i] for r in recs))]
        out["rounds_done"] = rounds
        out["step_ms_all"] = steps
        if steps:
            out["median_ms"] = statistics.median(steps)
            out["p10_ms"] = _pct(steps, 0.1)
            out["p90_ms"] = _pct(steps, 0.9)
            out["min_ms"] = min(steps)
            out["max_ms"] = max(steps)
            out["round_medians_ms"] = [
                statistics.median(max(ts) for ts in zip(*(r["times_ms"][i] for r in recs)))
                for i in range(rounds)
            ]
            warm = [max(ws) for ws in zip(*(r["warmup_s"] for r in recs))]
            out["compile_s"] = warm[0]
            out["rewarm_s"] = statistics.median(warm[1:]) if len(warm) > 1 else None
            out["collectives"] = rec0.get("collectives", {})
            out["recompiles_during_timing"] = [
                {k: max(r["recompiles_during_timing"][i][k] for r in recs) for k in
                 recs[0]["recompiles_during_timing"][i]}
                for i in range(rounds)
            ]
            diffs = [r["max_param_diff"] for r in recs if "max_param_diff" in r]
            if diffs:
                out["max_param_diff"] = max(diffs)
            if "grad_bytes" in rec0:
                out["grad_bytes"] = rec0["grad_bytes"]
        merged[key] = out
    return merged


def _fmt_collectives(c: dict[str, int]) -> str:
    if not c:
        return "0"
    main = c.get("gloo:all_reduce", 0)
    rest = {k.removeprefix("gloo:"): v for k, v in c.items() if k != "gloo:all_reduce"}
    s = str(main)
    if rest:
        s += " + " + ", ".join(f"{v} {k}" for k, v in sorted(rest.items()))
    return s


def _table(model: str, jobs: dict[str, dict[str, Any]], cap: Any) -> tuple[str, dict[str, Any]]:
    """Table for one model at one cap (bounds are cap-independent)."""
    rows = [j for j in jobs.values() if j["model"] == model and (j["cap"] == cap or j["mode"] in BOUNDS)]
    bound_parts = {j["mode"]: j.get("median_ms") for j in rows if j["mode"] in BOUNDS}
    bound = None
    if all(bound_parts.get(b) is not None for b in BOUNDS):
        bound = max(bound_parts[b] for b in BOUNDS)
    eager = next((j.get("median_ms") for j in rows if j["mode"] == "eager_ddp"), None)
    head = (f"{'mode':<34}{'median ms':>10}{'p10-p90 ms':>16}{'min-max ms':>16}{'eff.':>6}"
            f"{'x eager':>8}{'all-reduces/step':>22}{'compile s':>10}{'rewarm s':>9}"
            f"{'max |dp| vs eager':>19}")
    lines = [head, "-" * len(head)]
    summary: dict[str, Any] = {"bound_ms": bound, "bounds": bound_parts, "rows": {}}
    for j in rows:
        name = j["mode"]
        if "median_ms" not in j:
            lines.append(f"{name:<34}failed: {j.get('failed', 'no result')}")
            summary["rows"][name] = {"failed": j.get("failed", "no result")}
            continue
        eff = bound / j["median_ms"] if bound else None
        rel = j["median_ms"] / eager if eager else None
        diff = j.get("max_param_diff")
        rew = j.get("rewarm_s")
        recomp = any(v for rc in j["recompiles_during_timing"] for v in rc.values())
        lines.append(
            f"{name:<34}{j['median_ms']:>10.2f}{j['p10_ms']:>8.2f}-{j['p90_ms']:<7.2f}"
            f"{j['min_ms']:>8.2f}-{j['max_ms']:<7.2f}"
            f"{(f'{eff:.2f}' if eff else '-'):>6}{(f'{rel:.2f}' if rel else '-'):>8}"
            f"{_fmt_collectives(j['collectives']):>22}{j['compile_s']:>10.1f}"
            f"{(f'{rew:.1f}' if rew is not None else '-'):>9}"
            f"{(f'{diff:.2e}' if diff is not None else 'n/a'):>19}"
            + ("  (recompiled while timed!)" if recomp else "")
            + (f"  (failed in a later round: {j['failed']})" if j.get("failed") else "")
        )
        summary["rows"][name] = {"median_ms": j["median_ms"], "efficiency": eff, "x_eager": rel}
    if bound:
        lines.append(f"lower bound = max(compute_only, comm_only) = {bound:.2f} ms")
    return "\n".join(lines), summary


def _plot_sweep(jobs: dict[str, dict[str, Any]], models: list[str], caps: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for mode in SWEEP_MODES:
            xs, ys, lo, hi = [], [], [], []
            for cap in caps:
                j = jobs.get(f"{model}|{mode}|{cap}")
                if j and "median_ms" in j:
                    xs.append(cap)
                    ys.append(j["median_ms"])
                    lo.append(j["median_ms"] - j["p10_ms"])
                    hi.append(j["p90_ms"] - j["median_ms"])
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=mode)
        for b, style in zip(BOUNDS, (":", "--")):
            j = jobs.get(f"{model}|{b}|None")
            if j and "median_ms" in j:
                ax.axhline(j["median_ms"], linestyle=style, color="gray", label=b)
        ax.set_xscale("log")
        ax.set_xticks(caps)
        ax.set_xticklabels([f"{c:g}" for c in caps])
        ax.set_xlabel("bucket_cap_mb")
        ax.set_ylabel("step time, median ms (bars: p10-p90)")
        ax.set_title(f"{model} (2 gloo ranks, CPU, torch {torch.__version__})")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.step_time",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("mlp", "gpt", "all"), default="all")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated subset of: {','.join(all_modes())}")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="as for torch DDP (default: torch's, 1 MiB first bucket then 25)")
    parser.add_argument("--sweep", default=None,
                        help="comma-separated caps, e.g. 1,5,25: run eager_ddp and ddp_fusion "
                             "over them (+ bounds) and plot")
    parser.add_argument("--rounds", type=int, default=None, help="default 4 (quick: 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round, default 8 (quick: 5)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cache-dir", default=None,
                        help="TORCHINDUCTOR_CACHE_DIR for the ranks (default: a fresh temp dir, "
                             "so round 1 compiles cold)")
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args()

    rounds = args.rounds or (2 if args.quick else 4)
    steps = args.steps or (5 if args.quick else 8)
    models = ["mlp", "gpt"] if args.model == "all" else [args.model]
    known = list(all_modes())
    if args.sweep:
        caps: list[Any] = [float(c) for c in args.sweep.split(",")]
        modes = args.modes.split(",") if args.modes else list(SWEEP_MODES)
    else:
        caps = [args.bucket_cap_mb]
        modes = args.modes.split(",") if args.modes else known
    bad = [m for m in modes if m not in known]
    if bad:
        parser.error(f"unknown modes {bad}; known: {known}")
    jobs = []
    for model in models:
        for cap in caps:
            jobs += [(model, m, cap) for m in modes if m not in BOUNDS]
        jobs += [(model, m, None) for m in BOUNDS if args.sweep or m in modes]

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="step_time_inductor_cache_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    meta = {
        "torch": torch.__version__,
        "machine": _machine(),
        "world_size": 2,
        "backend": "gloo",
        "threads_per_rank": 1,
        "rounds": rounds,
        "timed_steps_per_round": steps,
        "warmup_steps": args.warmup,
        "bucket_cap_mb": args.bucket_cap_mb,
        "sweep": caps if args.sweep else None,
        "inductor_cache_dir": cache_dir,
        "models": {m: MODELS[m]["desc"] for m in models},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(f"bench.step_time: torch {meta['torch']}, {meta['machine']}, 2 gloo ranks x 1 thread; "
          f"{len(jobs)} jobs x {rounds} rounds x ({args.warmup} warm-up + {steps} timed + 1 profiled) "
          f"steps; Inductor cache {cache_dir}", flush=True)
    for m in models:
        print(f"  {m}: {MODELS[m]['desc']}", flush=True)
    plan = {"jobs": jobs, "rounds": rounds, "steps": steps, "warmup": args.warmup}
    t0 = time.perf_counter()
    per_rank = run_ranks(rank_main, world_size=2, args=(plan,), timeout=args.timeout,
                         threads_per_rank=1, pg_timeout=600)
    meta["wall_s"] = time.perf_counter() - t0
    meta["num_params"] = per_rank[0]["num_params"]
    meta["num_param_tensors"] = per_rank[0]["num_tensors"]
    merged = _merge(per_rank)

    result: dict[str, Any] = {"meta": meta, "jobs": merged, "tables": {}}
    for model in models:
        for cap in caps:
            text, summary = _table(model, merged, cap)
            cap_s = "torch default (1 MiB first bucket, then 25 MiB)" if cap is None else f"{cap:g} MiB"
            print(f"\n== {model}: {MODELS[model]['desc']}; {meta['num_params'][model]:,} params in "
                  f"{meta['num_param_tensors'][model]} tensors; bucket cap {cap_s} ==")
            print(text)
            result["tables"][f"{model}|{cap}"] = {"text": text, **summary}
    failures = {k: j["failed"] for k, j in merged.items() if j.get("failed")}
    if failures:
        print("\nfailures (full tracebacks in the JSON):")
        for k, f in failures.items():
            print(f"  {k}: {f}")
    print(f"\nwall time {meta['wall_s']:.0f} s")

    os.makedirs(OUT_DIR, exist_ok=True)
    name = "step_time_sweep" if args.sweep else "step_time"
    with open(os.path.join(OUT_DIR, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {os.path.join(OUT_DIR, name + '.json')}")
    if args.sweep:
        png = os.path.join(OUT_DIR, "step_time_sweep.png")
        _plot_sweep(merged, models, caps, png)
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
