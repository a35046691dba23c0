"""The exchange relay of a host group of more than two ranks: a small process of its
own that runs the rounds of :meth:`ddp_fusion.host_group.HostGroup.max_async`.

A max over N > 2 ranks takes ``ceil(log2 N)`` rounds (recursive doubling), and each
round needs code to run: add what the peer sent, then send the sum on. Run on a thread
of the training process, that code needs the GIL between rounds, which the main thread
holds while it runs backward: each round then waits for Python's switch interval (5 ms)
or for backward to end. So each rank of such a group starts one relay, a separate
Python process with its own interpreter, which connects to the relays of the ranks it
exchanges with (:func:`peers`) and runs the rounds as soon as messages arrive, whatever
its rank's main thread is doing. The training process talks to its relay over a socket
pair, as to the peer of a group of two (``host_group.PairChannel``): posting an exchange
is one ``send`` of its values, collecting it one ``recv`` of the max.

Run as ``python -I _relay.py FD RANK SIZE HOST TIMEOUT_S NAME`` (``FD``: this end of the
socket pair; ``HOST``: the address to listen on; ``TIMEOUT_S``: how long one exchange
may wait for a peer; ``NAME``: the host group's prefix, which peers present). The
standard library only: it imports neither torch nor ddp_fusion, starts in tens of
milliseconds and takes a few MB. Set-up, on the socket pair, in texts (:func:`send_text`):
the relay says where it listens (``host|port``); the rank answers with its peers'
addresses (JSON, group rank -> ``host|port``) and the seconds they have to connect; the
relay connects (to lower ranks; it accepts the higher ones') and says ``ok``, or an
error. Then one message per exchange each way, framed as ``PairChannel``'s (a count of
int64, then the values), or, when an exchange fails (a peer that never answers within
the timeout, whose process ended, or that asked for an exchange of another length), an
:data:`ERROR` frame with the reason; the relay exits after it. It exits when its rank's
end of the socket pair closes (the host group ended, or the process did), also in the
middle of an exchange.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import time

#: A frame's header: the number of int64 values that follow, or :data:`ERROR`.
FRAME = struct.Struct("<I")
#: The header of a failed exchange's frame: a text follows (:func:`send_text`).
ERROR = 0xFFFFFFFF
#: The longest text a set-up message may carry.
TEXT_MAX = 1 << 16
#: Seconds between a waiting relay's checks that its rank's process is still there.
_PARENT_CHECK_S = 1.0


def peers(rank: int, size: int) -> list[int]:
    """The group ranks a max over ``size`` ranks exchanges with, from ``rank``: the
    ranks above the largest power of two p fold into ``rank - p`` first and take its
    result at the end; below p, one peer per round (``rank ^ 2**i``)."""
    p = 1 << (size.bit_length() - 1)
    if rank >= p:
        return [rank - p]
    folded = [rank + p] if rank + p < size else []
    return folded + [rank ^ (1 << i) for i in range(p.bit_length() - 1)]


def ready(reading: list[socket.socket], writing: list[socket.socket],
          timeout: float | None) -> tuple[set[socket.socket], set[socket.socket]]:
    """The sockets of ``reading`` with something to read and of ``writing`` with room to
    write (either, if closed or failed), waited for up to ``timeout`` seconds (None:
    without end). ``poll``, not ``select``: a busy process's descriptors pass 1024."""
    poller = select.poll()
    for sock in reading:
        poller.register(sock, select.POLLIN)
    for sock in writing:
        poller.register(sock, select.POLLOUT | (select.POLLIN if sock in reading else 0))
    events = dict(poller.poll(None if timeout is None else max(0, int(timeout * 1000) + 1)))
    done = select.POLLHUP | select.POLLERR | select.POLLNVAL
    return ({s for s in reading if events.get(s.fileno(), 0) & (select.POLLIN | done)},
            {s for s in writing if events.get(s.fileno(), 0) & (select.POLLOUT | done)})


def send_text(sock: socket.socket, text: str) -> None:
    data = text.encode()
    sock.sendall(FRAME.pack(len(data)) + data)


def read_text(sock: socket.socket, deadline: float) -> str:
    """One :func:`send_text` message, waited for until ``deadline``
    (``time.monotonic``); an over-long one reads as ``""``."""
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            sock.settimeout(max(1e-3, deadline - time.monotonic()))
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the other end closed the connection")
            data += chunk
        return data
    (n,) = FRAME.unpack(exactly(FRAME.size))
    return exactly(n).decode(errors="replace") if n <= TEXT_MAX else ""


class _EndedError(Exception):
    """The rank closed its end: the relay exits."""


class _PeerFailedError(Exception):
    """A peer's relay failed this exchange; the message is its reason, passed on as is."""


class _Relay:
    def __init__(self, ctrl: socket.socket, rank: int, size: int, timeout_s: float, name: str) -> None:
        self.ctrl, self.rank, self.size, self.timeout_s, self.name = ctrl, rank, size, timeout_s, name
        self.conns: dict[int, socket.socket] = {}
        self.bufs: dict[int, bytearray] = {}
        self.requests = bytearray()  # from the rank, not yet taken
        self.parent = os.getppid()
        self.partial: set[int] = set()  # peers sent part of a frame (an ERROR must not follow)

    # -- set-up ------------------------------------------------------------------
    def connect(self, server: socket.socket, addresses: dict[int, str], deadline: float) -> None:
        hello = f"{self.name}|{self.rank}"
        for q in sorted(q for q in addresses if q < self.rank):
            host, port = addresses[q].rsplit("|", 1)
            try:
                left = max(1e-3, deadline - time.monotonic())
                sock = socket.create_connection((host, int(port)), timeout=left)
            except OSError as e:
                raise ConnectionError(f"could not connect to the relay of group rank {q} at {host}:{port} "
                                      f"({type(e).__name__}: {e})") from e
            send_text(sock, hello)
            self._add(q, sock)
        waiting = {q for q in addresses if q > self.rank}
        while waiting:
            server.settimeout(max(1e-3, deadline - time.monotonic()))
            try:
                sock, _ = server.accept()
            except TimeoutError:
                raise TimeoutError(f"no connection from the relays of group ranks "
                                   f"{', '.join(map(str, sorted(waiting)))} in time") from None
            try:
                name, q = read_text(sock, deadline).rsplit("|", 1)
                if name == self.name and int(q) in waiting:
                    waiting.discard(int(q))
                    self._add(int(q), sock)
                    continue
            except (OSError, ValueError):
                pass
            sock.close()  # (a stray connection)

    def _add(self, q: int, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.conns[q], self.bufs[q] = sock, bytearray()

    # -- exchanges -----------------------------------------------------------------
    def serve(self) -> None:
        self.ctrl.setblocking(False)
        seq = 0
        while True:
            values = self._request()
            try:
                result = self._max(values, seq, time.monotonic() + self.timeout_s)
            except _EndedError:
                raise
            except Exception as e:  # noqa: BLE001 - told to the peers and the rank, which raises it
                reason = str(e)
                for q, sock in self.conns.items():  # (so that every rank hears the same reason)
                    try:
                        if q not in self.partial:
                            sock.send(FRAME.pack(ERROR) + _text_frame(reason))
                    except OSError:
                        pass
                self._reply(FRAME.pack(ERROR) + _text_frame(f"exchange {seq}: {reason}"))
                return
            self._reply(FRAME.pack(len(result)) + struct.pack(f"<{len(result)}q", *result))
            seq += 1

    def _request(self) -> list[int]:
        """The rank's next exchange: its values (waits, with no deadline)."""
        while True:
            got = _take_frame(self.requests)
            if got is not None:
                return got
            if ready([self.ctrl], [], _PARENT_CHECK_S)[0]:
                self._read_ctrl()
            self._check_parent()

    def _check_parent(self) -> None:
        """End if the rank's process has gone (a process it forked may still hold the
        rank's end of the socket pair open)."""
        if os.getppid() != self.parent:
            raise _EndedError

    def _read_ctrl(self) -> None:
        try:
            data = self.ctrl.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            raise _EndedError
        self.requests += data

    def _reply(self, frame: bytes) -> None:
        self.ctrl.setblocking(True)
        try:
            self.ctrl.sendall(frame)
        except OSError as e:
            raise _EndedError from e
        finally:
            self.ctrl.setblocking(False)

    def _max(self, values: list[int], seq: int, deadline: float) -> list[int]:
        rank, p = self.rank, 1 << (self.size.bit_length() - 1)
        if rank >= p:  # fold into rank - p, then take its result
            self._send(rank - p, values, deadline)
            return self._recv(rank - p, len(values), deadline)
        if rank + p < self.size:
            values = [max(a, b) for a, b in zip(values, self._recv(rank + p, len(values), deadline))]
        mask = 1
        while mask < p:
            peer = rank ^ mask
            self._send(peer, values, deadline)
            values = [max(a, b) for a, b in zip(values, self._recv(peer, len(values), deadline))]
            mask <<= 1
        if rank + p < self.size:
            self._send(rank + p, values, deadline)
        return values

    def _send(self, q: int, values: list[int], deadline: float) -> None:
        frame = memoryview(FRAME.pack(len(values)) + struct.pack(f"<{len(values)}q", *values))
        sock = self.conns[q]
        self.partial.add(q)
        while frame:
            try:
                frame = frame[sock.send(frame):]
            except BlockingIOError:
                # The peer sends to us at the same time: read its frame meanwhile, or
                # neither of us could finish a frame longer than the sockets' buffers.
                self._wait(q, deadline, writing=True)
                self._read_peer(q)
            except OSError as e:
                raise ConnectionError(f"could not send to group rank {q}'s relay: its process ended "
                                      f"({type(e).__name__}: {e})") from e
        self.partial.discard(q)

    def _recv(self, q: int, count: int, deadline: float) -> list[int]:
        buf = self.bufs[q]
        while True:
            failed = take_error(buf)
            if failed is not None:
                raise _PeerFailedError(failed)
            got = _take_frame(buf)
            if got is not None:
                if len(got) != count:
                    raise ValueError(f"the ranks asked for different exchanges ({count} values on group "
                                     f"rank {self.rank}, {len(got)} on group rank {q})")
                return got
            if not self._read_peer(q):
                self._wait(q, deadline, writing=False)

    def _read_peer(self, q: int) -> bool:
        """Read what peer ``q`` has sent, without waiting; whether anything had."""
        try:
            data = self.conns[q].recv(1 << 20)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            raise ConnectionError(f"group rank {q}'s relay closed the connection (its process ended)")
        self.bufs[q] += data
        return True

    def _wait(self, q: int, deadline: float, writing: bool) -> None:
        """Until peer ``q``'s socket has something to read (or, ``writing``, room to
        write or something to read); ends the relay if the rank closes its end meanwhile,
        raises TimeoutError at ``deadline``."""
        sock = self.conns[q]
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                what = "read nothing" if writing else "sent nothing"
                raise TimeoutError(f"group rank {q} {what} within {self.timeout_s:g} s (it died, or is "
                                   "stuck before this exchange)")
            readable, writable = ready([self.ctrl, sock], [sock] if writing else [],
                                       min(left, _PARENT_CHECK_S))
            if self.ctrl in readable:
                self._read_ctrl()
            self._check_parent()
            if sock in readable or sock in writable:
                return


def _text_frame(text: str) -> bytes:
    data = text.encode()[:TEXT_MAX]
    return FRAME.pack(len(data)) + data


def take_error(buf: bytearray) -> str | None:
    """The reason of an :data:`ERROR` frame at the start of ``buf``, if a whole one is
    there."""
    if len(buf) < 2 * FRAME.size or FRAME.unpack_from(buf)[0] != ERROR:
        return None
    (n,) = FRAME.unpack_from(buf, FRAME.size)
    if len(buf) < 2 * FRAME.size + n:
        return None
    return bytes(buf[2 * FRAME.size:2 * FRAME.size + n]).decode(errors="replace")


def _take_frame(buf: bytearray) -> list[int] | None:
    """The first whole frame of values in ``buf``, taken out of it (None: not there yet)."""
    if len(buf) < FRAME.size:
        return None
    (count,) = FRAME.unpack_from(buf)
    if count == ERROR:
        return None  # (:func:`take_error`'s)
    end = FRAME.size + 8 * count
    if len(buf) < end:
        return None
    values = list(struct.unpack_from(f"<{count}q", buf, FRAME.size))
    del buf[:end]
    return values


def main(argv: list[str]) -> int:
    fd, rank, size, host, timeout_s, name = (
        int(argv[1]), int(argv[2]), int(argv[3]), argv[4], float(argv[5]), argv[6])
    # Ctrl-C reaches the whole process group: the rank handles it, and the relay ends
    # when the rank's end closes (no traceback of its own on the terminal).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctrl = socket.socket(fileno=fd)
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.create_server((host, 0), family=family) as server:
            send_text(ctrl, f"{host}|{server.getsockname()[1]}")
            setup = json.loads(read_text(ctrl, time.monotonic() + 3600))
            relay = _Relay(ctrl, rank, size, timeout_s, name)
            try:
                relay.connect(server, {int(q): a for q, a in setup["peers"].items()},
                              time.monotonic() + float(setup["connect_s"]))
            except Exception as e:  # noqa: BLE001 - told to the rank, which raises it
                send_text(ctrl, f"error: {type(e).__name__}: {e}")
                return 1
        send_text(ctrl, "ok")
        relay.serve()
    except (_EndedError, OSError, json.JSONDecodeError):
        pass  # (the rank has gone, or ended the host group; OSError: ConnectionError, TimeoutError)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
