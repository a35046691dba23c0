"""``ddp_fusion.config``: validation names the setting, env variables parse strictly,
``patch`` restores, and the wrapper rejects bad arguments before touching the network.
A bad ``DDP_FUSION*`` value never breaks ``import torch`` (torch imports ddp_fusion
through its entry point): it is a warning there, the setting keeps its default, and the
``ValueError`` naming the variable comes at the first DDP model built, unless code has
set the setting since (code beats the environment).

README's "Bad input, and what happens", row by row:

* bad ``config`` values: ``test_bad_value_names_the_setting``; unknown setting:
  ``test_unknown_setting``; bad env values: ``test_bad_env_names_the_variable`` and, in
  a fresh interpreter, ``test_bad_env_value_is_a_warning_at_import_and_an_error_at_the_first_ddp``;
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
import json
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
     ("max_in_flight_mb", float("inf")), ("bucket_cap_mb", 0), ("bucket_cap_mb", -25),
     ("bucket_cap_mb", "25"), ("bucket_cap_mb", True), ("bucket_cap_mb", float("nan")),
     ("bucket_cap_mb", "AUTO"),
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
        ({"DDP_FUSION": " Yes "}, {"enabled": True}),
        ({"DDP_FUSION": "FALSE"}, {"enabled": False}),
        ({"DDP_FUSION": ""}, {}),  # empty: unset
        ({"DDP_FUSION_ALGORITHM": "coalesced"}, {"algorithm": "coalesced"}),
        ({"DDP_FUSION_SCHEDULE_WAITS": "0"}, {"schedule_waits": False}),
        ({"DDP_FUSION_DUMP_DIR": "/tmp/d"}, {"dump_dir": "/tmp/d"}),
        ({"DDP_FUSION_MAX_IN_FLIGHT_MB": "64"}, {"max_in_flight_mb": 64.0}),
        ({"DDP_FUSION_MAX_IN_FLIGHT_MB": "None"}, {"max_in_flight_mb": None}),
        ({"DDP_FUSION_BUCKET_CAP_MB": "auto"}, {"bucket_cap_mb": "auto"}),
        ({"DDP_FUSION_BUCKET_CAP_MB": "25"}, {"bucket_cap_mb": 25.0}),
        ({"DDP_FUSION_BUCKET_CAP_MB": "0.5"}, {"bucket_cap_mb": 0.5}),
        ({"DDP_FUSION_LINK": "30,12.5"}, {"link": (30.0, 12.5)}),
        ({}, {}),
    ],
)
def test_env(env, expected):
    assert from_env(env) == (expected, {})


BOOLEANS = "must be one of 1, 0, true, false, yes, no, on, off (any case), got "


@pytest.mark.parametrize(
    "env, setting, message",
    [({"DDP_FUSION": "maybe"}, "enabled", "DDP_FUSION " + BOOLEANS + "'maybe'"),
     ({"DDP_FUSION": "2"}, "enabled", "DDP_FUSION " + BOOLEANS + "'2'"),
     ({"DDP_FUSION_ALGORITHM": "tree"}, "algorithm",
      "DDP_FUSION_ALGORITHM must be one of concat, coalesced, got 'tree'"),
     ({"DDP_FUSION_SCHEDULE_WAITS": "2"}, "schedule_waits", "DDP_FUSION_SCHEDULE_WAITS " + BOOLEANS + "'2'"),
     ({"DDP_FUSION_MAX_IN_FLIGHT_MB": "-1"}, "max_in_flight_mb",
      "DDP_FUSION_MAX_IN_FLIGHT_MB must be a positive number of MiB or 'none', got '-1'"),
     ({"DDP_FUSION_BUCKET_CAP_MB": "25MB"}, "bucket_cap_mb",
      "DDP_FUSION_BUCKET_CAP_MB must be 'auto' or a positive number of MiB, got '25MB'"),
     ({"DDP_FUSION_BUCKET_CAP_MB": "0"}, "bucket_cap_mb",
      "DDP_FUSION_BUCKET_CAP_MB must be 'auto' or a positive number of MiB, got '0'"),
     ({"DDP_FUSION_LINK": "30"}, "link", "DDP_FUSION_LINK must be 'latency_us,gbytes_per_s'"),
     ({"DDP_FUSION_LINK": "garbage"}, "link", "DDP_FUSION_LINK must be 'latency_us,gbytes_per_s'"),
     ({"DDP_FUSION_BACKWARD_COMPILE_KWARGS": "{"}, "backward_compile_kwargs",
      "DDP_FUSION_BACKWARD_COMPILE_KWARGS must be a JSON object")],
)
def test_bad_env_names_the_variable(env, setting, message):
    """A bad value gives no setting, and an error naming the variable, the value and
    what is accepted."""
    values, errors = from_env({**env, "DDP_FUSION_DUMP_DIR": "/tmp/d"})
    assert values == {"dump_dir": "/tmp/d"}  # the good ones still apply
    assert list(errors) == [setting]
    assert errors[setting].startswith("environment variable " + message), errors


# Each bad value the way torch meets it: through the entry point at `import torch`
# (ddp_fusion imported there, a warning); then the first torch DDP and the first
# wrapper raise the error; after code sets the setting (to its default), both build.
BAD_ENV = """
import json, sys, torch
print("imported", "ddp_fusion" in sys.modules, flush=True)
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import ddp_fusion
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
def builds():
    errors = []
    for build in (torch.nn.parallel.DistributedDataParallel, ddp_fusion.DistributedDataParallel):
        try:
            build(torch.nn.Linear(2, 2))
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors
first = builds()
setting = sys.argv[1]
setattr(ddp_fusion.config, setting, getattr(ddp_fusion.config, setting))  # code sets it
print(json.dumps({"first": first, "after_code": builds(), "enabled": ddp_fusion.config.enabled}))
"""

BAD_VALUES = {  # variable: (value, setting, what the message says is accepted)
    "DDP_FUSION": ("2", "enabled", BOOLEANS),
    "DDP_FUSION_LINK": ("garbage", "link", "must be 'latency_us,gbytes_per_s'"),
    "DDP_FUSION_ALGORITHM": ("tree", "algorithm", "must be one of concat, coalesced, got "),
    "DDP_FUSION_BUCKET_CAP_MB": ("25MB", "bucket_cap_mb", "must be 'auto' or a positive number of MiB"),
}

# DDP_FUSION=1 with enabled = False in code: off (code beats the environment)
CODE_BEATS_ENV = """
import json, os, torch, ddp_fusion
ddp_fusion.config.enabled = False
init = torch.nn.parallel.DistributedDataParallel.__init__
ours = os.path.dirname(ddp_fusion.__file__) + os.sep  # not the path's text: CI's venv is /tmp/ddp_fusion_ci.*
print(json.dumps({"patched": init.__code__.co_filename.startswith(ours)}))
"""


@pytest.fixture(scope="module")
def fresh_imports():
    """Fresh interpreters, run side by side: ``BAD_ENV`` with each of ``BAD_VALUES``, and
    ``CODE_BEATS_ENV``. Returns ``{name: CompletedProcess}``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_FUSION")}
    runs = {var: ([BAD_ENV, setting], {var: value}) for var, (value, setting, _) in BAD_VALUES.items()}
    runs["code_beats_env"] = ([CODE_BEATS_ENV], {"DDP_FUSION": "1"})
    procs = {
        name: subprocess.Popen([sys.executable, "-c", *args], env={**env, **extra}, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for name, (args, extra) in runs.items()
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("var", BAD_VALUES)
def test_bad_env_value_is_a_warning_at_import_and_an_error_at_the_first_ddp(fresh_imports, var):
    value, setting, accepted = BAD_VALUES[var]
    run = fresh_imports[var]
    assert run.returncode == 0, run.stderr
    assert "Failed to load the backend extension" not in run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "imported True", run.stdout
    (warning,) = [line for line in run.stderr.splitlines() if var in line]
    assert warning.startswith(f"ddp_fusion: environment variable {var} {accepted}"), warning
    assert f"got {value!r}; ignored, so ddp_fusion.config.{setting} keeps its default" in warning
    result = json.loads(lines[-1])
    for error in result["first"]:  # torch's DDP, then the wrapper
        assert error is not None and error.startswith(f"environment variable {var} {accepted}"), error
        assert f"set ddp_fusion.config.{setting} in code" in error
    assert result["after_code"] == [None, None]
    assert result["enabled"] is False


def test_code_beats_the_environment(fresh_imports):
    run = fresh_imports["code_beats_env"]
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == {"patched": False}


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

    def test_sparse_embedding(self):
        # its gradient is sparse: refused at construction, naming the module (an
        # uncompiled backward failed in the hook with "reshape is not implemented for
        # sparse tensors"); frozen, or not reduced, it is fine
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Embedding(10, 4, sparse=True))
        sparse = r"^DistributedDataParallel: module '1' is an embedding with sparse=True"
        with pytest.raises(NotImplementedError, match=sparse):
            ddp_fusion.DistributedDataParallel(m)
        m[1].requires_grad_(False)
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
