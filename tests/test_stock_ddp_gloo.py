"""Stock torch DDP under the flag (issue 13) on 2 gloo ranks, against the same model
under eager torch DDP: a torchrun-style compiled script, buffers broadcast at each
forward (stock and wrapper), no_sync + find_unused_parameters on a non-world group,
torch's fp16/bf16 compress hooks, parameters and buffers marked to be ignored."""

import pytest
import torch

from ddp_fusion.launch import run_ranks

from _workers_stock import stock_ddp


@pytest.fixture(scope="module")
def results():
    return run_ranks(stock_ddp, world_size=2, timeout=900)


def test_compiled_torch_ddp_trains_as_eager_ddp_with_its_buckets(results):
    for r in results:
        plain = r["plain"]
        assert plain["is_stock"] and plain["adopted"], plain
        assert plain["max_diff"] < 1e-6, plain
        assert plain["eager_buckets"] > 1 and plain["eager_collectives"] == plain["eager_buckets"]
        assert plain["collectives"] == plain["eager_buckets"], plain
        assert plain["fused"]["plans_run"] == 1, plain  # the fused backward ran
        assert not [k for k in plain["fused"] if k.startswith("unfused")], plain
        assert plain["graph_breaks"] == 0, plain


@pytest.mark.parametrize("kind", ["stock", "wrapper"])
def test_buffers_are_broadcast_at_each_forward_as_eager_ddp(results, kind):
    """Running statistics differ per rank by ~1 (data scaled by 1 + 2 * rank); eager DDP
    resets them to rank 0's at each forward. Also with broadcast_buffers=False, where
    each rank keeps its own."""
    for r in results:
        for flag in (True, False):
            got = r[f"buffers_{kind}_{flag}"]
            assert got["buffers"] < 1e-5 and got["params"] < 1e-5, (kind, flag, got)


def test_forward_sync_buffers_off_broadcasts_at_construction_only(results):
    """torch 2.13's ``forward_sync_buffers=False`` (``broadcast_buffers`` is deprecated
    since), as eager DDP keeps it; older releases lack the argument."""
    if "buffers_forward_sync_off" not in results[0]:
        pytest.skip(f"torch {torch.__version__}'s DDP has no forward_sync_buffers")
    for r in results:
        got = r["buffers_forward_sync_off"]
        assert got["buffers"] < 1e-5 and got["params"] < 1e-5, got


def test_no_sync_and_unused_parameters_on_a_subgroup(results):
    for r in results:
        got = r["no_sync_unused_group"]
        assert got["collectives_inside"] == 0, got
        assert got["max_diff"] < 1e-6 and got["unused_grad_none"], got


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_torch_compress_hooks_match_eager_ddp_with_the_hook(results, hook):
    for r in results:
        got = r[f"hook_{hook}"]
        assert got["comm_dtype"] == f"torch.{'float16' if hook == 'fp16' else 'bfloat16'}"
        assert got["max_diff"] < 1e-6, got


@pytest.mark.parametrize("kind", ["stock", "wrapper"])
def test_parameters_and_buffers_marked_ignored_stay_each_ranks_own(results, kind):
    """``b.weight`` starts 1 apart on the two ranks and ``bn.running_mean`` is fed data
    scaled per rank: eager torch DDP neither broadcasts nor reduces them (nor the
    running mean at forwards), and neither may ddp_fusion, compiled."""
    for rank, r in enumerate(results):
        got = r[f"ignored_{kind}"]
        assert got["params"] < 1e-5 and got["buffers"] < 1e-5, (kind, got)
        if rank == 1:  # the rank whose own value a broadcast would overwrite
            assert got["b_weight_from_rank_0"] > 0.5, (kind, got)
