"""Per-rank body of tests/test_bench_probes_gloo.py: what bench.plan_check's modes run."""

import torch
import torch.distributed as dist

from bench._lib import probes
from ddp_fusion import host_group, plan_check
from ddp_fusion.plan import BucketPlan, PlannedBucket


def plan_check_modes(rank: int, world_size: int) -> tuple[list[int], tuple[int, int]]:
    """The plan checks in flight right after each step's ``plan_check_start`` (the step
    is the start and the guard of a one-bucket plan on the world group, called through
    the dispatcher as a fused graph calls them), over one round of
    ``probes._check_or_not``'s modes of two steps each, in the order they ran, then one
    more step after it (the shipped kernels back); and the steady checks the C++
    kernels ran (starts, guards)."""
    name, cpu = dist.group.WORLD.group_name, torch.device("cpu")
    text = BucketPlan("concat", (PlannedBucket(name, torch.float32, "cpu", "avg", "concat", ("w",),
                                               (1024,)),)).to_json()
    h = plan_check.plan_hash(text)
    in_flight: list[int] = []

    def step() -> None:
        divisor = plan_check.PLAN_CHECK_START(name, text, h, cpu, "avg")
        in_flight.append(plan_check.pending())
        assert plan_check.PLAN_GUARD(divisor, name, h, "avg", cpu).item() == world_size

    step()  # the first: the long way (it makes the host group)
    in_flight.clear()
    probes._check_or_not(step, rounds=1, steps=2)
    step()
    return in_flight, host_group.native_loaded().counts()
