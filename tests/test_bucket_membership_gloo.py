"""Buckets hold exactly the gradients eager torch DDP's rebuilt buckets hold (2 gloo
ranks, compiled, a model with biases and uneven widths), for default caps, an explicit
cap and a cap list: the wrapper learns eager autograd's ready order (a Linear's bias
before its weight), which the compiled backward does not follow."""

import pytest

from ddp_fusion.launch import run_ranks

from _workers_buckets import BUCKET_ARGS, bucket_membership, first_batches_differ


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(
        bucket_membership, world_size=2, args=(str(tmp_path_factory.mktemp("dumps")),),
        timeout=900,
    )


@pytest.mark.parametrize("label", list(BUCKET_ARGS))
def test_bucket_membership_equals_torch_ddp_rebuilt_buckets(results, label):
    for r in results:
        r = r[label]
        # the reference is torch DDP's: same bucket sizes as its rebuilt buckets
        assert r["want_sizes"] == r["torch_rebuilt_sizes"], r
        assert len(r["want"]) > 1
        assert len(r["got"]) == 2  # first step (no .grad yet) and steady state
        for plan in r["got"]:
            assert plan == r["want"]
        assert r["collectives"] == len(r["want"])
        assert r["max_diff"] < 1e-5


def test_every_rank_takes_rank_0s_ready_order():
    """Ranks whose first batches would teach them different orders take rank 0's, so
    their plans agree and training goes on (before: PlanMismatchError at every step)."""
    (pos0, err0), (pos1, err1) = run_ranks(first_batches_differ, world_size=2, timeout=600)
    assert err0 is None and err1 is None, (err0, err1)
    # rank 0 (8 rows) learns b.bias, b.weight, a.bias, a.weight: positions by parameter
    # (a.weight, a.bias, b.weight, b.bias); rank 1 (3 rows) alone would learn a first
    assert pos0 == pos1 == (3, 2, 1, 0)
