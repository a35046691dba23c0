"""One training step, and the one worker that runs a (model, mode, cap) job in its ranks.

A step is ``zero_grad`` (``set_to_none`` as asked: torch's default is True), forward and
loss, backward, SGD step, each phase labelled for the profiler (``step::<phase>``).

The worker is a set of rank functions for :class:`ddp_fusion.launch.RankPool`: a job's
ranks stay alive between calls, holding the built (compiled) step in this module's
:data:`_job`, so a runner can compile every job once and time them round-robin:

    pool.run(step.start, model, mode, cap, device, set_to_none)   # build, enter the mode
    pool.run(step.warmup, n)       # n steps (compiles), seconds
    pool.run(step.time_steps, n)   # n timed steps: ms and host CPU ms each, recompiles
    pool.run(step.first_steps, n)  # the first n steps, each timed, compile phases (first_step)
    pool.run(step.measure)         # one profiled step: bytes, copies, memory, graph stats
    pool.run(step.trace, shapes)   # one profiled step as a time line (profiling.timeline)
    pool.run(step.op_profile, n, path)  # n steps: CPU per step of the main keys, top ops, trace
    pool.run(step.allocator)       # the CUDA caching allocator's counters (device malloc/free)
    pool.run(step.params)          # the parameters, flat

Each timed step starts after a ``dist.barrier()`` (on CUDA a synchronize, with another
after the step).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import profile, record_function

from bench._lib import _torch, models, profiling
from bench._lib.modes import COMM_FLOOR, Mode, all_modes
from ddp_fusion.plan import ddp_bucket_limits, split_by_rule


class TrainStep:
    """One training step of a (model, mode) job; ``model`` is None for ``comm_only``."""

    def __init__(self, model: nn.Module | None, opt: Any, batches: list, loss: Callable[..., Any],
                 set_to_none: bool) -> None:
        self.model, self.opt, self.batches, self.loss = model, opt, batches, loss
        self.set_to_none = set_to_none
        self.count = 0
        self.marks: list[tuple[str, float, dict[str, float]]] | None = None
        """When a list: gets ``(phase, time.perf_counter(), compile seconds)`` at the end
        of each step's forward, backward and optimizer step (:func:`first_steps`)."""

    def _mark(self, name: str) -> None:
        if self.marks is not None:
            self.marks.append((name, time.perf_counter(), _torch.compile_seconds()))

    def zero_grad(self) -> None:
        with record_function("step::zero_grad"):
            self.opt.zero_grad(set_to_none=self.set_to_none)

    def rest(self) -> None:
        """Everything after zero_grad."""
        x, y = self.batches[self.count % len(self.batches)]
        self.count += 1
        with record_function("step::forward"):
            loss = self.loss(x, y)
        self._mark("forward")
        with record_function("step::backward"):
            loss.backward()
        self._mark("backward")
        with record_function("step::optimizer"):
            self.opt.step()
        self._mark("optimizer")

    def __call__(self) -> None:
        self._mark("start")
        self.zero_grad()
        self.rest()


class CommOnlyStep(TrainStep):
    """The communication floor: the model's gradient bytes in DDP-bucket-sized
    all-reduces (DDP's rule over the parameters in reverse order, as DDP's first
    buckets), issued back to back, then waited for."""

    def __init__(self, sizes: list[int], group: Any, device: str) -> None:
        super().__init__(None, None, [], lambda x, y: None, True)
        self.buffers = [torch.randn(n, device=device) for n in sizes]
        self.group = group

    def zero_grad(self) -> None:
        pass

    def rest(self) -> None:
        with record_function("step::backward"):
            works = [dist.all_reduce(b, group=self.group, async_op=True) for b in self.buffers]
            for w in works:
                w.wait()


def bucket_numels(params: list[torch.Tensor], cap: float | None) -> list[int]:
    """Elements per DDP bucket of ``params`` (DDP's rule, parameters in reverse order)."""
    buckets = split_by_rule(reversed(params), lambda p: p.numel() * p.element_size(), ddp_bucket_limits(cap))
    return [sum(p.numel() for p in b) for b in buckets]


def build(model_name: str, mode: Mode, cap: float | None, batches: list, device: str = "cpu",
          set_to_none: bool = True) -> TrainStep:
    """The training step of ``mode``. DP x TP models are data-parallel over their DP
    group only."""
    dp, tp = models.dp_tp_groups(model_name)
    if mode.name == COMM_FLOOR:
        return CommOnlyStep(bucket_numels(models.parameters(model_name), cap), dp, device)
    spec = models.MODELS[model_name]
    model = mode.wrap(models.make_model(model_name, tp).to(device), cap, dp, **dict(spec.ddp_kwargs))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(_to(x, device), _to(y, device)) for x, y in batches]
    return TrainStep(model, opt, batches, models.loss_of(model_name, model), set_to_none)


def _to(x: Any, device: str) -> Any:
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x.to(device) if isinstance(x, torch.Tensor) else x


# --------------------------------------------------------------------------- the worker


class _Job:
    def __init__(self, step: TrainStep, device: str, lowered: profiling.LoweredGraphs,
                 stack: contextlib.ExitStack) -> None:
        self.step, self.device, self.lowered, self.stack = step, device, lowered, stack

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


_job: _Job | None = None
_lowered: profiling.LoweredGraphs | None = None


def start(rank: int, world_size: int, model_name: str, mode_name: str, cap: float | None,
          device: str = "cpu", set_to_none: bool = True, graph_caches: bool = False) -> str:
    """Build the job's step in this rank (the mode's settings stay on until :func:`stop`).
    ``graph_caches``: leave Inductor's FX graph cache and AOTAutograd's cache on (by
    default they are off, so every job lowers its own graphs)."""
    global _job, _lowered
    if _job is not None:
        raise RuntimeError("a job is already running in this rank")
    mode = all_modes()[mode_name]
    torch.compiler.reset()  # before entering the mode: it also turns compiled autograd off
    if _lowered is None:
        _lowered = profiling.LoweredGraphs()
    stack = contextlib.ExitStack()
    if not graph_caches:
        stack.enter_context(_torch.isolated_compile())
    stack.enter_context(mode.context())
    try:
        step = build(model_name, mode, cap, models.make_batches(model_name, rank, 4), device, set_to_none)
    except BaseException:
        stack.close()
        raise
    _job = _Job(step, device, _lowered, stack)
    return "ready"


def stop(rank: int, world_size: int) -> None:
    global _job
    if _job is not None:
        _job.stack.close()
        _job = None


def _current() -> _Job:
    if _job is None:
        raise RuntimeError("no job in this rank: call step.start first")
    return _job


def current_step() -> Callable[[], None]:
    """The training step of this rank's job (for rank functions of other modules)."""
    return _current().step


def warmup(rank: int, world_size: int, n: int) -> float:
    """``n`` steps between barriers (the compiles); seconds."""
    job = _current()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        job.step()
    job.sync()
    dist.barrier()
    return time.perf_counter() - t0


def _compile_counts() -> dict[str, int]:
    c = _torch.counters()
    return {"dynamo_graphs": int(c["stats"]["unique_graphs"]),
            "ca_captures": int(c["compiled_autograd"]["captures"])}


def _barrier_timed(job: _Job, n: int, cpu: list[tuple[float, float]] | None = None) -> list[float]:
    """``n`` steps, each started after a barrier; seconds each. ``cpu``: gets each step's
    CPU seconds (every thread of this process, its main thread alone), from its start to
    the return of the step's call: before the closing device synchronize, which on a GPU
    may spin while the device finishes."""
    times = []
    for _ in range(n):
        dist.barrier()
        job.sync()
        t0 = time.perf_counter()
        c0, m0 = time.process_time(), time.thread_time()
        job.step()
        if cpu is not None:
            cpu.append((time.process_time() - c0, time.thread_time() - m0))
        job.sync()
        times.append(time.perf_counter() - t0)
    return times


def first_steps(rank: int, world_size: int, n: int) -> dict[str, Any]:
    """The job's first ``n`` steps, each timed alone between barriers (the first
    compiles), with where the time went: torch's compile phases (seconds, from
    ``dynamo_timed``) in each step's forward and backward, and ddp_fusion's own parts
    (learning eager autograd's ready order, the pass)."""
    import ddp_fusion._install as install
    import ddp_fusion.grad_sync as grad_sync

    job = _current()
    spent = {"ddp_fusion ready order": 0.0, "ddp_fusion pass": 0.0}

    def timed(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t0
        return run

    saved = grad_sync.ready_order.learn, install.fuse_ddp_allreduces
    grad_sync.ready_order.learn = timed(saved[0], "ddp_fusion ready order")
    install.fuse_ddp_allreduces = timed(saved[1], "ddp_fusion pass")
    marks = job.step.marks = [] if isinstance(job.step, TrainStep) else None
    before = _torch.compile_seconds()
    try:
        times = _barrier_timed(job, n)
    finally:
        grad_sync.ready_order.learn, install.fuse_ddp_allreduces = saved
        if marks is not None:
            job.step.marks = None
    after = _torch.compile_seconds()
    return {"times_s": times, "compile_phases_s": _phase_delta(before, after),
            "steps": _step_windows(marks or []), **spent}


def _phase_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0) > 1e-3}


def _step_windows(marks: list[tuple[str, float, dict[str, float]]]) -> list[dict[str, Any]]:
    """Per step: the seconds of its forward (from the step's start: zero_grad and
    forward), backward and optimizer step, and the compile phases in each."""
    steps: list[dict[str, Any]] = []
    for prev, (name, t, seconds) in zip(marks, marks[1:]):
        if name == "forward":
            steps.append({})
        if name != "start" and steps:
            steps[-1][f"{name}_s"] = t - prev[1]
            steps[-1][f"{name}_phases_s"] = _phase_delta(prev[2], seconds)
    return steps


def time_steps(rank: int, world_size: int, n: int) -> dict[str, Any]:
    """``n`` steps, each after a barrier: ``times_ms``, the host CPU time of each
    (``cpu_ms``: every thread of the process; ``main_cpu_ms``: the main thread), and the
    compiles during them."""
    job = _current()
    before = _compile_counts()
    cpu: list[tuple[float, float]] = []
    times = [1e3 * t for t in _barrier_timed(job, n, cpu)]
    after = _compile_counts()
    return {"times_ms": times, "cpu_ms": [1e3 * c for c, _ in cpu],
            "main_cpu_ms": [1e3 * m for _, m in cpu],
            "recompiles": {k: after[k] - before[k] for k in after}}


def measure(rank: int, world_size: int) -> dict[str, Any]:
    """One profiled step (:func:`profiling.measure_step`), the stats of the last lowered
    graph with collectives, and the Dynamo counters."""
    job = _current()
    dist.barrier()
    value = profiling.measure_step(job.step, job.device)
    value["graph"] = job.lowered.last_with_collectives()
    c = _torch.counters()
    value["counters"] = {k: dict(c[k]) for k in ("ddp_fusion", "compiled_autograd", "stats")}
    return value


def trace(rank: int, world_size: int, shapes: bool = False) -> dict[str, Any]:
    """One profiled step as a time line (:func:`profiling.timeline`); ``shapes``:
    record input shapes (gives each collective's bytes, costs microseconds per op)."""
    job = _current()
    dist.barrier()
    with profile(record_shapes=shapes) as prof:
        dist.barrier()
        with record_function(profiling.STEP):
            job.step()
        job.sync()
    return profiling.timeline(prof)


_OP_KEYS = ("gloo:", "ddp_fusion::", "Torch-Compiled Region", "CompiledFunction", "Optimizer.step")


def op_profile(rank: int, world_size: int, n: int, path: str | None = None, top: int = 20) -> dict[str, Any]:
    """``n`` profiled steps, each after a barrier (with CUDA activity on a GPU): CPU ms per
    step of the profiler keys that say where a step goes (compiled regions, ddp_fusion's
    ops, collectives, the optimizer), the ``top`` ops by self CPU time, ms per step, and
    rank 0's Chrome trace written to ``path``."""
    job = _current()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if job.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    dist.barrier()
    with profile(activities=activities) as prof:
        for _ in range(n):
            dist.barrier()
            job.sync()
            with record_function(profiling.STEP):
                job.step()
            job.sync()
    if path and rank == 0:
        prof.export_chrome_trace(path)
    averages = prof.key_averages()
    events = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)
    # the per-step barrier above is this harness's, not the step's
    return {"cpu_ms": {e.key: round(e.cpu_time_total / n / 1e3, 3)
                       for e in averages if e.key.startswith(_OP_KEYS) and e.key != "gloo:barrier"},
            "self_cpu_ms": {e.key: round(e.self_cpu_time_total / n / 1e3, 3) for e in events[:top]},
            "calls": {e.key: e.count / n for e in events[:top]}}


_ALLOCATOR_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams",
                   "allocation.all.allocated", "segment.all.allocated")


def allocator(rank: int, world_size: int) -> dict[str, int]:
    """The CUDA caching allocator's running counts (device mallocs and frees, retries,
    allocations served); empty on CPU."""
    if _current().device != "cuda":
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in _ALLOCATOR_KEYS}


def params(rank: int, world_size: int) -> Any:
    """The model's parameters, flat, as a numpy array (None for comm_only)."""
    model = _current().step.model
    if model is None:
        return None
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy().copy()
