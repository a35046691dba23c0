"""Several process groups and mixed dtypes end to end on 2 gloo ranks (CPU): a model with
two ddp_fusion wrappers on two different process groups (same ranks), one of them
holding fp32 and bf16 parameters, compiled with fusion on, trains like the same model
under eager torch DDP, and the pass gives every (group, dtype) its own buckets.
"""

import pytest
import torch

from ddp_fusion.launch import run_ranks

from _workers import groups_and_dtypes

ALGORITHMS = ["concat", "coalesced"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(
        groups_and_dtypes,
        world_size=2,
        args=(tuple(ALGORITHMS), str(tmp_path_factory.mktemp("dumps"))),
        timeout=900,
        threads_per_rank=1,
    )


def _tensors(params):
    return {n: torch.tensor(v).to(getattr(torch, dtype)) for n, (dtype, v) in params.items()}


def _plan(result):
    """The bucket plan of the (one) fused backward graph."""
    assert len(result["plans"]) == 1 == result["counters"]["graphs"], result["plans"]
    return result["plans"][0]


def test_reference_has_two_groups_and_both_dtypes(results):
    """The setup really exercises the feature: two distinct groups, fp32 and bf16."""
    for r in results:
        group_a, group_b = r["groups"]
        assert group_a != group_b
        assert {dtype for dtype, _ in r["ref"]["params"].values()} == {"float32", "bfloat16"}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_parameters_match_eager_ddp(results, algorithm):
    """After several SGD steps on per-rank data, every parameter equals eager torch DDP's
    (fp32 to 1e-5; bf16 to assert_close's bf16 tolerance, and dtypes are kept)."""
    for rank, r in enumerate(results):
        got, want = _tensors(r[algorithm]["params"]), _tensors(r["ref"]["params"])
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype, name
            tol = {"atol": 1e-5, "rtol": 0} if want[name].dtype == torch.float32 else {}
            torch.testing.assert_close(got[name], want[name], **tol,
                                       msg=lambda m, r=rank, n=name: f"rank {r} {n}: {m}")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_parameters_identical_across_ranks(results, algorithm):
    """Each rank trained on different data; averaged gradients keep the replicas equal,
    bit for bit, in both dtypes."""
    p0, p1 = (_tensors(r[algorithm]["params"]) for r in results)
    for name in p0:
        assert torch.equal(p0[name], p1[name]), name


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_each_bucket_holds_one_group_and_one_dtype(results, algorithm):
    """Every gradient is in exactly one bucket, and a bucket's gradients all come from
    parameters of the bucket's group and dtype; all three (group, dtype) pairs appear.
    Nothing is left unfused, and the ranks' plans agree."""
    for r in results:
        result = r[algorithm]
        plan, grad_keys = _plan(result), result["grad_keys"]
        assert plan["algorithm"] == algorithm
        assert plan["unfused"] == []
        bucketed = [g for b in plan["buckets"] for g in b["grads"]]
        assert sorted(bucketed) == sorted(grad_keys)
        for b in plan["buckets"]:
            assert {grad_keys[g] for g in b["grads"]} == {(b["group"], b["dtype"])}, b
        group_a, group_b = r["groups"]
        assert {(b["group"], b["dtype"]) for b in plan["buckets"]} == {
            (group_a, "float32"), (group_b, "float32"), (group_b, "bfloat16")
        }
        counters = result["counters"]
        assert not any(v for k, v in counters.items() if k.startswith("unfused")), counters
        assert counters["fused_all_reduces"] == len(grad_keys)
        assert counters["buckets"] == len(plan["buckets"])
    assert _plan(results[0][algorithm]) == _plan(results[1][algorithm])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_collectives_per_step_equal_plan_buckets(results, algorithm):
    """The compiled step runs one all-reduce per planned bucket; eager torch DDP (which
    also buckets per group and dtype) has as many buckets and runs as many."""
    for r in results:
        buckets = len(_plan(r[algorithm])["buckets"])
        assert r[algorithm]["collectives"] == buckets, r[algorithm]
        assert r["ref"]["collectives"] == r["ref"]["buckets"] == buckets, r["ref"]
