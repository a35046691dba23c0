"""Issue 15 on 2 gloo ranks: where the reduced gradients live. Compiled and fused, each
bucket's reduced buffer *is* the storage of its parameters' ``.grad`` (nothing copied
back); uncompiled with ``gradient_as_bucket_view=True``, ``.grad`` are views of the
eager reducer's persistent buckets, as in torch DDP. Both against torch DDP with
``gradient_as_bucket_view=True``, with ``zero_grad(set_to_none=True)`` and ``False``."""

import pytest

from ddp_fusion.launch import run_ranks

from _workers_memory import grads_as_bucket_views


@pytest.fixture(scope="module")
def results():
    return run_ranks(grads_as_bucket_views, world_size=2, timeout=900)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_uncompiled_grads_are_views_of_persistent_buckets(results, set_to_none):
    for r in results:
        got = r[set_to_none]
        assert got["uncompiled"]["max_diff"] < 1e-6, got
        assert got["uncompiled"]["views_of_buckets"], got
        assert got["uncompiled"]["storages"] == got["torch_buckets"] > 1, got
        assert got["uncompiled"]["kept_storages"], got


@pytest.mark.parametrize("set_to_none", [True, False])
def test_compiled_grads_are_views_of_the_reduced_buckets(results, set_to_none):
    for r in results:
        got = r[set_to_none]
        assert got["compiled"]["max_diff"] < 1e-5, got
        # one storage per bucket: the reduced buffer, not one copy per parameter
        assert got["compiled"]["storages"] == got["torch_buckets"] > 1, got
        assert got["compiled"]["contiguous"], got
