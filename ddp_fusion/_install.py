"""Wiring into torch, done when ``config.enabled`` changes; every effect is undone when
it goes off. The effects, in the order they are applied (docs/user-guide.md, "What
``enabled = True`` changes in the process", lists them for users):

Every change goes through one ``_torch.patching.Patches`` (:data:`PATCHES`), which keeps
each setting's value from before ddp_fusion first changed it and drops an entry only
once its undo has succeeded; ``enabled = False`` restores them all, newest first, or is
refused with nothing changed (inside a compiled-autograd context opened after
ddp_fusion turned compiled autograd on).

Set in code, ``enabled`` applies 1 and 3 at once. Under ``DDP_FUSION=1`` the import,
which torch does at every ``import torch`` through its entry point, patches torch DDP's
constructor only (3, and ``replicate()``'s), so that it imports neither Dynamo nor
Inductor; the rest (``check_torch()``, 1, torch DDP's forward) is applied the first
time ddp_fusion is used: a torch DDP or a wrapper constructed, ``all_reduce_gradient``
called, the pass run (``effects.IN_USE``).

1. The pass goes into ``torch._inductor.config.post_grad_custom_post_pass`` as a
   ``CustomGraphPass`` (its ``uuid()`` hashes the pass source and the config, so
   Inductor's FX graph cache stays on and a config change is a cache miss). A pass the
   user installed first is kept and runs before ours; off restores it.
2. Once a ddp_fusion model's forward has run compiled (it asks through effects.py),
   compiled autograd is switched on for every ``backward()`` in the process (the DDP
   hooks reach the pass only through a compiled-autograd graph), with autograd's
   multithreading off as torch's own context does. A process whose models never run
   compiled compiles nothing it did not ask for: their gradients go through the eager
   bucketed reducer. Its compiler is
   :func:`compile_backward`: Inductor with ``config.backward_compile_kwargs``, and, when
   ``schedule_waits`` is on, Inductor's peak-memory reordering off *for graphs that
   hold ddp_fusion collectives only* (it would move each bucket's wait back up next to
   its collective); for those with a communication dtype, Inductor's precision-cast
   emulation on (see :func:`_patches_for`). Off restores the previous compiler and multithreading setting.
3. ``torch.nn.parallel.DistributedDataParallel``: one constructed now is adopted by
   ddp_fusion right after torch's constructor (stock.py: its gradients go through
   ddp_fusion's hooks and pass instead of torch's C++ reducer). One constructed
   before, which still uses the C++ reducer that compiled autograd cannot run, raises
   at its next forward an error that names ddp_fusion and the fix (instead of torch's
   error deep in backward). Off restores torch's constructor and forward; models
   adopted stay adopted.
4. Only once a model holds DTensor parameters (it asks through effects.py): compiled
   autograd copies DTensor parameters with ``clone()``
   (``_torch.compiled_autograd.allow_dtensor_post_accumulate_grad_hooks``).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch

from . import _torch, dump, effects, grad_sync, plan, plan_check, stock, unused
from . import config as config_module
from .config import config
from .log import log
from .ops import ALL_REDUCE_GRADIENT, HOOK
from .passes import fuse_ddp_allreduces

# The pass's behaviour is a function of these files and the config (read once).
_SOURCES = tuple(str(p) for p in sorted(pathlib.Path(__file__).parent.rglob("*.py")))
# Settings that change what the pass does (the others change what runs around it).
_PASS_SETTINGS = ("algorithm", "schedule_waits", "max_in_flight_mb", "dump_dir", "plan_check")


class FuseDDPAllReduces:
    """The Inductor post-grad pass: ``fuse_ddp_allreduces`` with the current config.
    (An Inductor ``CustomGraphPass``, registered as one when first installed.)"""

    def __call__(self, graph: torch.fx.Graph) -> None:
        result = fuse_ddp_allreduces(graph)
        if not result.buckets and not result.unfused and not grad_sync.live_models():
            _warn_no_model()

    def uuid(self) -> bytes:
        settings = {k: getattr(config, k) for k in _PASS_SETTINGS}
        layouts = unused.cache_key()  # find_unused_parameters models' layouts, which the pass reads
        if layouts is not None:
            settings["find_unused_parameters layouts"] = layouts
        agreed = plan_check.cache_key()  # config.plan_check as each group's ranks agreed on it
        if agreed is not None:
            settings["plan_check agreed"] = agreed
        orders = plan.element_orders_key()  # parameters not contiguous (plan.py, "Element order")
        if orders is not None:
            settings["element orders"] = orders
        return _torch.inductor.hash_files(_SOURCES, json.dumps(settings, sort_keys=True))


class _Chain:
    """Several post-grad passes in one slot, run in order (a ``CustomGraphPass`` too)."""

    def __init__(self, passes: tuple[Any, ...]) -> None:
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Any:
        uuids = [p.uuid() if _torch.inductor.is_graph_pass(p) else None for p in self.passes]
        # A plain function has no uuid; None tells Inductor not to cache, as it would
        # have done for that function alone.
        return None if any(u is None for u in uuids) else tuple(uuids)


THE_PASS = FuseDDPAllReduces()
_warned_no_model: list[bool] = []


def _warn_no_model() -> None:
    if not _warned_no_model:
        _warned_no_model.append(True)
        log.warning(
            "ddp_fusion: config.enabled is on and torch.compile is compiling, but no "
            "data-parallel model was wrapped or adopted in this process, so there is "
            "nothing to fuse (a single-process run that builds no DDP, say, or a DDP "
            "built in another process)"
        )


def _tagged_all_reduces(graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    targets = (ALL_REDUCE_GRADIENT, torch.ops.ddp_fusion.all_reduce_gradient)
    return [n for n in graph_module.graph.nodes if n.op == "call_function" and n.target in targets]


def _comm_dtype(node: torch.fx.Node) -> Any:
    return node.args[5] if len(node.args) > 5 else node.kwargs.get("comm_dtype")


def _reduce_op(node: torch.fx.Node) -> Any:
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("reduce_op")


def _patches_for(graph_module: torch.fx.GraphModule) -> dict[str, Any]:
    """Inductor settings for one backward graph, only if it holds ddp_fusion's
    collectives: keep the pass's node order, and with a communication dtype keep the
    rounding to it before the scaling (Inductor would otherwise compute cast + divide in
    fp32 and round once, where torch's compress hooks round the gradient first: a
    different result where the quotient is subnormal); and bound Inductor's fusion
    search among the readers of a bucket's divisor (one per gradient), which is
    otherwise most of a cold compile's extra time on a model of many parameters.

    The node order is kept whether or not ``schedule_waits`` placed the waits: Inductor
    keeps its own collectives in graph order, but not ddp_fusion's in-place bucket op
    (passes/in_place.py), which its peak-memory reordering could move past another
    bucket's collective: another order of collectives than the plan's, which other ranks
    and a joined rank's replay follow."""
    tagged = _tagged_all_reduces(graph_module)
    patches: dict[str, Any] = {}
    if tagged:
        patches.update(_torch.inductor.options_keeping_node_order())
    if any(_comm_dtype(n) is not None for n in tagged):
        patches.update(_torch.inductor.options_emulating_precision_casts())
    if tagged:
        patches.update(_torch.inductor.options_without_upstream_ddp_fusion())
        patches.update(_torch.inductor.options_bounding_fusion_search())
    return patches


def compile_backward(graph_module: torch.fx.GraphModule) -> Any:
    """Compiled autograd's compiler: ``torch.compile`` with Inductor and
    ``config.backward_compile_kwargs`` (read when each backward graph is compiled).
    Its code does not re-check the sizes and strides of its inputs, which Dynamo's guards
    on compiled autograd's frame check at every backward (one call per input per step
    saved: ``_torch.inductor.backend``)."""
    kwargs = dict(config.backward_compile_kwargs)
    if kwargs.get("mode") == "reduce-overhead" and any(
        _reduce_op(n) == HOOK for n in _tagged_all_reduces(graph_module)
    ):
        raise ValueError(
            "ddp_fusion.config.backward_compile_kwargs: mode 'reduce-overhead' (CUDA graphs) "
            "with a comm hook: a CUDA graph would replay the hook's kernels without running "
            "the hook (its Python, its state). Use another mode for the backward"
        )
    backend = _torch.inductor.backend(
        kwargs.pop("mode", None), kwargs.pop("options", None), kwargs.get("dynamic"), _patches_for,
        on_lowering=dump.lowered, input_asserts=False,
    )
    return torch.compile(graph_module, backend=backend, **kwargs)


def _refuse_cpp_reducer(ddp: Any) -> None:
    """Only for a forward whose backward would reduce gradients."""
    if (
        torch.is_grad_enabled()
        and ddp.require_backward_grad_sync
        and _torch.ddp.uses_cpp_reducer(ddp)
    ):
        raise RuntimeError(
            "ddp_fusion.config.enabled is on, but this torch.nn.parallel."
            "DistributedDataParallel was constructed while it was off: it reduces "
            "gradients with torch's C++ reducer, which ddp_fusion does not fuse and which "
            "compiled autograd (on once a ddp_fusion model runs compiled) cannot run. Set "
            "ddp_fusion.config.enabled = True (or DDP_FUSION=1) before wrapping the model "
            "in DDP, or turn it off for this model"
        )


PATCHES = _torch.patching.Patches()
"""Every process-wide change ``config.enabled`` made (``_torch.patching``): restored
when it goes off."""

_ENVIRONMENT = _torch.patching.Patches()
"""torch DDP's constructor checking a bad ``DDP_FUSION*`` value (:func:`at_import`)."""


class _State:
    on = False
    """``enabled``: torch DDP's constructor adopts."""
    in_use = False
    """And the rest applied (:func:`_use`): check_torch, the pass, DDP's forward, effects."""


def _apply(effect: str) -> None:
    wanted = effects.wanted()
    if effect in (effects.COMPILED_AUTOGRAD, effects.DYNAMIC_BACKWARD):
        # compiled autograd, if asked for, traces with dynamic sizes once those are asked for
        if effects.COMPILED_AUTOGRAD in wanted:
            _torch.compiled_autograd.install(PATCHES, compile_backward, effects.DYNAMIC_BACKWARD in wanted)
    elif effect == effects.DTENSOR_CLONE:
        _torch.compiled_autograd.allow_dtensor_post_accumulate_grad_hooks(PATCHES)


def _with_our_pass(previous: Any) -> Any:
    return THE_PASS if previous is None else _Chain((previous, THE_PASS))


def _use() -> None:
    """Everything but torch DDP's constructor: ``check_torch()`` (which imports Dynamo
    and Inductor), the pass in Inductor's slot, torch DDP's forward, the effects asked
    for. Done when ``enabled`` is set in code, or, under ``DDP_FUSION=1``, when
    ddp_fusion is first used (effects.IN_USE)."""
    if _State.in_use:
        return
    _torch.check_torch()
    for cls in (FuseDDPAllReduces, _Chain):
        _torch.inductor.register_graph_pass(cls)
    _torch.inductor.fill_post_grad_slot(PATCHES, _with_our_pass)
    _torch.ddp.patch_forward(PATCHES, _refuse_cpp_reducer)
    _State.in_use = True
    for effect in effects.wanted():
        _apply(effect)


def _before_ddp_init(arguments: dict[str, Any]) -> None:
    config_module.check_env()  # before anything is imported for a model that will not be built
    _use()
    stock.refuse_arguments(arguments)


def install(lazily: bool = False) -> None:
    """``enabled`` on: torch DDP's constructor (and ``replicate()``'s) patched to adopt,
    and, unless ``lazily``, the rest (:func:`_use`) now. All or nothing."""
    if _State.on:
        return
    try:
        _torch.ddp.patch_init(PATCHES, _before_ddp_init, stock.adopt)
        _State.on = True
        if not lazily or effects.IN_USE in effects.wanted():
            _use()
    except BaseException:
        # the setting reverts (config.py), so undo what was applied
        _State.on = _State.in_use = False
        PATCHES.restore()
        raise


def uninstall() -> None:
    """``enabled`` off: every change restored, newest first. Refused (``RuntimeError``,
    nothing changed) inside a compiled-autograd context opened after ddp_fusion turned
    compiled autograd on."""
    PATCHES.restore()
    _State.on = _State.in_use = False


def _on_want(effect: str) -> None:
    """A model asked for ``effect`` (effects.py): apply it now if enabled (again, if
    something undid it: ``torch._dynamo.reset()`` turns compiled autograd off)."""
    if not _State.on:
        return  # applied when enabled goes on
    _use()
    _apply(effect)


effects.on_want(_on_want)


def _check_environment(arguments: dict[str, Any]) -> None:
    config_module.check_env()
    _ENVIRONMENT.restore()  # every bad value overridden in code: torch's constructor back


def at_import() -> None:
    """What ``import ddp_fusion`` (so every ``import torch``, through the entry point)
    does to torch: a bad ``DDP_FUSION*`` value makes torch DDP's constructor raise its
    error (config.check_env); ``DDP_FUSION=1`` patches torch DDP's constructor only, and
    leaves the rest (which imports Dynamo and Inductor) to the first use."""
    if config_module.env_errors():
        _torch.ddp.patch_init(_ENVIRONMENT, _check_environment, replicate=False)
    if config.enabled:
        install(lazily=True)


def _on_change(name: str, value: Any) -> None:
    if name == "enabled":
        install() if value else uninstall()
