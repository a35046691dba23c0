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
