"""Per-step training time on 2 gloo ranks (CPU; 4 for DP x TP; 1 NCCL rank on a GPU) for
several data-parallel paths.

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
* ``ddp_fusion_concat_peak_memory_reorder``: the same with Inductor's peak-memory
  reordering left on for the backward graph (ddp_fusion's behaviour before 2026-11-23),
  which moves each bucket's wait up to its collective.
* bounds: ``compute_only`` (``torch.compile(model)``, no communication) and
  ``comm_only`` (one ``all_reduce`` of a flat tensor of all gradient bytes). Lower
  bound = max of the two medians; efficiency = bound / mode's median.

Each (model, mode, cap) job runs on its own rank processes, which stay alive (compiled)
for the whole run: jobs are started and warmed up (compiled) one after another, then
timed round-robin for several rounds (the starting job rotates each round), so drift on
the (shared) machine hits all modes alike, and no compiled code or global setting leaks
from one mode into another. A step is zero_grad, forward, loss, backward, SGD step; each
timed step starts after a ``dist.barrier()`` (and on CUDA a synchronize, with another
after the step), and the time of a step is the max over ranks. All-reduces per step
are counted with ``torch.profiler`` (``gloo:*`` / ``nccl:*`` events) over one extra step,
which also measures bytes reduced, bytes copied and peak memory. After the
run each mode's parameters are compared with eager DDP's (same data, same steps).

    python -m bench.step_time                  # both models, default buckets
    python -m bench.step_time --quick          # 2 rounds x 5 timed steps (default 10 x 5)
    python -m bench.step_time --model mlp --modes eager_ddp,ddp_fusion_concat
    python -m bench.step_time --sweep 1,5,25   # eager + ddp_fusion over bucket caps, PNG
    python -m bench.step_time --model mlp_tp   # DP=2 x TP=2 on 4 gloo ranks
    python -m bench.step_time --model hf --modes eager_ddp,ddp_optimizer,upstream_python_reducer_concat,ddp_fusion_stock
                                               # transformers models (GPT-2, BERT, Llama, ViT, ResNet)
    python -m bench.step_time --device cuda    # one GPU: world size 1, NCCL

On one GPU, world size 1 measures what fusion costs or saves in kernels and copies, not
communication (NCCL cannot put two ranks on one GPU); bench/cost_model.py projects
communication for more GPUs.

Writes a table per model to stdout and ``bench/out/step_time.json``
(``step_time_sweep.{json,png}`` for ``--sweep``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import statistics
import subprocess
import tempfile
import threading
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from bench._step_time_worker import MODELS, all_modes, model_info, mode_worker
from ddp_fusion.launch import run_ranks

OUT_DIR = os.path.join(os.path.dirname(__file__), "out")
BOUNDS = ("compute_only", "comm_only")
SWEEP_MODES = ("eager_ddp", "ddp_fusion_concat", "ddp_fusion_coalesced")


def machine() -> str:
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


class JobFailed(Exception):
    pass


class Job:
    """One (model, mode, cap) on its own rank processes, driven by commands."""

    def __init__(self, model: str, mode: str, cap: Any, pg_timeout: float, device: str,
                 set_to_none: bool = True) -> None:
        self.model, self.mode, self.cap, self.device = model, mode, cap, device
        self.set_to_none = set_to_none
        self.key = f"{model}|{mode}|{cap}"
        self.world_size = world_size(model, device)
        ctx = mp.get_context("spawn")
        self.cmd = [ctx.Queue() for _ in range(self.world_size)]
        self.res = ctx.Queue()
        self.error: str | None = None
        self.failed: str | None = None
        self.traceback: str | None = None
        self.rec: dict[str, Any] = {"model": model, "mode": mode, "cap": cap, "times_ms": [],
                                    "round_medians_ms": [], "recompiles_during_timing": []}
        self.thread = threading.Thread(target=self._run, args=(pg_timeout,), daemon=True)

    def _run(self, pg_timeout: float) -> None:
        try:
            run_ranks(mode_worker, world_size=self.world_size,
                      args=(self.model, self.mode, self.cap, self.cmd, self.res, self.device,
                            self.set_to_none),
                      timeout=10**6, threads_per_rank=1, pg_timeout=pg_timeout,
                      backend="nccl" if self.device == "cuda" else "gloo")
        except Exception as e:  # noqa: BLE001 - surfaced by _replies
            self.error = str(e)

    def start(self, timeout: float) -> None:
        self.thread.start()
        self._replies(timeout)

    def ask(self, cmd: str, arg: Any = None, timeout: float = 1800.0) -> list[Any]:
        for q in self.cmd:
            q.put((cmd, arg))
        return self._replies(timeout)

    def _replies(self, timeout: float) -> list[Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size:
            try:
                rank, status, value = self.res.get(timeout=1.0)
            except queue.Empty:
                if not self.thread.is_alive():
                    raise JobFailed(self._fail("ranks exited", self.error or "no error text"))
                if time.monotonic() > deadline:
                    raise JobFailed(self._fail(f"no reply within {timeout:.0f} s", ""))
                continue
            if status == "error":
                raise JobFailed(self._fail(value[0], value[1]))
            got[rank] = value
        return [got[r] for r in range(self.world_size)]

    def _fail(self, short: str, tb: str) -> str:
        self.failed, self.traceback = short, tb
        return short

    def stop(self) -> None:
        if self.failed is None:
            with contextlib.suppress(JobFailed):
                self.ask("stop", timeout=120)
        self.thread.join(timeout=30)


def world_size(model: str, device: str) -> int:
    """Ranks per job: the model's (2, or 4 for DP x TP) on CPU; 1 on the one GPU."""
    return 1 if device == "cuda" else MODELS[model]["world_size"]


def _stats(steps: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(steps), "p10_ms": _pct(steps, 0.1),
            "p90_ms": _pct(steps, 0.9), "min_ms": min(steps), "max_ms": max(steps)}


def _run_model_jobs(specs: list[tuple[str, str, Any]], rounds: int, steps: int, warmup: int,
                    pg_timeout: float, device: str, set_to_none: bool = True) -> dict[str, dict[str, Any]]:
    """Compile every job once (one after the other), then time them round-robin."""
    jobs = [Job(m, mode, cap, pg_timeout, device, set_to_none) for m, mode, cap in specs]
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"  [{time.perf_counter() - t_start:6.0f} s] {msg}", flush=True)

    def guard(job: Job, what: str, fn):
        try:
            return fn()
        except JobFailed as e:
            log(f"{job.key}: FAILED during {what}: {e}")
            job.stop()
            return None

    try:
        for job in jobs:
            t0 = time.perf_counter()
            if guard(job, "start", lambda: job.start(timeout=1800)) is None and job.failed:
                continue
            job.rec["startup_s"] = time.perf_counter() - t0
            w = guard(job, "warm-up", lambda: job.ask("warmup", warmup))
            if w is None:
                continue
            job.rec["compile_s"] = max(w)
            log(f"{job.key:52s} started in {job.rec['startup_s']:5.1f} s, "
                f"warm-up ({warmup} steps, compiles) {job.rec['compile_s']:6.1f} s")
        for r in range(rounds):
            order = jobs[r % len(jobs):] + jobs[: r % len(jobs)]  # rotate start each round
            line = []
            for job in order:
                if job.failed:
                    continue
                res = guard(job, f"round {r + 1}", lambda: job.ask("time", steps))
                if res is None:
                    continue
                per_step = [max(ts) for ts in zip(*(r["times_ms"] for r in res))]
                job.rec["times_ms"] += per_step
                job.rec["round_medians_ms"].append(statistics.median(per_step))
                job.rec["recompiles_during_timing"].append(
                    {k: max(r["recompiles"][k] for r in res) for k in res[0]["recompiles"]})
                label = job.mode if job.cap is None else f"{job.mode}@{job.cap:g}"
                line.append(f"{label}={statistics.median(per_step):.1f}")
            log(f"round {r + 1}/{rounds} medians ms: " + ", ".join(line))
        reference = {}
        for job in jobs:
            if job.failed:
                continue
            c = guard(job, "profile", lambda: job.ask("profile"))
            if c is not None:
                job.rec["collectives"] = c[0]["collectives"]
                job.rec["counters"] = [r["counters"] for r in c]
                # per rank; rank 0's row is shown (ranks run the same program)
                job.rec["profile"] = [{k: v for k, v in r.items() if k != "counters"} for r in c]
            p = guard(job, "params", lambda: job.ask("params"))
            if p is not None and p[0] is not None:
                job.rec["_params"] = p
                reference[(job.model, job.cap, job.mode)] = p
        modes = all_modes()
        for job in jobs:
            p = job.rec.pop("_params", None)
            # eager DDP; for a mode with a comm hook, eager DDP with the same hook
            ref = reference.get((job.model, job.cap, modes[job.mode].reference))
            if p is not None and ref is not None and job.mode not in BOUNDS:
                # each rank against eager DDP's same rank (TP ranks hold different
                # shards), and each rank against its DP peer on DP rank 0
                tp = MODELS[job.model]["tp"]
                job.rec["max_param_diff"] = float(max(abs(x - r).max() for x, r in zip(p, ref)))
                job.rec["max_param_diff_between_ranks"] = float(
                    max(abs(x - p[i % tp]).max() for i, x in enumerate(p)))
    finally:
        for job in jobs:
            job.stop()
    out = {}
    for job in jobs:
        rec = job.rec
        if job.failed:
            rec["failed"], rec["traceback"] = job.failed, job.traceback
        if rec["times_ms"]:
            rec.update(_stats(rec["times_ms"]))
        out[job.key] = rec
    return out


def _fmt_collectives(c: dict[str, int]) -> str:
    if not c:
        return "0"
    main = sum(v for k, v in c.items() if k.endswith(":all_reduce"))
    rest = {k.split(":", 1)[1]: v for k, v in c.items() if not k.endswith(":all_reduce")}
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
            f"{'x eager':>8}{'all-reduces/step':>22}{'compile s':>10}"
            f"{'max |dp| vs ref':>19}")
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
        recomp = any(v for rc in j["recompiles_during_timing"] for v in rc.values())
        unfused = sum(v for c in j.get("counters", []) for k, v in c["ddp_fusion"].items()
                      if k.startswith("unfused"))
        lines.append(
            f"{name:<34}{j['median_ms']:>10.2f}{j['p10_ms']:>8.2f}-{j['p90_ms']:<7.2f}"
            f"{j['min_ms']:>8.2f}-{j['max_ms']:<7.2f}"
            f"{(f'{eff:.2f}' if eff else '-'):>6}{(f'{rel:.2f}' if rel else '-'):>8}"
            f"{_fmt_collectives(j.get('collectives', {})):>22}{j.get('compile_s', float('nan')):>10.1f}"
            f"{(f'{diff:.2e}' if diff is not None else 'n/a'):>19}"
            + ("  (recompiled while timed!)" if recomp else "")
            + (f"  ({unfused} ddp_fusion unfused events!)" if unfused else "")
            + (f"  (failed later: {j['failed']})" if j.get("failed") else "")
        )
        summary["rows"][name] = {"median_ms": j["median_ms"], "efficiency": eff, "x_eager": rel}
    if bound:
        lines.append(f"lower bound = max(compute_only, comm_only) = {bound:.2f} ms")
    return "\n".join(lines), summary


def _bytes_table(model: str, jobs: dict[str, dict[str, Any]], cap: Any, device: str) -> str:
    """Collectives, bytes and memory per step (rank 0; one profiled step; MB = 1e6 bytes).

    * on wire: bytes handed to the backend's all-reduces (profiler events; with a comm
      hook, its ``dist.all_reduce`` calls from any thread: PowerSGD issues some from
      gloo's threads, which the profiler does not always see);
    * copy in / copy back: in the lowered backward graph (compiled modes), bytes written
      by ``cat`` nodes feeding a collective (the copy into a fused bucket; an upper
      bound, Inductor can compute a cat input straight into the bucket), and by ``copy_``
      nodes whose source is a collective's result (a reduced gradient copied into
      ``.grad``);
    * eager copies: bytes of ``aten::copy_`` / ``aten::cat`` calls not inside another
      aten op (torch DDP's reducer filling and emptying buckets, gloo flattening a
      coalesced all-reduce); copies inside Inductor kernels are invisible to it;
    * held: bytes kept between steps, after zero_grad (parameters, gradients, optimizer
      state, buffers, reducer buckets; each storage once);
    * peak: held + the most allocated during the rest of the step and not yet freed.
    """
    head = (f"{'mode':<34}{'all-reduces':>12}{'MB on wire':>12}{'MB copy in':>11}{'MB copy back':>13}"
            f"{'MB eager copies':>17}{'held MB':>9}{'peak MB':>9}" + (f"{'kernels':>9}" if device == "cuda" else ""))
    lines = [head, "-" * len(head)]
    for j in jobs.values():
        if j["model"] != model or (j["cap"] != cap and j["mode"] not in BOUNDS) or "profile" not in j:
            continue
        prof = j["profile"][0]
        graph = prof.get("graph")
        n, wire = sum(prof["collectives"].values()), prof["bytes_reduced"]
        if prof.get("python_all_reduces"):  # a comm hook's: all of them, from any thread
            n = prof["python_all_reduces"] + sum(v for k, v in prof["collectives"].items()
                                                 if not k.endswith("all_reduce"))
            wire = prof["python_bytes"]
        copy_in = f"{graph['fusion_copy_bytes'] / 1e6:.2f}" if graph else "-"
        copy_back = f"{graph['copy_back_bytes'] / 1e6:.2f}" if graph else "-"
        lines.append(
            f"{j['mode']:<34}{n:>12}{wire / 1e6:>12.2f}{copy_in:>11}{copy_back:>13}"
            f"{prof['copy_bytes'] / 1e6:>17.2f}{prof['held_bytes'] / 1e6:>9.1f}{prof['peak_bytes'] / 1e6:>9.1f}"
            + (f"{prof.get('kernels', 0):>9}" if device == "cuda" else ""))
    return "\n".join(lines)


def _plot_sweep(jobs: dict[str, dict[str, Any]], models: list[str], caps: list[float], path: str,
                device: str) -> None:
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
        ax.set_title(f"{model} ({world_size(model, device)} ranks, {device}, torch {torch.__version__})")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.step_time",
                                     description=__doc__.split("\n")[0])
    hf = [m for m in MODELS if m.startswith("hf_")]
    parser.add_argument("--model", choices=("mlp", "gpt", "mlp_tp", "all", "hf", *hf), default="all",
                        help="all = mlp and gpt (2 ranks); mlp_tp = DP=2 x TP=2 on 4 gloo ranks; "
                             f"hf = every transformers model ({', '.join(hf)}; bench/_hf_models.py)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one GPU, world size 1 with NCCL (measures fusion overhead, "
                             "not communication)")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated subset of: {','.join(all_modes())}")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="as for torch DDP (default: torch's, 1 MiB first bucket then 25)")
    parser.add_argument("--sweep", default=None,
                        help="comma-separated caps, e.g. 1,5,25: run eager_ddp and ddp_fusion "
                             "over them (+ bounds) and plot")
    parser.add_argument("--rounds", type=int, default=None, help="default 10 (quick: 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round, default 5")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 5 steps")
    parser.add_argument("--cache-dir", default=None,
                        help="TORCHINDUCTOR_CACHE_DIR for the ranks (default: a fresh temp dir, "
                             "so every job compiles cold)")
    parser.add_argument("--pg-timeout", type=float, default=900.0)
    parser.add_argument("--zero-grad", choices=("none", "zeros"), default="none",
                        help="each step's optimizer.zero_grad: set_to_none=True (none, torch's "
                             "default) or False (zeros: .grad kept, gradients accumulated into it)")
    args = parser.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device cuda: no CUDA device (torch {torch.__version__}, "
                         f"built with CUDA {torch.version.cuda})")
        if args.model == "mlp_tp":
            parser.error("--model mlp_tp needs 4 ranks; on one GPU NCCL runs world size 1")

    rounds = args.rounds or (2 if args.quick else 10)
    steps = args.steps or 5
    models = {"all": ["mlp", "gpt"], "hf": hf}.get(args.model, [args.model])
    sizes = {world_size(m, args.device) for m in models}
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
    specs: dict[str, list[tuple[str, str, Any]]] = {}
    for model in models:
        specs[model] = [(model, m, cap) for cap in caps for m in modes if m not in BOUNDS]
        specs[model] += [(model, m, None) for m in BOUNDS if args.sweep or m in modes]
    njobs = sum(len(v) for v in specs.values())

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="step_time_inductor_cache_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    meta = {
        "torch": torch.__version__,
        "machine": machine(),
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "world_size": sorted(sizes),
        "backend": "nccl" if args.device == "cuda" else "gloo",
        "threads_per_rank": 1,
        "rounds": rounds,
        "timed_steps_per_round": steps,
        "layout": "one process pair per job, kept alive; jobs compiled one after another, "
                  "then timed round-robin (start rotated each round)",
        "warmup_steps": args.warmup,
        "zero_grad_set_to_none": args.zero_grad == "none",
        "bucket_cap_mb": args.bucket_cap_mb,
        "sweep": caps if args.sweep else None,
        "inductor_cache_dir": cache_dir,
        "models": {m: MODELS[m]["desc"] for m in models},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(f"bench.step_time: torch {meta['torch']}, {meta['machine']}, {meta['device']}, "
          f"{'/'.join(map(str, sorted(sizes)))} {meta['backend']} ranks x 1 thread; "
          f"{njobs} jobs, each: {args.warmup} warm-up steps, then {rounds} rounds x {steps} timed "
          f"steps (round-robin over jobs), 1 profiled step; Inductor cache {cache_dir}", flush=True)
    t0 = time.perf_counter()
    merged: dict[str, dict[str, Any]] = {}
    meta["model_info"] = {}
    for model in models:
        meta["model_info"][model] = model_info(model)
        print(f"\n{model}: {MODELS[model]['desc']} -- compiling {len(specs[model])} jobs one after "
              f"another, then timing them round-robin", flush=True)
        merged.update(_run_model_jobs(specs[model], rounds, steps, args.warmup, args.pg_timeout,
                                      args.device, args.zero_grad == "none"))
    meta["wall_s"] = time.perf_counter() - t0

    result: dict[str, Any] = {"meta": meta, "jobs": merged, "tables": {}}
    for model in models:
        for cap in caps:
            text, summary = _table(model, merged, cap)
            cap_s = "torch default (1 MiB first bucket, then 25 MiB)" if cap is None else f"{cap:g} MiB"
            print(f"\n== {model}: {MODELS[model]['desc']}; {meta['model_info'][model]['num_params']:,} params in "
                  f"{meta['model_info'][model]['num_tensors']} tensors; bucket cap {cap_s} ==")
            print(text)
            bytes_text = _bytes_table(model, merged, cap, args.device)
            print(f"-- collectives and bytes per step (rank 0, one profiled step) --\n{bytes_text}")
            result["tables"][f"{model}|{cap}"] = {"text": text, "bytes_text": bytes_text, **summary}
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
        _plot_sweep(merged, models, caps, png, args.device)
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
