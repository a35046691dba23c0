"""``ddp_fusion.config``: validation names the setting, env variables parse strictly,
``patch`` restores, and the wrapper rejects bad arguments before touching the network."""

import pytest
import torch

import ddp_fusion
from ddp_fusion.config import Config, from_env


@pytest.mark.parametrize(
    "name, value",
    [("enabled", 1), ("enabled", "yes"), ("algorithm", "ring"), ("schedule_waits", None),
     ("dump_dir", 3), ("dump_dir", "")],
)
def test_bad_value_names_the_setting(name, value):
    with pytest.raises(ValueError, match=f"ddp_fusion.config.{name}"):
        setattr(Config(), name, value)


def test_unknown_setting():
    with pytest.raises(AttributeError, match="no setting 'bucket_cap'"):
        Config().bucket_cap = 5


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"DDP_FUSION": "1"}, {"enabled": True}),
        ({"DDP_FUSION": "off"}, {"enabled": False}),
        ({"DDP_FUSION_ALGORITHM": "coalesced"}, {"algorithm": "coalesced"}),
        ({"DDP_FUSION_SCHEDULE_WAITS": "0"}, {"schedule_waits": False}),
        ({"DDP_FUSION_DUMP_DIR": "/tmp/d"}, {"dump_dir": "/tmp/d"}),
        ({}, {}),
    ],
)
def test_env(env, expected):
    assert from_env(env) == expected


@pytest.mark.parametrize(
    "env, var",
    [({"DDP_FUSION": "maybe"}, "DDP_FUSION"),
     ({"DDP_FUSION_ALGORITHM": "tree"}, "DDP_FUSION_ALGORITHM"),
     ({"DDP_FUSION_SCHEDULE_WAITS": "2"}, "DDP_FUSION_SCHEDULE_WAITS")],
)
def test_bad_env_names_the_variable(env, var):
    with pytest.raises(ValueError, match=var):
        from_env(env)


def test_patch_restores_even_on_error():
    cfg = ddp_fusion.config
    before = cfg.as_dict()
    with pytest.raises(RuntimeError):
        with cfg.patch(algorithm="coalesced", schedule_waits=False):
            assert (cfg.algorithm, cfg.schedule_waits) == ("coalesced", False)
            raise RuntimeError
    assert cfg.as_dict() == before


def test_patch_rejects_bad_value_and_keeps_old():
    with pytest.raises(ValueError, match="algorithm"):
        with ddp_fusion.config.patch(algorithm="nope"):
            pass
    assert ddp_fusion.config.algorithm == "concat"


@pytest.mark.usefixtures("fake_pg")
class TestWrapperArguments:
    def test_bad_bucket_cap(self):
        with pytest.raises(ValueError, match="bucket_cap_mb"):
            ddp_fusion.DistributedDataParallel(torch.nn.Linear(2, 2), bucket_cap_mb=-5)

    def test_already_wrapped(self):
        inner = ddp_fusion.DistributedDataParallel(torch.nn.Linear(2, 2))
        with pytest.raises(ValueError, match="already wrapped"):
            ddp_fusion.DistributedDataParallel(inner)

    def test_integer_parameter(self):
        m = torch.nn.Linear(2, 2)
        m.register_parameter("count", torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False))
        ddp_fusion.DistributedDataParallel(m)  # frozen: fine
        m.extra = torch.nn.Parameter(torch.zeros(1, dtype=torch.float16).to_sparse())
        with pytest.raises(ValueError, match="'extra'"):
            ddp_fusion.DistributedDataParallel(m)

    def test_bad_process_group(self):
        with pytest.raises(TypeError, match="process_group"):
            ddp_fusion.DistributedDataParallel(torch.nn.Linear(2, 2), process_group="world")

    def test_uncompiled_step_reduces_each_gradient(self):
        """Fake group of 2: the all-reduce sums nothing, so the mean halves the grad."""
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 2)
        ddp = ddp_fusion.DistributedDataParallel(m)
        x = torch.randn(4, 3)
        ddp(x).sum().backward()
        want = torch.autograd.grad(torch.nn.functional.linear(x, m.weight, m.bias).sum(), m.weight)[0]
        torch.testing.assert_close(m.weight.grad, want / 2)
        m.weight.grad = None
        with ddp.no_sync():
            ddp(x).sum().backward()
        torch.testing.assert_close(m.weight.grad, want)


@pytest.mark.usefixtures("fake_pg")
def test_warns_once_when_enabled_but_backward_not_compiled(caplog):
    from torch._dynamo.utils import counters

    from ddp_fusion import _torch, ddp as ddp_module

    ddp = ddp_fusion.DistributedDataParallel(torch.nn.Linear(3, 2))
    counters.clear()
    ddp_module._warned_not_compiled.clear()
    with ddp_fusion.config.patch(enabled=True):
        with _torch.disable_compiled_autograd():
            for _ in range(2):
                ddp(torch.randn(4, 3)).sum().backward()
    assert counters["ddp_fusion"]["unfused: compiled autograd not active"] == 4  # 2 params x 2
    assert sum("outside compiled autograd" in r.message for r in caplog.records) == 1


@pytest.mark.usefixtures("fake_pg")
def test_failed_backward_leaves_the_reducer_usable():
    """A backward that raises after some gradients were reduced (its end-of-backward
    callback never runs); the next step must still reduce every gradient."""

    class FailOnce(torch.autograd.Function):
        fail = True

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            if FailOnce.fail:
                FailOnce.fail = False
                raise RuntimeError("injected failure")
            return g

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    ddp = ddp_fusion.DistributedDataParallel(net, bucket_cap_mb=0)  # a bucket per grad
    x = torch.randn(4, 3)

    def loss():
        return ddp.module[1](FailOnce.apply(ddp.module[0](x))).sum()

    with pytest.raises(RuntimeError, match="injected failure"):
        loss().backward()  # layer 1's gradients were reduced, layer 0's never came
    for p in net.parameters():
        p.grad = None
    loss().backward()
    ref = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    ref.load_state_dict(net.state_dict())
    ref(x).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):  # fake group of 2: halved
        torch.testing.assert_close(p.grad, q.grad / 2)
