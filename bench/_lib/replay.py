"""Replaying a profiled step with modelled communication (``bench.cost_model``'s model).

From each rank's profiled step (:func:`bench._lib.profiling.timeline`) the time blocked
on communication is cut out, leaving the mode's own *compute clock*
(:func:`compute_view`); :func:`simulate` replays those clocks with collectives of a
modelled duration run one at a time in issue order (``start_k = max(issue_k on every
rank, end_{k-1})``), a wait holding its rank until its collective ends.
:func:`analyse_job` compares the replay with the measured steps (pure functions).
"""

from __future__ import annotations

import statistics
from typing import Any


def blocked(step: dict[str, Any]) -> list[tuple[float, float]]:
    """Main-thread intervals spent waiting for communication: the wait ops; in modes
    without wait ops (eager DDP and DDPOptimizer wait in C++, with no profiler event),
    the idle gaps after the last issue that start while a collective is in flight. (The
    backend's event of a collective can end milliseconds after the waiting thread
    resumed, when gloo's thread is not scheduled at once on a busy machine.)"""
    if step["waits"]:
        return list(step["waits"])
    if not step["issues"]:
        return []
    last = step["issues"][-1][1]
    ends = [e for _, e, _ in step["colls"]]
    return [(s, e) for s, e in step["gaps"] if s >= last and any(c > s for c in ends)]


def compute_view(step: dict[str, Any]) -> dict[str, Any]:
    """The step on the rank's *compute clock* (wall time minus blocked time): collective
    issue times, their bytes, the sync points (clock, index of the collective waited
    for), and the total compute time."""
    cut = blocked(step)

    def tau(t: float) -> float:
        return t - sum(max(0.0, min(e, t) - s) for s, e in cut)

    issues = step["issues"]
    colls = step["colls"]
    if len(issues) != len(colls):
        raise ValueError(f"{len(issues)} collective issues but {len(colls)} backend collectives")
    k = len(issues)
    syncs: list[tuple[float, int]] = []
    if step["waits"]:
        if len(step["waits"]) == k:  # one wait per collective, in issue order
            syncs = [(tau(s), i) for i, (s, _) in enumerate(step["waits"])]
        else:  # otherwise a wait waits for everything issued before it
            syncs = [(tau(s), max(i for i, (t, _) in enumerate(issues) if t <= s))
                     for s, _ in step["waits"]]
    elif k:
        # eager DDP: finalize_backward waits for every bucket, then copies results out
        last = issues[-1][1]
        cands = [s for s, _ in cut if s >= last] + [t for t in step["copy_out"] if t >= last]
        t_sync = min(cands) if cands else step["phases"]["backward"][1]
        syncs = [(tau(t_sync), k - 1)]
    bwd = step["phases"]["backward"]
    return {"issue": [tau(s) for s, _ in issues], "bytes": [b for _, _, b in colls],
            "syncs": syncs, "total": tau(step["wall_ms"]),
            "blocked_ms": sum(e - s for s, e in cut),
            "backward": (tau(bwd[0]), tau(bwd[1])), "wall_ms": step["wall_ms"],
            "measured_coll_ms": [e - s for s, e, _ in colls]}


def simulate(ranks: list[dict[str, Any]], comm_ms: Any) -> dict[str, Any]:
    """Replay each rank's compute clock with modelled communication on one channel.

    ``comm_ms(nbytes)`` is one collective's duration. Returns per-rank predicted wall
    ends, the collectives' (start, end) and the prediction (max over ranks)."""
    k = len(ranks[0]["issue"])
    if any(len(r["issue"]) != k for r in ranks):
        raise ValueError("ranks issued different numbers of collectives")
    events = []
    for r in ranks:
        ev = [(t, 1, i) for i, t in enumerate(r["issue"])] + [(t, 0, j) for t, j in r["syncs"]]
        events.append(sorted(ev))  # at equal times a sync goes before an issue
    wall = [0.0] * len(ranks)
    clock = [0.0] * len(ranks)
    ptr = [0] * len(ranks)
    ends: list[float] = []
    spans = []

    def advance(r: int, stop_issue: int | None) -> float | None:
        while ptr[r] < len(events[r]):
            t, kind, idx = events[r][ptr[r]]
            wall[r] += t - clock[r]
            clock[r] = t
            ptr[r] += 1
            if kind == 0:
                if idx >= len(ends):
                    raise ValueError("a wait precedes its collective's issue")
                wall[r] = max(wall[r], ends[idx])
            elif idx == stop_issue:
                return wall[r]
        return None

    for i in range(k):
        issued = [advance(r, i) for r in range(len(ranks))]
        start = max([*issued, ends[-1] if ends else 0.0])
        end = start + comm_ms(max(r["bytes"][i] for r in ranks))
        ends.append(end)
        spans.append((start, end))
    for r in range(len(ranks)):
        advance(r, None)
        wall[r] += ranks[r]["total"] - clock[r]
    return {"wall": wall, "pred_ms": max(wall), "spans": spans,
            "comm_ms": sum(e - s for s, e in spans)}


def analyse_job(per_rank: list[dict[str, Any]], fits: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Measured numbers and the model's predictions (one per calibration fit) for one
    (model, mode)."""
    times = [max(ts) for ts in zip(*(r["times_ms"] for r in per_rank))]
    measured = statistics.median(times)
    nsteps = min(len(r["steps"]) for r in per_rank)
    views = [[compute_view(r["steps"][s]) for r in per_rank] for s in range(nsteps)]
    rows = []
    for vs in views:
        wall = max(v["wall_ms"] for v in vs)
        compute = max(v["total"] for v in vs)
        b0, b1 = vs[0]["backward"]
        row = {"profiled_wall_ms": wall, "compute_ms": compute, "exposed_measured_ms": wall - compute,
               "blocked_ms_per_rank": [v["blocked_ms"] for v in vs], "backward_compute_ms": b1 - b0,
               "ready_ms": [t - b0 for t in vs[0]["issue"]],
               "ready_frac": [(t - b0) / (b1 - b0) for t in vs[0]["issue"]],
               "bytes": vs[0]["bytes"], "measured_coll_ms": vs[0]["measured_coll_ms"]}
        for name, f in fits.items():
            sim = simulate(vs, lambda n, f=f: f["alpha_ms"] + f["beta_ms_per_byte"] * n)
            row[f"pred_{name}_ms"] = sim["pred_ms"]
            row[f"exposed_{name}_ms"] = sim["pred_ms"] - compute
            row[f"comm_{name}_ms"] = sim["comm_ms"]
        rows.append(row)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    mid = rows[len(rows) // 2]
    out = {
        "measured_median_ms": measured, "measured_times_ms": times,
        "profiled_wall_ms": med("profiled_wall_ms"), "compute_ms": med("compute_ms"),
        "exposed_measured_ms": med("exposed_measured_ms"),
        "backward_compute_ms": med("backward_compute_ms"),
        "collectives": len(mid["bytes"]), "bucket_bytes": mid["bytes"],
        "ready_ms": mid["ready_ms"], "ready_frac": mid["ready_frac"],
        "measured_coll_ms_sum": statistics.median(sum(r["measured_coll_ms"]) for r in rows),
        "pred": {}, "steps": rows,
        "compute_views": [[{k: v[k] for k in ("issue", "bytes", "syncs", "total")} for v in vs]
                          for vs in views],
    }
    for name in fits:
        pred, comm, exp = med(f"pred_{name}_ms"), med(f"comm_{name}_ms"), med(f"exposed_{name}_ms")
        out["pred"][name] = {
            "pred_ms": pred, "error_pct": 100 * (pred - measured) / measured,
            "error_vs_profiled_pct": 100 * (pred - out["profiled_wall_ms"]) / out["profiled_wall_ms"],
            "exposed_ms": exp, "comm_ms": comm,
            "overlap_pct": 100 * (1 - exp / comm) if comm else None}
    return out
