"""c10d: the process-group registry, stores, futures, functional collectives, ``Join``,
the flight recorder."""

from __future__ import annotations

import itertools
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import patching

REQUIRED = (
    "torch._C._distributed_c10d._resolve_process_group",
    "torch._C._distributed_c10d._register_process_group",
    "torch._C._distributed_c10d._dump_fr_trace",
    "torch._C.Future",
    "torch.distributed.ProcessGroup._set_group_name",
    "torch.distributed.ProcessGroup._get_backend",
    "torch.distributed.ProcessGroupGloo._Options",
    "torch.distributed.distributed_c10d._get_default_store",
    "torch.distributed.distributed_c10d._unregister_process_group",
    "torch.distributed.distributed_c10d._unregister_all_process_groups",
    "torch.distributed._functional_collectives.broadcast",
    "torch.distributed._functional_collectives.wait_tensor",
    "torch.ops._c10d_functional.all_reduce",
    "torch.ops._c10d_functional.all_reduce_coalesced",
    "torch.ops._c10d_functional.all_reduce_",
    "torch.ops._c10d_functional.all_reduce_coalesced_",
    "torch.ops._c10d_functional.wait_tensor",
    "torch.ops._c10d_functional.wait_tensor.default",
    "torch._C._AutoDispatchBelowAutograd",
    "torch.testing._internal.distributed.fake_pg.FakeStore",
)

#: Attributes of objects (not importable names) this module reads, and why that is safe.
UNCHECKED = {
    "_timeout": "a backend's options' timeout, read inside try/except with torch's default "
                "as the fallback; set on the ProcessGroupGloo._Options of a host group",
    "_join_config": "set on every Joinable by Joinable.__init__ (public API); read only for "
                    "models that are Joinables",
    "_devices": "a field of ProcessGroupGloo._Options (checked in REQUIRED), set before the "
                "group is made",
    "_threads": "a field of ProcessGroupGloo._Options (checked in REQUIRED), set before the "
                "group is made",
}

#: The functional collectives' ops (``all_reduce``, ``all_reduce_coalesced``,
#: ``wait_tensor``): what fused graphs hold, and Inductor lowers.
c10d_functional = torch.ops._c10d_functional
_wait_tensor = c10d_functional.wait_tensor.default


def wait_tensors(tensors: Sequence[torch.Tensor]) -> None:
    """Wait for the functional collectives issued on ``tensors``' storages, as
    ``_c10d_functional.wait_tensor`` on each does, but below autograd: importing
    ``torch.distributed._functional_collectives`` registers a Python autograd kernel for
    that op, which every call from Python then runs through (about 3.4 us of 5 a call
    on this project's CPU). ddp_fusion's ops wait on gradients, which are never
    differentiated, once per bucket or once per tensor of a ``coalesced`` bucket. The
    functional collectives keep a collective's work by storage: the first tensor of a
    storage waits for it, later ones find none (a lookup)."""
    with torch._C._AutoDispatchBelowAutograd():
        for tensor in tensors:
            _wait_tensor(tensor)


def resolve_process_group(group_name: str) -> dist.ProcessGroup | None:
    """The process group registered under ``group_name`` in this process, or None."""
    try:
        return torch._C._distributed_c10d._resolve_process_group(group_name)
    except (RuntimeError, ValueError):
        return None


def register_process_group(name: str, group: dist.ProcessGroup) -> None:
    """Name ``group`` ``name`` and make it resolvable by that name (functional
    collectives name groups)."""
    group._set_group_name(name)
    torch._C._distributed_c10d._register_process_group(name, group)


def ensure_group_name(group: dist.ProcessGroup) -> str:
    """``group``'s name, as functional collectives (and ddp_fusion's graphs) name groups.
    A group made outside ``torch.distributed.new_group`` may have none (torchft's
    ``ProcessGroupDummy``, which its DDP is built on): it gets one, and is registered
    under it."""
    try:
        return group.group_name
    except (RuntimeError, ValueError):  # "ProcessGroup name not set"
        # numbered in the order they are met: the same on every rank, which build their
        # models in the same order (the name is part of the bucket plan the ranks check)
        while True:
            name = f"ddp_fusion_unnamed_{next(_unnamed)}"
            if resolve_process_group(name) is None:
                break
        register_process_group(name, group)
        return name


_unnamed = itertools.count()


def is_future(x: Any) -> bool:
    """A ``torch.futures.Future``, or the C++ future that its ``then`` returns."""
    return isinstance(x, torch._C.Future)


def group_timeout(group: dist.ProcessGroup) -> Any:
    """The timeout (a ``datetime.timedelta``) of ``group``'s backend, or torch's default
    for a group that does not say (a Python process group)."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - no backend for that device, or no options
            continue
    return dist.default_pg_timeout


#: The environment variable that names the network interfaces gloo listens on.
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"


def lazy_gloo_group(prefix: str, rank: int, size: int, timeout: Any) -> Any:
    """A gloo process group (a backend object: ``send``, ``recv``, ``broadcast`` on CPU
    tensors, group ranks) of ``size`` ranks over the default store under ``prefix``,
    made without a collective and connecting lazily: each pair of ranks connects at its
    first exchange, so a rank that talks to O(log N) peers holds O(log N) connections
    (``TORCH_GLOO_LAZY_INIT``'s behaviour, for this group only). It listens on the
    interfaces ``GLOO_SOCKET_IFNAME`` names (comma-separated), as a gloo group that
    ``init_process_group`` makes does, else on the address the host's name resolves to.
    ``timeout`` bounds a connection (gloo retries one for up to five times it) and every
    wait that is not given its own. Registered nowhere: ``destroy_process_group`` does
    not know it, and it goes when it is garbage (its threads and sockets with it)."""
    store = dist.PrefixStore(prefix, default_store())
    options = dist.ProcessGroupGloo._Options()
    # (ProcessGroupGloo's own constructor reads GLOO_SOCKET_IFNAME; create_default_device
    # does not)
    interfaces = [i.strip() for i in os.environ.get(GLOO_SOCKET_IFNAME, "").split(",") if i.strip()]
    gloo = dist.ProcessGroupGloo
    try:
        devices = ([gloo.create_device(interface=i, lazy_init=True) for i in interfaces]
                   or [gloo.create_default_device(lazy_init=True)])
    except TypeError:  # a torch without lazy gloo devices: every pair connects now
        devices = [gloo.create_device(interface=i) for i in interfaces] or [gloo.create_default_device()]
    options._devices = devices
    options._timeout = timeout
    options._threads = 1
    return dist.ProcessGroupGloo(store, rank, size, options)


def _c10d() -> Any:
    import torch.distributed.distributed_c10d as c10d

    return c10d


UNREGISTER_GROUP = patching.Setting(
    "torch.distributed.distributed_c10d._unregister_process_group",
    lambda: _c10d()._unregister_process_group,
    lambda fn: setattr(_c10d(), "_unregister_process_group", fn),
)
UNREGISTER_ALL_GROUPS = patching.Setting(
    "torch.distributed.distributed_c10d._unregister_all_process_groups",
    lambda: _c10d()._unregister_all_process_groups,
    lambda fn: setattr(_c10d(), "_unregister_all_process_groups", fn),
)
"""What ``destroy_process_group`` calls, as its last step, to unregister a group by name
(a subgroup) or every group (the default group): c10d has no other notice that a group
has ended."""


def on_groups_unregistered(patches: patching.Patches, callback: Callable[[str | None], None]) -> None:
    """Until ``patches`` is restored, call ``callback(name)`` after c10d unregisters the
    group ``name`` (``destroy_process_group(group)``), and ``callback(None)`` after it
    unregisters every group (``destroy_process_group()``)."""

    def one(original: Callable[[str], None]) -> Callable[[str], None]:
        def _unregister_process_group(group_name: str) -> None:
            original(group_name)
            callback(group_name)

        return _unregister_process_group

    def every(original: Callable[[], None]) -> Callable[[], None]:
        def _unregister_all_process_groups() -> None:
            original()
            callback(None)

        return _unregister_all_process_groups

    patches.wrap(UNREGISTER_GROUP, one)
    patches.wrap(UNREGISTER_ALL_GROUPS, every)


def default_store() -> Any:
    """The store of the default process group (every rank can set and get keys)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def fake_store() -> Any:
    """A store for ``backend="fake"`` process groups (graph tests, examples)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def broadcast_traceable(tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor`` as ``group``'s rank ``src`` (a rank *in the group*, unlike
    ``dist.broadcast``) has it: a functional collective, so torch.compile traces it into
    the graph (no graph break)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.broadcast(tensor, src, group))


def join_enabled(joinable: Any) -> bool:
    """Whether ``joinable`` is in an enabled join context (torch's ``Join`` sets its
    ``_join_config``; it stays set after the context, as for torch DDP)."""
    return joinable is not None and joinable._join_config.enable


#: The environment variable that turns on c10d's flight recorder (read when a process
#: group is created) and gives its number of entries.
FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"


def flight_recorder_on() -> bool:
    return os.environ.get(FLIGHT_RECORDER_ENV, "0").strip() not in ("", "0")


def collectives_recorded() -> list[tuple[tuple[str, int], str, str]]:
    """``(key, profiling name, process group name)`` of the collectives c10d's flight
    recorders hold (the last ``TORCH_FR_BUFFER_SIZE`` this process issued, on any
    process group and thread, eager or from a compiled graph; gloo names an all-reduce
    ``"gloo:all_reduce"``, coalesced or not, NCCL ``"nccl:all_reduce"``), oldest first
    within each recorder. NCCL keeps its own recorder beside the one of the other
    backends: ``key`` is ``(recorder, record id)``, unique in the process (ids grow by
    one per collective within a recorder); take the collectives of a span as the keys
    not seen before it. The recorder must have been on (``TORCH_FR_BUFFER_SIZE`` > 0)
    when the process groups were created: reading it otherwise aborts the process, so
    this raises ``RuntimeError`` instead."""
    if not flight_recorder_on():
        raise RuntimeError(
            f"c10d's flight recorder is off: set {FLIGHT_RECORDER_ENV} before the process "
            "groups are created"
        )
    dumps = [("c10d", torch._C._distributed_c10d._dump_fr_trace)]
    nccl = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)  # CUDA builds only
    if nccl is not None:
        dumps.append(("nccl", nccl))
    out = []
    for recorder, dump in dumps:
        trace = pickle.loads(dump())
        out += [((recorder, e["record_id"]), e["profiling_name"], e.get("process_group", ("?",))[0])
                for e in trace.get("entries", [])]
    return out


def collectives_since(seen: set[tuple[str, int]]) -> list[tuple[str, str]]:
    """``(profiling name, process group name)`` of the recorded collectives whose keys
    are not in ``seen`` (:func:`collectives_recorded`), oldest first per recorder; adds
    their keys to ``seen``. Start with ``seen = set(); collectives_since(seen)``."""
    new = [(key, name, pg) for key, name, pg in collectives_recorded() if key not in seen]
    seen.update(key for key, _, _ in new)
    return [(name, pg) for _, name, pg in new]


class AllReduces:
    """Counts the all-reduces this process runs inside ``with AllReduces() as n: ...``
    (then ``n.count``), for tests and examples. Where the flight recorder is on
    (:data:`FLIGHT_RECORDER_ENV` set before the process groups are made) it counts what
    the recorder saw: every collective, issued from any thread. Else torch's profiler
    events (gloo or NCCL), which can miss one issued by a comm hook or by eager DDP's
    reducer when gloo's thread ends its event after the span."""

    def __enter__(self) -> AllReduces:
        self.count: int | None = None
        self._seen: set[tuple[str, int]] | None = None
        if flight_recorder_on():
            self._seen = set()
            collectives_since(self._seen)
        else:
            from torch.profiler import profile

            self._prof = profile()
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._seen is not None:
            names = [name for name, _ in collectives_since(self._seen)]
        else:
            self._prof.__exit__(*exc)
            names = [e.name for e in self._prof.events()]
        self.count = sum(name in ("gloo:all_reduce", "nccl:all_reduce") for name in names)
        return False
