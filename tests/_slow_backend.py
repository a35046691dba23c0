"""A c10d backend for tests whose all-reduces complete late: ``"slow"``.

gloo finishes a collective soon after it is issued, so on the CPU a reduced buffer read
before its wait usually holds the right values already; on NCCL it does not. This
backend makes such a read wrong every time. Each all-reduce (plain or coalesced) is
issued at once and returns a work; at issue the tensors are filled with NaN, and the sum
(computed over a real gloo group of the same ranks) is written into them only when the
collective completes, :data:`DELAY_S` later, on the group's own thread. The work's
``wait`` (and its future) returns after that. Other collectives go straight to the gloo
group.

On CUDA tensors the result is written on a side stream that first sleeps
(``torch.cuda._sleep``), and ``wait`` makes the current stream wait for it: a kernel
that reads the buffer before its wait reads NaN, and under ``TORCH_CUDA_SANITIZER=1``
the sanitizer reports the unsynchronized access.

    register()                                    # every rank, once
    slow = torch.distributed.new_group(backend="slow")

Each group counts the collectives it was asked for (``issued``) and those whose wait
was called (``waited``).
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

NAME = "slow"
DELAY_S = 0.02
#: CUDA: cycles the side stream sleeps before it writes a result (about 20 ms on an H100)
SLEEP_CYCLES = 20_000_000


def register() -> None:
    """Make ``dist.new_group(backend="slow")`` build a :class:`SlowGroup` (CPU and
    CUDA tensors)."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, SlowGroup, devices=["cpu", "cuda"])


def _garbage(t: torch.Tensor) -> None:
    t.fill_(float("nan") if t.is_floating_point() else -12345)


class SlowGroup(dist.ProcessGroup):
    """See the module docstring. Made by c10d (``new_group(backend="slow")``)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self.inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        # (a group keeps its name in its backends: c10d names this one after it; every
        # collective still goes through this class's methods)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.inner)
        self.issued = self.waited = 0
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._complete, name="slow backend", daemon=True)
        self._thread.start()

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    # -- the late ones -------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.AllreduceOptions()
        return self._late(tensors, lambda scratch: self.inner.allreduce(scratch, opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.AllreduceCoalescedOptions()
        return self._late(tensors, lambda scratch: self.inner.allreduce_coalesced(scratch, opts))

    def _late(self, tensors: list[torch.Tensor], issue: Any) -> dist.Work:
        self.issued += 1
        scratch = [t.detach().to("cpu", copy=True) for t in tensors]  # what the ranks sum
        for t in tensors:
            _garbage(t)
        work = _LateWork(self, tensors)
        if tensors and tensors[0].is_cuda:  # the result lands after the garbage
            work.issued = torch.cuda.Event()
            work.issued.record()
            # a CUDA-aware future, as NCCL's: waiting for it orders the waiter's stream
            work.future = torch.futures.Future(devices=[tensors[0].device])
        self._done.put((issue(scratch), scratch, work))
        return work

    def _complete(self) -> None:
        while True:
            inner, scratch, work = self._done.get()
            try:
                inner.wait()
                time.sleep(DELAY_S)
                work.land(scratch)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                work.fail(e)

    # -- the rest, as gloo does them -------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self.inner.broadcast(tensors, opts or dist.BroadcastOptions())

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        return self.inner.allgather(outputs, inputs, opts or dist.AllgatherOptions())

    def barrier(self, opts: Any = None) -> dist.Work:
        return self.inner.barrier(opts or dist.BarrierOptions())


class _LateWork(dist.Work):
    def __init__(self, group: SlowGroup, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.group, self.tensors = group, tensors
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.future: torch.futures.Future = torch.futures.Future()
        self.issued: Any = None  # CUDA: the issuing stream's event after the garbage
        self.event: Any = None  # CUDA: the side stream's event after the result
        self.keep: list[torch.Tensor] = []

    def land(self, scratch: list[torch.Tensor]) -> None:
        """The collective completes: its result goes into the tensors (CUDA: on a side
        stream that sleeps first)."""
        if self.tensors and self.tensors[0].is_cuda:
            device = self.tensors[0].device
            with torch.cuda.device(device):
                stream = torch.cuda.Stream()
                self.keep = [s.pin_memory() for s in scratch]  # (until the copies are done)
                with torch.cuda.stream(stream):
                    stream.wait_event(self.issued)
                    torch.cuda._sleep(SLEEP_CYCLES)
                    for t, s in zip(self.tensors, self.keep):
                        t.copy_(s, non_blocking=True)
                    self.event = torch.cuda.Event()
                    self.event.record(stream)
                    self.done.set()
                    self.future.set_result(self.tensors)  # (its events: on the side stream)
            return
        for t, s in zip(self.tensors, scratch):
            t.copy_(s)
        self.done.set()
        self.future.set_result(self.tensors)

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()
        self.future.set_exception(error)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.group.waited += 1
        if not self.done.wait(None if timeout is None or not timeout else timeout.total_seconds()):
            raise RuntimeError("slow backend: a collective did not complete within its timeout")
        if self.error is not None:
            raise self.error
        if self.event is not None:
            torch.cuda.current_stream(self.tensors[0].device).wait_event(self.event)
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()

    def get_future(self) -> torch.futures.Future:
        return self.future
