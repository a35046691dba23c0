"""Device placement and the cost of ddp_fusion's own exchanges, without a GPU or ranks:

* every tensor factory in ``ddp_fusion/`` names its device (``device=``), unless its
  line says it is host-side on purpose: a factory without one makes a CPU tensor, which
  a NCCL group refuses (gloo takes it, so the CPU tests would never notice);
* the host group's max (host_group.py), on which the per-step plan check runs, takes
  O(log N) message hops, not O(N) as an all-gather of one value per rank in a ring:
  checked on a simulated transport for every N up to 33, against the critical path
  ``ceil(log2 N)`` (plus 2 when N is not a power of two).

The collectives' devices themselves are checked on 2 gloo ranks in
tests/test_gpu_ready_gloo.py.
"""

import ast
import datetime
import math
import pathlib
import queue
import threading

import numpy as np
import pytest
import torch

import ddp_fusion
from ddp_fusion import host_group

PACKAGE = pathlib.Path(ddp_fusion.__file__).parent
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
             "empty_strided", "eye", "linspace"}
HOST_SIDE = "host-side"


def _factories_without_device(source: str) -> list[tuple[int, str]]:
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            call = lines[node.lineno - 1: node.end_lineno]
            if not any(HOST_SIDE in line for line in call):
                found.append((node.lineno, lines[node.lineno - 1].strip()))
    return found


def test_the_scan_finds_a_factory_without_a_device():
    assert _factories_without_device("import torch\nx = torch.zeros(3, dtype=torch.int32)\n") == [
        (2, "x = torch.zeros(3, dtype=torch.int32)")]
    host = "x = torch.zeros(3, device=d)\ny = torch.tensor([1])  # host-side\n"
    assert _factories_without_device(host) == []


def test_every_tensor_factory_in_the_package_names_its_device():
    found = {
        f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in _factories_without_device(path.read_text())
    }
    assert not found, (
        "tensor factories without device= (a CPU tensor, which a NCCL group refuses); give the "
        f"device, or say '{HOST_SIDE}' on the line if it must live on the host:\n" + "\n".join(sorted(found))
    )


class _Work:
    def __init__(self, done=lambda timeout: None):
        self._done = done

    def wait(self, timeout=None):
        self._done(timeout)
        return True


class _Transport:
    """Point-to-point messages between N simulated ranks (threads), each carrying its
    sender's hop count, as ``host_group.PythonRounds`` sends them through gloo."""

    def __init__(self, size, wait_s=10.0):
        self.boxes = {(a, b): queue.Queue() for a in range(size) for b in range(size)}
        self.wait_s = wait_s
        self.broken: set[tuple[int, int]] = set()  # (src, dst) whose sends fail
        self.sends = [0] * size
        self.hops = [0] * size  # per rank: the longest chain of messages that reached it

    def rank(self, rank):
        transport = self

        class _PG:
            def send(self, tensors, dst, tag):
                if (rank, dst) in transport.broken:
                    raise ConnectionError(f"connection to {dst} closed")
                transport.sends[rank] += 1
                transport.boxes[rank, dst].put((tensors[0].clone(), transport.hops[rank] + 1))
                return _Work()

            def recv(self, tensors, src, tag):
                def done(timeout):
                    wait_s = transport.wait_s if timeout is None else timeout.total_seconds()
                    value, hops = transport.boxes[src, rank].get(timeout=wait_s)
                    tensors[0].copy_(value)
                    transport.hops[rank] = max(transport.hops[rank], hops)
                return _Work(done)

        return _PG()


def _simulated_max(size: int, values: list[list[int]]) -> tuple[list[list[int]], _Transport]:
    transport = _Transport(size)
    results: list = [None] * size

    def run(rank):
        rounds = host_group.PythonRounds(rank, size)
        results[rank] = rounds.run(transport.rank(rank), list(values[rank]), datetime.timedelta(seconds=10))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results, transport


@pytest.mark.parametrize("size", range(1, 34))
def test_the_host_groups_max_takes_log_n_hops(size):
    rng = np.random.default_rng(size)
    values = [[int(v) for v in rng.integers(-1000, 1000, 2)] for _ in range(size)]
    values[size // 2][0] = host_group.NEUTRAL  # a joined rank's contribution never wins
    results, transport = _simulated_max(size, values)
    want = [max(v[i] for v in values) for i in range(2)]
    assert results == [want] * size
    log = math.ceil(math.log2(size)) if size > 1 else 0
    extra = 0 if size & (size - 1) == 0 else 2  # fold the ranks above a power of two in and out
    assert max(transport.hops) <= log + extra, transport.hops
    assert max(transport.sends) <= log + 1, transport.sends


def test_a_rank_whose_exchange_failed_carries_it_to_peers_that_succeeded():
    """Three ranks: in the second exchange rank 0's last send (the result, to rank 2,
    folded in) fails, so rank 0 fails while rank 1 succeeds. Rank 2 is gone for the
    third exchange: rank 1 must hear rank 0's failure (naming rank 2) from rank 0's
    rounds, not time out on a rank 0 that went quiet."""
    transport = _Transport(3)
    rounds = [host_group.PythonRounds(r, 3) for r in range(3)]
    timeout = datetime.timedelta(seconds=1)  # (each round's wait: this, plus 2 s a round)

    def exchange(ranks):
        out = {}

        def run(r):
            try:
                out[r] = rounds[r].run(transport.rank(r), [r], timeout)
            except Exception as e:  # noqa: BLE001 - the result
                out[r] = str(e)

        threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return out

    assert exchange([0, 1, 2]) == {0: [2], 1: [2], 2: [2]}
    transport.broken.add((0, 2))
    second = exchange([0, 1, 2])
    assert second[1] == [2] and "could not exchange with group rank 2" in second[0], second
    third = exchange([0, 1])
    assert third[0] == second[0], third
    assert "group rank 0 could not exchange with group rank 2" in third[1], third


def test_agree_is_true_only_when_every_rank_holds_the_same_value():
    def agree(values):
        results, _ = _simulated_max(len(values), [[v, -v] for v in values])
        return [top == v and -neg_bottom == v for (top, neg_bottom), v in zip(results, values)]

    assert agree([7, 7, 7, 7, 7]) == [True] * 5
    assert agree([7, 7, 8, 7, 7]) == [False] * 5
    assert agree([-(2**63) + 1, -(2**63) + 1, 2**63 - 1]) == [False] * 3
    assert torch.iinfo(torch.int64).min == host_group.NEUTRAL
