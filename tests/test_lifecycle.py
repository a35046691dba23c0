"""A wrapper's hooks live as long as the wrapper: once it is deleted, the bare module
trains locally (no communication), and a module whose parameters are hooked by a live
wrapper cannot be wrapped a second time (it would reduce every gradient twice)."""

import gc

import pytest
import torch

import ddp_fusion

pytestmark = pytest.mark.usefixtures("fake_pg")


def local_grads(net, x):
    return torch.autograd.grad(net(x).sum(), list(net.parameters()))


def grads_of_step(model, net, x):
    for p in net.parameters():
        p.grad = None
    model(x).sum().backward()
    return [p.grad for p in net.parameters()]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_deleted_wrapper_leaves_no_hooks(compiled):
    """Fake group of 2: a reduced gradient is half the local one, so a hook left behind
    shows as a halved gradient after the wrapper is gone."""
    torch.manual_seed(0)
    net, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    want = local_grads(net, x)
    with ddp_fusion.config.patch(enabled=compiled):
        wrapper = ddp_fusion.DistributedDataParallel(net)
        model = torch.compile(wrapper) if compiled else wrapper
        for got, w in zip(grads_of_step(model, net, x), want):
            torch.testing.assert_close(got, w / 2)
        del model, wrapper
        gc.collect()
        for got, w in zip(grads_of_step(net, net, x), want):
            torch.testing.assert_close(got, w)


def test_second_wrapper_of_hooked_parameters_is_refused_until_the_first_is_gone():
    net = torch.nn.Sequential(torch.nn.Linear(3, 2))
    first = ddp_fusion.DistributedDataParallel(net)
    with pytest.raises(ValueError, match=r"parameter '0.weight' already carries .* live"):
        ddp_fusion.DistributedDataParallel(net)
    with pytest.raises(ValueError, match=r"parameter 'weight' already carries"):
        ddp_fusion.DistributedDataParallel(net[0])  # a submodule: same parameters
    del first
    gc.collect()
    ddp_fusion.DistributedDataParallel(net)  # fine now


def test_a_model_made_again_takes_what_the_one_before_learned_at_its_first_compiled_forward():
    """A k-fold loop: the same model made again (same names, so the same model id) runs
    with the forward code Dynamo traced for the one before, where the trace-time first
    forward work does not run. It takes that one's ready order and counts as compiled
    (join() reads it); made again and run eagerly, it does not count as compiled."""
    from collections import OrderedDict

    from ddp_fusion import _torch

    def make():
        torch.manual_seed(0)
        net = torch.nn.Sequential(OrderedDict(
            made_again_a=torch.nn.Linear(3, 4), made_again_t=torch.nn.Tanh(),
            made_again_b=torch.nn.Linear(4, 2)))
        return net, ddp_fusion.DistributedDataParallel(net)

    counters = _torch.dynamo.counters()["ddp_fusion"]
    x = torch.randn(4, 3)
    with ddp_fusion.config.patch(enabled=True):
        net, first = make()
        torch.compile(first)(x).sum().backward()
        learned = first._state.ready_position
        assert first._state.ready_learned and learned is not None
        del first
        gc.collect()
        counters.clear()
        for _ in range(2):  # (the second time, the record is the first copy's)
            net, again = make()
            torch.compile(again)(x).sum().backward()
            assert again._state.compiled and again._state.ready_position == learned
            assert counters["ready order: graph's"] == 0, dict(counters)
            assert net.made_again_a.weight.grad is not None
            del again
            gc.collect()
        net, eager = make()
        eager(x).sum().backward()
        assert not eager._state.compiled
        assert not [k for k in counters if k.startswith("unfused")], dict(counters)
