"""DDP communication hooks (``register_comm_hook(state, hook)``) on ddp_fusion's buckets.

A hook gets each bucket as torch DDP gives it (:class:`GradBucket`: the flat, unscaled
gradients of the bucket, its index, whether it is the last, per-parameter views, the
parameters) and returns a ``torch.futures.Future`` of the reduced flat tensor.

Compiled, the pass fuses a hooked model's bucket exactly as it fuses a plain one
(``concat``: the gradients copied into one flat buffer), but sends the buffer to a
*bucket group* instead of the model's process group::

    flat = cat([g1 / 1, ..., gn / 1])          # the plan guard's 1: the hook scales
    red  = _c10d_functional.all_reduce(flat, "sum", "ddp_fusion_hook_<model>_<plan>_<bucket>")
    ...                                          # rest of backward
    red  = _c10d_functional.wait_tensor(red)     # where the plain bucket waits

A bucket group is a Python :class:`torch.distributed.ProcessGroup` registered under
that name (by the pass when it compiles, and by the plan check when a graph runs, for
graphs served from Inductor's cache). Its ``allreduce`` calls the hook on the buffer
and returns the hook's future as the collective's work; its ``wait`` is the
``wait_tensor``: it waits for the future (bounded by the model's process-group
timeout), checks the result and, if the hook returned another tensor, copies it into
the buffer. So Inductor treats a hook's bucket like any collective (the buffer lives
until the wait; the reduced gradients are views of it), and a hook's communication
overlaps the rest of backward as a plain bucket's does. Uncompiled, the eager reducer
(reducer.py) calls the same hook on its buckets.

Order: every rank calls the hooks in bucket order, and a bucket's hook is called only
once the previous bucket's future (of any ddp_fusion model in the process) has
completed. Hooks that issue collectives from their futures' callbacks (PowerSGD's
chained all-reduces) then issue them in the same order on every rank; with gloo, whose
futures complete on its own threads, eager torch DDP does not guarantee that and can
fail ("Received data size doesn't match expected size"). With NCCL a collective's
future completes when it is enqueued, so the wait costs the host nothing there.
"""

from __future__ import annotations

import datetime
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import _native, _torch


class GradBucket:
    """What torch's ``dist.GradBucket`` offers a comm hook, for one fused bucket."""

    def __init__(
        self,
        index: int,
        count: int,
        buffer: torch.Tensor,
        parameters: Sequence[torch.Tensor],
    ) -> None:
        self._index, self._count = index, count
        self._buffer = buffer
        self._parameters = list(parameters)
        self._lengths = [_torch.tensors.local_tensor(p.detach()).numel() for p in self._parameters]
        self._offsets = [sum(self._lengths[:i]) for i in range(len(self._lengths))]

    def index(self) -> int:
        """The bucket's position in the order buckets are reduced (0: the first)."""
        return self._index

    def is_last(self) -> bool:
        """Whether this is the last bucket of the step."""
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        """The bucket's gradients, flat and unscaled (the hook averages them)."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer (torch's compress wrappers hand a cast buffer on)."""
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        """Per parameter, a view of the buffer with the parameter's (local) shape."""
        return [
            self._buffer[o : o + n].view(_torch.tensors.local_tensor(p.detach()).shape)
            for o, n, p in zip(self._offsets, self._lengths, self._parameters)
        ]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._parameters)

    def offsets(self) -> list[int]:
        return list(self._offsets)

    def lengths(self) -> list[int]:
        return list(self._lengths)


class CommHookError(RuntimeError):
    """A comm hook raised, returned something that is not the bucket's reduced
    gradients, or did not complete within the process group's timeout."""


class _Flight:
    """One bucket's hook call, from its start to its wait."""

    def __init__(self, hook: CommHook, bucket: GradBucket, names: Sequence[str]) -> None:
        self.hook, self.bucket, self.names = hook, bucket, list(names)
        self.buffer = bucket.buffer()  # what the reduced gradients must end up in
        self.future: torch.futures.Future | None = None
        self.done = threading.Event()

    def describe(self) -> str:
        names = ", ".join(self.names[:4]) + (" ..." if len(self.names) > 4 else "")
        return (f"comm hook {self.hook.name} on bucket {self.bucket.index()} "
                f"({len(self.names)} gradients: {names}) of {self.hook.who}")

    def wait(self) -> None:
        """Until the hook's future completes, at most the process group's timeout."""
        if not self.done.wait(self.hook.timeout.total_seconds()):
            raise CommHookError(
                f"ddp_fusion: the {self.describe()} did not complete within the process "
                f"group's timeout ({self.hook.timeout}); its future was never set"
            )


_in_flight: list[_Flight] = []  # the last bucket whose hook was called, until done


class CommHook:
    """A model's registered ``(state, hook)``, called once per bucket per step."""

    def __init__(self, state: Any, hook: Callable[..., Any], group: dist.ProcessGroup,
                 params: Sequence[tuple[str, torch.Tensor]], who: str) -> None:
        self.state, self.hook, self.group, self.who = state, hook, group, who
        self.name = getattr(hook, "__qualname__", None) or repr(hook)
        self.params = dict(params)
        self.timeout = _torch.distributed.group_timeout(group)

    def start(self, index: int, count: int, buffer: torch.Tensor, names: Sequence[str]) -> _Flight:
        """Call the hook on bucket ``index`` of ``count`` (after the previous bucket's
        hook has completed: see the module docstring)."""
        if _in_flight:
            previous = _in_flight.pop()
            previous.wait()
        bucket = GradBucket(index, count, buffer, [self.params[n] for n in names])
        flight = _Flight(self, bucket, names)
        try:
            future = self.hook(self.state, bucket)
        except Exception as e:
            raise CommHookError(f"ddp_fusion: the {flight.describe()} raised {type(e).__name__}: {e}") from e
        if not _torch.distributed.is_future(future):
            raise CommHookError(
                f"ddp_fusion: the {flight.describe()} returned {type(future).__name__}; a comm "
                "hook returns a torch.futures.Future of the bucket's reduced gradients"
            )
        flight.future = future
        future.add_done_callback(lambda _: flight.done.set())
        _in_flight.append(flight)
        return flight

    def finish(self, flight: _Flight) -> None:
        """Wait for the hook's future and put its result into the bucket's buffer."""
        try:
            flight.wait()
            try:
                # wait(), not value(): with CUDA tensors it makes the current stream wait
                # for the future's (NCCL completes a future when it enqueues)
                value = flight.future.wait()
            except Exception as e:
                raise CommHookError(
                    f"ddp_fusion: the future of the {flight.describe()} failed: "
                    f"{type(e).__name__}: {e}") from e
            result = value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value
            buffer = flight.buffer
            if not isinstance(result, torch.Tensor):
                raise CommHookError(
                    f"ddp_fusion: the {flight.describe()} completed with "
                    f"{type(result).__name__}; expected the bucket's reduced gradients, a "
                    f"tensor of {buffer.numel()} elements")
            if result.numel() != buffer.numel() or not (
                result.is_floating_point() and buffer.is_floating_point()
                or result.dtype == buffer.dtype
            ):
                raise CommHookError(
                    f"ddp_fusion: the {flight.describe()} completed with a {result.dtype} tensor "
                    f"of shape {tuple(result.shape)}; expected the bucket's reduced gradients: "
                    f"{buffer.numel()} elements of a floating-point dtype (its own, "
                    f"{buffer.dtype}, or one it is cast back from)")
            if not (result.data_ptr() == buffer.data_ptr() and result.dtype == buffer.dtype):
                buffer.copy_(result.reshape(-1))
        finally:
            if _in_flight and _in_flight[-1] is flight:
                _in_flight.pop()


def pending() -> int:
    """Comm hook calls whose bucket has not been waited for: none between steps (see
    ``ddp_fusion.pending``)."""
    return len(_in_flight)


def drop_in_flight() -> None:
    """Forget a hook left in flight by a backward that failed halfway (a backward that
    completes has waited for all of its own). Called when a backward starts."""
    _in_flight.clear()


def wait_in_flight() -> None:
    """Before another collective on a hooked model's group (the used-parameter bitmap):
    let the last hook's chained collectives finish first, as start() does for the next
    bucket's hook."""
    if _in_flight:
        _in_flight[-1].wait()


# -- bucket groups: the compiled path's door to the hooks ------------------------------

# model id (the tagged all-reduce's ``model_id``) -> its CommHook
_hooks: dict[int, Callable[[], CommHook | None]] = {}


def register(model_id: int, hook: CommHook) -> None:
    """``hook`` reduces model ``model_id``'s buckets (ids of live models differ)."""
    _hooks[model_id] = weakref.ref(hook)
    native = _native.loaded()
    if native is not None:  # (no steady C++ plan check while hooks may be in flight: any_registered)
        native.forget_all()


def any_registered() -> bool:
    """Whether a comm hook was ever registered in this process. Until one is, no hook is
    ever in flight, so a steady step's plan check may skip :func:`drop_in_flight` (its
    C++ kernels do: plan_check.py)."""
    return bool(_hooks)


def group_name(model_id: int, plan: str, index: int) -> str:
    """The name of the bucket group of bucket ``index`` of model ``model_id`` in the
    bucket plan with id ``plan`` (each plan numbers its buckets from 0)."""
    return f"ddp_fusion_hook_{model_id}_{plan}_{index}"


class _BucketGroup(dist.ProcessGroup):
    """The process group a hooked bucket's all-reduce is issued to (module docstring)."""

    def __init__(self, model_id: int, index: int, count: int, names: Sequence[str],
                 rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.model_id, self.index, self.count, self.names = model_id, index, count, list(names)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "ddp_fusion_comm_hook"

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        ref = _hooks.get(self.model_id)
        hook = ref() if ref is not None else None
        if hook is None:
            raise RuntimeError(
                f"ddp_fusion: a compiled backward sends bucket {self.index} to the comm hook "
                f"of model {self.model_id}, which is gone or has no comm hook registered")
        return _HookWork(hook, hook.start(self.index, self.count, tensors[0], self.names))


class _HookWork(dist.Work):
    def __init__(self, hook: CommHook, flight: _Flight) -> None:
        super().__init__()
        self.hook, self.flight = hook, flight

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.hook.finish(self.flight)
        return True

    def is_completed(self) -> bool:  # noqa: N802
        return self.flight.done.is_set()


_groups: dict[str, _BucketGroup] = {}


def ensure_groups(model_id: int, plan: str, buckets: Sequence[Sequence[str]],
                  group: dist.ProcessGroup) -> list[str]:
    """Register the bucket groups of model ``model_id``'s hooked buckets in the bucket
    plan with id ``plan``, given each bucket's gradient names in plan order, unless they
    are registered already (``destroy_process_group`` unregisters every group); return
    their names."""
    names = []
    for index, grads in enumerate(buckets):
        name = group_name(model_id, plan, index)
        pg = _groups.get(name)
        if pg is None or _torch.distributed.resolve_process_group(name) is not pg:
            pg = _BucketGroup(model_id, index, len(buckets), grads, group.rank(), group.size())
            _torch.distributed.register_process_group(name, pg)
            _groups[name] = pg
        names.append(name)
    return names


def registered(names: Sequence[str]) -> bool:
    """Whether these bucket groups are (still) registered."""
    return all(_torch.distributed.resolve_process_group(n) is _groups.get(n) for n in names)
