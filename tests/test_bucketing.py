"""Bucket boundaries equal eager DDP's, for the same bucket arguments.

The reference is torch's own C++ ``compute_bucket_assignment_by_size`` called the way
``Reducer::rebuild_buckets`` calls it after the first iteration (gradients in ready
order, limits from the DDP arguments); limits are checked against
torch DDP's own rule (tests/_torch_buckets.py).
"""

import random

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import ddp_fusion
from ddp_fusion import _torch
from ddp_fusion.plan import ddp_bucket_limits
from ddp_fusion.passes.collectives import find_gradient_all_reduces
from ddp_fusion.passes.bucketing import plan_buckets

from _torch_buckets import torch_rebuild_limits

BUCKET_ARGS = [
    dict(),  # defaults: 1 MiB first bucket, then 25 MiB
    dict(bucket_cap_mb=0.25),
    dict(bucket_cap_mb=1),
    dict(bucket_cap_mb=0),
    dict(bucket_cap_mb_list=[0.5, 2, 0.125]),
    dict(bucket_cap_mb_list=[3]),
]




@pytest.mark.parametrize("args", BUCKET_ARGS, ids=str)
def test_limits_match_torch_ddp(args):
    ours = ddp_bucket_limits(**args)
    theirs = torch_rebuild_limits(**args)
    # [c] and [c, c] are the same rule (the last limit repeats)
    assert ours == theirs or (len(set(theirs)) == 1 and ours == theirs[:1])


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(bucket_cap_mb=-1), "bucket_cap_mb"),
        (dict(bucket_cap_mb="25"), "bucket_cap_mb"),
        (dict(bucket_cap_mb=float("nan")), "bucket_cap_mb"),
        (dict(bucket_cap_mb=True), "bucket_cap_mb"),
        (dict(bucket_cap_mb_list=[]), "bucket_cap_mb_list"),
        (dict(bucket_cap_mb_list=[1, -2]), r"bucket_cap_mb_list\[1\]"),
        (dict(bucket_cap_mb_list="1,2"), "bucket_cap_mb_list"),
    ],
)
def test_bad_bucket_arguments_name_the_setting(bad, match):
    with pytest.raises(ValueError, match=match):
        ddp_bucket_limits(**bad)


def planned(sizes_and_dtypes, **bucket_args):
    """Plan for gradients of these (numel, dtype), in this ready order."""

    def fn(*grads):
        return [ddp_fusion.all_reduce_gradient(g, **bucket_args) for g in grads]

    grads = [torch.empty(n, dtype=dt) for n, dt in sizes_and_dtypes]
    gm = make_fx(fn, tracing_mode="fake")(*grads)
    found, unfused = find_gradient_all_reduces(gm.graph)
    assert not unfused
    index = {g.node: i for i, g in enumerate(found)}
    return [[index[g.node] for g in b.grads] for b in plan_buckets(gm.graph, found)], grads


@pytest.mark.usefixtures("fake_pg")
@pytest.mark.parametrize("args", BUCKET_ARGS, ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_boundaries_match_torch_ddp(args, seed):
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.float32, torch.bfloat16] if seed else [torch.float32]
    # sizes from scalars to ~2 MiB, so every limit in BUCKET_ARGS is crossed
    spec = [(rng.choice([1, 7, 300, 4096, 65536, 262144, 524288]), rng.choice(dtypes)) for _ in range(60)]
    ours, grads = planned(spec, **args)
    theirs = _torch.ddp.compute_bucket_assignment_by_size(
        grads, torch_rebuild_limits(**args), list(range(len(grads)))
    )
    # torch appends the still-open buckets of each (dtype, device) at the end, in hash
    # order; compare as sets of buckets, and the closed ones in order.
    assert sorted(ours) == sorted(theirs)
    n_closed = len(ours) - len({dt for _, dt in spec})
    assert ours[: max(n_closed, 0)] == theirs[: max(n_closed, 0)]


@pytest.mark.usefixtures("fake_pg")
def test_default_first_bucket_is_small():
    """Defaults: 1 MiB, then 25 MiB — eight 512 KiB gradients give buckets of 2 and 6."""
    buckets, _ = planned([(131072, torch.float32)] * 8)
    assert [len(b) for b in buckets] == [2, 6]
