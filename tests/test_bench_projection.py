"""bench's GPU projection (bench/_lib/projection.py) and its replay model
(bench/_lib/replay.py): pure functions, checked against hand-computed cases.

* the NCCL ring/tree all-reduce time for one node and for two;
* DDP's buckets of GPT-2 small's gradients (count, sizes, the tied embedding last);
* exposed communication falls as bandwidth rises, and is zero when communication fits
  under backward;
* the replay of a profiled step with modelled collectives.
"""

from __future__ import annotations

import pytest

from bench._lib import projection
from bench._lib import replay

MiB = 1 << 20


def test_nccl_allreduce_on_one_node_is_a_ring_at_nvlink_rate():
    # 8 GPUs, 25 MiB: ring latency 8.4 us + 2*7 steps * 3.4 us = 56 us; tree 2*7*28 us = 392 us.
    # Bandwidth term 2*7/8 * 25 MiB / 450 GB/s.
    t, algo = projection.nccl_allreduce_s(25 * MiB, 8, projection.values())
    assert algo == "ring"
    assert t == pytest.approx(56e-6 + 1.75 * 25 * MiB / 450e9, rel=1e-12)


def test_nccl_allreduce_on_two_nodes_uses_the_nic_rate():
    # 16 GPUs on 2 nodes: ring 8.4 + (30 - 4) * 3.4 + 4 * 14 = 152.8 us; tree 2 * (7 + 1) * 28 = 448 us.
    t, algo = projection.nccl_allreduce_s(25 * MiB, 16, projection.values())
    assert algo == "ring"
    assert t == pytest.approx(152.8e-6 + 2 * 15 / 16 * 25 * MiB / 50e9, rel=1e-12)
    assert projection.nccl_allreduce_s(25 * MiB, 1, projection.values()) == (0.0, "-")


def test_many_nodes_pick_the_tree_for_small_messages():
    t, algo = projection.nccl_allreduce_s(3072, 1024, projection.values())
    assert algo == "tree"
    # 2 * (7 intra hops + log2(128) levels) * 28 us
    assert t == pytest.approx(2 * (7 + 7) * 28e-6 + 2 * 1023 / 1024 * 3072 / 50e9, rel=1e-12)


def test_gpt2_small_has_the_published_parameter_count():
    grads = projection.gpt2_small_grads()
    assert sum(n for _, n, _ in grads) == 124_439_808
    assert len(grads) == 148
    assert [r for _, _, r in grads] == sorted(r for _, _, r in grads)
    assert grads[-1][0] == "wte" and grads[-1][2] == 1.0


def test_ddp_buckets_gpt2_small_into_13():
    """A layer's gradients are 27.04 MiB. The first bucket (limit 1 MiB) closes at the
    last layer's 9 MiB c_proj weight; each next one (limit 25 MiB) at the next layer's
    c_proj weight: the rest of a layer + 9 MiB = 27.04 MiB, 11 times; the last holds
    layer 0's rest, wpe and the tied wte (147 MiB), ready at the end of backward."""
    buckets = projection.ddp_buckets(projection.gpt2_small_grads())
    assert len(buckets) == 13
    layer = 4 * (12 * 768 * 768 + 13 * 768)
    assert buckets[0][0] == 4 * (2 * 768 + 4 * 768 * 768)
    assert all(b == layer for b, _ in buckets[1:12])
    assert buckets[-1] == (layer - 4 * 4 * 768 * 768 + 4 * (1024 + 50257) * 768, 1.0)
    assert sum(b for b, _ in buckets) == 4 * 124_439_808


def test_a_smaller_cap_gives_more_buckets():
    grads = projection.gpt2_small_grads()
    counts = [len(projection.ddp_buckets(grads, (MiB, cap * MiB))) for cap in (5, 25, 100, 250)]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]


def test_exposed_communication_falls_as_bandwidth_rises():
    prm = projection.values()
    msgs = projection.ddp_buckets(projection.gpt2_small_grads())
    for p in (16, 1024):
        exposed = [projection.project_one(msgs, p, prm, 0.005, 0.010, 0.0005, bw_scale=s)["exposed_ms"]
                   for s in (0.1, 0.3, 1.0, 3.0, 10.0)]
        assert exposed == sorted(exposed, reverse=True)
        assert exposed[0] > exposed[-1]


def test_communication_that_fits_under_backward_is_hidden():
    prm = projection.values()
    one = projection.project_one([(MiB, 0.0)], 8, prm, fwd=0.001, bwd=0.010, opt=0.0)
    assert one["exposed_ms"] == 0.0 and one["overlap_pct"] == 100.0
    assert one["step_ms"] == pytest.approx(11.0)
    blocking = projection.project_one([(MiB, 0.0)], 8, prm, fwd=0.001, bwd=0.010, opt=0.0, blocking=True)
    assert blocking["exposed_ms"] == pytest.approx(blocking["comm_ms"])


def test_projection_tables_cover_every_gpu_count():
    pj = projection.projection()
    for table in pj["tables"].values():
        assert list(table) == [str(p) for p in projection.GPU_COUNTS]
    assert len(pj["config"]["buckets"]) == 13


def _view(issue, syncs, total):
    return {"issue": issue, "bytes": [100] * len(issue), "syncs": syncs, "total": total}


def test_replay_waits_for_the_later_rank_and_the_channel():
    """Two collectives of 1 ms on one channel. Rank 0 issues at 1 and 2 ms, rank 1 at 1.5
    and 2 ms; both wait for the second at 3 ms and end 1 ms of compute later. The first
    runs 1.5-2.5, the second 2.5-3.5: both ranks resume at 3.5 and end at 4.5."""
    ranks = [_view([1.0, 2.0], [(3.0, 1)], 4.0), _view([1.5, 2.0], [(3.0, 1)], 4.0)]
    sim = replay.simulate(ranks, lambda n: 1.0)
    assert sim["spans"] == [(1.5, 2.5), (2.5, 3.5)]
    assert sim["wall"] == [4.5, 4.5] and sim["pred_ms"] == 4.5


def test_replay_hides_communication_that_ends_before_its_wait():
    ranks = [_view([1.0], [(5.0, 0)], 6.0)] * 2
    assert replay.simulate(ranks, lambda n: 2.0)["pred_ms"] == 6.0


def test_the_old_plan_checks_all_gather_grows_with_the_ranks():
    prm = projection.values()
    # one node: 6.6 us + 7 NVLink steps * 0.6 us (LL)
    assert projection.nccl_allgather_latency_s(8, prm) == pytest.approx(10.8e-6)
    # two nodes: 14 intra steps at the 1 us network overhead, 1 inter-node step at 2.7 us
    assert projection.nccl_allgather_latency_s(16, prm) == pytest.approx(6.6e-6 + 14e-6 + 2.7e-6)
    assert projection.nccl_allgather_latency_s(1, prm) == 0.0


def test_the_host_groups_exchange_takes_log_n_rounds():
    assert [projection.host_exchange_rounds(p) for p in (1, 2, 3, 4, 6, 8, 8192)] == [0, 1, 3, 2, 4, 3, 13]
    rows = {r["gpus"]: r for r in projection.plan_check_costs(host_round=100e-6)}
    assert rows[8192]["new_ms"] == pytest.approx(1.3)
    assert rows[8192]["old_allgather_ms"] > 100 * rows[8]["old_allgather_ms"]
