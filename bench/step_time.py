"""Per-step training time on 2 gloo ranks (CPU; 4 for DP x TP; 1 NCCL rank on a GPU) for
several data-parallel paths (modes, listed in bench/_lib/modes.py).

Modes (each trains a fresh copy of the same model, same seed, same data, same buckets):
eager torch DDP (``eager_ddp``, ``eager_ddp_grad_view``, with torch's fp16 / bf16 /
PowerSGD hooks), DDPOptimizer (``ddp_optimizer``), upstream compiled DDP (python reducer +
compiled autograd + Inductor's ``_fuse_ddp_communication`` concat / coalesced, or
``bucket_all_reduces_fx``; ``compiled_autograd_nofusion``; on a GPU only,
``upstream_overlap_scheduling``: Inductor's overlap scheduler with collective bucketing,
whose estimates need Triton), ddp_fusion (wrapper
``concat`` / ``coalesced``, ``comm_dtype``, ``max_in_flight_mb``, PowerSGD, stock torch
DDP + flag, uncompiled), and the floors: ``compute_eager``, ``compute_only``
(``torch.compile(model)``), ``compute_compiled_autograd`` (no communication) and
``comm_only`` (the gradient bytes in DDP-bucket-sized all-reduces, back to back). Lower
bound = max(compute_only, comm_only); efficiency = bound / mode's median.

Each (model, mode, cap) job runs on its own rank processes (a ``RankPool``), which stay
alive, compiled, for the whole run: jobs are started and warmed up (compiled) one after
another, then timed round-robin for several rounds (the starting job rotates each round),
so drift on the (shared) machine hits all modes alike, and no compiled code or global
setting leaks from one mode into another. A step is zero_grad, forward, loss, backward,
SGD step; each timed step starts after a ``dist.barrier()`` (and on CUDA a synchronize,
with another after the step), and the time of a step is the max over ranks. One more,
profiled, step counts all-reduces (``gloo:*`` / ``nccl:*`` events), bytes reduced and
copied, and peak memory. After the run each mode's parameters are compared with eager
DDP's (or eager DDP's with the same comm hook).

    python -m bench.step_time                  # both models, default buckets
    python -m bench.step_time --quick          # 2 rounds x 5 timed steps (default 10 x 5)
    python -m bench.step_time --model mlp --modes eager_ddp,ddp_fusion_concat
    python -m bench.step_time --sweep 1,5,25   # eager + ddp_fusion over bucket caps, PNG
    python -m bench.step_time --model mlp_tp   # DP=2 x TP=2 on 4 gloo ranks
    python -m bench.step_time --model hf \
        --modes eager_ddp,ddp_optimizer,upstream_python_reducer_concat,ddp_fusion_stock
    python -m bench.step_time --device cuda    # one GPU: world size 1, NCCL
    python -m bench.step_time --device cuda --model mlp \
        --modes eager_ddp,ddp_optimizer,upstream_overlap_scheduling,ddp_fusion_concat
    python -m bench.step_time --link 1gbit,2gbit,4gbit,8gbit   # a shaped link (below)

On one GPU, world size 1 measures what fusion costs or saves in kernels and copies, not
communication (NCCL cannot put two ranks on one GPU); bench.cost_model projects
communication for more GPUs.

``--link RATE[,RATE...]``: the ranks run in a private network namespace whose loopback
is shaped by ``tc``'s token bucket filter to RATE (e.g. ``4gbit``), so communication waits
on the wire instead of on the 2 cores that run backward (bench/_lib/link.py). The jobs are
compiled once and timed at each rate; the tables give each mode's own compute floor, the
communication floor, step time and hidden communication, and a PNG per rate shows one step
per rank of eager DDP and ddp_fusion on a time line. Default models with ``--link``: mlp,
gpt, hf_gpt2; modes: eager DDP (with and without ``gradient_as_bucket_view``),
DDPOptimizer, upstream compiled DDP, ddp_fusion concat and coalesced, and the floors.
Needs root, ``unshare`` and ``tc`` with ``tbf`` (iproute2); exits naming what was refused
otherwise.

Writes tables to stdout and ``bench/out/step_time.json`` (``step_time_sweep.{json,png}``
for ``--sweep``; ``step_time_link[_<model>].json`` and
``step_time_link_timeline_<model>_<rate>.png`` for ``--link``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import torch

from bench._lib import jobs, link, report
from bench._lib.models import MODELS, model_info, world_size
from bench._lib.modes import all_modes
from bench._lib.record import out_path, provenance, write_json

MODEL_SETS = {"all": ["mlp", "gpt"], "hf": [m for m in MODELS if m.startswith("hf_")]}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m bench.step_time", description=__doc__.split("\n")[0])
    hf = MODEL_SETS["hf"]
    parser.add_argument("--model", default=None,
                        choices=("mlp", "mlp_host", "mlp_params", "gpt", "mlp_tp", "all", "hf", *hf),
                        help="all = mlp and gpt (2 ranks; the default); mlp_tp = DP=2 x TP=2 on 4 gloo "
                             f"ranks; hf = every transformers model ({', '.join(hf)}). With --link: "
                             f"default {','.join(link.MODELS)}")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one GPU, world size 1 with NCCL (measures fusion overhead, "
                             "not communication)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="CPU ranks per job instead of the model's 2 (pure data-parallel "
                             "models). 1: no peer, so no rank skew and no wire: the modes' host "
                             "cost alone")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated subset of: {','.join(all_modes())}")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="as for torch DDP (default: torch's, 1 MiB first bucket then 25)")
    parser.add_argument("--sweep", default=None,
                        help="comma-separated caps, e.g. 1,5,25: run eager_ddp and ddp_fusion "
                             "over them (+ floors) and plot")
    parser.add_argument("--link", default=None, metavar="RATE[,RATE...]",
                        help="run in a network namespace with a tbf-shaped loopback at each rate "
                             "(e.g. 4gbit, or 1gbit,2gbit,4gbit,8gbit); needs root, unshare, tc")
    parser.add_argument("--_inside-link", dest="inside_link", action="store_true", help=argparse.SUPPRESS)
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
    args = parser.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device cuda: no CUDA device (torch {torch.__version__}, "
                         f"built with CUDA {torch.version.cuda})")
        if args.model == "mlp_tp":
            parser.error("--model mlp_tp needs 4 ranks; on one GPU NCCL runs world size 1")
        if args.link:
            parser.error("--link shapes the loopback between gloo ranks on CPU; not with --device cuda")
    if args.world_size is not None:
        if args.device == "cuda" or args.link or args.world_size < 1:
            parser.error("--world-size: a positive number of CPU ranks, without --device cuda or --link")
        named = MODEL_SETS.get(args.model, [args.model]) if args.model else MODEL_SETS["all"]
        tp = [m for m in named if MODELS[m].tp > 1]
        if tp:
            parser.error(f"--world-size: {tp[0]} has its own layout (DP x TP); name a pure "
                         "data-parallel --model")
    if args.link and args.sweep:
        parser.error("--link runs one cap per job; not with --sweep")
    known = all_modes()
    bad = [m for m in (args.modes.split(",") if args.modes else []) if m not in known]
    if bad:
        parser.error(f"unknown modes {bad}; known: {list(known)}")
    gpu_only = [m for m in (args.modes.split(",") if args.modes else []) if known[m].needs_gpu]
    if gpu_only and args.device != "cuda":
        parser.error(f"mode {gpu_only[0]} runs on a GPU only: {known[gpu_only[0]].needs_gpu}")
    if args.link:
        try:
            args.rates = link.parse_rates(args.link)
        except ValueError as e:
            parser.error(f"--link: {e}")
    return parser, args


def main(argv: list[str] | None = None) -> None:
    parser, args = parse_args(argv)
    if args.link and not args.inside_link:
        # the run itself happens inside a private network namespace: this process waits
        sys.exit(link.run_inside(sys.argv[1:] if argv is None else argv, args.rates[0]))
    rounds = args.rounds or (2 if args.quick else 10)
    steps = args.steps or 5
    default_models = link.MODELS if args.link else MODEL_SETS["all"]
    models = MODEL_SETS.get(args.model, [args.model]) if args.model else default_models
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="step_time_inductor_cache_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    device = args.device if args.device == "cpu" else torch.cuda.get_device_name()
    meta = {**provenance(argv), "device": device,
            "world_size": sorted({world_size(m, args.device, args.world_size) for m in models}),
            "backend": "nccl" if args.device == "cuda" else "gloo", "threads_per_rank": 1,
            "rounds": rounds, "timed_steps_per_round": steps, "warmup_steps": args.warmup,
            "layout": "one RankPool per job, kept alive; jobs compiled one after another, then timed "
                      "round-robin (start rotated each round)",
            "zero_grad_set_to_none": args.zero_grad == "none", "bucket_cap_mb": args.bucket_cap_mb,
            "inductor_cache_dir": cache_dir, "models": {m: MODELS[m].desc for m in models},
            "model_info": {m: model_info(m) for m in models}}
    if args.link:
        link.main(args, models, rounds, steps, meta)
        return
    caps: list[Any] = [float(c) for c in args.sweep.split(",")] if args.sweep else [args.bucket_cap_mb]
    default_modes = list(report.SWEEP_MODES) if args.sweep else list(all_modes())
    if args.device != "cuda":
        skipped = [m for m in default_modes if all_modes()[m].needs_gpu]
        default_modes = [m for m in default_modes if m not in skipped]
        if skipped and not args.modes:
            print(f"bench.step_time: skipping {', '.join(skipped)} (GPU only)", flush=True)
    modes = args.modes.split(",") if args.modes else default_modes
    if args.sweep:
        modes += [f for f in ("compute_only", "comm_only") if f not in modes]
    meta["sweep"] = caps if args.sweep else None
    print(f"bench.step_time: torch {meta['torch']}, {meta['machine']}, {meta['device']}, "
          f"{'/'.join(map(str, meta['world_size']))} {meta['backend']} ranks x 1 thread; each job: "
          f"{args.warmup} warm-up steps, then {rounds} rounds x {steps} timed steps (round-robin), "
          f"1 profiled step; Inductor cache {cache_dir}", flush=True)
    t0 = time.perf_counter()
    merged: dict[str, dict[str, Any]] = {}
    for model in models:
        model_jobs = jobs.make_jobs(model, modes, caps, args.device, args.zero_grad == "none",
                                    args.pg_timeout, args.world_size)
        print(f"\n{model}: {MODELS[model].desc} -- compiling {len(model_jobs)} jobs one after another, "
              "then timing them round-robin", flush=True)
        merged.update(jobs.run_jobs(model_jobs, rounds, steps, args.warmup))
    meta["wall_s"] = time.perf_counter() - t0

    result: dict[str, Any] = {"meta": meta, "jobs": merged, "tables": {}}
    for model in models:
        info = meta["model_info"][model]
        for cap in caps:
            text, summary = report.step_table(model, merged, cap)
            cap_s = "torch default (1 MiB first bucket, then 25 MiB)" if cap is None else f"{cap:g} MiB"
            print(f"\n== {model}: {MODELS[model].desc}; {info['num_params']:,} params in "
                  f"{info['num_tensors']} tensors; bucket cap {cap_s} ==\n{text}")
            host_text = report.host_table(model, merged, cap, info["num_tensors"])
            if host_text:
                print(f"-- over each mode's own compute floor (medians) --\n{host_text}")
            cpu_text = report.cpu_table(model, merged, cap)
            if cpu_text:
                print(f"-- host CPU time per step (median; mean of ranks; before the device "
                      f"sync) --\n{cpu_text}")
            bytes_text = report.bytes_table(model, merged, cap, args.device)
            print(f"-- collectives and bytes per step (rank 0, one profiled step) --\n{bytes_text}")
            result["tables"][f"{model}|{cap}"] = {"text": text, "bytes_text": bytes_text,
                                                   "cpu_text": cpu_text, **summary}
    failures = {k: j["failed"] for k, j in merged.items() if j.get("failed")}
    if failures:
        print("\nfailures (full tracebacks in the JSON):")
        for k, f in failures.items():
            print(f"  {k}: {f}")
    print(f"\nwall time {meta['wall_s']:.0f} s")
    name = "step_time_sweep" if args.sweep else "step_time"
    print(f"wrote {write_json(f'{name}.json', result)}")
    if args.sweep:
        png = out_path("step_time_sweep.png")
        report.plot_sweep(merged, models, caps, png, lambda m: (
            f"{m} ({world_size(m, args.device, args.world_size)} ranks, {args.device}, "
            f"torch {torch.__version__})"))
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
