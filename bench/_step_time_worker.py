"""Per-rank body of ``python -m bench.step_time`` (importable by spawned ranks).

Kept out of ``bench/step_time.py`` because under ``python -m bench.step_time`` that
module is ``__main__``, and ``spawn`` pickles the rank function by module name.

Every mode is a :class:`Mode`: ``context()`` sets (and on exit restores) the global
configuration the mode needs, ``wrap(model, cap)`` wraps (and compiles) a fresh model
built from the same seed. Each (model, mode, cap) job runs in its own pair of rank
processes (:func:`mode_worker`), which stay alive, compiled, between the parent's
commands; so the parent can time the jobs round-robin without recompiling, and no
compiled code, Dynamo / compiled-autograd cache or config leaks from one mode into
another.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import profile

import ddp_fusion

# --------------------------------------------------------------------------- models


class MLP(nn.Module):
    """``depth`` x (Linear(width, width) + LayerNorm + GELU): many small parameters."""

    def __init__(self, width: int = 256, depth: int = 24) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embedding, ``layers`` pre-LN blocks, final LN, untied LM head."""

    def __init__(self, vocab: int = 1000, d: int = 192, heads: int = 4, layers: int = 4,
                 seq: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


MODELS: dict[str, dict[str, Any]] = {
    "mlp": {"desc": "MLP: 24 x (Linear(256,256) + LayerNorm + GELU) + Linear(256,1), batch 128",
            "batch": 128, "width": 256},
    "gpt": {"desc": "GPT: vocab 1000, d_model 192, 4 heads, 4 blocks, seq 64, batch 8",
            "batch": 8, "seq": 64, "vocab": 1000},
}


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MLP() if name == "mlp" else GPT()


def make_batches(name: str, rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (input, target) pairs; each rank its own data, the same for every mode."""
    spec = MODELS[name]
    gen = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(count):
        if name == "mlp":
            x = torch.randn(spec["batch"], spec["width"], generator=gen)
            y = torch.randn(spec["batch"], 1, generator=gen)
        else:
            ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"] + 1), generator=gen)
            x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        out.append((x, y))
    return out


def loss_fn(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "mlp":
        return (out - y).square().mean()
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# --------------------------------------------------------------------------- modes


@contextlib.contextmanager
def _restore_legacy_inlinelist() -> Iterator[None]:
    """Torch DDP built in python-reducer mode adds ``torch.nn.parallel.distributed`` to
    Dynamo's inline list for good; undo that so later modes trace DDP as usual."""
    from torch._dynamo import trace_rules

    name = "torch.nn.parallel.distributed"
    had = name in trace_rules.LEGACY_MOD_INLINELIST
    try:
        yield
    finally:
        if not had:
            trace_rules.LEGACY_MOD_INLINELIST.discard(name)
            trace_rules.get_legacy_mod_inlinelist.cache_clear()


def _inductor_defaults(**changes: Any) -> dict[str, Any]:
    """Inductor settings every compiled-DDP mode patches explicitly (so whatever torch
    DDP writes to them at construction is restored when the mode ends)."""
    base = {
        "_fuse_ddp_communication": False,
        "_fuse_ddp_bucket_size": torch._inductor.config._fuse_ddp_bucket_size,
        "_fuse_ddp_communication_passes": list(torch._inductor.config._fuse_ddp_communication_passes),
        "bucket_all_reduces_fx": "none",
    }
    base.update(changes)
    return base


def _compiled_autograd() -> contextlib.AbstractContextManager[None]:
    from torch._dynamo import compiled_autograd

    return compiled_autograd._enable(torch.compile(backend="inductor"))


class Mode:
    name = ""
    comm = True  # has gradient communication (compared with eager_ddp)
    compiled = True

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def wrap(self, model: nn.Module, cap: float | None) -> nn.Module:
        raise NotImplementedError


class EagerDDP(Mode):
    name = "eager_ddp"
    compiled = False

    def wrap(self, model, cap):
        return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)


class DDPOptimizer(Mode):
    name = "ddp_optimizer"

    def context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(torch._dynamo.config.patch(optimize_ddp=True))
        stack.enter_context(torch._inductor.config.patch(_inductor_defaults()))
        return stack

    def wrap(self, model, cap):
        return torch.compile(nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap))


class UpstreamPythonReducer(Mode):
    """Torch DDP with ``optimize_ddp="python_reducer"`` + compiled autograd; ``fusion``
    picks what Inductor does with the per-gradient all-reduces."""

    def __init__(self, name: str, inductor: dict[str, Any]) -> None:
        self.name = name
        self.inductor = inductor

    def context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(_restore_legacy_inlinelist())
        stack.enter_context(torch._dynamo.config.patch(optimize_ddp="python_reducer"))
        stack.enter_context(torch._inductor.config.patch(_inductor_defaults(**self.inductor)))
        stack.enter_context(_compiled_autograd())
        return stack

    def wrap(self, model, cap):
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
        # DDP's constructor turns upstream's fusion on (and sets its bucket size) as a
        # global side effect; re-assert this mode's choice (restored by the patch).
        torch._inductor.config._fuse_ddp_communication = self.inductor.get(
            "_fuse_ddp_communication", False
        )
        return torch.compile(ddp)


class DDPFusion(Mode):
    def __init__(self, algorithm: str, comm_dtype: torch.dtype | None = None) -> None:
        self.algorithm = algorithm
        self.comm_dtype = comm_dtype
        suffix = f"_{str(comm_dtype).removeprefix('torch.')}" if comm_dtype else ""
        self.name = f"ddp_fusion_{algorithm}{suffix}"
        # an fp16 wire changes the numbers: compare it with eager DDP + fp16 hook
        self.comm = comm_dtype is None

    def context(self):
        return ddp_fusion.config.patch(enabled=True, algorithm=self.algorithm)

    def wrap(self, model, cap):
        return torch.compile(
            ddp_fusion.DistributedDataParallel(model, bucket_cap_mb=cap, comm_dtype=self.comm_dtype)
        )


class DDPFusionUncompiled(Mode):
    """ddp_fusion's wrapper without torch.compile: its eager bucketed reducer."""

    name = "ddp_fusion_uncompiled"
    compiled = False

    def context(self):
        return ddp_fusion.config.patch(enabled=False)

    def wrap(self, model, cap):
        return ddp_fusion.DistributedDataParallel(model, bucket_cap_mb=cap)


class EagerDDPFp16Hook(Mode):
    name = "eager_ddp_fp16_hook"
    compiled = False
    comm = False

    def wrap(self, model, cap):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
        ddp.register_comm_hook(ddp.process_group, default_hooks.fp16_compress_hook)
        return ddp


class ComputeOnly(Mode):
    name = "compute_only"
    comm = False

    def wrap(self, model, cap):
        return torch.compile(model)


class CommOnly(Mode):
    name = "comm_only"
    comm = False
    compiled = False


def all_modes() -> dict[str, Mode]:
    concat = ["fuse_ddp_with_concat_op", "schedule_comm_wait"]
    coalesced = ["fuse_ddp_with_coalesced_op", "schedule_comm_wait"]
    modes: list[Mode] = [
        EagerDDP(),
        DDPOptimizer(),
        UpstreamPythonReducer("upstream_python_reducer_concat",
                              {"_fuse_ddp_communication": True,
                               "_fuse_ddp_communication_passes": concat}),
        UpstreamPythonReducer("upstream_python_reducer_coalesced",
                              {"_fuse_ddp_communication": True,
                               "_fuse_ddp_communication_passes": coalesced}),
        UpstreamPythonReducer("upstream_bucket_all_reduces_fx",
                              {"bucket_all_reduces_fx": "all"}),
        UpstreamPythonReducer("compiled_autograd_nofusion", {}),
        DDPFusion("concat"),
        DDPFusion("coalesced"),
        DDPFusionUncompiled(),
        EagerDDPFp16Hook(),
        DDPFusion("concat", torch.float16),
        ComputeOnly(),
        CommOnly(),
    ]
    return {m.name: m for m in modes}


# --------------------------------------------------------------------------- running


def _count_collectives(step: Callable[[], None]) -> dict[str, int]:
    with profile() as prof:
        step()
    counts: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("gloo:"):
            counts[e.name] = counts.get(e.name, 0) + 1
    return counts


def _stats_snapshot() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
        "ca_captures": int(counters["compiled_autograd"]["captures"]),
    }


def _short(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}"


def _build(model_name: str, mode: Mode, cap: float | None, batches: list):
    """``(step, model)`` for ``mode``; ``model`` is None for comm_only."""
    if isinstance(mode, CommOnly):
        numel = sum(p.numel() for p in make_model(model_name).parameters())
        flat = torch.randn(numel)
        return (lambda: dist.all_reduce(flat)), None
    model = mode.wrap(make_model(model_name), cap)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    count = [0]

    def step() -> None:
        x, y = batches[count[0] % len(batches)]
        count[0] += 1
        opt.zero_grad(set_to_none=False)
        loss_fn(model_name, model(x), y).backward()
        opt.step()

    return step, model


def mode_worker(rank: int, world_size: int, model_name: str, mode_name: str,
                cap: float | None, cmd_queues: list, res_queue: Any) -> None:
    """One rank of one (model, mode, cap) job, kept alive between commands so that its
    compiled code survives while other jobs (other processes) are timed.

    Commands (from the parent, one per rank): ``("warmup", n)``, ``("time", n)``,
    ``("profile", None)``, ``("params", None)``, ``("stop", None)``. Each is answered
    with ``(rank, "ok", value)`` on ``res_queue``; an exception with
    ``(rank, "error", (short, traceback))``, after which the rank exits.
    """
    torch.set_num_threads(1)
    mode = all_modes()[mode_name]
    batches = make_batches(model_name, rank, 4)
    # Before entering the mode: reset() also switches compiled autograd off.
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(compile_threads=1), mode.context():
            step, model = _build(model_name, mode, cap, batches)
            res_queue.put((rank, "ok", "ready"))
            while True:
                cmd, arg = cmd_queues[rank].get()
                if cmd == "stop":
                    res_queue.put((rank, "ok", None))
                    break
                if cmd == "warmup":
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(arg):
                        step()
                    dist.barrier()
                    value: Any = time.perf_counter() - t0
                elif cmd == "time":
                    before = _stats_snapshot()
                    times = []
                    for _ in range(arg):
                        dist.barrier()
                        t0 = time.perf_counter()
                        step()
                        times.append(1e3 * (time.perf_counter() - t0))
                    after = _stats_snapshot()
                    value = {"times_ms": times,
                             "recompiles": {k: after[k] - before[k] for k in after}}
                elif cmd == "profile":
                    dist.barrier()
                    from torch._dynamo.utils import counters

                    value = {"collectives": _count_collectives(step),
                             "counters": {k: dict(counters[k]) for k in
                                          ("ddp_fusion", "compiled_autograd", "stats")}}
                elif cmd == "params":
                    value = None if model is None else torch.cat(
                        [p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                res_queue.put((rank, "ok", value))
    except Exception as e:
        res_queue.put((rank, "error", (_short(e), traceback.format_exc())))
        raise


def model_info(model_name: str) -> dict[str, int]:
    params = list(make_model(model_name).parameters())
    return {"num_params": sum(p.numel() for p in params), "num_tensors": len(params)}
