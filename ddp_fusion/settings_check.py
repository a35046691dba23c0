"""The cross-rank check of a model's settings, before any collective depends on them.

A setting that changes which collectives a rank issues (the parameters it reduces, the
bucket caps or ``"auto"``, the link ``"auto"`` plans for, the algorithm, the
communication dtype or comm hook, ``find_unused_parameters``, whether the forward runs
fused) must be the same on every rank of the model's group; if it is not, the ranks'
collectives do not match and the job hangs, or, where the sizes happen to match, mixes
gradients silently. So each model checks its settings across its group at
construction and again at its first forward (grad_sync.py), before the collectives they
decide: the settings of each rank are hashed and compared on the host group
(host_group.py: one O(log N) exchange of CPU integers, no device involved). Where they
differ, every rank raises :class:`SettingsMismatchError`, naming each setting that
differs and the ranks that have which value, assembled on the error path only: every
rank receives group rank 0's settings (a tree broadcast), writes what differs from them
to the store, and group rank 0 groups the ranks by difference.

Settings are a flat ``dict`` of JSON-able values; ``"parameters"`` is the list of
``[name, shape, dtype, requires_grad, layout]`` of the module's parameters (layout: the
order of its dimensions in memory, outermost first; see plan.py, "Element order").
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .host_group import HostGroup


class SettingsMismatchError(ValueError):
    """The ranks of a model's process group have settings that make them issue
    different collectives (which would hang)."""


def check(host: HostGroup | None, who: str, when: str, settings: dict[str, Any]) -> None:
    """Raise :class:`SettingsMismatchError` on every rank of ``host``'s group if the
    ranks' ``settings`` differ (every rank must call it). ``who`` names the model,
    ``when`` the moment (``"at construction"``)."""
    if host is None:
        return
    text = json.dumps(settings, sort_keys=True, default=str)
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
    ticket = host.ticket()
    if host.agree(digest):
        return
    rank0 = host.broadcast_json(text, src=0)
    mine = "\n".join(differences(json.loads(text), json.loads(rank0)))
    raise SettingsMismatchError(
        host.report("settings", ticket, mine, lambda payloads: _describe(who, when, host, payloads))
    )


def differences(mine: dict[str, Any], rank0: dict[str, Any]) -> list[str]:
    """One line per setting where ``mine`` differs from group rank 0's."""
    out = []
    for key in sorted(set(mine) | set(rank0)):
        a, b = mine.get(key), rank0.get(key)
        if a == b:
            continue
        if key == "parameters" and isinstance(a, list) and isinstance(b, list):
            out.append(_parameter_difference(a, b))
        else:
            out.append(f"{key} is {a!r} (group rank 0: {b!r})")
    return out


def _parameter_difference(mine: list[Any], rank0: list[Any]) -> str:
    for i, (a, b) in enumerate(zip(mine, rank0)):
        if a != b:
            return f"parameter #{i} is {_param(a)} (group rank 0: {_param(b)})"
    return f"{len(mine)} parameters (group rank 0: {len(rank0)})"


def _param(p: list[Any]) -> str:
    name, shape, dtype, requires_grad, dims = p
    layout = "" if dims == sorted(dims) else f" laid out with dimensions {tuple(dims)} outermost first"
    return f"{name!r} {tuple(shape)} {dtype}{'' if requires_grad else ' requires_grad=False'}{layout}"


def _describe(who: str, when: str, host: HostGroup, payloads: dict[int, str]) -> str:
    ranks_of: dict[str, list[int]] = {}
    for rank, diff in sorted(payloads.items()):
        if diff:
            ranks_of.setdefault(diff, []).append(rank)
    lines = [
        f"ddp_fusion: {who}: the ranks of process group {host.group_name!r} have different "
        f"settings {when}, and these settings decide which collectives a rank issues (a "
        "hang, or gradients mixed across ranks). Every rank must wrap the same model with "
        "the same arguments and ddp_fusion settings (environment variables included):"
    ]
    for diff, ranks in ranks_of.items():
        shown = host.ranks(ranks)
        for line in diff.splitlines():
            lines.append(f"  group rank{'s' if len(ranks) > 1 else ''} {shown}: {line}")
    return "\n".join(lines)
