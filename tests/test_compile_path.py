"""The real torch.compile path in one process (fake process group): the config flag
installs the pass and compiled autograd, the compiled backward carries one collective
per bucket, gradients match the unfused run, and Inductor's FX graph cache is used.
"""

import gc
import re

import pytest
import torch
from torch._dynamo.utils import counters

import ddp_fusion
from ddp_fusion import _install, effects, grad_sync

pytestmark = pytest.mark.usefixtures("fake_pg")


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 8),
    )


def grads_after_steps(enabled, steps=2, **config):
    """Run ``steps`` compiled forward+backward passes; return the gradients."""
    torch._dynamo.reset()
    # A model's id (in its graphs) counts the live models with its parameter names: an
    # earlier test's model left in a reference cycle, collected between two calls,
    # would change it, and the cache test would miss for that reason alone.
    gc.collect()
    with ddp_fusion.config.patch(enabled=enabled, **config):
        # cap 0.015 MiB (15728 B); eager autograd's ready order is 4.b, 4.w 2 KiB, 2.b,
        # 2.w 16 KiB, 0.b, 0.w 8 KiB: buckets [4.b .. 2.w] (18720 B) and [0.b, 0.w]
        model = torch.compile(ddp_fusion.DistributedDataParallel(mlp(), bucket_cap_mb=0.015))
        torch.manual_seed(1)
        for _ in range(steps):
            model(torch.randn(16, 32)).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def unfused_grads():
    return grads_after_steps(enabled=False)


@pytest.mark.parametrize("algorithm", ["concat", "coalesced"])
def test_fused_backward_matches_unfused(unfused_grads, algorithm, tmp_path):
    counters.clear()
    fused = grads_after_steps(enabled=True, algorithm=algorithm, dump_dir=str(tmp_path))
    for got, want in zip(fused, unfused_grads):
        torch.testing.assert_close(got, want)
    # one backward graph per step shape: first step (no .grad yet) and accumulation
    assert counters["ddp_fusion"]["graphs"] == 2
    assert counters["ddp_fusion"]["fused_all_reduces"] == 2 * 6
    assert counters["ddp_fusion"]["buckets"] == 2 * 2
    first, second = [p.read_text() for p in sorted(tmp_path.glob("*.after.txt"))]
    # the graph Inductor lowers: each bucket's collective in place on it (no copy of it)
    op = "all_reduce_bucket_coalesced.default" if algorithm == "coalesced" else "all_reduce_bucket.default"
    assert first.count(op) == 2
    # accumulation into the .grads of step 1: each bucket reduced in place in them
    assert second.count("ddp_fusion.all_reduce_in_place.default(") == 2
    assert "_c10d_functional" not in second
    for after in (first, second):
        assert "ddp_fusion.all_reduce_gradient" not in after


def test_a_backward_compiled_to_cpp_wrapper_code_fuses_and_matches_unfused(unfused_grads):
    """Inductor's ``cpp_wrapper`` (as AOTInductor) writes an op's ``str`` arguments into
    C++ string literals unescaped: the plan's JSON, passed as it is up to 4 KB, ended
    the literal at its first quote, and the fused backward failed to compile. The plan
    is always encoded there (base85, no quote or backslash) and decodes to the same."""
    from ddp_fusion.plan_check import from_graph_text, graph_text

    plan = '{"buckets": [{"grads": ["0.weight", "0.bias\\"]}]}'
    with torch._inductor.config.patch(cpp_wrapper=True):
        text = graph_text(plan)
    assert not set(text) & set('"\\\n') and from_graph_text(text) == plan
    assert graph_text(plan) == plan  # (Python wrapper code: readable in graph dumps)
    counters.clear()
    with torch._inductor.config.patch(cpp_wrapper=True, fx_graph_cache=False):
        grads = grads_after_steps(enabled=True)
    # two graphs (new .grads, then kept ones reduced in place), two buckets each
    assert counters["ddp_fusion"]["buckets"] == 2 * 2
    for got, want in zip(grads, unfused_grads):
        torch.testing.assert_close(got, want)


def test_fx_graph_cache_miss_then_hit(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    counters.clear()
    grads_after_steps(enabled=True, steps=1)
    assert counters["ddp_fusion"]["graphs"] == 1  # the pass ran: a cache miss
    assert counters["inductor"]["fxgraph_cache_miss"] >= 1
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    counters.clear()
    grads_after_steps(enabled=True, steps=1)
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1
    assert counters["ddp_fusion"]["graphs"] == 0  # served from the cache
    counters.clear()
    grads_after_steps(enabled=True, steps=1, algorithm="coalesced")
    assert counters["ddp_fusion"]["graphs"] == 1  # the config is part of the key


def test_uuid_covers_config():
    """The pass's uuid (its FX graph cache key, see test_fx_graph_cache_miss_then_hit)
    changes with each of the four settings that change what the pass does, and is the
    same for the same config."""
    defaults = dict(algorithm="concat", schedule_waits=True, max_in_flight_mb=5120.0, dump_dir=None)
    changes = dict(algorithm="coalesced", schedule_waits=False, max_in_flight_mb=64.0, dump_dir="/tmp/d")
    with ddp_fusion.config.patch(**defaults):
        base = _install.THE_PASS.uuid()
        assert _install.THE_PASS.uuid() == base
        uuids = {}
        for name, value in changes.items():
            with ddp_fusion.config.patch(**{name: value}):
                uuids[name] = _install.THE_PASS.uuid()
    assert [name for name, uuid in uuids.items() if uuid == base] == []
    assert len(set(uuids.values())) == len(changes)


def test_enabled_installs_next_to_user_pass_and_restores_it():
    import torch._inductor.config as inductor_config

    calls = []

    from torch._inductor.custom_graph_pass import CustomGraphPass

    class UserPass(CustomGraphPass):
        def __call__(self, graph):
            calls.append(graph)

        def uuid(self):
            return "user-pass"

    user = UserPass()
    saved = inductor_config.post_grad_custom_post_pass
    inductor_config.post_grad_custom_post_pass = user
    try:
        with ddp_fusion.config.patch(enabled=True):
            installed = inductor_config.post_grad_custom_post_pass
            assert isinstance(installed, _install._Chain)
            assert installed.passes == (user, _install.THE_PASS)
            assert installed.uuid()[0] == "user-pass"
            effects.want(effects.COMPILED_AUTOGRAD)  # what a model's compiled forward asks
            assert _install._torch.compiled_autograd.active()
        assert inductor_config.post_grad_custom_post_pass is user
        assert not _install._torch.compiled_autograd.active()
    finally:
        inductor_config.post_grad_custom_post_pass = saved


def test_no_sync_accumulates_without_communication_and_one_extra_graph(monkeypatch, tmp_path):
    """Two micro-steps under no_sync, then a synced one: the no-sync backward has no
    all-reduce, the synced one reduces the accumulated sum, and the no-sync variant
    costs exactly one more compiled backward graph (no recompile storm)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the pass must run
    torch._dynamo.reset()
    torch.manual_seed(1)
    batches = [torch.randn(16, 32) for _ in range(3)]

    def accumulate(model, ddp):
        for _ in range(2):  # two accumulation cycles
            for p in model.parameters():
                p.grad = None
            with ddp.no_sync():
                for x in batches[:2]:
                    model(x).square().sum().backward()
            model(batches[2]).square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    eager_ddp = ddp_fusion.DistributedDataParallel(mlp())
    want = accumulate(eager_ddp, eager_ddp)

    counters.clear()
    with ddp_fusion.config.patch(enabled=True):
        ddp = ddp_fusion.DistributedDataParallel(mlp())
        got = accumulate(torch.compile(ddp), ddp)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    # 1 forward graph + 3 backward graphs: first micro-step (no .grad yet) no-sync,
    # accumulating no-sync, accumulating synced; without no_sync it would be 1 + 2.
    # Only the synced backward has tagged all-reduces for the pass.
    assert counters["stats"]["unique_graphs"] == 4
    assert counters["ddp_fusion"]["graphs"] == 1


def test_waits_stay_after_the_backward_compute_they_overlap(monkeypatch, tmp_path):
    """Inductor's peak-memory reordering would pull the first bucket's wait up to right
    after its collective (and push the collective down); the compiled-autograd compiler
    turns it off, so in the generated code every collective is issued, with compute
    between them, before the first wait."""

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(128, 128), torch.nn.LayerNorm(128), torch.nn.GELU()]
    # cap 0.001 MiB: a bucket per Linear's weight, LayerNorms and biases between them;
    # with Inductor's peak-memory reordering on, each wait lands right after its issue
    net = torch.nn.Sequential(*layers, torch.nn.Linear(128, 1))
    with ddp_fusion.config.patch(enabled=True):
        model = torch.compile(ddp_fusion.DistributedDataParallel(net, bucket_cap_mb=0.001))
        model(torch.randn(16, 128)).square().sum().backward()
    code = [p.read_text() for p in tmp_path.rglob("*.py") if "all_reduce_" in p.read_text()]
    assert len(code) == 1
    call = code[0].split("def call(")[1]
    issue = "torch.ops.ddp_fusion.all_reduce_bucket.default("
    wait = "torch.ops.ddp_fusion.wait_bucket.default("
    assert call.count(issue) == call.count(wait) > 4
    first_issue, last_issue, first_wait = call.index(issue), call.rindex(issue), call.index(wait)
    assert last_issue < first_wait
    assert "extern_kernels.mm(" in call[first_issue:last_issue]


@pytest.mark.parametrize("grads_before", ["none", "zeros"])
def test_generated_code_copies_each_gradient_once(monkeypatch, tmp_path, grads_before):
    """Issue 15: in Inductor's code for the fused backward, each bucket has one buffer,
    the size of the bucket: the scaled gradients are written into it (the one copy),
    the all-reduce runs in place on it, and after its wait no kernel reads it: the
    graph returns views of it, which become the gradients (nothing is copied back).
    Issue 32: with ``.grad`` already set (``zero_grad(set_to_none=False)``), ``.grad``
    stays the same tensor, as under torch DDP, and the kept ``.grad``s are the bucket:
    each gradient is written into its ``.grad`` (the accumulation and the scaling fused
    into that one write), each bucket is reduced in place in them, and no buffer of a
    bucket's size is made, nothing copied back."""
    import re

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    net = mlp()
    if grads_before == "zeros":
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
    kept = [p.grad for p in net.parameters()]
    with ddp_fusion.config.patch(enabled=True):
        model = torch.compile(ddp_fusion.DistributedDataParallel(net, bucket_cap_mb=0.015))
        model(torch.randn(16, 32)).square().sum().backward()
    assert [p.grad is g for p, g in zip(net.parameters(), kept)] == [grads_before == "zeros"] * 6
    (code,) = [p.read_text() for p in tmp_path.rglob("*.py") if "all_reduce_" in p.read_text()]
    call = code.split("def call(")[1]
    # buckets [4.b, 4.w, 2.b, 2.w] and [0.b, 0.w] (see grads_after_steps)
    bucket_numels = [8 + 64 * 8 + 64 + 64 * 64, 64 + 32 * 64]
    if grads_before == "zeros":
        in_place = r"ddp_fusion\.all_reduce_in_place\.default\(\[([^\]]*)\], '0', 'concat', '[^']+'\)"
        reduced = re.findall(in_place, call)
        assert [len(r.split(", ")) for r in reduced] == [4, 2], call
        pieces = call.split("all_reduce_in_place")
        for i, names in enumerate(reduced):
            before = "".join(pieces[:i + 1])
            for arg in names.split(", "):
                assert arg.startswith("arg"), names  # the kept .grads (graph inputs)
                # before its reduction, a kernel accumulates and scales into it
                assert re.search(rf"cpp_fused_\w*\(.*\b{arg}\b", before), (arg, call)
        assert call.count("ddp_fusion.wait_in_place.default([") == 2
        for numel in bucket_numels:
            assert f"empty_strided_cpu(({numel}, )" not in call  # no bucket buffer
        assert "cpp_fused_copy" not in call and "_c10d_functional" not in call  # no copy back
        return
    buckets = re.findall(r"all_reduce_bucket\.default\((buf\d+), '0'\)", call)
    assert len(buckets) == 2, call
    numels = []
    for buf in buckets:
        numel = re.search(rf"\n\s*{buf} = empty_strided_cpu\(\((\d+), \)", call).group(1)
        numels.append(int(numel))
        # one buffer of the bucket's size: no second, scaled copy of it
        assert len(re.findall(rf"empty_strided_cpu\(\({numel}, \)", call)) == 1, call
        after_wait = call.split(f"wait_bucket.default([{buf}])")[1]
        readers = [line for line in after_wait.splitlines()
                   if re.search(rf"\b{buf}\b", line) and not line.strip().startswith(("del ", "return "))]
        assert readers == [], readers  # no copy back
        assert re.search(rf"return \(.*reinterpret_tensor\({buf},", after_wait)
    assert sorted(numels) == sorted(bucket_numels)


def test_the_compiled_backward_leaves_checking_its_inputs_to_dynamos_guards():
    """Inductor's code checks each graph input's sizes and strides at every call (one
    ``assert_size_stride(arg, ..., 'input')`` per tensor, ~0.4-1 us of host each):
    compiled autograd's backward takes every input through its Dynamo frame, whose guards
    check the same, so ddp_fusion's backward leaves them out; the forward, compiled by the
    user's ``torch.compile``, keeps them, and so do the backward's checks of its fallback
    kernels' outputs (the plan check's)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with ddp_fusion.config.patch(enabled=True), torch._inductor.config.patch(fx_graph_cache=False):
        model = torch.compile(ddp_fusion.DistributedDataParallel(mlp()))
        _, codes = run_and_get_code(lambda: model(torch.randn(16, 32)).sum().backward())
    torch._dynamo.reset()
    backward = [c for c in codes if "ddp_fusion" in c]
    forward = [c for c in codes if "ddp_fusion" not in c]
    assert len(backward) == 1 and len(forward) == 1
    # an input's check names the input (torch 2.11: ``primals_1``; 2.12 on also ends
    # with 'input'; 2.14 checks inputs in groups, ``assert_size_stride_grouped((primals_3,
    # ...``); an op output's, a buffer (2.14 checks those with assert_tensor_metadata)
    checks = r"assert_(?:size_stride|tensor_metadata|size_stride_grouped)\(\(?(\w+)"
    assert [n for n in re.findall(checks, forward[0]) if not n.startswith("buf")]
    assert [n for n in re.findall(checks, backward[0]) if not n.startswith("buf")] == []
    assert [n for n in re.findall(checks, backward[0]) if n.startswith("buf")]  # ddp_fusion's ops


def test_the_sums_that_make_bias_and_norm_gradients_write_into_the_bucket():
    """Issue 61 (scale.py): a gradient that a sum over the batch makes (a bias's, a
    LayerNorm's weight's and bias's) is divided inside that sum, so Inductor's code
    writes the reduction straight into the gradient's slice of the bucket (an alias of
    it), with no buffer of its own to allocate and free each step; only the bucket's
    last gradient, which the checked divisor scales, may keep one. The code before
    gave 5 of the 6 such gradients a buffer each."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 32), torch.nn.LayerNorm(32),
        torch.nn.Linear(32, 4),
    )
    with ddp_fusion.config.patch(enabled=True), torch._inductor.config.patch(fx_graph_cache=False):
        model = torch.compile(ddp_fusion.DistributedDataParallel(net))
        _, codes = run_and_get_code(lambda: model(torch.randn(8, 16)).square().sum().backward())
    torch._dynamo.reset()
    (backward,) = [c for c in codes if "ddp_fusion" in c]
    call = backward.split("def call(")[1]
    # the six gradients of 32 elements a sum makes: 2 Linear biases, 2 x LayerNorm's two
    own = re.findall(r"empty_strided_cpu\(\((?:1, 32|32, )\)", call)
    slices = re.findall(r"reinterpret_tensor\(buf\d+, \(32, \), \(1, \), \d+\)  # alias", call)
    assert len(own) <= 1 and len(slices) >= 5, call


def test_the_compiled_backward_guards_a_few_hooks_not_one_per_parameter(dynamo_guards, monkeypatch):
    """Dynamo guards, at every backward, each hook compiled autograd traces and what it
    reads. A compiled model reduces from one callback queued by the hooks of a few
    parameters (here 2 of 6: ``CALLBACK_HOOKS``), so the backward's guards hold those
    hooks (one function: its code, and its closure once) and the tags of every
    parameter as one string, not a hook per parameter with its own closure (issue 61:
    ~2 µs per parameter a step); no guard on the model's name or ready-position tables
    item by item (issue 36). The forward guards no module's buffers (issue 61)."""
    import re

    monkeypatch.setattr(grad_sync, "CALLBACK_HOOKS", 2)
    torch._dynamo.reset()
    try:
        with ddp_fusion.config.patch(enabled=True):
            model = torch.compile(ddp_fusion.DistributedDataParallel(mlp()))
            model(torch.randn(16, 32)).sum().backward()
    finally:
        torch._dynamo.reset()
    text = "\n".join(dynamo_guards)
    sources: dict[str, set[str]] = {}
    for hook, rest in re.findall(r"source=L\['hooks'\]\[(\d+)\]([^,]*),", text):
        sources.setdefault(hook, set()).add(re.sub(r"\[\d+\]", "[k]", rest))
    assert len(sources) == 2, text
    assert sorted(map(len, sources.values())) == [2, 6], sources  # the closure once
    assert len(re.findall(r"source=\S*_hook_data\[\d+\]\.tags,", text)) == 1, text
    assert ".names[" not in text and ".ready_position[" not in text
    # a model without buffers has none to broadcast (as torch DDP): its forward does not
    # look for them in every module, which Dynamo would guard module by module
    assert "named_modules" not in text and "._buffers" not in text, text


class _WithEmptyParameter(torch.nn.Module):
    """A parameter of no elements whose gradient is its bucket's last ready."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 4)
        self.empty = torch.nn.Parameter(torch.zeros(0, 16))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + self.empty.sum()


@pytest.mark.parametrize(
    "algorithm,grads_before", [("concat", None), ("coalesced", None), ("concat", "zeros")]
)
def test_the_plan_check_runs_when_a_bucket_ends_with_an_empty_gradient(algorithm, grads_before):
    """The check's divisor scaled the bucket's last-ready gradient only: where that
    gradient had no elements, Inductor dropped the division, and with it the guard and
    the check's start (nothing else read them), so every step ran unchecked: ranks
    with different plans would have issued them."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    net = _WithEmptyParameter()
    if grads_before == "zeros":
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
    with ddp_fusion.config.patch(enabled=True, algorithm=algorithm), \
            torch._inductor.config.patch(fx_graph_cache=False):
        model = torch.compile(ddp_fusion.DistributedDataParallel(net))
        _, codes = run_and_get_code(lambda: model(torch.randn(8, 16)).sum().backward())
    torch._dynamo.reset()
    (backward,) = [c for c in codes if "ddp_fusion" in c]
    call = backward.split("def call(")[1]
    assert "ddp_fusion.plan_check_start.default(" in call and "ddp_fusion.plan_guard.default(" in call


def test_a_backward_compiled_without_the_pass_says_its_all_reduces_ran_unfused(caplog):
    """A compiled-autograd compiler of the user's own that is not Inductor (here
    ``aot_eager``) runs the hooks' tagged all-reduces one by one, unchecked: correct,
    and said once per model (it was silent)."""
    torch._dynamo.reset()
    counters.clear()
    with ddp_fusion.config.patch(enabled=True):
        model = torch.compile(ddp_fusion.DistributedDataParallel(mlp()))
        for _ in range(2):
            loss = model(torch.randn(16, 32)).sum()
            with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
                loss.backward()
    torch._dynamo.reset()
    said = [m for m in (r.getMessage() for r in caplog.records) if "all-reduces unfused" in m]
    assert len(said) == 1 and "compiled by Inductor with ddp_fusion's pass" in said[0], said
    assert counters["ddp_fusion"]["unfused: backward compiled without the pass"] == 1
    assert "plans_run" not in counters["ddp_fusion"]


@pytest.mark.parametrize("wrap", ["wrapper", "stock", "uncompiled"])
def test_a_parameter_unfrozen_after_wrapping_raises_at_the_next_step(wrap):
    """A parameter frozen when the model was wrapped has no hook: switched on later, its
    gradient would train unreduced and the ranks drift apart (torch DDP says nothing).
    The forward's recompile (Dynamo guards ``requires_grad``) runs the check; an
    uncompiled model checks at every forward."""
    torch._dynamo.reset()
    gc.collect()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    net[0].weight.requires_grad_(False)
    cls = ddp_fusion.DistributedDataParallel
    if wrap == "stock":
        cls = torch.nn.parallel.DistributedDataParallel
    with ddp_fusion.config.patch(enabled=True):
        model = cls(net) if wrap == "uncompiled" else torch.compile(cls(net))
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
        net[0].weight.requires_grad_(True)
        with pytest.raises(RuntimeError, match=r"parameter\(s\) '0.weight' did not require grad when the "
                                               r"model was wrapped and do now"):
            model(torch.randn(4, 8)).sum().backward()


class _BatchNormMLP(torch.nn.Module):
    """Buffers for torch DDP to broadcast in the forward, and two buckets in the backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn = torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64)
        self.b, self.c = torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.bn(self.a(x))))))


def _collective_calls(code: str) -> list[str]:
    """The code's collective, wait and ddp_fusion calls in order, buffers unnamed."""
    calls = re.findall(r"^ +(?:\w+ = )?(torch\.ops\.(?:ddp_fusion|_c10d_functional)\.\w+\.default\(.*)$",
                       code, re.M)
    return [re.sub(r"\bbuf\d+\b", "buf", c) for c in calls]


@pytest.mark.skipif(
    not hasattr(torch._inductor.config.aten_distributed_optimizations, "enable_simple_overlap"),
    reason="Inductor's simple overlap (on by default) is new in torch 2.14",
)
def test_inductors_simple_overlap_moves_no_bucket_and_keeps_the_broadcasts_order(fake_pg):
    """torch 2.14's Inductor moves collectives earlier and waits later by default
    (``aten_distributed_optimizations.enable_simple_overlap``). ddp_fusion keeps it on:
    it does not touch the backward's buckets (ddp_fusion's own ops, which it does not take
    for collectives), and in the forward it issues torch DDP's buffer broadcasts in their
    order, the later ones before the earlier ones' waits."""
    from torch._inductor.utils import run_and_get_code

    def compiled(overlap: bool) -> tuple[list[str], list[str]]:
        torch._dynamo.reset()
        patch = {"fx_graph_cache": False, "aten_distributed_optimizations.enable_simple_overlap": overlap}
        with ddp_fusion.config.patch(enabled=True), torch._inductor.config.patch(patch):
            ddp = torch.nn.parallel.DistributedDataParallel(_BatchNormMLP(), bucket_cap_mb=0.01)
            model = torch.compile(ddp)
            _, codes = run_and_get_code(lambda: model(torch.randn(16, 32)).sum().backward())
        torch._dynamo.reset()
        (backward,) = [c for c in codes if "ddp_fusion" in c]
        (forward,) = [c for c in codes if "ddp_fusion" not in c]
        return _collective_calls(forward), _collective_calls(backward)

    forward_on, backward_on = compiled(True)
    forward_off, backward_off = compiled(False)
    assert sum("all_reduce_bucket" in c for c in backward_on) == 2, backward_on
    assert backward_on == backward_off
    broadcasts = [c for c in forward_off if "broadcast" in c]
    assert len(broadcasts) >= 2, forward_off
    assert [c for c in forward_on if "broadcast" in c] == broadcasts
    assert sorted(forward_on) == sorted(forward_off)



class _FirstUnused(torch.nn.Module):
    """``mlp()`` after a layer the forward never calls: the first parameters get no
    gradient."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(4, 4)
        self.net = mlp()

    def forward(self, x):
        return self.net(x)


class _EndsUnused(_FirstUnused):
    """``_FirstUnused`` with a second unused layer after ``mlp()``: the first and the
    last parameters get no gradient."""

    def __init__(self):
        super().__init__()
        self.unused_last = torch.nn.Linear(4, 4)


@pytest.mark.parametrize("model_class, grads_before", [
    (_FirstUnused, None), (_FirstUnused, "zeros"), (_EndsUnused, None),
])
def test_a_compiled_model_reduces_every_gradient_from_one_callback_per_backward(
        monkeypatch, model_class, grads_before):
    """A compiled model reduces from one callback per backward, queued by the hooks of a
    few parameters, not from a hook per parameter (issue 61): here 2 (``CALLBACK_HOOKS``),
    the first in the learned ready order and the first in the model, which gets no
    gradient. Every gradient is reduced, as the fake group reduces it (its average halves
    them), whether ``.grad`` starts empty or kept; the unused parameters' stay as they
    were, and are not in a bucket. A lost callback would leave the gradients whole: as
    hooks spread over the model in index order alone left them with ``_EndsUnused``,
    whose first and last parameters get no gradient."""
    monkeypatch.setattr(grad_sync, "CALLBACK_HOOKS", 2)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(1)
    batches = [torch.randn(16, 32) for _ in range(2)]
    plain = model_class()
    with ddp_fusion.config.patch(enabled=True), torch._inductor.config.patch(fx_graph_cache=False):
        module = model_class()
        if grads_before == "zeros":
            for p in module.parameters():
                p.grad = torch.zeros_like(p)
        ddp = ddp_fusion.DistributedDataParallel(module)
        model = torch.compile(ddp)
        for x in batches:
            plain.zero_grad()
            plain(x).square().sum().backward()
            module.net.zero_grad(set_to_none=grads_before is None)
            model(x).square().sum().backward()
            for (name, got), want in zip(module.named_parameters(), plain.parameters()):
                if name.startswith("unused"):
                    assert (got.grad is None) == (grads_before is None), name
                    assert got.grad is None or not got.grad.any(), name
                else:
                    torch.testing.assert_close(got.grad, want.grad / 2, msg=name)
    torch._dynamo.reset()
    assert ddp._sync.callback and len(ddp._sync.handles) == 2
    assert counters["ddp_fusion"]["fused_all_reduces"] >= 6, dict(counters["ddp_fusion"])
    # the callback reads the unused layer's kept .grads too; the pass leaves them out of
    # the buckets, as a hook per parameter would not have fired for them
    assert counters["ddp_fusion"]["kept .grads not written"] == (2 if grads_before else 0)
    assert not [k for k in counters["ddp_fusion"] if k.startswith("unfused")], dict(counters["ddp_fusion"])
