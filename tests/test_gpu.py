"""The GPU suite (``python -m pytest -q -m gpu``; skipped without CUDA): what gloo on the
CPU cannot show, on one GPU.

* NCCL at world size 1 with the per-step plan check forced on (``host_group.FORCE``:
  there is no peer to disagree with, but every check runs): the wrapper compiled and
  not, each with ``find_unused_parameters=True``; torch DDP under the flag; a comm hook;
  ``bucket_cap_mb="auto"``; ``join()``. Each trains as eager torch DDP, and every steady
  compiled step runs under ``torch.cuda.set_sync_debug_mode("error")``: a device sync
  (a host read of a device tensor) raises. A NCCL group refuses CPU tensors, so a
  collective handed one fails here too.
* 2 processes sharing the GPU over gloo with CUDA tensors: buckets over ranks with
  different data against eager torch DDP; a plan that diverges at a later step raises
  ``PlanMismatchError`` on every rank at that step.
* ``torch.compile(mode="reduce-overhead")`` (CUDA graphs) forward and backward: runs and
  trains as eager torch DDP (Inductor's CUDA-graph counters are printed: ddp_fusion's
  ops are tagged cudagraph-unsafe, so the graphs holding them are left out).

The same paths run on the CPU (gloo, world size 1, the check forced on) in
``test_the_gpu_suites_paths_on_the_cpu`` (slow), so their logic is exercised without a
GPU. Timings and memory on a GPU: the runbook in bench/README.md.
"""

import pytest
import torch

from ddp_fusion.launch import run_ranks

from _workers_gpu import STEPS, paths, reduce_overhead, shared_device

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PATHS = ("wrapper, compiled, find_unused_parameters", "wrapper, uncompiled, find_unused_parameters",
         "torch DDP under the flag, compiled", "comm hook, compiled", "join(), compiled",
         "bucket_cap_mb='auto', compiled")


def _check_paths(out):
    assert set(out) == set(PATHS)
    for name, r in out.items():
        assert r["diff"] < 1e-5, (name, r)
    # the hook reduces each of the two buckets at every step
    assert out["comm hook, compiled"]["hook_calls"] == 2 * STEPS, out


@pytest.mark.gpu
@needs_cuda
def test_every_path_on_nccl_at_world_size_1_with_the_plan_check_forced_on():
    (out,) = run_ranks(paths, world_size=1, args=("cuda",), backend="nccl", timeout=900)
    _check_paths(out)


@pytest.mark.gpu
@needs_cuda
def test_two_processes_sharing_one_gpu_over_gloo():
    for r in run_ranks(shared_device, world_size=2, args=("cuda",), timeout=900, pg_timeout=120):
        assert r["diff"] < 1e-5 and r["raised_at"] == 2, r


@pytest.mark.gpu
@needs_cuda
def test_reduce_overhead_trains_as_eager_ddp():
    (out,) = run_ranks(reduce_overhead, world_size=1, args=("cuda",), backend="nccl", timeout=900)
    print("reduce-overhead:", out)
    assert out["diff"] < 1e-5, out


@pytest.mark.slow
def test_the_gpu_suites_paths_on_the_cpu():
    (out,) = run_ranks(paths, world_size=1, args=("cpu",), timeout=900)
    _check_paths(out)
    for r in run_ranks(shared_device, world_size=2, args=("cpu",), timeout=900, pg_timeout=120):
        assert r["diff"] < 1e-5 and r["raised_at"] == 2, r
