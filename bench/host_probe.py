"""Is this host's CPU speed steady? A fixed amount of work, timed again and again for a
while: pure Python, small CPU-tensor ops, and (where CUDA is) 500 kernel launches and a
synchronize. Each row's time says how fast the core ran it; runs of slow rows with
nothing else running mean the machine itself changes speed (a busy hyperthread sibling
or neighbour on the host, frequency), which moves every host-bound step with it.

    python -m bench.host_probe --seconds 40
    taskset -c 5 python -m bench.host_probe --seconds 20     # pinned to one core

Prints each kind's spread, the steal ticks from /proc/stat and the cores it ran on, and
every 5th row's time in order (runs show there).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _python() -> int:
    s = 0
    for i in range(150_000):
        s += i * i
    return s


def _cpu_ops(x: torch.Tensor) -> None:
    for _ in range(1500):
        x.add_(1)


def _launches(y: torch.Tensor) -> None:
    for _ in range(500):
        y.add_(1)
    torch.cuda.synchronize()


def _core() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])  # field 39, "processor"


def _steal() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.host_probe", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    args = parser.parse_args(argv)
    x = torch.zeros(8)
    kinds = {"python ms": _python, "cpu ops ms": lambda: _cpu_ops(x)}
    if torch.cuda.is_available():
        y = torch.zeros(8, device="cuda")
        _launches(y)
        kinds["500 launches ms"] = lambda: _launches(y)
    rows, steal, cores = [], 0, set()
    end = time.time() + args.seconds
    while time.time() < end:
        s0 = _steal()
        row = []
        for fn in kinds.values():
            t = time.perf_counter()
            fn()
            row.append(1e3 * (time.perf_counter() - t))
        rows.append(row)
        steal += _steal() - s0
        cores.add(_core())
    for k, name in enumerate(kinds):
        v = [r[k] for r in rows]
        q = statistics.quantiles(v, n=10)
        print(f"{name}: n {len(v)} min {min(v):.2f} p10 {q[0]:.2f} median {statistics.median(v):.2f} "
              f"p90 {q[-1]:.2f} max {max(v):.2f}")
    print(f"steal ticks {steal}, cores {sorted(cores)}")
    for k, name in enumerate(kinds):
        print(f"{name} in order (every 5th): " + " ".join(f"{r[k]:.1f}" for r in rows[::5]))


if __name__ == "__main__":
    main()
