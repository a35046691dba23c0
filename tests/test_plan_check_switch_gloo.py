"""``ddp_fusion.config.plan_check`` (2 gloo ranks): off on every rank, compiled torch DDP
under the flag trains as eager torch DDP, fused, and posts no per-step exchange (on, it
posts at least one a step: the count can fail); ``join()`` with uneven inputs trains as
torch DDP's (the check runs inside the join context, where a joined rank learns the plan
from it). Off on one rank only is a settings error on every rank
(test_agreement_gloo.py)."""

import pytest

from ddp_fusion.launch import run_ranks

from _workers_plan_check import train_with_and_without_the_check


@pytest.fixture(scope="module")
def results():
    return run_ranks(train_with_and_without_the_check, world_size=2, timeout=600, pg_timeout=60)


def test_off_trains_as_eager_ddp_fused_without_a_per_step_exchange(results):
    for rank, r in enumerate(results):
        on, off = r[True], r[False]
        assert on["diff"] < 1e-5 and off["diff"] < 1e-5, (rank, r)
        assert on["fused"] == off["fused"] == 1, (rank, r)  # all-reduces a step: 1 bucket
        assert all(n >= 1 for n in on["exchanges"]), (rank, r)
        assert off["exchanges"] == [0, 0], (rank, r)


def test_join_with_uneven_inputs_matches_eager_ddp_with_the_check_off(results):
    """Rank 1 runs out of batches first; without the check inside the join context the
    joined rank would wait for an exchange nobody posts (a timeout, not this result)."""
    for rank, r in enumerate(results):
        assert r[False]["join_diff"] < 1e-5, (rank, r)
