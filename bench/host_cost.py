"""Where ddp_fusion's host time per parameter goes, against its compiled-autograd floor.

One process, world size 1 (gloo, no communication), a host-bound model (``--model``:
``mlp_host`` or ``mlp_params``, 402 small parameters each, batch 8), one thread, so that
the step is host time. Each mode runs in a process of its own: ``ddp_fusion`` (the
wrapper, concat) and ``compiled_autograd``
(the model in a one-line wrapper module, backward through compiled autograd and
Inductor, no DDP: ddp_fusion's own floor). With ``--peers``, three more:
``ddp_optimizer`` (torch's DDP, compiled: DDPOptimizer), ``compiled`` (the one-line
wrapper, ``torch.compile`` alone: DDPOptimizer's floor) and ``eager_ddp`` (torch's DDP,
not compiled). At world size 1 a step is the host's work alone (no peer to wait for,
gloo's all-reduce of one rank), so the cost each mode adds over its own floor, per
parameter, is measured here without two ranks' scheduling noise. The mode
``compiled_autograd_hooks`` (``--modes``) is the floor with a hook per parameter that
reads a tag and does nothing: what the hooks alone cost; ``compiled_autograd_shared_hook``
the same with one hook function, reading nothing, for every parameter;
``compiled_autograd_callback`` the floor with no parameter hook, but one hook on the loss
that queues one callback at the end of the backward, reading every parameter's ``.grad``
and doing nothing with it: what the same reads cost when they are not hooks. For each:

* the step: the processes take turns at timing rounds (the order turning each round),
  so that a slower spell of the machine falls on both; the median of the round medians,
  and the per-round ratio;
* Dynamo's guard evaluation of the two compiled frames (the wrapper's forward, the
  compiled-autograd graph), timed directly on the frames' captured locals: what a step
  spends in guards, without a profiler's own cost in the figure;
* with ``line_profiler`` installed (``pip install line_profiler``), the backward graph's
  Inductor wrapper code (the ``call`` that launches its kernels), by kind of statement,
  line-profiled (so inflated by the profiler's cost per line; compare the two modes).

With ``--baseline PATH`` a third process runs ddp_fusion from another checkout (say
``git worktree add /tmp/base HEAD~1``), taking its turn in every round: what a change
buys, in the same run. ``--cpu N`` pins every process to one core: on a VM whose cores
run at different speeds, processes left to the scheduler can keep a core each and show
the difference of the cores as one of the modes (seen here: 1.2 ms a step either way).

    python -m bench.host_cost --zero-grad none
    python -m bench.host_cost --zero-grad zeros --baseline /tmp/base --cpu 0 --rounds 30 --steps 100
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

MODES = ("ddp_fusion", "compiled_autograd")
PEERS = ("ddp_optimizer", "compiled", "eager_ddp")
"""``--peers``: DDPOptimizer, its floor (``torch.compile`` alone), eager DDP."""
HOOKS = "compiled_autograd_hooks"
"""The compiled-autograd floor with a post-accumulate-grad hook per parameter that reads
a tag of its own from its closure and does nothing with it, as ddp_fusion's hooks read
theirs: what per-parameter hooks cost compiled autograd and Dynamo by themselves."""
SHARED_HOOK = "compiled_autograd_shared_hook"
"""The same, with one hook function for every parameter that reads nothing (no closure):
what the hooks cost when nothing of a parameter's own is guarded."""
CALLBACK = "compiled_autograd_callback"
"""The floor with no parameter hook: one hook on the loss queues one callback at the end
of the backward (compiled autograd traces it, with ``fullgraph``), which reads every
parameter's ``.grad`` and does nothing with it: what the hooks' reads cost without a
hook per parameter."""
FLOOR = {"ddp_fusion": "compiled_autograd", "ddp_optimizer": "compiled", "eager_ddp": "compiled",
         HOOKS: "compiled_autograd", SHARED_HOOK: "compiled_autograd", CALLBACK: "compiled_autograd"}
COMPILED_AUTOGRAD = ("ddp_fusion", "compiled_autograd", HOOKS, SHARED_HOOK, CALLBACK)
ALL_MODES = (*MODES, *PEERS, HOOKS, SHARED_HOOK, CALLBACK)
BASELINE = "ddp_fusion@baseline"
"""ddp_fusion from the checkout ``--baseline`` names (its own bench and ddp_fusion)."""
MODELS = ("mlp_host", "mlp_params")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kind(line: str) -> str:
    """What a line of Inductor's wrapper code does."""
    line = line.strip()
    if line.startswith("del "):
        return "del"
    if "reinterpret_tensor" in line and "# alias" in line:
        return "alias of a bucket slice"
    if line.startswith("return"):
        return "return (outputs, views)"
    if "empty_strided" in line:
        return "empty_strided"
    if line.startswith(("assert_size_stride", "assert_alignment")):
        return "assert_size_stride/alignment"
    if "extern_kernels." in line:
        return "extern kernel (mm, ...)"
    if re.match(r"cpp_fused_\w+\(|triton_\w+\.run\(", line):
        return "generated kernel"
    if "torch.ops.ddp_fusion." in line:
        return "ddp_fusion op: " + line.split("torch.ops.ddp_fusion.")[1].split(".")[0]
    return "other"


def worker(mode: str, zero_grad: str, steps: int, model_name: str) -> dict[str, Any]:
    """Compile and warm up, print ``READY``; then, per ``round`` line read from stdin,
    time ``steps`` steps and print ``ROUND <median ms>``; at ``finish``, measure the
    guards and the wrapper and return the result."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import ddp_fusion
    from bench._lib import _torch
    from bench._lib.models import loss_of, make_batches, make_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    net = make_model(model_name)
    ((x, y),) = make_batches(model_name, 0, 1)

    class Plain(nn.Module):  # a forward frame like the wrapper's
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, *args: Any) -> Any:
            return self.module(*args)

    if mode == "ddp_fusion":
        ddp_fusion.config.enabled = True
        model: nn.Module = ddp_fusion.DistributedDataParallel(net)
    elif mode in ("ddp_optimizer", "eager_ddp"):
        model = nn.parallel.DistributedDataParallel(net)
    else:
        if mode in ("compiled_autograd", HOOKS, SHARED_HOOK, CALLBACK):
            _ca = _torch.compiled_autograd(dynamic=False, fullgraph=mode == CALLBACK)
            _ca.__enter__()  # for the life of the process
        if mode == HOOKS:
            for i, (name, p) in enumerate(net.named_parameters()):
                p.register_post_accumulate_grad_hook(_tag_reading_hook(f"0:{i}:{i}:{name}"))
        if mode == SHARED_HOOK:
            for p in net.parameters():
                p.register_post_accumulate_grad_hook(_shared_hook)
        model = Plain(net)
    loss = loss_of(model_name, model if mode == "eager_ddp" else torch.compile(model))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    queue = _queueing_hook(list(net.parameters())) if mode == CALLBACK else None

    def step(backward_profiler: Any = None) -> None:
        opt.zero_grad(set_to_none=zero_grad == "none")
        out = loss(x, y)
        if queue is not None:
            out.register_hook(queue)
        if backward_profiler is not None:
            backward_profiler.enable_by_count()
        out.backward()
        if backward_profiler is not None:
            backward_profiler.disable_by_count()
        opt.step()

    for _ in range(6):
        step()
    print("READY", flush=True)
    for command in sys.stdin:
        if command.strip() != "round":
            break
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        print(f"ROUND {statistics.median(times) * 1e3}", flush=True)

    frames: dict[str, Any] = {}
    with _torch.frames_called(lambda kind, frame: frames.setdefault(kind, frame)):
        step()
    guards: dict[str, float | None] = {"forward": None, "backward": None}
    for kind in ("forward", "backward") if mode != "eager_ddp" else ():
        if kind not in frames:  # (no compiled-autograd frame: a peer's backward)
            continue
        code, f_locals = frames[kind]
        timed = [t for t in _torch.guard_check_us(code, f_locals, 300, kind == "forward") if t is not None]
        guards[kind] = timed[0] if timed else None

    wrapper: dict[str, list[float]] | None = None
    try:
        import line_profiler
    except ImportError:
        line_profiler = None
    if line_profiler is not None and mode in COMPILED_AUTOGRAD:  # (one backward graph to read)
        profiler = line_profiler.LineProfiler()
        modules = [m for m in _torch.inductor_modules() if hasattr(m, "Runner")]
        for m in modules:
            profiler.add_function(m.Runner.call)
        profiled = 50
        for _ in range(profiled):
            step(profiler)
        stats = profiler.get_stats()
        spent = {key: sum(t for _, _, t in lines) for key, lines in stats.timings.items() if lines}
        (filename, _, _), lines = max(((k, stats.timings[k]) for k in spent), key=lambda kv: spent[kv[0]])
        source = open(filename).read().splitlines()
        ms, per_step = Counter(), Counter()
        for lineno, hits, t in lines:
            kind = _kind(source[lineno - 1])
            ms[kind] += t * stats.unit / profiled * 1e3
            per_step[kind] += hits / profiled
        wrapper = {k: [ms[k], per_step[k]] for k in ms}
    params = sum(1 for _ in net.parameters())
    counters = _torch.counters()
    return {"mode": mode, "params": params, "buckets_per_graph": _buckets(counters),
            "dynamo_graphs": int(counters.get("stats", {}).get("unique_graphs", 0)),
            "guard_us": guards, "wrapper_ms": wrapper}


def _tag_reading_hook(tag: str) -> Any:
    """A hook that reads its closure's ``tag`` (Dynamo guards it) and does nothing."""
    def hook(param: Any) -> None:
        if tag.startswith("#"):  # (never: a tag starts with the model's id)
            param.grad.mul_(2)

    return hook


def _shared_hook(param: Any) -> None:
    """One hook for every parameter; reads nothing and does nothing."""


def _queueing_hook(params: list[Any]) -> Any:
    """A hook for the loss that queues one callback at the end of the backward, which
    reads every parameter's ``.grad`` (Dynamo guards each) and does nothing."""
    from bench._lib import _torch

    def read_grads() -> None:
        for p in params:
            if p.grad is None:
                raise AssertionError("a parameter without a gradient")

    def hook(grad: Any) -> Any:
        _torch.queue_backward_callback(read_grads)
        return grad

    return hook


def _expect(workers: dict[str, Any], mode: str, tag: str) -> str:
    """The rest of the next line ``mode``'s worker prints starting with ``tag``; exits
    with the worker's error output if it ends first."""
    proc, err = workers[mode]
    for line in proc.stdout:
        if line.startswith(tag):
            return line[len(tag):].strip()
    proc.wait()
    err.seek(0)
    sys.exit(f"{mode} failed (exit {proc.returncode}):\n{err.read()[-3000:]}")


def ratio_lines(medians: dict[str, list[float]]) -> str:
    """The first mode's round medians over each other mode's, per round (the median,
    the range, and the median difference in ms)."""
    first, *others = medians
    lines = []
    for other in others:
        pairs = list(zip(medians[first], medians[other]))
        ratios = [a / b for a, b in pairs]
        diff = statistics.median(a - b for a, b in pairs)
        lines.append(f"  {first} / {other} per round: median {statistics.median(ratios):.3f} "
                     f"({min(ratios):.3f}-{max(ratios):.3f}); difference {diff:+.2f} ms, "
                     f"{first} ahead in {sum(r < 1 for r in ratios)} of {len(ratios)}")
    return "\n".join(lines)


def _buckets(counters: dict[str, Any]) -> float | None:
    c = counters.get("ddp_fusion", {})
    return c["buckets"] / c["graphs"] if c.get("graphs") else None


def table(results: list[dict[str, Any]]) -> str:
    by = {r["mode"]: r for r in results}
    fused, floor = by.get("ddp_fusion"), by.get("compiled_autograd")
    rows = ["", ""]

    def row(label: str, values: list[float | None], scale: float) -> None:
        cells = [f"{v:.3f}" if v is not None else "n/a" for v in values]
        diff = ""
        if fused is not None and floor is not None and None not in values[:2]:
            diff = f"{(values[0] - values[1]) * scale / fused['params']:.2f} µs"
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {diff} |")

    order = [by[m] for m in (*MODES, BASELINE) if m in by]  # (the peers: over_floor's table)
    rows[0] = "| | " + " | ".join(r["mode"] for r in order) + " | difference per parameter |"
    rows[1] = "|---|" + "---:|" * (len(order) + 1)
    row("step, ms (median of round medians)", [r["step_ms"] for r in order], 1e3)
    for kind in ("forward", "backward"):
        row(f"guards of the {kind} frame, µs per step", [r["guard_us"][kind] for r in order], 1.0)
    kinds = sorted({k for r in order if r["wrapper_ms"] for k in r["wrapper_ms"]},
                   key=lambda k: -max((r["wrapper_ms"] or {}).get(k, [0])[0] for r in order))
    for k in kinds:
        vals = [(r["wrapper_ms"] or {}).get(k, [0.0, 0.0]) for r in order]
        label = f"backward wrapper: {k}, ms (" + " / ".join(f"{v[1]:.0f}" for v in vals) + " per step)"
        row(label, [v[0] for v in vals], 1e3)
    if kinds:
        row("backward wrapper, all, ms (line-profiled)",
            [sum(v[0] for v in (r["wrapper_ms"] or {}).values()) for r in order], 1e3)
    return "\n".join(rows)


def over_floor(results: list[dict[str, Any]]) -> str:
    """Each mode's step over its own floor's (ddp_fusion: compiled autograd's; DDPOptimizer
    and eager DDP: ``torch.compile``'s), per step and per parameter; a compiled mode whose
    process made no Dynamo graph is marked."""
    by = {r["mode"]: r for r in results}
    rows = ["| mode | step, ms | Dynamo graphs | floor | over floor, ms | per parameter, µs |",
            "|---|---:|---:|---|---:|---:|"]
    for r in results:
        mode = r["mode"].split("@")[0]
        floor = by.get(FLOOR.get(mode, ""))
        graphs = r.get("dynamo_graphs")
        mark = " (compiled nothing)" if graphs == 0 and mode != "eager_ddp" else ""
        over = "" if floor is None else f"{r['step_ms'] - floor['step_ms']:+.3f}"
        per = "" if floor is None else f"{(r['step_ms'] - floor['step_ms']) * 1e3 / r['params']:+.2f}"
        rows.append(f"| {r['mode']}{mark} | {r['step_ms']:.3f} | {graphs if graphs is not None else ''} | "
                    f"{floor['mode'] if floor else ''} | {over} | {per} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.host_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, from: {','.join(ALL_MODES)}")
    parser.add_argument("--peers", action="store_true", help=f"add the modes {','.join(PEERS)}")
    parser.add_argument("--zero-grad", choices=("none", "zeros"), default="none",
                        help="each step's optimizer.zero_grad: set_to_none=True (none) or False (zeros)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds, the modes' processes taking turns")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--out", default="host_cost.json", help="JSON output (relative: under bench/out/)")
    parser.add_argument("--baseline", metavar="PATH",
                        help="also time ddp_fusion from the checkout at PATH, in the same rounds")
    parser.add_argument("--cpu", type=int, metavar="N", help="pin every process to core N")
    parser.add_argument("--model", default="mlp_host", choices=MODELS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = worker(args.worker, args.zero_grad, args.steps, args.model)
        print("RESULT " + json.dumps(result), flush=True)
        return
    modes = args.modes.split(",")
    if args.peers:
        modes += [m for m in PEERS if m not in modes]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad:
        parser.error(f"unknown modes {bad}")
    if args.baseline:
        if not os.path.isdir(os.path.join(args.baseline, "ddp_fusion")):
            parser.error(f"--baseline {args.baseline}: no ddp_fusion package there")
        modes.append(BASELINE)
    pin = (lambda: os.sched_setaffinity(0, {args.cpu})) if args.cpu is not None else None
    workers = {}
    try:
        for mode in modes:  # compiled one after the other
            t0 = time.perf_counter()
            err = tempfile.TemporaryFile(mode="w+")
            env, cwd = None, None
            if mode == BASELINE:
                env, cwd = {**os.environ, "PYTHONPATH": os.path.abspath(args.baseline)}, args.baseline
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench.host_cost", "--worker", mode.split("@")[0],
                 "--zero-grad", args.zero_grad, "--steps", str(args.steps), "--model", args.model],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1,
                env=env, cwd=cwd, preexec_fn=pin,
            )
            workers[mode] = (proc, err)
            _expect(workers, mode, "READY")
            print(f"  {mode}: compiled and warm in {time.perf_counter() - t0:.0f} s", flush=True)
        medians: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.rounds):  # round-robin, the order turning each round
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                workers[mode][0].stdin.write("round\n")
                medians[mode].append(float(_expect(workers, mode, "ROUND")))
        results = []
        for mode in modes:
            workers[mode][0].stdin.write("finish\n")
            result = json.loads(_expect(workers, mode, "RESULT"))
            result.update(mode=mode, round_medians_ms=medians[mode], step_ms=statistics.median(medians[mode]))
            results.append(result)
    finally:
        for proc, err in workers.values():
            proc.kill()
            err.close()
    print(ratio_lines(medians))
    print(f"\n{args.model}, world size 1, zero_grad set_to_none={args.zero_grad == 'none'}\n")
    print(table(results))
    print()
    print(over_floor(results))
    out = args.out if os.path.isabs(args.out) else os.path.join(os.path.dirname(__file__), "out", args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"zero_grad": args.zero_grad, "results": results}, f, indent=1)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
