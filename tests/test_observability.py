"""Seeing what ddp_fusion did where torch users look (fresh interpreters, fake group of
2): ``TORCH_TRACE`` holds the plan and the graphs as structured artifacts under each
compiled-autograd graph's compile id (what tlparse shows); the dump files are named by
compile id and step (first / steady), label each bucket's nodes, and show the graph
Inductor lowers (``all_reduce_`` in place); and a graph served from Inductor's FX graph
cache is not silent: its plan is logged and dumped."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, logging, os, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import ddp_fusion
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
infos = []
class Keep(logging.Handler):
    def emit(self, record): infos.append(record.getMessage())
log = logging.getLogger("ddp_fusion")
log.addHandler(Keep(level=logging.INFO)); log.setLevel(logging.INFO)
ddp_fusion.config.enabled = True
ddp_fusion.config.dump_dir = sys.argv[1]
torch.manual_seed(0)
model = torch.compile(ddp_fusion.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), bucket_cap_mb=0.00005))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    opt.zero_grad(set_to_none=False)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
files = sorted(os.listdir(sys.argv[1])) if os.path.isdir(sys.argv[1]) else []
print(json.dumps({"files": files, "infos": infos}))
"""


def _run(dump_dir, cache_dir, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DDP_FUSION", "TORCH_"))}
    return subprocess.run([sys.executable, "-c", SCRIPT, str(dump_dir)], capture_output=True, text=True,
                          env={**base, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), **env}, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same training twice on one Inductor cache: cold (with TORCH_TRACE), warm."""
    tmp = tmp_path_factory.mktemp("obs")
    # the same dump_dir (part of the pass's cache key: a new one compiles afresh)
    cold = _run(tmp / "dump", tmp / "cache", TORCH_TRACE=str(tmp / "trace"))
    (tmp / "dump").rename(tmp / "dump_cold")
    warm = _run(tmp / "dump", tmp / "cache")
    for run in (cold, warm):
        assert run.returncode == 0, run.stderr
    return tmp, json.loads(cold.stdout.splitlines()[-1]), json.loads(warm.stdout.splitlines()[-1])


def test_torch_trace_has_the_plan_and_graphs_per_compile_id(runs):
    tmp, _, _ = runs
    (log,) = glob.glob(str(tmp / "trace" / "*.log"))
    artifacts = []
    for line in open(log):
        if line.startswith("\t"):
            continue  # a payload line
        record = json.loads(line.split("] ", 1)[1])
        if "artifact" in record and record["artifact"]["name"].startswith("ddp_fusion"):
            artifacts.append((record["artifact"]["name"], record.get("compiled_autograd_id")))
    for ca_id in (0, 1):  # the first backward's graph, and the steady one's
        for name in ("ddp_fusion_plan", "ddp_fusion_before", "ddp_fusion_after"):
            assert (name, ca_id) in artifacts, artifacts


def test_dump_files_are_named_by_compile_id_and_step(runs):
    _, cold, _ = runs
    names = {f.split("_", 2)[2] for f in cold["files"]}  # rank0_000_<rest>
    assert names == {f"{cid}_{phase}.{kind}" for cid, phase in (("ca0_1_0", "first"), ("ca1_2_0", "steady"))
                     for kind in ("before.txt", "after.txt", "buckets.json")}, names


def test_after_graph_is_the_lowered_one_with_labelled_buckets(runs):
    tmp, _, _ = runs
    (first,) = glob.glob(str(tmp / "dump_cold" / "*_first.after.txt"))
    code = open(first).read()
    assert "bucket0_all_reduce = torch.ops.ddp_fusion.all_reduce_bucket.default(bucket0_cat" in code
    assert "bucket1_wait = " in code and "bucket1_split = " in code
    # the steady step accumulates into the first step's .grads: reduced in place there
    (steady,) = glob.glob(str(tmp / "dump_cold" / "*_steady.after.txt"))
    code = open(steady).read()
    assert ("bucket0_all_reduce_in_place = torch.ops.ddp_fusion.all_reduce_in_place.default("
            "[bucket0_write") in code
    assert "bucket1_wait = torch.ops.ddp_fusion.wait_in_place.default([bucket1_write" in code


def test_a_graph_from_the_fx_graph_cache_is_logged_and_its_plan_dumped(runs):
    _, _, warm = runs
    assert any("served from Inductor's FX graph cache" in m and "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1" in m
               for m in warm["infos"]), warm["infos"]
    (cached,) = [f for f in warm["files"] if "_cached_" in f]
    assert cached.endswith(".buckets.json")
