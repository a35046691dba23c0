"""Host-side agreement among a model's ranks: CPU tensors only, O(log N) rounds.

ddp_fusion's own cross-rank checks (the per-step plan check, plan_check.py; the settings
check at construction and at the first forward, and the choices group rank 0 makes for
everyone, grad_sync.py) exchange a few integers or a small object. On the model's own
process group (NCCL on GPUs) that would take device tensors, and reading the answer on
the host would be a device sync: the host would wait for the GPU to reach the
collective, losing its run-ahead in the middle of backward. So these exchanges go
through a :class:`HostGroup`, a gloo group of the same ranks that only ever moves CPU
tensors, which the host reads directly (through numpy, never ``Tensor.item``):

* :meth:`HostGroup.max_async` / :meth:`~HostGroup.max`: the element-wise max of a few
  int64 over the ranks, by recursive doubling on point-to-point messages:
  ``ceil(log2 N)`` rounds, plus two when N is not a power of two (gloo's own all-reduce
  is a ring: ``2 (N - 1)`` steps). "Do all ranks hold h?" is ``max(h, -h)``: all agree
  exactly when both maxima give back h. A rank that takes no part in a decision (a
  joined rank) sends :data:`NEUTRAL`, which never wins.
* :meth:`HostGroup.broadcast_object`: gloo's broadcast, a binomial tree
  (``ceil(log2 N)`` rounds).
* :meth:`HostGroup.report`: on an error path only, a description of what the ranks
  hold, through the default store: each rank writes one key, group rank 0 reads them all
  (one ``multi_get``) and writes the description, which every rank then reads. O(1)
  store operations per rank but rank 0's.

Every exchange runs on the group's own thread in the order it was asked for, which is
the same on every rank, so a caller can start one and collect it later (the plan check
starts at the beginning of backward and waits where the first bucket is issued). A
peer that never comes fails the exchange after the model group's timeout.

The gloo group is made without any collective (no other rank needs to be there): over
the default store, under a prefix named after the model's group, and it connects lazily,
each rank only to the peers it exchanges with (``O(log N)`` of them), not to every rank.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import pickle
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import _torch

NEUTRAL = -(1 << 63)
"""What a rank that takes no part in a :meth:`HostGroup.max` sends: int64's minimum."""

#: Test hook: make host groups (and so run every check) also for groups of one rank,
#: which have no peers to disagree with (the GPU suite forces the plan check on at world
#: size 1 this way). Groups of the ``fake`` backend never get one.
FORCE = False

#: Seconds a rank waits for group rank 0's description of a disagreement.
REPORT_TIMEOUT_S = 30.0


def has_peers(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` has other ranks to exchange with (not size 1, not the ``fake``
    backend of graph tests)."""
    return group.size() > 1 and dist.get_backend(group) != "fake"


class HostGroup:
    """A gloo group over the ranks of ``group``, for host-side exchanges (module
    docstring). Made by :func:`of`."""

    def __init__(self, group: dist.ProcessGroup, prefix: str) -> None:
        self.group_name = group.group_name
        self.rank, self.size = group.rank(), group.size()
        try:
            self.global_ranks = dist.get_process_group_ranks(group)
        except Exception:  # noqa: BLE001 - a group c10d does not know: its own ranks
            self.global_ranks = list(range(self.size))
        self.prefix = prefix
        self.timeout: datetime.timedelta = _torch.distributed.group_timeout(group)
        self._pg = _torch.distributed.lazy_gloo_group(prefix, self.rank, self.size, self.timeout)
        self._tickets = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=_serve, args=(self._jobs,), name=f"ddp_fusion host group {self.group_name}", daemon=True
        )
        self._thread.start()

    def ranks(self, ranks: Sequence[int]) -> str:
        """Group ranks as a user reads them: ``0-3, 7``, with their global ranks
        (which logs carry) where those differ."""
        text = _ranges(ranks)
        global_ranks = [self.global_ranks[r] for r in ranks]
        return text if global_ranks == list(ranks) else f"{text} (global {_ranges(global_ranks)})"

    def ticket(self) -> int:
        """Number the next exchange asked for (the same number on every rank, which ask
        for the same exchanges in the same order): names its :meth:`report`."""
        self._tickets += 1
        return self._tickets

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future

    def max_async(self, values: Sequence[int]) -> concurrent.futures.Future:
        """Start the element-wise max of ``values`` (int64) over the ranks; the future's
        result is a list of ints."""
        mine = np.array(values, dtype=np.int64)
        return self._submit(lambda: self._max(mine))

    def max(self, values: Sequence[int]) -> list[int]:
        """The element-wise max of ``values`` (int64) over the ranks (blocks)."""
        return self.max_async(values).result()

    def agree(self, value: int) -> bool:
        """Whether every rank passed the same ``value`` (blocks)."""
        top, neg_bottom = self.max([value, -value])
        return top == value and -neg_bottom == value

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Group rank ``src``'s ``obj`` (picklable), on every rank (blocks)."""
        return self._submit(lambda: self._broadcast(obj, src)).result()

    def report(self, topic: str, ticket: int, mine: str, describe: Callable[[list[str]], str]) -> str:
        """What group rank 0 makes of every rank's ``mine``: ``describe(payloads)``, the
        payloads in group rank order. Call it on every rank, with a ``ticket`` taken for
        the exchange that found the disagreement. For error paths only."""
        store = _torch.distributed.default_store()
        base = f"{self.prefix}/report/{topic}/{ticket}"
        store.set(f"{base}/{self.rank}", mine)
        key = f"{base}/described"
        if self.rank == 0:
            payloads = [v.decode() for v in store.multi_get([f"{base}/{r}" for r in range(self.size)])]
            try:
                text = describe(payloads)
            except Exception as e:  # noqa: BLE001 - the ranks must still hear something
                text = f"(describing it failed: {type(e).__name__}: {e})"
            store.set(key, text)
            return text
        try:
            store.wait([key], datetime.timedelta(seconds=REPORT_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - rank 0 gone or stuck: say what this rank knows
            return f"(group rank 0 did not describe it within {REPORT_TIMEOUT_S:.0f} s; this rank: {mine})"
        return store.get(key).decode()

    # -- on the group's thread ------------------------------------------------------
    def _max(self, mine: np.ndarray) -> list[int]:
        rank, size, pg = self.rank, self.size, self._pg
        buf = torch.from_numpy(mine)  # host-side on purpose: the gloo group's own tensors
        got = torch.empty_like(buf)
        values, received = buf.numpy(), got.numpy()
        p = 1 << (size.bit_length() - 1)  # the largest power of two <= size
        if rank >= p:  # fold into rank - p, then take its result
            pg.send([buf], rank - p, 0).wait()
            pg.recv([buf], rank - p, 0).wait()
            return values.tolist()
        if rank + p < size:
            pg.recv([got], rank + p, 0).wait()
            np.maximum(values, received, out=values)
        mask = 1
        while mask < p:
            peer = rank ^ mask
            send, recv = pg.send([buf], peer, 0), pg.recv([got], peer, 0)
            send.wait()
            recv.wait()
            np.maximum(values, received, out=values)
            mask <<= 1
        if rank + p < size:
            pg.send([buf], rank + p, 0).wait()
        return values.tolist()

    def _broadcast(self, obj: Any, src: int) -> Any:
        if self.size == 1:
            return obj
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        data = pickle.dumps(obj) if self.rank == src else b""
        length = torch.tensor([len(data)], dtype=torch.int64, device="cpu")  # host-side on purpose
        self._pg.broadcast([length], opts).wait()
        n = int(length.numpy()[0])
        payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src
                   else torch.empty(n, dtype=torch.uint8, device="cpu"))  # host-side on purpose
        self._pg.broadcast([payload], opts).wait()
        return obj if self.rank == src else pickle.loads(payload.numpy().tobytes())


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    out, start = [], ranks[0]
    for prev, r in zip(ranks, [*ranks[1:], None]):
        if r is None or r != prev + 1:  # a run of consecutive ranks ends at prev
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = r
    return ", ".join(out)


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        fn, future = jobs.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(e)


# group name -> (weak reference to the group, its host group)
_groups: dict[str, tuple[weakref.ref, HostGroup]] = {}
_made: dict[str, int] = {}


def of(group: dist.ProcessGroup) -> HostGroup | None:
    """``group``'s host group (made the first time; None for a group without peers,
    unless :data:`FORCE`, and always for the ``fake`` backend). A group made again under
    the same name (a new ``init_process_group``) gets a new one."""
    if not (has_peers(group) or (FORCE and dist.get_backend(group) != "fake")):
        return None
    name = _torch.distributed.ensure_group_name(group)
    known = _groups.get(name)
    if known is not None and known[0]() is group:
        return known[1]
    # numbered per name: every rank makes its groups in the same order
    _made[name] = _made.get(name, 0) + 1
    host = HostGroup(group, f"ddp_fusion/host/{name}/{_made[name]}")
    _groups[name] = (weakref.ref(group), host)
    return host
