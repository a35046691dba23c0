"""Shared fixtures: a fake process group of 2 ranks for one-process graph tests."""

import logging
import os

import pytest
import torch
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


@pytest.fixture
def dynamo_guards():
    """A list that receives the text of the guards Dynamo builds during the test
    (``TORCH_LOGS=guards``), one entry per compiled frame."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger, keep = logging.getLogger("torch._dynamo.guards.__guards"), Keep()
    logger.addHandler(keep)
    torch._logging.set_logs(guards=True)
    try:
        yield records
    finally:
        torch._logging.set_logs()
        logger.removeHandler(keep)
