"""torch's composable ``replicate()`` (``torch.distributed._composable.replicate``, the
DDP API torchtitan used) with the flag on and ``torch.compile``, on 2 gloo ranks,
against eager ``replicate()``: the torch DDP it builds (over an ``nn.ParameterList`` of
the module's parameters, at the first forward) is adopted like any torch DDP, the ready
order is learned on the replicated module, and DDPOptimizer stays out (it refused a
bucket cap under its 1 MiB first bucket). One spawn covers DDP's default cap and 0.5 MB."""

import pytest

from ddp_fusion.launch import run_ranks

from _workers_replicate import replicate_fused

CAPS = (None, 0.5)


@pytest.fixture(scope="module")
def results():
    return run_ranks(replicate_fused, world_size=2, args=(CAPS,), timeout=900)


@pytest.mark.parametrize("cap", CAPS, ids=["default-cap", "cap-0.5"])
def test_replicate_trains_fused_as_eager_replicate_with_its_buckets(results, cap):
    for r in results:
        got = r[cap]
        assert "error" not in got, got
        assert got["adopted"], got
        assert got["max_diff"] < 1e-5, got
        assert got["eager_collectives"] == got["eager_buckets"], got
        assert got["collectives"] == got["eager_buckets"], got
        assert got["fused"].get("plans_run") == 1, got
        assert not [k for k in got["fused"] if k.startswith("unfused")], got
        assert "ready order: graph's" not in got["fused"], got
        assert not [w for w in got["warnings"] if "ready order" in w], got["warnings"]


def test_several_buckets_at_a_small_cap(results):
    for r in results:
        assert r[0.5]["eager_buckets"] > 1, r[0.5]
