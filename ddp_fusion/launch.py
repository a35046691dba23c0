"""Run functions on N local ranks (gloo on CPU, or NCCL): for the demo, benchmarks and tests.

    results = run_ranks(fn, world_size=2, args=(...,))   # fn(rank, world_size, *args)

    with RankPool(world_size=2) as pool:                  # ranks kept alive between calls
        pool.run(build, "mlp")                            # build(rank, world_size, "mlp")
        times = pool.run(time_steps, 20)                  # state kept in the rank processes

Each rank is a fresh ``spawn``-ed process with a process group initialized from a
temporary file store; ``fn``'s return value (picklable) comes back in rank order. A rank
that raises makes the call raise with that rank's traceback and those of the ranks that
fail within ``ERROR_GRACE_S`` of it (the others are named as still running, then
killed); ranks still running after ``timeout`` seconds are killed and reported, so a
hang fails instead of stalling.

``run_ranks`` is the one-shot form of :class:`RankPool`: it spawns the ranks with ``fn``,
and each rank leaves (destroying its process group) as soon as ``fn`` returns, so a peer
that returns early is gone, as in a job whose rank exits. A pool keeps its ranks, their
process group and whatever ``fn`` left in their module globals (a compiled model) until
it is closed; after a failed call it is closed (a rank may be stuck in a collective).

``fn`` is pickled by module name and imported again in each rank, so it must live in a
module the rank can import under that name (not ``__main__``, not a test file).
"""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_STOP = None  # on a rank's command queue: destroy the process group and exit
ERROR_GRACE_S = 2.0  # after a rank fails, how long the others may still report (theirs, together)


def _rank_main(rank, world_size, init_file, threads, first, commands, results, pg_timeout, backend):
    """One rank: init the process group, run ``first`` (if given; then exit) or the
    commands from ``commands`` until ``_STOP``. Each result goes to ``results`` as
    ``(rank, call number, ok, value or traceback)``; a rank exits after a failure."""
    try:
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, 0, False, traceback.format_exc()))
        return
    try:
        call = 0
        while True:
            command = first if first is not None else commands.get()
            if command is _STOP:
                break
            fn, args = pickle.loads(command) if isinstance(command, bytes) else command
            try:
                value = fn(rank, world_size, *args)
            except BaseException:  # noqa: BLE001 - report everything to the parent
                results.put((rank, call, False, traceback.format_exc()))
                break
            results.put((rank, call, True, value))
            if first is not None:
                break
            call += 1
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world_size`` rank processes kept alive between calls of :meth:`run`.

    Args:
        world_size: ranks (processes).
        timeout: default seconds a :meth:`run` may take (from the call; the first call
            includes the ranks' start-up).
        threads_per_rank: ``torch.set_num_threads`` in each rank (default: the CPUs
            divided among the ranks).
        pg_timeout: the process group's timeout, seconds.
        backend: ``"gloo"``, or ``"nccl"`` (rank ``r`` on ``cuda:r``; needs
            ``world_size`` GPUs).

    Use as a context manager (or call :meth:`close`); the ranks start on ``__enter__``.
    """

    def __init__(
        self,
        world_size: int = 2,
        timeout: float = 600.0,
        threads_per_rank: int | None = None,
        pg_timeout: float = 120.0,
        backend: str = "gloo",
        _first: tuple[Callable[..., Any], tuple[Any, ...]] | None = None,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"run_ranks: backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            raise RuntimeError(
                f"run_ranks: backend='nccl' with world_size={world_size} needs {world_size} GPUs; "
                f"this machine has {torch.cuda.device_count()}"
            )
        self.world_size = world_size
        self.timeout = timeout
        self._threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self._pg_timeout = pg_timeout
        self._backend = backend
        self._first = _first
        self._procs: list[Any] = []
        self._commands: list[Any] = []
        self._results: Any = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._calls = 0
        self.failed: str | None = None  # why the pool was closed after a failed call

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(kill=exc[0] is not None)

    def start(self) -> None:
        """Spawn the ranks (they initialise their process group in the background)."""
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tmp = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._tmp.name, "store")
        self._commands = [None if self._first else ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, self.world_size, init_file, self._threads, self._first, self._commands[r],
                      self._results, self._pg_timeout, self._backend),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """``[fn(rank, world_size, *args) for rank in range(world_size)]``, on the pool's ranks.

        Raises ``RuntimeError`` naming the failed ranks with their tracebacks, the ranks that
        exited without a result, or the ranks that did not finish within ``timeout``
        seconds (default: the pool's); the pool is closed then.
        """
        if self.failed is not None:
            raise RuntimeError(f"run_ranks: the pool was closed after a failed call: {self.failed}")
        if self._first is None:
            # Pickled here, not in the queue's feeder thread, so that an unpicklable
            # argument raises in the caller instead of leaving the ranks waiting.
            command = bytes(ForkingPickler.dumps((fn, args)))
            for q in self._commands:
                q.put(command)
        return self._collect(self.timeout if timeout is None else timeout)

    def _collect(self, timeout: float) -> list[Any]:
        call = self._calls
        self._calls += 1
        out: dict[int, Any] = {}
        failed: dict[int, str] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout
        grace = None  # after the first failure: until when the other ranks may report theirs
        while len(out) + len(failed) < self.world_size and not (grace and time.monotonic() > grace):
            try:
                rank, number, ok, value = self._results.get(timeout=0.2 if grace else 1.0)
            except queue.Empty:
                if grace:
                    continue
                dead = [r for r, p in enumerate(self._procs) if r not in out and p.exitcode is not None]
                if dead:
                    # Give a rank that just exited a moment to deliver its report.
                    time.sleep(1.0)
                    if self._results.empty():
                        errors.append(
                            f"ranks {dead} exited (codes "
                            f"{[self._procs[r].exitcode for r in dead]}) without a result"
                        )
                        break
                elif time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(out))
                    errors.append(f"ranks {missing} did not finish within {timeout:.0f} s")
                    break
                continue
            if not ok:
                failed[rank] = value
                grace = grace or time.monotonic() + ERROR_GRACE_S
            elif number == call:
                out[rank] = value
        for rank in sorted(failed):
            errors.append(f"rank {rank} failed:\n{failed[rank]}")
        if failed:
            silent = sorted(set(range(self.world_size)) - set(out) - set(failed))
            exited = [r for r in silent if self._procs[r].exitcode is not None]
            running = [r for r in silent if r not in exited]
            if exited:
                errors.append(f"ranks {exited} exited without a result")
            if running:
                errors.append(f"ranks {running} were still running {ERROR_GRACE_S:g} s "
                              "after the first failure")
        if errors:
            self.failed = errors[0].splitlines()[0]
            self.close(kill=True)
            raise RuntimeError("run_ranks: " + "\n".join(errors))
        return [out[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        """Stop the ranks (``kill``: at once, as after a failure) and remove the store."""
        if not kill and self.failed is None:
            for q in self._commands:
                if q is not None:
                    q.put(_STOP)
        for p in self._procs:
            p.join(timeout=0.1 if kill or self.failed else 5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    timeout: float = 600.0,
    threads_per_rank: int | None = None,
    pg_timeout: float = 120.0,
    backend: str = "gloo",
) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, one process each.

    ``backend="nccl"`` puts rank ``r`` on ``cuda:r``; it needs ``world_size`` GPUs."""
    pool = RankPool(world_size, timeout, threads_per_rank, pg_timeout, backend, _first=(fn, tuple(args)))
    with pool:
        return pool._collect(timeout)
