"""A process group destroyed and made again in the same process (a new
``init_process_group``, an in-process restart) takes ddp_fusion's per-group state with
it: after each round the process holds the threads and open files it holds with the
flag off (2 gloo ranks; each rank's host group is a thread, a gloo group and its
sockets)."""

import pytest

from ddp_fusion.launch import run_ranks

from _workers_regroup import regroup


def _check(results):
    for rounds in results:
        off, *on = rounds
        for r in on:
            assert r["diff"] < 1e-5, rounds
            assert not [t for t in r["python_threads"] if t.startswith("ddp_fusion")], rounds
            # torch may start a thread of its own once (tqdm's monitor): count the rest
            assert (r["files"], r["other_threads"]) == (off["files"], off["other_threads"]), rounds
        assert all(r == on[0] for r in on), rounds


def test_host_groups_end_with_their_process_group(tmp_path):
    """ddp_fusion's wrapper, uncompiled (each host group is made at construction)."""
    _check(run_ranks(regroup, world_size=2, args=(str(tmp_path), False), timeout=300))


@pytest.mark.slow
def test_host_groups_end_with_their_process_group_compiled(tmp_path):
    """Torch DDP under the flag, compiled (the per-step plan check on the host group);
    about a minute on 2 cores."""
    _check(run_ranks(regroup, world_size=2, args=(str(tmp_path), True), timeout=600))
