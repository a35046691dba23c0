"""A C++ prototype of the per-step plan check's steady path, for ``bench.plan_check
--compiled-check`` only: what a compiled steady path would take off a step, next to the
shipped Python ops (bench/results/plan_check_price_cpu_2026-11-28.md).

Not the product, and not safe as one: ``plan_check_start`` and ``plan_guard`` get C++
kernels (through a ``torch::Library`` made and dropped around the timed rounds) that send
the two-rank exchange's frame (``host_group.PairChannel``'s: a uint32 count, then the
int64 values) on the host group's own connection, read exactly the peer's frame, and
compare (a mismatch is a bare error, with no description). They keep none of the Python
channel's state: an exchange of the Python side in flight across a switch of kernels, or
any other exchange on the connection during the block, would be misread (the bench's
rounds start each step after a barrier, so none is). Only a group of two ranks whose host
group is made, one guard per group and step (one reduce op and device), no join divisors,
no hooked buckets; waits bounded at 60 s. Built with
``torch.utils.cpp_extension.load_inline`` (a C++ compiler and ninja; about 25 s the
first time, cached after).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.utils.cpp_extension import load_inline

from ddp_fusion import host_group

SOURCE = r'''
#include <torch/extension.h>
#include <torch/library.h>
#include <sys/socket.h>
#include <poll.h>
#include <errno.h>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>

static std::unordered_map<std::string, std::pair<int, double>> g_chan;
static std::unique_ptr<torch::Library> g_lib;
static constexpr size_t kFrame = 4 + 2 * 8;  // (little-endian hosts, as the Python side packs "<")

static std::pair<int, double>& chan(c10::string_view name) {
  auto it = g_chan.find(std::string(name));
  TORCH_CHECK(it != g_chan.end(), "compiled-check prototype: no channel for group ", std::string(name));
  return it->second;
}

static at::Tensor divisor(double d, c10::string_view reduce_op, c10::Device device) {
  return at::full({}, reduce_op == "avg" ? d : 1.0, at::TensorOptions().dtype(at::kFloat).device(device));
}

// After a send or recv on the non-blocking socket that would block: wait (60 s at most)
// until it can go on; any other error raises.
static void wait_ready(int fd, short events, const char* op, const char* timed_out) {
  TORCH_CHECK(errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR,
              "compiled-check prototype: ", op, " failed, errno ", errno);
  pollfd pf{fd, events, 0};
  TORCH_CHECK(::poll(&pf, 1, 60000) > 0, "compiled-check prototype: ", timed_out);
}

at::Tensor start(c10::string_view group_name, c10::string_view plan, int64_t h, c10::Device device,
                 c10::string_view reduce_op) {
  auto& c = chan(group_name);
  // host_group.PairChannel's frame: a uint32 count of int64 values, then the values
  char frame[kFrame];
  const uint32_t count = 2;
  const int64_t values[2] = {h, -h};
  std::memcpy(frame, &count, 4);
  std::memcpy(frame + 4, values, 16);
  const char* p = frame;
  size_t left = kFrame;
  while (left) {
    ssize_t n = ::send(c.first, p, left, MSG_NOSIGNAL);
    if (n < 0) {
      wait_ready(c.first, POLLOUT, "send", "the peer read nothing in 60 s");
      continue;
    }
    p += n; left -= n;
  }
  return divisor(c.second, reduce_op, device);
}

at::Tensor guard(const at::Tensor& token, c10::string_view group_name, int64_t h, c10::string_view reduce_op,
                 c10::Device device) {
  auto& c = chan(group_name);
  char frame[kFrame];
  char* p = frame;
  size_t left = kFrame;
  while (left) {
    ssize_t n = ::recv(c.first, p, left, 0);
    if (n < 0) {
      wait_ready(c.first, POLLIN, "recv", "the peer sent nothing in 60 s");
      continue;
    }
    TORCH_CHECK(n > 0, "compiled-check prototype: the peer closed the connection");
    p += n; left -= n;
  }
  uint32_t count;
  int64_t theirs[2];
  std::memcpy(&count, frame, 4);
  std::memcpy(theirs, frame + 4, 16);
  TORCH_CHECK(count == 2 && std::max(h, theirs[0]) == h && std::max(-h, theirs[1]) == -h,
              "compiled-check prototype: the ranks run different bucket plans");
  return divisor(c.second, reduce_op, device);
}

void set_channel(const std::string& name, int64_t fd, double d) { g_chan[name] = {int(fd), d}; }

void enable() {
  g_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "ddp_fusion",
                                           c10::DispatchKey::CompositeExplicitAutograd, __FILE__, __LINE__);
  g_lib->impl("plan_check_start", TORCH_FN(start));
  g_lib->impl("plan_guard", TORCH_FN(guard));
}

void disable() { g_lib.reset(); }
'''


@functools.cache
def _extension() -> Any:
    return load_inline("ddp_fusion_bench_plan_check", SOURCE, functions=["set_channel", "enable", "disable"],
                       extra_cflags=["-O2"])


def build() -> None:
    """Build (or load) the extension: before the ranks time anything."""
    _extension()


@contextlib.contextmanager
def steady_check(group: dist.ProcessGroup) -> Iterator[None]:
    """The plan ops' C++ kernels for the block, on ``group`` (two ranks, its host group
    made: after the model's first steps)."""
    known = host_group.known(group.group_name)
    if known is None or group.size() != 2:
        raise RuntimeError("the compiled-check prototype needs a group of two ranks whose host group is made")
    ext = _extension()
    ext.set_channel(group.group_name, known[1]._channel._sock.fileno(), float(group.size()))
    with warnings.catch_warnings():  # (that it overrides the shipped kernels: that is the point)
        warnings.simplefilter("ignore", UserWarning)
        ext.enable()
    try:
        yield
    finally:
        ext.disable()


def time_steps(rank: int, world_size: int, n: int) -> dict[str, Any]:
    """bench/_lib/step.py's ``time_steps`` on the rank's job, with the prototype's kernels."""
    from bench._lib import step

    with steady_check(dist.group.WORLD):
        return step.time_steps(rank, world_size, n)
