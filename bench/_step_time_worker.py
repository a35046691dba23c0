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
import operator
import time
import traceback
import unittest.mock
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import profile, record_function

import ddp_fusion
from bench import _hf_models
from bench._tp import TPBlock

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


class TPMLP(nn.Module):
    """``depth`` residual Megatron blocks (see bench/_tp.py) split over the TP group."""

    def __init__(self, tp_group, width: int = 256, hidden: int = 1024, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(TPBlock(width, hidden, tp_group, seed) for seed in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


MODELS: dict[str, dict[str, Any]] = {
    "mlp": {"desc": "MLP: 24 x (Linear(256,256) + LayerNorm + GELU) + Linear(256,1), batch 128",
            "batch": 128, "width": 256, "world_size": 2, "tp": 1},
    "gpt": {"desc": "GPT: vocab 1000, d_model 192, 4 heads, 4 blocks, seq 64, batch 8",
            "batch": 8, "seq": 64, "vocab": 1000, "world_size": 2, "tp": 1},
    "mlp_tp": {"desc": "DP=2 x TP=2 MLP: 8 x Megatron block (256 -> 1024 -> 256, W1 by rows, "
                       "W2 by columns over TP), batch 64 per DP rank",
               "batch": 64, "width": 256, "world_size": 4, "tp": 2},
}
# transformers models built from configs (bench/_hf_models.py), as ``hf_<name>``
for _name, _spec in _hf_models.MODELS.items():
    MODELS[f"hf_{_name}"] = {
        "desc": f"transformers {_spec.desc}, batch {_hf_models.BATCH}", "world_size": 2, "tp": 1,
        "hf": _name, "ddp_kwargs": {"find_unused_parameters": _spec.find_unused_parameters},
    }


def dp_tp_groups(name: str) -> tuple[Any, Any]:
    """``(dp_group, tp_group)`` of this rank for ``name``; ``(None, None)`` for pure DP
    models. DP x TP models use a (dp, tp) device mesh: TP peers are neighbouring ranks."""
    if MODELS[name]["tp"] == 1:
        return None, None
    from torch.distributed.device_mesh import init_device_mesh

    tp = MODELS[name]["tp"]
    mesh = init_device_mesh("cpu", (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
    return mesh["dp"].get_group(), mesh["tp"].get_group()


def make_model(name: str, tp_group: Any = None) -> nn.Module:
    if "hf" in MODELS[name]:
        return _hf_models.build(MODELS[name]["hf"])
    torch.manual_seed(0)
    if name == "mlp_tp":
        return TPMLP(tp_group)
    return MLP() if name == "mlp" else GPT()


def make_batches(name: str, rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (input, target) pairs; each DP rank its own data (TP peers share it),
    the same for every mode."""
    spec = MODELS[name]
    gen = torch.Generator().manual_seed(1000 + rank // spec["tp"])
    if "hf" in spec:  # (batch dict, None): the loss comes from _hf_models.loss_of
        return [(_hf_models.MODELS[spec["hf"]].batch(gen), None) for _ in range(count)]
    out = []
    for _ in range(count):
        if name in ("mlp", "mlp_tp"):
            x = torch.randn(spec["batch"], spec["width"], generator=gen)
            y = torch.randn(spec["batch"], 1 if name == "mlp" else spec["width"], generator=gen)
        else:
            ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"] + 1), generator=gen)
            x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        out.append((x, y))
    return out


def loss_fn(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name in ("mlp", "mlp_tp"):
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
    reference = "eager_ddp"  # the mode whose parameters this one should reproduce

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def wrap(self, model: nn.Module, cap: float | None, pg: Any = None, **kw: Any) -> nn.Module:
        """``model`` wrapped for data parallelism over ``pg`` (None: the world); ``kw``:
        the model's DDP arguments (``find_unused_parameters``)."""
        raise NotImplementedError


class EagerDDP(Mode):
    name = "eager_ddp"
    compiled = False

    def wrap(self, model, cap, pg=None, **kw):
        return nn.parallel.DistributedDataParallel(model, process_group=pg, bucket_cap_mb=cap, **kw)


class DDPOptimizer(Mode):
    name = "ddp_optimizer"

    def context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(torch._dynamo.config.patch(optimize_ddp=True))
        stack.enter_context(torch._inductor.config.patch(_inductor_defaults()))
        return stack

    def wrap(self, model, cap, pg=None, **kw):
        return torch.compile(nn.parallel.DistributedDataParallel(model, process_group=pg, bucket_cap_mb=cap, **kw))


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

    def wrap(self, model, cap, pg=None, **kw):
        ddp = nn.parallel.DistributedDataParallel(model, process_group=pg, bucket_cap_mb=cap, **kw)
        # DDP's constructor turns upstream's fusion on (and sets its bucket size) as a
        # global side effect; re-assert this mode's choice (restored by the patch).
        torch._inductor.config._fuse_ddp_communication = self.inductor.get(
            "_fuse_ddp_communication", False
        )
        return torch.compile(ddp)


class DDPFusion(Mode):
    """``peak_memory_reorder``: ddp_fusion as it was before it turned Inductor's
    peak-memory reordering off for the backward graph (which pulls each bucket's wait
    up to its collective), to measure what that costs. ``copy_back``: ddp_fusion's
    concat as it was before issue 15 (each reduced gradient copied back into the old
    ``.grad``; the bucket scaled into a second buffer), emulated by
    :func:`_copy_back_concat`. ``max_in_flight_mb``: ddp_fusion's in-flight budget."""

    def __init__(self, algorithm: str, comm_dtype: torch.dtype | None = None,
                 peak_memory_reorder: bool = False, copy_back: bool = False,
                 max_in_flight_mb: float | None = None) -> None:
        self.algorithm = algorithm
        self.comm_dtype = comm_dtype
        self.peak_memory_reorder = peak_memory_reorder
        self.copy_back = copy_back
        self.max_in_flight_mb = max_in_flight_mb
        suffix = f"_{str(comm_dtype).removeprefix('torch.')}" if comm_dtype else ""
        suffix += "_peak_memory_reorder" if peak_memory_reorder else ""
        suffix += "_copy_back" if copy_back else ""
        suffix += f"_inflight_{max_in_flight_mb:g}mb" if max_in_flight_mb else ""
        self.name = f"ddp_fusion_{algorithm}{suffix}"
        # an fp16 wire changes the numbers: compare it with eager DDP + fp16 hook
        self.comm = comm_dtype is None
        if comm_dtype == torch.float16:
            self.reference = "eager_ddp_fp16_hook"

    def context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(ddp_fusion.config.patch(enabled=True, algorithm=self.algorithm))
        if self.max_in_flight_mb:
            stack.enter_context(ddp_fusion.config.patch(max_in_flight_mb=self.max_in_flight_mb))
        if self.copy_back:
            stack.enter_context(_copy_back_concat())
        if self.peak_memory_reorder:
            stack.enter_context(unittest.mock.patch.object(
                ddp_fusion._torch, "inductor_options_keeping_node_order", dict))
        return stack

    def wrap(self, model, cap, pg=None, **kw):
        return torch.compile(
            ddp_fusion.DistributedDataParallel(model, process_group=pg, bucket_cap_mb=cap, comm_dtype=self.comm_dtype, **kw)
        )


@contextlib.contextmanager
def _copy_back_concat() -> Iterator[None]:
    """ddp_fusion's concat before issue 15 (commit 17a3314), for same-run comparisons:
    the hook copies the reduced gradient into the old ``.grad`` (a copy back), and the
    fuser scales the concatenated bucket into a second buffer. Patched in for the
    duration (the hooks are made when the wrapper is built)."""
    from ddp_fusion import ddp as ddp_module
    from ddp_fusion import passes
    from ddp_fusion.ops import ALL_REDUCE_GRADIENT
    from ddp_fusion.passes import concat

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional

    def make_hook(state, reducer, index, group_name, limits, name, owner):
        def reduce_grad(param):
            if not state.require_backward_grad_sync or param.grad is None:
                return
            if torch.compiler.is_compiling():
                ready = -1 if state.ready_position is None else state.ready_position[index]
                reduced = ALL_REDUCE_GRADIENT(param.grad, group_name, state.reduce_op, limits, name,
                                              state.comm_dtype, ready, owner)
                param.grad.copy_(reduced)
                return
            reducer.grad_ready(index)
        return reduce_grad

    def fuse(make, bucket, after, divisor, group_name=None):
        key = bucket.key
        with make.graph.inserting_before(after.next):
            flats = [concat._flatten(make, g) for g in bucket.grads]
            flat = make(aten.cat.default, (flats,))
            if key.comm_dtype is not None:
                flat = make(torch.ops.prims.convert_element_type.default, (flat, key.comm_dtype))
            flat = make(aten.div.Tensor, (flat, divisor))
            collective = make(c10d.all_reduce.default, (flat, "sum", group_name or key.group_name))
            tail = [make(c10d.wait_tensor.default, (collective,))]
            if key.comm_dtype is not None:
                tail.append(make(torch.ops.prims.convert_element_type.default, (tail[-1], key.dtype)))
            parts = make(aten.split_with_sizes.default, (tail[-1], [g.numel for g in bucket.grads]))
            tail.append(parts)
            outputs = []
            for i, g in enumerate(bucket.grads):
                out = make(operator.getitem, (parts, i))
                tail.append(out)
                for node in concat._unflatten(make, g, out):
                    tail.append(node)
                    out = node
                outputs.append(out)
        return FusedBucket(bucket, collective, [tail], outputs)

    from ddp_fusion.passes.schedule import FusedBucket

    with unittest.mock.patch.object(ddp_module, "_make_hook", make_hook), \
            unittest.mock.patch.dict(passes._FUSERS, {"concat": fuse}):
        yield


class EagerDDPGradView(Mode):
    name = "eager_ddp_grad_view"
    compiled = False

    def wrap(self, model, cap, pg=None, **kw):
        return nn.parallel.DistributedDataParallel(model, process_group=pg, bucket_cap_mb=cap,
                                                   gradient_as_bucket_view=True, **kw)


class DDPFusionStock(Mode):
    """Stock torch DDP built with ddp_fusion on, then torch.compile: what a torchrun,
    Accelerate or Lightning user gets from the flag alone."""

    name = "ddp_fusion_stock"

    def context(self):
        return ddp_fusion.config.patch(enabled=True, algorithm="concat")

    def wrap(self, model, cap, pg=None, **kw):
        return torch.compile(nn.parallel.DistributedDataParallel(model, process_group=pg, bucket_cap_mb=cap, **kw))


class DDPFusionUncompiled(Mode):
    """ddp_fusion's wrapper without torch.compile: its eager bucketed reducer."""

    name = "ddp_fusion_uncompiled"
    compiled = False

    def context(self):
        return ddp_fusion.config.patch(enabled=False)

    def wrap(self, model, cap, pg=None, **kw):
        return ddp_fusion.DistributedDataParallel(model, process_group=pg, bucket_cap_mb=cap, **kw)


class EagerDDPFp16Hook(Mode):
    name = "eager_ddp_fp16_hook"
    compiled = False
    comm = False

    def wrap(self, model, cap, pg=None, **kw):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp = nn.parallel.DistributedDataParallel(model, process_group=pg, bucket_cap_mb=cap, **kw)
        ddp.register_comm_hook(ddp.process_group, default_hooks.fp16_compress_hook)
        return ddp


def _powersgd(rank: int) -> tuple[Any, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                               start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
    return state, psgd.powerSGD_hook


def _waiting(hook: Any) -> Any:
    """``hook``, finishing each bucket before returning: eager torch DDP on gloo issues
    PowerSGD's chained all-reduces from gloo's threads, in an order that can differ
    between ranks once there are several buckets (a hang; see
    bench/results/comm_hooks_cpu_2026-11-24.md); this is the order ddp_fusion enforces."""
    def waiting_hook(state, bucket):  # no annotations: torch DDP checks them
        fut = hook(state, bucket)
        fut.wait()
        return fut
    return waiting_hook


class EagerDDPPowerSGD(Mode):
    compiled = False
    comm = False

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.name = f"eager_ddp_powersgd_r{rank}"

    def wrap(self, model, cap, pg=None, **kw):
        ddp = nn.parallel.DistributedDataParallel(model, process_group=pg, bucket_cap_mb=cap, **kw)
        state, hook = _powersgd(self.rank)
        ddp.register_comm_hook(state, _waiting(hook))
        return ddp


class DDPFusionPowerSGD(Mode):
    """torch's ``powerSGD_hook`` on ddp_fusion's fused buckets, compiled."""

    comm = False

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.name = f"ddp_fusion_powersgd_r{rank}"
        self.reference = f"eager_ddp_powersgd_r{rank}"

    def context(self):
        return ddp_fusion.config.patch(enabled=True, algorithm="concat")

    def wrap(self, model, cap, pg=None, **kw):
        ddp = ddp_fusion.DistributedDataParallel(model, process_group=pg, bucket_cap_mb=cap, **kw)
        ddp.register_comm_hook(*_powersgd(self.rank))
        return torch.compile(ddp)


class ComputeOnly(Mode):
    name = "compute_only"
    comm = False

    def wrap(self, model, cap, pg=None, **kw):
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
        DDPFusion("concat", peak_memory_reorder=True),
        DDPFusion("concat", copy_back=True),
        DDPFusion("concat", max_in_flight_mb=1),
        DDPFusion("concat", torch.float16, max_in_flight_mb=1),
        EagerDDPGradView(),
        DDPFusionStock(),
        DDPFusionUncompiled(),
        EagerDDPFp16Hook(),
        DDPFusion("concat", torch.float16),
        EagerDDPPowerSGD(1),
        DDPFusionPowerSGD(1),
        EagerDDPPowerSGD(4),
        DDPFusionPowerSGD(4),
        ComputeOnly(),
        CommOnly(),
    ]
    return {m.name: m for m in modes}


# --------------------------------------------------------------------------- running


_COLLECTIVE_PREFIXES = ("gloo:", "nccl:")


def _profile_step(step: TrainStep, device: str) -> dict[str, Any]:
    """Run one step (zero_grad outside the profiler) and measure what it communicated,
    copied and held.

    * ``collectives``: backend events (``gloo:*`` / ``nccl:*``) by name;
    * ``bytes_reduced``: numel x element size of those events' inputs;
    * ``copy_bytes``: bytes written by ``aten::copy_`` / ``aten::cat`` calls that are not
      inside another aten op: copies made by reducers and backends (torch DDP's bucket
      fill and empty, gloo's flattening of a coalesced all-reduce), not the ones inside
      kernels (addmm copies its bias into the output) and not those Inductor generates
      (see ``_graph_stats``);
    * ``held_bytes``: after zero_grad, the bytes the job holds between steps
      (:func:`_held_bytes`: parameters, gradients, optimizer state, buffers, reducer
      buckets);
    * ``rise_bytes``: on CPU, the highest total of allocations made during the rest of
      the step and not yet freed (profiler memory events); on CUDA,
      ``max_memory_allocated`` above what was allocated when it began;
    * ``peak_bytes``: ``held_bytes + rise_bytes``, the step's peak (on CPU frees of
      memory allocated before the profiler started are not seen: an upper bound);
    * ``kernels`` (CUDA only): GPU kernels launched.
    """
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    step.zero_grad()
    held = _held_bytes(step)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with profile(activities=activities, record_shapes=True, profile_memory=True) as prof, \
            _python_all_reduces() as python_all_reduces:
        step.rest()
        if device == "cuda":
            torch.cuda.synchronize()
    out: dict[str, Any] = {"collectives": {}, "bytes_reduced": 0, "copy_bytes": 0}
    out["python_all_reduces"], out["python_bytes"] = len(python_all_reduces), sum(python_all_reduces)
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        if e.name.startswith(_COLLECTIVE_PREFIXES):
            out["collectives"][e.name] = out["collectives"].get(e.name, 0) + 1
            out["bytes_reduced"] += _nbytes(e.input_shapes, e.input_dtypes)
        elif e.name in ("aten::copy_", "aten::cat") and not (
                e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")):
            # copy_(dst, src) writes dst; cat writes the output it allocates (the
            # profiler records no shapes for a tensor list)
            out["copy_bytes"] += (_nbytes(e.input_shapes[:1], e.input_dtypes[:1]) if e.name == "aten::copy_"
                                  else e.cpu_memory_usage + e.device_memory_usage)
    if device == "cpu":  # the raw events list every allocation and free in order
        for e in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
            if e.name() == "[memory]":
                live += e.nbytes()
                peak = max(peak, live)
    out["rise_bytes"] = torch.cuda.max_memory_allocated() - base if device == "cuda" else peak
    out["held_bytes"] = held
    out["peak_bytes"] = held + out["rise_bytes"]
    if device == "cuda":
        out["kernels"] = sum(1 for e in prof.events() for _ in e.kernels)
    return out


@contextlib.contextmanager
def _python_all_reduces() -> Iterator[list[int]]:
    """Bytes of each ``dist.all_reduce`` call, from any thread: what comm hooks send
    (PowerSGD's chained all-reduces are issued from gloo's threads, whose events this
    thread's profiler does not always record)."""
    sizes, original = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        sizes.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield sizes
    finally:
        dist.all_reduce = original


def _held_bytes(step: TrainStep) -> int:
    """Bytes of the tensors a job keeps between steps: parameters, gradients, optimizer
    state, buffers (each storage once: gradients that are views of one bucket count
    once), and reducer buckets: torch DDP's C++ reducer's (unless its ``.grad`` are views
    of them), ddp_fusion's eager reducer's (allocated on first use)."""
    model = step.model
    if model is None:
        return 0
    storages: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for b in model.buffers():
        add(b)
    for state in step.opt.state.values():
        for v in state.values():
            add(v)
    inner = getattr(model, "_orig_mod", model)
    extra = 0
    if isinstance(inner, ddp_fusion.DistributedDataParallel) or hasattr(inner, "_ddp_fusion"):
        sync = inner._sync if isinstance(inner, ddp_fusion.DistributedDataParallel) else inner._ddp_fusion
        for bucket in sync.reducer.buckets:
            add(bucket._buffer)
        if hasattr(inner, "_ddp_fusion"):  # an adopted torch DDP: its placeholder reducer
            extra += sum(b.buffer().numel() * b.buffer().element_size()
                         for b in inner.reducer._get_zeros_like_grad_buckets())
    elif isinstance(inner, nn.parallel.DistributedDataParallel) and not (
            inner.gradient_as_bucket_view and any(p.grad is not None for p in model.parameters())):
        # (with gradient_as_bucket_view, .grad are views of the buckets: counted above,
        # unless zero_grad(set_to_none=True) dropped them, while the buckets stay)
        extra += sum(b.buffer().numel() * b.buffer().element_size()
                     for b in inner.reducer._get_zeros_like_grad_buckets())
    return sum(storages.values()) + extra


_ITEMSIZE = {"float": 4, "c10::Half": 2, "c10::BFloat16": 2, "double": 8, "long int": 8,
             "int": 4, "bool": 1}


def _nbytes(shapes: list, dtypes: list) -> int:
    total = 0
    for shape, dtype in zip(shapes, dtypes):
        if shape and dtype in _ITEMSIZE:
            n = 1
            for d in shape:
                n *= d
            total += n * _ITEMSIZE[dtype]
    return total


# Statistics of every FX graph Inductor lowers in this process (post-grad, after every
# pass, ddp_fusion's and upstream's included), appended by _capture_lowered_graphs.
_LOWERED: list[dict[str, int]] = []


def _capture_lowered_graphs() -> None:
    """Record :func:`_graph_stats` of each graph handed to Inductor's lowering, so the
    fusion copies of compiled modes are counted from the graph that really runs."""
    from torch._inductor.graph import GraphLowering

    init = GraphLowering.__init__

    def recording_init(self, gm, *args, **kwargs):
        _LOWERED.append(_graph_stats(gm.graph))
        init(self, gm, *args, **kwargs)

    GraphLowering.__init__ = recording_init


def _graph_stats(graph: torch.fx.Graph) -> dict[str, int]:
    """Collectives in ``graph``, the bytes they reduce, and the bytes written by ``cat``
    nodes that feed them (the copy into a fused bucket; an upper bound, since Inductor
    can compute a cat input directly into the bucket)."""
    c10d = torch.ops._c10d_functional
    collectives = {c10d.all_reduce.default, c10d.all_reduce_.default,
                   c10d.all_reduce_coalesced.default, c10d.all_reduce_coalesced_.default,
                   torch.ops.ddp_fusion.all_reduce_gradient.default}

    def nbytes(n: Any) -> int:
        vals = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
        vals = vals if isinstance(vals, (list, tuple)) else [vals]
        return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))

    def feeds_collective(n: torch.fx.Node, depth: int = 3) -> bool:
        return any(u.target in collectives or (depth > 1 and feeds_collective(u, depth - 1))
                   for u in n.users)

    def reduced(n: Any, depth: int = 6) -> bool:
        """``n`` is (a view of) a collective's result."""
        if not isinstance(n, torch.fx.Node) or depth == 0:
            return False
        if n.target is torch.ops._c10d_functional.wait_tensor.default:
            return True
        return n.target in views and reduced(n.args[0], depth - 1)

    views = {torch.ops.aten.view.default, torch.ops.aten.split_with_sizes.default,
             torch.ops.aten.permute.default, torch.ops.aten.reshape.default,
             torch.ops.aten.split.Tensor, operator.getitem}
    stats = {"collectives": 0, "bytes_reduced": 0, "fusion_copy_bytes": 0, "copy_back_bytes": 0}
    for n in graph.nodes:
        if n.target in (torch.ops.aten.copy_.default, torch.ops.aten.copy.default) and reduced(n.args[1]):
            stats["copy_back_bytes"] += nbytes(n.args[1])
        if n.target in collectives:
            stats["collectives"] += 1
            arg = n.args[0]
            stats["bytes_reduced"] += (sum(nbytes(a) for a in arg) if isinstance(arg, (list, tuple))
                                       else nbytes(arg))
        elif n.target in (torch.ops.aten.cat, torch.ops.aten.cat.default) and feeds_collective(n):
            # (upstream's concat pass calls the overload packet ``aten.cat``)
            stats["fusion_copy_bytes"] += nbytes(n)
    return stats


def _stats_snapshot() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
        "ca_captures": int(counters["compiled_autograd"]["captures"]),
    }


def _short(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}"


class TrainStep:
    """One training step of a (model, mode) job, the loop that bench.step_time times and
    profiles and bench.cost_model models: ``zero_grad`` (``set_to_none`` as given: torch's
    default is True), forward and loss, backward, SGD step. Each phase is labelled for
    the profiler (``step::<phase>``)."""

    def __init__(self, model: nn.Module | None, opt: Any, batches: list, loss: Callable[..., Any],
                 set_to_none: bool) -> None:
        self.model, self.opt, self.batches, self.loss = model, opt, batches, loss
        self.set_to_none = set_to_none
        self.count = 0

    def zero_grad(self) -> None:
        with record_function("step::zero_grad"):
            self.opt.zero_grad(set_to_none=self.set_to_none)

    def rest(self) -> None:
        """Everything after zero_grad."""
        x, y = self.batches[self.count % len(self.batches)]
        self.count += 1
        with record_function("step::forward"):
            loss = self.loss(x, y)
        with record_function("step::backward"):
            loss.backward()
        with record_function("step::optimizer"):
            self.opt.step()

    def __call__(self) -> None:
        self.zero_grad()
        self.rest()


class _CommOnlyStep(TrainStep):
    def __init__(self, flat: torch.Tensor, group: Any) -> None:
        super().__init__(None, None, [], lambda x, y: None, True)
        self.flat, self.group = flat, group

    def zero_grad(self) -> None:
        pass

    def rest(self) -> None:
        dist.all_reduce(self.flat, group=self.group)


def _build(model_name: str, mode: Mode, cap: float | None, batches: list, device: str = "cpu",
           set_to_none: bool = True) -> TrainStep:
    """The training step of ``mode`` (``step.model`` is None for comm_only). DP x TP
    models are data-parallel over their DP group only."""
    dp, tp = dp_tp_groups(model_name)
    if isinstance(mode, CommOnly):
        numel = sum(p.numel() for p in make_model(model_name, tp).parameters())
        return _CommOnlyStep(torch.randn(numel, device=device), dp)
    spec = MODELS[model_name]
    model = mode.wrap(make_model(model_name, tp).to(device), cap, dp, **spec.get("ddp_kwargs", {}))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(_to(x, device), _to(y, device)) for x, y in batches]
    if "hf" in spec:
        loss = lambda x, y: _hf_models.loss_of(model, x)  # noqa: E731
    else:
        loss = lambda x, y: loss_fn(model_name, model(x), y)  # noqa: E731
    return TrainStep(model, opt, batches, loss, set_to_none)


def _to(x: Any, device: str) -> Any:
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x.to(device) if isinstance(x, torch.Tensor) else x


def mode_worker(rank: int, world_size: int, model_name: str, mode_name: str,
                cap: float | None, cmd_queues: list, res_queue: Any, device: str = "cpu",
                set_to_none: bool = True) -> None:
    """One rank of one (model, mode, cap) job, kept alive between commands so that its
    compiled code survives while other jobs (other processes) are timed.

    Commands (from the parent, one per rank): ``("warmup", n)``, ``("time", n)``,
    ``("profile", None)``, ``("params", None)``, ``("stop", None)``. Each is answered
    with ``(rank, "ok", value)`` on ``res_queue``; an exception with
    ``(rank, "error", (short, traceback))``, after which the rank exits. On CUDA each
    timed region is bracketed by ``torch.cuda.synchronize()``.
    """
    torch.set_num_threads(1)
    mode = all_modes()[mode_name]
    batches = make_batches(model_name, rank, 4)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # Before entering the mode: reset() also switches compiled autograd off.
    torch._dynamo.reset()
    _capture_lowered_graphs()
    try:
        # The FX graph caches are off so that every job lowers (and _LOWERED records)
        # its own graphs; compiled kernels are still cached across jobs.
        with torch._inductor.config.patch(compile_threads=1, fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False), mode.context():
            step = _build(model_name, mode, cap, batches, device, set_to_none)
            model = step.model
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
                    sync()
                    dist.barrier()
                    value: Any = time.perf_counter() - t0
                elif cmd == "time":
                    before = _stats_snapshot()
                    times = []
                    for _ in range(arg):
                        dist.barrier()
                        sync()
                        t0 = time.perf_counter()
                        step()
                        sync()
                        times.append(1e3 * (time.perf_counter() - t0))
                    after = _stats_snapshot()
                    value = {"times_ms": times,
                             "recompiles": {k: after[k] - before[k] for k in after}}
                elif cmd == "profile":
                    dist.barrier()
                    from torch._dynamo.utils import counters

                    value = _profile_step(step, device)
                    # the steady-state backward: the last lowered graph with collectives
                    value["graph"] = next((g for g in reversed(_LOWERED) if g["collectives"]), None)
                    value["counters"] = {k: dict(counters[k]) for k in
                                         ("ddp_fusion", "compiled_autograd", "stats")}
                elif cmd == "params":
                    value = None if model is None else torch.cat(
                        [p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy().copy()
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                res_queue.put((rank, "ok", value))
    except Exception as e:
        res_queue.put((rank, "error", (_short(e), traceback.format_exc())))
        raise


class _ShapeOnlyGroup:
    """Stands in for TP rank 0's group when only parameter shapes are needed."""

    def __init__(self, size: int) -> None:
        self._size = size

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self._size


def model_info(model_name: str) -> dict[str, int]:
    """Parameters per rank (a TP rank holds its shards)."""
    params = list(make_model(model_name, _ShapeOnlyGroup(MODELS[model_name]["tp"])).parameters())
    return {"num_params": sum(p.numel() for p in params), "num_tensors": len(params),
            "grad_bytes": sum(p.numel() * p.element_size() for p in params)}
