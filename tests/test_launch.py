"""ddp_fusion.launch, which runs every multi-rank test: a failure reports every rank's
error, not only the first to arrive."""

import time

import pytest

from ddp_fusion.launch import run_ranks

from _workers import fail_on_ranks


def test_ranks_that_fail_together_are_all_reported_and_the_waiting_rank_named():
    """Ranks 0 and 1 raise, rank 2 waits as if in a collective: the error has both
    tracebacks and names rank 2 as still running, within seconds (it is killed)."""
    start = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        run_ranks(fail_on_ranks, world_size=3, args=((0, 1),), timeout=120)
    message = str(e.value)
    assert "rank 0 failed:" in message and "rank 0 fails on purpose" in message, message
    assert "rank 1 failed:" in message and "rank 1 fails on purpose" in message, message
    assert "ranks [2] were still running 2 s after the first failure" in message, message
    assert time.monotonic() - start < 25  # not rank 2's 30 s
