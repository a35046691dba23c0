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
   bench/_step_time_worker.py, modes ``eager_ddp``, ``ddp_fusion_concat``,
   ``compiled_autograd_nofusion``, ``upstream_python_reducer_concat`` and the
   ``compute_only`` control, torch's default buckets -- a fresh pair of gloo ranks warms up
   (compiles), times >= 10 unprofiled steps (``dist.barrier()`` before each, step time = max
   over ranks, as bench/step_time.py), then profiles a few steps with ``torch.profiler``.
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
   timed in blocks between the profiled ones), error in %.
3. **Projection.** GPT-2-small-sized job (124.4 M parameters, fp32 gradients, 25 MiB
   buckets) on 8 / 16 / 64 / 256 / 1,024 H100 SXM GPUs, 8 per node: NCCL-style ring
   and tree all-reduce times from the published link bandwidths and NCCL's own latency
   constants (table printed, with sources), GPU compute from 6 * N * tokens FLOPs at a
   stated MFU (an assumption: there is no GPU here). Per GPU count: step time, exposed
   communication and overlap for one all-reduce per gradient (unfused compiled autograd),
   DDP buckets (eager DDP and ddp_fusion issue the same buckets) and one bucket at the end.

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
import math
import os
import platform
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from bench.step_time import machine

OUT_DIR = os.path.join(os.path.dirname(__file__), "out")
MODES = ("eager_ddp", "ddp_fusion_concat", "compiled_autograd_nofusion",
         "upstream_python_reducer_concat", "compute_only")
QUICK_MODES = ("eager_ddp", "ddp_fusion_concat", "compiled_autograd_nofusion", "compute_only")
CALIB_BYTES = [4096 * 2**i for i in range(14)]  # 4 KiB .. 32 MiB

# Profiler event names (main thread) of a collective's issue and of a blocking wait;
# nested issue ops (_c10d_functional::all_reduce_ -> c10d::allreduce_) count once.
ISSUE_OPS = {"c10d::allreduce_", "c10d::allreduce_coalesced_", "_c10d_functional::all_reduce",
             "_c10d_functional::all_reduce_", "_c10d_functional::all_reduce_coalesced",
             "_c10d_functional::all_reduce_coalesced_"}
WAIT_OPS = {"_c10d_functional::wait_tensor", "c10d::wait"}
COPY_OUT = "torch.distributed.ddp.reducer::copy_bucket_to_grad"  # eager DDP's finalize
_ITEMSIZE = {"float": 4, "c10::Half": 2, "c10::BFloat16": 2, "double": 8}


def _log(t0: float, msg: str) -> None:
    print(f"  [{time.perf_counter() - t0:6.0f} s] {msg}", flush=True)


# =========================================================================== 1. calibration


def calib_worker(rank: int, world_size: int, sizes: list[int], reps: list[int]) -> list[list[float]]:
    """Per size, ``reps`` timings (ms) of one blocking ``dist.all_reduce``."""
    torch.set_num_threads(1)
    return [all_reduce_times(torch.ones(nbytes // 4), n) for nbytes, n in zip(sizes, reps)]


def all_reduce_times(x: torch.Tensor, n: int, warmup: int = 3) -> list[float]:
    """``n`` timings (ms) of one blocking ``dist.all_reduce(x)``, each after a barrier."""
    for _ in range(warmup):  # warm up the size (gloo allocates per size)
        dist.all_reduce(x)
    ts = []
    for _ in range(n):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        ts.append(1e3 * (time.perf_counter() - t))
    return ts


def fit_alpha_beta(nbytes: list[int], t_ms: list[float]) -> tuple[float, float]:
    """``(alpha_ms, beta_ms_per_byte)`` minimizing sum(((alpha + beta n - t) / t)^2)."""
    import numpy as np

    n = np.asarray(nbytes, dtype=float)
    t = np.asarray(t_ms, dtype=float)
    a = np.stack([1 / t, n / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return float(alpha), float(beta)


def calibrate(quick: bool, t0: float) -> dict[str, Any]:
    """Per size, the median (typical) and mean (expected) time of one all-reduce, max over
    ranks; two fits: ``median`` (the plain model) and ``mean`` (the correction, see
    ``FITS``)."""
    from bench import cost_model as this
    from ddp_fusion.launch import run_ranks

    reps = [(30 if quick else 60) if b <= 1 << 20 else (8 if quick else 20) for b in CALIB_BYTES]
    _log(t0, f"calibration: 2 gloo ranks x 1 thread, dist.all_reduce of fp32 tensors "
             f"{CALIB_BYTES[0] // 1024} KiB .. {CALIB_BYTES[-1] >> 20} MiB, {reps[0]}/{reps[-1]} reps")
    res = run_ranks(this.calib_worker, world_size=2, args=(CALIB_BYTES, reps), timeout=900,
                    threads_per_rank=1)
    samples = [[max(pair) for pair in zip(r0, r1)] for r0, r1 in zip(*res)]
    stats = {"median": [statistics.median(x) for x in samples],
             "mean": [statistics.fmean(x) for x in samples]}
    out: dict[str, Any] = {"reps": reps, "fits": {}, "rows": []}
    for name, ts in stats.items():
        alpha, beta = fit_alpha_beta(CALIB_BYTES, ts)
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


# =========================================================================== 2. timelines


def _nbytes(shapes: list, dtypes: list) -> int:
    total = 0
    for shape, dtype in zip(shapes, dtypes):
        if shape and dtype in _ITEMSIZE:
            total += math.prod(shape) * _ITEMSIZE[dtype]
    return total


def _outermost(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    iv = sorted(iv, key=lambda x: (x[0], -x[1]))
    out: list[tuple[float, float]] = []
    for s, e in iv:
        if out and s >= out[-1][0] and e <= out[-1][1]:
            continue
        out.append((s, e))
    return out


def _timelines(prof: Any) -> list[dict[str, Any]]:
    """Per profiled step (``cm::step`` range), times in ms from the step's start."""
    evs = list(prof.profiler.kineto_results.events())
    steps = sorted((e for e in evs if e.name() == "cm::step"), key=lambda e: e.start_ns())
    main = steps[0].start_thread_id()
    out = []
    for st in steps:
        s0, s1 = st.start_ns(), st.end_ns()

        def rel(t: int) -> float:
            return (t - s0) / 1e6  # noqa: B023

        inside = [e for e in evs if s0 <= e.start_ns() <= s1]
        on_main = [e for e in inside if e.start_thread_id() == main]
        phases = {e.name()[len("step::"):]: (rel(e.start_ns()), rel(e.end_ns()))
                  for e in on_main if e.name().startswith("step::")}
        issues = _outermost([(rel(e.start_ns()), rel(e.end_ns())) for e in on_main if e.name() in ISSUE_OPS])
        waits = _outermost([(rel(e.start_ns()), rel(e.end_ns())) for e in on_main if e.name() in WAIT_OPS])
        # the bucket all-reduces (ddp_fusion's per-step plan check, an 8-byte all-gather
        # waited for inside its guard op, stays in the compute timeline)
        colls = sorted((rel(e.start_ns()), rel(e.end_ns()), _nbytes(e.shapes(), e.dtypes()))
                       for e in inside if e.name() in ("gloo:all_reduce", "nccl:all_reduce"))
        copy_out = sorted(rel(e.start_ns()) for e in on_main if e.name() == COPY_OUT)
        busy = sorted((rel(e.start_ns()), rel(e.end_ns())) for e in on_main
                      if not e.name().startswith(("cm::", "step::")))
        gaps, cur = [], 0.0
        for s, e in busy:
            if s > cur + 0.02:
                gaps.append((cur, s))
            cur = max(cur, e)
        if rel(s1) > cur + 0.02:
            gaps.append((cur, rel(s1)))
        out.append({"wall_ms": rel(s1), "phases": phases, "issues": issues, "waits": waits,
                    "colls": colls, "copy_out": copy_out, "gaps": gaps})
    return out


def mode_worker(rank: int, world_size: int, model_name: str, mode_name: str, warmup: int,
                timed: int, profiled: int, set_to_none: bool = True) -> dict[str, Any]:
    """One rank of one (model, mode): compile, time, profile. The step is
    bench/_step_time_worker.TrainStep, the one bench/step_time times (zero_grad,
    forward, loss, backward, SGD step, each phase labelled ``step::<phase>``)."""
    from torch.profiler import profile, record_function

    from bench._step_time_worker import _build, _profile_step, all_modes, make_batches

    torch.set_num_threads(1)
    torch._dynamo.reset()  # before the mode: reset() also turns compiled autograd off
    mode = all_modes()[mode_name]
    batches = make_batches(model_name, rank, 4)
    with torch._inductor.config.patch(compile_threads=1), mode.context():
        step = _build(model_name, mode, None, batches, set_to_none=set_to_none)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(warmup):
            step()
        dist.barrier()
        compile_s = time.perf_counter() - t
        # bucket bytes from one step with shapes recorded; the timelines from steps
        # without (record_shapes costs microseconds per op, i.e. percent of an eager step)
        dist.barrier()
        with profile(record_shapes=True) as prof:
            with record_function("cm::step"):
                step()
        sizes = [b for _, _, b in _timelines(prof)[0]["colls"]]
        # timed and profiled steps interleaved (a block of timed steps, then one profiled
        # step), so that both see the same load on a shared machine
        times: list[float] = []
        steps: list[dict[str, Any]] = []
        for i in range(profiled):
            for _ in range(timed // profiled + (1 if i < timed % profiled else 0)):
                dist.barrier()
                t = time.perf_counter()
                step()
                times.append(1e3 * (time.perf_counter() - t))
            dist.barrier()
            with profile() as prof:
                dist.barrier()
                with record_function("cm::step"):
                    step()
            st = _timelines(prof)[0]
            if len(st["colls"]) != len(sizes):
                raise RuntimeError(f"{len(st['colls'])} collectives in a step, {len(sizes)} before")
            st["colls"] = [(s, e, b) for (s, e, _), b in zip(st["colls"], sizes)]
            steps.append(st)
        dist.barrier()
        memory = _profile_step(step, "cpu")  # held and peak bytes (bench.step_time's measure)
        return {"compile_s": compile_s, "times_ms": times, "steps": steps,
                "held_bytes": memory["held_bytes"], "peak_bytes": memory["peak_bytes"]}


# --------------------------------------------------------------------------- the model


def _blocked(step: dict[str, Any]) -> list[tuple[float, float]]:
    """Main-thread intervals spent waiting for communication: the wait ops; in modes
    without wait ops (eager DDP waits in C++, with no profiler event), the idle gaps
    after the last issue in which a collective completes."""
    if step["waits"]:
        return list(step["waits"])
    if not step["issues"]:
        return []
    last = step["issues"][-1][1]
    ends = [e for _, e, _ in step["colls"]]
    return [(s, e) for s, e in step["gaps"] if s >= last and any(s <= c <= e + 0.05 for c in ends)]


def compute_view(step: dict[str, Any]) -> dict[str, Any]:
    """The step on the rank's *compute clock* (wall time minus blocked time): collective
    issue times, their bytes, the sync points (clock, index of the collective waited
    for), and the total compute time."""
    blocked = _blocked(step)

    def tau(t: float) -> float:
        return t - sum(max(0.0, min(e, t) - s) for s, e in blocked)

    issues = step["issues"]
    colls = step["colls"]
    if len(issues) != len(colls):
        raise ValueError(f"{len(issues)} collective issues but {len(colls)} backend collectives")
    k = len(issues)
    syncs: list[tuple[float, int]] = []
    if step["waits"]:
        if len(step["waits"]) == k:  # one wait per collective, in issue order
            syncs = [(tau(s), i) for i, (s, _) in enumerate(step["waits"])]
        else:  # otherwise a wait waits for everything issued before it
            syncs = [(tau(s), max(i for i, (t, _) in enumerate(issues) if t <= s))
                     for s, _ in step["waits"]]
    elif k:
        # eager DDP: finalize_backward waits for every bucket, then copies results out
        last = issues[-1][1]
        cands = [s for s, _ in blocked if s >= last] + [t for t in step["copy_out"] if t >= last]
        t_sync = min(cands) if cands else step["phases"]["backward"][1]
        syncs = [(tau(t_sync), k - 1)]
    bwd = step["phases"]["backward"]
    return {"issue": [tau(s) for s, _ in issues], "bytes": [b for _, _, b in colls],
            "syncs": syncs, "total": tau(step["wall_ms"]),
            "blocked_ms": sum(e - s for s, e in blocked),
            "backward": (tau(bwd[0]), tau(bwd[1])), "wall_ms": step["wall_ms"],
            "measured_coll_ms": [e - s for s, e, _ in colls]}


def simulate(ranks: list[dict[str, Any]], comm_ms: Any) -> dict[str, Any]:
    """Replay each rank's compute clock with modelled communication on one channel.

    ``comm_ms(nbytes)`` is one collective's duration. Returns per-rank predicted wall
    ends, the collectives' (start, end) and the prediction (max over ranks)."""
    k = len(ranks[0]["issue"])
    if any(len(r["issue"]) != k for r in ranks):
        raise ValueError("ranks issued different numbers of collectives")
    events = []
    for r in ranks:
        ev = [(t, 1, i) for i, t in enumerate(r["issue"])] + [(t, 0, j) for t, j in r["syncs"]]
        events.append(sorted(ev))  # at equal times a sync goes before an issue
    wall = [0.0] * len(ranks)
    clock = [0.0] * len(ranks)
    ptr = [0] * len(ranks)
    ends: list[float] = []
    spans = []

    def advance(r: int, stop_issue: int | None) -> float | None:
        while ptr[r] < len(events[r]):
            t, kind, idx = events[r][ptr[r]]
            wall[r] += t - clock[r]
            clock[r] = t
            ptr[r] += 1
            if kind == 0:
                if idx >= len(ends):
                    raise ValueError("a wait precedes its collective's issue")
                wall[r] = max(wall[r], ends[idx])
            elif idx == stop_issue:
                return wall[r]
        return None

    for i in range(k):
        issued = [advance(r, i) for r in range(len(ranks))]
        start = max([*issued, ends[-1] if ends else 0.0])
        end = start + comm_ms(max(r["bytes"][i] for r in ranks))
        ends.append(end)
        spans.append((start, end))
    for r in range(len(ranks)):
        advance(r, None)
        wall[r] += ranks[r]["total"] - clock[r]
    return {"wall": wall, "pred_ms": max(wall), "spans": spans,
            "comm_ms": sum(e - s for s, e in spans)}


def analyse_job(per_rank: list[dict[str, Any]], fits: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Measured numbers and the model's predictions (one per calibration fit) for one
    (model, mode)."""
    times = [max(ts) for ts in zip(*(r["times_ms"] for r in per_rank))]
    measured = statistics.median(times)
    nsteps = min(len(r["steps"]) for r in per_rank)
    views = [[compute_view(r["steps"][s]) for r in per_rank] for s in range(nsteps)]
    rows = []
    for vs in views:
        wall = max(v["wall_ms"] for v in vs)
        compute = max(v["total"] for v in vs)
        b0, b1 = vs[0]["backward"]
        row = {"profiled_wall_ms": wall, "compute_ms": compute, "exposed_measured_ms": wall - compute,
               "blocked_ms_per_rank": [v["blocked_ms"] for v in vs], "backward_compute_ms": b1 - b0,
               "ready_ms": [t - b0 for t in vs[0]["issue"]],
               "ready_frac": [(t - b0) / (b1 - b0) for t in vs[0]["issue"]],
               "bytes": vs[0]["bytes"], "measured_coll_ms": vs[0]["measured_coll_ms"]}
        for name, f in fits.items():
            sim = simulate(vs, lambda n, f=f: f["alpha_ms"] + f["beta_ms_per_byte"] * n)
            row[f"pred_{name}_ms"] = sim["pred_ms"]
            row[f"exposed_{name}_ms"] = sim["pred_ms"] - compute
            row[f"comm_{name}_ms"] = sim["comm_ms"]
        rows.append(row)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    mid = rows[len(rows) // 2]
    out = {
        "measured_median_ms": measured, "measured_times_ms": times,
        "profiled_wall_ms": med("profiled_wall_ms"), "compute_ms": med("compute_ms"),
        "exposed_measured_ms": med("exposed_measured_ms"),
        "backward_compute_ms": med("backward_compute_ms"),
        "collectives": len(mid["bytes"]), "bucket_bytes": mid["bytes"],
        "ready_ms": mid["ready_ms"], "ready_frac": mid["ready_frac"],
        "measured_coll_ms_sum": statistics.median(sum(r["measured_coll_ms"]) for r in rows),
        "pred": {}, "steps": rows,
        "compute_views": [[{k: v[k] for k in ("issue", "bytes", "syncs", "total")} for v in vs]
                          for vs in views],
    }
    for name in fits:
        pred, comm, exp = med(f"pred_{name}_ms"), med(f"comm_{name}_ms"), med(f"exposed_{name}_ms")
        out["pred"][name] = {
            "pred_ms": pred, "error_pct": 100 * (pred - measured) / measured,
            "error_vs_profiled_pct": 100 * (pred - out["profiled_wall_ms"]) / out["profiled_wall_ms"],
            "exposed_ms": exp, "comm_ms": comm,
            "overlap_pct": 100 * (1 - exp / comm) if comm else None}
    return out


def run_jobs(models: list[str], modes: list[str], cal: dict[str, Any], warmup: int, timed: int,
             profiled: int, t0: float) -> dict[str, Any]:
    from bench import cost_model as this  # pickled by module name, not as __main__
    from ddp_fusion.launch import run_ranks

    jobs: dict[str, Any] = {}
    for model in models:
        for mode in modes:
            key = f"{model}|{mode}"
            _log(t0, f"{key}: 2 gloo ranks, {warmup} warm-up steps (compile), {timed} timed, "
                     f"{profiled} profiled ...")
            t = time.perf_counter()
            try:
                res = run_ranks(this.mode_worker, world_size=2,
                                args=(model, mode, warmup, timed, profiled), timeout=1800,
                                threads_per_rank=1, pg_timeout=900)
                a = analyse_job(res, cal["fits"])
            except Exception as e:  # noqa: BLE001 - one failed job must not lose the rest
                _log(t0, f"{key}: FAILED: {str(e).strip().splitlines()[-1][:200]}")
                jobs[key] = {"model": model, "mode": mode, "failed": str(e)[-2000:]}
                continue
            a.update(model=model, mode=mode, compile_s=max(r["compile_s"] for r in res),
                     job_s=time.perf_counter() - t, peak_mb=res[0]["peak_bytes"] / 1e6,
                     held_mb=res[0]["held_bytes"] / 1e6)
            jobs[key] = a
            preds = ", ".join(f"{n} {p['pred_ms']:.1f} ms ({p['error_pct']:+.0f}%)" for n, p in a["pred"].items())
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
        print(f"{j['model']:<6}{j['mode']:<40}{m:>9.1f}{cells}{j.get('peak_mb', float('nan')):>9.1f}  {ready}")
    for n, ok in within.items():
        if ok:
            print(f"{n} fit: exposed communication within +-10% of the step for "
                  f"{sum(a for a, _ in ok)}/{len(ok)} jobs, within +-25% of itself for "
                  f"{sum(b for _, b in ok)}/{len(ok)}")


# =========================================================================== 3. projection

# Published parameters. Latencies are NCCL's own tuning constants for the Simple protocol
# (the one large gradient buckets use), NCCL 2.20.3, src/graph/tuning.cc (baseLat, hwLat).
PARAMS: dict[str, dict[str, Any]] = {
    "gpus_per_node": {"value": 8, "unit": "GPUs", "source": "DGX H100 user guide: 8x H100 SXM5 per system"},
    "B_nvlink": {"value": 450e9, "unit": "B/s per GPU per direction",
                 "source": "NVIDIA H100 datasheet: NVLink 900 GB/s total bidirectional per "
                           "H100 SXM GPU (NVLink 4); 450 GB/s each way. Peak, not achieved."},
    "B_ib": {"value": 50e9, "unit": "B/s per GPU per direction",
             "source": "DGX H100 user guide: 8x ConnectX-7, 400 Gb/s InfiniBand NDR each, one per "
                       "GPU: 400 Gb/s = 50 GB/s. Peak, not achieved."},
    "ring_base_lat": {"value": 8.4e-6, "unit": "s per all-reduce",
                      "source": "NCCL 2.20.3 src/graph/tuning.cc baseLat[Ring][Simple]"},
    "ring_nvlink_lat": {"value": 3.4e-6, "unit": "s per ring step",
                        "source": "NCCL 2.20.3 tuning.cc hwLat[NVLink][Ring][Simple]"},
    "ring_net_lat": {"value": 14.0e-6, "unit": "s per inter-node ring step",
                     "source": "NCCL 2.20.3 tuning.cc hwLat[Net][Ring][Simple] (+ latencyInter, "
                               "topology-dependent, taken as 0)"},
    "tree_base_lat": {"value": 0.0, "unit": "s per all-reduce",
                      "source": "NCCL 2.20.3 tuning.cc baseLat[Tree][Simple]"},
    "tree_nvlink_lat": {"value": 28e-6, "unit": "s per tree hop",
                        "source": "NCCL 2.20.3 tuning.cc hwLat[NVLink][Tree][Simple]"},
    "tree_net_lat": {"value": 28e-6, "unit": "s per tree level",
                     "source": "NCCL 2.20.3 tuning.cc hwLat[Net][Tree][Simple]"},
    "peak_bf16": {"value": 989e12, "unit": "FLOP/s",
                  "source": "NVIDIA H100 datasheet: H100 SXM BF16 Tensor Core 1,979 TFLOPS with "
                            "sparsity, i.e. 989 dense"},
    "hbm_bw": {"value": 3.35e12, "unit": "B/s",
               "source": "NVIDIA H100 datasheet: H100 SXM 3.35 TB/s HBM3"},
    "mfu": {"value": 0.40, "unit": "fraction of peak_bf16",
            "source": "ASSUMPTION (typical well-tuned GPT training; sensitivity shown)"},
    "tokens_per_gpu": {"value": 8 * 1024, "unit": "tokens per step per GPU",
                       "source": "ASSUMPTION: micro-batch 8 x sequence 1024, no accumulation"},
}
GPU_COUNTS = (8, 16, 64, 256, 1024)
BUCKET_CAPS = (1 << 20, 25 << 20)  # torch DDP: 1 MiB first bucket, then 25 MiB


def gpt2_small_grads() -> list[tuple[str, int, float]]:
    """``(name, numel, ready fraction of backward)`` in gradient-ready order for GPT-2 small
    (vocab 50257, context 1024, d 768, 12 layers, LM head tied to the token embedding).

    Backward FLOPs of a tensor = 4 * numel * tokens (the backward 2/3 of 6 * N * tokens;
    attention-score FLOPs are ignored); layers run in reverse. The tied head's matmul
    backward runs first, but the shared weight's gradient is complete (ready) only after
    the embedding backward at the very end."""
    v, ctx, d, layers = 50257, 1024, 768, 12
    order: list[tuple[str, int, bool]] = [("head(wte)", v * d, False), ("ln_f.weight", d, True),
                                          ("ln_f.bias", d, True)]
    for i in reversed(range(layers)):
        p = f"h.{i}."
        order += [(p + "mlp.c_proj.weight", 4 * d * d, True), (p + "mlp.c_proj.bias", d, True),
                  (p + "mlp.c_fc.weight", 4 * d * d, True), (p + "mlp.c_fc.bias", 4 * d, True),
                  (p + "ln_2.weight", d, True), (p + "ln_2.bias", d, True),
                  (p + "attn.c_proj.weight", d * d, True), (p + "attn.c_proj.bias", d, True),
                  (p + "attn.c_attn.weight", 3 * d * d, True), (p + "attn.c_attn.bias", 3 * d, True),
                  (p + "ln_1.weight", d, True), (p + "ln_1.bias", d, True)]
    order += [("wpe", ctx * d, True), ("wte", 0, True)]
    total = sum(n for _, n, _ in order)
    out, cum = [], 0
    for name, n, is_grad in order:
        cum += n
        if is_grad:
            out.append((name, v * d if name == "wte" else n, cum / total))
    return out


def ddp_buckets(grads: list[tuple[str, int, float]], caps: tuple[int, ...]) -> list[tuple[int, float]]:
    """``(bytes, ready fraction)`` per bucket: fp32 gradients in ready order, a bucket
    closes once it reaches the current cap (torch DDP's rule; the last cap repeats)."""
    buckets, cur, ready = [], 0, 0.0
    for _, n, r in grads:
        cur += 4 * n
        ready = r
        if cur >= caps[min(len(buckets), len(caps) - 1)]:
            buckets.append((cur, ready))
            cur = 0
    if cur:
        buckets.append((cur, ready))
    return buckets


def nccl_allreduce_s(nbytes: float, p: int, prm: dict[str, float], lat_scale: float = 1.0,
                     bw_scale: float = 1.0) -> tuple[float, str]:
    """Modelled NCCL all-reduce time and the algorithm (ring or tree, whichever is
    faster, as NCCL's tuner picks). Bandwidth term 2(p-1)/p * n / B with B the slowest
    link (NVLink inside a node, the NIC once p > 8) for both; latency terms as NCCL's
    tuning.cc: ring base + (2(p-1) - 2N) intra steps + 2N inter steps, tree
    2((ppn-1) intra + log2(N) inter), N nodes (N > 1)."""
    if p <= 1:
        return 0.0, "-"
    g = prm["gpus_per_node"]
    nodes = max(1, math.ceil(p / g))
    ppn = min(p, g)
    b = (prm["B_nvlink"] if nodes == 1 else prm["B_ib"]) * bw_scale
    bw = 2 * (p - 1) / p * nbytes / b
    inter = 2 * nodes if nodes > 1 else 0
    ring = prm["ring_base_lat"] + (2 * (p - 1) - inter) * prm["ring_nvlink_lat"] + inter * prm["ring_net_lat"]
    tree = prm["tree_base_lat"] + 2 * ((ppn - 1) * prm["tree_nvlink_lat"] +
                                       math.log2(nodes) * prm["tree_net_lat"])
    ring, tree = ring * lat_scale, tree * lat_scale
    return (ring + bw, "ring") if ring <= tree else (tree + bw, "tree")


def project_one(msgs: list[tuple[int, float]], p: int, prm: dict[str, float], fwd: float, bwd: float,
                opt: float, blocking: bool = False, **scale: float) -> dict[str, Any]:
    """Step on ``p`` GPUs: collectives ``(bytes, ready fraction of backward)`` in order on
    one stream, waits at the end of backward (``blocking``: each collective is waited
    for at once, stalling compute)."""
    end, algos, total, stall = 0.0, set(), 0.0, 0.0
    for nbytes, frac in msgs:
        d, algo = nccl_allreduce_s(nbytes, p, prm, **scale)
        algos.add(algo)
        total += d
        if blocking:
            stall += d
        else:
            end = max(end, frac * bwd) + d
    exposed = stall if blocking else max(0.0, end - bwd)
    return {"step_ms": 1e3 * (fwd + bwd + exposed + opt), "exposed_ms": 1e3 * exposed,
            "comm_ms": 1e3 * total, "overlap_pct": 100 * (1 - exposed / total) if total else 100.0,
            "algo": "/".join(sorted(algos))}


def projection(mfu: float | None = None) -> dict[str, Any]:
    prm = {k: v["value"] for k, v in PARAMS.items()}
    if mfu is not None:
        prm["mfu"] = mfu
    grads = gpt2_small_grads()
    n_params = sum(n for _, n, _ in grads)
    flops = 6 * n_params * prm["tokens_per_gpu"]
    compute = flops / (prm["mfu"] * prm["peak_bf16"])
    fwd, bwd = compute / 3, 2 * compute / 3
    opt = 12 * n_params / prm["hbm_bw"]  # SGD as in the benchmark: read p, g; write p (fp32)
    variants = {
        "unfused (1 all-reduce per gradient)": [(4 * n, r) for _, n, r in grads],
        "DDP buckets (eager DDP = ddp_fusion)": ddp_buckets(grads, BUCKET_CAPS),
        "one bucket at the end": [(4 * n_params, 1.0)],
    }
    tables: dict[str, Any] = {}
    for name, msgs in variants.items():
        tables[name] = {p: project_one(msgs, p, prm, fwd, bwd, opt) for p in GPU_COUNTS}
    tables["unfused, each wait right after its all-reduce"] = {
        p: project_one(variants["unfused (1 all-reduce per gradient)"], p, prm, fwd, bwd, opt,
                       blocking=True) for p in GPU_COUNTS}
    sens = []
    for label, kw in (("latency x0.5", {"lat_scale": 0.5}), ("latency x1", {}),
                      ("latency x2", {"lat_scale": 2.0}), ("latency x4", {"lat_scale": 4.0}),
                      ("bandwidth x0.7 (achieved vs peak)", {"bw_scale": 0.7})):
        for p in (16, 1024):
            sens.append({"case": label, "gpus": p, **{
                name: project_one(variants[name], p, prm, fwd, bwd, opt, **kw)
                for name in variants}})
    mfu_sens = []
    for m in (0.2, 0.4, 0.6):
        c = flops / (m * prm["peak_bf16"])
        for p in (16, 1024):
            mfu_sens.append({"mfu": m, "gpus": p, "compute_ms": 1e3 * c, **{
                name: project_one(variants[name], p, prm, c / 3, 2 * c / 3, opt)
                for name in variants}})
    cap_sens = []
    for cap_mib in (5, 25, 100, 250):
        msgs = ddp_buckets(grads, (1 << 20, cap_mib << 20))
        for p in (16, 1024):
            cap_sens.append({"cap_mib": cap_mib, "gpus": p, "buckets": len(msgs),
                             **project_one(msgs, p, prm, fwd, bwd, opt)})
    buckets = variants["DDP buckets (eager DDP = ddp_fusion)"]
    return {
        "config": {"model": "GPT-2 small (vocab 50257, ctx 1024, d 768, 12 layers, tied head)",
                   "params": n_params, "grad_bytes": 4 * n_params, "tensors": len(grads),
                   "flops_per_step": flops, "forward_ms": 1e3 * fwd, "backward_ms": 1e3 * bwd,
                   "optimizer_ms": 1e3 * opt, "buckets": [{"bytes": b, "ready_frac": r} for b, r in buckets],
                   "bucket_caps": list(BUCKET_CAPS)},
        "params": PARAMS, "tables": {k: {str(p): v for p, v in t.items()} for k, t in tables.items()},
        "latency_bandwidth_sensitivity": sens, "mfu_sensitivity": mfu_sens,
        "bucket_cap_sensitivity": cap_sens,
        "allreduce_examples": [
            {"gpus": p, "bytes": n, "ms": 1e3 * nccl_allreduce_s(n, p, prm)[0],
             "algo": nccl_allreduce_s(n, p, prm)[1]}
            for p in GPU_COUNTS for n in (4 * 768, 25 << 20, 4 * n_params)],
    }


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
    print("\n-- DDP bucket cap (first bucket 1 MiB) --")
    print(f"{'cap MiB':>8}{'buckets':>9}{'GPUs':>6}{'step ms':>10}{'exposed ms':>12}{'comm ms':>10}{'overlap':>9}")
    for r in pj["bucket_cap_sensitivity"]:
        print(f"{r['cap_mib']:>8}{r['buckets']:>9}{r['gpus']:>6}{r['step_ms']:>10.2f}{r['exposed_ms']:>12.2f}"
              f"{r['comm_ms']:>10.2f}{r['overlap_pct']:>8.0f}%")


# =========================================================================== main


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cost_model", description=__doc__.split("\n")[0])
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
    args = parser.parse_args()

    t0 = time.perf_counter()
    os.makedirs(OUT_DIR, exist_ok=True)
    meta: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                            "load_avg_start": os.getloadavg(), "quick": args.quick}
    result: dict[str, Any] = {"meta": meta}
    if args.projection_only:
        cal = None
        if os.path.exists(args.out):
            with open(args.out) as f:
                old = json.load(f)
            result.update({k: v for k, v in old.items() if k in ("calibration", "jobs")})
            cal = old.get("calibration")
        pj = projection()
        result["projection"] = pj
        print_projection(pj, cal)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir
        models = ["mlp", "gpt"] if args.model == "all" else [args.model]
        modes = args.modes.split(",") if args.modes else list(QUICK_MODES if args.quick else MODES)
        from bench._step_time_worker import all_modes

        known = [m for m, mode in all_modes().items() if not m == "comm_only"]
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
        pj = projection()
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
