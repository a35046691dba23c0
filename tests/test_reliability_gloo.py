"""Ranks that would issue different collectives get a clear error on every rank, never
a hang (2 gloo ranks; 3 and 4 where the host group's rounds carry a failure on)."""

import re

from ddp_fusion.launch import run_ranks

import pytest

from _workers import different_models, mismatched_plans, peer_dies_mid_step, plans_diverge_at_step_3


def test_rank_dependent_backward_raises_plan_mismatch_on_every_rank():
    errors = run_ranks(mismatched_plans, world_size=2, timeout=600)
    for err in errors:
        assert err is not None and "different gradient bucket plans" in err
        assert "group rank 1 has no gradient for: b.bias, b.weight" in err


@pytest.mark.parametrize("native", [(True, True), (False, False), (True, False), (True,) * 4],
                         ids=["cpp", "python", "mixed", "cpp-4-ranks"])
def test_plans_that_diverge_at_a_later_step_raise_on_every_rank(native):
    """Ranks agree for two steps, then one recompiles: the per-step plan check makes
    every rank raise at that step, well within the process-group timeout. The second
    step's check ran in C++ where ``native_check`` is on (``cpp``: the C++ guard finds
    the mismatch at the third step and the Python code describes it), in Python where it
    is off, and either way on each rank (``mixed``: the same messages)."""
    results = run_ranks(plans_diverge_at_step_3, world_size=len(native), args=(native,), timeout=300,
                        pg_timeout=60)
    for rank, (step, err, steady) in enumerate(results):
        assert step == 2, (step, err)
        assert "different gradient bucket plans" in err
        assert "group rank 1 has no gradient for: b.bias, b.weight" in err
        assert steady == ((1, 1) if native[rank] else (0, 0)), (rank, steady)


def test_different_models_fail_at_construction_on_every_rank():
    errors = run_ranks(different_models, world_size=2, timeout=120)
    for err in errors:
        assert err is not None and "different settings at construction" in err
        assert ("group rank 1: parameter #0 is 'weight' (9, 8) float32 "
                "(group rank 0: 'weight' (8, 8) float32)") in err


PEER_GONE = re.compile(
    r"gloo/transport/tcp/pair\.cc:\d+\] "
    r"(Connection closed by peer|Read error \S+: Connection reset by peer)"
    # compiled: the plan check's exchange on the host group (gloo too) may see it first,
    # in the guard before the first bucket
    r"|the per-step plan check of process group '\S+' failed .*: ConnectionError: exchange \d+: "
    r"group rank 0 could not exchange with group rank 1: \S*gloo/transport/tcp/pair\.cc:\d+\] "
    r"(Connection closed by peer|Read error \S+: Connection reset by peer)"
)


@pytest.mark.parametrize("compiled", [False, True], ids=["uncompiled", "compiled"])
def test_dead_peer_raises_within_process_group_timeout(compiled):
    """The survivor's backward raises a plain ``RuntimeError`` naming a connection the
    peer closed or reset (gloo's, both seen on torch 2.13; compiled, the plan check's own,
    which names the group rank), compiled or not: not a hang, a timeout or another
    error; well within the process-group timeout (20 s)."""
    result, _ = run_ranks(peer_dies_mid_step, world_size=2, args=(compiled,), timeout=600, pg_timeout=20)
    kind, seconds, message, _ = result
    assert kind == "builtins.RuntimeError", (kind, message)
    assert PEER_GONE.search(message), message
    assert seconds < 20 + 10, (kind, seconds, message)


def test_dead_peer_of_three_raises_on_both_survivors_naming_it():
    """Three ranks, compiled: rank 1 leaves after the forward, and both survivors'
    backwards raise at once (rank 2 never exchanges with rank 1: rank 0's round carries
    the failure on), naming group rank 1. About 25 s on 2 cores."""
    results = run_ranks(peer_dies_mid_step, world_size=3, args=(True,), timeout=600, pg_timeout=20)
    for rank in (0, 2):
        kind, seconds, message, _ = results[rank]
        assert kind == "builtins.RuntimeError", (rank, kind, message)
        assert re.search(r"group rank \d could not exchange with group rank 1: .*(Connection closed by peer"
                         r"|Connection reset by peer|the connection failed)", message), (rank, message)
        assert seconds < 10, (rank, seconds, message)


def test_a_rank_killed_mid_step_of_four_fails_every_survivor_within_seconds():
    """Four ranks, compiled: rank 1 is SIGKILLed after its forward (its process group
    never destroyed); the survivors' backwards raise within seconds of it (the group's
    timeout is 60 s), naming group rank 1, and no process of ddp_fusion's is left on
    them (a host group starts none)."""
    results = run_ranks(peer_dies_mid_step, world_size=4, args=(True, True), timeout=600, pg_timeout=60)
    for rank in (0, 2, 3):
        kind, seconds, message, children = results[rank]
        assert kind == "builtins.RuntimeError", (rank, kind, message)
        assert re.search(r"could not exchange with group rank 1: ", message), (rank, message)
        assert seconds < 1 + 9, (rank, seconds, message)
        assert children == 0, (rank, children)


def test_a_30_day_group_timeout_trains_and_still_catches_a_divergence():
    """A group timeout of 30 days (a common way to turn timeouts off): the ranks (one
    with the C++ part, one without) train two steps and both raise at the third, when
    one recompiles."""
    results = run_ranks(plans_diverge_at_step_3, world_size=2, args=((True, False),), timeout=300,
                        pg_timeout=30 * 86400)
    for step, err, _ in results:
        assert step == 2 and "different gradient bucket plans" in err, (step, err)
