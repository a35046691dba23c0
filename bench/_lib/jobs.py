"""The parent's side of a run: jobs on kept-alive ranks, compiled once, timed round-robin.

A :class:`Job` is one (model, mode, cap) on its own :class:`ddp_fusion.launch.RankPool`,
running the worker of :mod:`bench._lib.step`. :func:`run_jobs` starts and warms up
(compiles) the jobs one after another, then times them round-robin for several rounds
(the starting job rotating each round), so drift on a shared machine hits all modes
alike; then profiles one step of each and compares its parameters with its reference
mode's. A job that fails is reported and dropped; the others go on.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from bench._lib import models, step
from bench._lib.modes import FLOORS, all_modes
from bench._lib.record import spread
from ddp_fusion.launch import RankPool


class JobError(Exception):
    pass


class Job:
    """One (model, mode, cap) on its own rank processes."""

    def __init__(self, model: str, mode: str, cap: float | None, device: str = "cpu",
                 set_to_none: bool = True, pg_timeout: float = 900.0, graph_caches: bool = False,
                 ranks: int | None = None) -> None:
        self.model, self.mode, self.cap, self.device = model, mode, cap, device
        self.graph_caches = graph_caches
        self.set_to_none = set_to_none
        self.key = f"{model}|{mode}|{cap}"
        self.label = mode if cap is None else f"{mode}@{cap:g}"
        self.world_size = models.world_size(model, device, ranks)
        self.pool = RankPool(self.world_size, threads_per_rank=1, pg_timeout=pg_timeout,
                             backend="nccl" if device == "cuda" else "gloo")
        self.started = False
        self.failed: str | None = None
        self.traceback: str | None = None
        self.rec: dict[str, Any] = {"model": model, "mode": mode, "cap": cap, "times_ms": [],
                                    "round_medians_ms": [], "recompiles_during_timing": []}

    def start(self, timeout: float = 1800.0) -> None:
        self.pool.start()
        self.started = True
        self.run(step.start, self.model, self.mode, self.cap, self.device, self.set_to_none,
                 self.graph_caches, timeout=timeout)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 1800.0) -> list[Any]:
        """``fn(rank, world_size, *args)`` on the job's ranks; :class:`JobError` (with
        the failure's last line) if it fails, after which the job is stopped."""
        if self.failed:
            raise JobError(self.failed)
        try:
            return self.pool.run(fn, *args, timeout=timeout)
        except RuntimeError as e:
            text = str(e)
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            self.failed = lines[-1][:200] if lines else "failed"
            self.traceback = text
            raise JobError(self.failed) from None

    def stop(self) -> None:
        """Leave the mode (its settings restored in the ranks), then stop the ranks."""
        if self.started and not self.failed:
            try:
                self.run(step.stop, timeout=120)
            except JobError:
                pass
        self.pool.close(kill=self.failed is not None)
        self.started = False


def make_jobs(model: str, modes: list[str], caps: list[float | None], device: str = "cpu",
              set_to_none: bool = True, pg_timeout: float = 900.0, ranks: int | None = None) -> list[Job]:
    """A job per (mode, cap); floors (cap-independent) once, at the default cap."""
    specs = [(m, cap) for cap in caps for m in modes if m not in FLOORS]
    specs += [(m, None) for m in FLOORS if m in modes]
    return [Job(model, m, cap, device, set_to_none, pg_timeout, ranks=ranks) for m, cap in specs]


class Log:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"  [{time.perf_counter() - self.t0:6.0f} s] {msg}", flush=True)


def _guard(log: Log, job: Job, what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except JobError as e:
        log(f"{job.key}: FAILED during {what}: {e}")
        job.stop()
        return None


def start_jobs(jobs: list[Job], warmup: int, log: Log) -> None:
    """Start and warm up (compile) each job, one after another."""
    for job in jobs:
        t0 = time.perf_counter()
        if _guard(log, job, "start", lambda job=job: job.start()) is None and job.failed:
            continue
        job.rec["startup_s"] = time.perf_counter() - t0
        w = _guard(log, job, "warm-up", lambda job=job: job.run(step.warmup, warmup))
        if w is None:
            continue
        job.rec["compile_s"] = max(w)
        log(f"{job.key:52s} started in {job.rec['startup_s']:5.1f} s, "
            f"warm-up ({warmup} steps, compiles) {job.rec['compile_s']:6.1f} s")


def time_round_robin(jobs: list[Job], rounds: int, steps: int, log: Log, rec_key: str = "") -> None:
    """``rounds`` rounds of ``steps`` timed steps per job, start rotated each round; a
    step's time is the max over ranks. ``rec_key``: record under ``job.rec[rec_key]``
    (e.g. a link rate) instead of ``job.rec``."""
    for r in range(rounds):
        order = jobs[r % len(jobs):] + jobs[: r % len(jobs)]
        line = []
        for job in order:
            if job.failed:
                continue
            res = _guard(log, job, f"round {r + 1}", lambda job=job: job.run(step.time_steps, steps))
            if res is None:
                continue
            rec = job.rec.setdefault(rec_key, {"times_ms": [], "round_medians_ms": [],
                                               "recompiles_during_timing": []}) if rec_key else job.rec
            per_step = [max(ts) for ts in zip(*(x["times_ms"] for x in res))]
            rec["times_ms"] += per_step
            rec["round_medians_ms"].append(statistics.median(per_step))
            for key in ("cpu_ms", "main_cpu_ms"):  # a step's host CPU: the mean over ranks
                rec.setdefault(key, []).extend(statistics.fmean(c) for c in zip(*(x[key] for x in res)))
            rec["recompiles_during_timing"].append(
                {k: max(x["recompiles"][k] for x in res) for k in res[0]["recompiles"]})
            line.append(f"{job.label}={statistics.median(per_step):.1f}")
        log(f"round {r + 1}/{rounds} medians ms: " + ", ".join(line))


def profile_and_compare(jobs: list[Job], log: Log) -> None:
    """One profiled step per job (bytes, copies, memory), and each job's parameters
    against its reference mode's (eager DDP, or eager DDP with the same hook)."""
    reference = {}
    params = {}
    for job in jobs:
        if job.failed:
            continue
        c = _guard(log, job, "profile", lambda job=job: job.run(step.measure))
        if c is not None:
            job.rec["collectives"] = c[0]["collectives"]
            job.rec["counters"] = [r["counters"] for r in c]
            # per rank; rank 0's row is shown (ranks run the same program)
            job.rec["profile"] = [{k: v for k, v in r.items() if k != "counters"} for r in c]
        p = _guard(log, job, "params", lambda job=job: job.run(step.params))
        if p is not None and p[0] is not None:
            params[job.key] = p
            reference[(job.model, job.cap, job.mode)] = p
    modes = all_modes()
    for job in jobs:
        p = params.get(job.key)
        ref = reference.get((job.model, job.cap, modes[job.mode].reference))
        if p is not None and ref is not None and job.mode not in FLOORS:
            # each rank against the reference's same rank (TP ranks hold different
            # shards), and each rank against its DP peer on DP rank 0
            tp = models.MODELS[job.model].tp
            job.rec["max_param_diff"] = float(max(abs(x - r).max() for x, r in zip(p, ref)))
            job.rec["max_param_diff_between_ranks"] = float(
                max(abs(x - p[i % tp]).max() for i, x in enumerate(p)))


def records(jobs: list[Job]) -> dict[str, dict[str, Any]]:
    """Each job's record, with its step-time spread and any failure."""
    out = {}
    for job in jobs:
        rec = job.rec
        if job.failed:
            rec["failed"], rec["traceback"] = job.failed, job.traceback
        if rec["times_ms"]:
            rec.update(spread(rec["times_ms"]))
        for key in ("cpu_ms", "main_cpu_ms"):
            if rec.get(key):
                rec[f"{key}_median"] = statistics.median(rec[key])
        out[job.key] = rec
    return out


def run_jobs(jobs: list[Job], rounds: int, steps: int, warmup: int, log: Log | None = None) -> dict[str, Any]:
    """Compile every job once, time them round-robin, profile and compare; stop them."""
    log = log or Log()
    try:
        start_jobs(jobs, warmup, log)
        time_round_robin(jobs, rounds, steps, log)
        profile_and_compare(jobs, log)
    finally:
        for job in jobs:
            job.stop()
    return records(jobs)
