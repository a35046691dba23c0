"""``bucket_cap_mb="auto"`` (ddp_fusion/autocap.py): the plan chosen for a given link
(alpha, beta) and given gradient ready times, against hand-worked cases; the setting on
the wrapper, on torch DDP through ``config.bucket_cap_mb``, and refused where it cannot
plan; and on 2 gloo ranks, one choice for every rank (rank 0's) that trains like eager
DDP given the same caps."""

from __future__ import annotations

import pytest
import torch

import ddp_fusion
from ddp_fusion import autocap
from ddp_fusion.autocap import Link
from ddp_fusion.launch import run_ranks
from ddp_fusion.plan import MiB

from _workers_autocap import auto_caps_against_eager_ddp

# Four 1 MiB gradients ready 10 ms apart; the backward ends at 40 ms.
SIZES = [MiB] * 4
READY = [0.010, 0.020, 0.030, 0.040]
BACKWARD = 0.040


def test_predict_by_hand():
    """Caps of 1 MiB: four buckets, each 1 ms + 5 ms on a link free when it is ready:
    the last ends at 40 + 6 = 46 ms, 6 ms exposed. One bucket of all four: 1 + 20 ms
    from 40 ms: 21 ms exposed."""
    link = Link(alpha=0.001, beta=0.005 / MiB)
    assert autocap.predict(SIZES, READY, BACKWARD, [MiB], link) == (pytest.approx(0.006), 4)
    assert autocap.predict(SIZES, READY, BACKWARD, [100 * MiB], link) == (pytest.approx(0.021), 1)


def test_a_slow_link_gets_small_buckets_that_start_early():
    """DDP's default here is one bucket (1 MiB, then the other three: 25 MiB cap) whose
    three gradients go out at the end; smaller buckets hide all but the last."""
    link = Link(alpha=0.0001, beta=0.008 / MiB)
    choice = autocap.choose(SIZES, READY, BACKWARD, link)
    assert choice.buckets_default == 2 and choice.buckets_chosen == 4
    assert choice.exposed_chosen_s < choice.exposed_default_s - 0.010  # 8.1 ms against 24.1


def test_a_high_latency_link_gets_one_bucket():
    """Each collective costs 30 ms. Four buckets queue behind each other (the last ends
    at 10 + 4 * 31 = 134 ms: 94 ms exposed). DDP's two ([1 MiB] from 10 to 41 ms, then
    [3 MiB] 41 to 74 ms) and one bucket of all four (40 to 74 ms) both expose 34 ms,
    but one bucket saves a collective: cost 34 - 30 = 4 ms against DDP's 34 ms. The
    one-bucket plans tie (uniform caps of 4 MiB and up); the largest cap wins."""
    link = Link(alpha=0.030, beta=0.001 / MiB)
    choice = autocap.choose(SIZES, READY, BACKWARD, link)
    assert choice.limits == [256 * MiB]
    assert (choice.buckets_default, choice.buckets_chosen) == (2, 1)
    assert choice.exposed_default_s == pytest.approx(0.034)
    assert choice.exposed_chosen_s == pytest.approx(0.034)


def test_a_small_gain_keeps_ddps_default():
    """A fast link: every plan hides almost everything; the default stays."""
    link = Link(alpha=1e-5, beta=1e-4 / MiB)
    choice = autocap.choose(SIZES, READY, BACKWARD, link)
    assert choice.limits == autocap.default_limits()


def test_an_extra_collective_must_save_more_than_its_fixed_cost():
    """0.3 and 0.1 MiB ready at 1 and 4 ms; alpha 2.5 ms, 10 ms per MiB. DDP's one
    bucket: 2.5 + 4 ms from 4 ms, 6.5 ms exposed. Two buckets (0.25 MiB caps): 1 + 5.5 =
    6.5 ms, then 2.5 + 1 ms: 6 ms exposed, 0.5 ms less, over 5 % of the backward but less
    than the second collective's 2.5 ms: DDP's default stays."""
    sizes, ready, backward = [3 * MiB // 10, MiB // 10], [0.001, 0.004], 0.004
    link = Link(alpha=0.0025, beta=0.010 / MiB)
    assert autocap.predict(sizes, ready, backward, [MiB // 4], link) == (pytest.approx(0.006, abs=1e-6), 2)
    assert autocap.predict(sizes, ready, backward, autocap.default_limits(), link) == (
        pytest.approx(0.0065, abs=1e-6), 1)
    choice = autocap.choose(sizes, ready, backward, link)
    assert choice.limits == autocap.default_limits() and choice.buckets_chosen == 1


def test_caps_above_the_in_flight_budget_are_not_chosen():
    """alpha 12 ms, 3 ms per MiB. DDP's default: [1 MiB] 10 to 25 ms, [3 MiB] 40 to 61
    ms: 21 ms exposed. Unbounded, one bucket (40 to 64 ms, 24 ms exposed, one collective
    fewer: cost 24 - 12 = 12 ms) is best; its caps (4 MiB and up) are over a 2 MiB
    budget. Within it: caps of 2 MiB, [g0 g1] 20 to 38 ms, [g2 g3] 40 to 58 ms: 18 ms
    exposed, 3 ms less than DDP's, over 5 % of the backward (2 ms); four 1 MiB buckets
    (10 to 25, 25 to 40, 40 to 55, 55 to 70 ms) cost 30 + 2 * 12 = 54 ms, and [1 MiB, 2
    MiB] ([g0], [g1 g2] from 30 ms, [g3] to 63 ms) 23 + 12 = 35 ms."""
    link = Link(alpha=0.012, beta=0.003 / MiB)
    unbounded = autocap.choose(SIZES, READY, BACKWARD, link)
    assert unbounded.limits == [256 * MiB] and unbounded.buckets_chosen == 1
    assert unbounded.exposed_chosen_s == pytest.approx(0.024)
    choice = autocap.choose(SIZES, READY, BACKWARD, link, max_in_flight=2 * MiB)
    assert choice.limits == [2 * MiB] and choice.buckets_chosen == 2
    assert choice.exposed_chosen_s == pytest.approx(0.018)
    assert choice.exposed_default_s == pytest.approx(0.021)


@pytest.mark.usefixtures("fake_pg")
def test_config_auto_reaches_torch_ddp_and_the_choice_is_used(tmp_path):
    """``config.bucket_cap_mb = "auto"`` with ``config.link`` given: an adopted torch
    DDP's limits become the choice at its first compiled forward, and the compiled
    backward reduces in those buckets. Six 256x256 layers (1.5 MiB of gradients, at
    most 257 KiB each): DDP's default caps make two buckets whatever the ready order
    (the first closes at 1 MiB, before the last gradient). On a link whose collective
    costs 1 s, any plan of n >= 2 buckets costs at least (2n - 2) s plus the bytes'
    time, less the (millisecond) backward; one bucket costs only the bytes' time: one
    bucket (ties broken by the largest cap, 256 MiB), whatever the measured ready
    times."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), ddp_fusion.config.patch(
        enabled=True, bucket_cap_mb="auto", link=(1e6, 1.0), dump_dir=str(tmp_path)
    ):
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        torch.compile(ddp)(torch.randn(8, 256)).sum().backward()
    sync = ddp._ddp_fusion
    assert sync.sizing is not None and not sync.sizing.measured_link
    assert sync.sizing.limits == [256 * MiB], sync.sizing
    assert (sync.sizing.buckets_default, sync.sizing.buckets_chosen) == (2, 1), sync.sizing
    assert sync.limits == [256 * MiB]
    fused = counters["ddp_fusion"]
    assert fused["graphs"] == 1 and fused["fused_all_reduces"] == 12, dict(fused)
    assert fused["buckets"] == 1, dict(fused)  # DDP's default caps would make 2
    assert list(tmp_path.glob("rank0_autocap_*.json"))


def test_wrapper_refuses_what_auto_cannot_plan(fake_pg):
    with pytest.raises(ValueError, match="bucket_cap_mb='auto' or bucket_cap_mb_list, not both"):
        ddp_fusion.DistributedDataParallel(torch.nn.Linear(2, 2), bucket_cap_mb="auto",
                                           bucket_cap_mb_list=[1])
    with pytest.raises(ValueError, match="'auto' with find_unused_parameters=True is not supported"):
        ddp_fusion.DistributedDataParallel(torch.nn.Linear(2, 2), bucket_cap_mb="auto",
                                           find_unused_parameters=True)
    with pytest.raises(ValueError, match="bucket_cap_mb must be a non-negative number of MiB"):
        ddp_fusion.DistributedDataParallel(torch.nn.Linear(2, 2), bucket_cap_mb="big")


def test_every_rank_runs_rank_0s_choice_and_trains_like_eager_ddp():
    results = run_ranks(auto_caps_against_eager_ddp, world_size=2, timeout=600)
    assert results[0]["limits"] == results[1]["limits"]
    assert results[0]["link"] == results[1]["link"] and results[0]["measured"]
    # each rank logs the choice it runs (rank 0's), once; rank 1 says whose it is
    (rank0,), (rank1,) = results[0]["logged"], results[1]["logged"]
    assert "(group rank 0's choice)" not in rank0 and "(group rank 0's choice)" in rank1
    assert rank1.replace(" (group rank 0's choice)", "") == rank0, (rank0, rank1)
    for r in results:
        assert r["collectives"] == r["eager_collectives"], r
        assert r["max_diff"] < 1e-5, r
