"""The data-parallel paths bench compares (modes).

Every mode is a :class:`Mode`: ``context()`` sets (and on exit restores) the global
configuration the mode needs, ``wrap(model, cap, pg)`` wraps (and compiles) a fresh
model built from the same seed. A job runs one mode in its own rank processes, so no
compiled code, Dynamo or compiled-autograd cache or setting leaks into another mode.

Each mode also names its *own compute floor* (:attr:`Mode.floor`), the floor mode that
runs the same kind of compute without any communication: eager modes the eager model
(``compute_eager``), DDPOptimizer the AOT-compiled model (``compute_only``,
``torch.compile(model)``), compiled-autograd modes the model compiled with its backward
through compiled autograd and Inductor (``compute_compiled_autograd``).

Modes that emulated ddp_fusion's earlier graphs by patching its internals
(``ddp_fusion_concat_peak_memory_reorder``, ``ddp_fusion_concat_copy_back``) are gone;
their numbers are in bench/results/step_time_cpu_2026-11-23.md and
bench/results/memory_cpu_2026-11-24.md.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

import ddp_fusion
from bench._lib import _torch

DDP = nn.parallel.DistributedDataParallel
EAGER_FLOOR, AOT_FLOOR, CA_FLOOR = "compute_eager", "compute_only", "compute_compiled_autograd"
COMM_FLOOR = "comm_only"
FLOORS = (EAGER_FLOOR, AOT_FLOOR, CA_FLOOR, COMM_FLOOR)


class Mode:
    name = ""
    comm = True
    """Has gradient communication whose result should equal :attr:`reference`'s."""
    compiled = True
    reference = "eager_ddp"
    """The mode whose parameters this one should reproduce ("": none)."""
    floor = CA_FLOOR
    """Its own compute floor (a mode name)."""
    sized_for_link = False
    """Chooses its buckets for the link it measures at its first compiled step (so on a
    shaped link it is compiled again at each rate)."""
    needs_gpu = ""
    """Why the mode runs on a GPU only ("": it runs anywhere)."""

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def wrap(self, model: nn.Module, cap: float | None, pg: Any = None, **kw: Any) -> nn.Module:
        """``model`` wrapped for data parallelism over ``pg`` (None: the world); ``kw``:
        the model's DDP arguments (``find_unused_parameters``)."""
        raise NotImplementedError


class EagerDDP(Mode):
    """torch DDP, no compile (``grad_view``: ``gradient_as_bucket_view=True``)."""

    compiled = False
    floor = EAGER_FLOOR

    def __init__(self, grad_view: bool = False) -> None:
        self.grad_view = grad_view
        self.name = "eager_ddp_grad_view" if grad_view else "eager_ddp"

    def wrap(self, model, cap, pg=None, **kw):
        return DDP(model, process_group=pg, bucket_cap_mb=cap, gradient_as_bucket_view=self.grad_view, **kw)


class EagerDDPFp16Hook(Mode):
    """torch DDP with torch's fp16 compression hook (its bf16 hook needs NCCL or XCCL:
    there is no eager bf16 reference on gloo)."""

    name = "eager_ddp_fp16_hook"
    compiled = False
    comm = False
    floor = EAGER_FLOOR

    def wrap(self, model, cap, pg=None, **kw):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp = DDP(model, process_group=pg, bucket_cap_mb=cap, **kw)
        ddp.register_comm_hook(ddp.process_group, default_hooks.fp16_compress_hook)
        return ddp


class DDPOptimizer(Mode):
    """``torch.compile`` of torch DDP, ``optimize_ddp=True``: graph breaks at buckets,
    torch's C++ reducer, AOT-compiled backward."""

    name = "ddp_optimizer"
    floor = AOT_FLOOR

    def context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(_torch.optimize_ddp(True))
        stack.enter_context(_torch.upstream_ddp_fusion())
        return stack

    def wrap(self, model, cap, pg=None, **kw):
        return torch.compile(DDP(model, process_group=pg, bucket_cap_mb=cap, **kw))


class UpstreamPythonReducer(Mode):
    """torch DDP with ``optimize_ddp="python_reducer"`` + compiled autograd; ``inductor``
    picks what Inductor does with the per-gradient all-reduces (see
    :func:`_torch.upstream_ddp_fusion`)."""

    def __init__(self, name: str, **inductor: Any) -> None:
        self.name = name
        self.inductor = inductor

    def context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(_torch.restore_legacy_inlinelist())
        stack.enter_context(_torch.optimize_ddp("python_reducer"))
        stack.enter_context(_torch.upstream_ddp_fusion(**self.inductor))
        stack.enter_context(_torch.compiled_autograd())
        return stack

    def wrap(self, model, cap, pg=None, **kw):
        ddp = DDP(model, process_group=pg, bucket_cap_mb=cap, **kw)
        _torch.set_upstream_ddp_fusion(self.inductor.get("fuse", False))
        return torch.compile(ddp)


class UpstreamOverlapScheduling(UpstreamPythonReducer):
    """torch DDP under the python reducer (a functional all-reduce per gradient in the
    compiled-autograd backward) with Inductor's overlap scheduler bucketing and placing
    them (``aten_distributed_optimizations``: ``enable_overlap_scheduling``,
    ``collective_bucketing``): upstream's newest compiled-DDP path, with buckets of its
    own choosing (the job's cap is ignored)."""

    needs_gpu = ("Inductor's overlap scheduler estimates kernel runtimes with Triton, which a "
                 "CPU-only torch lacks (it fails importing triton): run it with --device cuda")

    def __init__(self) -> None:
        super().__init__("upstream_overlap_scheduling")

    def context(self):
        stack = super().context()
        stack.enter_context(_torch.overlap_scheduling())
        return stack


class DDPFusion(Mode):
    """``torch.compile(ddp_fusion.DistributedDataParallel(...))`` with ``algorithm``, a
    communication dtype, an in-flight budget (``max_in_flight_mb``),
    ``bucket_cap_mb="auto"`` (``auto``: the job's cap is ignored), and without the
    per-step plan check (``plan_check=False``: ``_nocheck``)."""

    def __init__(self, algorithm: str, comm_dtype: torch.dtype | None = None,
                 max_in_flight_mb: float | None = None, auto: bool = False, plan_check: bool = True) -> None:
        self.algorithm = algorithm
        self.comm_dtype = comm_dtype
        self.max_in_flight_mb = max_in_flight_mb
        self.auto = self.sized_for_link = auto
        self.plan_check = plan_check
        suffix = f"_{_short(comm_dtype)}" if comm_dtype else ""
        suffix += f"_inflight_{max_in_flight_mb:g}mb" if max_in_flight_mb else ""
        suffix += "_auto" if auto else ""
        suffix += "" if plan_check else "_nocheck"
        self.name = f"ddp_fusion_{algorithm}{suffix}"
        # a low-precision wire changes the numbers: compare with eager DDP + the same
        # hook (fp16; torch's bf16 hook does not run on gloo: no reference)
        self.comm = comm_dtype is None
        if comm_dtype is not None:
            self.reference = "eager_ddp_fp16_hook" if comm_dtype == torch.float16 else ""

    def context(self):
        settings: dict[str, Any] = {"enabled": True, "algorithm": self.algorithm,
                                    "plan_check": self.plan_check}
        if self.max_in_flight_mb:
            settings["max_in_flight_mb"] = self.max_in_flight_mb
        return ddp_fusion.config.patch(**settings)

    def wrap(self, model, cap, pg=None, **kw):
        return torch.compile(ddp_fusion.DistributedDataParallel(
            model, process_group=pg, bucket_cap_mb="auto" if self.auto else cap,
            comm_dtype=self.comm_dtype, **kw))


class DDPFusionStock(Mode):
    """Stock torch DDP built with ddp_fusion on, then torch.compile: what a torchrun,
    Accelerate or Lightning user gets from the flag alone."""

    name = "ddp_fusion_stock"

    def context(self):
        return ddp_fusion.config.patch(enabled=True, algorithm="concat")

    def wrap(self, model, cap, pg=None, **kw):
        return torch.compile(DDP(model, process_group=pg, bucket_cap_mb=cap, **kw))


class DDPFusionUncompiled(Mode):
    """ddp_fusion's wrapper without torch.compile: its eager bucketed reducer."""

    name = "ddp_fusion_uncompiled"
    compiled = False
    floor = EAGER_FLOOR

    def context(self):
        return ddp_fusion.config.patch(enabled=False)

    def wrap(self, model, cap, pg=None, **kw):
        return ddp_fusion.DistributedDataParallel(model, process_group=pg, bucket_cap_mb=cap, **kw)


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
    floor = EAGER_FLOOR

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.name = f"eager_ddp_powersgd_r{rank}"

    def wrap(self, model, cap, pg=None, **kw):
        ddp = DDP(model, process_group=pg, bucket_cap_mb=cap, **kw)
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


class ComputeFloor(Mode):
    """The model alone, no communication: eager, AOT-compiled (``torch.compile``), or
    compiled with its backward through compiled autograd (static sizes, as ddp_fusion
    uses it while shapes are stable) and Inductor."""

    comm = False

    def __init__(self, name: str) -> None:
        self.name = self.floor = name
        self.compiled = name != EAGER_FLOOR

    def context(self):
        # static sizes, as ddp_fusion traces backward while the forward's shapes are stable
        return _torch.compiled_autograd(dynamic=False) if self.name == CA_FLOOR else contextlib.nullcontext()

    def wrap(self, model, cap, pg=None, **kw):
        return model if self.name == EAGER_FLOOR else torch.compile(model)


class CommOnly(Mode):
    """The gradient bytes in DDP-bucket-sized all-reduces, issued back to back (no model)."""

    name = COMM_FLOOR
    comm = False
    compiled = False
    floor = COMM_FLOOR


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def all_modes() -> dict[str, Mode]:
    """Every mode, by name, in the order tables list them."""
    concat = ["fuse_ddp_with_concat_op", "schedule_comm_wait"]
    coalesced = ["fuse_ddp_with_coalesced_op", "schedule_comm_wait"]
    modes: list[Mode] = [
        EagerDDP(),
        EagerDDP(grad_view=True),
        DDPOptimizer(),
        UpstreamPythonReducer("upstream_python_reducer_concat", fuse=True, passes=concat),
        UpstreamPythonReducer("upstream_python_reducer_coalesced", fuse=True, passes=coalesced),
        UpstreamPythonReducer("upstream_bucket_all_reduces_fx", bucket_all_reduces_fx="all"),
        UpstreamPythonReducer("compiled_autograd_nofusion"),
        UpstreamOverlapScheduling(),
        DDPFusion("concat"),
        DDPFusion("coalesced"),
        DDPFusion("concat", max_in_flight_mb=1),
        DDPFusion("concat", torch.float16),
        DDPFusion("concat", torch.float16, max_in_flight_mb=1),
        DDPFusion("concat", torch.bfloat16),
        DDPFusion("coalesced", torch.float16),
        DDPFusion("concat", auto=True),
        DDPFusion("concat", plan_check=False),
        DDPFusionStock(),
        DDPFusionUncompiled(),
        EagerDDPFp16Hook(),
        EagerDDPPowerSGD(1),
        DDPFusionPowerSGD(1),
        EagerDDPPowerSGD(4),
        DDPFusionPowerSGD(4),
        ComputeFloor(EAGER_FLOOR),
        ComputeFloor(AOT_FLOOR),
        ComputeFloor(CA_FLOOR),
        CommOnly(),
    ]
    return {m.name: m for m in modes}
