"""Stock ``torch.nn.parallel.DistributedDataParallel`` under the flag (issue 13), one
process with the fake group: adoption, the compiled backward it produces, and every
refusal. Training against eager DDP is in test_stock_ddp_gloo.py."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import ddp_fusion
from ddp_fusion import _install, _torch

DDP = nn.parallel.DistributedDataParallel


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


@pytest.fixture
def enabled(fake_pg):
    with ddp_fusion.config.patch(enabled=True):
        yield


def test_torch_ddp_built_with_the_flag_is_fused_in_one_compiled_backward(fake_pg, monkeypatch, tmp_path,
                                                                          dynamo_guards):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the pass must run
    torch._dynamo.reset()  # before enabling: a reset also resets compiled autograd
    counters = _torch.dynamo.counters()
    counters.clear()
    with ddp_fusion.config.patch(enabled=True):
        ddp = DDP(_net(), bucket_cap_mb=1e-4)  # 100 bytes: see the bucket count below
        assert isinstance(ddp, DDP) and type(ddp).__name__ == "DistributedDataParallel"
        model = torch.compile(ddp)
        model(torch.randn(4, 8)).sum().backward()
    fused = counters["ddp_fusion"]
    assert fused["graphs"] == 1 and fused["fused_all_reduces"] == 4, dict(fused)
    # ready order 2.bias (16 B), 2.weight (128 B) | 0.bias (32 B), 0.weight (256 B):
    # DDP closes a bucket once it reaches the 105-byte cap
    assert fused["buckets"] == 2, dict(fused)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not [k for k in fused if k.startswith("unfused")], dict(fused)
    assert counters["stats"]["unique_graphs"] == 2  # one forward, one backward graph
    # no buffers when adopted, none broadcast (as torch DDP): the forward does not look
    # for them in every module, which Dynamo would guard module by module (the DDP's own
    # buffers dict is guarded once: reading its _ddp_fusion goes through Module.__getattr__)
    text = "\n".join(dynamo_guards)
    assert "named_modules" not in text, text
    assert text.count("DictGetItemGuardAccessor('_buffers')") == 1, text


def test_the_compiled_backward_keeps_upstreams_ddp_fusion_pass_off(enabled):
    """torch DDP under optimize_ddp="python_reducer" turns upstream's pass on
    process-wide; a graph ddp_fusion fuses must not also get it."""
    gm = torch.fx.symbolic_trace(lambda g: torch.ops.ddp_fusion.all_reduce_gradient(
        g, "0", "avg", [1], "w", None, -1, 0))
    assert _install._patches_for(gm).get("_fuse_ddp_communication") is False
    plain = torch.fx.symbolic_trace(lambda g: g * 2)
    assert "_fuse_ddp_communication" not in _install._patches_for(plain)


def test_the_compiled_backward_keeps_the_pass_order_without_wait_scheduling(enabled):
    """Inductor orders its own collectives but not ddp_fusion's in-place bucket op: its
    peak-memory reordering stays off for a graph ddp_fusion fuses, ``schedule_waits`` on
    or off, so collectives run in plan order."""
    gm = torch.fx.symbolic_trace(lambda g: torch.ops.ddp_fusion.all_reduce_gradient(
        g, "0", "avg", [1], "w", None, -1, 0))
    for schedule_waits in (True, False):
        with ddp_fusion.config.patch(schedule_waits=schedule_waits):
            assert _install._patches_for(gm).get("reorder_for_peak_memory") is False


def test_the_compiled_backward_bounds_inductors_fusion_search_among_the_divisors_readers(enabled):
    """Every gradient's scaled copy reads its bucket's divisor: Inductor's pairwise fusion
    search in that group of readers is bounded for a graph ddp_fusion fuses (cold
    compile, bench/results/compile_time_cpu_2026-11-27.md), and a lower setting of the
    user's is kept."""
    inductor_config = _torch.inductor.config()
    name = "max_fusion_buffer_group_pairwise_attempts"
    gm = torch.fx.symbolic_trace(lambda g: torch.ops.ddp_fusion.all_reduce_gradient(
        g, "0", "avg", [1], "w", None, -1, 0))
    assert getattr(inductor_config, name) == 64  # torch's default, which the patch lowers
    assert _install._patches_for(gm)[name] == 8
    with inductor_config.patch({name: 4}):
        assert _install._patches_for(gm)[name] == 4
    plain = torch.fx.symbolic_trace(lambda g: g * 2)
    assert name not in _install._patches_for(plain)


def test_adopted_torch_ddp_takes_its_bucket_arguments_and_group(enabled):
    """bucket_cap_mb / bucket_cap_mb_list and the process group reach the hooks' bucket
    limits (the same limits the wrapper is tested with against eager DDP)."""
    from ddp_fusion.plan import ddp_bucket_limits

    sub = dist.new_group([0, 1])
    ddp = DDP(_net(), process_group=sub, bucket_cap_mb_list=[0.001, 0.002])
    assert ddp._ddp_fusion.group is sub
    assert ddp._ddp_fusion.reducer.limits == ddp_bucket_limits(None, [0.001, 0.002])
    assert DDP(_net(), bucket_cap_mb=3)._ddp_fusion.reducer.limits == ddp_bucket_limits(3, None)


def test_a_number_in_config_bucket_cap_mb_is_every_adopted_ddps_cap(enabled):
    """``config.bucket_cap_mb = 3`` (``DDP_FUSION_BUCKET_CAP_MB=3``) replaces each torch
    DDP's own ``bucket_cap_mb`` / ``bucket_cap_mb_list`` (the wrapper keeps its own)."""
    from ddp_fusion.plan import ddp_bucket_limits

    with ddp_fusion.config.patch(bucket_cap_mb=3):
        assert DDP(_net(), bucket_cap_mb=25)._ddp_fusion.limits == ddp_bucket_limits(3)
        assert DDP(_net(), bucket_cap_mb_list=[0.001, 0.002])._ddp_fusion.limits == ddp_bucket_limits(3)
        wrapper = ddp_fusion.DistributedDataParallel(_net(), bucket_cap_mb=25)
        assert wrapper._sync.limits == ddp_bucket_limits(25)
    assert DDP(_net(), bucket_cap_mb=25)._ddp_fusion.limits == ddp_bucket_limits(25)


def test_adopted_torch_ddp_holds_no_bucket_memory(enabled):
    """Issue 15: the C++ reducer torch DDP built holds a bucket buffer for every
    gradient; adopted, it is replaced by one over a one-element placeholder (the
    gradients are reduced by ddp_fusion), and the eager reducer's buckets are made only
    if the model ever runs uncompiled. The model's parameters and torch's logging data
    are unchanged."""
    net = _net()
    ddp = DDP(net)
    held = sum(b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets())
    assert held == 1
    assert [p for p in ddp.parameters()] == [p for p in net.parameters()]
    assert ddp._get_ddp_logging_data()["module_name"] == "Sequential"
    assert all(b._buffer is None for b in ddp._ddp_fusion.reducer.buckets)


def test_torch_ddp_built_before_the_flag_keeps_torchs_reducer(fake_pg):
    ddp = DDP(_net())
    assert not hasattr(ddp, "_ddp_fusion")
    assert type(ddp) is DDP


def test_an_adopted_model_trains_with_the_eager_reducer_once_the_flag_is_off(fake_pg, monkeypatch):
    """With the flag off, an adopted model's gradient hooks go through ddp_fusion's eager
    bucketed reducer: one all-reduce per bucket (2.b + 2.w: 36 elements, then 0.b +
    0.w: 72; see the first test) in each step, before and after the buckets are rebuilt
    from the ready order. The fake group's all-reduce returns its input, so each
    gradient is the module's own divided by the world size (2), and SGD steps on them
    follow the module's."""
    with ddp_fusion.config.patch(enabled=True):
        ddp = DDP(_net(), bucket_cap_mb=1e-4)
    ref = _net()
    sent = []
    all_reduce = dist.all_reduce  # what the eager reducer calls (torch's C++ reducer does not)
    monkeypatch.setattr(dist, "all_reduce",
                        lambda t, *a, **k: (sent.append(t.numel()), all_reduce(t, *a, **k))[1])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, ref)]
    torch.manual_seed(1)
    for step in range(2):
        x = torch.randn(4, 8)
        for model, opt in zip((ddp, ref), opts):
            opt.zero_grad()
            model(x).square().sum().backward()  # no compiled autograd now: eager reducer
        for (name, got), want in zip(ddp.module.named_parameters(), ref.parameters()):
            torch.testing.assert_close(got.grad, want.grad / 2,
                                       msg=lambda m, s=step, n=name: f"step {s}, {n}: {m}")
            want.grad /= 2
        for opt in opts:
            opt.step()
    assert sent == [36, 72, 36, 72] and ddp._ddp_fusion.reducer.rebuilt
    for got, want in zip(ddp.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want)


def test_register_comm_hook_maps_torchs_compress_hooks_to_a_comm_dtype(enabled):
    ddp = DDP(_net())
    ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    assert ddp._ddp_fusion.state.comm_dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="already registered"):
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    other = DDP(_net())
    other._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    assert other._ddp_fusion.state.comm_dtype == torch.float16


def test_register_comm_hook_takes_any_hook_and_refuses_what_it_cannot_honour(enabled):
    """Issue 14: any hook is called on the buckets; torch's compress hooks become a
    communication dtype only over the model's own group (else they run as hooks)."""
    ddp = DDP(_net())
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    assert ddp._ddp_fusion.reducer.hook.state is state and ddp._ddp_fusion.state.reduce_op == "hook"
    with pytest.raises(RuntimeError, match="already registered"):
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    sub = dist.new_group([0, 1])
    on_world = DDP(_net())
    on_world.register_comm_hook(sub, default_hooks.fp16_compress_hook)  # another group
    assert on_world._ddp_fusion.reducer.hook is not None and on_world._ddp_fusion.state.comm_dtype is None
    on_sub = DDP(_net(), process_group=sub)
    on_sub.register_comm_hook(sub, default_hooks.fp16_compress_hook)  # its own group
    assert on_sub._ddp_fusion.reducer.hook is None and on_sub._ddp_fusion.state.comm_dtype == torch.float16
    with pytest.raises(TypeError, match="hook must be callable"):
        DDP(_net()).register_comm_hook(None, "fp16")
    used = DDP(_net())
    used(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="before the model's first forward"):
        used.register_comm_hook(None, default_hooks.fp16_compress_hook)
    with pytest.raises(ValueError, match="given comm_dtype.*give one"):
        ddp_fusion.DistributedDataParallel(_net(), comm_dtype=torch.float16).register_comm_hook(
            state, powerSGD_hook.powerSGD_hook)


def test_refusals_name_the_setting(enabled):
    from torch.nn.parallel.distributed import _MixedPrecision

    with pytest.raises(NotImplementedError, match="mixed_precision is not supported"):
        DDP(_net(), mixed_precision=_MixedPrecision(param_dtype=torch.float16))
    with pytest.raises(ValueError, match=r"^bucket_cap_mb must be a non-negative number of MiB, got nan"):
        DDP(_net(), bucket_cap_mb=float("nan"))  # torch: "cannot convert float NaN to integer"
    emb = nn.Sequential(nn.Embedding(10, 4, sparse=True))
    with pytest.raises(NotImplementedError, match=r"module '0' is an embedding with sparse=True"):
        DDP(emb)
    with pytest.raises(TypeError, match="divide_by_initial_world_size must be True or False"):
        DDP(_net()).join(divide_by_initial_world_size="yes")
    net = _net()
    ours = ddp_fusion.DistributedDataParallel(net)
    with pytest.raises(ValueError, match=r"parameter '0.weight' already carries the gradient hooks"):
        DDP(net)
    del ours


def test_upstreams_python_reducer_and_the_flag_refuse_each_other(enabled):
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        with pytest.raises(ValueError, match="optimize_ddp is 'python_reducer'.*ddp_fusion replaces"):
            DDP(_net())
    assert not _torch.inductor.config()._fuse_ddp_communication  # refused before torch ran


@pytest.mark.parametrize("kind", ["stock", "wrapper"])
def test_copying_or_pickling_the_model_says_to_copy_its_module(enabled, kind):
    """torch DDP's copy builds a reducer of its own; ddp_fusion's model refuses, naming
    what to copy instead (it failed on whichever of its objects did not pickle)."""
    import copy
    import pickle

    model = DDP(_net()) if kind == "stock" else ddp_fusion.DistributedDataParallel(_net())
    for copier in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match=r"cannot be copied or pickled.*deepcopy\(model\.module\)"):
            copier(model)
    copy.deepcopy(model.module)(torch.randn(2, 8))  # what it says to do works
