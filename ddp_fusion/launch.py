"""Run a function on N local ranks (gloo on CPU, or NCCL): for the demo, benchmarks and tests.

    results = run_ranks(fn, world_size=2, args=(...,))   # fn(rank, world_size, *args)

Each rank is a fresh ``spawn``-ed process with a gloo process group initialized from a
temporary file store; ``fn``'s return value (picklable) comes back in rank order. A rank
that raises makes ``run_ranks`` raise with that rank's traceback; ranks still running
after ``timeout`` seconds are killed and reported, so a hang fails instead of stalling.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank, world_size, init_file, threads, fn, args, results, pg_timeout, backend):
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
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))


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
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"run_ranks: backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(
            f"run_ranks: backend='nccl' with world_size={world_size} needs {world_size} GPUs; "
            f"this machine has {torch.cuda.device_count()}"
        )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world_size, init_file, threads, fn, args, results, pg_timeout, backend),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout
        try:
            while len(out) < world_size and not errors:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [
                        r for r, p in enumerate(procs)
                        if r not in out and p.exitcode is not None
                    ]
                    if dead:
                        # Give a rank that just exited a moment to deliver its report.
                        time.sleep(1.0)
                        if results.empty():
                            errors.append(
                                f"ranks {dead} exited (codes "
                                f"{[procs[r].exitcode for r in dead]}) without a result"
                            )
                    elif time.monotonic() > deadline:
                        missing = sorted(set(range(world_size)) - set(out))
                        errors.append(f"ranks {missing} did not finish within {timeout:.0f} s")
                    continue
                if ok:
                    out[rank] = value
                else:
                    errors.append(f"rank {rank} failed:\n{value}")
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            raise RuntimeError("run_ranks: " + "\n".join(errors))
    return [out[r] for r in range(world_size)]
