"""How the time of the fusion pass grows with the number of gradients in a graph.

Measures, for graphs of N gradients of 4 MB each (fp32, [1024, 1024]):

* ours:     ``ddp_fusion.passes.fuse_ddp_allreduces(graph, algorithm=...)`` with
            ``algorithm="concat"`` and ``"coalesced"`` (wait scheduling on, as configured
            by default);
* upstream: Inductor's ``torch._inductor.fx_passes.ddp_fusion.fuse_ddp_with_concat_op(
            graph, 25)`` (its concat fusion alone, without its wait scheduling pass).

Each graph looks like a backward: a chain of cheap compute (``dh = dh * 0.5``) with one
gradient (``g = dh + i``) split off per step and all-reduced. For ours the all-reduce is
``ddp_fusion.all_reduce_gradient``; for upstream it is the functional collective
``all_reduce(g / 2, "sum", group)`` + ``wait_tensor`` that upstream's pass matches. Graphs
are traced with ``make_fx(tracing_mode="fake")`` on a fake process group of 2 ranks.

Only the pass call is timed: wall time (``time.perf_counter``), and this process's CPU
time (``time.process_time``), which other processes on a busy machine disturb less.
Every measurement gets a freshly traced graph. The best of ``--repeats`` runs is kept
(by wall time), except that a run over 10 s is not repeated. The number of collectives
left in the graph is reported so that one can see each pass really fused.

    cd /work/main && python -m bench.pass_time                 # N = 100 ... 3200
    python -m bench.pass_time --quick                          # N = 100, 200, 400
    python -m bench.pass_time --sizes 100,1000 --skip-upstream-above 400
    python -m bench.pass_time --shape kept --sizes 800,3200   # into kept .grads (in place)
    python -m bench.pass_time --shape sums --sizes 800,3200   # half of them biases' sums
    python -m bench.pass_time --sizes 800,3200 --collector both  # also with gc left on

``--collector both`` also times our passes with Python's garbage collector left on (the
pass pauses it), alternating the two per run, since this VM's speed drifts between runs.

Writes a table to stdout and ``bench/out/pass_time.json``.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

import ddp_fusion
from bench._lib import _torch
from bench._lib.record import provenance, write_json
from ddp_fusion.passes import fuse_ddp_allreduces

SHAPE = (1024, 1024)  # 1M fp32 elements = 4 MB per gradient
DEFAULT_SIZES = (100, 200, 400, 800, 1600, 3200)
QUICK_SIZES = (100, 200, 400)
UPSTREAM_BUCKET_MB = 25
GROWTH_KEYS = ("ours_concat", "ours_coalesced", "ours_concat_gc_on", "ours_coalesced_gc_on",
               "upstream_concat")
SLOW_S = 10.0  # a measurement slower than this is not repeated
COLLECTIVES = {
    _torch.C10D.all_reduce.default,
    _torch.C10D.all_reduce_.default,
    _torch.C10D.all_reduce_coalesced.default,
    _torch.C10D.all_reduce_coalesced_.default,
    torch.ops.ddp_fusion.all_reduce_gradient.default,
    torch.ops.ddp_fusion.all_reduce_bucket.default,
    torch.ops.ddp_fusion.all_reduce_bucket_coalesced.default,
    torch.ops.ddp_fusion.all_reduce_in_place.default,
}


# --- graphs ---------------------------------------------------------------------------


def backward_like(n: int, reduce: Callable[[torch.Tensor, int], torch.Tensor]):
    """A function of one input producing ``n`` gradients one after another, each
    passed through ``reduce``; returns the reduced gradients."""

    def fn(x):
        dh, out = x, []
        for i in range(n):
            dh = dh * 0.5  # backward through a layer
            g = dh + float(i)  # that layer's weight gradient
            out.append(reduce(g, i))
        return out

    return fn


def ours_graph(n: int) -> torch.fx.GraphModule:
    fn = backward_like(n, lambda g, i: ddp_fusion.all_reduce_gradient(g, name=f"p{i}"))
    return make_fx(fn, tracing_mode="fake")(torch.empty(SHAPE))


def ours_kept_graph(n: int) -> torch.fx.GraphModule:
    """The kept-``.grad`` shape: each reduced gradient copied into an existing tensor (a
    graph input), as the compiled backward does where ``.grad`` outlives the step
    (``zero_grad(set_to_none=False)``, accumulation); the pass reduces it in place."""

    def fn(x, *kept):
        dh = x
        for i, out in enumerate(kept):
            dh = dh * 0.5
            out.copy_(ddp_fusion.all_reduce_gradient(dh + float(i), name=f"p{i}"))
        return list(kept)

    return make_fx(fn, tracing_mode="fake")(*(torch.empty(SHAPE) for _ in range(n + 1)))


def ours_sums_graph(n: int) -> torch.fx.GraphModule:
    """The chain, with every second gradient a bias's: a sum over the first dimension,
    kept and viewed away (1-D, 4 KB), which the pass divides inside its sum (scale.py)."""

    def reduce(g: torch.Tensor, i: int) -> torch.Tensor:
        if i % 2:
            g = g.sum(0, keepdim=True).view(-1)
        return ddp_fusion.all_reduce_gradient(g, name=f"p{i}")

    return make_fx(backward_like(n, reduce), tracing_mode="fake")(torch.empty(SHAPE))


GRAPHS = {"chain": ours_graph, "kept": ours_kept_graph, "sums": ours_sums_graph}


def upstream_graph(n: int) -> torch.fx.GraphModule:
    group = dist.group.WORLD
    fn = backward_like(n, lambda g, i: _torch.functional_all_reduce(g / 2, "sum", group))
    gm = make_fx(fn, tracing_mode="fake")(torch.empty(SHAPE))
    _torch.add_tensor_meta(gm)  # upstream reads tensor_meta; make_fx usually sets it
    return gm


def count_collectives(graph: torch.fx.Graph) -> int:
    return sum(1 for node in graph.nodes if node.target in COLLECTIVES)


# --- passes ---------------------------------------------------------------------------


def run_ours(algorithm: str, collector_on: bool = False) -> Callable[[torch.fx.GraphModule], None]:
    fuse = fuse_ddp_allreduces.__wrapped__ if collector_on else fuse_ddp_allreduces  # undecorated: gc left on

    def run(gm):
        fuse(gm.graph, algorithm=algorithm)

    return run


def run_upstream(gm: torch.fx.GraphModule) -> None:
    _torch.upstream_concat_fusion(gm, UPSTREAM_BUCKET_MB)


def measure(label: str, n: int, trace, run_pass, repeats: int) -> dict:
    """Best time of ``run_pass`` over fresh graphs, and the collectives before/after."""
    times, cpu_times = [], []
    for _ in range(repeats):
        gm = trace(n)
        before = count_collectives(gm.graph)
        gc.collect()
        c0, t0 = time.process_time(), time.perf_counter()
        run_pass(gm)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        gm.graph.lint()
        after = count_collectives(gm.graph)
        del gm
        if times[-1] > SLOW_S:
            break
    best = min(range(len(times)), key=times.__getitem__)
    print(
        f"  N={n:5d} {label:<17s} {times[best] * 1e3:10.1f} ms (cpu {cpu_times[best] * 1e3:.1f})  "
        f"runs: {', '.join(f'{t * 1e3:.1f}' for t in times)} ms  "
        f"collectives {before} -> {after}",
        flush=True,
    )
    return {"ms": times[best] * 1e3, "cpu_ms": cpu_times[best] * 1e3,
            "runs_ms": [t * 1e3 for t in times], "runs_cpu_ms": [t * 1e3 for t in cpu_times],
            "collectives_before": before, "collectives_after": after}


def measure_ours(algorithm: str, n: int, trace, repeats: int, also_gc_on: bool) -> dict:
    """Our pass as it runs (the collector paused), and where ``also_gc_on`` with the
    collector on too, the two alternating run by run."""
    if not also_gc_on:
        return {f"ours_{algorithm}": measure(f"ours {algorithm}", n, trace, run_ours(algorithm), repeats)}
    runs: dict[str, list[dict]] = {f"ours_{algorithm}": [], f"ours_{algorithm}_gc_on": []}
    for i in range(repeats):
        for key in sorted(runs, reverse=i % 2 == 1):
            label = key.removeprefix("ours_").replace("_gc_on", " gc on")
            run = run_ours(algorithm, collector_on=key.endswith("gc_on"))
            runs[key].append(measure(f"ours {label}", n, trace, run, 1))
    return {key: min(rs, key=lambda r: r["ms"]) | {"runs_ms": [r["ms"] for r in rs],
                                                   "runs_cpu_ms": [r["cpu_ms"] for r in rs]}
            for key, rs in runs.items()}


# --- report ---------------------------------------------------------------------------


def fmt(value, spec: str) -> str:
    return "skipped" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    head = ("| N | ours concat ms | ours coalesced ms | upstream concat ms "
            "| ours concat µs/grad | collectives after: ours concat / coalesced / upstream |")
    lines = [head, "|" + "---:|" * 6]
    for r in rows:
        up = r["upstream_concat"]
        lines.append(
            f"| {r['n']} | {r['ours_concat']['ms']:.1f} | {r['ours_coalesced']['ms']:.1f} "
            f"| {fmt(up and up['ms'], '.1f')} "
            f"| {r['ours_concat']['ms'] * 1e3 / r['n']:.1f} "
            f"| {r['ours_concat']['collectives_after']} / "
            f"{r['ours_coalesced']['collectives_after']} / "
            f"{fmt(up and up['collectives_after'], 'd')} |"
        )
    return "\n".join(lines)


def growth(rows: list[dict]) -> dict:
    """time(N_max) / time(N_max / 4) per pass, wall and CPU, where both sizes were
    measured (linear: ~4, quadratic: ~16)."""
    by_n = {r["n"]: r for r in rows}
    hi = max(by_n)
    lo = hi // 4
    if lo not in by_n or hi % 4:
        return {}
    ratios: dict = {"from_n": lo, "to_n": hi}
    for key in GROWTH_KEYS:
        a, b = by_n[lo].get(key), by_n[hi].get(key)
        if a and b:
            ratios[key] = {"wall": b["ms"] / a["ms"], "cpu": b["cpu_ms"] / a["cpu_ms"]}
    return ratios


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                        help="comma-separated numbers of gradients")
    parser.add_argument("--quick", action="store_true",
                        help=f"sizes {','.join(map(str, QUICK_SIZES))}")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per measurement, best kept (runs over 10 s: 1)")
    parser.add_argument("--skip-upstream-above", type=int, default=3200, metavar="N",
                        help="do not run upstream's pass for graphs of more than N gradients")
    parser.add_argument("--shape", choices=sorted(GRAPHS), default="chain",
                        help="chain: each gradient a new tensor; kept: each copied into a graph "
                             "input (a kept .grad; upstream's pass is not run on it); sums: the "
                             "chain with every second gradient a bias's, made by a sum")
    parser.add_argument("--collector", choices=("paused", "both"), default="paused",
                        help="both: also time our passes with the garbage collector left on")
    parser.add_argument("--out", default="pass_time.json", help="JSON output (relative: under bench/out/)")
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else tuple(int(s) for s in args.sizes.split(","))

    if not dist.is_initialized():
        dist.init_process_group("fake", store=_torch.fake_store(), rank=0, world_size=2)

    source = provenance(argv)
    load_before = os.getloadavg()
    print(f"torch {torch.__version__}, {source['machine']}, load average {load_before[0]:.2f}; "
          f"{SHAPE[0]}x{SHAPE[1]} fp32 gradients (4 MB), best of {args.repeats}; ddp_fusion at "
          f"{source.get('git_head')} (uncommitted changes: {source.get('uncommitted')})", flush=True)
    # The first call of each pass pays one-time costs (imports, fake-tensor caches, ~1 s);
    # pay them on a small graph so that they are not counted in any measurement.
    run_ours("concat")(ours_graph(8))
    run_ours("coalesced")(ours_graph(8))
    run_ours("concat")(ours_kept_graph(8))
    run_upstream(upstream_graph(8))

    graph = GRAPHS[args.shape]
    rows = []
    for n in sizes:
        row = {"n": n, "upstream_concat": None}
        for algorithm in ("concat", "coalesced"):
            row |= measure_ours(algorithm, n, graph, args.repeats, args.collector == "both")
        if args.shape == "chain" and n <= args.skip_upstream_above:
            row["upstream_concat"] = measure("upstream concat", n, upstream_graph,
                                             run_upstream, args.repeats)
        else:
            why = (f"--skip-upstream-above {args.skip_upstream_above}" if args.shape == "chain"
                   else "not upstream's pattern")
            print(f"  N={n:5d} upstream concat   skipped ({why})", flush=True)
        rows.append(row)

    print()
    print(table(rows))
    ratios = growth(rows)
    if ratios:
        print(f"\ngrowth time(N={ratios['to_n']}) / time(N={ratios['from_n']}) "
              "(linear ~4, quadratic ~16):")
        for key in GROWTH_KEYS:
            if key in ratios:
                print(f"  {key:<22s} wall {ratios[key]['wall']:.1f}, cpu {ratios[key]['cpu']:.1f}")
    load_after = os.getloadavg()
    print(f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f} "
          f"on {os.cpu_count()} CPUs")

    path = write_json(args.out, {
        **source,
        "load_average_1min": {"before": load_before[0], "after": load_after[0]},
        "ddp_fusion_path": os.path.dirname(os.path.abspath(ddp_fusion.__file__)),
        "gradient_shape": list(SHAPE),
        "graph_shape": args.shape,
        "upstream_bucket_mb": UPSTREAM_BUCKET_MB,
        "repeats": args.repeats,
        "rows": rows,
        "growth": ratios,
    })
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
