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
  Among the paths: kept ``.grad``s (``zero_grad(set_to_none=False)``: each bucket
  reduced in place in them), and a model whose gradients come in three layouts (a
  channels-last convolution, a weight stored transposed, plain ones), with new and kept
  ``.grad``s.
* ``torch.compile(mode="reduce-overhead")`` (CUDA graphs) forward and backward, with kept
  ``.grad``s and the plan check forced on, 6 steps: trains as eager torch DDP, every
  step issues each bucket's all-reduce through its process group (c10d's flight
  recorder sees the same count at every step: none was captured in a CUDA graph, whose
  replays it would not see), and Inductor partitioned or skipped the graphs around
  ddp_fusion's ops (its counters, printed with ``-rA``).
* The "slow" backend (tests/_slow_backend.py) on CUDA tensors, 2 processes sharing the
  GPU: each all-reduce's result is written by a side stream that sleeps first, and the
  work's wait orders the current stream after it; under ``TORCH_CUDA_SANITIZER=1`` a
  kernel that read a bucket before its wait would be reported, and it would read NaN.
  The paths: concat, coalesced, kept ``.grad``s in one run and gathered, a comm hook,
  ``join()``, uncompiled.

The same paths run on the CPU (gloo, world size 1, the check forced on) in
``test_the_gpu_suites_paths_on_the_cpu`` (slow), so their logic is exercised without a
GPU; the slow backend's CPU form is tests/test_slow_backend_gloo.py. Timings and memory
on a GPU: the runbook in bench/README.md.
"""

import pytest
import torch

from ddp_fusion.launch import run_ranks

from _workers_gpu import REDUCE_OVERHEAD_STEPS, STEPS, paths, reduce_overhead, shared_device
from _workers_slow import slow_paths

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PATHS = ("wrapper, compiled, find_unused_parameters", "wrapper, uncompiled, find_unused_parameters",
         "torch DDP under the flag, compiled", "comm hook, compiled", "join(), compiled",
         "wrapper, compiled, kept .grads",
         "channels-last convolution and transposed weight, compiled, new .grads",
         "channels-last convolution and transposed weight, compiled, kept .grads",
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


def _check_reduce_overhead(out, device_type):
    assert out["diff"] < 1e-5, out
    per_step = out["all_reduces_per_step"]
    # Net's two buckets at bucket_cap_mb=0.01, issued through c10d at every step
    assert per_step == [2] * REDUCE_OVERHEAD_STEPS, out
    if device_type == "cuda":
        cudagraphs = out["inductor"]
        assert cudagraphs.get("cudagraph_partitions", 0) + cudagraphs.get("cudagraph_skips", 0) > 0, out


@pytest.mark.gpu
@needs_cuda
def test_reduce_overhead_captures_no_collective_and_trains_as_eager_ddp(monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")  # c10d's flight recorder, in the rank
    (out,) = run_ranks(reduce_overhead, world_size=1, args=("cuda",), backend="nccl", timeout=900)
    print("reduce-overhead:", out)
    _check_reduce_overhead(out, "cuda")


def _check_slow(results):
    for rank, out in enumerate(results):
        nan_before, after = out.pop("read before wait")
        assert nan_before and after == [2.0] * 4, "the backend is not slow"
        for name, r in out.items():
            assert r["diff"] < 1e-5 and r["left"] == [], (rank, name, r)


@pytest.mark.gpu
@needs_cuda
def test_every_path_waits_for_a_slow_side_stream_under_the_cuda_sanitizer(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_SANITIZER", "1")  # in the ranks, from their import of torch
    _check_slow(run_ranks(slow_paths, world_size=2, args=("cuda",), timeout=900, pg_timeout=120))


@pytest.mark.slow
def test_the_gpu_suites_paths_on_the_cpu(monkeypatch):
    (out,) = run_ranks(paths, world_size=1, args=("cpu",), timeout=900)
    _check_paths(out)
    for r in run_ranks(shared_device, world_size=2, args=("cpu",), timeout=900, pg_timeout=120):
        assert r["diff"] < 1e-5 and r["raised_at"] == 2, r
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    (out,) = run_ranks(reduce_overhead, world_size=1, args=("cpu",), timeout=900)
    _check_reduce_overhead(out, "cpu")
