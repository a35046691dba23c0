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
  int64 over the ranks, by recursive doubling on point-to-point messages (not gloo's:
  the pair's own connection, or exchange relays; below):
  ``ceil(log2 N)`` rounds, plus two when N is not a power of two (gloo's own all-reduce
  is a ring: ``2 (N - 1)`` steps). "Do all ranks hold h?" is ``max(h, -h)``: all agree
  exactly when both maxima give back h. A rank that takes no part in a decision (a
  joined rank) sends :data:`NEUTRAL`, which never wins.
* :meth:`HostGroup.broadcast_json`: gloo's broadcast, a binomial tree
  (``ceil(log2 N)`` rounds), of JSON (never a pickle: bytes from another rank are data).
* :meth:`HostGroup.report`: on an error path only, a description of what the ranks
  hold, through the default store: each rank writes one key, group rank 0 reads them all
  (one ``multi_get``) and writes the description, which every rank then reads. O(1)
  store operations per rank but rank 0's.

Exchanges run in the order they were asked for, which is the same on every rank, so a
caller can start one and collect it later (the plan check starts at the beginning of
backward and waits where the first bucket is issued). The max never runs on a thread of
this process, whose Python would need the GIL between rounds while the main thread runs
backward (each round would then wait up to Python's switch interval, 5 ms). Over two
ranks it is one message each way on a TCP connection of the pair's own
(:class:`PairChannel`): sent by the caller, carried by the kernel, read when collected.
Over more, each rank has an *exchange relay* (``_relay.py``), a small process of its
own (standard library only) connected to its peers' relays: the caller sends its values
to it and reads the max back, on the same kind of channel, and the relays run the rounds
with their own interpreters. A peer that never comes fails the exchange after the model
group's timeout; one whose process ended fails it at once; a failed exchange fails on
every rank with the same reason (the relays pass it on), and ends the relays. Other
exchanges (the broadcast, the connection check) run on the gloo group's thread. The
relays are set up with the host group, collectively: a rank whose relay cannot start or
connect says so in the store, and every rank raises :class:`HostGroupError` naming it.

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
rank within seconds, naming the addresses and ``GLOO_SOCKET_IFNAME``. A group of two
then makes its own connection the same way, bounded alike: group rank 0 listens where
gloo does and says where in the store, rank 1 connects, and each names the group.

A host group ends with its process group: when ``destroy_process_group`` unregisters
the group (c10d's unregister functions are wrapped, through ``_torch.patching``, while
any host group exists), when the group is garbage, or when a new group of the same name
takes its place. Its thread stops after the exchanges already asked for, and the gloo
group (its sockets and threads) goes with it, as do its relays (each sees its rank's end
close and exits; a process forked from the rank, a DataLoader worker, closes its
copies of the channels at once, and a relay whose rank's process has gone exits too);
using it after that raises :class:`HostGroupError`.
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
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import _native, _relay, _torch
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

#: Seconds a rank waits for its exchange relay beyond the group's timeout: the relay
#: times a silent peer out after the timeout, and its reason must reach the rank first.
RELAY_GRACE_S = 2.0

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
        if self.size > 1:
            native()  # (built before the ranks connect, whose wait is bounded: 25 s the first time)
        pg = self._make(connect_s)
        # max_async's channel: to the peer (two ranks) or to this rank's relay (more)
        self._channel: PairChannel | None = None
        self._relay: subprocess.Popen | None = None
        # The thread holds the only lasting reference to the gloo group: when it stops,
        # the group (its sockets, its threads) goes.
        self._thread = threading.Thread(
            target=_serve, args=(self._jobs, pg),
            name=f"ddp_fusion host group {self.group_name}", daemon=True,
        )
        del pg
        self._thread.start()
        try:
            self._connect(connect_s)
            if self.size == 2:
                self._channel = self._pair_channel(connect_s)
            elif self.size > 2:
                self._channel = self._relay_channel(connect_s)
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
        timeout = datetime.timedelta(seconds=connect_s)
        exchange = self._submit(lambda pg: self._max(pg, np.zeros(1, dtype=np.int64), timeout))
        try:
            exchange.result(timeout=connect_s)
            return
        except concurrent.futures.TimeoutError:
            why = f"no answer within {connect_s:g} s"
        except Exception as e:  # noqa: BLE001 - gloo's error, in the message
            why = f"{type(e).__name__}: {e}"
        store = _torch.distributed.default_store()
        peers = [f"group rank {p} ({store.get(f'{self.prefix}/connect/where/{p}').decode()})"
                 for p in _peers(self.rank, self.size)]
        raise HostGroupError(self._cannot(
            f"group rank {self.rank} ({_where()}) could not exchange with "
            f"{', '.join(peers)} ({why})"))

    def _pair_channel(self, connect_s: float) -> PairChannel:
        """The TCP connection of a group of two (:class:`PairChannel`): group rank 0
        listens where gloo does and says where in the store, rank 1 connects, and each
        names the group to the other; within ``connect_s``, else :class:`HostGroupError`
        on both ranks."""
        store = _torch.distributed.default_store()
        key, hello = f"{self.prefix}/pair", self.prefix
        deadline = time.monotonic() + connect_s
        try:
            if self.rank == 0:
                host = _listen_address()
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                with socket.create_server((host, 0), family=family) as server:
                    store.set(key, f"{host}|{server.getsockname()[1]}")
                    sock = _accept_peer(server, hello, deadline)
            else:
                store.wait([key], datetime.timedelta(seconds=connect_s))
                host, port = store.get(key).decode().rsplit("|", 1)
                sock = socket.create_connection((host, int(port)), timeout=connect_s)
                _relay.send_text(sock, hello)
                if _relay.read_text(sock, deadline) != hello:
                    raise ConnectionError(f"{host}:{port} answered for another group")
        except Exception as e:  # noqa: BLE001 - named in the error every rank raises
            raise HostGroupError(self._cannot(
                f"group rank {self.rank} ({_where()}) could not make the TCP connection of the "
                f"two ranks' exchanges ({type(e).__name__}: {e})")) from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # (a few bytes: now)
        peer = f"group rank {1 - self.rank} of process group {self.group_name!r}"
        return channel(sock, self.timeout, peer)

    def _relay_channel(self, connect_s: float) -> PairChannel:
        """The channel to this rank's exchange relay (``_relay.py``: a process of its
        own that runs a larger group's rounds without this process's GIL), started and
        connected to its peers' relays within ``connect_s``, else
        :class:`HostGroupError`."""
        store = _torch.distributed.default_store()
        base = f"{self.prefix}/relay"
        deadline = time.monotonic() + connect_s
        peers = _peers(self.rank, self.size)
        ctrl: socket.socket | None = None
        failed: str | None = None
        try:
            try:
                self._relay, ctrl, where = start_relay(self.rank, self.size, _listen_address(),
                                                       self.timeout.total_seconds(), self.prefix, deadline)
                store.set(f"{base}/{self.rank}", where)
                keys = [f"{base}/{q}" for q in peers]
                store.wait(keys, datetime.timedelta(seconds=max(1e-3, deadline - time.monotonic())))
                connect_relay(ctrl, {q: store.get(k).decode() for q, k in zip(peers, keys)},
                              max(1e-3, deadline - time.monotonic()))
                answer = _relay.read_text(ctrl, deadline + 1.0)
                failed = None if answer == "ok" else answer
            except Exception as e:  # noqa: BLE001 - told to every rank, then raised
                failed = f"{type(e).__name__}: {e}"
            # Every rank hears of the first rank's failure (the cause; the others' may
            # follow from it): a relay that connected may have peers whose others failed.
            if failed is not None:
                store.compare_set(f"{base}/failed", "", (
                    f"group rank {self.rank} ({_where()}) could not start its exchange relay or "
                    f"connect it to the relays of group ranks {_ranges(sorted(peers))}: {failed}"))
            if store.add(f"{base}/arrived", 1) == self.size:
                store.set(f"{base}/all", "1")
            try:
                left = max(1e-3, deadline + 2.0 - time.monotonic())
                store.wait([f"{base}/all"], datetime.timedelta(seconds=left))
            except Exception as e:
                arrived = store.add(f"{base}/arrived", 0)
                raise HostGroupError(self._cannot(
                    f"only {arrived} of the {self.size} ranks' exchange relays were set up in time "
                    f"(group rank {self.rank}'s: {failed or 'connected'})")) from e
            if store.check([f"{base}/failed"]):
                raise HostGroupError(self._cannot(store.get(f"{base}/failed").decode()))
        except BaseException:
            if ctrl is not None:
                ctrl.close()
            if self._relay is not None:
                self._relay.kill()
                self._relay.wait()
            raise
        return channel(ctrl, self.timeout + datetime.timedelta(seconds=RELAY_GRACE_S),
                           f"the exchange relay of group rank {self.rank} (process {self._relay.pid})")

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
    def channel(self) -> PairChannel | None:
        """The connection of :meth:`max_async` (to the peer of a group of two, or to this
        rank's exchange relay); None for a group of one."""
        return self._channel

    @property
    def ended(self) -> bool:
        """Whether the host group has ended (its process group is gone)."""
        return self._ended is not None

    def end(self, why: str, wait_s: float = 0.0) -> None:
        """End the host group: no exchange can be asked for any more; the thread stops
        after those asked for (waited for up to ``wait_s``), and the gloo group with it."""
        with self._lock:
            if self._ended is None:
                self._ended = why
                if self._channel is not None:
                    self._channel.close()  # (the relay exits when it sees its end close)
                self._jobs.put(None)
        if wait_s > 0 and threading.current_thread() is not self._thread:
            self._thread.join(wait_s)
        if self._relay is not None:
            try:
                self._relay.wait(wait_s)
            except subprocess.TimeoutExpired:  # (still closing: reaped when it has)
                threading.Thread(target=self._relay.wait, name="ddp_fusion relay reaper", daemon=True).start()

    def ranks(self, ranks: Sequence[int]) -> str:
        """Group ranks as a user reads them: ``0-3, 7``, with their global ranks
        (which logs carry) where those differ."""
        text = _ranges(ranks)
        global_ranks = [self.global_ranks[r] for r in ranks]
        return text if global_ranks == list(ranks) else f"{text} (global {_ranges(global_ranks)})"

    def ticket(self) -> int:
        """Number the next exchange asked for (the same number on every rank, which ask
        for the same exchanges in the same order): names its :meth:`report`."""
        if self._channel is not None:  # (which the C++ plan check numbers with too)
            return self._channel.ticket()
        self._tickets += 1
        return self._tickets

    @property
    def tickets(self) -> int:
        """The tickets taken so far (:meth:`ticket`)."""
        if self._channel is not None:
            return self._channel.tickets
        return self._tickets

    def _submit(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(gloo group)`` on the group's thread."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._check_open()
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
        ``.result()`` is a list of ints. Two ranks exchange one message each way on
        their own TCP connection (:class:`PairChannel`); more send theirs to their
        exchange relay, which runs the rounds in a process of its own. Either way no
        Python of this process runs between posting and collecting, so the exchange
        never waits for this process's GIL."""
        if self._channel is not None:
            with self._lock:
                self._check_open()
                return self._channel.post(values)
        mine = np.array(values, dtype=np.int64)
        return self._submit(lambda pg: self._max(pg, mine, self.timeout))

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
    def _max(self, pg: Any, mine: np.ndarray, timeout: datetime.timedelta) -> list[int]:
        rank, size = self.rank, self.size
        buf = torch.from_numpy(mine)  # host-side on purpose: the gloo group's own tensors
        got = torch.empty_like(buf)
        values, received = buf.numpy(), got.numpy()
        p = 1 << (size.bit_length() - 1)  # the largest power of two <= size
        # (every wait is given the timeout: the gloo group's own bounds connections)
        if rank >= p:  # fold into rank - p, then take its result
            pg.send([buf], rank - p, 0).wait(timeout)
            pg.recv([buf], rank - p, 0).wait(timeout)
            return values.tolist()
        if rank + p < size:
            pg.recv([got], rank + p, 0).wait(timeout)
            np.maximum(values, received, out=values)
        mask = 1
        while mask < p:
            peer = rank ^ mask
            send, recv = pg.send([buf], peer, 0), pg.recv([got], peer, 0)
            send.wait(timeout)
            recv.wait(timeout)
            np.maximum(values, received, out=values)
            mask <<= 1
        if rank + p < size:
            pg.send([buf], rank + p, 0).wait(timeout)
        return values.tolist()

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


class PairChannel:
    """The max exchanges of a group of two ranks: one TCP connection between them, which
    the kernel carries (and, for a larger group, the socket pair to this rank's exchange
    relay, whose answer is the max itself, or an error frame with the reason the
    exchange failed). Posting an exchange is one ``send`` of this rank's values;
    collecting it reads the peer's, which have usually arrived long before (they sit in
    the socket's buffer: one ``recv``). No thread, no Python and no GIL between the two;
    gloo's own point-to-point messages, tried first, took 0.1-5 ms to post on a busy
    2-core host (bench/results/host_bound_cpu_2026-11-26.md).

    Messages are framed (a count of int64, then the values) and taken in the order they
    were posted, which is the same on both ranks; one collected out of order waits here
    until its own comes. A count that differs from this rank's means the ranks asked for
    different exchanges: :class:`HostGroupError`. The socket does not block: every wait
    is a ``poll`` bounded by the group's timeout (or the caller's)."""

    def __init__(self, sock: socket.socket, timeout: datetime.timedelta, peer: str = "the peer") -> None:
        _channels.add(self)
        sock.setblocking(False)
        self._sock, self._peer = sock, peer
        self._timeout = timeout
        self._send_lock, self._recv_lock = threading.Lock(), threading.Lock()
        self._posted = self._read = 0
        self._buf = bytearray()  # received, not yet a whole message
        self._early: dict[int, tuple[int, ...]] = {}  # the peer's values read before their turn
        self._failed: str | None = None  # why the other end failed (a relay's ERROR frame)
        self._tickets = 0

    def ticket(self) -> int:
        """The host group's next ticket (:meth:`HostGroup.ticket`)."""
        self._tickets += 1
        return self._tickets

    @property
    def tickets(self) -> int:
        """The tickets taken so far."""
        return self._tickets

    def post(self, mine: Sequence[int]) -> PairMax:
        """Send this rank's ``mine`` (int64 values) and return the exchange, to collect
        later. (Packed with ``struct``, not through a numpy array: about 6 µs less a
        plan check in a step, bench/results/issue36_check_cpu_2026-11-28.md.)"""
        mine = [int(v) for v in mine]
        frame = memoryview(_FRAME.pack(len(mine)) + struct.pack(f"<{len(mine)}q", *mine))
        deadline = None
        with self._send_lock:
            seq, self._posted = self._posted, self._posted + 1
            try:
                while frame:
                    try:
                        frame = frame[self._sock.send(frame):]
                    except BlockingIOError:  # the peer has not read for a long time
                        deadline = deadline or time.monotonic() + self._timeout.total_seconds()
                        self._wait(deadline, writing=True)
            except OSError as e:  # (TimeoutError too)
                with self._recv_lock:  # a relay that failed said why before it ended
                    try:
                        self._receive()
                    except ConnectionError:
                        pass
                if self._failed is not None:
                    raise ConnectionError(self._failed) from e
                raise self._send_failed(e) from e
        return PairMax(self, seq, mine)

    def take(self, seq: int, deadline: float) -> tuple[int, ...]:
        """The peer's values of exchange ``seq``, waited for until ``deadline``
        (``time.monotonic``)."""
        with self._recv_lock:
            while seq not in self._early:
                if not self._receive():
                    self._wait(deadline, writing=False)
            return self._early.pop(seq)

    def arrived(self, seq: int) -> bool:
        """Whether the peer's values of exchange ``seq`` are here: collecting them would
        not wait for the peer."""
        with self._recv_lock:
            self._receive()
            return seq in self._early

    def _receive(self) -> bool:
        """Read what has arrived, without waiting; whether anything had."""
        if self._failed is not None:
            raise ConnectionError(self._failed)
        if self._sock.fileno() < 0:
            raise self._closed_here()
        try:
            data = self._sock.recv(1 << 16)
        except BlockingIOError:
            return False
        except OSError as e:
            raise self._peer_closed(e) from e
        if not data:
            raise self._peer_closed()
        buf = self._buf
        buf += data
        at = 0
        while len(buf) - at >= _FRAME.size:
            (count,) = _FRAME.unpack_from(buf, at)
            if count == _relay.ERROR:  # (a relay's: a text follows, then it exits)
                text = _relay.take_error(buf[at:])
                if text is not None:
                    self._failed = f"{self._peer} failed: {text}"
                    raise ConnectionError(self._failed)
                break
            end = at + _FRAME.size + 8 * count
            if len(buf) < end:
                break
            self._early[self._read] = struct.unpack_from(f"<{count}q", buf, at + _FRAME.size)
            self._read += 1
            at = end
        del buf[:at]
        return True

    def _wait(self, deadline: float, writing: bool) -> None:
        left = deadline - time.monotonic()
        reading, sending = ([], [self._sock]) if writing else ([self._sock], [])
        ready = left > 0 and any(_relay.ready(reading, sending, left))
        if not ready:
            raise self._timed_out(writing)

    # -- the errors, worded alike for both channels ------------------------------------
    def _send_failed(self, e: OSError) -> ConnectionError:
        return ConnectionError(f"could not send to {self._peer}: its process ended, is stuck, "
                               f"or the connection broke ({type(e).__name__}: {e})")

    def _closed_here(self) -> ConnectionError:
        return ConnectionError(f"the connection to {self._peer} was closed here: its host group has ended")

    def _peer_closed(self, e: OSError | None = None) -> ConnectionError:
        how = "" if e is None else f": {type(e).__name__}: {e}"
        return ConnectionError(f"{self._peer} closed the connection (its process ended{how})")

    def _timed_out(self, writing: bool) -> TimeoutError:
        what = "read nothing" if writing else "sent nothing"
        return TimeoutError(f"{self._peer} {what} in time (it died, or is stuck before this exchange)")

    def fileno(self) -> int:
        """The socket's file descriptor (-1 once closed)."""
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()

    close_in_child = close


class NativePairChannel(PairChannel):
    """:class:`PairChannel` on the C++ channel of ``ddp_fusion/csrc/host_check.cpp``
    (``_native.py``): the same frames, numbering and waits, in C++ with the GIL
    released; the plan ops' C++ kernels post and collect the plan check's exchanges of a
    steady step on it directly (plan_check.py), numbered with the Python ones. The
    channel owns the socket (its file descriptor) from here on."""

    def __init__(self, sock: socket.socket, timeout: datetime.timedelta, peer: str = "the peer") -> None:
        sock.setblocking(False)
        self._peer, self._timeout = peer, timeout
        self._failed = None
        self.core = _native.load().Channel(sock.fileno(), timeout.total_seconds())
        sock.detach()  # (the C++ channel closes it)
        _channels.add(self)

    def ticket(self) -> int:
        return self.core.ticket()

    @property
    def tickets(self) -> int:
        return self.core.tickets()

    def post(self, mine: Sequence[int]) -> PairMax:
        mine = [int(v) for v in mine]
        status, seq, err = self.core.post(mine, self._timeout.total_seconds())
        if status != OK:
            raise self.post_error(status, err)
        return PairMax(self, seq, mine)

    def post_error(self, status: int, err: int) -> ConnectionError:
        """The error of a post that ended with ``status`` (``err``: its errno), as
        :meth:`PairChannel.post` words it."""
        if self.core.arrived(-1)[0] == ERROR_FRAME:  # a relay that failed said why before it ended
            return self.error(ERROR_FRAME, 0)
        return self._send_failed(OSError(err, os.strerror(err)) if status == OS_ERROR
                                 else self.error(status, err, writing=True))

    def take(self, seq: int, deadline: float) -> tuple[int, ...]:
        status, values, err = self.core.take(seq, max(0.0, deadline - time.monotonic()))
        if status != OK:
            raise self.error(status, err)
        return tuple(values)

    def arrived(self, seq: int) -> bool:
        status, here, err = self.core.arrived(seq)
        if status != OK:
            raise self.error(status, err)
        return here

    def error(self, status: int, err: int, writing: bool = False) -> OSError:
        """The error a channel operation that ended with ``status`` (``err``: its errno)
        raises, as :class:`PairChannel` words it."""
        if status == TIMED_OUT:
            return self._timed_out(writing)
        if status == ERROR_FRAME:
            if self._failed is None:
                text = _relay.take_error(bytearray(self.core.error_bytes()))
                self._failed = f"{self._peer} failed: {text}"
            return ConnectionError(self._failed)
        if status == CLOSED_HERE:
            return self._closed_here()
        return self._peer_closed(None if status == PEER_CLOSED else OSError(err, os.strerror(err)))

    def fileno(self) -> int:
        return self.core.fileno()

    def close(self) -> None:
        self.core.close()

    def close_in_child(self) -> None:
        self.core.close_in_child()


# A C++ channel operation's outcome (csrc/host_check.cpp's ``Status``)
OK, TIMED_OUT, PEER_CLOSED, OS_ERROR, ERROR_FRAME, CLOSED_HERE = range(6)


def channel(sock: socket.socket, timeout: datetime.timedelta, peer: str = "the peer") -> PairChannel:
    """A :class:`NativePairChannel` where the C++ extension is on (``config.native_check``)
    and built, else a :class:`PairChannel`: the same frames on the wire."""
    kind = NativePairChannel if native() is not None else PairChannel
    return kind(sock, timeout, peer)


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


#: A :class:`PairChannel` message's header: the number of int64 values that follow.
_FRAME = _relay.FRAME

#: Every open :class:`PairChannel` of this process.
_channels: weakref.WeakSet[PairChannel] = weakref.WeakSet()


def _close_channels_in_child() -> None:
    """A forked child (a DataLoader worker) closes its copies of the channels' sockets,
    so that a peer or relay still sees this process's end close when the host group
    ends or the process does (the child cannot use them anyway)."""
    for channel in list(_channels):
        channel.close_in_child()


os.register_at_fork(after_in_child=_close_channels_in_child)


class PairMax:
    """An exchange posted on a :class:`PairChannel`; :meth:`result` collects it."""

    def __init__(self, channel: PairChannel, seq: int, mine: list[int],
                 taken: Callable[[], tuple[int, ...]] | None = None) -> None:
        self._channel, self._seq, self._mine = channel, seq, mine
        self._taken = taken  # (the peer's values, or their error, as the C++ kernel took them)

    def done(self) -> bool:
        """Whether :meth:`result` would not wait for the peer."""
        return self._channel.arrived(self._seq)

    def result(self, timeout: float | None = None) -> list[int]:
        """The element-wise max, waited for (up to ``timeout`` seconds, else the group's
        timeout); raises if the peer does not answer in time or has gone."""
        if self._taken is not None:
            theirs = self._taken()
        else:
            limit = self._channel._timeout.total_seconds() if timeout is None else timeout
            theirs = self._channel.take(self._seq, time.monotonic() + limit)
        if len(theirs) != len(self._mine):
            raise HostGroupError(
                f"ddp_fusion: the two ranks of a host group asked for different exchanges "
                f"(exchange {self._seq}: {len(self._mine)} values on this rank, {len(theirs)} on the peer)"
            )
        return [max(a, b) for a, b in zip(self._mine, theirs)]


#: What :meth:`HostGroup.max_async` returns: a max in flight, whose ``result()`` waits.
Exchange = concurrent.futures.Future | PairMax


def start_relay(rank: int, size: int, host: str, timeout_s: float, name: str,
                deadline: float) -> tuple[subprocess.Popen, socket.socket, str]:
    """Start group rank ``rank``'s exchange relay (``_relay.py``), listening on
    ``host``: its process, this end of the socket pair to it, and where it listens
    (``host|port``), which it says by ``deadline`` (``time.monotonic``)."""
    mine, theirs = socket.socketpair()
    try:
        relay = subprocess.Popen(
            [sys.executable, "-I", _relay.__file__, str(theirs.fileno()), str(rank), str(size), host,
             repr(timeout_s), name],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    try:
        return relay, mine, _relay.read_text(mine, deadline)
    except BaseException:
        relay.kill()
        mine.close()
        raise


def connect_relay(ctrl: socket.socket, addresses: dict[int, str], connect_s: float) -> None:
    """Tell a relay where its peers' relays listen (group rank -> ``host|port``); it
    connects within ``connect_s`` and then says ``ok`` (or an error) on ``ctrl``."""
    _relay.send_text(ctrl, json.dumps({"peers": {str(q): a for q, a in addresses.items()},
                                       "connect_s": connect_s}))


def _described(describe: Callable[[dict[int, str]], str], payloads: dict[int, str]) -> str:
    try:
        return describe(payloads)
    except Exception as e:  # noqa: BLE001 - the ranks must still hear something
        return f"(describing it failed: {type(e).__name__}: {e})"


_peers = _relay.peers


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


def _listen_address() -> str:
    """The address gloo listens on (:func:`_where`): the first interface
    ``GLOO_SOCKET_IFNAME`` names (its IPv4 address), else the first address the host's
    name resolves to that can be bound, else 127.0.0.1."""
    ifname = os.environ.get(_torch.distributed.GLOO_SOCKET_IFNAME, "").split(",")[0].strip()
    if ifname:
        import fcntl  # (POSIX; Linux's SIOCGIFADDR)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    try:
        found = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        found = []
    for family, _, _, _, address in found:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((address[0], 0))
            return str(address[0])
        except OSError:
            continue
    return "127.0.0.1"


def _accept_peer(server: socket.socket, hello: str, deadline: float) -> socket.socket:
    """The first connection to ``server`` that names ``hello``, answered with it (a
    stray one is closed); TimeoutError at ``deadline``."""
    while True:
        server.settimeout(max(1e-3, deadline - time.monotonic()))
        sock, _ = server.accept()
        try:
            if _relay.read_text(sock, deadline) == hello:
                _relay.send_text(sock, hello)
                return sock
        except OSError:
            pass
        sock.close()
        if time.monotonic() >= deadline:
            raise TimeoutError("no peer named this group")


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
