"""Rank functions of the small one-question commands.

* :func:`plan_check_calls`, :func:`plan_check_step` (``bench.plan_check``): the per-step
  cross-rank plan check (``plan_check_start`` + ``plan_guard``) back to back, next to its
  bare exchange on the host group and to the all-gather of one int64 per rank the check
  used before; the demo MLP's fused step (or a bench job's: :func:`plan_check_job_step`)
  with and without it;
* :func:`powersgd_trial` (``bench.hook_order``): PowerSGD on several buckets, eager torch
  DDP or ddp_fusion.
"""

from __future__ import annotations

import contextlib
import ctypes
import statistics
import time
import unittest.mock
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import ddp_fusion
from ddp_fusion import host_group, plan_check
from ddp_fusion.plan import BucketPlan, PlannedBucket


def _time(fn: Callable[[], object], calls: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def plan_check_calls(rank: int, world_size: int, calls: int, rounds: int) -> dict[str, list[float]]:
    """Microseconds per call, per round: a bare all-gather of one int64 per rank (the
    check's collective before), the host group's max of two int64 (the check's exchange
    now), and ``plan_check_start`` + ``plan_guard`` of a one-bucket plan."""
    group = dist.group.WORLD
    name = group.group_name
    bucket = PlannedBucket(name, torch.float32, "cpu", "avg", "concat", ("w",), (1024,))
    text = BucketPlan("concat", (bucket,)).to_json()
    h = plan_check.plan_hash(text)
    cpu = torch.device("cpu")
    one = torch.zeros(1, dtype=torch.int64, device="cpu")
    everyone = torch.zeros(world_size, dtype=torch.int64, device="cpu")
    host = host_group.of(group)
    modes = {
        "all_gather of 1 int64 per rank (before)": lambda: dist.all_gather_into_tensor(everyone, one),
        "host group max of 2 int64 (the exchange now)": lambda: host.max([rank, -rank]),
        "plan_check_start + plan_guard, back to back": lambda: plan_check.PLAN_GUARD(
            plan_check.PLAN_CHECK_START(name, text, h, cpu, "avg"), name, h, "avg", cpu),
        "max started, GIL held 2 ms, collected": lambda: _busy_then_collect(host, rank, 0.002),
    }
    for fn in modes.values():  # warm up
        _time(fn, 50)
    out: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(rounds):
        for m, fn in modes.items():
            out[m].append(_time(fn, calls))
    return out


def _busy_then_collect(host: host_group.HostGroup, rank: int, busy_s: float) -> None:
    """Start the host group's max, hold the GIL for ``busy_s`` (libc's ``usleep`` through
    ``ctypes.PyDLL``, which keeps the GIL: a main thread launching backward holds it so,
    without the CPU that spinning would take from the other ranks on a small host), then
    collect it: whatever of the exchange needs this process's GIL waits for the collect."""
    exchange = host.max_async([rank, -rank])
    _LIBC.usleep(int(busy_s * 1e6))
    exchange.result()


_LIBC = ctypes.PyDLL(None)  # (PyDLL: its calls keep the GIL)


def _demo_mlp(width: int = 512, depth: int = 8) -> nn.Module:
    """The demo's model (``python -m ddp_fusion``): ``depth`` x (Linear + GELU)."""
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())))


def plan_check_step(rank: int, world_size: int, rounds: int, steps: int) -> dict[str, list[float]]:
    """Median step ms per round of the demo MLP, fused and compiled, with the plan check
    and with its work skipped (:func:`_check_or_not`)."""
    with ddp_fusion.config.patch(enabled=True):
        model = torch.compile(ddp_fusion.DistributedDataParallel(_demo_mlp()))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(64, 512, device="cpu")

        def step() -> None:
            opt.zero_grad(set_to_none=False)
            model(x).square().mean().backward()
            opt.step()

        for _ in range(3):  # compiles
            step()
        return _check_or_not(step, rounds, steps)


def plan_check_job_step(rank: int, world_size: int, rounds: int, steps: int) -> dict[str, list[float]]:
    """:func:`plan_check_step` on the step of the rank's bench job (a ``bench.step_time``
    model and mode, already warmed up: bench/_lib/step.py)."""
    from bench._lib import step

    return _check_or_not(step.current_step(), rounds, steps)


def time_steps_python_check(rank: int, world_size: int, n: int) -> dict[str, object]:
    """bench/_lib/step.py's ``time_steps`` on the rank's job, with the plan check in
    Python (``config.native_check`` off: its first step marks the plans steady again
    after it)."""
    from bench._lib import step

    with ddp_fusion.config.patch(native_check=False):
        return step.time_steps(rank, world_size, n)


def _check_or_not(step: Callable[[], None], rounds: int, steps: int) -> dict[str, list[float]]:
    """Median ms per round of ``step`` (compiled, fused) in these modes, in turn per
    round on the same compiled model:

    * ``C++ check``: as it ships (``config.native_check``: a steady step's check runs in
      the C++ kernels; the first step of each round's block runs the Python ops, which
      mark the plan steady again); only where the C++ part is built;
    * ``Python check``: the Python ops on every step (``native_check`` off);
    * ``check's work skipped``: the plan ops still entered (Python), but each only
      returns its divisor (no exchange, no bookkeeping; :func:`_plan_ops_skipped`): the
      difference to ``Python check`` is what the Python check's own work costs a step;
    * ``Python check, ops timed``: each plan op's main-thread CPU (``time.thread_time``
      around its body), per step: the ops' whole price on this rank's host, entry and
      the cold caches they meet included, but not the dispatcher's part of the call.

    With the Python check, also per round: the share of steps whose exchange had
    finished when the guard came to collect it (the main thread busy in backward
    meanwhile), and the median and mean time the guard spent collecting it (us: a mean
    far above the median is the steps whose guard waited for a late peer)."""
    collected: list[tuple[bool, float]] = []
    outcome = plan_check.outcome
    op_cpu: dict[str, float] = {}

    def timed_outcome(exchange, group_name):
        done, t0 = exchange.done(), time.perf_counter()
        result = outcome(exchange, group_name)
        collected.append((done, (time.perf_counter() - t0) * 1e6))
        return result

    def python(patch: contextlib.AbstractContextManager) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(ddp_fusion.config.patch(native_check=False))
        stack.enter_context(patch)
        return stack

    native = ddp_fusion.config.native_check and host_group.native() is not None
    modes = (*(("C++ check",) if native else ()), "Python check", "check's work skipped",
             "Python check, ops timed")
    out: dict[str, list[float]] = {m: [] for m in modes}
    out |= {"plan ops' CPU per step, median us": [], "exchange done at the guard, %": [],
            "guard collecting, median us": [], "guard collecting, mean us": []}
    if native:  # (the C++ kernels time themselves: wall time inside them, per steady step)
        out |= {"C++ start, mean us": [], "C++ guard less its wait, mean us": [],
                "C++ guard's wait for the peer, mean us": []}
    op_steps: list[float] = []
    for i in range(rounds):
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            if mode == "C++ check":
                patch = contextlib.nullcontext()
            elif mode == "Python check":
                patch = python(unittest.mock.patch.object(plan_check, "outcome", timed_outcome))
            elif mode == "check's work skipped":
                patch = _plan_ops_skipped()
            else:
                patch = python(_plan_ops_timed(op_cpu))
            collected.clear()
            op_steps.clear()
            before = _cpp_times() if native else None
            with patch:
                times = []
                for _ in range(steps):
                    op_cpu.clear()
                    dist.barrier()
                    t0 = time.perf_counter()
                    step()
                    times.append((time.perf_counter() - t0) * 1e3)
                    op_steps.append(sum(op_cpu.values()))
            out[mode].append(statistics.median(times))
            if mode == "Python check":
                done = sum(d for d, _ in collected)
                out["exchange done at the guard, %"].append(100 * done / len(collected))
                out["guard collecting, median us"].append(statistics.median(w for _, w in collected))
                out["guard collecting, mean us"].append(statistics.fmean(w for _, w in collected))
            elif mode == "Python check, ops timed":
                out["plan ops' CPU per step, median us"].append(statistics.median(op_steps) * 1e6)
            elif mode == "C++ check":
                starts, guards, start_ns, guard_ns, wait_ns = (b - a for a, b in zip(before, _cpp_times()))
                out["C++ start, mean us"].append(start_ns / max(starts, 1) / 1e3)
                out["C++ guard less its wait, mean us"].append((guard_ns - wait_ns) / max(guards, 1) / 1e3)
                out["C++ guard's wait for the peer, mean us"].append(wait_ns / max(guards, 1) / 1e3)
    return out


def _cpp_times() -> tuple[int, ...]:
    """The C++ kernels' steady starts and guards so far, and their nanoseconds: in the
    starts, in the guards, in the guards' waits for the peer."""
    native = host_group.native_loaded()
    return (*native.counts(), *native.times_ns())


_PLAN_OPS = ("plan_check_start", "plan_guard", "plan_divisor")


@contextlib.contextmanager
def _plan_ops(impls: dict[str, Callable[..., torch.Tensor]]):
    """The plan ops' CPU kernels replaced by ``impls`` for the block: registered on a
    library of the block's own, which the dispatcher calls before the shipped ones;
    dropping it at the end drops exactly those registrations."""
    lib = torch.library.Library("ddp_fusion", "FRAGMENT")
    with warnings.catch_warnings():  # (that it overrides a kernel: that is the point)
        warnings.simplefilter("ignore", UserWarning)
        for name, fn in impls.items():
            lib.impl(name, fn, "CompositeExplicitAutograd", allow_override=True)  # (2.11 refuses without)
    try:
        yield
    finally:
        del lib  # (its finalizer takes the registrations back)


def _plan_ops_skipped():
    """The plan ops entered as in a step, each returning only its divisor (what
    ``plan_divisor`` gives): no exchange is posted or collected."""
    def start(group_name, plan, plan_hash, device, reduce_op="avg"):
        return plan_check.plan_divisor(group_name, reduce_op, device)

    def guard(token, group_name, plan_hash, reduce_op, device):
        return plan_check.plan_divisor(group_name, reduce_op, device)

    return _plan_ops({"plan_check_start": start, "plan_guard": guard,
                      "plan_divisor": plan_check.plan_divisor})


def _plan_ops_timed(acc: dict[str, float]):
    """The shipped plan ops, each one's main-thread CPU added to ``acc[name]``."""
    def timed(name: str) -> Callable[..., torch.Tensor]:
        fn = getattr(plan_check, name)

        def op(*args):
            c0 = time.thread_time()
            try:
                return fn(*args)
            finally:
                acc[name] = acc.get(name, 0.0) + time.thread_time() - c0
        return op

    return _plan_ops({name: timed(name) for name in _PLAN_OPS})


def powersgd_trial(rank: int, world_size: int, mode: str, steps: int) -> int:
    """``steps`` SGD steps of a 3-layer MLP (3 buckets of 1 MiB at ``bucket_cap_mb=0.25``)
    with ``powerSGD_hook`` (rank 1, compression from step 2); ``mode``: ``eager_ddp``,
    ``ddp_fusion_uncompiled`` or ``ddp_fusion_compiled``."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    torch.manual_seed(0)
    width = 512
    net = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                        nn.Linear(width, width))
    state = psgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    with ddp_fusion.config.patch(enabled=mode == "ddp_fusion_compiled"):
        if mode == "eager_ddp":
            model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.25)
        else:
            model = ddp_fusion.DistributedDataParallel(net, bucket_cap_mb=0.25)
        model.register_comm_hook(state, psgd.powerSGD_hook)
        run = torch.compile(model) if mode == "ddp_fusion_compiled" else model
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            opt.zero_grad()
            run(torch.randn(16, width, generator=gen)).square().mean().backward()
            opt.step()
    return steps
