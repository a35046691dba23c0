"""The fused backward's generated code, called alone: this checkout's against another's.

The pass decides what Inductor's code for the backward does per gradient (buffers
allocated and freed, slices of a bucket aliased, views returned). At two ranks a step's
noise on this VM hides a difference of a few percent; this times that code alone.

Each checkout (this one, and ``--baseline PATH``) compiles the model's backward in a
process of its own: world size 2 on a fake process group, ``torch.nn.parallel``'s DDP
with the flag, torch's default caps, three steps with ``.grad`` set to none (or kept,
``--zero-grad zeros``). It saves Inductor's module for the backward graph of the last
step. One process, pinned to one core with one thread, then loads both modules and calls
each one's ``call`` on the inputs its ``get_args()`` makes, the two taking turns round by
round. The ops inside are this checkout's ddp_fusion ops (the checkouts must agree on
their schemas); the fake group's collectives return at once, so what is timed is the
host code and the kernels. The modules' statements are counted by kind.

    git worktree add /tmp/base HEAD~1
    python -m bench.backward_call --model mlp_params --baseline /tmp/base

Writes a table to stdout and ``bench/out/backward_call.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

from bench._lib.record import provenance, write_json
from bench.host_cost import _kind

MODELS = ("mlp_params", "mlp_host", "mlp")
KINDS = ("empty_strided", "del", "alias of a bucket slice", "views returned", "generated kernel",
         "extern kernel (mm, ...)")


def compile_backward(model_name: str, zero_grad: str, out: str) -> None:
    """Child process: compile ``model_name``'s backward under the flag; write the
    backward's Inductor module to ``out``."""
    import torch
    import torch.distributed as dist

    import ddp_fusion
    from bench._lib import _torch
    from bench._lib.models import loss_of, make_batches, make_model

    dist.init_process_group("fake", store=_torch.fake_store(), rank=0, world_size=2)
    ddp_fusion.config.enabled = True
    net = make_model(model_name)
    model = torch.compile(torch.nn.parallel.DistributedDataParallel(net))
    loss = loss_of(model_name, model)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    with _torch.isolated_compile():  # (no FX graph cache: each graph's module is new)
        for x, y in make_batches(model_name, 0, 3):
            loss(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=zero_grad == "none")
    sources = [open(m.__file__).read() for m in _torch.inductor_modules()]
    backward = [code for code in sources if "torch.ops.ddp_fusion." in code]
    if not backward:
        raise SystemExit(f"no backward graph of ddp_fusion's among {len(sources)} compiled")
    with open(out, "w") as f:
        f.write(backward[-1])


def kinds(code: str) -> Counter[str]:
    """Statements of the module's ``call``, by kind (``host_cost``'s kinds), and the
    views its ``return`` makes."""
    call = code.split("def call(", 1)[1].split("\nrunner = ", 1)[0]
    n: Counter[str] = Counter(_kind(line) for line in call.splitlines()[1:] if line.strip())
    n["views returned"] = sum(line.count("reinterpret_tensor(") for line in call.splitlines()
                              if line.strip().startswith("return"))
    return n


def time_calls(paths: list[str], rounds: int, calls: int) -> list[list[float]]:
    """Per module, per round: µs per call, the modules taking turns each round."""
    import torch
    import torch.distributed as dist

    import ddp_fusion  # noqa: F401  (registers the ops the modules call)
    from bench._lib import _torch

    if not dist.is_initialized():
        dist.init_process_group("fake", store=_torch.fake_store(), rank=0, world_size=2)
    torch.set_num_threads(1)
    mods = []
    for i, path in enumerate(paths):
        spec = importlib.util.spec_from_file_location(f"_backward_call_{i}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        mods.append((module.call, module.get_args()))
    out: list[list[float]] = [[] for _ in mods]
    for r in range(rounds):
        order = range(len(mods)) if r % 2 == 0 else reversed(range(len(mods)))
        for i in order:
            call, args = mods[i]
            for _ in range(5):
                call(list(args))
            start = time.perf_counter()
            for _ in range(calls):
                call(list(args))
            out[i].append((time.perf_counter() - start) / calls * 1e6)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.backward_call", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=MODELS, default="mlp_params")
    parser.add_argument("--zero-grad", choices=("none", "zeros"), default="none")
    parser.add_argument("--baseline", required=True,
                        help="another checkout, compiled with its own ddp_fusion")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=50, help="calls timed per module per round")
    parser.add_argument("--cpu", type=int, default=0, help="the core to time on")
    parser.add_argument("--out", default="backward_call.json")
    parser.add_argument("--compile-to", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_to:
        compile_backward(args.model, args.zero_grad, args.compile_to)
        return

    if not os.path.isdir(os.path.join(args.baseline, "ddp_fusion")):
        parser.error(f"--baseline {args.baseline}: no ddp_fusion package there")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this checkout": here, "baseline": os.path.abspath(args.baseline)}
    tmp = tempfile.mkdtemp(prefix="backward_call_")
    paths = {}
    for label, tree in trees.items():
        paths[label] = os.path.join(tmp, label.replace(" ", "_") + ".py")
        env = dict(os.environ, PYTHONPATH=tree, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"))
        # this file, run as a script: the checkout's own ddp_fusion and bench._lib
        cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model,
               "--zero-grad", args.zero_grad, "--baseline", args.baseline, "--compile-to", paths[label]]
        print(f"compiling {args.model}'s backward with {label} ({tree})", flush=True)
        subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")  # its kernels
    os.sched_setaffinity(0, {args.cpu})
    labels = list(paths)
    times = time_calls([paths[k] for k in labels], args.rounds, args.calls)
    counts = {k: kinds(open(paths[k]).read()) for k in labels}
    ratios = [a / b for a, b in zip(times[0], times[1])]
    med = {k: statistics.median(t) for k, t in zip(labels, times)}

    print(f"\n{args.model}, .grad {'set to none' if args.zero_grad == 'none' else 'kept'}, "
          f"{args.rounds} rounds of {args.calls} calls, core {args.cpu}\n")
    print("| | this checkout | baseline |\n|---|---:|---:|")
    print(f"| backward graph call, µs (median of rounds) | {med[labels[0]]:.1f} | {med[labels[1]]:.1f} |")
    for kind in KINDS:
        print(f"| {kind} | {counts[labels[0]][kind]} | {counts[labels[1]][kind]} |")
    print(f"\nthis checkout / baseline per round: median {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f}), ahead in {sum(r < 1 for r in ratios)} of {len(ratios)}")
    path = write_json(args.out, {
        "meta": provenance(argv), "model": args.model, "zero_grad": args.zero_grad,
        "baseline": trees["baseline"], "us_per_call": dict(zip(labels, times)),
        "statements": {k: dict(v) for k, v in counts.items()}, "ratios": ratios,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
