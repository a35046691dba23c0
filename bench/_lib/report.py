"""Tables and plots of ``bench.step_time``'s job records (:func:`bench._lib.jobs.records`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench._lib.modes import AOT_FLOOR, CA_FLOOR, COMM_FLOOR, EAGER_FLOOR, FLOORS, all_modes

SWEEP_MODES = ("eager_ddp", "ddp_fusion_concat", "ddp_fusion_coalesced")


def _rows(model: str, jobs: dict[str, dict[str, Any]], cap: Any) -> list[dict[str, Any]]:
    return [j for j in jobs.values() if j["model"] == model and (j["cap"] == cap or j["mode"] in FLOORS)]


def fmt_collectives(c: dict[str, int]) -> str:
    if not c:
        return "0"
    main = sum(v for k, v in c.items() if k.endswith(":all_reduce"))
    rest = {k.split(":", 1)[1]: v for k, v in c.items() if not k.endswith(":all_reduce")}
    s = str(main)
    if rest:
        s += " + " + ", ".join(f"{v} {k}" for k, v in sorted(rest.items()))
    return s


def step_table(model: str, jobs: dict[str, dict[str, Any]], cap: Any) -> tuple[str, dict[str, Any]]:
    """Step time per mode for one model at one cap (floors are cap-independent); lower
    bound = max(compute_only, comm_only), efficiency = bound / median."""
    rows = _rows(model, jobs, cap)
    floors = {j["mode"]: j.get("median_ms") for j in rows if j["mode"] in FLOORS}
    bound = None
    if floors.get(AOT_FLOOR) is not None and floors.get(COMM_FLOOR) is not None:
        bound = max(floors[AOT_FLOOR], floors[COMM_FLOOR])
    eager = next((j.get("median_ms") for j in rows if j["mode"] == "eager_ddp"), None)
    head = (f"{'mode':<38}{'median ms':>10}{'p10-p90 ms':>16}{'min-max ms':>16}{'eff.':>6}"
            f"{'x eager':>8}{'all-reduces/step':>22}{'compile s':>10}{'max |dp| vs ref':>19}")
    lines = [head, "-" * len(head)]
    summary: dict[str, Any] = {"bound_ms": bound, "floors": floors, "rows": {}}
    for j in rows:
        name = j["mode"]
        if "median_ms" not in j:
            lines.append(f"{name:<38}failed: {j.get('failed', 'no result')}")
            summary["rows"][name] = {"failed": j.get("failed", "no result")}
            continue
        eff = bound / j["median_ms"] if bound else None
        rel = j["median_ms"] / eager if eager else None
        diff = j.get("max_param_diff")
        recomp = any(v for rc in j["recompiles_during_timing"] for v in rc.values())
        unfused = sum(v for c in j.get("counters", []) for k, v in c["ddp_fusion"].items()
                      if k.startswith("unfused"))
        idle = compiled_nothing(j)
        lines.append(
            f"{name:<38}{j['median_ms']:>10.2f}{j['p10_ms']:>8.2f}-{j['p90_ms']:<7.2f}"
            f"{j['min_ms']:>8.2f}-{j['max_ms']:<7.2f}"
            f"{(f'{eff:.2f}' if eff else '-'):>6}{(f'{rel:.2f}' if rel else '-'):>8}"
            f"{fmt_collectives(j.get('collectives', {})):>22}{j.get('compile_s', float('nan')):>10.1f}"
            f"{(f'{diff:.2e}' if diff is not None else 'n/a'):>19}"
            + ("  (recompiled while timed!)" if recomp else "")
            + (f"  ({unfused} ddp_fusion unfused events!)" if unfused else "")
            + ("  (compiled nothing: no Dynamo graph, it ran eagerly!)" if idle else "")
            + (f"  (failed later: {j['failed']})" if j.get("failed") else ""))
        summary["rows"][name] = {"median_ms": j["median_ms"], "efficiency": eff, "x_eager": rel}
    if bound:
        lines.append(f"lower bound = max({AOT_FLOOR}, {COMM_FLOOR}) = {bound:.2f} ms")
    return "\n".join(lines), summary


def compiled_nothing(job: dict[str, Any]) -> bool:
    """Whether a compiled mode's job made no Dynamo graph on any rank: it ran eagerly
    (``torch.compile`` of torch DDP around a module of torch's own, an ``nn.Sequential``,
    compiles nothing on torch 2.13: Dynamo breaks in DDP's forward and skips torch's
    modules). False where the counters were not recorded."""
    mode = all_modes().get(job["mode"])
    counters = job.get("counters") or []
    if mode is None or not mode.compiled or not counters:
        return False
    return all(not c.get("stats", {}).get("unique_graphs") for c in counters)


def own_floor(mode: str) -> str:
    """The compute floor a mode's data-parallel work adds to: eager DDP's is the eager
    model, DDPOptimizer's the compiled one, every compiled-autograd mode's (ddp_fusion,
    upstream's) the compiled model under compiled autograd."""
    if mode.startswith("eager_ddp"):
        return EAGER_FLOOR
    return AOT_FLOOR if mode == "ddp_optimizer" else CA_FLOOR


def host_table(model: str, jobs: dict[str, dict[str, Any]], cap: Any, num_tensors: int) -> str | None:
    """Each mode's median step over its own compute floor (its data-parallel cost: on a
    host-bound model, host time), that cost per parameter and per bucket (all-reduce of
    the profiled step), and the same over the compiled-autograd floor, the lowest
    compiled one (so that modes of different floors compare on one scale). None where
    no floor was run."""
    rows = _rows(model, jobs, cap)
    floors = {j["mode"]: j["median_ms"] for j in rows if j["mode"] in FLOORS and "median_ms" in j}
    if not floors:
        return None
    head = (f"{'mode':<38}{'over floor ms':>14}  {'floor':<27}{'us/parameter':>13}{'us/bucket':>11}"
            f"{'over CA floor ms':>18}{'us/parameter':>13}")
    lines = [head, "-" * len(head)]
    for j in rows:
        floor = own_floor(j["mode"])
        if j["mode"] in FLOORS or "median_ms" not in j or floor not in floors:
            continue
        over = j["median_ms"] - floors[floor]
        buckets = sum(j.get("collectives", {}).values())
        per_param = f"{over * 1e3 / num_tensors:.1f}"
        per_bucket = f"{over * 1e3 / buckets:.0f}" if buckets else "-"
        over_ca = per_param_ca = ""
        if CA_FLOOR in floors:
            ca = j["median_ms"] - floors[CA_FLOOR]
            over_ca, per_param_ca = f"{ca:.2f}", f"{ca * 1e3 / num_tensors:.1f}"
        lines.append(f"{j['mode']:<38}{over:>14.2f}  {floor:<27}{per_param:>13}{per_bucket:>11}"
                     f"{over_ca:>18}{per_param_ca:>13}")
    return "\n".join(lines)


def cpu_table(model: str, jobs: dict[str, dict[str, Any]], cap: Any) -> str | None:
    """Each mode's host CPU time per step (medians over steps of the mean over ranks):
    every thread of a rank's process (main, Inductor's, gloo's, ddp_fusion's host
    group), the main thread, and the difference; and the all-threads time over the
    mode's own floor where that was run. CPU time, unlike the step's wall time, does not
    count time a rank spends waiting (for its peer, or descheduled by the machine), so
    it separates host work from waiting. None where no step recorded it."""
    rows = [j for j in _rows(model, jobs, cap) if j.get("cpu_ms_median") is not None]
    if not rows:
        return None
    floors = {j["mode"]: j["cpu_ms_median"] for j in rows if j["mode"] in FLOORS}
    head = (f"{'mode':<38}{'CPU ms, all threads':>20}{'main thread':>13}{'other threads':>15}"
            f"{'over floor':>12}")
    lines = [head, "-" * len(head)]
    for j in rows:
        cpu, main = j["cpu_ms_median"], j["main_cpu_ms_median"]
        floor = floors.get(own_floor(j["mode"])) if j["mode"] not in FLOORS else None
        over = f"{cpu - floor:.2f}" if floor is not None else "-"
        lines.append(f"{j['mode']:<38}{cpu:>20.2f}{main:>13.2f}{cpu - main:>15.2f}{over:>12}")
    return "\n".join(lines)


def bytes_table(model: str, jobs: dict[str, dict[str, Any]], cap: Any, device: str) -> str:
    """Collectives, bytes and memory per step (rank 0; one profiled step; MB = 1e6 bytes).

    * on wire: bytes handed to the backend's all-reduces (with a comm hook, its
      ``dist.all_reduce`` calls from any thread);
    * copy in / copy back: in the lowered backward graph (compiled modes), bytes written
      by ``cat`` nodes feeding a collective (the copy into a fused bucket; an upper
      bound), and by ``copy_`` nodes whose source is a collective's result;
    * copies/grad (compiled modes): copies per fused gradient in the lowered graph, in
      and back (``profiling.graph_stats``: an extern kernel's output is copied into
      its bucket, a generated kernel's is written there);
    * eager copies: ``aten::copy_`` / ``aten::cat`` calls not inside another aten op
      (torch DDP's reducer, gloo flattening a coalesced all-reduce);
    * held: bytes kept between steps; peak: held + the most allocated during the step
      (torch's profiler, this thread); peak, RSS (CPU): held + the rise of the resident
      set, which sees every thread, median of 5 more steps (``profiling.rss_rise``).
    """
    cuda = device == "cuda"
    rss = any("rss_peak_bytes" in j["profile"][0] for j in _rows(model, jobs, cap) if "profile" in j)
    head = (f"{'mode':<38}{'all-reduces':>12}{'MB on wire':>12}{'MB copy in':>11}{'MB copy back':>13}"
            f"{'copies/grad':>12}{'MB eager copies':>17}{'held MB':>9}{'peak MB':>9}"
            + (f"{'kernels':>9}" if cuda else "")
            + (f"{'peak MB, RSS':>13}" if rss else ""))
    lines = [head, "-" * len(head)]
    for j in _rows(model, jobs, cap):
        if "profile" not in j:
            continue
        prof = j["profile"][0]
        graph = prof.get("graph")
        n, wire = sum(prof["collectives"].values()), prof["bytes_reduced"]
        if prof.get("python_all_reduces"):  # a comm hook's: all of them, from any thread
            n = prof["python_all_reduces"] + sum(v for k, v in prof["collectives"].items()
                                                 if not k.endswith("all_reduce"))
            wire = prof["python_bytes"]
        copy_in = f"{graph['fusion_copy_bytes'] / 1e6:.2f}" if graph else "-"
        copy_back = f"{graph['copy_back_bytes'] / 1e6:.2f}" if graph else "-"
        per_grad = (f"{graph['grad_copies'] / graph['grads']:.2f}" if graph and graph.get("grads")
                    else "-")
        lines.append(
            f"{j['mode']:<38}{n:>12}{wire / 1e6:>12.2f}{copy_in:>11}{copy_back:>13}{per_grad:>12}"
            f"{prof['copy_bytes'] / 1e6:>17.2f}{prof['held_bytes'] / 1e6:>9.1f}"
            f"{prof['peak_bytes'] / 1e6:>9.1f}"
            + (f"{prof.get('kernels', 0):>9}" if cuda else "")
            + (f"{prof['rss_peak_bytes'] / 1e6:>13.1f}" if "rss_peak_bytes" in prof else ""))
    return "\n".join(lines)


def plot_sweep(jobs: dict[str, dict[str, Any]], models: list[str], caps: list[float], path: str,
               title: Callable[[str], str]) -> None:
    """Step time against bucket cap per model, with the floors as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for mode in SWEEP_MODES:
            pts = [(cap, jobs.get(f"{model}|{mode}|{cap}")) for cap in caps]
            pts = [(cap, j) for cap, j in pts if j and "median_ms" in j]
            if pts:
                ax.errorbar([c for c, _ in pts], [j["median_ms"] for _, j in pts],
                            yerr=[[j["median_ms"] - j["p10_ms"] for _, j in pts],
                                  [j["p90_ms"] - j["median_ms"] for _, j in pts]],
                            marker="o", capsize=3, label=mode)
        for floor, style in zip((AOT_FLOOR, COMM_FLOOR), (":", "--")):
            j = jobs.get(f"{model}|{floor}|None")
            if j and "median_ms" in j:
                ax.axhline(j["median_ms"], linestyle=style, color="gray", label=floor)
        ax.set_xscale("log")
        ax.set_xticks(caps)
        ax.set_xticklabels([f"{c:g}" for c in caps])
        ax.set_xlabel("bucket_cap_mb")
        ax.set_ylabel("step time, median ms (bars: p10-p90)")
        ax.set_title(title(model))
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
