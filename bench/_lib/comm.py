"""Timing plain all-reduces on the ranks, and the alpha-beta fit to them.

Rank functions (for ``run_ranks`` / ``RankPool``): :func:`calibration` (blocking
``dist.all_reduce`` of fp32 tensors over a range of sizes, for ``bench.cost_model``) and
:func:`dtype_times` (the same element count in fp32, fp16 and bf16, for
``bench.gloo_dtype``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist


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


def calibration(rank: int, world_size: int, sizes: Sequence[int], reps: Sequence[int]) -> list[list[float]]:
    """Per size (bytes of fp32), ``reps`` timings (ms) of one blocking ``dist.all_reduce``."""
    return [all_reduce_times(torch.ones(nbytes // 4), n) for nbytes, n in zip(sizes, reps)]


def dtype_times(rank: int, world_size: int, numels: Sequence[int], dtypes: Sequence[torch.dtype],
                reps: int) -> dict[tuple[int, str], float]:
    """Median ms of one all-reduce per (element count, dtype)."""
    return {(numel, str(dtype)): statistics.median(
                all_reduce_times(torch.ones(numel, dtype=dtype), reps, warmup=5))
            for numel in numels for dtype in dtypes}


def fit_alpha_beta(nbytes: Sequence[int], t_ms: Sequence[float]) -> tuple[float, float]:
    """``(alpha_ms, beta_ms_per_byte)`` minimizing sum(((alpha + beta n - t) / t)^2):
    least squares on relative error, so every size counts alike (plain least squares
    would let the largest size decide alpha)."""
    import numpy as np

    n = np.asarray(nbytes, dtype=float)
    t = np.asarray(t_ms, dtype=float)
    a = np.stack([1 / t, n / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return float(alpha), float(beta)
