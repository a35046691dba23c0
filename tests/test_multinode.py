"""Many nodes: examples/multinode_torchrun.py launched as on two nodes, by two torchrun
agents on this machine (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on a free
localhost port, the same command for both, as on real nodes: the rendezvous numbers
them), gloo on CPU. So the second node's ranks have RANK 2 and 3 but LOCAL_RANK 0 and 1.
With the flag on (stock torch DDP adopted, compiled) the job trains to eager torch DDP's
parameters (a reference job launched the same way), every rank issues one all-reduce
per eager DDP bucket, and the dumps in one shared directory are named by global rank.

The agents run in their own sessions with a deadline; on a failure or a timeout they and
their workers are killed and their output is printed."""

import importlib.util
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "multinode_torchrun.py"
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
TOL = 1e-5
TIMEOUT_S = 300  # one job; it takes about a minute on 2 busy cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pids: set[int]) -> set[int]:
    """Every live descendant of ``pids`` (torchrun starts each worker in its own
    session, so killing an agent's process group leaves its workers)."""
    found, frontier = set(), set(pids)
    while frontier:
        parents, frontier = frontier, set()
        for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            pid = int(stat.parent.name)
            if int(fields[1]) in parents and pid not in found:
                found.add(pid)
                frontier.add(pid)
    return found


def _kill(agents: list[subprocess.Popen]) -> None:
    """The agents and every process under them, at once."""
    pids = {a.pid for a in agents if a.poll() is None}
    for pid in _children(pids) | pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for a in agents:
        a.wait(timeout=30)


def _launch(mode: str, tmp_path: pathlib.Path, **env_extra: str) -> tuple[list[tuple[dict, dict]], list[int]]:
    """The example as a two-node job in ``mode``: each rank's result and parameters, and
    the agents' pids."""
    out = tmp_path / mode
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    env.pop("DDP_FUSION", None)
    endpoint = f"127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
           "--nproc-per-node", str(PER_NODE), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
           "--rdzv-id", f"multinode-{mode}", "--rdzv-conf", "join_timeout=120",
           str(SCRIPT), "--device", "cpu", "--mode", mode, "--out", str(out)]
    logs = [tmp_path / f"{mode}.agent{i}.log" for i in range(NODES)]
    agents = []
    try:
        for log in logs:
            with open(log, "w") as f:
                agents.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + TIMEOUT_S
        codes = [a.poll() for a in agents]
        # until both are done, one has failed (the other would wait for its peers), or
        # the deadline
        while None in codes and not set(codes) - {None, 0} and time.monotonic() < deadline:
            time.sleep(0.5)
            codes = [a.poll() for a in agents]
    finally:
        _kill(agents)
    if codes != [0] * NODES:
        shown = "\n".join(f"==== agent {i} ({log}):\n{log.read_text()[-6000:]}" for i, log in enumerate(logs))
        pytest.fail(f"{' '.join(cmd)}\nexit codes {codes} (None: still running when stopped; "
                    f"the deadline is {TIMEOUT_S} s)\n{shown}")
    results = [(json.loads(pathlib.Path(f"{out}.{r}.json").read_text()), torch.load(f"{out}.{r}.pt"))
               for r in range(WORLD)]
    return results, [a.pid for a in agents]


def _check_topology(results, agent_pids) -> None:
    """Two agents, two workers each; RANK = GROUP_RANK * 2 + LOCAL_RANK."""
    by_agent: dict[int, list[dict]] = {}
    for rank, (info, _) in enumerate(results):
        env = info["env"]
        assert info["rank"] == rank and env["RANK"] == str(rank), info
        assert env["WORLD_SIZE"] == str(WORLD) and env["LOCAL_WORLD_SIZE"] == str(PER_NODE), info
        assert int(env["RANK"]) == int(env["GROUP_RANK"]) * PER_NODE + int(env["LOCAL_RANK"]), info
        by_agent.setdefault(info["agent_pid"], []).append(env)
    assert sorted(by_agent) == sorted(agent_pids), (by_agent, agent_pids)
    for envs in by_agent.values():
        assert sorted(e["LOCAL_RANK"] for e in envs) == ["0", "1"], envs
        assert len({e["GROUP_RANK"] for e in envs}) == 1, envs
    assert sorted(envs[0]["GROUP_RANK"] for envs in by_agent.values()) == ["0", "1"], by_agent
    assert sum(e["RANK"] != e["LOCAL_RANK"] for envs in by_agent.values() for e in envs) == PER_NODE


def _initial_parameters() -> dict[str, torch.Tensor]:
    spec = importlib.util.spec_from_file_location("_examples_common", ROOT / "examples" / "_common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    return {n: p.detach() for n, p in common.model().named_parameters()}


@pytest.mark.slow
def test_two_node_torchrun_trains_fused_as_eager_ddp(tmp_path):
    eager, eager_agents = _launch("eager", tmp_path)
    dumps = tmp_path / "dumps"
    fused, fused_agents = _launch("fused", tmp_path, DDP_FUSION_DUMP_DIR=str(dumps))
    _check_topology(eager, eager_agents)
    _check_topology(fused, fused_agents)

    initial = _initial_parameters()
    for rank, ((want, want_params), (got, got_params)) in enumerate(zip(eager, fused)):
        assert got["adopted_by_ddp_fusion"] and got["fused_plans_run"] == 1, got
        assert got["ddp"] == "torch.nn.parallel.distributed.DistributedDataParallel", got
        assert not got["unfused"] and got["graph_breaks"] == 0, got
        assert want["eager_buckets"] > 1 and want["collectives_last_step"] == want["eager_buckets"], want
        assert got["collectives_last_step"] == want["eager_buckets"], (rank, got, want)
        diff = max((got_params[k] - want_params[k]).abs().max().item() for k in want_params)
        assert diff < TOL, (rank, diff)
        # the tolerance is far below what training did: every tensor moved by > 100 x TOL
        moved = min((want_params[k] - initial[k]).abs().max().item() for k in want_params)
        assert moved > 100 * TOL, (rank, moved)

    # one shared dump directory: every global rank wrote its own plan files, and no
    # file is named by another number (LOCAL_RANK would make the nodes' files collide)
    plans = {r: sorted(dumps.glob(f"rank{r}_*.buckets.json")) for r in range(WORLD)}
    assert all(plans.values()), plans
    assert sorted(dumps.glob("*.buckets.json")) == sorted(p for ps in plans.values() for p in ps)
