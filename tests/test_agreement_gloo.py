"""Settings given on some ranks only, and a rank that fails where the others do not,
end the same way on every rank (2 gloo ranks): a clear error naming the setting and
the ranks, within seconds and outside Dynamo's trace; or the same fallback everywhere,
with warnings that say what each rank runs. Before: a hang (``bucket_cap_mb="auto"``
or ``DDP_FUSION_LINK`` on some ranks, a link probe that fails on one rank), gradients
silently mixed (a parameter frozen on one rank), an ``IndexError`` from inside Dynamo's
trace (the same, compiled), or a warning that named the wrong plan."""

import pytest

from ddp_fusion.launch import run_ranks

from _workers_agree import (
    flag_on_one_rank,
    learning_fails_on_one_rank,
    settings_differ_at_construction,
    settings_differ_at_first_forward,
)

CONSTRUCTION = {
    "auto on one rank": "bucket caps (bytes) is [1048576, 26214400] (group rank 0: 'auto')",
    "bucket_cap_mb": "bucket caps (bytes) is [2097152] (group rank 0: [1048576])",
    "find_unused_parameters": "find_unused_parameters is False (group rank 0: True)",
    "comm_dtype": "comm_dtype is None (group rank 0: 'float16')",
    "frozen weight (sizes shift)": "parameter #0 is 'a.weight' (16, 16) float32 requires_grad=False "
                                   "(group rank 0: 'a.weight' (16, 16) float32)",
    "frozen bias (equal sizes)": "parameter #1 is 'a.bias' (16,) float32 requires_grad=False "
                                 "(group rank 0: 'a.bias' (16,) float32)",
    "config.link with auto, torch DDP": "link (config.link) is [30.0, 12.5] (group rank 0: None)",
    "config.plan_check": "config.plan_check is False (group rank 0: True)",
}
FIRST_FORWARD = {
    "config.algorithm, compiled": "config.algorithm is 'coalesced' (group rank 0: 'concat')",
    "comm hook, uncompiled": "comm hook is None (group rank 0: 'fp16_compress_hook')",
    "config.plan_check, compiled": "config.plan_check is False (group rank 0: True)",
}


def _check(results, expected, when):
    for rank, out in enumerate(results):
        assert set(out) == set(expected)
        for i, (case, line) in enumerate(expected.items()):
            err, seconds, kind = out[case]
            assert kind == "SettingsMismatchError", (rank, case, err)
            assert f"different settings {when}" in err and f"group rank 1: {line}" in err, (rank, case, err)
            # the first case also pays for the first construction (imports, connections)
            assert i == 0 or seconds < 10, (rank, case, seconds)


def test_settings_that_differ_raise_at_construction_on_every_rank():
    results = run_ranks(settings_differ_at_construction, world_size=2, timeout=300, pg_timeout=60)
    _check(results, CONSTRUCTION, "at construction")


def test_settings_that_differ_raise_at_the_first_forward_on_every_rank():
    results = run_ranks(settings_differ_at_first_forward, world_size=2, timeout=300, pg_timeout=60)
    _check(results, FIRST_FORWARD, "at their first forward")


def test_the_flag_on_some_ranks_only_ends_within_the_group_timeout_naming_it():
    """Ranks without the flag never join ddp_fusion's check: the ranks with it raise
    after the group's timeout, saying the flag may differ; the others fail in their
    first collective, on the same timeout (torch's error), not a hang."""
    (kind0, err0, s0), (kind1, err1, s1) = run_ranks(flag_on_one_rank, world_size=2, timeout=120,
                                                     pg_timeout=5)
    assert kind0 == "HostGroupError" and "only 1 of the 2 ranks" in err0, err0
    assert "DDP_FUSION=1 set on every rank" in err0, err0
    assert kind1 is not None and s0 < 30 and s1 < 30, (kind1, err1, s0, s1)


@pytest.mark.parametrize(
    "failing, what",
    # rank 1 failing in the eager run: slow (the link probe failing on rank 1 covers a
    # failure off rank 0)
    [pytest.param(1, "eager run", marks=pytest.mark.slow), (0, "eager run"), (1, "link probe")],
    ids=["eager-run-fails-on-rank-1", "eager-run-fails-on-rank-0", "link-probe-fails-on-rank-1"],
)
def test_a_failure_on_one_rank_ends_the_same_on_every_rank(failing, what):
    results = run_ranks(learning_fails_on_one_rank, world_size=2, args=(failing, what), timeout=600,
                        pg_timeout=60)
    r0, r1 = results
    # every rank runs the same plan, and trains as eager torch DDP
    assert r0["position"] == r1["position"] and r0["limits"] == r1["limits"], results
    assert all(r["diff"] < 1e-6 for r in results), results
    rank0_failed = failing == 0 or what == "link probe"
    assert r0["sizing"] is (not rank0_failed) and r1["sizing"] is (not rank0_failed), results
    if failing == 1 and what == "eager run":
        # rank 0 learned both: rank 1 takes them and says so
        assert r0["position"] is not None and not r0["warnings"], results
        assert any("this rank could not learn eager autograd's ready order" in w
                   and "runs group rank 0's" in w for w in r1["warnings"]), r1["warnings"]
        assert any("could not choose bucket caps" in w and "group rank 0's choice" in w
                   for w in r1["warnings"]), r1["warnings"]
        assert not any("compiled backward's order" in w for w in r1["warnings"]), r1["warnings"]
    elif failing == 0:
        # rank 0 could not: every rank buckets in the graph's order with DDP's caps
        assert r0["position"] is None and r0["graph_order"] and r1["graph_order"], results
        assert any("could not learn eager autograd's ready order" in w for w in r0["warnings"])
        assert any("on group rank 0, whose choice every rank takes" in w and "compiled backward's order" in w
                   for w in r1["warnings"]), r1["warnings"]
        assert not any("carry no ready order" in w for r in results for w in r["warnings"]), results
    else:
        # no rank probed the link: every rank keeps DDP's caps, and says why
        assert r0["position"] is not None, results
        for r in results:
            assert any("keeps DDP's default bucket caps" in w and "link could not be measured" in w
                       for w in r["warnings"]), r["warnings"]
