"""Nothing reads a reduced buffer before its wait, and nothing is left pending after a
step: ddp_fusion's paths (concat, coalesced, kept ``.grad``s reduced in place in one run
and gathered, a comm hook, ``join()``, uncompiled) on 2 ranks of the "slow" test backend
(tests/_slow_backend.py), whose all-reduces complete late and hold NaN until then,
against eager torch DDP on gloo. On gloo alone a read before the wait usually sees the
right values. Slow: about 1.5 minutes on 2 cores; ``python -m pytest -q -m slow
tests/test_slow_backend_gloo.py``."""

import pytest

from ddp_fusion.launch import run_ranks

from _workers_slow import STEPS, slow_paths

PATHS = ("concat", "coalesced", "kept .grads, one run", "kept .grads, gathered", "comm hook", "join()",
         "uncompiled")


@pytest.mark.slow
def test_every_path_waits_before_it_reads_and_leaves_nothing_pending():
    for rank, out in enumerate(run_ranks(slow_paths, world_size=2, timeout=900, pg_timeout=120)):
        nan_before, after = out.pop("read before wait")
        assert nan_before and after == [2.0] * 4, "the backend is not slow"
        assert set(out) == set(PATHS)
        for name, r in out.items():
            assert r["diff"] < 1e-5, (rank, name, r)
            assert r["left"] == [] and r["steps"] == (STEPS - rank if name == "join()" else STEPS), (name, r)
            assert r["issued"] > 0, (name, r)
            if name not in ("comm hook", "join()"):  # (a hook waits on futures; Join's own
                assert r["waited"] >= r["issued"], (name, r)  # count is never waited for)
        assert out["kept .grads, one run"]["ddp_fusion"].get("in place: one run", 0) > 0, out
        assert out["kept .grads, gathered"]["ddp_fusion"].get("in place: gathered", 0) > 0, out
