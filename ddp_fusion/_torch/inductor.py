"""Inductor: the post-grad pass slot, hashing a pass for the FX graph cache, the backend
compiled autograd compiles backward graphs with, and the options ddp_fusion sets per graph."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx

from . import patching

REQUIRED = (
    "torch._inductor.config.post_grad_custom_post_pass",
    "torch._inductor.custom_graph_pass.CustomGraphPass.register",
    "torch._inductor.custom_graph_pass.get_hash_for_files",
    "torch._inductor.pattern_matcher.stable_topological_sort",
    "torch._TorchCompileInductorWrapper",
    "torch._inductor.graph.GraphLowering.__init__",
    "torch._inductor.codegen.wrapper.PythonWrapperCodegen.codegen_input_size_asserts",
    "torch._inductor.config.cpp_wrapper",
)

#: Attributes of objects (not importable names) this module reads, and why that is safe.
UNCHECKED = {
    "_fuse_ddp_communication": "an Inductor option, set only where hasattr says it exists",
}


def config() -> Any:
    """``torch._inductor.config`` (the shim reads option names off it)."""
    import torch._inductor.config as inductor_config

    return inductor_config


def cpp_wrapper() -> bool:
    """Whether the graph being compiled gets C++ wrapper code (``cpp_wrapper``, which
    AOTInductor turns on too): its ``str`` arguments of ops become C++ string literals,
    written as they are, without escaping."""
    return bool(config().cpp_wrapper)


POST_GRAD_SLOT = patching.Setting(
    "torch._inductor.config.post_grad_custom_post_pass",
    lambda: config().post_grad_custom_post_pass,
    lambda graph_pass: setattr(config(), "post_grad_custom_post_pass", graph_pass),
)
"""Inductor's post-grad custom slot, which Inductor runs on every graph it compiles after
its own passes (a ``CustomGraphPass``, or None), as a setting of :class:`patching.Patches`."""


def fill_post_grad_slot(patches: patching.Patches, make: Callable[[Any], Any]) -> None:
    """Put ``make(the pass in the slot now)`` in Inductor's post-grad custom slot until
    ``patches`` is restored (nothing to do while ours is there)."""
    patches.wrap(POST_GRAD_SLOT, make)


def without_post_grad_pass() -> Any:
    """A context in which Inductor's post-grad custom slot is empty."""
    return config().patch(post_grad_custom_post_pass=None)


def register_graph_pass(cls: type) -> None:
    """Make ``cls`` (a callable on a graph with a ``uuid()``) a virtual subclass of
    Inductor's ``CustomGraphPass``, which is what Inductor checks to cache graphs
    compiled with it (an ABC: no need to import Inductor to define ``cls``)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    CustomGraphPass.register(cls)


def is_graph_pass(obj: Any) -> bool:
    """Whether Inductor takes ``obj`` as a ``CustomGraphPass`` (it has a ``uuid()``)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return isinstance(obj, CustomGraphPass)


def hash_files(paths: tuple[str, ...], extra: str) -> bytes:
    """A hash of the files' contents and ``extra``: a ``CustomGraphPass.uuid()``."""
    from torch._inductor.custom_graph_pass import get_hash_for_files

    return get_hash_for_files(paths, extra)


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Re-sort ``graph`` so every node follows its inputs, moving as few nodes as
    possible (nodes that are already in order keep it)."""
    from torch._inductor.pattern_matcher import stable_topological_sort as _sort

    _sort(graph)


def backend(
    mode: str | None, options: dict[str, Any] | None, dynamic: bool | None,
    extra_patches: Callable[[torch.fx.GraphModule], dict[str, Any]],
    on_lowering: Callable[[torch.fx.GraphModule], None] | None = None,
    input_asserts: bool = True,
) -> Any:
    """The backend ``torch.compile(backend="inductor", mode=, options=, dynamic=)`` uses,
    plus ``extra_patches(graph)``: Inductor config patches chosen per Dynamo graph;
    ``on_lowering(gm)``, called with each post-grad graph Inductor lowers to code (after
    all its graph passes, its re-inplacing included), before it lowers it; and without
    ``input_asserts``, code that does not check its inputs' sizes and strides
    (:func:`_without_input_asserts`)."""
    from torch import _TorchCompileInductorWrapper

    class Backend(_TorchCompileInductorWrapper):
        def __call__(self, model_: Any, inputs_: Any, **kwargs: Any) -> Any:
            # The wrapper compiles with its ``config``; widen it for this graph only
            # (torch 2.13 also takes config_patches=, older releases do not).
            saved = self.config
            self.config = {**saved, **extra_patches(model_)}
            try:
                with _watching_lowering(on_lowering), _without_input_asserts(not input_asserts):
                    return super().__call__(model_, inputs_, **kwargs)
            finally:
                self.config = saved

    return Backend(mode, options, dynamic)


@contextlib.contextmanager
def _without_input_asserts(active: bool) -> Iterator[None]:
    """While ``active``: Inductor's generated code does not check its graph inputs' sizes
    and strides (``assert_size_stride(arg, ..., 'input')``, one call per tensor input per
    run, about 0.4-1 us each on the host). Only for graphs whose every input Dynamo's
    guards check already (sizes and strides: ``TENSOR_MATCH``, and the shape guards of
    dynamic sizes), as compiled autograd's graphs are: the frame Dynamo compiles takes
    them as its ``inputs``. The other asserts of ``config.size_asserts`` (on the outputs
    of fallback kernels, which no guard sees) stay."""
    if not active:
        yield
        return
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    original = PythonWrapperCodegen.codegen_input_size_asserts
    PythonWrapperCodegen.codegen_input_size_asserts = lambda self: None
    try:
        yield
    finally:
        PythonWrapperCodegen.codegen_input_size_asserts = original


_watched: list[bool] = []


def lowering_watched() -> bool:
    """Whether the graph being compiled goes through a :func:`backend` with an
    ``on_lowering`` (which will see its final form)."""
    return bool(_watched)


@contextlib.contextmanager
def _watching_lowering(on_lowering: Callable[[torch.fx.GraphModule], None] | None) -> Iterator[None]:
    if on_lowering is None:
        yield
        return
    from torch._inductor.graph import GraphLowering

    original = GraphLowering.__init__

    def __init__(self: Any, gm: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        on_lowering(gm)
        original(self, gm, *args, **kwargs)

    GraphLowering.__init__ = __init__
    _watched.append(True)
    try:
        yield
    finally:
        _watched.pop()
        GraphLowering.__init__ = original


def options_without_upstream_ddp_fusion() -> dict[str, Any]:
    """Keep upstream's ``_fuse_ddp_communication`` pass (which torch DDP turns on
    process-wide under ``optimize_ddp="python_reducer"``) off a graph ddp_fusion fuses."""
    if hasattr(config(), "_fuse_ddp_communication"):
        return {"_fuse_ddp_communication": False}
    return {}


def options_keeping_node_order() -> dict[str, Any]:
    """Inductor options that keep a post-grad graph's node order through scheduling.

    Inductor's ``reorder_for_peak_memory`` (on by default since torch 2.6) re-sorts the
    scheduled nodes to lower the estimated peak memory. For a fused bucket that pulls
    the wait and unpacking of the reduced buffer up to right after the collective and
    pushes the collective down (both shorten the buffer's life), which undoes
    ``schedule.sink_waits``: no backward compute is left between issue and wait.
    """
    if hasattr(config(), "reorder_for_peak_memory"):
        return {"reorder_for_peak_memory": False}
    return {}


# pairwise fusion attempts per node within one buffer's group of readers: enough for
# Inductor to merge a bucket's scaled copies over its rounds (it fuses neighbours, then
# neighbours of the fused nodes), an eighth of torch's default checks per node
FUSION_ATTEMPTS_PER_SHARED_BUFFER = 8


def options_bounding_fusion_search() -> dict[str, Any]:
    """Inductor options that bound its search for fusions among the nodes that read one
    buffer. Every gradient's scaled copy into its bucket reads the bucket's divisor (one
    device scalar), so the divisor's readers are one group of as many nodes as the graph
    has gradients, and Inductor checks each node against the next
    ``max_fusion_buffer_group_pairwise_attempts`` (default 64) of them in every fusion
    round, each check costlier as the fused nodes grow: 26 s of a 99 s cold first step
    on a model of 402 parameters (bench/results/compile_time_cpu_2026-11-27.md), for
    the same generated code as with 8. Never raises the user's own setting."""
    name = "max_fusion_buffer_group_pairwise_attempts"
    if not hasattr(config(), name):
        return {}
    return {name: min(getattr(config(), name), FUSION_ATTEMPTS_PER_SHARED_BUFFER)}


def options_emulating_precision_casts() -> dict[str, Any]:
    """Inductor options that keep each cast to a lower precision (a rounding) where the
    graph has one, instead of fusing it into fp32 math around it."""
    if hasattr(config(), "emulate_precision_casts"):
        return {"emulate_precision_casts": True}
    return {}
