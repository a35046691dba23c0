"""Parameters unused on some ranks only, with ``find_unused_parameters=True``, train as
under eager torch DDP with the same flag (2 gloo ranks, one rank-process run per test
for all its scenarios): the same parameters after 4 SGD steps (momentum and weight
decay, so a ``.grad`` set where eager DDP leaves None shows), the same ``.grad``s left
None after each step, no gradient left unfused, and one all-reduce per bucket (eager
DDP: its buckets and a used-parameter bitmap; ddp_fusion agrees on the used parameters
on the host group).

Scenarios (tests/_workers_unused.py): a branch one rank takes; a branch one rank takes
at some steps (kept ``.grad``s, torch DDP + flag, ``coalesced``); a mixture of experts
with top-1 routing of a few tokens, ranks using different experts at different steps
(``.grad`` None, and kept); ``requires_grad`` switched off on one rank
(``replicate()``); ``no_sync()`` with a parameter used only in the micro-batch that does
not reduce, or only in the one that does (compiled with ``.grad`` None and kept, and
uncompiled); ``join()`` with uneven batches, the joined rank taking part in the
agreement on used parameters. Before buckets were laid out by the model, every compiled scenario raised
``PlanMismatchError`` at its first rank-dependent step, and the uncompiled ``no_sync()``
one left rank 0's accumulated gradient unreduced.

    python -m pytest -q tests/test_unused_gloo.py            # CI's part, ~2 min on 2 cores
    python -m pytest -q -m slow tests/test_unused_gloo.py    # the other scenarios
"""

import pytest

from ddp_fusion.launch import run_ranks

from _workers_unused import ROUTES, unused_on_some_ranks

CI = ("moe", "branch at some steps", "no_sync, set_to_none=False", "no_sync, uncompiled")
SLOW = ("branch on one rank", "moe, kept .grads", "requires_grad off on one rank",
        "no_sync, set_to_none=True", "join, uneven batches")


def _check(ranks):
    for results in ranks:
        for name, r in results.items():
            assert "error" not in r, (name, r)
            assert r["max_diff"] < 1e-5, (name, r)
            assert r["none_after"] == r["want_none_after"], (name, r)
            # graph breaks: the MoE's routing, replicate()'s hooks
            assert r["graph_breaks"] == 0 or name.startswith(("moe", "requires_grad")), (name, r)
            assert r["counters"].get("find_unused_parameters: graph's buckets", 0) == 0, (name, r)
            assert not any(k.startswith("unfused") for k in r["counters"]), (name, r)
    # every compiled scenario had a gradient absent on some rank
    for name in ranks[0]:
        if name != "no_sync, uncompiled":
            assert any(results[name]["counters"].get("unused: absent gradients") for results in ranks), name


def test_parameters_unused_on_some_ranks_train_as_eager_ddp():
    ranks = run_ranks(unused_on_some_ranks, world_size=2, args=(CI,), timeout=900)
    _check(ranks)
    for r in (results["moe"] for results in ranks):
        # each rank leaves experts without a token out at some steps, not at others
        assert len({tuple(n) for n in r["want_none_after"]}) > 1, r
        # one all-reduce per bucket; eager DDP: its buckets and the bitmap
        assert r["collectives"] == r["eager_buckets"] == r["eager_collectives"] - 1, r
    # ranks route differently: at step 0, expert 0 on rank 0 only, expert 2 on rank 1 only
    assert ROUTES[0] == [[0, 0, 1], [1, 2, 2]] and ROUTES[2] == [[1, 0, 0], [2, 1, 2]]


@pytest.mark.slow
def test_more_parameters_unused_on_some_ranks_train_as_eager_ddp():
    ranks = run_ranks(unused_on_some_ranks, world_size=2, args=(SLOW,), timeout=900)
    _check(ranks)
    # rank 1 takes the branch: nothing absent there, no fix-up
    assert "unused: absent gradients" not in ranks[1]["branch on one rank"]["counters"]
