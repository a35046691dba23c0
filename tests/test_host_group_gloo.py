"""ddp_fusion's host groups (2 and 3 gloo ranks; a host group is a gloo group, its
sockets and threads, and a thread of ddp_fusion's (a C++ one with it), per rank and
process group; no process):

* a process group destroyed and made again in the same process (a new
  ``init_process_group``, an in-process restart) takes its host group with it: after
  each round the process holds the threads and open files it holds with the flag off;
* ranks that cannot connect their host group fail where they build the model, on every
  rank, within seconds (not the group's timeout), naming the address and
  ``GLOO_SOCKET_IFNAME``."""

import pytest

from ddp_fusion.launch import run_ranks

from _workers_host_group import broadcast_json, cannot_connect, regroup


def _check(results, compiled=False):
    """Each round with the flag on trained as eager DDP did, started no process, and left
    what the round with it off left; ``compiled``: the per-step plan check ran on each
    round's own host group."""
    for rounds in results:
        off, *on = rounds
        for r in on:
            assert r["diff"] < 1e-5, rounds
            assert r["checked_here"] is (True if compiled else None), rounds
            assert not [t for t in r["python_threads"] if t.startswith("ddp_fusion")], rounds
            # torch may start a thread of its own once (tqdm's monitor): count the rest
            assert (r["files"], r["other_threads"]) == (off["files"], off["other_threads"]), rounds
            assert (r["children_before_destroy"], r["children"]) == (0, 0), rounds
        assert all(r == on[0] for r in on), rounds


def test_host_groups_end_with_their_process_group(tmp_path):
    """ddp_fusion's wrapper, uncompiled (each host group is made at construction)."""
    _check(run_ranks(regroup, world_size=2, args=(str(tmp_path), False), timeout=300))


def test_host_groups_of_three_ranks_end_with_their_process_group(tmp_path):
    """Three ranks (rank 2 folded into rank 0's exchanges)."""
    _check(run_ranks(regroup, world_size=3, args=(str(tmp_path), False), timeout=300))


@pytest.mark.slow
def test_host_groups_end_with_their_process_group_compiled(tmp_path):
    """Torch DDP under the flag, compiled (the per-step plan check on the host group);
    about a minute on 2 cores."""
    _check(run_ranks(regroup, world_size=2, args=(str(tmp_path), True), timeout=600), compiled=True)


def test_a_host_group_that_cannot_connect_fails_on_every_rank_within_seconds():
    """The host group's gloo addresses read as ones nobody answers at (so whichever rank
    of the pair connects, it connects to nothing): with a 60 s group timeout gloo alone
    would give up after minutes (and, before, in the settings check or the first backward);
    the host group's check where the model is built raises within its bound (10 s) on
    both ranks. Rank 1's ``GLOO_SOCKET_IFNAME`` naming an interface it lacks: both raise
    at once (before, the host group ignored ``GLOO_SOCKET_IFNAME``). Both naming ``lo``:
    the model builds."""
    for out in run_ranks(cannot_connect, world_size=2, timeout=300, pg_timeout=60):
        seconds, kind, message = out["unreachable"]
        assert kind == "HostGroupError", out
        assert seconds < 30, out
        assert "cannot connect" in message and "GLOO_SOCKET_IFNAME" in message, message
        assert "could not exchange with group rank" in message and "(host " in message, message
        seconds, kind, message = out["no such interface"]
        assert kind == "HostGroupError" and seconds < 30, out
        assert "group rank 1 (host" in message, message
        assert "interface nosuch0 from GLOO_SOCKET_IFNAME" in message, message
        assert out["lo"] == (out["lo"][0], None, None), out


def test_broadcast_moves_json_never_a_pickle_and_refuses_past_its_cap():
    """Bytes from another rank are data: group rank 0's object arrives as JSON gives it
    back; a payload over the cap fails on both ranks, naming it, before anything is
    received, and the next broadcast still pairs up."""
    for r in run_ranks(broadcast_json, world_size=2, timeout=120):
        assert r["got"] == [0, [1.5, "x"], {"k": None}], r
        assert "more than 16 bytes to broadcast" in r["over_cap"] and "(at most 16)" in r["over_cap"], r
        assert r["after"] == 0, r
