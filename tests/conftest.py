"""Shared fixtures: a fake process group of 2 ranks for one-process graph tests."""

import logging
import os

import pytest
import torch.distributed as dist

from ddp_fusion import _torch

# c10d's flight recorder in every process group the tests make (ranks inherit the
# environment): tests count collectives with it (``_torch.distributed.AllReduces``),
# which sees those issued from any thread, where the profiler can miss one.
os.environ.setdefault(_torch.distributed.FLIGHT_RECORDER_ENV, "4096")


@pytest.fixture(scope="session")
def fake_pg():
    """The default process group: ``backend="fake"``, rank 0 of 2. Collectives do no
    communication (an all-reduce returns its input unchanged)."""
    if not dist.is_initialized():
        dist.init_process_group("fake", store=_torch.distributed.fake_store(), rank=0, world_size=2)
    yield dist.group.WORLD


@pytest.fixture(autouse=True)
def _ddp_fusion_records_reach_caplog():
    """torch's logging (with which ddp_fusion registers its logger) stops it from
    propagating; let its records reach pytest's ``caplog`` during tests."""
    log = logging.getLogger("ddp_fusion")
    propagate, log.propagate = log.propagate, True
    yield
    log.propagate = propagate
