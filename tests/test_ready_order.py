"""Learning eager autograd's ready order (ddp_fusion/ready_order.py) leaves the model as
it was, copes with any forward arguments, and says so when it cannot learn (one
process, fake group of 2)."""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

import ddp_fusion
from ddp_fusion import effects, ready_order

pytestmark = pytest.mark.usefixtures("fake_pg")


class LazyCache(torch.nn.Module):
    """Builds a tensor cache on its first forward (as rotary embeddings often do)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.cache = None

    def forward(self, x):
        if self.cache is None or self.cache.shape[0] < x.shape[0]:
            self.cache = torch.arange(x.shape[0], dtype=x.dtype)[:, None]
        return self.lin(x) * self.cache[: x.shape[0]]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_state_built_by_the_fake_run_does_not_leak_into_the_model(compiled):
    """Compiled, the order is learned (a fake run at trace time); eager, the eager
    reducer needs none and nothing runs."""
    torch._dynamo.reset()
    net = LazyCache()
    with ddp_fusion.config.patch(enabled=True):
        wrapper = ddp_fusion.DistributedDataParallel(net)
        model = torch.compile(wrapper) if compiled else wrapper
        model(torch.randn(3, 4)).sum().backward()
    assert (wrapper._state.ready_position is not None) == compiled
    assert type(net.cache) is torch.Tensor
    torch.testing.assert_close(net.cache, torch.arange(3.0)[:, None])


class Config:
    scale = 2.0


class WithOptions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, *, cfg, act, mask=None):
        return act(self.b(self.a(x))) * cfg.scale


@pytest.mark.parametrize("enabled", [True, False])
def test_forward_arguments_dynamo_cannot_make_proxies_of(enabled):
    """A config object and a function as keyword arguments: the compiled wrapper runs
    (with or without fusion), and the order is learned from them."""
    torch._dynamo.reset()
    with ddp_fusion.config.patch(enabled=enabled):
        wrapper = ddp_fusion.DistributedDataParallel(WithOptions())
        out = torch.compile(wrapper)(torch.randn(2, 4), cfg=Config(), act=torch.tanh)
        out.sum().backward()
    learned = wrapper._state.ready_position
    if enabled:  # b's gradients are ready first, bias before weight
        assert [n for _, n in sorted(zip(learned, ["a.weight", "a.bias", "b.weight", "b.bias"]))] == [
            "b.bias", "b.weight", "a.bias", "a.weight"
        ]
    else:
        assert learned is None


@dataclasses.dataclass
class Out:
    y: torch.Tensor


class DataclassOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return Out(self.lin(x))


def test_output_the_fake_run_cannot_see_into_is_reported(caplog):
    """A plain dataclass output (not a pytree): no order can be learned; a warning and
    a counter say that buckets follow the graph's order."""
    torch._dynamo.reset()
    counters.clear()
    with ddp_fusion.config.patch(enabled=True):
        wrapper = ddp_fusion.DistributedDataParallel(DataclassOut())
        torch.compile(wrapper)(torch.randn(2, 4))
    assert wrapper._state.ready_position is None
    assert counters["ddp_fusion"]["ready order: graph's"] == 1
    assert any("could not learn eager autograd's ready order" in r.message and "Out" in r.message
               for r in caplog.records)


def test_gradients_of_a_wrapper_that_never_learned_are_reported(caplog):
    """The inner module compiled and called without the wrapper, while compiled
    autograd is on (another model ran compiled in the process): the wrapper's hooks
    still tag the gradients, with no ready order; the pass says it uses graph order."""
    torch._dynamo.reset()
    counters.clear()
    ready_order._warned.clear()  # warned once per reason: another test may have seen it
    with torch._inductor.config.patch(fx_graph_cache=False), ddp_fusion.config.patch(enabled=True):
        effects.want(effects.COMPILED_AUTOGRAD)
        wrapper = ddp_fusion.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4)))
        torch.compile(wrapper.module)(torch.randn(2, 4)).sum().backward()
    assert wrapper._state.ready_position is None
    assert counters["ddp_fusion"]["ready order: graph's"] == 1
    assert counters["ddp_fusion"]["buckets"] == 1  # still fused
    assert any("carry no ready order" in r.message for r in caplog.records)


class CompiledInside(torch.nn.Module):
    """A torch.compile'd submodule and function inside the model (Lightning compiles a
    LightningModule's training_step, which its DDP then calls)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.compile(torch.nn.Linear(8, 8))
        self.act = torch.compile(lambda x: torch.tanh(x) * 2)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_compiled_code_inside_the_model_runs_eagerly_in_the_fake_run(compiled):
    """Before, the fake run called the inner functions' compiled code with fake tensors:
    uncompiled wrapper, the order was not learned (a warning); compiled wrapper, the
    compiled kernel read fake data and the process segfaulted. The subprocess keeps a
    crash from taking the test run with it."""
    import subprocess
    import sys

    code = (
        "import torch, torch.distributed as dist, ddp_fusion\n"
        "from ddp_fusion import _torch\n"
        "from test_ready_order import CompiledInside\n"
        "dist.init_process_group('fake', store=_torch.distributed.fake_store(), rank=0, world_size=2)\n"
        "ddp_fusion.config.enabled = True\n"
        "wrapper = ddp_fusion.DistributedDataParallel(CompiledInside())\n"
        f"model = torch.compile(wrapper) if {compiled} else wrapper\n"
        "model(torch.randn(4, 8)).sum().backward()\n"
        "print(wrapper._state.ready_position, dict(_torch.dynamo.counters()['ddp_fusion']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=__import__("os").path.dirname(__file__))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("(3, 2, 1, 0) "), proc.stdout  # eager autograd's order
    assert "ready order: graph's" not in proc.stdout, proc.stdout


class Checkpointed(torch.nn.Module):
    """Activation checkpointing (torch.utils.checkpoint, non-reentrant), as large models
    use it: backward recomputes the block's forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.utils.checkpoint.checkpoint(
            lambda y: torch.tanh(self.a(y)), x, use_reentrant=False))


def test_order_is_learned_under_activation_checkpointing(caplog):
    """Issue 31: the fake run does forward and backward in one ``functional_call``, so the
    recompute in backward sees the fake parameters. Before, it failed ("convert all
    Tensors to FakeTensors"), buckets fell back to the graph's order, and a second warning
    blamed ``enabled`` turned on after compiling."""
    torch._dynamo.reset()
    counters.clear()
    ready_order._warned.clear()
    with ddp_fusion.config.patch(enabled=True):
        wrapper = ddp_fusion.DistributedDataParallel(Checkpointed())
        torch.compile(wrapper)(torch.randn(2, 8)).sum().backward()
    # learned, in eager autograd's order: b.bias, b.weight, a.bias, a.weight
    assert wrapper._state.ready_position == (3, 2, 1, 0), wrapper._state.ready_position
    assert counters["ddp_fusion"]["ready order: graph's"] == 0
    assert not [r.message for r in caplog.records if r.levelname == "WARNING"]
