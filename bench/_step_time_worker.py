"""Per-rank body of ``python -m bench.step_time`` (importable by spawned ranks).

Kept out of ``bench/step_time.py`` because under ``python -m bench.step_time`` that
module is ``__main__``, and ``spawn`` pickles the rank function by module name.

Every mode is a :class:`Mode`: ``context()`` sets (and on exit restores) the global
configuration the mode needs, ``build(cap)`` makes a fresh model from the same seed and
returns ``(step_fn, params)``. One *round* runs every mode once, in order:
``torch._dynamo.reset()``, build, warm-up steps (compiles; timed as a whole), timed
steps (``dist.barrier()`` before each, ``time.perf_counter``), one profiled step to
count collectives. Rounds repeat, so machine drift hits every mode alike. Round 1
compiles from an empty Inductor cache (the parent points ``TORCHINDUCTOR_CACHE_DIR`` at
a fresh directory); later rounds re-trace but mostly hit the FX graph cache.
"""

from __future__ import annotations

import contextlib
import gc
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
    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self.name = f"ddp_fusion_{algorithm}"

    def context(self):
        return ddp_fusion.config.patch(enabled=True, algorithm=self.algorithm)

    def wrap(self, model, cap):
        return torch.compile(ddp_fusion.DistributedDataParallel(model, bucket_cap_mb=cap))


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


def _flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _stats_snapshot() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
        "ca_captures": int(counters["compiled_autograd"]["captures"]),
    }


def _run_one(model_name: str, mode: Mode, cap: float | None, warmup: int, steps: int,
             batches: list, reference: torch.Tensor | None) -> dict[str, Any]:
    torch._dynamo.reset()
    gc.collect()
    out: dict[str, Any] = {}
    with mode.context():
        if isinstance(mode, CommOnly):
            numel = sum(p.numel() for p in make_model(model_name).parameters())
            flat = torch.randn(numel)

            def step() -> None:
                dist.all_reduce(flat)

            out["grad_bytes"] = numel * 4
        else:
            model = mode.wrap(make_model(model_name), cap)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            it = iter(range(10**9))

            def step() -> None:
                x, y = batches[next(it) % len(batches)]
                opt.zero_grad(set_to_none=False)
                loss_fn(model_name, model(x), y).backward()
                opt.step()

        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(warmup):
            step()
        dist.barrier()
        out["warmup_s"] = time.perf_counter() - t0
        before = _stats_snapshot()
        times = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        after = _stats_snapshot()
        out["times_ms"] = [1e3 * t for t in times]
        out["recompiles_during_timing"] = {k: after[k] - before[k] for k in after}
        dist.barrier()
        out["collectives"] = _count_collectives(step)
        if not isinstance(mode, CommOnly):
            params = _flat_params(model)
            out["params"] = params
            if reference is not None and mode.comm:
                out["max_param_diff"] = (params - reference).abs().max().item()
            del model, opt
    torch._dynamo.reset()
    gc.collect()
    return out


def _short(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}"


def rank_main(rank: int, world_size: int, plan: dict[str, Any]) -> dict[str, Any]:
    """Run ``plan["jobs"]`` (list of (model, mode, cap)) round-robin for
    ``plan["rounds"]`` rounds. Returns per-job records for this rank."""
    torch.set_num_threads(1)
    modes = all_modes()
    log = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)
    batches = {m: make_batches(m, rank, 4) for m in {j[0] for j in plan["jobs"]}}
    records: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    t_start = time.perf_counter()
    with torch._inductor.config.patch(compile_threads=1):
        for r in range(plan["rounds"]):
            reference: dict[tuple[str, Any], torch.Tensor] = {}
            for model_name, mode_name, cap in plan["jobs"]:
                key = f"{model_name}|{mode_name}|{cap}"
                rec = records.setdefault(key, {"model": model_name, "mode": mode_name, "cap": cap,
                                               "times_ms": [], "warmup_s": [],
                                               "recompiles_during_timing": []})
                if key in failed:
                    continue
                mode = modes[mode_name]
                t0 = time.perf_counter()
                try:
                    res = _run_one(model_name, mode, cap, plan["warmup"], plan["steps"],
                                   batches[model_name], reference.get((model_name, cap)))
                except Exception as e:  # noqa: BLE001 - reported in the table
                    failed[key] = _short(e)
                    rec["failed"] = failed[key]
                    rec["traceback"] = traceback.format_exc()
                    log(f"  [round {r + 1}] {model_name:4s} {mode_name:34s} cap={cap}: FAILED "
                        f"{failed[key]}")
                    with contextlib.suppress(Exception):
                        torch._dynamo.reset()
                    gc.collect()
                    dist.barrier()
                    continue
                params = res.pop("params", None)
                if mode_name == "eager_ddp":
                    reference[(model_name, cap)] = params
                rec["times_ms"].append(res["times_ms"])
                rec["warmup_s"].append(res["warmup_s"])
                rec["recompiles_during_timing"].append(res["recompiles_during_timing"])
                rec["collectives"] = res["collectives"]
                if "max_param_diff" in res:
                    rec["max_param_diff"] = res["max_param_diff"]
                if "grad_bytes" in res:
                    rec["grad_bytes"] = res["grad_bytes"]
                med = sorted(res["times_ms"])[len(res["times_ms"]) // 2]
                log(f"  [round {r + 1}/{plan['rounds']}, {time.perf_counter() - t_start:6.0f} s] "
                    f"{model_name:4s} {mode_name:34s} cap={cap}: warm-up {res['warmup_s']:5.1f} s, "
                    f"rank0 median {med:7.2f} ms, job {time.perf_counter() - t0:5.1f} s")
    return {"records": records, "num_params": {m: sum(p.numel() for p in make_model(m).parameters())
                                               for m in batches},
            "num_tensors": {m: sum(1 for _ in make_model(m).parameters()) for m in batches}}

