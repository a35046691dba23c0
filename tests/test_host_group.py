"""Host groups in one process: where group rank 0 cannot describe a disagreement (it
left, or is stuck), every other rank's error still reads as the error it is: its
header, then what that rank knows. And the max's rounds (the C++ exchanger and its
Python twin), each rank a thread of this process with a gloo group of its own."""

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from ddp_fusion import _torch, host_group, plan_check, settings_check
from ddp_fusion.host_group import HostGroup
from ddp_fusion.plan import BucketPlan, PlannedBucket

from _exchangers import KINDS, leave_all, ranks as _ranks


@pytest.fixture(autouse=True)
def _ranks_leave():
    yield
    leave_all()


@pytest.fixture
def rank1_alone(monkeypatch):
    """Group rank 1 of 2 of a host group whose group rank 0 never describes anything
    (a store of its own; the wait for rank 0 cut to 0.2 s)."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    monkeypatch.setattr(_torch.distributed, "default_store", lambda: store)
    monkeypatch.setattr(host_group, "REPORT_TIMEOUT_S", 0.2)
    host = object.__new__(HostGroup)
    host.group_name, host.rank, host.size = "0", 1, 2
    host.global_ranks, host.prefix = [0, 1], "test/host"
    return host


def test_plan_mismatch_keeps_its_header_when_rank_0_is_gone(rank1_alone):
    bucket = PlannedBucket("0", torch.float32, "cpu", "avg", "concat", ("w2", "w1"), (15, 5))
    plan = BucketPlan("concat", (bucket,)).to_json()
    plan_check._publish(plan, plan_check.plan_hash(plan))
    text = plan_check.describe_mismatch(rank1_alone, 1, "0", plan_check.plan_hash(plan))
    first, *rest = text.splitlines()
    assert first.startswith("ddp_fusion: ranks of process group '0' compiled different gradient bucket plans")
    assert "  group rank 1: 1 buckets, bytes [80]" in rest, text
    assert "group rank 0 did not describe the other ranks within 0.2 s" in text, text


def test_settings_mismatch_keeps_its_header_when_rank_0_is_gone(rank1_alone, monkeypatch):
    host = rank1_alone
    monkeypatch.setattr(host, "ticket", lambda: 1, raising=False)
    monkeypatch.setattr(host, "agree", lambda value: False, raising=False)
    rank0 = '{"algorithm": "concat", "bucket_cap_mb": 25}'
    monkeypatch.setattr(host, "broadcast_json", lambda obj, src=0: rank0, raising=False)
    with pytest.raises(settings_check.SettingsMismatchError) as e:
        settings_check.check(host, "the model", "at construction",
                             {"algorithm": "concat", "bucket_cap_mb": 5})
    first, *rest = str(e.value).splitlines()
    assert first.startswith("ddp_fusion: the model: the ranks of process group '0' have different settings "
                            "at construction"), str(e.value)
    assert "  group rank 1: bucket_cap_mb is 5 (group rank 0: 25)" in rest, str(e.value)
    assert "group rank 0 did not describe the other ranks" in str(e.value)


@pytest.mark.parametrize("size", [1, 2, 5, 8])
def test_peers_are_those_of_the_exchange(size):
    """Who each rank exchanges with in the host group's max (recursive doubling, the
    ranks above the largest power of two folded in): each pair from both sides."""
    peers = {r: host_group.peers(r, size) for r in range(size)}
    assert all(r in peers[p] for r in peers for p in peers[r])
    p = 1 << (size.bit_length() - 1)
    assert all(len(peers[r]) == (p.bit_length() - 1) + (r + p < size) for r in range(p))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("size", [2, 3, 5, 7])
def test_every_rank_gets_the_max_of_each_exchange_in_posting_order(kind, size):
    """Exchanges of different lengths, collected in any order; ranks with and without
    the C++ part together (``mixed``)."""
    ranks = _ranks(KINDS[kind](size))
    posted = [(r.post([r.rank, -r.rank]), r.post([0, 7 * r.rank, 1])) for r in ranks]
    for first, second in posted:
        assert second.result() == [0, 7 * (size - 1), 1]
        assert first.result() == [size - 1, 0]


@pytest.mark.parametrize("kind", ["cpp", "python"])
def test_the_cpp_rounds_run_while_this_process_holds_the_gil(kind):
    """Five ranks (one folded in): every exchange completes while this thread holds the
    GIL for 0.5 s without a break (as a training step's backward holds it for long
    stretches) in C++; the Python rounds, which need the GIL, cannot."""
    import ctypes

    ranks = _ranks(KINDS[kind](5))
    exchanges = [r.post([r.rank]) for r in ranks]
    ctypes.PyDLL(None).usleep(500_000)  # (a PyDLL call keeps the GIL)
    done = [e.done() for e in exchanges]
    assert [e.result() for e in exchanges] == [[4]] * 5
    assert all(done) if kind == "cpp" else not any(done), done


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("size", [3, 4, 5])
def test_a_rank_that_has_gone_fails_every_rank_at_once_naming_it(kind, size):
    """The last rank's process ends: every other rank's exchange fails within seconds
    (the group's timeout is 60 s), naming it, also ranks that never exchange with it
    (a peer that did carries the failure on), and the group's next exchange fails on
    every rank with the same reason, as fast (each carries the failure to its peers)."""
    ranks = _ranks(KINDS[kind](size), timeout_s=60)
    assert [e.result() for e in [r.post([1]) for r in ranks]] == [[1]] * size  # (connected)
    gone = size - 1
    ranks[gone].leave()
    start = time.monotonic()
    errors = []
    for exchange in [r.post([r.rank]) for r in ranks[:gone]]:
        with pytest.raises(ConnectionError) as e:
            exchange.result()
        errors.append(str(e.value))
    assert time.monotonic() - start < 10, errors
    for text in errors:
        assert f"could not exchange with group rank {gone}" in text, errors
    start = time.monotonic()
    for r, exchange in zip(ranks, [r.post([0]) for r in ranks[:gone]]):
        with pytest.raises(ConnectionError) as e:
            exchange.result()
        assert str(e.value) == errors[r.rank]
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("kind", ["cpp", "python"])
def test_a_silent_rank_fails_every_rank_after_the_timeout(kind):
    """Rank 2 of 4 never asks for the exchange: the others fail after the timeout (0.5 s)
    and a grace period a round, never later. Ranks 0 and 3 wait for it and name it;
    rank 1's rounds never reach rank 2: it hears from rank 3, whose gloo group closes its
    connections when a wait of its times out (gloo's way), so it names rank 3."""
    ranks = _ranks(KINDS[kind](4), timeout_s=0.5)
    exchanges = {r.rank: r.post([r.rank]) for r in ranks if r.rank != 2}
    start = time.monotonic()
    for rank, e in exchanges.items():
        peer = 3 if rank == 1 else 2
        with pytest.raises(ConnectionError, match=f"could not exchange with group rank {peer}: "):
            e.result()
    assert time.monotonic() - start < 0.5 + 3 * host_group.GRACE_S


@pytest.mark.parametrize("kind", ["cpp", "python"])
def test_exchanges_of_different_lengths_time_out_instead_of_mixing(kind):
    """gloo ends a process that receives a message longer than the buffer posted for it;
    a message of the max is tagged with its length, so ranks that ask for different
    exchanges wait for each other's and fail after the timeout, naming the peer."""
    ranks = _ranks(KINDS[kind](2), timeout_s=0.5)
    exchanges = [ranks[0].post([1, 2]), ranks[1].post([1, 2, 3])]
    for e in exchanges:
        # (the first to time out closes its gloo group's connections: the other may see that)
        with pytest.raises(ConnectionError, match="could not exchange with group rank [01]: .*"
                                                  "([Tt]imed out|Connection closed by peer)"):
            e.result()


def test_a_30_day_timeout_works():
    """A timeout of days (a common way to turn timeouts off) is a timeout like another,
    in C++ and in Python."""
    ranks = _ranks([True, False], timeout_s=30 * 86400)
    assert [e.result() for e in [r.post([r.rank]) for r in ranks]] == [[1], [1]]


@pytest.mark.parametrize("size", [2, 3])
def test_an_exchange_of_a_host_group_that_ends_fails_at_once(size):
    """Closing the exchanger aborts the round in flight (its peers never came) and
    fails what was posted after it, saying so (a group of two runs its exchanges on the
    callers' threads, a larger one on the exchanger's)."""
    ranks = _ranks([True] * size, timeout_s=600)
    waiting, queued = ranks[0].post([1]), ranks[0].post([2])
    time.sleep(0.2)
    start = time.monotonic()
    ranks[0].x.close(5.0)
    with pytest.raises(ConnectionError, match="its host group (ended|has ended)"):
        waiting.result()
    with pytest.raises(ConnectionError, match="its host group"):
        queued.result()
    with pytest.raises(ConnectionError, match="its host group has ended"):
        ranks[0].post([3])
    assert time.monotonic() - start < 5
