"""One profiled step per rank on a time line, and its picture (``--link``).

From :func:`bench._lib.profiling.timeline` of a step: the main thread's phases, its
backward compute (the backward phase minus the time blocked on communication and idle
gaps), each bucket collective's issue (the main-thread op that hands it to the backend; drawn
with its length, which should be microseconds),
its transfer (the backend's ``gloo:all_reduce`` span: from when gloo starts it to when it
completes, which on a shaped link is mostly time on the wire) and the waits (compiled
modes' ``wait_tensor``; eager DDP waits in C++ without an event, so its wait is the idle
gap after its last issue while a collective is in flight). ddp_fusion's per-step plan
check (``plan_check_start`` starts the host-side exchange of the plan's hash,
``plan_guard`` collects it) is drawn apart from compute.
"""

from __future__ import annotations

from typing import Any

from bench._lib.replay import blocked

IDLE_MS = 0.2  # main-thread gaps shorter than this count as compute (profiler granularity)


def _minus(span: tuple[float, float], cuts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, (s, e) = [], span
    for a, b in sorted(tuple(c) for c in cuts):
        if b <= s or a >= e:
            continue
        if a > s:
            out.append((s, a))
        s = max(s, b)
    if e > s:
        out.append((s, e))
    return out


def lanes(t: dict[str, Any]) -> dict[str, Any]:
    """What the picture draws of one rank's step (ms from the step's start)."""
    b0, b1 = t["phases"].get("backward", (0.0, 0.0))
    waits = blocked(t)
    idle = [g for g in t["gaps"] if g[1] - g[0] >= IDLE_MS]
    checks = t.get("checks", [])
    issuing = [tuple(i) for i in t["issues"]]
    compute = _minus((b0, b1), waits + idle + issuing + [(s, e) for _, s, e in checks])
    return {"forward": t["phases"].get("forward"), "optimizer": t["phases"].get("optimizer"),
            "backward": (b0, b1), "compute": compute, "waits": waits, "issuing": issuing,
            "issues": [s for s, _ in issuing], "transfers": t["colls"], "checks": checks}


def issue_positions(t: dict[str, Any]) -> list[float]:
    """Each bucket's issue, in % of the backward's compute (time blocked on communication,
    in issue calls, in ddp_fusion's plan check, or idle not counted): 0 = when backward
    starts, 100 = when its compute ends."""
    ln = lanes(t)
    total = sum(e - s for s, e in ln["compute"])
    if total <= 0:
        return []
    return [100 * sum(max(0.0, min(e, x) - s) for s, e in ln["compute"]) / total for x in ln["issues"]]


def waited_ms(t: dict[str, Any]) -> float:
    """Time the main thread was blocked on bucket communication in the step."""
    return sum(e - s for s, e in blocked(t))


def issuing_ms(t: dict[str, Any]) -> float:
    """Time the main thread spent inside the calls that issue bucket collectives (an
    asynchronous issue should take microseconds)."""
    return sum(e - s for s, e in t["issues"])


def plot(traces: dict[str, list[dict[str, Any]]], summary: dict[str, Any], path: str, title: str) -> None:
    """Modes side by side (same time scale), each rank two lanes: the main thread
    (forward, backward compute, waits, optimizer, issue markers) and the link (each
    bucket's transfer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {"forward": "#c7c7c7", "compute": "#1f77b4", "wait": "#d62728", "optimizer": "#7f7f7f",
              "transfer": "#ff7f0e", "issuing": "#000000", "check": "#9467bd"}
    nranks = max(len(r) for r in traces.values())
    end = max(t["wall_ms"] for ranks in traces.values() for t in ranks)
    fig, axes = plt.subplots(1, len(traces), figsize=(7.5 * len(traces), 1.2 + 1.6 * nranks),
                             sharex=True, squeeze=False)
    for ax, (mode, ranks) in zip(axes[0], traces.items()):
        ticks, labels = [], []
        for r, t in enumerate(ranks):
            ln = lanes(t)
            y_main, y_link = 3 * (nranks - 1 - r) + 1.2, 3 * (nranks - 1 - r)
            bars = [(ln["forward"], "forward"), (ln["optimizer"], "optimizer")]
            for span, kind in bars:
                if span:
                    ax.broken_barh([(span[0], span[1] - span[0])], (y_main, 0.8), color=colors[kind])
            ax.broken_barh([(s, e - s) for s, e in ln["compute"]], (y_main, 0.8), color=colors["compute"])
            ax.broken_barh([(s, e - s) for s, e in ln["waits"]], (y_main, 0.8), color=colors["wait"])
            ax.broken_barh([(s, e - s) for s, e in ln["issuing"]], (y_main, 0.8), color=colors["issuing"])
            ax.broken_barh([(s, e - s) for _, s, e in ln["checks"]], (y_main, 0.8), color=colors["check"])
            for i, x in enumerate(ln["issues"]):
                ax.plot([x], [y_main + 0.95], marker="v", color="black", markersize=6)
                ax.annotate(f"b{i}", (x, y_main + 1.05), ha="center", fontsize=7)
            for i, (s, e, n) in enumerate(ln["transfers"]):
                ax.broken_barh([(s, e - s)], (y_link + 0.1 + 0.35 * (i % 2), 0.35), color=colors["transfer"],
                               edgecolor="black", linewidth=0.5)
                label = f"b{i}" + (f" {n / 1e6:.1f} MB" if n else "")
                narrow = e - s < 0.08 * end  # the label beside the bar, not across it
                x = e + 0.005 * end if narrow else (s + e) / 2
                ax.annotate(label, (x, y_link + 0.27 + 0.35 * (i % 2)), ha="left" if narrow else "center",
                            va="center", fontsize=7)
            ticks += [y_main + 0.4, y_link + 0.45]
            labels += [f"rank {r} main thread\n(waited {waited_ms(t):.1f} ms)", f"rank {r} link (gloo)"]
        row = summary["rows"].get(mode, {})
        hidden = f", hidden {100 * row['hidden']:.0f}%" if "hidden" in row else ""
        step = f"median step {row['median_ms']:.1f} ms" if "median_ms" in row else "no timing"
        ax.set_title(f"{mode}: {step}{hidden}", fontsize=10)
        ax.set_yticks(ticks)
        ax.set_yticklabels(labels, fontsize=8)
        ax.set_xlim(0, end * 1.02)
        ax.set_ylim(-0.2, 3 * nranks)
        ax.set_xlabel("ms from the step's start (this rank's clock)")
    names = {"forward": "forward", "compute": "backward compute", "wait": "wait", "optimizer": "optimizer",
             "transfer": "transfer", "issuing": "in the issue call", "check": "ddp_fusion plan check"}
    handles = [Patch(color=colors[k], label=label) for k, label in names.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(title + "; \u25bc = bucket issued", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
