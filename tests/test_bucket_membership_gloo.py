"""Buckets hold exactly the gradients eager torch DDP's rebuilt buckets hold (2 gloo
ranks, compiled, a model with biases and uneven widths), for default caps, an explicit
cap and a cap list: the wrapper learns eager autograd's ready order (a Linear's bias
before its weight), which the compiled backward does not follow."""

import pytest

from ddp_fusion.launch import run_ranks

from _workers_buckets import BUCKET_ARGS, bucket_membership


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
