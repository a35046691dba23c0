"""Parameters unused on some ranks only, with ``find_unused_parameters=True``, compiled
with the flag on, train as under eager torch DDP with the same flag (2 gloo ranks, one
rank-process run for every scenario): the same parameters after several SGD steps
(momentum and weight decay, so a ``.grad`` set where eager DDP leaves None shows), the
same ``.grad``s left None after each step, and one all-reduce per bucket (eager DDP: its
buckets and a used-parameter bitmap).

Scenarios: a branch one rank takes; a branch one rank takes at some steps (kept
``.grad``s, torch DDP + flag, ``coalesced``); a mixture of experts with top-1 routing of
a few tokens, ranks using different experts at different steps (``.grad`` None and
kept); ``requires_grad`` switched off on one rank (``replicate()``); ``no_sync()`` with
a parameter used only in the micro-batch that does not reduce, or only in the one that
does. Before find_unused_parameters laid buckets out by the model, each of these
raised ``PlanMismatchError`` at its first rank-dependent step.
"""

from ddp_fusion.launch import run_ranks

from _workers_unused import ROUTES, unused_on_some_ranks


def test_parameters_unused_on_some_ranks_train_as_eager_ddp():
    ranks = run_ranks(unused_on_some_ranks, world_size=2, timeout=900)
    for results in ranks:
        for name, r in results.items():
            assert "error" not in r, (name, r)
            assert r["max_diff"] < 1e-5, (name, r)
            assert r["none_after"] == r["want_none_after"], (name, r)
            assert r["graph_breaks"] == 0 or name.startswith("moe"), (name, r)
            assert r["counters"].get("find_unused_parameters: graph's buckets", 0) == 0, (name, r)
            assert not any(k.startswith("unfused") for k in r["counters"]), (name, r)
        # the scenarios do what they say: some rank had an absent gradient, and eager DDP
        # left some .grad None that ddp_fusion had to leave None too
        assert all(r["counters"]["absent gradients"] > 0 for r in results.values()), results
    moe = [results["moe"] for results in ranks]
    # each rank leaves unused experts out at some step and not at others
    for r in moe:
        assert r["want_none_after"][0] != r["want_none_after"][1], r
        # one all-reduce per bucket; eager DDP: its buckets and the bitmap
        assert r["collectives"] == r["eager_buckets"] == r["eager_collectives"] - 1, r
    # ranks route differently: step 0 uses expert 0 on rank 0 only and 2 on rank 1 only
    assert ROUTES[0] == [[0, 0, 1], [1, 2, 2]]
