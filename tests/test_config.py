"""``ddp_fusion.config``: validation names the setting, env variables parse strictly
(and are applied at import), ``patch`` restores, and the wrapper rejects bad arguments
before touching the network.

README's "Bad input, and what happens", row by row:

* bad ``config`` values: ``test_bad_value_names_the_setting``; unknown setting:
  ``test_unknown_setting``; bad env values: ``test_bad_env_names_the_variable`` and, at
  import, ``test_bad_env_value_fails_at_import``;
* bucket arguments, ``process_group`` / ``device_mesh``, ``comm_dtype`` /
  ``reduce_dtype``, already wrapped, sparse parameter, several device types, no
  trainable parameter, ``torch.distributed`` not initialized: ``TestWrapperArguments``;
* different models on different ranks, and a parameter unused on some ranks under
  ``torch.compile``: ``test_reliability_gloo.py``
  (``test_different_models_fail_at_construction_on_every_rank``,
  ``test_rank_dependent_backward_raises_plan_mismatch_on_every_rank``); unused on some
  ranks, uncompiled: ``test_semantics_gloo.py::test_unused_parameters``.
"""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import ddp_fusion
from ddp_fusion.config import Config, from_env


@pytest.mark.parametrize(
    "name, value",
    [("enabled", 1), ("enabled", "yes"), ("algorithm", "ring"), ("schedule_waits", None),
     ("dump_dir", 3), ("dump_dir", ""), ("max_in_flight_mb", 0), ("max_in_flight_mb", "5"),
     ("max_in_flight_mb", float("inf")), ("bucket_cap_mb", 25), ("bucket_cap_mb", "AUTO"),
     ("link", (30,)), ("link", (30, 0)), ("link", (-1, 10)), ("link", "30,10")],
)
def test_bad_value_names_the_setting(name, value):
    with pytest.raises(ValueError, match=f"^ddp_fusion.config.{name} must be "):
        setattr(Config(), name, value)


def test_unknown_setting():
    settings = ", ".join(f.name for f in dataclasses.fields(Config))
    with pytest.raises(AttributeError, match=f"no setting 'bucket_cap'; settings are {settings}$"):
        Config().bucket_cap = 5


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"DDP_FUSION": "1"}, {"enabled": True}),
        ({"DDP_FUSION": "off"}, {"enabled": False}),
        ({"DDP_FUSION_ALGORITHM": "coalesced"}, {"algorithm": "coalesced"}),
        ({"DDP_FUSION_SCHEDULE_WAITS": "0"}, {"schedule_waits": False}),
        ({"DDP_FUSION_DUMP_DIR": "/tmp/d"}, {"dump_dir": "/tmp/d"}),
        ({"DDP_FUSION_MAX_IN_FLIGHT_MB": "64"}, {"max_in_flight_mb": 64.0}),
        ({"DDP_FUSION_MAX_IN_FLIGHT_MB": "None"}, {"max_in_flight_mb": None}),
        ({"DDP_FUSION_BUCKET_CAP_MB": "auto"}, {"bucket_cap_mb": "auto"}),
        ({"DDP_FUSION_LINK": "30,12.5"}, {"link": (30.0, 12.5)}),
        ({}, {}),
    ],
)
def test_env(env, expected):
    assert from_env(env) == expected


@pytest.mark.parametrize(
    "env, var",
    [({"DDP_FUSION": "maybe"}, "DDP_FUSION"),
     ({"DDP_FUSION_ALGORITHM": "tree"}, "DDP_FUSION_ALGORITHM"),
     ({"DDP_FUSION_SCHEDULE_WAITS": "2"}, "DDP_FUSION_SCHEDULE_WAITS"),
     ({"DDP_FUSION_MAX_IN_FLIGHT_MB": "-1"}, "DDP_FUSION_MAX_IN_FLIGHT_MB"),
     ({"DDP_FUSION_BUCKET_CAP_MB": "25"}, "DDP_FUSION_BUCKET_CAP_MB"),
     ({"DDP_FUSION_LINK": "30"}, "DDP_FUSION_LINK"),
     ({"DDP_FUSION_LINK": "fast,slow"}, "DDP_FUSION_LINK")],
)
def test_bad_env_names_the_variable(env, var):
    with pytest.raises(ValueError, match=var):
        from_env(env)


IMPORT_STATE = """
import torch._dynamo.compiled_autograd as ca, torch._inductor.config as inductor, ddp_fusion
print(f"installed={inductor.post_grad_custom_post_pass is ddp_fusion._install.THE_PASS}",
      f"compiled_autograd={ca.compiled_autograd_enabled}")
ddp_fusion.config.enabled = False
print(f"removed={inductor.post_grad_custom_post_pass is None}",
      f"compiled_autograd={ca.compiled_autograd_enabled}")
"""


@pytest.fixture(scope="module")
def fresh_imports():
    """``import ddp_fusion`` in fresh interpreters, run side by side: with
    ``DDP_FUSION=1`` (prints what is installed, then again after ``enabled = False``),
    and with ``DDP_FUSION=maybe``. Returns ``{env value: CompletedProcess}``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_FUSION")}
    procs = {
        value: subprocess.Popen(
            [sys.executable, "-c", IMPORT_STATE],
            env={**env, "DDP_FUSION": value},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for value in ("1", "maybe")
    }
    out = {}
    for value, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[value] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


def test_env_enabled_at_import_installs_the_pass_not_yet_compiled_autograd(fresh_imports):
    """``DDP_FUSION=1``: importing ddp_fusion installs its pass as Inductor's
    ``post_grad_custom_post_pass`` (so the first value is not true by default); compiled
    autograd waits for a model's first compiled forward; clearing ``enabled`` removes
    the pass."""
    run = fresh_imports["1"]
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == [
        "installed=True compiled_autograd=False", "removed=True compiled_autograd=False"
    ], run.stdout


def test_bad_env_value_fails_at_import(fresh_imports):
    """At torch's import (the entry point loads ddp_fusion), naming the variable."""
    run = fresh_imports["maybe"]
    assert run.returncode != 0
    assert (
        "ValueError: environment variable DDP_FUSION must be 1 or 0 (true/false), got 'maybe'"
        in run.stderr.splitlines()
    ), run.stderr


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
    @pytest.mark.parametrize(
        "bad, match",
        [
            (dict(bucket_cap_mb=-1), "^bucket_cap_mb must be"),
            (dict(bucket_cap_mb="25"), "^bucket_cap_mb must be"),
            (dict(bucket_cap_mb=float("nan")), "^bucket_cap_mb must be"),
            (dict(bucket_cap_mb=True), "^bucket_cap_mb must be"),
            (dict(bucket_cap_mb_list=[]), "^bucket_cap_mb_list must not be empty"),
            (dict(bucket_cap_mb_list=[1, -2]), r"^bucket_cap_mb_list\[1\] must be"),
            (dict(bucket_cap_mb_list="1,2"), "^bucket_cap_mb_list must be a list"),
        ],
        ids=str,
    )
    def test_bad_bucket_arguments(self, bad, match):
        with pytest.raises(ValueError, match=match):
            ddp_fusion.DistributedDataParallel(torch.nn.Linear(2, 2), **bad)

    def test_meta_device_module(self):
        """A model not yet materialized: nothing to reduce; torch DDP fails obscurely."""
        with torch.device("meta"):
            m = torch.nn.Linear(2, 2)
        with pytest.raises(ValueError, match=r"parameter 'weight' is on the meta device.*to_empty"):
            ddp_fusion.DistributedDataParallel(m)

    def test_already_wrapped(self):
        inner = ddp_fusion.DistributedDataParallel(torch.nn.Linear(2, 2))
        with pytest.raises(ValueError, match="^module is already wrapped in ddp_fusion.wrapper.Distributed"):
            ddp_fusion.DistributedDataParallel(inner)
        inner = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        with pytest.raises(ValueError, match="^module is already wrapped in torch.nn.parallel"):
            ddp_fusion.DistributedDataParallel(inner)

    def test_integer_parameter(self):
        m = torch.nn.Linear(2, 2)
        count = torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
        m.register_parameter("count", count)
        ddp_fusion.DistributedDataParallel(m)  # frozen: fine
        # (torch itself refuses an integer parameter that requires grad)
        m.extra = torch.nn.Parameter(torch.zeros(1, dtype=torch.float16).to_sparse())
        with pytest.raises(ValueError, match="parameter 'extra' is torch.float16 with layout torch.sparse"):
            ddp_fusion.DistributedDataParallel(m)

    def test_bad_process_group(self):
        with pytest.raises(TypeError, match="^process_group must be a torch.distributed.ProcessGroup"):
            ddp_fusion.DistributedDataParallel(torch.nn.Linear(2, 2), process_group="world")

    def test_bad_device_mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match="^give process_group or device_mesh, not both"):
            ddp_fusion.DistributedDataParallel(
                torch.nn.Linear(2, 2), process_group=dist.group.WORLD, device_mesh=mesh["dp"]
            )
        match = r"^device_mesh must be the 1-D data-parallel sub-mesh .*dp=1, tp"
        with pytest.raises(ValueError, match=match):
            ddp_fusion.DistributedDataParallel(torch.nn.Linear(2, 2), device_mesh=mesh)

    @pytest.mark.parametrize(
        "bad, match",
        [
            (dict(comm_dtype=torch.int8), "^comm_dtype must be a floating-point torch.dtype or None, got "),
            (dict(reduce_dtype=torch.int8), "^reduce_dtype must be a floating-point torch.dtype"),
            (dict(comm_dtype="float16"), "^comm_dtype must be a floating-point torch.dtype"),
            (
                dict(comm_dtype=torch.float16, reduce_dtype=torch.float32),
                r"^comm_dtype \(torch.float16\) and reduce_dtype \(torch.float32\) name the same thing",
            ),
        ],
        ids=str,
    )
    def test_bad_comm_dtype(self, bad, match):
        with pytest.raises(ValueError, match=match):
            ddp_fusion.DistributedDataParallel(torch.nn.Linear(2, 2), **bad)

    def test_several_device_types(self):
        m = torch.nn.Linear(2, 2)
        m.elsewhere = torch.nn.Parameter(torch.zeros(2, device="meta"))
        with pytest.raises(ValueError, match=r"parameters span device types \['cpu', 'meta'\]"):
            ddp_fusion.DistributedDataParallel(m)

    def test_no_trainable_parameter(self):
        with pytest.raises(ValueError, match="module has no parameter that requires grad"):
            ddp_fusion.DistributedDataParallel(torch.nn.Linear(2, 2).requires_grad_(False))
        with pytest.raises(ValueError, match="module has no parameter that requires grad"):
            ddp_fusion.DistributedDataParallel(torch.nn.ReLU())

    def test_distributed_not_initialized(self, monkeypatch):
        """What torch reports before ``init_process_group`` (this process has the fake
        group, so ``is_initialized`` is patched), for the wrapper and the op alike."""
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
        match = r"torch.distributed is not initialized; call torch.distributed.init_process_group\(\)"
        with pytest.raises(RuntimeError, match=f"^DistributedDataParallel: {match}"):
            ddp_fusion.DistributedDataParallel(torch.nn.Linear(2, 2))
        with pytest.raises(RuntimeError, match=f"^all_reduce_gradient: {match}"):
            ddp_fusion.all_reduce_gradient(torch.ones(2))

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
def test_warns_once_when_a_compiled_model_reduces_outside_compiled_autograd(caplog):
    from torch._dynamo.utils import counters

    from ddp_fusion import _torch, grad_sync

    with ddp_fusion.config.patch(enabled=True):
        ddp = torch.compile(ddp_fusion.DistributedDataParallel(torch.nn.Linear(3, 2)))
        counters.clear()
        grad_sync._warned.clear()
        for _ in range(2):
            loss = ddp(torch.randn(4, 3)).sum()
            with _torch.compiled_autograd.disabled():
                loss.backward()
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
