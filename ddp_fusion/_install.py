"""Wiring into torch.compile, done when ``config.enabled`` changes.

On: the pass goes into ``torch._inductor.config.post_grad_custom_post_pass`` as a
``CustomGraphPass`` (its ``uuid()`` hashes the pass source and the config, so Inductor's
FX graph cache stays on and a config change is a cache miss). A pass the user installed
first is kept and runs before ours. Compiled autograd is switched on for every
``backward()`` in the process, because the DDP hooks only reach the pass through a
compiled-autograd graph. With ``schedule_waits`` on, those backward graphs compile with
Inductor's peak-memory reordering off, which would otherwise move each bucket's wait
back up next to its collective (``_torch.inductor_options_keeping_node_order``).

Off: both are undone (a user pass installed before ours is restored).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch

from . import _torch
from .config import config
from .passes import fuse_ddp_allreduces

# The pass's behaviour is a function of these files and the config (read once).
_SOURCES = tuple(str(p) for p in sorted(pathlib.Path(__file__).parent.rglob("*.py")))
_CustomGraphPass = _torch.custom_graph_pass_base()


class FuseDDPAllReduces(_CustomGraphPass):
    """The Inductor post-grad pass: ``fuse_ddp_allreduces`` with the current config."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        fuse_ddp_allreduces(graph)

    def uuid(self) -> bytes:
        settings = {k: v for k, v in config.as_dict().items() if k != "enabled"}
        return _torch.hash_files(_SOURCES, json.dumps(settings, sort_keys=True))


class _Chain(_CustomGraphPass):
    """Several post-grad passes in one slot, run in order."""

    def __init__(self, passes: tuple[Any, ...]) -> None:
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Any:
        uuids = [p.uuid() if isinstance(p, _CustomGraphPass) else None for p in self.passes]
        # A plain function has no uuid; None tells Inductor not to cache, as it would
        # have done for that function alone.
        return None if any(u is None for u in uuids) else tuple(uuids)


THE_PASS = FuseDDPAllReduces()


def compile_backward(graph_module: torch.fx.GraphModule) -> Any:
    """Compiled autograd's compiler: Inductor, keeping the node order the pass chose
    when ``schedule_waits`` is on (read when each backward graph is compiled)."""
    options = _torch.inductor_options_keeping_node_order() if config.schedule_waits else {}
    return torch.compile(graph_module, backend="inductor", options=options or None)


_installed: dict[str, Any] = {}


def install() -> None:
    inductor = _torch.inductor_config()
    current = inductor.post_grad_custom_post_pass
    if "slot" not in _installed:
        new = THE_PASS if current is None else _Chain((current, THE_PASS))
        inductor.post_grad_custom_post_pass = new
        _installed.update(slot=new, previous=current)
    if "compiled_autograd" not in _installed:
        ctx = _torch.enable_compiled_autograd(compile_backward)
        ctx.__enter__()
        _installed["compiled_autograd"] = ctx


def uninstall() -> None:
    inductor = _torch.inductor_config()
    if "slot" in _installed:
        slot, previous = _installed.pop("slot"), _installed.pop("previous")
        if inductor.post_grad_custom_post_pass is slot:
            inductor.post_grad_custom_post_pass = previous
    ctx = _installed.pop("compiled_autograd", None)
    if ctx is not None:
        ctx.__exit__(None, None, None)


def _on_change(name: str, value: Any) -> None:
    if name == "enabled":
        install() if value else uninstall()


