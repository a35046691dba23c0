"""The one place where ddp_fusion touches private torch APIs.

Everything here is underscore-prefixed upstream and has moved between releases. A torch
upgrade that breaks ddp_fusion should break in this file only. Supported: torch 2.11, 2.13.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

c10d_functional = torch.ops._c10d_functional

#: DDP's default size of the first (latency-sensitive) bucket, in bytes.
DEFAULT_FIRST_BUCKET_BYTES: int = dist._DEFAULT_FIRST_BUCKET_BYTES


def counters() -> dict[str, Any]:
    """``torch._dynamo.utils.counters``: a ``defaultdict(Counter)`` shared with Dynamo."""
    from torch._dynamo.utils import counters as _counters

    return _counters


def resolve_process_group(group_name: str) -> dist.ProcessGroup | None:
    """The process group registered under ``group_name`` in this process, or None."""
    try:
        return torch._C._distributed_c10d._resolve_process_group(group_name)
    except (RuntimeError, ValueError):
        return None


def compute_bucket_assignment_by_size(
    tensors: list[torch.Tensor], limits: list[int], tensor_indices: list[int]
) -> list[list[int]]:
    """Eager DDP's own C++ bucketing, used by tests as the reference for our planner."""
    indices, _ = dist._compute_bucket_assignment_by_size(
        tensors, limits, [False] * len(tensors), tensor_indices
    )
    return [list(b) for b in indices]


def detect_fake_mode(values: Any) -> Any:
    from torch._guards import detect_fake_mode as _detect

    return _detect(values)


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Re-sort ``graph`` so every node follows its inputs, moving as few nodes as
    possible (nodes that are already in order keep it)."""
    from torch._inductor.pattern_matcher import stable_topological_sort as _sort

    _sort(graph)


def enable_compiled_autograd(compiler_fn: Callable[..., Any]) -> AbstractContextManager[None]:
    """Compiled autograd for every ``backward()`` while the returned context is open."""
    from torch._dynamo import compiled_autograd

    # `_enable` since torch 2.7; `enable` before (same signature).
    enable = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable
    return enable(compiler_fn)


def inductor_options_keeping_node_order() -> dict[str, Any]:
    """Inductor options that keep a post-grad graph's node order through scheduling.

    Inductor's ``reorder_for_peak_memory`` (on by default since torch 2.6) re-sorts the
    scheduled nodes to lower the estimated peak memory. For a fused bucket that pulls
    the wait and unpacking of the reduced buffer up to right after the collective and
    pushes the collective down (both shorten the buffer's life), which undoes
    ``schedule.sink_waits``: no backward compute is left between issue and wait.
    """
    if hasattr(inductor_config(), "reorder_for_peak_memory"):
        return {"reorder_for_peak_memory": False}
    return {}


def allow_dtensor_post_accumulate_grad_hooks() -> None:
    """Let compiled autograd trace post-accumulate-grad hooks of DTensor parameters.

    Tracing such a hook, compiled autograd copies the parameter with
    ``clone_preserve_strides``, which calls ``as_strided``; DTensor does not implement
    ``as_strided``, so the backward fails (torch 2.11 to 2.13). A DTensor's own
    ``clone()`` keeps its placements and its local shard's strides, which is what that
    copy is for; every other tensor still goes through torch's function. Idempotent.
    """
    from torch._dynamo import compiled_autograd

    original = getattr(compiled_autograd, "maybe_clone", None)
    if original is None or getattr(original, "_ddp_fusion_dtensor_aware", False):
        return

    def maybe_clone(x: torch.Tensor | None) -> torch.Tensor | None:
        return x.clone() if x is not None and is_dtensor(x) else original(x)

    maybe_clone._ddp_fusion_dtensor_aware = True  # type: ignore[attr-defined]
    compiled_autograd.maybe_clone = maybe_clone


def compiled_autograd_active() -> bool:
    from torch._dynamo import compiled_autograd

    return bool(compiled_autograd.compiled_autograd_enabled)


def hash_files(paths: tuple[str, ...], extra: str) -> bytes:
    from torch._inductor.custom_graph_pass import get_hash_for_files

    return get_hash_for_files(paths, extra)


def inductor_config() -> Any:
    import torch._inductor.config as inductor_config

    return inductor_config


def custom_graph_pass_base() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def fake_store() -> Any:
    """A store for ``backend="fake"`` process groups (graph tests, examples)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()



def disable_compiled_autograd() -> AbstractContextManager[None]:
    """Eager autograd inside the block, even while ``enable_compiled_autograd`` is open."""
    from torch._dynamo import compiled_autograd

    return compiled_autograd._disable()


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has finished (call from a hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def current_backward_id() -> int:
    """An id of the running backward pass (-1 outside one); differs between passes."""
    return torch._C._current_graph_task_id()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (what data parallelism reduces), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def as_like(ref: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` wrapped as a DTensor laid out like ``ref`` if ``ref`` is one, else itself."""
    from torch.distributed.tensor import DTensor

    if not is_dtensor(ref):
        return local
    return DTensor.from_local(
        local, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape, stride=ref.stride()
    )


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def fake_view(mode: Any, base: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """``base.view(shape)`` for a fake tensor, without a trip through fake dispatch (about
    5x faster; the pass makes one per gradient on each side). The meta view is rewrapped,
    so it shares ``base``'s storage exactly as a dispatched view would."""
    from torch._subclasses.fake_tensor import FakeTensor

    with torch._C._DisableTorchDispatch():
        out = torch.ops.aten.view.default(base, shape)
    if isinstance(out, FakeTensor):
        return out
    return mode.fake_tensor_converter.from_meta_and_device(mode, out, base.fake_device)