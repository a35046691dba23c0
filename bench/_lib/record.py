"""Where results go and what they record: the machine and the code measured.

* :data:`OUT_DIR` (``bench/out/``, git-ignored) for raw JSON and pictures;
* :func:`provenance`: torch and Python versions, CPU model, cores, memory, GPU, load
  average, date, the command line, and the git commit of this checkout (with whether
  ``ddp_fusion/`` had uncommitted changes): what a results file must state;
* :func:`nbytes`: bytes of tensors from the profiler's shapes and dtype names;
* :func:`spread`: median and percentiles of a list of step times.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(BENCH_DIR, "out")
RESULTS_DIR = os.path.join(BENCH_DIR, "results")


def out_path(name: str) -> str:
    """``bench/out/<name>``, the directory created."""
    os.makedirs(OUT_DIR, exist_ok=True)
    return os.path.join(OUT_DIR, name)


def write_json(name: str, obj: Any) -> str:
    """``obj`` as JSON in ``bench/out/<name>``; returns the path."""
    path = name if os.path.isabs(name) else out_path(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    return path


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
        return round(kb / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        return None


def machine() -> str:
    """One line: CPU model, cores, memory, GPU."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu_model()}, {os.cpu_count()} CPUs, {memory_gb()} GiB, {gpu}"


def git_state() -> dict[str, Any]:
    """The checkout's commit, and whether ``ddp_fusion/`` or ``bench/`` had uncommitted changes."""
    repo = os.path.dirname(BENCH_DIR)

    def git(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", repo, *cmd], capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return {}
    return {"git_head": head.stdout.strip(),
            "uncommitted": {d: bool(git("status", "--porcelain", "--", d).stdout.strip())
                            for d in ("ddp_fusion", "bench")}}


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """What a results file states about the run: versions, machine, code, command, date."""
    args = sys.argv[1:] if argv is None else argv
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "?"
    module = f"bench.{os.path.splitext(prog)[0]}" if prog.endswith(".py") else prog
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": memory_gb(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": shlex.join(["python", "-m", module, *args]),
        **git_state(),
    }


# Profiler dtype names -> bytes per element
ITEMSIZE = {"float": 4, "c10::Half": 2, "c10::BFloat16": 2, "double": 8, "long int": 8,
            "int": 4, "bool": 1}


def event_dtypes(event: Any) -> list | None:
    """A profiler event's input dtype names, or None where this torch's
    ``FunctionEvent`` has none (2.11)."""
    return getattr(event, "input_dtypes", None)


def nbytes(shapes: list, dtypes: list | None) -> float:
    """Bytes of the tensors a profiler event lists (shapes and dtype names); inputs
    without a shape or of another kind count 0. NaN where the profiler gives no dtypes
    (torch 2.11's ``FunctionEvent`` has no ``input_dtypes``): unknown, not guessed."""
    if dtypes is None:
        return math.nan
    return sum(math.prod(shape) * ITEMSIZE[dtype]
               for shape, dtype in zip(shapes, dtypes) if shape and dtype in ITEMSIZE)


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, linearly interpolated."""
    xs = sorted(xs)
    k = q * (len(xs) - 1)
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def spread(xs: list[float]) -> dict[str, float]:
    """Median, p10, p90, min and max of step times (ms)."""
    return {"median_ms": statistics.median(xs), "p10_ms": percentile(xs, 0.1),
            "p90_ms": percentile(xs, 0.9), "min_ms": min(xs), "max_ms": max(xs)}
