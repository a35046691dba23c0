"""Host groups in one process: where group rank 0 cannot describe a disagreement (it
left, or is stuck), every other rank's error still reads as the error it is: its
header, then what that rank knows."""

import datetime

import pytest
import torch
import torch.distributed as dist

from ddp_fusion import _torch, host_group, plan_check, settings_check
from ddp_fusion.host_group import HostGroup
from ddp_fusion.plan import BucketPlan, PlannedBucket


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
    peers = {r: host_group._peers(r, size) for r in range(size)}
    assert all(r in peers[p] for r in peers for p in peers[r])
    p = 1 << (size.bit_length() - 1)
    assert all(len(peers[r]) == (p.bit_length() - 1) + (r + p < size) for r in range(p))


@pytest.fixture(params=["python", "native"])
def kind(request):
    """Which channel: :class:`host_group.PairChannel` or its C++ twin,
    :class:`host_group.NativePairChannel` (the same frames and errors)."""
    if request.param == "native" and host_group.native() is None:
        pytest.fail(f"the C++ extension did not build: {__import__('ddp_fusion._native')._native.failure()}")
    return {"python": host_group.PairChannel, "native": host_group.NativePairChannel}[request.param]


@pytest.fixture
def pair(kind):
    """The two ends of a channel (one process, a socket pair)."""
    a, b = __import__("socket").socketpair()
    timeout = datetime.timedelta(seconds=5)
    ends = kind(a, timeout), kind(b, timeout)
    yield ends
    for end in ends:
        end.close()


def test_python_and_native_channels_talk_to_each_other():
    """The same frames on the wire: a rank whose C++ part did not build works with one
    whose did."""
    a, b = __import__("socket").socketpair()
    timeout = datetime.timedelta(seconds=5)
    mine, theirs = host_group.PairChannel(a, timeout), host_group.NativePairChannel(b, timeout)
    try:
        exchanges = [mine.post([3, -3]), theirs.post([5, -5]), theirs.post([1, 2, 3]), mine.post([0, 7, 0])]
        assert [e.result() for e in exchanges] == [[5, -3], [5, -3], [1, 7, 3], [1, 7, 3]]
        assert [mine.ticket(), mine.ticket(), theirs.ticket()] == [1, 2, 1]
    finally:
        mine.close()
        theirs.close()


def test_pair_exchanges_are_matched_in_posting_order_whatever_order_they_are_collected(pair):
    import numpy as np

    mine, theirs = pair
    first, second = mine.post(np.array([3, -3])), mine.post(np.array([7, 0, 1]))
    their_first, their_second = theirs.post(np.array([5, -5])), theirs.post(np.array([2, 9, -4]))
    assert second.result() == [7, 9, 1]  # (the first message is read and kept for its turn)
    assert first.result() == [5, -3]
    assert their_first.result() == [5, -3] and their_second.result() == [7, 9, 1]


def test_pair_exchanges_of_different_lengths_raise_instead_of_mixing(pair):
    import numpy as np

    mine, theirs = pair
    exchange = mine.post(np.array([1, -1]))
    theirs.post(np.array([1, 2, 3]))
    with pytest.raises(host_group.HostGroupError,
                       match="asked for different exchanges .*2 values on this rank, 3"):
        exchange.result()


def test_a_pair_exchange_whose_peer_has_gone_raises_at_once_and_one_never_answered_in_time(pair):
    import time

    import numpy as np

    mine, theirs = pair
    exchange = mine.post(np.array([1, -1]))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="sent nothing"):
        exchange.result(timeout=0.2)
    assert time.monotonic() - start < 2
    pending = mine.post(np.array([2, -2]))
    theirs.close()
    with pytest.raises(ConnectionError, match="the peer closed the connection"):
        pending.result()
    with pytest.raises(ConnectionError, match="could not send to the peer: its process ended"):
        mine.post(np.array([0]))


def test_a_pair_message_that_arrives_in_pieces_is_collected_whole_after_a_timeout(kind):
    import numpy as np

    a, theirs = __import__("socket").socketpair()
    mine = kind(a, datetime.timedelta(seconds=5))
    try:
        exchange = mine.post(np.array([4, -4]))
        frame = host_group._FRAME.pack(2) + np.array([6, -6], dtype="<i8").tobytes()
        theirs.send(frame[:7])  # (the header and part of the first value)
        with pytest.raises(TimeoutError, match="sent nothing in time"):
            exchange.result(timeout=0.1)
        theirs.send(frame[7:])
        assert exchange.result() == [6, -4]
    finally:
        mine.close()
        theirs.close()


def test_a_pair_exchange_collected_after_its_host_group_ended_says_so(pair):
    import numpy as np

    mine, _ = pair
    exchange = mine.post(np.array([1, -1]))
    mine.close()
    with pytest.raises(ConnectionError, match="was closed here: its host group has ended"):
        exchange.result()


def _relays(size, timeout_s=5.0, kind=None):
    """The channels to ``size`` connected exchange relays (one process, as the ranks of
    a group of ``size`` would make them), and the relays' processes."""
    import time

    deadline = time.monotonic() + 10
    started = [host_group.start_relay(r, size, "127.0.0.1", timeout_s, "test/relay", deadline)
               for r in range(size)]
    where = {r: w for r, (_, _, w) in enumerate(started)}
    for r, (_, ctrl, _) in enumerate(started):
        host_group.connect_relay(ctrl, {q: where[q] for q in host_group._peers(r, size)}, 10)
    for _, ctrl, _ in started:
        assert __import__("ddp_fusion._relay")._relay.read_text(ctrl, deadline) == "ok"
    grace = datetime.timedelta(seconds=timeout_s + host_group.RELAY_GRACE_S)
    channels = [(kind or host_group.channel)(ctrl, grace, f"relay {r}")
                for r, (_, ctrl, _) in enumerate(started)]
    return channels, [proc for proc, _, _ in started]


@pytest.fixture
def relays5(kind):
    channels, procs = _relays(5, kind=kind)
    yield channels, procs
    _ended(channels, procs)


def test_relays_give_every_rank_the_max_while_this_process_holds_the_gil(relays5):
    """Five ranks (one folded into rank 0): every rank gets the element-wise max, also
    of exchanges collected out of order; and the rounds run while this process's main
    thread spins in Python with the switch interval at 10 s, so no other thread of this
    process could run: they need no Python here."""
    import sys
    import time

    import numpy as np

    channels, _ = relays5
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        firsts = [c.post(np.array([r, -r])) for r, c in enumerate(channels)]
        seconds = [c.post(np.array([10 * r % 7, 0, -r])) for r, c in enumerate(channels)]
        end = time.monotonic() + 0.5
        while time.monotonic() < end and not all(e.done() for e in seconds):
            sum(range(1000))  # (Python, holding the GIL)
        done = [e.done() for e in firsts + seconds]
    finally:
        sys.setswitchinterval(interval)
    assert all(done), done
    assert [e.result() for e in seconds] == [[6, 0, 0]] * 5
    assert [e.result() for e in firsts] == [[4, 0]] * 5


def test_relays_whose_ranks_ask_for_different_exchanges_fail_on_every_rank(relays5):
    """Every rank raises the same reason, the relays exit, and the next post says why
    (not a broken pipe)."""
    import numpy as np

    channels, procs = relays5
    exchanges = [c.post(np.array([1, 2] if r != 3 else [1, 2, 3])) for r, c in enumerate(channels)]
    for exchange in exchanges:
        with pytest.raises(ConnectionError, match="failed: exchange 0: .*asked for different exchanges"):
            exchange.result()
    assert all(proc.wait(timeout=5) == 0 for proc in procs)  # (a relay exits after a failure)
    with pytest.raises(ConnectionError, match="relay 0 failed: exchange 0: .*asked for different exchanges"):
        channels[0].post(np.array([1, 2]))


def _ended(channels, procs):
    for channel, proc in zip(channels, procs):
        channel.close()
        proc.kill()
        proc.wait()


def test_a_relay_exchange_fails_in_time_when_a_peer_never_comes(kind):
    import time

    import numpy as np

    channels, procs = _relays(3, timeout_s=0.5, kind=kind)
    try:
        start = time.monotonic()
        exchange = channels[0].post(np.array([1, -1]))  # (ranks 1 and 2 never post)
        with pytest.raises(ConnectionError,
                           match="relay 0 failed: exchange 0: group rank 2 sent nothing within 0.5 s"):
            exchange.result()
        assert time.monotonic() - start < 3
    finally:
        _ended(channels, procs)


def test_a_relay_exchange_fails_at_once_on_every_rank_when_a_peer_has_ended(kind):
    """Rank 2's relay ends (its rank closed the channel): the others' exchange fails at
    once, not after the 60 s timeout, with the same reason on both."""
    import time

    import numpy as np

    channels, procs = _relays(3, timeout_s=60, kind=kind)
    try:
        channels[2].close()
        assert procs[2].wait(timeout=5) == 0
        start = time.monotonic()
        exchanges = [channels[r].post(np.array([r])) for r in (0, 1)]
        for r, exchange in zip((0, 1), exchanges):
            with pytest.raises(ConnectionError, match=f"relay {r} failed: exchange 0: group rank 2's relay "
                                                      r"closed the connection \(its process ended\)"):
                exchange.result()
        assert time.monotonic() - start < 3
    finally:
        _ended(channels, procs)


def test_relays_exchange_more_than_their_sockets_hold(kind):
    """A million values (8 MB) each way: both peers of a round send at once, so each
    must read while it writes."""
    import numpy as np

    channels, procs = _relays(4, timeout_s=60, kind=kind)
    try:
        n = 1_000_000
        exchanges = [c.post(np.full(n, r, dtype=np.int64)) for r, c in enumerate(channels)]
        assert all(e.result()[::100_000] == [3] * 10 for e in exchanges)
    finally:
        _ended(channels, procs)


def test_relays_work_with_descriptors_past_1024(kind):
    """A busy training process has more than 1024 files open: ``select`` cannot wait
    on such descriptors (the relay gets the rank's descriptor number)."""
    import resource

    import numpy as np

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"the hard limit on open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1300), hard))
    held = []
    try:
        while not held or held[-1].fileno() < 1100:
            held.append(open("/dev/null"))  # noqa: SIM115 - held open on purpose
        channels, procs = _relays(3, kind=kind)
        try:
            assert channels[0].fileno() > 1024
            exchanges = [c.post(np.array([r])) for r, c in enumerate(channels)]
            assert [e.result() for e in exchanges] == [[2]] * 3
        finally:
            _ended(channels, procs)
    finally:
        for f in held:
            f.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_relays_end_with_their_channels_while_a_forked_child_lives(kind):
    """A forked child (a DataLoader worker) closes its copies of the channels: the
    relays see the rank's end close when the rank closes it, not when the child exits."""
    import os
    import time
    import warnings

    channels, procs = _relays(3, kind=kind)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (fork with threads: the child only sleeps)
            pid = os.fork()
        if pid == 0:
            time.sleep(10)
            os._exit(0)
        for channel in channels:
            channel.close()
        assert [proc.wait(timeout=5) for proc in procs] == [0, 0, 0]
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        _ended(channels, procs)


def test_relay_set_up_fails_on_every_rank_naming_the_rank_that_failed(monkeypatch):
    """Group rank 2 of 3 cannot start its relay: every rank raises, naming it, within
    the connection time, including rank 1, whose own relay connected."""
    import threading
    import time

    store = dist.HashStore()
    monkeypatch.setattr(_torch.distributed, "default_store", lambda: store)
    started = host_group.start_relay

    def start_relay(rank, *args):
        if rank == 2:
            raise OSError("no such file: python")
        return started(rank, *args)

    monkeypatch.setattr(host_group, "start_relay", start_relay)
    errors = {}

    def rank(r):
        host = object.__new__(HostGroup)
        host.group_name, host.rank, host.size = "0", r, 3
        host.global_ranks, host.prefix = [0, 1, 2], "test/setup"
        host.timeout, host._relay = datetime.timedelta(seconds=30), None
        try:
            host._relay_channel(2.0)
        except host_group.HostGroupError as e:
            errors[r] = str(e)

    start = time.monotonic()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(errors) == [0, 1, 2], errors
    assert all("group rank 2 (" in e and "no such file: python" in e for e in errors.values()), errors
    assert time.monotonic() - start < 10
