"""bench's shim for private torch: every private torch name bench uses is reached here.

The upstream baselines bench drives (DDPOptimizer, upstream's python reducer with
Inductor's DDP fusion passes or ``bucket_all_reduces_fx``, compiled autograd without
ddp_fusion) are switched on through private torch settings, and some measurements read
torch internals (the graphs Inductor lowers, DDP's bucket buffers, raw profiler events).
They are all here, each listed in ``REQUIRED`` as a dotted name, which :func:`check`
resolves (``tests/test_bench_shim.py`` checks that, and that no other file of bench
reaches a private torch name). ddp_fusion's own shim (``ddp_fusion/_torch/``) is
ddp_fusion's; bench does not use it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

REQUIRED = (
    "torch.ops.aten._foreach_div.Tensor",
    "torch._dynamo.config.optimize_ddp",
    "torch._dynamo.compiled_autograd._enable",
    "torch.autograd.Variable._execution_engine.queue_callback",
    "torch._dynamo.trace_rules.LEGACY_MOD_INLINELIST",
    "torch._dynamo.trace_rules.get_legacy_mod_inlinelist",
    "torch._dynamo.utils.counters",
    "torch._dynamo.utils.compilation_time_metrics",
    "torch._inductor.config._fuse_ddp_communication",
    "torch._inductor.config._fuse_ddp_bucket_size",
    "torch._inductor.config._fuse_ddp_communication_passes",
    "torch._inductor.config.bucket_all_reduces_fx",
    "torch._inductor.config.aten_distributed_optimizations.enable_overlap_scheduling",
    "torch._inductor.config.aten_distributed_optimizations.collective_bucketing",
    "torch._inductor.config.compile_threads",
    "torch._inductor.config.fx_graph_cache",
    "torch._inductor.graph.GraphLowering.__init__",
    "torch._inductor.fx_passes.ddp_fusion.fuse_ddp_with_concat_op",
    "torch._inductor.virtualized.V.set_fake_mode",
    "torch._functorch.config.enable_autograd_cache",
    "torch._guards.detect_fake_mode",
    "torch._dynamo.eval_frame._debug_get_cache_entry_list",
    "torch._inductor.codecache.PyCodeCache.modules",
    "torch._C._distributed_c10d.Reducer._get_zeros_like_grad_buckets",
    "torch.fx.passes.shape_prop._extract_tensor_metadata",
    "torch.distributed._functional_collectives.all_reduce",
    "torch.ops._c10d_functional.all_reduce",
    "torch.ops._c10d_functional.wait_tensor",
    "torch.testing._internal.distributed.fake_pg.FakeStore",
)
# Private attributes of instances, which cannot be resolved at import, and why using
# them is safe.
UNCHECKED = {
    "_orig_mod": "the module a torch.compile'd module wraps (set in OptimizedModule.__init__); "
                 "read with getattr and a default",
    "_get_ddp_logging_data": "torch DDP's logging record (a method of DistributedDataParallel; "
                             "its bucket sizes), read after the model has trained",
}


def check() -> list[str]:
    """The ``REQUIRED`` names this torch lacks (empty when all resolve)."""
    missing = []
    for name in REQUIRED:
        parts = name.split(".")
        obj: Any = None
        for i in range(len(parts), 0, -1):  # the longest importable module prefix
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            rest = parts[i:]
            break
        else:
            missing.append(name)
            continue
        try:
            for attr in rest:
                obj = getattr(obj, attr)
        except AttributeError:
            missing.append(name)
    return missing


# --------------------------------------------------------------------------- compile settings


def optimize_ddp(value: bool | str) -> contextlib.AbstractContextManager[None]:
    """Dynamo's DDP handling: True (DDPOptimizer: graph breaks at buckets), False, or
    ``"python_reducer"`` (upstream's compiled DDP under compiled autograd)."""
    return torch._dynamo.config.patch(optimize_ddp=value)


def upstream_ddp_fusion(**changes: Any) -> contextlib.AbstractContextManager[None]:
    """Inductor's own DDP fusion settings, all patched (off unless ``changes`` say
    otherwise), so that whatever torch DDP's constructor writes to them is restored
    when the mode ends. ``changes``: ``fuse`` (``_fuse_ddp_communication``), ``passes``
    (``_fuse_ddp_communication_passes``), ``bucket_all_reduces_fx``."""
    cfg = torch._inductor.config
    return cfg.patch({
        "_fuse_ddp_communication": changes.get("fuse", False),
        "_fuse_ddp_bucket_size": cfg._fuse_ddp_bucket_size,
        "_fuse_ddp_communication_passes": list(changes.get("passes", cfg._fuse_ddp_communication_passes)),
        "bucket_all_reduces_fx": changes.get("bucket_all_reduces_fx", "none"),
    })


def overlap_scheduling() -> contextlib.AbstractContextManager[None]:
    """Inductor's overlap scheduler with collective bucketing on
    (``aten_distributed_optimizations``: ``enable_overlap_scheduling``,
    ``collective_bucketing``): it buckets a graph's collectives and places them from its
    runtime estimates, which benchmark kernels with Triton (a GPU)."""
    return torch._inductor.config.patch({
        "aten_distributed_optimizations.enable_overlap_scheduling": True,
        "aten_distributed_optimizations.collective_bucketing": True,
    })


def set_upstream_ddp_fusion(fuse: bool) -> None:
    """Re-assert ``_fuse_ddp_communication`` (torch DDP's constructor turns it on under
    the python reducer, a process-wide side effect; :func:`upstream_ddp_fusion` restores it)."""
    torch._inductor.config._fuse_ddp_communication = fuse


@contextlib.contextmanager
def restore_legacy_inlinelist() -> Iterator[None]:
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


def compiled_autograd(dynamic: bool = True,
                      fullgraph: bool = False) -> contextlib.AbstractContextManager[None]:
    """Every ``backward()`` through compiled autograd, its graphs compiled by Inductor;
    ``dynamic``: traced with dynamic sizes (torch's default for this context);
    ``fullgraph``: no graph break (which :func:`queue_backward_callback` needs)."""
    from torch._dynamo import compiled_autograd as ca

    return ca._enable(torch.compile(backend="inductor", fullgraph=fullgraph), dynamic=dynamic)


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """From a hook during a backward: call ``callback`` when the backward ends (compiled
    autograd traces it at the end of its graph)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def isolated_compile() -> contextlib.ExitStack:
    """One compile thread, and no FX graph or AOT autograd cache, so that every job
    lowers (and :func:`on_lowering` sees) its own graphs; compiled kernels are still
    cached across jobs."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._inductor.config.patch(compile_threads=1, fx_graph_cache=False))
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return stack


def on_lowering(callback: Callable[[torch.fx.GraphModule], None]) -> None:
    """Call ``callback(gm)`` with every FX graph handed to Inductor's lowering (post-grad,
    after every pass) in this process, from now on."""
    from torch._inductor.graph import GraphLowering

    init = GraphLowering.__init__

    def recording_init(self, gm, *args, **kwargs):
        callback(gm)
        init(self, gm, *args, **kwargs)

    GraphLowering.__init__ = recording_init


def counters() -> Any:
    """Dynamo's counters (``stats``, ``compiled_autograd``, ``ddp_fusion``, ...)."""
    from torch._dynamo.utils import counters as c

    return c


def compile_seconds() -> dict[str, float]:
    """Seconds spent so far in each of torch's timed compile phases (``dynamo_timed``
    keys such as ``_compile.compile_inner`` or ``GraphLowering.compile_to_module``);
    nested phases are counted in their parents too."""
    from torch._dynamo.utils import compilation_time_metrics

    return {k: float(sum(v)) for k, v in compilation_time_metrics.items()}


# --------------------------------------------------------------------------- objects


def unwrap_compiled(model: Any) -> Any:
    """The module a ``torch.compile``'d module wraps (itself if not compiled)."""
    return getattr(model, "_orig_mod", model)


def ddp_bucket_count(ddp: torch.nn.parallel.DistributedDataParallel) -> int:
    """How many buckets torch DDP's reducer has (its logging record's bucket sizes)."""
    return len(ddp._get_ddp_logging_data()["bucket_sizes"].split(","))


def ddp_bucket_bytes(ddp: torch.nn.parallel.DistributedDataParallel) -> int:
    """Bytes of torch DDP's C++ reducer's bucket buffers."""
    return sum(b.buffer().numel() * b.buffer().element_size()
               for b in ddp.reducer._get_zeros_like_grad_buckets())


C10D = torch.ops._c10d_functional
"""The functional collectives (``all_reduce``, ``wait_tensor``, ...) as graph targets."""

FOREACH_DIV = torch.ops.aten._foreach_div.Tensor
"""The scaling of ddp_fusion's coalesced buckets, as a graph target."""


def functional_all_reduce(t: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """``all_reduce`` as a functional collective (traced as ``_c10d_functional.all_reduce``)."""
    import torch.distributed._functional_collectives as fcol

    return fcol.all_reduce(t, op, group)


# --------------------------------------------------------------------------- pass_time


def fake_store() -> Any:
    """A store for a ``backend="fake"`` process group (one process, no communication)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def add_tensor_meta(gm: torch.fx.GraphModule) -> None:
    """``meta["tensor_meta"]`` on every tensor node (upstream's passes read it)."""
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if "tensor_meta" not in node.meta and isinstance(val, torch.Tensor):
            node.meta["tensor_meta"] = _extract_tensor_metadata(val)


def upstream_concat_fusion(gm: torch.fx.GraphModule, bucket_mb: float) -> None:
    """Inductor's ``fuse_ddp_with_concat_op`` on ``gm`` (under the graph's fake mode)."""
    from torch._guards import detect_fake_mode
    from torch._inductor.fx_passes.ddp_fusion import fuse_ddp_with_concat_op
    from torch._inductor.virtualized import V

    fake_mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes])
    if fake_mode is None:
        raise RuntimeError("no fake tensors in the traced graph")
    with V.set_fake_mode(fake_mode):
        fuse_ddp_with_concat_op(gm.graph, bucket_mb)


# --------------------------------------------------------------------------- host_cost


@contextlib.contextmanager
def frames_called(record: Callable[[str, Any], None]) -> Iterator[None]:
    """Calls ``record(kind, (code, locals))`` for the frames Dynamo runs compiled code for,
    while the context is open: ``"backward"`` for the compiled-autograd graph (its
    GraphModule's ``forward`` and the arguments compiled autograd calls it with, lists
    copied before the graph clears them), ``"forward"`` for every ``forward`` of a
    module (its class's ``forward`` code and the frame's locals)."""
    import sys

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        local = frame.f_locals
        if frame.f_code.co_name == "runtime_wrapper" and "compiled_fn" in local and "hooks" in local:
            # compiled autograd's runtime wrapper: compiled_fn(inputs, sizes, scalars, hooks, ...)
            gm = getattr(local["compiled_fn"], "_orig_mod", local["compiled_fn"])
            args = {k: list(v) if isinstance(v, list) else v for k, v in local.items()
                    if k in ("inputs", "sizes", "scalars", "hooks", "packed_inputs")}
            record("backward", (type(gm).forward.__code__, {"self": gm, **args}))
        elif frame.f_code.co_name == "forward" and isinstance(local.get("self"), torch.nn.Module):
            record("forward", (type(local["self"]).forward.__code__, dict(local)))

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)


def guard_check_us(code: Any, f_locals: dict[str, Any], calls: int, grad_enabled: bool) -> list[float | None]:
    """Microseconds per evaluation of the guards of each compiled entry of ``code``
    (Dynamo's cache), on ``f_locals``, ``calls`` evaluations; None for an entry whose
    guards fail on them (not the entry this frame runs)."""
    import time

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    out: list[float | None] = []
    with torch.set_grad_enabled(grad_enabled):
        for entry in _debug_get_cache_entry_list(code):
            manager = entry.guard_manager
            if not manager.check(f_locals):
                out.append(None)
                continue
            t0 = time.perf_counter()
            for _ in range(calls):
                manager.check(f_locals)
            out.append((time.perf_counter() - t0) / calls * 1e6)
    return out


def inductor_modules() -> list[Any]:
    """The Python modules of the graphs Inductor compiled (or loaded) in this process."""
    from torch._inductor.codecache import PyCodeCache

    return list(PyCodeCache.modules)
