"""The shaped-link benchmark (``python -m bench.step_time --link RATE[,RATE...]``).

On this machine gloo reduces on the same 2 cores that run backward, so communication
cannot overlap compute. Here the ranks run in a private network namespace whose loopback
is shaped by ``tc``'s token bucket filter: a collective then waits on the wire, not on
the CPU, as NCCL does on a real network, and overlap can be seen.

How it runs: the command checks that it can (:func:`check`: ``unshare``, ``ip``, ``tc``
found; ``unshare -n``, ``ip link set lo up`` and a ``tbf`` qdisc allowed), then re-runs
itself (:func:`run_inside`) as::

    unshare -n sh -c 'ip link set lo up && tc qdisc add dev lo root tbf rate <R> burst 256kb
        latency 200ms && exec python -m bench.step_time <same args> --_inside-link'

so the ranks it spawns inherit the namespace. Inside (:func:`main`), per model, every job
(the modes and the floors) is compiled once; then for each rate the loopback's rate is
changed (``tc qdisc change``) and all jobs are timed round-robin, and one step per rank
of each job is profiled for the time line. A ``bucket_cap_mb="auto"`` job, which sizes its
buckets for the link it measures at its first compiled step, is started and compiled
again at each rate. The rate is that of the one loopback queue
that all ranks' traffic crosses: a 2-rank ring all-reduce of n bytes puts 2n bytes on it.

Reported per model and rate: the compute floors (eager; AOT-compiled, ``torch.compile``;
compiled-autograd compiled: the model alone, no communication), the communication floor
(the gradient bytes in DDP-bucket-sized all-reduces issued back to back), each mode's
median step with its p10-p90 spread, and hidden communication::

    hidden = 1 - (step - own compute floor) / communication floor

(own floor: eager modes the eager floor, DDPOptimizer the AOT floor, compiled-autograd
modes the compiled-autograd floor; with ``--bucket-cap-mb`` the modes and the
communication floor use that cap; 100 % = all communication hidden under compute, 0 % =
none, below 0 = the step costs more than compute + communication back to back). For
``mlp_tp`` (DP=2 x TP=2 on 4 ranks) the compute floors hold the model's TP all-reduces,
which cross the shaped link too, and the communication floor only the DP gradients: the
hidden share is that of the data-parallel communication. A picture per model and rate
draws one step per rank of eager DDP and ddp_fusion side by side
(bench/_lib/timeline.py).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from typing import Any

from bench._lib import jobs as jobs_lib
from bench._lib import step, timeline
from bench._lib.models import world_size
from bench._lib.modes import AOT_FLOOR, CA_FLOOR, COMM_FLOOR, EAGER_FLOOR, FLOORS, all_modes
from bench._lib.record import RESULTS_DIR, out_path, spread, write_json

MODELS = ["mlp", "gpt", "hf_gpt2"]
MODES = ["eager_ddp", "eager_ddp_grad_view", "ddp_optimizer", "upstream_python_reducer_concat",
         "ddp_fusion_concat", "ddp_fusion_coalesced"]
RATES = ["1gbit", "2gbit", "4gbit", "8gbit"]
TIMELINE_MODES = ("eager_ddp", "ddp_fusion_concat")
TBF = "burst 256kb latency 200ms"
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_PARENT_NETNS = "BENCH_LINK_PARENT_NETNS"  # set by run_inside: the namespace it left


def parse_rates(text: str) -> list[str]:
    """``"1gbit,4gbit"`` -> ``["1gbit", "4gbit"]``; ValueError naming a bad rate."""
    rates = [r.strip().lower() for r in text.split(",") if r.strip()]
    bad = [r for r in rates if not _RATE.match(r)]
    if bad or not rates:
        raise ValueError(f"a rate is a number and tc's unit kbit, mbit or gbit (4gbit), got {bad or text!r}")
    return rates


def rate_bytes_per_s(rate: str) -> float:
    m = _RATE.match(rate)
    assert m is not None
    return float(m.group(1)) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)] / 8


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def check() -> str | None:
    """None if a private network namespace with a ``tbf``-shaped loopback can be made
    here; else what was refused."""
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (f"{', '.join(missing)} not found (unshare is in util-linux; ip and tc in iproute2: "
                "apt-get install iproute2)")
    steps = [("unshare -n (a private network namespace; needs root or CAP_SYS_ADMIN)", "true"),
             ("ip link set lo up (inside the namespace)", "ip link set lo up"),
             (f"tc qdisc add dev lo root tbf rate 1gbit {TBF} (inside the namespace)",
              f"ip link set lo up && tc qdisc add dev lo root tbf rate 1gbit {TBF}")]
    for what, script in steps:
        try:
            res = _run(["unshare", "-n", "sh", "-c", script])
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{what}: {e}"
        if res.returncode != 0:
            return f"{what} was refused: {(res.stderr or res.stdout).strip() or f'exit {res.returncode}'}"
    return None


def run_inside(argv: list[str], rate: str) -> int:
    """Re-run ``python -m bench.step_time <argv> --_inside-link`` in a private network
    namespace whose loopback is shaped to ``rate``; its exit status (2 if refused)."""
    refused = check()
    if refused is not None:
        print(f"bench.step_time --link: cannot shape a link here: {refused}.\n"
              "Run as root on a machine with unshare and tc (iproute2), or run without --link "
              "(e.g. python -m bench.step_time --model mlp) for the unshaped CPU benchmark.",
              file=sys.stderr)
        return 2
    inner = shlex.join([sys.executable, "-m", "bench.step_time", *argv, "--_inside-link"])
    script = f"ip link set lo up && tc qdisc add dev lo root tbf rate {rate} {TBF} && exec {inner}"
    env = {**os.environ, _PARENT_NETNS: _netns(), "GLOO_SOCKET_IFNAME": "lo"}
    return subprocess.run(["unshare", "-n", "sh", "-c", script], env=env).returncode


def _netns() -> str:
    return os.readlink("/proc/self/ns/net")


def inside() -> bool:
    """Whether this process runs in the namespace :func:`run_inside` made (so changing
    the loopback's qdisc cannot touch the machine's own)."""
    parent = os.environ.get(_PARENT_NETNS)
    return parent is not None and parent != _netns()


def set_rate(rate: str) -> None:
    if not inside():
        raise RuntimeError("set_rate outside the benchmark's network namespace")
    res = _run(["tc", "qdisc", "change", "dev", "lo", "root", "tbf", "rate", rate, *TBF.split()])
    if res.returncode != 0:
        raise RuntimeError(f"tc qdisc change ... rate {rate}: {res.stderr.strip()}")


# --------------------------------------------------------------------------- the run


FLOOR_NAMES = {EAGER_FLOOR: "eager", AOT_FLOOR: "AOT", CA_FLOOR: "compiled autograd"}


def own_floor(mode: str) -> str:
    return all_modes()[mode].floor


TRACED_STEPS = 3


def _trace(job: jobs_lib.Job) -> list[dict[str, Any]]:
    """One step per rank as a time line: of :data:`TRACED_STEPS` profiled steps, the one
    of median length (the longer rank's), so that one slow step on a shared machine is
    not the one drawn; the collectives' bytes from another step with shapes recorded
    (recording shapes slows eager steps)."""
    sized = job.run(step.trace, True)
    steps = sorted((job.run(step.trace, False) for _ in range(TRACED_STEPS)),
                   key=lambda ranks: max(t["wall_ms"] for t in ranks))
    plain = steps[len(steps) // 2]
    for s, p in zip(sized, plain):
        if len(s["colls"]) == len(p["colls"]):
            p["colls"] = [(a, b, n) for (a, b, _), (_, _, n) in zip(p["colls"], s["colls"])]
    return plain


def run_model(model: str, modes: list[str], cap: float | None, rates: list[str], rounds: int, steps: int,
              warmup: int, set_to_none: bool, pg_timeout: float, log: jobs_lib.Log) -> dict[str, Any]:
    """Compile every job once, then per rate: set the rate, time round-robin, trace. The
    communication floor reduces the buckets of ``cap``, as the modes do."""
    jobs = [jobs_lib.Job(model, m, cap if m not in FLOORS or m == COMM_FLOOR else None, "cpu", set_to_none,
                         pg_timeout) for m in modes]
    try:
        set_rate(rates[0])  # the link "auto" jobs measure as they compile, not the last model's
        jobs_lib.start_jobs(jobs, warmup, log)
        for i, rate in enumerate(rates):
            set_rate(rate)
            log(f"{model}: link {rate}")
            if i > 0:  # bucket_cap_mb="auto" decides on the link it meets: a fresh job here
                for k, job in enumerate(jobs):
                    if all_modes()[job.mode].sized_for_link and not job.failed:
                        job.stop()
                        jobs[k] = jobs_lib.Job(job.model, job.mode, job.cap, "cpu", set_to_none, pg_timeout)
                        jobs[k].rec = job.rec
                        jobs_lib.start_jobs([jobs[k]], warmup, log)
            jobs_lib.time_round_robin(jobs, rounds, steps, log, rec_key=rate)
            for job in jobs:
                if not job.failed and job.mode not in (EAGER_FLOOR, AOT_FLOOR, CA_FLOOR):
                    try:
                        job.rec[rate]["trace"] = _trace(job)
                    except jobs_lib.JobError as e:
                        log(f"{job.key}: FAILED during trace: {e}")
                        job.stop()
    finally:
        for job in jobs:
            job.stop()
    out = {}
    for job in jobs:
        rec = {k: v for k, v in job.rec.items() if k in ("mode", "compile_s")}
        if job.failed:
            rec["failed"], rec["traceback"] = job.failed, job.traceback
        for rate in rates:
            r = job.rec.get(rate)
            if r and r["times_ms"]:
                rec[rate] = {**r, **spread(r["times_ms"])}
        out[job.mode] = rec
    return out


def summarise(res: dict[str, Any], rates: list[str]) -> dict[str, Any]:
    """Per rate: the floors' medians, and per mode its median, spread, own floor,
    exposed time (step - own floor), hidden fraction and bucket issue positions."""
    out: dict[str, Any] = {}
    for rate in rates:
        floors = {f: res.get(f, {}).get(rate, {}).get("median_ms") for f in FLOORS}
        rows = {}
        for mode, rec in res.items():
            r = rec.get(rate)
            if mode in FLOORS or not r:
                continue
            floor, comm = floors.get(own_floor(mode)), floors[COMM_FLOOR]
            row = {k: r[k] for k in ("median_ms", "p10_ms", "p90_ms")}
            row["own_floor"] = own_floor(mode)
            if floor is not None:
                row["exposed_ms"] = r["median_ms"] - floor
                if comm:
                    row["hidden"] = 1 - row["exposed_ms"] / comm
            if "trace" in r:
                row["issued_pct"] = [timeline.issue_positions(t) for t in r["trace"]]
                row["waited_ms"] = [timeline.waited_ms(t) for t in r["trace"]]
                row["issuing_ms"] = [timeline.issuing_ms(t) for t in r["trace"]]
            rows[mode] = row
        out[rate] = {"floors": floors, "rows": rows}
    return out


def table(model: str, summary: dict[str, Any], res: dict[str, Any]) -> str:
    lines = []
    for rate, s in summary.items():
        f = s["floors"]

        def ms(x: float | None) -> str:
            return "failed" if x is None else f"{x:.1f} ms"

        mbs = rate_bytes_per_s(rate) / 1e6
        lines.append(f"-- {model}, link {rate} ({mbs:.0f} MB/s, shared by all ranks' traffic) --")
        lines.append(f"floors: compute eager {ms(f[EAGER_FLOOR])}, AOT-compiled {ms(f[AOT_FLOOR])}, "
                     f"compiled autograd {ms(f[CA_FLOOR])}; communication {ms(f[COMM_FLOOR])}")
        head = (f"{'mode':<32}{'own floor ms':>24}{'step ms':>9}{'p10-p90 ms':>15}{'exposed':>9}{'hidden':>8}"
                f"{'waited ms':>12}{'issuing ms':>12}  buckets issued at % of backward")
        lines += [head, "-" * (len(head) + 10)]
        for mode, rec in res.items():
            if mode in FLOORS:
                continue
            row = s["rows"].get(mode)
            if row is None:
                lines.append(f"{mode:<34}failed: {rec.get('failed', 'no result')}")
                continue
            floor = f"{FLOOR_NAMES[row['own_floor']]} {f[row['own_floor']] or float('nan'):.1f}"
            hidden = f"{100 * row['hidden']:.0f}%" if "hidden" in row else "-"
            exposed = f"{row['exposed_ms']:.1f}" if "exposed_ms" in row else "-"
            waited = "/".join(f"{w:.1f}" for w in row.get("waited_ms", [])) or "-"
            issuing = "/".join(f"{w:.1f}" for w in row.get("issuing_ms", [])) or "-"
            issued = " / ".join(", ".join(f"{p:.0f}" for p in rank) for rank in row.get("issued_pct", []))
            lines.append(f"{mode:<32}{floor:>24}{row['median_ms']:>9.1f}{row['p10_ms']:>7.1f}-{row['p90_ms']:<7.1f}"
                         f"{exposed:>9}{hidden:>8} {waited:>11} {issuing:>11}  {issued}")
        lines.append("exposed = step - own floor; hidden = 1 - exposed / communication floor; in the "
                     "profiled step, per rank (0/1/...): waited = main thread blocked on buckets, issuing = "
                     "in the calls that issue them; issue positions: rank 0 / rank 1 / ...")
    return "\n".join(lines)


def hidden_table(model: str, summary: dict[str, Any]) -> str:
    """Hidden communication per mode (rows) and rate (columns)."""
    rates = list(summary)
    modes = list(dict.fromkeys(m for s in summary.values() for m in s["rows"]))
    head = f"{'hidden communication, ' + model:<40}" + "".join(f"{r:>9}" for r in rates)
    lines = [head, "-" * len(head)]
    for mode in modes:
        cells = []
        for r in rates:
            row = summary[r]["rows"].get(mode, {})
            cells.append(f"{100 * row['hidden']:.0f}%" if "hidden" in row else "-")
        lines.append(f"{mode:<40}" + "".join(f"{c:>9}" for c in cells))
    comm = [summary[r]["floors"][COMM_FLOOR] for r in rates]
    lines.append(f"{'(communication floor, ms)':<40}" + "".join(
        f"{c:>9.1f}" if c is not None else f"{'-':>9}" for c in comm))
    return "\n".join(lines)


def main(args: argparse.Namespace, models: list[str], rounds: int, steps: int, meta: dict[str, Any]) -> None:
    """The run inside the namespace: per model, jobs compiled once and timed per rate."""
    if not inside():
        sys.exit("bench.step_time --_inside-link: not in the namespace that --link makes; run with --link")
    modes = args.modes.split(",") if args.modes else list(MODES)
    modes = [m for m in modes if m not in FLOORS] + list(FLOORS)
    meta.update(link={"rates": args.rates, "tbf": TBF, "netns": _netns(),
                      "note": "one loopback queue shared by all ranks' traffic"}, modes=modes,
                bucket_cap_mb=args.bucket_cap_mb)
    ranks = " or ".join(str(w) for w in meta["world_size"])
    print(f"bench.step_time --link: torch {meta['torch']}, {meta['machine']}; {ranks} gloo ranks x 1 "
          f"thread in a private network namespace, loopback tbf {TBF} at {', '.join(args.rates)}; each job: "
          f"{args.warmup} warm-up steps, then per rate {rounds} rounds x {steps} timed steps "
          "(round-robin), 1 profiled step per rank", flush=True)
    log = jobs_lib.Log()
    t0 = time.perf_counter()
    result: dict[str, Any] = {"meta": meta, "models": {}}
    for model in models:
        print(f"\n{model}: compiling {len(modes)} jobs one after another, then timing them at each rate",
              flush=True)
        res = run_model(model, modes, args.bucket_cap_mb, args.rates, rounds, steps, args.warmup,
                        args.zero_grad == "none", args.pg_timeout, log)
        summary = summarise(res, args.rates)
        text, hidden = table(model, summary, res), hidden_table(model, summary)
        print(f"\n== {model}: {meta['models'][model]} ==\n{text}\n\n{hidden}", flush=True)
        pictures = {}
        for rate in args.rates:
            traces = {m: res[m][rate]["trace"] for m in TIMELINE_MODES
                      if "trace" in res.get(m, {}).get(rate, {})}
            if len(traces) == len(TIMELINE_MODES):
                path = out_path(f"step_time_link{_tag(meta)}_timeline_{model}_{rate}.png")
                title = (f"{model}, link {rate}: one step per rank (torch {meta['torch']}, "
                         f"{world_size(model)} gloo ranks)")
                timeline.plot(traces, summary[rate], path, title)
                pictures[rate] = path
                print(f"wrote {path}")
        result["models"][model] = {"jobs": res, "summary": summary, "table": text, "hidden_table": hidden,
                                   "timelines": pictures, "desc": meta["models"][model]}
        per_model = {"meta": meta, **result["models"][model]}
        path = write_json(f"step_time_link{_tag(meta)}_{model}.json", per_model)
        print(f"wrote {path}")
    meta["wall_s"] = time.perf_counter() - t0
    print(f"\nwall time {meta['wall_s']:.0f} s")
    print(f"wrote {write_json(f'step_time_link{_tag(meta)}.json', result)}")
    draft, files = write_draft(result)
    print(f"wrote {draft}: a draft results file. Check it, say what else was running, then file it:")
    for src, dst in files.items():
        print(f"  cp {os.path.relpath(src)} {os.path.relpath(dst)}")


def write_draft(result: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """``bench/out/step_time_link.md``: the run's provenance, command, tables and
    pictures, in the form of a results file (``bench/results/link_cpu_<date>.md``, its
    pictures ``link_timeline_<model>_<rate>_cpu_<date>.png`` beside it). Returns its path
    and where it and its pictures would be filed."""
    meta = result["meta"]
    date = meta["date"][:10]
    files = {}
    rates = ", ".join(meta["link"]["rates"])
    cap = meta["bucket_cap_mb"]
    caps = "torch default (1 MiB first, then 25 MiB)" if cap is None else f"bucket_cap_mb={cap:g}"
    lines = [f"# Shaped-link step time and hidden communication, CPU, {meta['date'][:10]}", "",
             f"* Command: `{meta['command'].replace(' --_inside-link', '')}`",
             f"* Code: commit {meta.get('git_head')} (uncommitted changes: {meta.get('uncommitted')})",
             f"* torch {meta['torch']}, Python {meta['python']}; {meta['machine']}",
             f"* Load average at the start: {', '.join(f'{x:.2f}' for x in meta['load_average'])}; "
             "what else was running: (fill in)",
             f"* Link: a private network namespace, loopback `tbf {TBF}` at {rates}, "
             "one queue shared by all ranks' traffic (a 2-rank all-reduce of n bytes puts 2n bytes on it)",
             f"* Buckets: {caps}",
             f"* {' or '.join(str(w) for w in meta['world_size'])} gloo ranks x 1 thread; "
             f"{meta['warmup_steps']} warm-up steps; per rate {meta['rounds']} "
             f"rounds x {meta['timed_steps_per_round']} timed steps per job, round-robin; step time = max "
             "over ranks",
             "", "hidden = 1 - (step - own compute floor) / communication floor; own floor: eager modes the "
             "eager model, DDPOptimizer the AOT-compiled model, compiled-autograd modes the model compiled "
             "with compiled autograd; communication floor: the gradient bytes in DDP-bucket-sized "
             "all-reduces back to back.", ""]
    for model, m in result["models"].items():
        lines += [f"## {model}: {m['desc']}", "", "```", m["hidden_table"], "", m["table"], "```", ""]
        for rate, path in m["timelines"].items():
            name = f"link{_tag(meta)}_timeline_{model}_{rate}_cpu_{date}.png"
            files[path] = os.path.join(RESULTS_DIR, name)
            lines.append(f"![{model}, {rate}]({name})")
        lines.append("")
    path = out_path(f"step_time_link{_tag(meta)}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path, {path: os.path.join(RESULTS_DIR, f"link{_tag(meta)}_cpu_{date}.md"), **files}


def _tag(meta: dict[str, Any]) -> str:
    """File-name part for a bucket cap other than torch's default."""
    cap = meta.get("bucket_cap_mb")
    return "" if cap is None else f"_cap{cap:g}"
