"""Training semantics against eager torch DDP on 2 gloo ranks: the uncompiled bucketed
path, unused parameters, fp16 gradient communication, gradient accumulation."""

import pytest

from ddp_fusion.launch import run_ranks

from _workers import training_semantics


@pytest.fixture(scope="module")
def results():
    return run_ranks(training_semantics, world_size=2, timeout=900)


def test_uncompiled_path_matches_eager_ddp_with_one_collective_per_bucket(results):
    for r in results:
        assert r["uncompiled"]["max_diff"] < 1e-6, r
        assert r["uncompiled"]["collectives"] == r["uncompiled"]["buckets"] > 1, r


def test_unused_parameters(results):
    for r in results:
        assert r["unused"]["max_diff"] < 1e-6, r
        assert r["unused"]["c_grad_is_none"]  # used by no rank: like eager DDP
        assert r["unused"]["b_grad_set"]  # used on rank 0 only: averaged everywhere
    # without find_unused_parameters the rank that skipped b says so (and does not hang)
    assert "b.weight" in results[1]["unused_error"]
    assert "find_unused_parameters=True" in results[1]["unused_error"]


def test_fp16_comm_matches_fp16_compress_hook(results):
    for r in results:
        assert r["fp16"]["eager_max_diff"] < 1e-6, r
        assert r["fp16"]["compiled_max_diff"] < 1e-6, r


def test_no_sync_has_no_communication_and_matches_eager_ddp(results):
    for r in results:
        assert r["no_sync"]["collectives_inside"] == 0
        assert r["no_sync"]["max_diff"] < 1e-6, r
