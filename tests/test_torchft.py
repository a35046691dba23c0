"""Issue 14: torchft's fault-tolerant DDP (``torchft.ddp.DistributedDataParallel``, a
torch DDP whose comm hook sends each bucket through ``Manager.allreduce``) compiled with
ddp_fusion on: 2 replica groups (one process each, gloo), an in-process lighthouse, the
scenario of torchft's own ``manager_integ_test.py`` (``test_ddp_healthy``,
``test_ddp_recovery``), with processes instead of threads and a real kill.

* healthy: the compiled, fused run's parameters and optimizer state equal the same run
  uncompiled (torchft's eager DDP), and each step sends ddp_fusion's buckets through the
  manager (one ``Manager.allreduce`` per bucket);
* a replica killed (SIGKILL) in the middle of a step: the survivor's step fails in the
  manager's all-reduce and is discarded (not committed), the quorum re-forms when the
  replica is restarted, the restarted replica heals from the survivor, and both end
  with the same state.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("torchft")

HERE = pathlib.Path(__file__).resolve().parent
STEPS = 6


def _start(lighthouse, replica, out, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]),
           # a fresh Inductor cache per process: the pass (and its bucket counters) must
           # run, which a hit in the FX graph cache of an earlier run would skip
           "TORCHINDUCTOR_CACHE_DIR": f"{out}.inductor_cache"}
    env.pop("DDP_FUSION", None)
    log = open(f"{out}.log", "w")
    return subprocess.Popen(
        [sys.executable, str(HERE / "_torchft_replica.py"), "--replica", str(replica),
         "--lighthouse", lighthouse.address(), "--steps", str(STEPS), "--out", str(out), *extra],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )


def _finish(procs, outs, timeout=600):
    deadline = time.monotonic() + timeout
    for p, out in zip(procs, outs):
        try:
            rc = p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "timeout"
        assert rc == 0, f"replica exited {rc}:\n{pathlib.Path(f'{out}.log').read_text()[-4000:]}"
    return [(json.loads(pathlib.Path(f"{o}.json").read_text()), torch.load(f"{o}.pt")) for o in outs]


def _lighthouse():
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=2)


def _train(tmp_path, name, *extra):
    lighthouse = _lighthouse()
    try:
        outs = [tmp_path / f"{name}{r}" for r in range(2)]
        return _finish([_start(lighthouse, r, o, *extra) for r, o in enumerate(outs)], outs)
    finally:
        lighthouse.shutdown()


def _max_diff(a, b):
    if isinstance(a, torch.Tensor):
        return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, dict):
        return max([_max_diff(a[k], b[k]) for k in a] or [0.0])
    if isinstance(a, (list, tuple)):
        return max([_max_diff(x, y) for x, y in zip(a, b)] or [0.0])
    assert a == b, (a, b)
    return 0.0


def test_compiled_fused_torchft_ddp_matches_uncompiled(tmp_path):
    eager = _train(tmp_path, "eager")
    fused = _train(tmp_path, "fused", "--compiled")
    for (_, want), (got_log, got) in zip(eager, fused):
        assert got_log["adopted"] and got_log["ddp_fusion"]["plans_run"] == 1, got_log
        assert not [k for k in got_log["ddp_fusion"] if k.startswith("unfused")], got_log
        buckets = got_log["ddp_fusion"]["buckets"]  # one backward graph, compiled once
        assert buckets == 2, got_log
        for entry in got_log["log"]:
            assert entry["participants"] == 2 and entry["committed"], entry
            assert len(entry["sent"]) == buckets, entry  # one Manager.allreduce per bucket
        assert _max_diff(got, want) < 1e-6
    assert _max_diff(fused[0][1], fused[1][1]) == 0.0  # the replicas agree exactly


@pytest.mark.slow  # 50 s on 2 cores; CI runs the fused torchft test above
def test_killed_replica_step_is_discarded_and_the_restarted_one_heals(tmp_path):
    lighthouse = _lighthouse()
    try:
        outs = [tmp_path / "survivor", tmp_path / "killed", tmp_path / "restarted"]
        survivor = _start(lighthouse, 0, outs[0], "--compiled")
        killed = _start(lighthouse, 1, outs[1], "--compiled", "--kill-at", "3")
        assert killed.wait(600) == -9  # SIGKILL, in the middle of step 3
        restarted = _start(lighthouse, 1, outs[2], "--compiled")
        (survivor_log, survivor_state), (restarted_log, restarted_state) = _finish(
            [survivor, restarted], [outs[0], outs[2]])
    finally:
        lighthouse.shutdown()
    log = survivor_log["log"]
    # the step the other replica died in failed in the manager's all-reduce: discarded
    failed = [e for e in log if not e["committed"]]
    assert failed and failed[0]["step"] == 3, log
    # then retried and committed with the restarted replica in the quorum
    assert [e["step"] for e in log if e["committed"]] == list(range(STEPS)), log
    assert all(e["participants"] == 2 for e in log if e["committed"]), log
    # the restarted replica did not start from step 0: it healed from the survivor
    steps = [e["step"] for e in restarted_log["log"]]
    assert steps[0] >= 3 and steps[-1] == STEPS - 1, restarted_log
    for got_log in (survivor_log, restarted_log):
        assert got_log["adopted"] and not [k for k in got_log["ddp_fusion"] if k.startswith("unfused")]
    assert _max_diff(survivor_state, restarted_state) == 0.0
