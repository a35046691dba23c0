"""Repros of upstream limits ddp_fusion works around or reports (in the normal CI run).

Each is ``xfail(strict=True)`` for exactly the upstream error (``raises=UpstreamLimitError``):
when upstream fixes one, the test starts passing, fails the strict xfail, and tells us
to lift the matching restriction in ddp_fusion; any other error fails it too."""

import inspect

import pytest
import torch


class UpstreamLimitError(Exception):
    """The known upstream error, and only it, is re-raised as this."""


@pytest.mark.usefixtures("fake_pg")
@pytest.mark.xfail(
    strict=True,
    raises=UpstreamLimitError,
    reason="compiled autograd: post-acc-grad hook on DTensor uses as_strided",
)
def test_compiled_autograd_post_accumulate_grad_hook_on_dtensor():
    """Tracing a post-accumulate-grad hook, compiled autograd copies the parameter with
    ``maybe_clone`` (``clone_preserve_strides``: ``as_strided``), which DTensor lacks.
    ddp_fusion works around it (``_torch.compiled_autograd.allow_dtensor_post_accumulate_grad_hooks``
    swaps in DTensor's own ``clone()``); when this passes, the work-around can go.

    The copy is called directly, on torch's own ``maybe_clone``: through a whole
    backward the failure is not deterministic on torch 2.13 (the C++ caller leaves the
    Python error pending; the backward then raises ``SystemError`` or carries on,
    depending on what runs next). If the hook stops going through ``maybe_clone``, the
    first assertion fails the test."""
    from torch._dynamo import compiled_autograd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    hook_source = inspect.getsource(compiled_autograd.AutogradCompilerInstance.post_acc_grad_hook)
    assert "maybe_clone(input)" in hook_source, hook_source
    maybe_clone = compiled_autograd.maybe_clone
    if getattr(maybe_clone, "_ddp_fusion_dtensor_aware", False):  # the work-around is in
        maybe_clone = inspect.getclosurevars(maybe_clone).nonlocals["original"]
    mesh = init_device_mesh("cpu", (2,))
    param = DTensor.from_local(torch.randn(4, 8), mesh, [Shard(0)], run_check=False)
    try:
        maybe_clone(param)
    except RuntimeError as e:
        if "as_strided not supported with DTensor" in str(e):
            raise UpstreamLimitError(str(e)) from e
        raise


@pytest.mark.xfail(
    strict=True,
    raises=UpstreamLimitError,
    reason="compiled autograd: its graphs never reach AOTAutograd's cache",
)
def test_compiled_autograd_graphs_reach_aotautograd_cache():
    """Why a warm-cache first step under the flag still runs AOTAutograd (5.6 s of
    12.8 s on a tiny GPT-2, bench/results/first_step_cpu_2026-11-25.md), with torch's
    own compiled autograd and no ddp_fusion:

    * the compiled-autograd backward graph is bypassed: it calls each autograd node's
      formula through compiled autograd's own ops (``ops.validate_outputs``,
      ``ops.SumBackward0``, ...) and, for a compiled forward, a closure
      (``call_aot_bwd_prologue``), none of which the cache accepts;
    * the compiled forward's entry is never saved: AOTAutograd saves it when it
      compiles the forward's backward, which compiled autograd inlines instead.

    Inductor's FX graph cache still serves both graphs' code. When this passes, the
    first step under the flag should drop by that AOTAutograd time: re-measure with
    ``python -m bench.first_step``."""
    from torch._dynamo import compiled_autograd
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    counters.clear()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    try:
        with fresh_cache(), torch._functorch.config.patch(enable_autograd_cache=True), \
                torch._inductor.config.patch(fx_graph_cache=True):
            compiled = torch.compile(model)
            with compiled_autograd._enable(torch.compile):
                compiled(torch.randn(4, 8)).sum().backward()
        aot = dict(counters["aot_autograd"])
    finally:
        torch._dynamo.reset()
    if aot.get("autograd_cache_saved", 0) == 0 and aot.get("autograd_cache_bypass", 0) > 0:
        raise UpstreamLimitError(f"AOTAutograd cache counters: {aot}")
