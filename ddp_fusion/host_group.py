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
  int64 over the ranks, by recursive doubling on the gloo group's point-to-point
  ``send`` and ``recv``: ``ceil(log2 N)`` rounds, plus two when N is not a power of two
  (gloo's own all-reduce is a ring: ``2 (N - 1)`` steps). "Do all ranks hold h?" is
  ``max(h, -h)``: all agree exactly when both maxima give back h. A rank that takes no
  part in a decision (a joined rank) sends :data:`NEUTRAL`, which never wins.
* :meth:`HostGroup.broadcast_json`: gloo's broadcast, a binomial tree
  (``ceil(log2 N)`` rounds), of JSON (never a pickle: bytes from another rank are data).
* :meth:`HostGroup.report`: on an error path only, a description of what the ranks
  hold, through the default store: each rank writes one key, group rank 0 reads them all
  (one ``multi_get``) and writes the description, which every rank then reads. O(1)
  store operations per rank but rank 0's.

Exchanges run in the order they were asked for, which is the same on every rank, so a
caller can start one and collect it later (the plan check starts at the beginning of
backward and waits where the first bucket is issued). The max's rounds run on a C++
thread of the host group's own (``csrc/host_check.cpp``'s ``Exchanger``, built by
``_native.py``), which never takes the GIL: on a thread of this process's Python, each
round would wait for the GIL, which the main thread holds while it runs backward (up
to Python's switch interval, 5 ms, a round). Where the C++ part is not built, the same
rounds and messages run in Python on the group's thread (:class:`PythonRounds`), and
ranks with and without it work together. A rank whose round fails (its peer's process
ended, or it sent nothing within the model group's timeout) goes on with its other
rounds carrying the failure, so every rank's exchange fails at once with the same
reason, and every later exchange of the group fails with it (running its rounds, so that
a peer that missed it hears of it). Nothing but gloo moves
the bytes: no process, socket or protocol of ddp_fusion's own.

The gloo group is made over the default store, under a prefix named after the model's
group, and connects lazily, each rank only to the peers it exchanges with (``O(log N)``
of them), not to every rank. Making it is collective (every rank of the group makes its
host group where it builds its model): each rank says in the store where it listens
and counts itself in; once every rank has (within the group's timeout: a rank may come
late), the ranks run one exchange, which makes every connection a rank will use, bounded
by :data:`CONNECT_TIMEOUT_S`, not by the group's timeout. A rank that cannot make its
end, or ranks that cannot connect (gloo listens on the address the host's name resolves
to, unless ``GLOO_SOCKET_IFNAME`` names an interface: a name that resolves to
127.0.1.1 cannot be reached from another node), raise :class:`HostGroupError` on every
rank within seconds, naming the addresses and ``GLOO_SOCKET_IFNAME``.

A host group ends with its process group: when ``destroy_process_group`` unregisters
the group (c10d's unregister functions are wrapped, through ``_torch.patching``, while
any host group exists), when the group is garbage, or when a new group of the same name
takes its place. Its threads stop (an exchange not yet run fails, saying so), and the
gloo group (its sockets and threads) goes with them; using it after that raises
:class:`HostGroupError`.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import functools
import ipaddress
import json
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import _native, _torch
from .config import config
from .log import log

NEUTRAL = -(1 << 63)
"""What a rank that takes no part in a :meth:`HostGroup.max` sends: int64's minimum."""

#: Test hook: make host groups (and so run every check) also for groups of one rank,
#: which have no peers to disagree with (the GPU suite forces the plan check on at world
#: size 1 this way). Groups of the ``fake`` backend never get one.
FORCE = False

#: Seconds a rank waits for group rank 0's description of a disagreement.
REPORT_TIMEOUT_S = 30.0

#: Seconds the ranks of a new host group have to connect, once every rank has made its
#: end (at most the group's timeout).
CONNECT_TIMEOUT_S = 10.0

#: Seconds each round of a max may wait beyond the one before it: a rank whose earlier
#: round timed out tells its later peers before they time out themselves.
GRACE_S = 2.0

#: A message of the max is ``[kind, origin, peer, count, values...]``: kind :data:`FINE`,
#: or why the exchange failed at group rank ``origin`` (with ``peer``), then the number
#: of values; gloo's tag is ``TAG_BASE + count``: ranks that ask for exchanges of
#: different lengths never match each other's messages (gloo ends a process that
#: receives a message longer than the buffer posted for it), and time out instead.
TAG_BASE = 1 << 30
HEADER = 4
FINE, BROKEN, SILENT = range(3)

#: The most bytes :meth:`HostGroup.broadcast_json` moves (a ready order of a million
#: parameters is about 7 MB).
MAX_BROADCAST_BYTES = 64 << 20

#: Seconds ``destroy_process_group`` waits for the threads of the host groups it ends.
END_WAIT_S = 2.0


class HostGroupError(RuntimeError):
    """A host group could not be made or connected, or was used after its process group
    ended."""


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
        self._tickets = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ended: str | None = None
        connect_s = min(CONNECT_TIMEOUT_S, self.timeout.total_seconds())
        self._rounds = PythonRounds(self.rank, self.size)  # (where there is no C++ exchanger)
        module = native() if self.size > 1 else None  # (built before the ranks connect)
        pg = self._make(connect_s)
        # the C++ thread that runs the max's rounds (None: they run on the thread below)
        self._exchanger: NativeExchanger | None = None
        if module is not None:
            self._exchanger = NativeExchanger(
                module.Exchanger(pg, self.rank, self.size, self.timeout.total_seconds(), GRACE_S),
                self.timeout)
        # The thread and the exchanger hold the only lasting references to the gloo
        # group: when both stop, the group (its sockets, its threads) goes.
        self._thread = threading.Thread(
            target=_serve, args=(self._jobs, pg),
            name=f"ddp_fusion host group {self.group_name}", daemon=True,
        )
        del pg
        self._thread.start()
        try:
            self._connect(connect_s)
        except BaseException:
            self.end("it could not connect")
            raise

    def _make(self, connect_s: float) -> Any:
        """This rank's end of the gloo group, once every rank has made its own (or the
        group's timeout has passed: :class:`HostGroupError`)."""
        store = _torch.distributed.default_store()
        base = f"{self.prefix}/connect"
        store.set(f"{base}/where/{self.rank}", _where())
        try:
            pg = _torch.distributed.lazy_gloo_group(
                self.prefix, self.rank, self.size, datetime.timedelta(seconds=connect_s))
            failed = None
        except Exception as e:  # noqa: BLE001 - told to every rank, then raised
            failed = e
            store.set(f"{base}/failed", f"group rank {self.rank} ({_where()}) could not make its end of "
                                        f"the gloo group: {type(e).__name__}: {e}")
        if store.add(f"{base}/arrived", 1) == self.size:
            store.set(f"{base}/all", "1")
        if failed is not None:
            raise HostGroupError(self._cannot(store.get(f"{base}/failed").decode())) from failed
        try:
            store.wait([f"{base}/all"], self.timeout)
        except Exception as e:
            arrived = store.add(f"{base}/arrived", 0)
            raise HostGroupError(
                f"ddp_fusion: only {arrived} of the {self.size} ranks of process group "
                f"{self.group_name!r} made their host group (where they build a ddp_fusion model "
                f"on it) within the group's timeout ({self.timeout}): a rank died, or does not "
                "build the model with ddp_fusion (is ddp_fusion.config.enabled / DDP_FUSION=1 "
                "set on every rank, before it wraps the model in torch DDP?)"
            ) from e
        if store.check([f"{base}/failed"]):
            raise HostGroupError(self._cannot(store.get(f"{base}/failed").decode()))
        return pg

    def _connect(self, connect_s: float) -> None:
        """One exchange, which connects this rank to every peer it will exchange with;
        :class:`HostGroupError` if it does not complete within ``connect_s``."""
        exchange = self._max_async([0], datetime.timedelta(seconds=connect_s))
        try:
            exchange.result(timeout=connect_s + GRACE_S * (self.size.bit_length() + 2))
            return
        except concurrent.futures.TimeoutError:
            why = f"no answer within {connect_s:g} s"
        except Exception as e:  # noqa: BLE001 - gloo's error, in the message
            why = f"{type(e).__name__}: {e}"
        store = _torch.distributed.default_store()
        where = [f"group rank {p} ({store.get(f'{self.prefix}/connect/where/{p}').decode()})"
                 for p in peers(self.rank, self.size)]
        raise HostGroupError(self._cannot(
            f"group rank {self.rank} ({_where()}) could not exchange with "
            f"{', '.join(where)} ({why})"))

    def _cannot(self, what: str) -> str:
        return (
            f"ddp_fusion: the host group of process group {self.group_name!r} (a gloo group "
            f"over its ranks for ddp_fusion's cross-rank checks, on the CPU) cannot connect: "
            f"{what}. gloo listens on the address that the host's name resolves to, unless "
            "GLOO_SOCKET_IFNAME names the network interface to use: on a cluster, set "
            "GLOO_SOCKET_IFNAME on every rank to an interface the other nodes reach (the one "
            "NCCL_SOCKET_IFNAME names, say), and check that the nodes reach each other over TCP"
        )

    @property
    def exchanger(self) -> NativeExchanger | None:
        """The C++ thread that runs :meth:`max_async`'s rounds (None where the C++ part
        is not built, or for a group of one)."""
        return self._exchanger

    @property
    def ended(self) -> bool:
        """Whether the host group has ended (its process group is gone)."""
        return self._ended is not None

    def end(self, why: str, wait_s: float = 0.0) -> None:
        """End the host group: no exchange can be asked for any more; the C++ thread
        aborts its round in flight and fails those not yet run, the Python one stops after
        the exchanges already asked for (both waited for up to ``wait_s``), and the gloo
        group goes with them."""
        with self._lock:
            if self._ended is None:
                self._ended = why
                self._jobs.put(None)
        if self._exchanger is not None:
            self._exchanger.close(wait_s)
        if wait_s > 0 and threading.current_thread() is not self._thread:
            self._thread.join(wait_s)

    def ranks(self, ranks: Sequence[int]) -> str:
        """Group ranks as a user reads them: ``0-3, 7``, with their global ranks
        (which logs carry) where those differ."""
        text = _ranges(ranks)
        global_ranks = [self.global_ranks[r] for r in ranks]
        return text if global_ranks == list(ranks) else f"{text} (global {_ranges(global_ranks)})"

    def ticket(self) -> int:
        """Number the next exchange asked for (the same number on every rank, which ask
        for the same exchanges in the same order): names its :meth:`report`."""
        if self._exchanger is not None:  # (which the C++ plan check numbers with too)
            return self._exchanger.ticket()
        self._tickets += 1
        return self._tickets

    @property
    def tickets(self) -> int:
        """The tickets taken so far (:meth:`ticket`)."""
        if self._exchanger is not None:
            return self._exchanger.tickets
        return self._tickets

    def _submit(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(gloo group)`` on the group's thread."""
        with self._lock:
            self._check_open()
            return self._submit_locked(fn)

    def _submit_locked(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future

    def _check_open(self) -> None:
        if self._ended is not None:
            raise HostGroupError(
                f"ddp_fusion: the host group of process group {self.group_name!r} has ended "
                f"({self._ended}); a model built on that group cannot run any more: build it "
                "again on the group that replaces it"
            )

    def max_async(self, values: Sequence[int]) -> Exchange:
        """Start the element-wise max of ``values`` (int64) over the ranks; its
        ``.result()`` is a list of ints. The rounds run on the host group's C++ thread,
        or where it has none, on its Python thread (module docstring)."""
        return self._max_async(values, self.timeout)

    def _max_async(self, values: Sequence[int], timeout: datetime.timedelta) -> Exchange:
        with self._lock:
            self._check_open()
            if self._exchanger is not None:
                return self._exchanger.post(values, timeout)
            mine = [int(v) for v in values]
            return self._submit_locked(lambda pg: self._rounds.run(pg, mine, timeout))

    def max(self, values: Sequence[int]) -> list[int]:
        """The element-wise max of ``values`` (int64) over the ranks (blocks)."""
        return self.max_async(values).result()

    def agree(self, value: int) -> bool:
        """Whether every rank passed the same ``value`` (blocks)."""
        top, neg_bottom = self.max([value, -value])
        return top == value and -neg_bottom == value

    def broadcast_json(self, obj: Any, src: int = 0) -> Any:
        """Group rank ``src``'s ``obj`` (made of what JSON holds: lists come back for
        tuples), on every rank (blocks). The bytes another rank sends are data: JSON,
        never unpickled, at most :data:`MAX_BROADCAST_BYTES`, checked before they are
        received."""
        return self._submit(lambda pg: self._broadcast(pg, obj, src)).result()

    def report(self, topic: str, ticket: int, mine: str, describe: Callable[[dict[int, str]], str]) -> str:
        """What group rank 0 makes of every rank's ``mine``: ``describe(payloads)``, the
        payloads by group rank. Call it on every rank, with a ``ticket`` taken for the
        exchange that found the disagreement. For error paths only. Where group rank 0
        does not describe it within :data:`REPORT_TIMEOUT_S` (it left, or is stuck), or
        the store fails, a rank describes its own side: ``describe({rank: mine})``, and
        says so."""
        base = f"{self.prefix}/report/{topic}/{ticket}"
        key = f"{base}/described"
        try:
            store = _torch.distributed.default_store()
            store.set(f"{base}/{self.rank}", mine)
            if self.rank == 0:
                got = store.multi_get([f"{base}/{r}" for r in range(self.size)])
                text = _described(describe, {r: v.decode() for r, v in enumerate(got)})
                store.set(key, text)
                return text
            store.wait([key], datetime.timedelta(seconds=REPORT_TIMEOUT_S))
            return store.get(key).decode()
        except Exception as e:  # noqa: BLE001 - rank 0 gone or stuck: say what this rank knows
            why = (f"group rank 0 did not describe the other ranks within {REPORT_TIMEOUT_S:g} s"
                   if self.rank != 0 else f"the store failed: {type(e).__name__}: {e}")
            return (f"{_described(describe, {self.rank: mine})}\n"
                    f"  ({why}: this is group rank {self.rank}'s side only)")

    # -- on the group's thread ------------------------------------------------------
    def _broadcast(self, pg: Any, obj: Any, src: int) -> Any:
        if self.size == 1:
            return obj
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.timeout = self.timeout
        data = json.dumps(obj).encode() if self.rank == src else b""
        too_long = len(data) > MAX_BROADCAST_BYTES  # (the others learn it from the length, -1)
        length = torch.tensor([-1 if too_long else len(data)], dtype=torch.int64,
                              device="cpu")  # host-side on purpose
        pg.broadcast([length], opts).wait()
        n = int(length.numpy()[0])
        if not 0 <= n <= MAX_BROADCAST_BYTES:
            raise HostGroupError(
                f"ddp_fusion: group rank {src} of process group {self.group_name!r} had "
                f"{'more than ' + str(MAX_BROADCAST_BYTES) if n == -1 else n} bytes to broadcast "
                f"to the other ranks (at most {MAX_BROADCAST_BYTES})")
        payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src and n
                   else torch.empty(n, dtype=torch.uint8, device="cpu"))  # host-side on purpose
        # (torch.frombuffer refuses an empty buffer; n == 0 never happens for JSON)
        pg.broadcast([payload], opts).wait()
        if self.rank == src:
            return json.loads(data)  # (what every other rank gets: tuples as lists)
        try:
            return json.loads(payload.numpy().tobytes())
        except ValueError as e:
            raise HostGroupError(f"ddp_fusion: group rank {src} of process group {self.group_name!r} "
                                 f"broadcast bytes that are not JSON ({e})") from e


class PythonRounds:
    """The rounds of :meth:`HostGroup.max_async` in Python, on the host group's thread
    where the C++ part is not built: what ``csrc/host_check.cpp``'s ``Exchanger`` does,
    with the same messages (a rank of either kind can be the other's peer)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self._failed: str | None = None  # the first failure: every later exchange fails with it,
        self._failure = (FINE, -1, -1)  # and carries its header to the peers
        self._exchanges = 0
        self._kept: list[Any] = []  # (the works of failed rounds, with their tensors)

    def run(self, pg: Any, values: list[int], timeout: datetime.timedelta) -> list[int]:
        """The max of ``values`` over the ranks of the gloo group ``pg``."""
        seq, self._exchanges = self._exchanges, self._exchanges + 1
        n = len(values)
        if n >= TAG_BASE:
            raise ValueError(f"ddp_fusion: a host group exchange of {n} values (at most {TAG_BASE - 1})")
        mine = torch.tensor([*self._failure, n, *values], dtype=torch.int64)  # host-side on purpose
        got = torch.empty_like(mine)
        m, g = mine.numpy(), got.numpy()
        local = None
        start = time.monotonic()
        for peer, send, recv, combine, k in schedule(self.rank, self.size):
            deadline = start + min(timeout.total_seconds(), 1e9) + k * GRACE_S
            works = []
            try:
                if recv:
                    works.append(pg.recv([got], peer, TAG_BASE + n))
                if send:
                    works.append(pg.send([mine], peer, TAG_BASE + n))
                for work in works:
                    left = datetime.timedelta(seconds=max(1e-3, deadline - time.monotonic()))
                    if not work.wait(left):
                        raise ConnectionError("its host group ended")
            except Exception as e:  # noqa: BLE001 - carried to the later peers, then raised
                self._kept += works
                if m[0] == FINE:
                    silent = "imed out" in str(e) or "imeout" in str(e)
                    m[:3] = (SILENT if silent else BROKEN, self.rank, peer)
                    local = (f"group rank {self.rank} could not exchange with group rank {peer}: "
                             f"{type(e).__name__}: {str(e)[:2000]}")
                continue
            if not recv:
                continue
            if combine == 2:
                if m[0] == FINE:
                    m[:] = g
            else:
                if m[0] == FINE and g[0] != FINE:
                    m[:3] = g[:3]
                np.maximum(m[HEADER:], g[HEADER:], out=m[HEADER:])
        if self._failed is not None:
            raise ConnectionError(self._failed)
        if m[0] != FINE:
            kind, origin, peer = (int(v) for v in m[:3])
            why = local if origin == self.rank and local else _failure(kind, origin, peer)
            self._failed, self._failure = f"exchange {seq}: {why}", (kind, origin, peer)
            raise ConnectionError(self._failed)
        return m[HEADER:].tolist()


class NativeExchanger:
    """A host group's C++ thread that runs the max's rounds (``csrc/host_check.cpp``'s
    ``Exchanger``, ``core``): exchanges posted here and by the plan ops' C++ kernels
    (plan_check.py) run in the order posted, numbered alike."""

    def __init__(self, core: Any, timeout: datetime.timedelta) -> None:
        self.core, self.timeout = core, timeout

    def ticket(self) -> int:
        """The host group's next ticket (:meth:`HostGroup.ticket`)."""
        return self.core.ticket()

    @property
    def tickets(self) -> int:
        return self.core.tickets()

    def post(self, values: Sequence[int], timeout: datetime.timedelta | None = None) -> NativeMax:
        """Post the max of ``values``; raises if the host group has ended."""
        mine = [int(v) for v in values]
        status, seq = self.core.post(mine, (timeout or self.timeout).total_seconds())
        if status != OK:
            raise self.error(status, "")
        return NativeMax(self, seq)

    def error(self, status: int, text: str) -> OSError:
        """The error of an exchange that ended with ``status`` (``text``: where and why it
        failed, as the ranks learned it)."""
        if status == TIMED_OUT:
            return TimeoutError("the host group's exchanges did not finish in time")
        if status == CLOSED_HERE:
            return ConnectionError("its host group has ended")
        return ConnectionError(text)

    def close(self, wait_s: float = 0.0) -> None:
        self.core.close(wait_s)


# An exchange's outcome (csrc/host_check.cpp's ``Status``)
OK, TIMED_OUT, FAILED, CLOSED_HERE = range(4)


class NativeMax:
    """An exchange posted on a :class:`NativeExchanger`; :meth:`result` collects it."""

    def __init__(self, exchanger: NativeExchanger, seq: int,
                 taken: Callable[[], list[int]] | None = None) -> None:
        self._exchanger, self._seq = exchanger, seq
        self._taken = taken  # (the max, or its error, as the C++ kernel took it)
        self._outcome: tuple[int, list[int], str] | None = None  # (taken once, kept)

    def done(self) -> bool:
        """Whether :meth:`result` would not wait."""
        return self._taken is not None or self._outcome is not None or self._exchanger.core.arrived(self._seq)

    def result(self, timeout: float | None = None) -> list[int]:
        """The element-wise max, waited for (up to ``timeout`` seconds, else as long as
        the exchange and those queued before it can take); raises where it failed on
        any rank."""
        if self._taken is not None:
            return self._taken()
        if self._outcome is None:
            outcome = self._exchanger.core.take(self._seq, -1.0 if timeout is None else timeout)
            if outcome[0] == TIMED_OUT:  # (not done yet: it may still be taken later)
                raise self._exchanger.error(TIMED_OUT, "")
            self._outcome = outcome
        status, values, text = self._outcome
        if status != OK:
            raise self._exchanger.error(status, text)
        return list(values)


#: What :meth:`HostGroup.max_async` returns: a max in flight, whose ``result()`` waits.
Exchange = concurrent.futures.Future | NativeMax


def native() -> Any | None:
    """The C++ extension (``_native.py``) where ``config.native_check`` is on and it
    builds; where it does not build, logged once (a warning: the plan check then runs
    in Python, which costs more per step)."""
    if not config.native_check:
        return None
    module = _native.load()
    if module is None and not _native_failure_logged:
        _native_failure_logged.append(True)
        log.warning(
            "ddp_fusion: the C++ part of the per-step plan check could not be built, so it runs in "
            "Python (a few percent of a small model's step; set ddp_fusion.config.native_check = False "
            "or DDP_FUSION_NATIVE_CHECK=0 to not try): %s", _native.failure())
    return module


_native_failure_logged: list[bool] = []


def native_loaded() -> Any | None:
    """The C++ extension if this process has built or loaded it (never builds it)."""
    return _native.loaded()


def schedule(rank: int, size: int) -> list[tuple[int, bool, bool, int, int]]:
    """The rounds of a max over ``size`` ranks from ``rank``: ``(peer, send, receive,
    combine, round)``, combine 1 taking the max with the peer's values, 2 taking the
    peer's as the result; ``round`` numbers a message alike on both of its ranks (it
    sets the message's deadline). The ranks above the largest power of two p fold into
    ``rank - p`` first (round 0) and take its result at the end (round log2 p + 1);
    below p, one peer per round (``rank ^ 2**i``, round i + 1), as
    ``csrc/host_check.cpp``'s ``schedule``."""
    p = 1 << (size.bit_length() - 1)
    last = p.bit_length()
    if rank >= p:
        return [(rank - p, True, False, 0, 0), (rank - p, False, True, 2, last)]
    steps = [(rank + p, False, True, 1, 0)] if rank + p < size else []
    steps += [(rank ^ (1 << i), True, True, 1, i + 1) for i in range(last - 1)]
    return steps + ([(rank + p, True, False, 0, last)] if rank + p < size else [])


def peers(rank: int, size: int) -> list[int]:
    """The group ranks a max over ``size`` ranks exchanges with, from ``rank``."""
    return list(dict.fromkeys(peer for peer, *_ in schedule(rank, size)))


def _failure(kind: int, origin: int, peer: int) -> str:
    """Why an exchange failed, as a message from group rank ``origin`` says it."""
    what = ("it sent or read nothing in time (it died, is stuck before this exchange, or asked for "
            "an exchange of another length)" if kind == SILENT
            else "the connection failed (its process ended, or a wait of its timed out: gloo then "
                 "closes all its connections)")
    return f"group rank {origin} could not exchange with group rank {peer}: {what}"


def _described(describe: Callable[[dict[int, str]], str], payloads: dict[int, str]) -> str:
    try:
        return describe(payloads)
    except Exception as e:  # noqa: BLE001 - the ranks must still hear something
        return f"(describing it failed: {type(e).__name__}: {e})"


def _where() -> str:
    """Where this rank's gloo group listens, as gloo picks it: the interface
    ``GLOO_SOCKET_IFNAME`` names, else the address the host's name resolves to."""
    host = socket.gethostname()
    ifname = os.environ.get(_torch.distributed.GLOO_SOCKET_IFNAME)
    if ifname:
        return f"host {host}, interface {ifname} from GLOO_SOCKET_IFNAME"
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as e:
        return f"host {host}, whose name does not resolve ({e}): gloo then listens on 127.0.0.1"
    addresses = list(dict.fromkeys(str(a[4][0]) for a in found))
    loopback = all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
    return (f"host {host}, address {', '.join(addresses)}"
            + (" (loopback: no other host can reach it)" if loopback else ""))


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    out, start = [], ranks[0]
    for prev, r in zip(ranks, [*ranks[1:], None]):
        if r is None or r != prev + 1:  # a run of consecutive ranks ends at prev
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = r
    return ", ".join(out)


def _serve(jobs: queue.SimpleQueue, pg: Any) -> None:
    """The group's thread: run each job on ``pg`` until the end (None)."""
    while True:
        job = jobs.get()
        if job is None:
            return  # (and ``pg``, the only reference to the gloo group, goes)
        fn, future = job
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn(pg))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(e)


# group name -> (weak reference to the group, its host group)
_groups: dict[str, tuple[weakref.ref, HostGroup]] = {}
_made: dict[str, int] = {}
_lock = threading.RLock()  # (a weak reference's callback may run in any thread)
#: c10d's unregister functions, wrapped while any host group lives (see ``_unregistered``)
_patches = _torch.patching.Patches()


def of(group: dist.ProcessGroup) -> HostGroup | None:
    """``group``'s host group (made the first time; None for a group without peers,
    unless :data:`FORCE`, and always for the ``fake`` backend). A group made again under
    the same name (a new ``init_process_group``) gets a new one, and the old one ends.
    Making one is collective (module docstring): :class:`HostGroupError` if the ranks
    cannot make it or connect it."""
    if not (has_peers(group) or (FORCE and dist.get_backend(group) != "fake")):
        return None
    name = _torch.distributed.ensure_group_name(group)
    with _lock:
        known = _groups.get(name)
        if known is not None and known[0]() is group:
            return known[1]
        if known is not None:
            _end(name, "a new process group of its name replaced it")
        # numbered per name: every rank makes its groups in the same order
        _made[name] = _made.get(name, 0) + 1
        host = HostGroup(group, f"ddp_fusion/host/{name}/{_made[name]}")
        gone = functools.partial(_gone, name, host)
        _groups[name] = (weakref.ref(group, gone), host)
        _torch.distributed.on_groups_unregistered(_patches, _unregistered)
        return host


def known(name: str) -> tuple[dist.ProcessGroup, HostGroup] | None:
    """The process group named ``name`` and its host group, if :func:`of` made one for it
    and neither has gone since (destroyed, replaced under its name, collected): what a
    steady step's exchange needs, without looking either up. (In a step each lookup runs
    once, between Inductor's kernels, with cold caches: ``resolve_process_group`` and
    :func:`of` took about 45 µs of a plan check at 2 ranks,
    bench/results/issue36_check_cpu_2026-11-28.md.)"""
    entry = _groups.get(name)
    if entry is None:
        return None
    group, host = entry[0](), entry[1]
    return None if group is None or host.ended else (group, host)


def _end(name: str, why: str) -> HostGroup:
    with _lock:
        _, host = _groups.pop(name)
        if not _groups:
            _patches.restore()
    host.end(why)
    return host


def _gone(name: str, host: HostGroup, _ref: weakref.ref) -> None:
    """The group is garbage: its host group ends (if it is still the one of its name)."""
    with _lock:
        known = _groups.get(name)
        if known is not None and known[1] is host:
            _end(name, "its process group is gone")


def _unregistered(name: str | None) -> None:
    """c10d unregistered the group ``name`` (None: every group): destroy_process_group."""
    with _lock:
        hosts = [_end(n, "destroy_process_group destroyed its process group")
                 for n in [n for n in _groups if name is None or n == name]]
    deadline = time.monotonic() + END_WAIT_S  # (each thread stops once idle; gloo's go with it)
    for host in hosts:
        host.end("", max(1e-3, deadline - time.monotonic()))
