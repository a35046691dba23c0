"""What one profiled step communicated, copied, held and when: ``torch.profiler`` helpers.

* :func:`measure_step`: collectives, bytes reduced, bytes copied, held and peak memory of
  one step (``bench.step_time``'s bytes table);
* :func:`graph_stats` and :class:`LoweredGraphs`: collectives and bucket copies in the
  graphs Inductor really lowers (after every pass);
* :func:`timeline`: one step's events on a time line (phases, collective issues, waits,
  the backend's collectives with their bytes, backward compute ops, idle gaps), which
  ``bench.cost_model`` replays and ``bench.step_time --link`` draws.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

import ddp_fusion
from bench._lib import _torch
from bench._lib.record import event_dtypes, nbytes

COLLECTIVE_PREFIXES = ("gloo:", "nccl:")
# Main-thread events of a collective's issue and of a blocking wait; nested issue ops
# (_c10d_functional::all_reduce_ -> c10d::allreduce_) count once.
ISSUE_OPS = {"c10d::allreduce_", "c10d::allreduce_coalesced_", "_c10d_functional::all_reduce",
             "_c10d_functional::all_reduce_", "_c10d_functional::all_reduce_coalesced",
             "_c10d_functional::all_reduce_coalesced_"}
WAIT_OPS = {"_c10d_functional::wait_tensor", "c10d::wait"}
BUCKET_COLLECTIVES = ("gloo:all_reduce", "nccl:all_reduce")
COPY_OUT = "torch.distributed.ddp.reducer::copy_bucket_to_grad"  # eager DDP's finalize
STEP = "bench::step"


# --------------------------------------------------------------------------- bytes and memory


def measure_step(step: Any, device: str) -> dict[str, Any]:
    """Run one step (zero_grad outside the profiler) and measure what it communicated,
    copied and held.

    * ``collectives``: backend events (``gloo:*`` / ``nccl:*``) by name;
    * ``bytes_reduced``: numel x element size of those events' inputs;
    * ``python_all_reduces`` / ``python_bytes``: ``dist.all_reduce`` calls from any
      thread (what comm hooks send);
    * ``copy_bytes``: bytes written by ``aten::copy_`` / ``aten::cat`` calls that are not
      inside another aten op: copies made by reducers and backends (torch DDP's bucket
      fill and empty, gloo's flattening of a coalesced all-reduce), not the ones inside
      kernels and not those Inductor generates (see :func:`graph_stats`);
    * ``held_bytes``: after zero_grad, the bytes the job holds between steps
      (:func:`held_bytes`);
    * ``rise_bytes``: on CPU, the highest total of allocations made during the rest of
      the step and not yet freed; on CUDA, ``max_memory_allocated`` above the start;
    * ``peak_bytes``: ``held_bytes + rise_bytes`` (on CPU frees of memory allocated
      before the profiler started are not seen: an upper bound);
    * ``rss_rise_bytes`` / ``rss_peak_bytes`` (CPU, Linux): the same, the median of
      :data:`RSS_STEPS` more steps, unprofiled, from the process's peak resident set,
      which sees every thread's allocations and frees (gloo's too): :func:`rss_rise`;
    * ``kernels`` (CUDA only): GPU kernels launched.
    """
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    step.zero_grad()
    held = held_bytes(step)
    base = 0
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with profile(activities=activities, record_shapes=True, profile_memory=True) as prof, \
            python_all_reduces() as sizes:
        step.rest()
        if device == "cuda":
            torch.cuda.synchronize()
    out: dict[str, Any] = {"collectives": {}, "bytes_reduced": 0, "copy_bytes": 0,
                           "python_all_reduces": len(sizes), "python_bytes": sum(sizes)}
    for e in prof.events():
        if e.name.startswith(COLLECTIVE_PREFIXES):
            out["collectives"][e.name] = out["collectives"].get(e.name, 0) + 1
            out["bytes_reduced"] += nbytes(e.input_shapes, event_dtypes(e))
        elif e.name in ("aten::copy_", "aten::cat") and not (
                e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")):
            # copy_(dst, src) writes dst; cat writes the output it allocates (the
            # profiler records no shapes for a tensor list)
            out["copy_bytes"] += (nbytes(e.input_shapes[:1], event_dtypes(e)) if e.name == "aten::copy_"
                                  else e.cpu_memory_usage + e.device_memory_usage)
    live = peak = 0
    if device == "cpu":  # the raw events list every allocation and free in order
        for e in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
            if e.name() == "[memory]":
                live += e.nbytes()
                peak = max(peak, live)
    out["rise_bytes"] = torch.cuda.max_memory_allocated() - base if device == "cuda" else peak
    out["held_bytes"] = held
    out["peak_bytes"] = held + out["rise_bytes"]
    if device == "cpu" and RSS_PEAK_WORKS:
        rises = []
        for _ in range(RSS_STEPS):
            step.zero_grad()
            held = held_bytes(step)
            rises.append(rss_rise(step.rest))
        out["rss_rise_bytes"] = sorted(rises)[len(rises) // 2]
        out["rss_peak_bytes"] = held + out["rss_rise_bytes"]
    if device == "cuda":
        out["kernels"] = sum(1 for e in prof.events() for _ in e.kernels)
    return out


@contextlib.contextmanager
def python_all_reduces() -> Iterator[list[int]]:
    """Bytes of each ``dist.all_reduce`` call, from any thread: what comm hooks send
    (PowerSGD's chained all-reduces are issued from gloo's threads, whose events this
    thread's profiler does not always record)."""
    sizes, original = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        sizes.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield sizes
    finally:
        dist.all_reduce = original


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    """Reset the process's peak resident set to its current one (Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


RSS_PEAK_WORKS = _reset_peak_rss()
RSS_STEPS = 5


def rss_rise(run: Any) -> int:
    """How far the resident set of the process rose above its level at the start while
    ``run()`` ran, in bytes: peak memory as every thread sees it (torch's profiler misses
    frees on gloo's threads). From here on glibc serves every allocation of 64 KiB or
    more by its own mmap, returned to the system at its free (``M_MMAP_THRESHOLD``), so
    the resident set follows the live tensors rather than the allocator's cache. That
    setting stays for the rest of the process, and makes allocations slower: time
    nothing in the process after it (the bench measures after its timed rounds)."""
    import ctypes

    libc = ctypes.CDLL(None)
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.malloc_trim(0)
    _reset_peak_rss()
    start = _status_kb("VmRSS")
    run()
    return (_status_kb("VmHWM") - start) * 1024


def held_bytes(step: Any) -> int:
    """Bytes of the tensors a job keeps between steps: parameters, gradients, optimizer
    state, buffers (each storage once: gradients that are views of one bucket count
    once), and reducer buckets: torch DDP's C++ reducer's (unless its ``.grad`` are views
    of them), ddp_fusion's eager reducer's (allocated on first use)."""
    model = step.model
    if model is None:
        return 0
    storages: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for b in model.buffers():
        add(b)
    for state in step.opt.state.values():
        for v in state.values():
            add(v)
    inner = _torch.unwrap_compiled(model)
    extra = 0
    sync_reducer = _ddp_fusion_reducer(inner)
    if sync_reducer is not None:
        for bucket in sync_reducer.buckets:
            # the buffer is allocated on first use; reading ``.buffer`` would allocate it
            add(bucket._buffer)
        if isinstance(inner, nn.parallel.DistributedDataParallel):  # adopted: its placeholder reducer
            extra += _torch.ddp_bucket_bytes(inner)
    elif isinstance(inner, nn.parallel.DistributedDataParallel) and not (
            inner.gradient_as_bucket_view and any(p.grad is not None for p in model.parameters())):
        # (with gradient_as_bucket_view, .grad are views of the buckets: counted above,
        # unless zero_grad(set_to_none=True) dropped them, while the buckets stay)
        extra += _torch.ddp_bucket_bytes(inner)
    return sum(storages.values()) + extra


def _ddp_fusion_reducer(model: Any) -> Any:
    """ddp_fusion's eager reducer of ``model`` (its wrapper, or a torch DDP it adopted)."""
    if isinstance(model, ddp_fusion.DistributedDataParallel):
        return model.reducer
    from ddp_fusion import stock

    sync = stock.adopted(model)
    return None if sync is None else sync.reducer


# --------------------------------------------------------------------------- lowered graphs


def graph_stats(graph: torch.fx.Graph) -> dict[str, int]:
    """Collectives in ``graph``, the bytes they reduce, the bytes written by ``cat`` nodes
    that feed them (the copy into a fused bucket; an upper bound, since Inductor can
    compute a cat input directly into the bucket), the bytes of reduced gradients
    copied into another tensor (a copy back into ``.grad``), and copies per gradient.

    ``grads``: gradients going into a fused collective (a ``cat``'s inputs, a coalesced
    all-reduce's inputs, the kept ``.grad``s ddp_fusion reduces in place);
    ``grad_copies``: how many of them are copied on the way. A gradient made by an
    extern kernel (:data:`EXTERN`: ``mm``, ``addmm``, convolutions...) is written to a
    buffer of its own and then copied into the bucket (or its ``.grad``): one copy. One
    Inductor generates (pointwise, reductions) is written straight into its place: none.
    Each copy back into ``.grad`` is one more. Graph-level: ``.grad``s that ddp_fusion's
    in-place op gathers at run time (made by the user, not one run of memory) are not
    counted."""
    c10d = _torch.C10D
    in_place = torch.ops.ddp_fusion.all_reduce_in_place.default
    buckets = {torch.ops.ddp_fusion.all_reduce_bucket.default,
               torch.ops.ddp_fusion.all_reduce_bucket_coalesced.default}
    collectives = {c10d.all_reduce.default, c10d.all_reduce_.default,
                   c10d.all_reduce_coalesced.default, c10d.all_reduce_coalesced_.default,
                   torch.ops.ddp_fusion.all_reduce_gradient.default, in_place, *buckets}
    views = {torch.ops.aten.view.default, torch.ops.aten.split_with_sizes.default,
             torch.ops.aten.permute.default, torch.ops.aten.reshape.default,
             torch.ops.aten.split.Tensor, torch.ops.aten.alias.default, operator.getitem}
    # on the way from a gradient into its bucket: views, the scaling, a cast, a write
    passes = views | {torch.ops.aten.div.Tensor, _torch.FOREACH_DIV,
                      torch.ops.prims.convert_element_type.default, torch.ops.aten.copy_.default}

    def size(n: Any) -> int:
        vals = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
        vals = vals if isinstance(vals, (list, tuple)) else [vals]
        return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))

    def feeds_collective(n: torch.fx.Node, depth: int = 3) -> bool:
        return any(u.target in collectives or (depth > 1 and feeds_collective(u, depth - 1))
                   for u in n.users)

    def reduced(n: Any, depth: int = 6) -> bool:
        """``n`` is (a view of) a collective's result."""
        if not isinstance(n, torch.fx.Node) or depth == 0:
            return False
        if n.target is c10d.wait_tensor.default:
            return True
        if any(u.target in buckets for u in n.users):  # ddp_fusion's buckets: reduced in place
            return True
        return n.target in views and reduced(n.args[0], depth - 1)

    def copied(n: Any, depth: int = 8) -> bool:
        """The gradient on its way into a bucket at ``n`` comes from an extern kernel."""
        while isinstance(n, torch.fx.Node) and n.target in passes and depth:
            if n.target is torch.ops.aten.reshape.default and not n.args[0].meta["val"].is_contiguous():
                return True  # (a gradient that is not dense, copied to be flattened)
            if n.target is operator.getitem and n.args[0].target is _torch.FOREACH_DIV:
                n = n.args[0].args[0][n.args[1]]  # (one of a _foreach_div's inputs)
            else:
                n = n.args[1] if n.target is torch.ops.aten.copy_.default else n.args[0]
            depth -= 1
        return isinstance(n, torch.fx.Node) and n.target in EXTERN | {torch.ops.aten.clone.default}

    stats = {"collectives": 0, "bytes_reduced": 0, "fusion_copy_bytes": 0, "copy_back_bytes": 0,
             "grads": 0, "grad_copies": 0}
    for n in graph.nodes:
        if n.target in (torch.ops.aten.copy_.default, torch.ops.aten.copy.default) and reduced(n.args[1]):
            stats["copy_back_bytes"] += size(n.args[1])
            stats["grad_copies"] += 1
        if n.target in collectives:
            stats["collectives"] += 1
            arg = n.args[0]
            stats["bytes_reduced"] += (sum(size(a) for a in arg) if isinstance(arg, (list, tuple))
                                       else size(arg))
            if isinstance(arg, (list, tuple)):  # coalesced, or in place in the kept .grads
                stats["grads"] += len(arg)
                stats["grad_copies"] += sum(copied(a) for a in arg)
        elif n.target in (torch.ops.aten.cat, torch.ops.aten.cat.default) and feeds_collective(n):
            # (upstream's concat pass calls the overload packet ``aten.cat``)
            stats["fusion_copy_bytes"] += size(n)
            stats["grads"] += len(n.args[0])
            stats["grad_copies"] += sum(copied(a) for a in n.args[0])
    return stats


#: Ops Inductor runs as extern kernels (library calls that write a buffer of their own).
EXTERN = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
          torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default,
          torch.ops.aten.convolution_backward.default}


class LoweredGraphs:
    """:func:`graph_stats` of every FX graph Inductor lowers in this process, in order."""

    def __init__(self) -> None:
        self.stats: list[dict[str, int]] = []
        _torch.on_lowering(lambda gm: self.stats.append(graph_stats(gm.graph)))

    def last_with_collectives(self) -> dict[str, int] | None:
        """The steady-state backward: the last lowered graph with collectives."""
        return next((g for g in reversed(self.stats) if g["collectives"]), None)


# --------------------------------------------------------------------------- time lines


def _outermost(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    iv = sorted(iv, key=lambda x: (x[0], -x[1]))
    out: list[tuple[float, float]] = []
    for s, e in iv:
        if out and s >= out[-1][0] and e <= out[-1][1]:
            continue
        out.append((s, e))
    return out


def timeline(prof: Any) -> dict[str, Any]:
    """The profiled step (the ``bench::step`` range) on a time line, ms from its start.

    * ``phases``: ``step::<phase>`` ranges (zero_grad, forward, backward, optimizer);
    * ``issues``: main-thread collective issue ops (:data:`ISSUE_OPS`, outermost);
    * ``waits``: main-thread blocking waits (:data:`WAIT_OPS`);
    * ``colls``: the backend's bucket collectives (``gloo:all_reduce``), any thread, as
      ``(start, end, bytes)`` (bytes 0 unless shapes were recorded);
    * ``copy_out``: starts of eager DDP's copies of reduced buckets into ``.grad``;
    * ``checks``: ddp_fusion's plan-check ops on the main thread (``plan_check_start``
      starts the host-side exchange of the plan's hash, ``plan_guard`` collects it before
      the first bucket), as ``(name, start, end)``;
    * ``gaps``: main-thread intervals with no event (idle, or blocked in C++: eager DDP
      waits for its buckets without a profiler event);
    * ``wall_ms``: the step's length.
    """
    evs = list(prof.profiler.kineto_results.events())
    st = next(e for e in evs if e.name() == STEP)
    main = st.start_thread_id()
    s0, s1 = st.start_ns(), st.end_ns()

    def rel(t: int) -> float:
        return (t - s0) / 1e6

    inside = [e for e in evs if s0 <= e.start_ns() <= s1 and e.name() != "[memory]"]
    on_main = [e for e in inside if e.start_thread_id() == main]
    phases = {e.name()[len("step::"):]: (rel(e.start_ns()), rel(e.end_ns()))
              for e in on_main if e.name().startswith("step::")}
    issues = _outermost([(rel(e.start_ns()), rel(e.end_ns())) for e in on_main if e.name() in ISSUE_OPS])
    waits = _outermost([(rel(e.start_ns()), rel(e.end_ns())) for e in on_main if e.name() in WAIT_OPS])
    colls = sorted((rel(e.start_ns()), rel(e.end_ns()), nbytes(e.shapes(), e.dtypes()))
                   for e in inside if e.name() in BUCKET_COLLECTIVES)
    copy_out = sorted(rel(e.start_ns()) for e in on_main if e.name() == COPY_OUT)
    checks = sorted((e.name().split("::")[-1], rel(e.start_ns()), rel(e.end_ns())) for e in on_main
                    if e.name() in ("ddp_fusion::plan_check_start", "ddp_fusion::plan_guard"))
    busy = sorted((rel(e.start_ns()), rel(e.end_ns())) for e in on_main
                  if not e.name().startswith(("bench::", "step::")))
    gaps, cur = [], 0.0
    for s, e in busy:
        if s > cur + 0.02:
            gaps.append((cur, s))
        cur = max(cur, e)
    if rel(s1) > cur + 0.02:
        gaps.append((cur, rel(s1)))
    return {"wall_ms": rel(s1), "phases": phases, "issues": issues, "waits": waits, "colls": colls,
            "copy_out": copy_out, "checks": checks, "gaps": gaps}
