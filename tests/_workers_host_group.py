"""Per-rank bodies of tests/test_host_group_gloo.py: ddp_fusion's per-group state (a host
group: a thread, a gloo group, its sockets) ends with its process group when the group
is destroyed and made again in the same process (a new ``init_process_group``, an
in-process restart); a host group whose ranks cannot connect fails at construction,
on every rank, within seconds."""

import copy
import gc
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

import ddp_fusion
from ddp_fusion import host_group

from _workers import mlp


def _resources() -> dict:
    """Python threads (names), threads that are not Python's (gloo's, torch's pools) and
    open files of this process."""
    names = sorted(t.name for t in threading.enumerate())
    return {
        "python_threads": names,
        "other_threads": len(os.listdir("/proc/self/task")) - len(names),
        "files": len(os.listdir("/proc/self/fd")),
        "children": _children(),
    }


def _children() -> int:
    """Processes whose parent is this one, zombies included (a host group starts none)."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        n += ppid == os.getpid()
    return n


def _tickets() -> int:
    """The exchanges asked of this round's host group so far (the one ``host_group.known``
    gives a steady step; 0 without one). Holds no reference to it after it returns: the
    round counts what is left once its group is gone."""
    known = host_group.known(dist.group.WORLD.group_name)
    return 0 if known is None else known[1].tickets


def _round(rank, world_size, store, flag, compiled, steps=3):
    """init_process_group on ``store``; torch DDP with ``flag`` (``compiled``: torch.compile'd;
    else ddp_fusion's wrapper, uncompiled) for ``steps`` steps, and eager torch DDP on
    the same data; destroy_process_group; collect garbage. Returns the resources left
    and the parameter difference between the two."""
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(8, 64, generator=gen) for _ in range(steps)]
    base = mlp()
    nets, checked_here = [], None
    for fused in (False, flag):
        if compiled:
            torch._dynamo.reset()
        with ddp_fusion.config.patch(enabled=fused and compiled):
            net = copy.deepcopy(base)
            if fused and not compiled:
                model = ddp_fusion.DistributedDataParallel(net)
            else:
                model = torch.nn.parallel.DistributedDataParallel(net)
            model = torch.compile(model) if fused and compiled else model
            opt = torch.optim.SGD(net.parameters(), lr=0.05)
            before = _tickets()
            for x in batches:
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
            if fused and compiled:
                # the per-step plan check ran its exchanges on this round's host group,
                # not on the round before's, which ended with that round's group
                checked_here = _tickets() - before >= steps
            nets.append(net)
        del model, opt
    diff = max((a - b).abs().max().item() for a, b in zip(*(n.parameters() for n in nets)))
    del nets, net
    during = _children()
    if compiled:
        torch._dynamo.reset()
    dist.destroy_process_group()
    gc.collect()
    return {**_resources(), "diff": diff, "children_before_destroy": during,
            "checked_here": checked_here}


def regroup(rank, world_size, tmpdir, compiled, rounds=3):
    """The group made and destroyed once with the flag off, then ``rounds`` times with
    it on, training each time. Returns the resources after each round (the first: flag
    off). Leaves a group initialized (run_ranks destroys it).

    The rounds meet in one file store, each under its own prefix, as a job that restarts
    in process keeps its store. Not a new ``init_method="file://..."`` per round: gloo
    then fails to connect now and then (one rank raises "Connection closed by peer" in
    ``init_process_group`` and the other waits for the group's timeout), without
    ddp_fusion or DDP: ``init_process_group(init_method=f"file://{dir}/r{i}")`` and
    ``destroy_process_group()`` alone in a loop on 2 ranks failed 5 times in about
    2,700 rounds on a 2-core VM (torch 2.13); one store with a prefix per round, none in
    6,000; a new ``FileStore`` per round passed as ``store=`` (a slower round), none in
    3,000; ``new_group`` and destroying it, none in 1,800."""
    dist.destroy_process_group()  # run_ranks's group: every round makes its own
    store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
    out = [_round(rank, world_size, dist.PrefixStore(f"round{i}", store), i > 0, compiled)
           for i in range(rounds + 1)]
    dist.init_process_group("gloo", store=dist.PrefixStore("last", store), rank=rank, world_size=world_size)
    return out


UNREACHABLE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never routed


def _unreachable_address(value: bytes) -> bytes:
    """gloo's published address of a rank (a ``sockaddr`` inside its bytes), with the IP
    address replaced by one nobody answers at: a peer's connection to it goes nowhere,
    as to a node whose host name resolves to 127.0.1.1, or behind a blocked port."""
    try:
        ours = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        ours = set()
    for address in sorted(ours | {"127.0.0.1"}):
        at = value.find(socket.inet_aton(address))
        if at >= 4 and value[at - 4:at - 2] == b"\x02\x00":  # sockaddr_in: AF_INET, port, address
            return value[:at] + socket.inet_aton(UNREACHABLE) + value[at + 4:]
    raise AssertionError(f"no IPv4 address of this host in gloo's published address {value!r}")


class _Unreachable(dist.Store):
    """The default store, except that every host group's gloo address (the key
    ``<prefix>/0/<rank>`` gloo publishes it under) reads as one nobody answers at: so
    whichever rank of a pair connects, it connects to nothing."""

    def __init__(self, store):
        super().__init__()
        self.store = store

    def get(self, key):
        value = self.store.get(key)
        parts = key.split("/")
        if key.startswith("ddp_fusion/host/") and parts[-2] == "0" and parts[-1].isdigit():
            return _unreachable_address(value)
        return value

    def set(self, key, value):
        self.store.set(key, value)

    def add(self, key, value):
        return self.store.add(key, value)

    def wait(self, keys, timeout=None):
        return self.store.wait(keys) if timeout is None else self.store.wait(keys, timeout)

    def check(self, keys):
        return self.store.check(keys)

    def multi_get(self, keys):
        return self.store.multi_get(keys)

    def multi_set(self, keys, values):
        return self.store.multi_set(keys, values)

    def compare_set(self, key, expected, desired):
        return self.store.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self.store.delete_key(key)

    def num_keys(self):
        return self.store.num_keys()

    def has_extended_api(self):
        return True


def _build(group):
    """Seconds to build a model on ``group`` (which makes its host group), the error's
    type and message (None, None if it built)."""
    start = time.monotonic()
    try:
        ddp_fusion.DistributedDataParallel(torch.nn.Linear(4, 4), process_group=group)
    except Exception as e:  # noqa: BLE001 - the result
        return time.monotonic() - start, type(e).__name__, str(e)
    return time.monotonic() - start, None, None


def cannot_connect(rank, world_size):
    """Host groups on new groups of both ranks: the ranks' gloo addresses read as ones
    nobody answers at; rank 1's
    ``GLOO_SOCKET_IFNAME`` names an interface it lacks; both name the loopback interface
    (``lo``: fine). Returns ``{case: (seconds, error type, message)}``: each failure must
    come within seconds, on both ranks."""
    from ddp_fusion import _torch

    _torch.check_torch()  # (imports Dynamo and Inductor: not part of the time)
    out = {}
    default_store = _torch.distributed.default_store
    unreachable = _Unreachable(default_store())
    group = dist.new_group([0, 1])
    _torch.distributed.default_store = lambda: unreachable
    try:
        out["unreachable"] = _build(group)
    finally:
        _torch.distributed.default_store = default_store
    for case, ifname in (("no such interface", "nosuch0" if rank == 1 else ""), ("lo", "lo")):
        group = dist.new_group([0, 1])
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
        try:
            out[case] = _build(group)
        finally:
            del os.environ["GLOO_SOCKET_IFNAME"]
    return out


def broadcast_json(rank, world_size):
    """Group rank 0's object on both ranks, as JSON gives it back (tuples as lists);
    over the cap (set on both ranks), a HostGroupError on both naming it, and the host
    group still usable after."""
    from ddp_fusion import host_group

    host = host_group.of(dist.new_group([0, 1]))
    out = {"got": host.broadcast_json((rank, [1.5, "x"], {"k": None}) if rank == 0 else None)}
    cap, host_group.MAX_BROADCAST_BYTES = host_group.MAX_BROADCAST_BYTES, 16
    try:
        host.broadcast_json("x" * 100 if rank == 0 else None)
    except host_group.HostGroupError as e:
        out["over_cap"] = str(e)
    finally:
        host_group.MAX_BROADCAST_BYTES = cap
    out["after"] = host.broadcast_json(rank)
    return out
