"""The plan ops' C++ kernels (ddp_fusion/csrc/host_check.cpp) in one process: a plan
marked steady on group rank 0's exchanger of a host group of two (gloo groups of this
process), group rank 1 played by the test. What they do on a steady step, and that
every other case goes to the Python code: a mismatch, a peer gone, a start that runs in
Python after a C++ one whose guard never ran, a guard that runs in Python after a C++
start."""

import pytest
import torch

from ddp_fusion import PlanMismatchError, plan_check

from _exchangers import leave_all, native as _native, ranks as _ranks

GROUP = "test_native"
H = 0x1234_5678_9ABC
CPU = torch.device("cpu")


class _Host:
    """What the Python side uses of a steady plan's host group: its exchanger, and a
    mismatch's description (the store's, in a real group)."""

    def __init__(self, exchanger):
        self.exchanger = exchanger

    def report(self, topic, ticket, mine, describe):
        return f"mismatch described, ticket {ticket}"

    def ranks(self, ranks):
        return str(ranks)


@pytest.fixture
def steady(monkeypatch):
    """(the C++ module, this rank's exchanger, the peer), the plan ``H`` of group
    ``GROUP`` marked steady on this rank's exchanger (divisor 2)."""
    native = _native()
    mine, peer = _ranks([True, True], timeout_s=5)
    mine = mine.x
    native.register_kernels(plan_check.plan_check_start, plan_check.plan_guard,
                            plan_check._steady_start_failed, plan_check._steady_failed)
    monkeypatch.setitem(plan_check._steady_hosts, GROUP, _Host(mine))
    monkeypatch.setitem(plan_check._texts, H, "{}")
    native.mark_steady(GROUP, mine.core, H, 2.0)
    yield native, mine, peer
    native.forget(GROUP)
    while native.take_pending(GROUP, H) is not None:
        pass
    leave_all()


def _start():
    return plan_check.PLAN_CHECK_START(GROUP, "{}", H, CPU, "avg")


def _guard(token):
    return plan_check.PLAN_GUARD(token, GROUP, H, "avg", CPU)


def test_a_steady_step_runs_in_cpp_and_a_mismatch_raises_the_python_error(steady):
    native, mine, peer = steady
    starts, guards = native.counts()
    token = _start()
    assert token.item() == 2.0 and native.pending() == 1
    assert peer.post([H, -H]).result() == [H, -H]  # (the peer's side of the exchange)
    assert _guard(token).item() == 2.0
    assert native.counts() == (starts + 1, guards + 1) and native.pending() == 0

    token = _start()
    peer.post([H + 1, -H])
    with pytest.raises(PlanMismatchError, match="mismatch described, ticket 2"):
        _guard(token)
    assert native.counts() == (starts + 2, guards + 1)


def test_a_start_that_goes_to_python_drops_a_cpp_check_whose_guard_never_ran(steady):
    """A backward failed between its C++ start and its guard; the next step's start runs
    in Python (the plan no longer steady): its guard must collect that step's exchange,
    not the one left behind."""
    native, mine, peer = steady
    _start()
    assert native.pending() == 1
    native.forget(GROUP)
    with pytest.raises(RuntimeError, match="not registered"):  # (the Python start: no such group here)
        _start()
    assert native.pending() == 0


def test_a_guard_that_runs_in_python_collects_the_cpp_start_s_check(steady, monkeypatch):
    native, mine, peer = steady
    token = _start()
    monkeypatch.setattr(plan_check, "_known_group", lambda name: None)
    monkeypatch.setattr(plan_check, "_divisor_tensor", lambda group, op, device: torch.tensor(2.0))
    monkeypatch.setattr(plan_check, "_mark_steady", lambda *args: None)
    monkeypatch.setattr(plan_check, "_reported", {(GROUP, H)})
    peer.post([H + 1, -H])
    with pytest.raises(PlanMismatchError, match="mismatch described"):
        plan_check.plan_guard(token, GROUP, H, "avg", CPU)  # (the Python op, as with native_check off)
    assert native.pending() == 0


def test_a_steady_check_whose_peer_has_gone_raises_the_python_error_naming_it(steady):
    native, mine, peer = steady
    peer.leave()
    token = _start()
    with pytest.raises(RuntimeError, match=r"the per-step plan check of process group 'test_native' failed .*"
                                           r"ConnectionError: exchange \d+: group rank 0 could not exchange "
                                           r"with group rank 1: .*Connection closed by peer"):
        _guard(token)
    assert native.pending() == 0
