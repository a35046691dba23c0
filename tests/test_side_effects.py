"""What ``ddp_fusion.config.enabled = True`` changes in the process is undone when it
goes off (every setting, in every order of a user's own compiled-autograd context
against ddp_fusion turning compiled autograd on and off), stays out of graphs that are
not ddp_fusion's, and lets the user's compile options reach the backward graphs (user
guide: "What `enabled = True` changes in the process")."""

import itertools

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo import compiled_autograd
from torch.distributed._composable.replicate import _ReplicateState

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


DDP = torch.nn.parallel.DistributedDataParallel


def settings() -> dict:
    """Every process-wide setting that ``enabled`` and its effects may change."""
    return {
        "post_grad_custom_post_pass": inductor_config.post_grad_custom_post_pass,
        "compiled autograd's compiler": current_compiler(),
        "compiled_autograd_enabled": compiled_autograd.compiled_autograd_enabled,
        "autograd multithreading": torch._C._is_multithreading_enabled(),
        "DDP.__init__": DDP.__dict__["__init__"],
        "DDP._pre_forward": DDP.__dict__["_pre_forward"],
        "DDP._get_active_ddp_module": DDP.__dict__["_get_active_ddp_module"],
        "_ReplicateState.init": _ReplicateState.__dict__["init"],
        "compiled_autograd.maybe_clone": compiled_autograd.maybe_clone,
    }


CA_STATE = ("compiled autograd's compiler", "compiled_autograd_enabled", "autograd multithreading")


def _orders() -> list[str]:
    """T: ``enabled = True``; C: a model asks for compiled autograd (its compiled forward,
    and DTensor parameters); F: ``enabled = False``; E / L: the user enters / leaves
    ``compiled_autograd._enable``. Every interleaving of E < L with T < C < F, and runs
    where C comes again (after the context closed, inside a context opened after ours)
    or ``compiled_autograd.reset()`` (R, what ``torch._dynamo.reset()`` does) clears it."""
    orders = []
    for where in itertools.combinations(range(5), 2):
        ours = iter("TCF")
        orders.append("".join("EL"[where.index(i)] if i in where else next(ours) for i in range(5)))
    return orders + ["TECLCF", "TCECLF", "TECLECLF", "TECLECF" + "L", "TCRF", "TCRCF", "TECRCLF"]


@pytest.mark.parametrize("asked_before", [False, True], ids=["first_ask", "asked_before"])
@pytest.mark.parametrize("order", _orders())
def test_off_restores_every_setting_in_any_order_with_a_users_compiled_autograd_context(
    order, asked_before, monkeypatch
):
    """``enabled = False`` puts back every setting as it was before ddp_fusion touched
    it. Inside a context the user opened after ddp_fusion turned compiled autograd on,
    it is refused (torch restores ddp_fusion's compiler when that context closes):
    nothing changes, and it works once the context is closed. ``asked_before``: a
    model asked for compiled autograd before the flag went on (T turns it on at once)."""
    monkeypatch.setattr(effects, "_wanted", [effects.COMPILED_AUTOGRAD] if asked_before else [])
    start = settings()
    depth, ours_at, users, refused = 0, None, None, False
    context = None
    passed = False
    try:
        for event in order:
            if event == "E":
                context = compiled_autograd._enable(torch.compile)
                context.__enter__()
                depth += 1
                users = {k: settings()[k] for k in CA_STATE}
            elif event == "L":
                context.__exit__(None, None, None)
                depth -= 1
                if ours_at is not None and ours_at > depth:
                    ours_at = None  # torch put back what was there before the context
            elif event == "T":
                ddp_fusion.config.enabled = True
                if effects.COMPILED_AUTOGRAD in effects.wanted():  # asked for before: on now
                    ours_at = depth
            elif event == "C":
                compiled_forward_ran()
                effects.want(effects.DTENSOR_CLONE)
                ours_at = depth if ours_at is None else ours_at
            elif event == "R":
                compiled_autograd.reset()
                ours_at = None
            elif event == "F" and ours_at is not None and depth > ours_at:
                before = settings()
                with pytest.raises(RuntimeError, match="turn ddp_fusion off after leaving that context"):
                    ddp_fusion.config.enabled = False
                assert ddp_fusion.config.enabled and settings() == before
                refused = True
            elif event == "F":
                ddp_fusion.config.enabled = False
                if depth:  # the user's context is as the user opened it
                    assert {k: settings()[k] for k in CA_STATE} == users
        if refused:
            ddp_fusion.config.enabled = False
        assert settings() == start
        passed = True
    finally:
        if not passed:  # leave the next test a clean process
            if depth:
                context.__exit__(None, None, None)
            _force(start)


def _force(start: dict) -> None:
    try:
        ddp_fusion.config.enabled = False
    except RuntimeError:
        pass
    inductor_config.post_grad_custom_post_pass = start["post_grad_custom_post_pass"]
    torch._C._dynamo.compiled_autograd.set_autograd_compiler(start["compiled autograd's compiler"], False)
    compiled_autograd.compiled_autograd_enabled = start["compiled_autograd_enabled"]
    torch._C._set_multithreading_enabled(start["autograd multithreading"])
    DDP.__init__ = start["DDP.__init__"]
    DDP._pre_forward = start["DDP._pre_forward"]
    DDP._get_active_ddp_module = start["DDP._get_active_ddp_module"]
    _ReplicateState.init = start["_ReplicateState.init"]
    compiled_autograd.maybe_clone = start["compiled_autograd.maybe_clone"]


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
