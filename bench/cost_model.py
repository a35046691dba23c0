"""alpha-beta cost model of DDP gradient communication: calibrated on gloo, checked against
measured step times, projected to 8-1,024 H100 GPUs with NVLink + InfiniBand NCCL parameters.

Three parts, all in one run:

1. **Calibration.** 2 gloo ranks (1 thread each) time ``dist.all_reduce`` of fp32 tensors
   from 4 KiB to 32 MiB (barrier before each call, max over ranks) and fit
   ``t(n) = alpha + beta * n`` by least squares on relative error (every size counts
   alike; plain least squares would let the 32 MiB point decide alpha), once to the
   median time per size (the plain model) and once to the mean (the one correction: on
   this VM a collective is either fast or delayed by up to a 4 ms scheduler tick, so a
   step with many blocking collectives pays the mean, several times the median).
2. **Reproduction.** For each (model, mode) -- models ``mlp`` and ``gpt`` of
   bench/_lib/models.py, modes ``eager_ddp``, ``ddp_fusion_concat``,
   ``compiled_autograd_nofusion``, ``upstream_python_reducer_concat`` and the
   ``compute_only`` control, torch's default buckets -- a fresh pair of gloo ranks runs
   bench.step_time's training step and worker (bench/_lib/step.py): warms up (compiles),
   times >= 10 unprofiled steps (``dist.barrier()`` before each, step time = max over
   ranks, as bench.step_time), then profiles a few steps with ``torch.profiler``.
   From each profiled step and rank it reads, on the main thread, every collective issue
   (``c10d::allreduce_`` / ``_c10d_functional::all_reduce_`` ...: the bucket ready time),
   every blocking wait (``_c10d_functional::wait_tensor``; for eager DDP the idle gap in
   which a ``gloo:all_reduce`` completes), and the bytes of each ``gloo:all_reduce``.
   The step minus its blocked time is the mode's own *compute* timeline (its real code:
   eager ops for eager DDP, Inductor code for compiled modes). The model replays that
   timeline with modelled communication: collectives run one at a time in issue order,
   ``start_k = max(issue_k on every rank, end_{k-1})``, ``end_k = start_k + alpha +
   beta * bytes_k``; a wait holds its rank until its collective ends (the k-th wait belongs
   to the k-th collective; eager DDP's end-of-backward finalize waits for all). The
   predicted step is the later rank's end; with all waits at the end of backward this is
   ``backward compute end + max(0, last comm end - backward compute end) + optimizer +
   the rest``. Predicted (with each fit) vs measured (median of the unprofiled steps,
   timed in blocks between the profiled ones), error in % (bench/_lib/replay.py).
3. **Projection.** GPT-2-small-sized job (124.4 M parameters, fp32 gradients, 25 MiB
   buckets) on 8 / 16 / 64 / 256 / 1,024 H100 SXM GPUs, 8 per node: NCCL-style ring
   and tree all-reduce times from the published link bandwidths and NCCL's own latency
   constants (table printed, with sources), GPU compute from 6 * N * tokens FLOPs at a
   stated MFU (an assumption: there is no GPU here). Per GPU count: step time, exposed
   communication and overlap for one all-reduce per gradient (unfused compiled autograd),
   DDP buckets (eager DDP and ddp_fusion issue the same buckets) and one bucket at the end
   (bench/_lib/projection.py).

    python -m bench.cost_model                   # everything (about 5-10 min on 2 cores)
    python -m bench.cost_model --quick           # fewer steps, no upstream mode
    python -m bench.cost_model --model mlp --modes eager_ddp,ddp_fusion_concat
    python -m bench.cost_model --projection-only # part 3 only (instant; uses the JSON's
                                                 # calibration if present)

Writes tables to stdout and ``bench/out/cost_model.json``. Compiled kernels are cached in
``bench/out/inductor_cache`` (``--cache-dir``), so a second run compiles much faster.
"""


from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from bench._lib import comm, projection, replay, step
from bench._lib.jobs import Job, JobError
from bench._lib.modes import all_modes
from bench._lib.projection import GPU_COUNTS, PARAMS
from bench._lib.record import OUT_DIR, provenance
from ddp_fusion.launch import run_ranks

MODES = ("eager_ddp", "ddp_fusion_concat", "compiled_autograd_nofusion",
         "upstream_python_reducer_concat", "compute_only")
QUICK_MODES = ("eager_ddp", "ddp_fusion_concat", "compiled_autograd_nofusion", "compute_only")
CALIB_BYTES = [4096 * 2**i for i in range(14)]  # 4 KiB .. 32 MiB


def _log(t0: float, msg: str) -> None:
    print(f"  [{time.perf_counter() - t0:6.0f} s] {msg}", flush=True)


# =========================================================================== 1. calibration


def calibrate(quick: bool, t0: float) -> dict[str, Any]:
    """Per size, the median (typical) and mean (expected) time of one all-reduce, max over
    ranks; two fits: ``median`` (the plain model) and ``mean`` (the correction, see
    ``FITS``)."""
    reps = [(30 if quick else 60) if b <= 1 << 20 else (8 if quick else 20) for b in CALIB_BYTES]
    _log(t0, f"calibration: 2 gloo ranks x 1 thread, dist.all_reduce of fp32 tensors "
             f"{CALIB_BYTES[0] // 1024} KiB .. {CALIB_BYTES[-1] >> 20} MiB, {reps[0]}/{reps[-1]} reps")
    res = run_ranks(comm.calibration, world_size=2, args=(CALIB_BYTES, reps), timeout=900,
                    threads_per_rank=1)
    samples = [[max(pair) for pair in zip(r0, r1)] for r0, r1 in zip(*res)]
    stats = {"median": [statistics.median(x) for x in samples],
             "mean": [statistics.fmean(x) for x in samples]}
    out: dict[str, Any] = {"reps": reps, "fits": {}, "rows": []}
    for name, ts in stats.items():
        alpha, beta = comm.fit_alpha_beta(CALIB_BYTES, ts)
        out["fits"][name] = {"alpha_ms": alpha, "beta_ms_per_byte": beta, "bandwidth_GBps": 1e-6 / beta}
    for i, b in enumerate(CALIB_BYTES):
        x = sorted(samples[i])
        row = {"bytes": b, "p10_ms": x[len(x) // 10], "p90_ms": x[(9 * len(x)) // 10],
               "max_ms": x[-1], "samples_ms": samples[i]}
        for name, ts in stats.items():
            f = out["fits"][name]
            fit = f["alpha_ms"] + f["beta_ms_per_byte"] * b
            row[f"{name}_ms"] = ts[i]
            row[f"{name}_fit_ms"] = fit
            row[f"{name}_residual_pct"] = 100 * (fit - ts[i]) / ts[i]
        out["rows"].append(row)
    return out


# The plain model uses the median (typical) collective time. The one correction: use the
# mean (expected) time instead, fitted the same way to the same calibration samples. On
# this VM a collective is either fast or delayed by up to a 4 ms scheduler tick
# (CONFIG_HZ=250), so the mean of a small all-reduce is several times its median, and a
# step with many blocking collectives pays the mean.
FITS = {"median": "plain: median (typical) all-reduce time",
        "mean": "corrected: mean (expected) all-reduce time"}


def print_calibration(cal: dict[str, Any]) -> None:
    print("\n== gloo calibration: t(n) = alpha + beta*n, max over 2 ranks per call, least squares "
          "on relative error ==")
    for name, f in cal["fits"].items():
        print(f"  {name:<7} fit: alpha = {1e3 * f['alpha_ms']:7.1f} us, beta = "
              f"{1e6 * f['beta_ms_per_byte']:.3f} ms/MB (1/beta = {f['bandwidth_GBps']:.2f} GB/s)"
              f"   [{FITS[name]}]")
    print(f"{'bytes':>12}{'reps':>6}{'median ms':>11}{'fit':>8}{'resid.':>8}{'mean ms':>10}{'fit':>8}"
          f"{'resid.':>8}{'p10 ms':>9}{'p90 ms':>9}{'max ms':>9}")
    for r, n in zip(cal["rows"], cal["reps"]):
        print(f"{r['bytes']:>12,}{n:>6}{r['median_ms']:>11.3f}{r['median_fit_ms']:>8.3f}"
              f"{r['median_residual_pct']:>7.0f}%{r['mean_ms']:>10.3f}{r['mean_fit_ms']:>8.3f}"
              f"{r['mean_residual_pct']:>7.0f}%{r['p10_ms']:>9.3f}{r['p90_ms']:>9.3f}{r['max_ms']:>9.2f}")
    for name in cal["fits"]:
        worst = max(abs(r[f"{name}_residual_pct"]) for r in cal["rows"])
        print(f"largest |residual| of the {name} fit: {worst:.0f}%")


# =========================================================================== 2. replay


def run_job(model: str, mode: str, warmup: int, timed: int, profiled: int) -> list[dict[str, Any]]:
    """One (model, mode) on its own ranks: compile, then blocks of timed steps each
    followed by one profiled step (so both see the same load on a shared machine), then
    one step's held and peak memory. Per rank: ``compile_s``, ``times_ms``, ``steps``
    (time lines with each collective's bytes), ``held_bytes``, ``peak_bytes``."""
    job = Job(model, mode, None, pg_timeout=900)
    try:
        job.start()
        compile_s = job.run(step.warmup, warmup)
        # bucket bytes from one step with shapes recorded; the time lines from steps
        # without (record_shapes costs microseconds per op, i.e. percent of an eager step)
        sizes = [[b for _, _, b in t["colls"]] for t in job.run(step.trace, True)]
        ranks: list[dict[str, Any]] = [{"compile_s": c, "times_ms": [], "steps": []} for c in compile_s]
        for i in range(profiled):
            n = timed // profiled + (1 if i < timed % profiled else 0)
            for r, res in zip(ranks, job.run(step.time_steps, n)):
                r["times_ms"] += res["times_ms"]
            for r, st, sz in zip(ranks, job.run(step.trace), sizes):
                if len(st["colls"]) != len(sz):
                    raise RuntimeError(f"{len(st['colls'])} collectives in a step, {len(sz)} before")
                st["colls"] = [(s, e, b) for (s, e, _), b in zip(st["colls"], sz)]
                r["steps"].append(st)
        for r, mem in zip(ranks, job.run(step.measure)):
            r["held_bytes"], r["peak_bytes"] = mem["held_bytes"], mem["peak_bytes"]
        return ranks
    finally:
        job.stop()


def run_jobs(models: list[str], modes: list[str], cal: dict[str, Any], warmup: int, timed: int,
             profiled: int, t0: float) -> dict[str, Any]:
    jobs: dict[str, Any] = {}
    for model in models:
        for mode in modes:
            key = f"{model}|{mode}"
            _log(t0, f"{key}: 2 gloo ranks, {warmup} warm-up steps (compile), {timed} timed, "
                     f"{profiled} profiled ...")
            t = time.perf_counter()
            try:
                res = run_job(model, mode, warmup, timed, profiled)
                a = replay.analyse_job(res, cal["fits"])
            except (JobError, RuntimeError, ValueError) as e:  # one failed job must not lose the rest
                _log(t0, f"{key}: FAILED: {str(e).strip().splitlines()[-1][:200]}")
                jobs[key] = {"model": model, "mode": mode, "failed": str(e)[-2000:]}
                continue
            a.update(model=model, mode=mode, compile_s=max(r["compile_s"] for r in res),
                     job_s=time.perf_counter() - t, peak_mb=res[0]["peak_bytes"] / 1e6,
                     held_mb=res[0]["held_bytes"] / 1e6)
            jobs[key] = a
            preds = ", ".join(f"{n} {p['pred_ms']:.1f} ms ({p['error_pct']:+.0f}%)"
                              for n, p in a["pred"].items())
            _log(t0, f"{key}: warm-up {a['compile_s']:.0f} s; measured {a['measured_median_ms']:.1f} ms, "
                     f"predicted: {preds}; {a['collectives']} collectives/step; job {a['job_s']:.0f} s")
    return jobs


def print_jobs(jobs: dict[str, Any]) -> None:
    print("\n== predicted vs measured step time, 2 gloo ranks (ms, medians) ==")
    print("measured: unprofiled steps, max over ranks (the target).  profiled: wall time of the\n"
          "profiled steps.  compute: profiled step minus time blocked on communication (slower\n"
          "rank).  exposed: step - compute.  Per calibration fit: modelled exposed time, sum of\n"
          "modelled collective times, prediction and its error vs measured (and vs profiled).\n"
          "ready: collective issue times, % of backward compute (rank 0).")
    head1 = f"{'':<77}" + "".join(f"{' -- ' + n + ' fit ':-<35}" for n in FITS)
    head = (f"{'model':<6}{'mode':<32}{'coll':>5}{'measured':>9}{'profiled':>9}{'compute':>8}{'exposed':>8}"
            + "".join(f"{'exposed':>8}{'comm':>7}{'predicted':>10}{'error':>9}" for _ in FITS)
            + f"  {'ready %':<}")
    print(head1)
    print(head)
    print("-" * (len(head) + 14))
    for j in jobs.values():
        if "failed" in j:
            print(f"{j['model']:<6}{j['mode']:<32}failed: {j['failed'].strip().splitlines()[-1][:80]}")
            continue
        fr = j["ready_frac"]
        ready = ",".join(f"{100 * f:.0f}" for f in fr) if len(fr) <= 4 else \
            f"{len(fr)}: {100 * fr[0]:.0f}..{100 * fr[-1]:.0f}"
        cells = "".join(
            f"{p['exposed_ms']:>8.1f}{p['comm_ms']:>7.1f}{p['pred_ms']:>10.1f}"
            f"{'%+.0f%%' % p['error_pct']:>5}{'(%+.0f)' % p['error_vs_profiled_pct']:>5}"
            for p in j["pred"].values())
        print(f"{j['model']:<6}{j['mode']:<32}{j['collectives']:>5}{j['measured_median_ms']:>9.1f}"
              f"{j['profiled_wall_ms']:>9.1f}{j['compute_ms']:>8.1f}{j['exposed_measured_ms']:>8.1f}"
              f"{cells}  {ready}")
    for name in FITS:
        errs = [abs(j["pred"][name]["error_pct"]) for j in jobs.values() if "pred" in j]
        if errs:
            print(f"{name} fit: largest |error| {max(errs):.0f}%, {sum(e <= 20 for e in errs)}/{len(errs)} "
                  f"jobs within +-20%")
    print_exposed(jobs)


def print_exposed(jobs: dict[str, Any]) -> None:
    """The check that says most about the model: exposed communication (the part of the
    step spent waiting for it), measured and modelled, per mode; and, next to each
    mode's bucket issue positions, its peak memory (bench.step_time's measure)."""
    print("\n== exposed communication: measured vs modelled (ms, medians over profiled steps) ==")
    print("measured exposed = profiled step - compute (time blocked on communication, slower\n"
          "rank); modelled = the replay's step - compute. error = modelled - measured, in ms, in %\n"
          "of the measured step and in % of the measured exposed time. ready: bucket issue\n"
          "positions, % of backward compute.")
    head = (f"{'model':<6}{'mode':<40}{'measured':>9}"
            + "".join(f"{n + ' fit':>11}{'err ms':>8}{'% step':>7}{'% exp.':>7}" for n in FITS)
            + f"{'peak MB':>9}  ready %")
    print(head)
    print("-" * (len(head) + 12))
    within = {n: [] for n in FITS}
    for j in jobs.values():
        if "failed" in j:
            continue
        m = j["exposed_measured_ms"]
        cells = ""
        for n in FITS:
            err = j["pred"][n]["exposed_ms"] - m
            pct = 100 * err / j["measured_median_ms"]
            of_exposed = f"{100 * err / m:+.0f}" if m > 0.5 else "-"
            within[n].append((abs(pct) <= 10, m <= 0.5 or abs(err / m) <= 0.25))
            cells += f"{j['pred'][n]['exposed_ms']:>11.1f}{err:>+8.1f}{pct:>+7.0f}{of_exposed:>7}"
        ready = ",".join(f"{100 * f:.0f}" for f in j["ready_frac"][:8])
        peak = j.get("peak_mb", float("nan"))
        print(f"{j['model']:<6}{j['mode']:<40}{m:>9.1f}{cells}{peak:>9.1f}  {ready}")
    for n, ok in within.items():
        if ok:
            print(f"{n} fit: exposed communication within +-10% of the step for "
                  f"{sum(a for a, _ in ok)}/{len(ok)} jobs, within +-25% of itself for "
                  f"{sum(b for _, b in ok)}/{len(ok)}")


# =========================================================================== 3. projection


def print_projection(pj: dict[str, Any], cal: dict[str, Any] | None) -> None:
    c = pj["config"]
    print("\n== projection parameters ==")
    for k, v in pj["params"].items():
        val = v["value"]
        s = f"{val / 1e9:g} GB/s" if "B/s" in v["unit"] and val > 1e6 else \
            f"{val * 1e6:g} us" if v["unit"].startswith("s ") else \
            f"{val / 1e12:g} TFLOP/s" if v["unit"] == "FLOP/s" else f"{val:g}"
        print(f"  {k:<16}{s:>14}  {v['unit']:<28} {v['source']}")
    if cal:
        f = cal["fits"]["median"]
        print(f"  (for scale: this machine's gloo median fit, 2 ranks: alpha {1e3 * f['alpha_ms']:.0f} us, "
              f"{f['bandwidth_GBps']:.2f} GB/s)")
    print(f"\n== projection: {c['model']}, {c['params'] / 1e6:.1f} M params in {c['tensors']} tensors, "
          f"fp32 grads {c['grad_bytes'] / 1e6:.0f} MB ==")
    print(f"per GPU (ASSUMED, weak scaling): forward {c['forward_ms']:.2f} ms + backward "
          f"{c['backward_ms']:.2f} ms (6*N*tokens at {100 * PARAMS['mfu']['value']:.0f}% of bf16 peak, "
          f"{PARAMS['tokens_per_gpu']['value']} tokens) + SGD {c['optimizer_ms']:.2f} ms (HBM-bound)")
    bs = c["buckets"]
    print(f"DDP buckets (caps 1 MiB then 25 MiB, ready order): {len(bs)}: " +
          ", ".join(f"{b['bytes'] / 1e6:.0f} MB@{100 * b['ready_frac']:.0f}%" for b in bs))
    print("(the tied embedding's 154 MB gradient is complete only at the end of backward)")
    print("\nall-reduce times (ms) of this model (NCCL model, ring or tree as faster):")
    ex = pj["allreduce_examples"]
    sizes = sorted({e["bytes"] for e in ex})
    print(f"{'GPUs':>6}" + "".join(f"{format(s, ',') + ' B':>22}" for s in sizes))
    for p in GPU_COUNTS:
        cells = []
        for s in sizes:
            e = next(e for e in ex if e["gpus"] == p and e["bytes"] == s)
            cells.append(f"{e['ms']:.3f} ({e['algo']})")
        print(f"{p:>6}" + "".join(f"{c:>22}" for c in cells))
    for name, t in pj["tables"].items():
        print(f"\n-- {name} --")
        print(f"{'GPUs':>6}{'step ms':>10}{'exposed ms':>12}{'comm ms':>10}{'overlap':>9}  algo")
        for p, r in t.items():
            print(f"{p:>6}{r['step_ms']:>10.2f}{r['exposed_ms']:>12.2f}{r['comm_ms']:>10.2f}"
                  f"{r['overlap_pct']:>8.0f}%  {r['algo']}")
    names = [n for n in pj["tables"] if n in pj["latency_bandwidth_sensitivity"][0]]
    print("\n-- sensitivity: step ms (exposed ms) --")
    print(f"{'case':<36}{'GPUs':>6}" + "".join(f"{n.split(' (')[0][:26]:>28}" for n in names))
    def cells(row: dict[str, Any]) -> str:
        return "".join(f"{'%.1f (%.1f)' % (row[n]['step_ms'], row[n]['exposed_ms']):>28}" for n in names)

    for row in pj["latency_bandwidth_sensitivity"]:
        print(f"{row['case']:<36}{row['gpus']:>6}" + cells(row))
    for row in pj["mfu_sensitivity"]:
        label = "MFU %.0f%% (compute %.1f ms)" % (100 * row["mfu"], row["compute_ms"])
        print(f"{label:<36}{row['gpus']:>6}" + cells(row))
    print_plan_check(pj)
    print("\n-- DDP bucket cap (first bucket 1 MiB) --")
    print(f"{'cap MiB':>8}{'buckets':>9}{'GPUs':>6}{'step ms':>10}{'exposed ms':>12}{'comm ms':>10}"
          f"{'overlap':>9}")
    for r in pj["bucket_cap_sensitivity"]:
        print(f"{r['cap_mib']:>8}{r['buckets']:>9}{r['gpus']:>6}{r['step_ms']:>10.2f}{r['exposed_ms']:>12.2f}"
              f"{r['comm_ms']:>10.2f}{r['overlap_pct']:>8.0f}%")


def print_plan_check(pj: dict[str, Any]) -> None:
    """ddp_fusion's per-step plan check, before (an all-gather of one int64 per rank on the
    model's group, read on the host) and now (the host group's max: O(log N) rounds on
    the CPU), beside eager DDP's own per-step fixed cost."""
    print("\n-- per-step plan check vs eager DDP's fixed cost (GPT-2 small, DDP's default caps) --")
    print("before: NCCL ring all-gather of 8 B per rank (LL protocol latency), then a device sync\n"
          "now: host group max, rounds x host_round (x4: a slower host network), on its own thread,\n"
          "hidden while it takes less than the backward before the first bucket\n"
          "eager DDP: the latency of its bucket all-reduces (ddp_fusion issues the same buckets)")
    print(f"{'GPUs':>6}{'before ms':>11}{'rounds':>8}{'now ms':>8}{'now x4 ms':>11}{'eager DDP ms':>14}"
          f"{'1st bucket ms':>15}")
    slow = {r["gpus"]: r for r in pj["plan_check_host_round_x4"]}
    for r in pj["plan_check"]:
        print(f"{r['gpus']:>6}{r['old_allgather_ms']:>11.3f}{r['new_rounds']:>8}{r['new_ms']:>8.2f}"
              f"{slow[r['gpus']]['new_ms']:>11.2f}{r['eager_ddp_fixed_ms']:>14.2f}{r['first_bucket_ms']:>15.2f}")


# =========================================================================== main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cost_model",
                                     description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--model", choices=("mlp", "gpt", "all"), default="all")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated modes of bench.step_time (default {','.join(MODES)})")
    parser.add_argument("--quick", action="store_true",
                        help="10 timed / 3 profiled steps, fewer calibration reps, no upstream mode")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timed", type=int, default=None, help="timed steps (default 20, quick 10)")
    parser.add_argument("--profiled", type=int, default=None, help="profiled steps (default 5, quick 3)")
    parser.add_argument("--cache-dir", default=os.path.join(OUT_DIR, "inductor_cache"),
                        help="TORCHINDUCTOR_CACHE_DIR for the ranks")
    parser.add_argument("--projection-only", action="store_true")
    parser.add_argument("--out", default=os.path.join(OUT_DIR, "cost_model.json"))
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    os.makedirs(OUT_DIR, exist_ok=True)
    meta: dict[str, Any] = {**provenance(), "quick": args.quick}
    meta["load_avg_start"] = meta.pop("load_average")
    result: dict[str, Any] = {"meta": meta}
    if args.projection_only:
        cal = None
        if os.path.exists(args.out):
            with open(args.out) as f:
                old = json.load(f)
            result.update({k: v for k, v in old.items() if k in ("calibration", "jobs")})
            cal = old.get("calibration")
        pj = projection.projection()
        result["projection"] = pj
        print_projection(pj, cal)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir
        models = ["mlp", "gpt"] if args.model == "all" else [args.model]
        modes = args.modes.split(",") if args.modes else list(QUICK_MODES if args.quick else MODES)
        known = [m for m in all_modes() if m != "comm_only"]
        bad = [m for m in modes if m not in known]
        if bad:
            parser.error(f"unknown modes {bad}; known: {known}")
        timed = args.timed or (10 if args.quick else 20)
        profiled = args.profiled or (3 if args.quick else 5)
        meta.update(models=models, modes=modes, warmup=args.warmup, timed=timed, profiled=profiled,
                    inductor_cache=args.cache_dir)
        print(f"bench.cost_model: torch {meta['torch']}, {meta['machine']}, load average "
              f"{' '.join(f'{x:.2f}' for x in meta['load_avg_start'])}; 2 gloo ranks x 1 thread; "
              f"{len(models)} models x {len(modes)} modes", flush=True)
        cal = calibrate(args.quick, t0)
        result["calibration"] = cal
        print_calibration(cal)
        print(flush=True)
        jobs = run_jobs(models, modes, cal, args.warmup, timed, profiled, t0)
        result["jobs"] = jobs
        print_jobs(jobs)
        pj = projection.projection()
        result["projection"] = pj
        print_projection(pj, cal)
    meta["load_avg_end"] = os.getloadavg()
    meta["wall_s"] = time.perf_counter() - t0
    print(f"\nload average at end {' '.join(f'{x:.2f}' for x in meta['load_avg_end'])}; "
          f"wall time {meta['wall_s']:.0f} s")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
