"""The demo behind ``python -m ddp_fusion``: a small fused training demo on 2 CPU ranks (gloo).

Trains the same MLP three times under ``torch.compile`` (see MODES): with
``ddp_fusion.config.enabled`` off (the eager bucketed reducer), with compiled autograd
but no fusion (one all-reduce per gradient), and fused (one per bucket). Prints rank 0's
bucket plan, collectives per step and median step time for each. The collectives are
counted by c10d's flight recorder (``TORCH_FR_BUFFER_SIZE``, set for the ranks), which
sees every collective, eager or compiled, and prints nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import logging
import math
import os
import statistics
import tempfile
import time

import torch

import ddp_fusion
from ddp_fusion import _torch
from ddp_fusion.config import ALGORITHMS
from ddp_fusion.launch import run_ranks
from ddp_fusion.log import log


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _collectives(step) -> int:
    """All-reduces the process groups ran during ``step()``, as c10d's flight recorder
    saw them (every collective, eager or compiled, on any thread; prints nothing)."""
    seen: set = set()
    _torch.distributed.collectives_since(seen)
    step()
    return sum(name.endswith(":all_reduce") for name, _ in _torch.distributed.collectives_since(seen))


MODES = ("eager_reducer", "unfused", "fused")
"""eager_reducer: compiled forward/backward, ``enabled = False``, gradients through the
wrapper's eager bucketed reducer. unfused: compiled autograd, the pass removed, one
blocking all-reduce per gradient. fused: compiled autograd and the pass."""


@contextlib.contextmanager
def _without_pass():
    """The "unfused" mode: the pass out of Inductor, so the hooks' all-reduces run one by
    one, which is what this mode shows; the warning that says so is left out here."""
    def not_news(record: logging.LogRecord) -> bool:
        return "ran its gradient all-reduces unfused" not in record.getMessage()

    log.addFilter(not_news)
    try:
        with _torch.inductor.without_post_grad_pass():
            yield
    finally:
        log.removeFilter(not_news)


def _run(rank: int, world_size: int, args: argparse.Namespace, dump_dir: str) -> dict:
    results = {}
    for mode in MODES:
        enabled = mode != "eager_reducer"
        torch.compiler.reset()
        with ddp_fusion.config.patch(
            enabled=enabled, algorithm=args.algorithm, dump_dir=dump_dir if mode == "fused" else None
        ), _without_pass() if mode == "unfused" else contextlib.nullcontext():
            ddp = ddp_fusion.DistributedDataParallel(
                _model(args.width, args.depth), bucket_cap_mb=args.bucket_cap_mb
            )
            model = torch.compile(ddp)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            x = torch.randn(args.batch, args.width, device="cpu")  # the demo's gloo ranks run on the CPU

            def step(model=model, opt=opt, x=x) -> None:
                opt.zero_grad(set_to_none=False)
                model(x).square().mean().backward()
                opt.step()

            t0 = time.perf_counter()
            for _ in range(3):  # compiles: first step (no .grad yet) and the next
                step()
            compile_s = time.perf_counter() - t0
            times = []
            for _ in range(args.steps):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            results[mode] = {
                "step_ms": 1e3 * statistics.median(times),
                "spread_ms": 1e3 * (max(times) - min(times)),
                "collectives": _collectives(step),
                "compile_s": compile_s,
                "num_params": sum(1 for _ in ddp.parameters()),
            }
    return results


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line (``python -m ddp_fusion --help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m ddp_fusion",
        description="Train the same MLP on 2 gloo CPU ranks under torch.compile three ways "
        "(eager bucketed reducer, compiled autograd unfused, fused) and print rank 0's bucket "
        "plan, all-reduces per step, and step and compile times.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="concat",
                        help="how the fused mode reduces a bucket (ddp_fusion.config.algorithm)")
    parser.add_argument("--bucket-cap-mb", type=_positive_float, default=None,
                        help="bucket size in MB, as torch DDP's bucket_cap_mb (unset: DDP's default, 25)")
    parser.add_argument("--width", type=_positive_int, default=512,
                        help="features of each Linear layer of the MLP")
    parser.add_argument("--depth", type=_positive_int, default=8, help="Linear layers of the MLP")
    parser.add_argument("--batch", type=_positive_int, default=64, help="samples per rank and step")
    parser.add_argument("--steps", type=_positive_int, default=20,
                        help="timed steps per mode (after 3 compiling ones)")
    parser.add_argument("--dump-dir", default=None,
                        help="write the FX dumps and bucket plans here and keep them (unset: a temporary "
                        "directory, removed at the end)")
    return parser


@contextlib.contextmanager
def _flight_recorder():
    """Ranks spawned in the block record their collectives (``_collectives``)."""
    name = _torch.distributed.FLIGHT_RECORDER_ENV
    prior = os.environ.get(name)
    os.environ[name] = "4096"
    try:
        yield
    finally:
        if prior is None:
            del os.environ[name]
        else:
            os.environ[name] = prior


def main() -> None:
    args = build_parser().parse_args()

    print(f"ddp_fusion demo: {args.depth} x Linear({args.width}, {args.width}) on 2 gloo ranks, "
          f"torch {torch.__version__}; compiling (about a minute on 2 cores)...", flush=True)
    with contextlib.ExitStack() as stack:
        # without --dump-dir the ranks dump into a directory removed once the plan is read
        dump_dir = args.dump_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="ddp_fusion_dumps_")
        )
        with _flight_recorder():
            results = run_ranks(_run, world_size=2, args=(args, dump_dir), timeout=1200)[0]
        plans = sorted(glob.glob(os.path.join(dump_dir, "rank0_*.buckets.json")))
        with open(plans[-1]) as f:
            plan = json.load(f)

    print(f"\nbucket plan (rank 0, steady-state backward graph), algorithm={plan['algorithm']}:")
    for i, b in enumerate(plan["buckets"]):
        print(f"  bucket {i}: {b['num_grads']:3d} grads  {b['bytes'] / 2**20:8.3f} MiB  "
              f"{b['dtype']} group={b['group']}  [{', '.join(b['grads'])}]")
    for u in plan["unfused"]:
        print(f"  unfused: {u['grad']}: {u['reason']}")
    print(f"\n{'mode':<14}{'all-reduces/step':>18}{'step ms (median)':>18}{'spread ms':>11}{'compile s':>11}")
    for mode in MODES:
        r = results[mode]
        print(f"{mode:<14}{r['collectives']:>18}{r['step_ms']:>18.2f}{r['spread_ms']:>11.2f}{r['compile_s']:>11.1f}")
    # Step times on 2 shared CPU cores vary from run to run by more than fusion changes
    # them (a ratio of medians swung from 1.15x to 2.00x): the table shows each median
    # with its spread, and the closing line states what does not vary.
    print(f"\nfused issues {results['fused']['collectives']} all-reduces per step where unfused "
          f"issues {results['unfused']['collectives']} (both compiled autograd)"
          + (f"; dumps in {args.dump_dir}" if args.dump_dir else ""))


if __name__ == "__main__":
    main()
