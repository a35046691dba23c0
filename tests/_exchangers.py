"""Ranks of a host group's max in one process, each a thread with a gloo group of its own
(tests of the C++ exchanger, its Python twin and the plan ops' C++ kernels)."""

import concurrent.futures
import datetime
import queue
import threading

import pytest
import torch.distributed as dist

from ddp_fusion import host_group


def native():
    native = host_group.native()
    if native is None:
        pytest.fail(f"the C++ extension did not build: {__import__('ddp_fusion._native')._native.failure()}")
    return native


class Rank:
    """A rank of a host group's max in this process: its gloo group and the C++
    exchanger on it (``cpp``), or the Python rounds run on a thread of its own."""

    def __init__(self, pg, rank, size, cpp, timeout):
        self.pg, self.rank, self.timeout = pg, rank, timeout
        if cpp:
            self.x = host_group.NativeExchanger(
                native().Exchanger(pg, rank, size, timeout.total_seconds(), host_group.GRACE_S), timeout)
        else:
            self.x, self.rounds = None, host_group.PythonRounds(rank, size)
            self.jobs = queue.SimpleQueue()
            threading.Thread(target=host_group._serve, args=(self.jobs, pg), daemon=True).start()

    def post(self, values):
        if self.x is not None:
            return self.x.post(values)
        future = concurrent.futures.Future()
        self.jobs.put((lambda pg, v=list(values): self.rounds.run(pg, v, self.timeout), future))
        return future

    def leave(self):
        """The rank's process ends: its gloo group (its connections) goes."""
        if self.pg is None:
            return
        if self.x is not None:
            self.x.close(2.0)
        else:
            self.jobs.put(None)
        self.pg = None


def ranks(kinds, timeout_s=10.0):
    """One :class:`_Rank` per entry of ``kinds`` (True: C++), over one store."""
    store, size = dist.HashStore(), len(kinds)
    pgs = [None] * size

    def make(r):
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        opts._timeout, opts._threads = datetime.timedelta(seconds=timeout_s), 1
        pgs[r] = dist.ProcessGroupGloo(dist.PrefixStore("test", store), r, size, opts)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    timeout = datetime.timedelta(seconds=timeout_s)
    made = [Rank(pg, r, size, cpp, timeout) for r, (pg, cpp) in enumerate(zip(pgs, kinds))]
    _made.extend(made)
    return made


_made: list[Rank] = []


def leave_all():
    """Every rank :func:`ranks` made leaves (their threads stop, their gloo groups go)."""
    while _made:
        _made.pop().leave()


# which ranks run the C++ rounds: all, none, every other one (a C++ rank and a Python
# one meet in the first round of recursive doubling), the lower half (they meet in the
# fold and in the later rounds)
KINDS = {"cpp": lambda n: [True] * n, "python": lambda n: [False] * n,
         "mixed": lambda n: [r % 2 == 0 for r in range(n)],
         "halves": lambda n: [r < (n + 1) // 2 for r in range(n)]}
