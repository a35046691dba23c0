"""What ``ddp_fusion.config.enabled = True`` changes in the process is undone when it
goes off, stays out of graphs that are not ddp_fusion's, and lets the user's compile
options reach the backward graphs (README: "What `enabled = True` changes")."""

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo import compiled_autograd

import ddp_fusion
from ddp_fusion import effects

pytestmark = pytest.mark.usefixtures("fake_pg")


def current_compiler():
    current = torch._C._dynamo.compiled_autograd.set_autograd_compiler(None, False)
    torch._C._dynamo.compiled_autograd.set_autograd_compiler(*current)
    return current[0]


def compiled_forward_ran():
    """What a ddp_fusion model's first compiled forward asks for (grad_sync.py)."""
    effects.want(effects.COMPILED_AUTOGRAD)


def test_off_restores_a_compiled_autograd_context_opened_before():
    multithreading = torch._C._is_multithreading_enabled()
    with compiled_autograd._enable(torch.compile):
        users = current_compiler()
        with ddp_fusion.config.patch(enabled=True):
            compiled_forward_ran()
            assert current_compiler() is not users
            assert not torch._C._is_multithreading_enabled()
        assert current_compiler() is users and compiled_autograd.compiled_autograd_enabled
    assert current_compiler() is None and not compiled_autograd.compiled_autograd_enabled
    assert torch._C._is_multithreading_enabled() == multithreading


def test_off_inside_a_context_opened_after_is_refused_clearly_and_changes_nothing():
    ddp_fusion.config.enabled = True
    try:
        compiled_forward_ran()
        ours = current_compiler()
        with compiled_autograd._enable(torch.compile):
            with pytest.raises(RuntimeError, match="turn ddp_fusion off after leaving that context"):
                ddp_fusion.config.enabled = False
            assert ddp_fusion.config.enabled
        assert current_compiler() is ours
    finally:
        ddp_fusion.config.enabled = False
    assert current_compiler() is None and not compiled_autograd.compiled_autograd_enabled


def test_dtensor_clone_patch_only_while_enabled():
    original = compiled_autograd.maybe_clone
    with ddp_fusion.config.patch(enabled=True):
        effects.want(effects.DTENSOR_CLONE)  # what a model with DTensor parameters asks
        assert compiled_autograd.maybe_clone is not original
    assert compiled_autograd.maybe_clone is original


def test_torch_ddp_built_before_the_flag_gets_an_error_naming_ddp_fusion_at_forward():
    stock = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    with ddp_fusion.config.patch(enabled=True):
        with pytest.raises(RuntimeError, match=r"ddp_fusion.config.enabled is on.*constructed "
                                               r"while it was off.*C\+\+ reducer.*before wrapping"):
            stock(torch.randn(2, 4))
    stock(torch.randn(2, 4))  # off again: the forward runs (fake group: no backward)


def test_backward_compile_kwargs_reach_backward_graphs_and_peak_memory_reorder_is_scoped():
    """An Inductor option given in ``backward_compile_kwargs`` (a custom pre-pass that
    records each graph) reaches every backward graph; Inductor's peak-memory reordering
    is off only for the backward graph that holds ddp_fusion's collectives."""
    seen = []

    def record(graph):
        ours = any("ddp_fusion" in str(n.target) for n in graph.nodes)
        seen.append((ours, inductor_config.reorder_for_peak_memory))

    torch._dynamo.reset()
    torch.manual_seed(0)
    wrapped = ddp_fusion.DistributedDataParallel(torch.nn.Linear(8, 8))
    plain = torch.nn.Linear(8, 8)
    with ddp_fusion.config.patch(
        enabled=True, backward_compile_kwargs={"options": {"post_grad_custom_pre_pass": record}}
    ):
        torch.compile(wrapped)(torch.randn(2, 8)).sum().backward()
        torch.compile(plain)(torch.randn(2, 8)).sum().backward()
    # forward graphs do not get the option: only the two backward graphs are recorded
    assert sorted(seen) == [(False, True), (True, False)], seen


@pytest.mark.parametrize(
    "value, match",
    [({"backend": "eager"}, "unsupported torch.compile argument 'backend'"),
     ({"mode": "fast"}, r"\['mode'\] has an invalid value"),
     ("max-autotune", "must be a dict")],
)
def test_bad_backward_compile_kwargs(value, match):
    with pytest.raises(ValueError, match=match):
        ddp_fusion.config.backward_compile_kwargs = value
