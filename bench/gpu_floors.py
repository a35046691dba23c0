"""One GPU at world size 1 (NCCL): ddp_fusion's CUDA path, and compiled-autograd
backward against torch.compile's AOT backward.

    python -m bench.gpu_floors OUT.json [mlp] [gpt] [--small | --cpu-size] [--floors-only] [--memory]

For each model (sized for a GPU: MLP 24 x 1024, batch 256; GPT d=768, 6 layers, seq 256,
batch 8), in one process:

* compute floors, forward and backward timed apart (CUDA-synchronised, median of 50):
  eager; ``torch.compile`` (AOT backward); ``torch.compile`` + compiled autograd with
  static sizes (what ddp_fusion uses while shapes are stable) and with dynamic sizes;
* step time of eager torch DDP, DDPOptimizer and ddp_fusion (concat, coalesced, and
  concat with ``mode="reduce-overhead"``: CUDA graphs, forward and backward);
* gradients after one step of ddp_fusion against eager torch DDP (world size 1: the
  average is the local gradient);
* with ``--memory`` (CUDA only): ``torch.cuda.max_memory_allocated`` over one steady
  step, and what is held before it, of eager torch DDP with ``gradient_as_bucket_view``
  and of ddp_fusion, with ``zero_grad(set_to_none=True)`` and ``False``.

At world size 1 NCCL moves nothing: this measures compute and the cost of the fused
graph, not communication. It runs on the lent GPU machine's own torch (2.11 there),
from a checkout on ``PYTHONPATH``. ``--small`` shrinks everything for a CPU smoke run;
``--cpu-size`` uses the shaped-link benchmark's CPU models (the compiled-backward
comparison on CPU); ``--floors-only`` measures the compute floors only. One failing
measurement is recorded (its traceback) and the others go on.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F  # noqa: N812 - torch's own spelling

import ddp_fusion
from bench._lib import _torch
from bench._lib.models import GPT, GPT_BATCH, GPT_SEQ, GPT_VOCAB, MLP, MLP_BATCH, MLP_WIDTH

SPECS = {
    "gpt": dict(vocab=8192, d=768, heads=12, layers=6, seq=256, batch=8),
    "mlp": dict(width=1024, depth=24, batch=256),
}


def _defaults(cls: type) -> dict[str, Any]:
    return {k: p.default for k, p in inspect.signature(cls).parameters.items() if p.default is not p.empty}


CPU_SIZE = {  # the shaped-link benchmark's models, as bench/_lib/models.py builds them
    "gpt": {**_defaults(GPT), "vocab": GPT_VOCAB, "seq": GPT_SEQ, "batch": GPT_BATCH},
    "mlp": {**_defaults(MLP), "width": MLP_WIDTH, "batch": MLP_BATCH},
}
SMALL = {
    "gpt": dict(vocab=500, d=64, heads=2, layers=2, seq=32, batch=2),
    "mlp": dict(width=64, depth=4, batch=16),
}
FLOORS = ("eager", "aot", "ca_static", "ca_dynamic")
MODES = ("eager_ddp", "ddp_optimizer", "ddp_fusion_concat", "ddp_fusion_coalesced",
         "ddp_fusion_concat_reduce_overhead")
MEMORY_MODES = ("eager_ddp_gbav", "ddp_fusion_concat")


def _init() -> torch.device:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    if torch.cuda.is_available():
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
        return dev
    dist.init_process_group("gloo", rank=0, world_size=1)
    return torch.device("cpu")


class Bench:
    def __init__(self, specs: dict[str, dict[str, int]], device: torch.device, reps: int) -> None:
        self.specs, self.dev, self.reps = specs, device, reps

    def make(self, name: str) -> nn.Module:
        torch.manual_seed(0)
        s = self.specs[name]
        if name == "gpt":
            model = GPT(s["vocab"], s["d"], s["heads"], s["layers"], s["seq"])
        else:
            model = MLP(s["width"], s["depth"])
        return model.to(self.dev)

    def batches(self, name: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(1)
        s, out = self.specs[name], []
        for _ in range(n):
            if name == "gpt":
                ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=gen)
                out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
            else:
                out.append((torch.randn(s["batch"], s["width"], generator=gen),
                            torch.randn(s["batch"], 1, generator=gen)))
        return [(x.to(self.dev), y.to(self.dev)) for x, y in out]

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], None]) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def floors(self, name: str) -> dict[str, Any]:
        """Forward and backward times of the model alone: eager, AOT, compiled autograd."""
        out = {}
        x, y = self.batches(name, 1)[0]
        for kind in FLOORS:
            torch.compiler.reset()
            model = self.make(name)
            compiled = model if kind == "eager" else torch.compile(model)
            ctx = (_torch.compiled_autograd(dynamic=kind == "ca_dynamic") if kind.startswith("ca_")
                   else contextlib.nullcontext())
            holder: dict[str, torch.Tensor] = {}

            def fwd(model: nn.Module = model, compiled: Any = compiled, holder: dict = holder) -> None:
                for p in model.parameters():
                    p.grad = None
                holder["loss"] = loss_of(name, compiled(x), y)

            def bwd(holder: dict = holder) -> None:
                holder["loss"].backward()

            with ctx:
                t0 = time.perf_counter()
                for _ in range(3):
                    fwd()
                    bwd()
                self.sync()
                warm = time.perf_counter() - t0
                f, b = [], []
                for _ in range(self.reps):
                    f.append(self.timed(fwd))
                    b.append(self.timed(bwd))
            out[kind] = {"fwd": summary(f), "bwd": summary(b), "warmup_s": warm}
            print(name, kind, json.dumps(out[kind]), flush=True)
        return out

    def wrap(self, mode: str, net: nn.Module) -> nn.Module:
        if mode in ("eager_ddp", "eager_ddp_gbav"):
            return nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=mode == "eager_ddp_gbav")
        if mode == "ddp_optimizer":
            return torch.compile(nn.parallel.DistributedDataParallel(net))
        ddp_fusion.config.enabled = True
        if mode.endswith("_reduce_overhead"):  # CUDA graphs, forward and backward
            ddp_fusion.config.algorithm = mode.removeprefix("ddp_fusion_").removesuffix("_reduce_overhead")
            ddp_fusion.config.backward_compile_kwargs = {"mode": "reduce-overhead"}
            return torch.compile(ddp_fusion.DistributedDataParallel(net), mode="reduce-overhead")
        ddp_fusion.config.algorithm = mode.removeprefix("ddp_fusion_")
        return torch.compile(ddp_fusion.DistributedDataParallel(net))

    def memory(self, name: str) -> dict[str, Any]:
        """Peak CUDA memory over one steady step (after 3), and what is held before it."""
        out = {}
        for mode in MEMORY_MODES:
            for set_to_none in (True, False):
                torch.compiler.reset()
                net = self.make(name)
                try:
                    model = self.wrap(mode, net)
                    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
                    batches = self.batches(name, 4)

                    for i, (x, y) in enumerate(batches):
                        if i == 3:  # the steady step measured
                            self.sync()
                            torch.cuda.reset_peak_memory_stats()
                            held = torch.cuda.memory_allocated()
                        opt.zero_grad(set_to_none=set_to_none)
                        loss_of(name, model(x), y).backward()
                        opt.step()
                    self.sync()
                    out[f"{mode}, set_to_none={set_to_none}"] = {
                        "held_mb": held / 1e6, "peak_mb": torch.cuda.max_memory_allocated() / 1e6}
                finally:
                    ddp_fusion.config.enabled = False
                    ddp_fusion.config.backward_compile_kwargs = {}
                print(name, mode, set_to_none, json.dumps(out[f"{mode}, set_to_none={set_to_none}"]),
                      flush=True)
        return out

    def train(self, name: str, mode: str, steps: int = 8) -> dict[str, Any]:
        """Median step time of one data-parallel mode."""
        torch.compiler.reset()
        counters = _torch.counters()
        counters.clear()
        net = self.make(name)
        try:
            model = self.wrap(mode, net)
            opt = torch.optim.SGD(net.parameters(), lr=1e-3)
            batches = self.batches(name, steps)
            index = [0]

            def step() -> None:
                x, y = batches[index[0] % len(batches)]
                index[0] += 1
                opt.zero_grad(set_to_none=True)
                loss_of(name, model(x), y).backward()
                opt.step()

            t0 = time.perf_counter()
            for _ in range(3):
                step()
            self.sync()
            warm = time.perf_counter() - t0
            times = [self.timed(step) for _ in range(self.reps)]
            return {"step": summary(times), "warmup_s": warm,
                    "buckets_per_graph": dict(counters["ddp_fusion"]),
                    "param_sum": float(sum(p.detach().double().sum() for p in net.parameters()))}
        finally:
            ddp_fusion.config.enabled = False
            ddp_fusion.config.backward_compile_kwargs = {}

    def first_grads(self, name: str, mode: str) -> list[torch.Tensor]:
        """Gradients after one step (world size 1: the average is the local gradient)."""
        torch.compiler.reset()
        net = self.make(name)
        try:
            model = self.wrap(mode, net)
            x, y = self.batches(name, 1)[0]
            loss_of(name, model(x), y).backward()
        finally:
            ddp_fusion.config.enabled = False
        return [p.grad.detach().clone() for p in net.parameters()]


def loss_of(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "gpt":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return (out - y).square().mean()


def summary(ts: list[float]) -> dict[str, float]:
    ts, n = sorted(ts), len(ts)
    return {"median_ms": 1e3 * statistics.median(ts), "p10_ms": 1e3 * ts[n // 10],
            "p90_ms": 1e3 * ts[(9 * n) // 10]}


def _record(results: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
    try:
        results[key] = fn()
    except Exception:  # noqa: BLE001 - one failing measurement must not lose the others
        results[f"{key}_error"] = traceback.format_exc()[-3000:]
        print(results[f"{key}_error"], flush=True)


def main() -> None:
    out_path, args = sys.argv[1], sys.argv[2:]
    small, cpu_size, floors_only = "--small" in args, "--cpu-size" in args, "--floors-only" in args
    with_memory = "--memory" in args
    dev = _init()
    bench = Bench(SMALL if small else CPU_SIZE if cpu_size else SPECS, dev, reps=5 if small else 50)
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "specs": bench.specs,
    }
    for name in [a for a in args if a in SPECS] or list(SPECS):
        _record(results, f"{name}_floors", lambda name=name: bench.floors(name))
        if floors_only:
            with open(out_path, "w") as f:
                json.dump(results, f, indent=1)
            continue
        for mode in MODES:
            _record(results, f"{name}_{mode}", lambda name=name, mode=mode: bench.train(name, mode))
            if f"{name}_{mode}" in results:
                print(name, mode, json.dumps(results[f"{name}_{mode}"]["step"]), flush=True)

        def grad_diffs(name: str = name) -> None:
            ref = bench.first_grads(name, "eager_ddp")
            results[f"{name}_grad_maxabs"] = max(float(a.abs().max()) for a in ref)
            for algorithm in ("concat", "coalesced"):
                got = bench.first_grads(name, f"ddp_fusion_{algorithm}")
                results[f"{name}_grad_maxdiff_{algorithm}"] = max(
                    float((a - b).abs().max()) for a, b in zip(ref, got))

        _record(results, f"{name}_grads", grad_diffs)
        if with_memory and dev.type == "cuda":
            _record(results, f"{name}_memory", lambda name=name: bench.memory(name))
        print(name, "grad diffs", results.get(f"{name}_grad_maxdiff_concat"),
              results.get(f"{name}_grad_maxdiff_coalesced"), flush=True)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
