"""Graph tests of the fusion pass on make_fx graphs (one process, fake process group).

What they pin down: the readable graph each algorithm produces; that only tagged
all-reduces are touched; that a world size of 1 and ``reduce_op="sum"`` still fuse;
that a gradient computed from an earlier reduced gradient gets its own bucket; that the
rewritten graph computes what the original computed; and the dump files.
"""

import json

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

import ddp_fusion
from ddp_fusion.passes import fuse_ddp_allreduces

ALL_REDUCE_GRADIENT = torch.ops.ddp_fusion.all_reduce_gradient.default
ALL_REDUCE_CHECKED = torch.ops.ddp_fusion.all_reduce_checked.default
PLAN_GUARD = torch.ops.ddp_fusion.plan_guard.default
BUCKET = torch.ops.ddp_fusion.all_reduce_bucket.default
BUCKET_COALESCED = torch.ops.ddp_fusion.all_reduce_bucket_coalesced.default
WAIT_BUCKET = torch.ops.ddp_fusion.wait_bucket.default
C10D = torch.ops._c10d_functional


def small_backward(x, w1, w2):
    """Two layers' weight gradients, the second ready first, with compute between."""
    h = x @ w1
    g2 = h.t() @ x
    r2 = ddp_fusion.all_reduce_gradient(g2, name="w2")
    g1 = (h * 2).sum(0)
    r1 = ddp_fusion.all_reduce_gradient(g1, name="w1")
    return r1, r2


def kept_backward(x, w1, w2, grad1, grad2):
    """``small_backward`` accumulating into kept ``.grad``s, as the hooks trace it."""
    h = x @ w1
    g2 = grad2 + h.t() @ x
    grad2.copy_(ddp_fusion.all_reduce_gradient(g2, name="w2"))
    g1 = grad1 + (h * 2).sum(0)
    grad1.copy_(ddp_fusion.all_reduce_gradient(g1, name="w1"))
    return grad1, grad2


def inputs():
    torch.manual_seed(0)
    return torch.randn(4, 3), torch.randn(3, 5), torch.randn(5, 3)


def trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def fuse(gm, **kwargs):
    result = fuse_ddp_allreduces(gm.graph, **kwargs)
    gm.graph.lint()
    gm.recompile()
    return result


@pytest.mark.usefixtures("fake_pg")
class TestReadableGraphs(expecttest.TestCase):
    def test_before(self):
        """What the pass starts from: one tagged all-reduce right after each gradient."""
        gm = trace(small_backward, *inputs())
        self.assertExpectedInline(gm.code.strip(), """\
def forward(self, x_1, w1_1, w2_1):
    mm = torch.ops.aten.mm.default(x_1, w1_1);  w1_1 = None
    t = torch.ops.aten.t.default(mm)
    mm_1 = torch.ops.aten.mm.default(t, x_1);  t = x_1 = None
    all_reduce_gradient = torch.ops.ddp_fusion.all_reduce_gradient.default(mm_1, '0', 'avg', [1048576, 26214400], 'w2');  mm_1 = None
    mul = torch.ops.aten.mul.Tensor(mm, 2);  mm = None
    sum_1 = torch.ops.aten.sum.dim_IntList(mul, [0]);  mul = None
    all_reduce_gradient_1 = torch.ops.ddp_fusion.all_reduce_gradient.default(sum_1, '0', 'avg', [1048576, 26214400], 'w1');  sum_1 = None
    return (all_reduce_gradient_1, all_reduce_gradient)""")

    def test_concat(self):
        gm = trace(small_backward, *inputs())
        fuse(gm, algorithm="concat")
        self.assertExpectedInline(gm.code.strip(), """\
def forward(self, x_1, w1_1, w2_1):
    plan_check_start_default = torch.ops.ddp_fusion.plan_check_start.default('0', '{"algorithm": "concat", "buckets": [{"group": "0", "dtype": "float32", "device": "cpu", "reduce_op": "avg", "algorithm": "concat", "bytes": 80, "num_grads": 2, "numels": [15, 5], "grads": ["w2", "w1"]}], "unfused": []}', 2860895155221077544, device(type='cpu'), 'avg')
    mm = torch.ops.aten.mm.default(x_1, w1_1);  w1_1 = None
    t = torch.ops.aten.t.default(mm)
    mm_1 = torch.ops.aten.mm.default(t, x_1);  t = x_1 = None
    mul = torch.ops.aten.mul.Tensor(mm, 2);  mm = None
    sum_1 = torch.ops.aten.sum.dim_IntList(mul, [0]);  mul = None
    view_default = torch.ops.aten.view.default(mm_1, [-1]);  mm_1 = None
    div_tensor = torch.ops.aten.div.Tensor(view_default, plan_check_start_default);  view_default = None
    plan_guard_default = torch.ops.ddp_fusion.plan_guard.default(plan_check_start_default, '0', 2860895155221077544, 'avg', device(type='cpu'));  plan_check_start_default = None
    div_tensor_1 = torch.ops.aten.div.Tensor(sum_1, plan_guard_default);  sum_1 = plan_guard_default = None
    bucket0_cat = torch.ops.aten.cat.default([div_tensor, div_tensor_1]);  div_tensor = div_tensor_1 = None
    bucket0_all_reduce = torch.ops.ddp_fusion.all_reduce_bucket.default(bucket0_cat, '0');  bucket0_all_reduce = None
    bucket0_wait = torch.ops.ddp_fusion.wait_bucket.default([bucket0_cat]);  bucket0_wait = None
    bucket0_split = torch.ops.aten.split_with_sizes.default(bucket0_cat, [15, 5]);  bucket0_cat = None
    getitem = bucket0_split[0]
    view_default_1 = torch.ops.aten.view.default(getitem, [5, 3]);  getitem = None
    getitem_1 = bucket0_split[1];  bucket0_split = None
    return (getitem_1, view_default_1)""")

    def test_coalesced(self):
        gm = trace(small_backward, *inputs())
        fuse(gm, algorithm="coalesced")
        self.assertExpectedInline(gm.code.strip(), """\
def forward(self, x_1, w1_1, w2_1):
    plan_check_start_default = torch.ops.ddp_fusion.plan_check_start.default('0', '{"algorithm": "coalesced", "buckets": [{"group": "0", "dtype": "float32", "device": "cpu", "reduce_op": "avg", "algorithm": "coalesced", "bytes": 80, "num_grads": 2, "numels": [15, 5], "grads": ["w2", "w1"]}], "unfused": []}', -5147003848419962538, device(type='cpu'), 'avg')
    mm = torch.ops.aten.mm.default(x_1, w1_1);  w1_1 = None
    t = torch.ops.aten.t.default(mm)
    mm_1 = torch.ops.aten.mm.default(t, x_1);  t = x_1 = None
    mul = torch.ops.aten.mul.Tensor(mm, 2);  mm = None
    sum_1 = torch.ops.aten.sum.dim_IntList(mul, [0]);  mul = None
    bucket0_scale = torch.ops.aten._foreach_div.Tensor([mm_1], plan_check_start_default);  mm_1 = None
    getitem = bucket0_scale[0];  bucket0_scale = None
    plan_guard_default = torch.ops.ddp_fusion.plan_guard.default(plan_check_start_default, '0', -5147003848419962538, 'avg', device(type='cpu'));  plan_check_start_default = None
    bucket0_scale_checked = torch.ops.aten.div.Tensor(sum_1, plan_guard_default);  sum_1 = plan_guard_default = None
    bucket0_all_reduce_coalesced = torch.ops.ddp_fusion.all_reduce_bucket_coalesced.default([getitem, bucket0_scale_checked], '0');  bucket0_all_reduce_coalesced = None
    bucket0_wait = torch.ops.ddp_fusion.wait_bucket.default([getitem, bucket0_scale_checked]);  bucket0_wait = None
    alias_default = torch.ops.aten.alias.default(getitem);  getitem = None
    alias_default_1 = torch.ops.aten.alias.default(bucket0_scale_checked);  bucket0_scale_checked = None
    return (alias_default_1, alias_default)""")

    def test_no_plan_check(self):
        """``config.plan_check`` off: a ``plan_start`` (the divisor, no exchange) and no
        guard; every gradient is scaled by the start's divisor."""
        from unittest import mock

        from ddp_fusion import plan_check

        gm = trace(small_backward, *inputs())
        # (no value agreed by an earlier test's model on this group, which would win)
        with ddp_fusion.config.patch(plan_check=False), mock.patch.object(plan_check, "_agreed", {}):
            fuse(gm, algorithm="concat")
        self.assertExpectedInline(gm.code.strip(), """\
def forward(self, x_1, w1_1, w2_1):
    plan_start_default = torch.ops.ddp_fusion.plan_start.default('0', '{"algorithm": "concat", "buckets": [{"group": "0", "dtype": "float32", "device": "cpu", "reduce_op": "avg", "algorithm": "concat", "bytes": 80, "num_grads": 2, "numels": [15, 5], "grads": ["w2", "w1"]}], "unfused": []}', 2860895155221077544, device(type='cpu'), 'avg')
    mm = torch.ops.aten.mm.default(x_1, w1_1);  w1_1 = None
    t = torch.ops.aten.t.default(mm)
    mm_1 = torch.ops.aten.mm.default(t, x_1);  t = x_1 = None
    mul = torch.ops.aten.mul.Tensor(mm, 2);  mm = None
    sum_1 = torch.ops.aten.sum.dim_IntList(mul, [0]);  mul = None
    view_default = torch.ops.aten.view.default(mm_1, [-1]);  mm_1 = None
    div_tensor = torch.ops.aten.div.Tensor(view_default, plan_start_default);  view_default = None
    div_tensor_1 = torch.ops.aten.div.Tensor(sum_1, plan_start_default);  sum_1 = plan_start_default = None
    bucket0_cat = torch.ops.aten.cat.default([div_tensor, div_tensor_1]);  div_tensor = div_tensor_1 = None
    bucket0_all_reduce = torch.ops.ddp_fusion.all_reduce_bucket.default(bucket0_cat, '0');  bucket0_all_reduce = None
    bucket0_wait = torch.ops.ddp_fusion.wait_bucket.default([bucket0_cat]);  bucket0_wait = None
    bucket0_split = torch.ops.aten.split_with_sizes.default(bucket0_cat, [15, 5]);  bucket0_cat = None
    getitem = bucket0_split[0]
    view_default_1 = torch.ops.aten.view.default(getitem, [5, 3]);  getitem = None
    getitem_1 = bucket0_split[1];  bucket0_split = None
    return (getitem_1, view_default_1)""")

    def test_kept_grads_are_reduced_in_place(self):
        """Issue 32: gradients accumulated into ``.grad``s that exist before the backward
        (the hooks copy the reduced gradient into them): each scaled gradient is written
        into its ``.grad``, the bucket reduced in place there, nothing else allocated."""
        gm = trace(kept_backward, *inputs(), torch.zeros(5), torch.zeros(5, 3))
        fuse(gm, algorithm="concat")
        self.assertExpectedInline(gm.code.strip(), """\
def forward(self, x_1, w1_1, w2_1, grad1_1, grad2_1):
    plan_check_start_default = torch.ops.ddp_fusion.plan_check_start.default('0', '{"algorithm": "concat", "buckets": [{"group": "0", "dtype": "float32", "device": "cpu", "reduce_op": "avg", "algorithm": "concat", "bytes": 80, "num_grads": 2, "numels": [15, 5], "grads": ["w2", "w1"]}], "unfused": []}', 2860895155221077544, device(type='cpu'), 'avg')
    mm = torch.ops.aten.mm.default(x_1, w1_1);  w1_1 = None
    t = torch.ops.aten.t.default(mm)
    mm_1 = torch.ops.aten.mm.default(t, x_1);  t = x_1 = None
    add = torch.ops.aten.add.Tensor(grad2_1, mm_1);  mm_1 = None
    div_tensor = torch.ops.aten.div.Tensor(add, plan_check_start_default);  add = None
    bucket0_write = torch.ops.aten.copy_.default(grad2_1, div_tensor);  div_tensor = None
    mul = torch.ops.aten.mul.Tensor(mm, 2);  mm = None
    sum_1 = torch.ops.aten.sum.dim_IntList(mul, [0]);  mul = None
    add_1 = torch.ops.aten.add.Tensor(grad1_1, sum_1);  sum_1 = None
    plan_guard_default = torch.ops.ddp_fusion.plan_guard.default(plan_check_start_default, '0', 2860895155221077544, 'avg', device(type='cpu'));  plan_check_start_default = None
    div_tensor_1 = torch.ops.aten.div.Tensor(add_1, plan_guard_default);  add_1 = plan_guard_default = None
    bucket0_write_1 = torch.ops.aten.copy_.default(grad1_1, div_tensor_1);  div_tensor_1 = None
    bucket0_all_reduce_in_place = torch.ops.ddp_fusion.all_reduce_in_place.default([bucket0_write, bucket0_write_1], '0', 'concat', '-1/0/bucket0/2/4dc5377b');  bucket0_all_reduce_in_place = None
    bucket0_wait = torch.ops.ddp_fusion.wait_in_place.default([bucket0_write, bucket0_write_1]);  bucket0_write = bucket0_write_1 = bucket0_wait = None
    return (grad1_1, grad2_1)""")

    def test_without_wait_scheduling_wait_follows_collective(self):
        def fn(x, w):
            r = ddp_fusion.all_reduce_gradient(x * 3)
            return r, (w * 2).sum()

        gm = trace(fn, torch.randn(4), torch.randn(4))
        fuse(gm, algorithm="concat", schedule_waits=False)
        FileCheck().check("all_reduce_bucket.default").check_next("wait_bucket").run(gm.code)
        gm = trace(fn, torch.randn(4), torch.randn(4))
        fuse(gm, algorithm="concat", schedule_waits=True)
        FileCheck().check("all_reduce_bucket.default").check("mul_1").check("wait_bucket").run(gm.code)


def cudagraph_partitions(gm):
    """The graph as Inductor's graph partitioning cuts it for CUDA graphs
    (``mode="reduce-overhead"``): runs of ops a CUDA graph may capture, and the ops it
    never captures (``is_cudagraph_unsafe_fx_node``: what Inductor's ``should_partition``
    asks of every op, before it fuses kernels)."""
    from torch._inductor.utils import is_cudagraph_unsafe_fx_node

    lines, run = [], []
    for n in [n for n in gm.graph.nodes if n.op == "call_function"]:
        if is_cudagraph_unsafe_fx_node(n):
            lines += [f"captured: {', '.join(run)}"] if run else []
            lines.append(f"not captured: {n.name}")
            run = []
        else:
            run.append(n.name)
    return "\n".join(lines + ([f"captured: {', '.join(run)}"] if run else []))


@pytest.mark.usefixtures("fake_pg")
class TestCudaGraphPartitions(expecttest.TestCase):
    """Under ``mode="reduce-overhead"`` no collective and no wait of ddp_fusion's is ever
    captured in a CUDA graph: each is an op Inductor partitions the graph around (a CUDA
    graph would replay a collective invisibly to NCCL's watchdog and the flight recorder,
    and keep the bucket in its memory pool). Shown on the CPU with Inductor's own test of
    an op; on a GPU, tests/test_gpu.py counts the partitions."""

    def check(self, gm):
        comm = [n for n in gm.graph.nodes if n.op == "call_function"
                and getattr(n.target, "namespace", None) in ("_c10d_functional", "ddp_fusion")]
        assert comm and all(f"not captured: {n.name}" in cudagraph_partitions(gm).splitlines() for n in comm)
        return cudagraph_partitions(gm)

    def test_concat(self):
        gm = trace(small_backward, *inputs())
        fuse(gm, algorithm="concat")
        self.assertExpectedInline(self.check(gm), """\
not captured: plan_check_start_default
captured: mm, t, mm_1, mul, sum_1, view_default, div_tensor
not captured: plan_guard_default
captured: div_tensor_1, bucket0_cat
not captured: bucket0_all_reduce
not captured: bucket0_wait
captured: bucket0_split, getitem, view_default_1, getitem_1""")

    def test_coalesced(self):
        gm = trace(small_backward, *inputs())
        fuse(gm, algorithm="coalesced")
        self.assertExpectedInline(self.check(gm), """\
not captured: plan_check_start_default
captured: mm, t, mm_1, mul, sum_1, bucket0_scale, getitem
not captured: plan_guard_default
captured: bucket0_scale_checked
not captured: bucket0_all_reduce_coalesced
not captured: bucket0_wait
captured: alias_default, alias_default_1""")

    def test_kept_grads(self):
        gm = trace(kept_backward, *inputs(), torch.zeros(5), torch.zeros(5, 3))
        fuse(gm, algorithm="concat")
        self.assertExpectedInline(self.check(gm), """\
not captured: plan_check_start_default
captured: mm, t, mm_1, add, div_tensor, bucket0_write, mul, sum_1, add_1
not captured: plan_guard_default
captured: div_tensor_1, bucket0_write_1
not captured: bucket0_all_reduce_in_place
not captured: bucket0_wait""")


@pytest.mark.usefixtures("fake_pg")
@pytest.mark.parametrize("algorithm", ["concat", "coalesced"])
def test_channels_last_gradient_is_reduced_in_memory_order(algorithm):
    """A channels-last gradient goes into its bucket as a permute view (no copy) and
    comes back with its strides, so the new ``.grad`` keeps the gradient layout; the
    values are the unfused graph's."""
    def fn(x, y):
        g = (x * 2).contiguous(memory_format=torch.channels_last)
        return ddp_fusion.all_reduce_gradient(g, name="conv"), ddp_fusion.all_reduce_gradient(y * 3, name="b")

    args = (torch.randn(2, 3, 4, 5), torch.randn(7))
    gm = trace(fn, *args)
    want = gm(*args)

    def copies():  # the clone is the user's .contiguous(channels_last)
        return [n.target for n in gm.graph.nodes
                if n.target in (torch.ops.aten.clone.default, torch.ops.aten.reshape.default)]

    before = copies()
    fuse(gm, algorithm=algorithm)
    out = gm.graph.find_nodes(op="output")[0].args[0]
    assert out[0].meta["val"].stride() == want[0].stride() == (60, 1, 15, 3)
    assert copies() == before == [torch.ops.aten.clone.default]
    got = gm(*args)
    assert got[0].stride() == want[0].stride()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def three_buckets(x):
    """Three 64-byte gradients, each its own bucket (cap 32 bytes), compute between."""
    out = []
    for i in range(3):
        x = x * 2
        out.append(ddp_fusion.all_reduce_gradient(x + i, name=f"g{i}", bucket_cap_mb=32 / 2**20))
    return out


@pytest.mark.usefixtures("fake_pg")
class TestInFlightBudget:
    """``max_in_flight_mb`` bounds the bytes of collectives issued and not yet waited
    for (issue 15): over budget, the oldest bucket is waited for before the next one is
    issued; a bucket larger than the budget still goes, alone."""

    def order(self, budget_bytes, algorithm):
        gm = trace(three_buckets, torch.randn(16))
        budget = None if budget_bytes is None else budget_bytes / 2**20
        fuse(gm, algorithm=algorithm, max_in_flight_mb=budget)
        issue = {BUCKET, BUCKET_COALESCED}
        return ["issue" if n.target in issue else "wait" for n in gm.graph.nodes
                if n.target in issue or n.target is WAIT_BUCKET]

    @pytest.mark.parametrize("algorithm", ["concat", "coalesced"])
    def test_unbounded_all_waits_after_all_issues(self, algorithm):
        assert self.order(None, algorithm) == ["issue"] * 3 + ["wait"] * 3

    @pytest.mark.parametrize("algorithm", ["concat", "coalesced"])
    def test_room_for_two_buckets(self, algorithm):
        assert self.order(128, algorithm) == ["issue", "issue", "wait", "issue", "wait", "wait"]

    @pytest.mark.parametrize("algorithm", ["concat", "coalesced"])
    def test_a_bucket_over_the_budget_goes_alone(self, algorithm):
        assert self.order(16, algorithm) == ["issue", "wait"] * 3


def bias_first_backward(x, w, shared):
    """A bias's gradient (a sum over the batch, its kept dimension viewed away) ready
    before a weight's; with ``shared``, the sum is read by something else too."""
    s = (x * 3).sum(0, keepdim=True)
    rb = ddp_fusion.all_reduce_gradient(s.view(-1), name="b")
    rw = ddp_fusion.all_reduce_gradient(x.t() @ (x @ w), name="w")
    return (rb, rw, s * 2) if shared else (rb, rw)


@pytest.mark.usefixtures("fake_pg")
@pytest.mark.parametrize("algorithm", ["concat", "coalesced"])
class TestDividedInsideTheSum:
    """scale.py: a gradient that a sum makes, other than its bucket's last, is divided
    inside that sum, which then feeds the bucket directly (no buffer of its own in
    Inductor's code); the old sum and its view go."""

    def fused(self, algorithm, shared):
        x, w = torch.randn(4, 3), torch.randn(3, 3)
        gm = trace(lambda x, w: bias_first_backward(x, w, shared), x, w)
        fuse(gm, algorithm=algorithm)
        torch.testing.assert_close(gm(x, w), bias_first_backward(x, w, shared), rtol=0, atol=0)
        (collective,) = [n for n in gm.graph.nodes if n.target in (BUCKET, BUCKET_COALESCED)]
        reduced = collective.args[0]
        inputs = reduced.args[0] if algorithm == "concat" else reduced  # (the cat's)
        sums = [n for n in gm.graph.nodes if n.target is torch.ops.aten.sum.dim_IntList]
        return inputs, sums

    def test_a_bias_gradient_is_divided_inside_its_sum(self, algorithm):
        inputs, sums = self.fused(algorithm, shared=False)
        (s,) = sums
        assert s.args[1] == [0] and len(s.args) == 2  # no kept dimension to view away
        assert s.args[0].target is torch.ops.aten.div.Tensor
        assert inputs[0] is s

    def test_a_sum_read_elsewhere_is_divided_after(self, algorithm):
        inputs, sums = self.fused(algorithm, shared=True)
        (s,) = sums
        assert s.args[0].target is torch.ops.aten.mul.Tensor
        assert inputs[0] is not s


@pytest.mark.parametrize("op, args", [
    ("sum", ((4, 3), [0])),
    ("sum", ((2, 4, 3), [0, 1])),
    ("sum", ((2, 4, 3), [-3, 2])),
    ("div", ((4, 3),)),
    ("div", ((5,),)),
])
def test_the_pass_shortcuts_give_what_fake_dispatch_gives(op, args):
    """The values NodeMaker sets without fake dispatch (passes/_graph.py) are what the
    op gives: shape, strides, dtype, device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ddp_fusion.passes import _graph

    mode = FakeTensorMode()
    x = mode.from_tensor(torch.randn(*args[0]))
    target = {"sum": torch.ops.aten.sum.dim_IntList, "div": torch.ops.aten.div.Tensor}[op]
    call = (x, args[1]) if op == "sum" else (x, mode.from_tensor(torch.tensor(2.0)))
    got = _graph._SHORTCUTS[target](mode, target, *call)
    with mode:
        want = target(*call)
    assert got is not None
    assert (got.shape, got.stride(), got.dtype, got.device) == (want.shape, want.stride(), want.dtype, want.device)


@pytest.mark.usefixtures("fake_pg")
class TestWhatIsFused:
    @pytest.mark.parametrize("algorithm", ["concat", "coalesced"])
    def test_same_values_as_unfused(self, algorithm):
        gm = trace(small_backward, *inputs())
        fuse(gm, algorithm=algorithm)
        args = inputs()
        for got, want in zip(gm(*args), small_backward(*args)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)

    def test_untagged_all_reduce_untouched(self, fake_pg):
        """A tensor-parallel style functional all-reduce between two gradients stays
        exactly where it was, and the two gradients still form one bucket."""

        def fn(a, b, act):
            ra = ddp_fusion.all_reduce_gradient(a * 2)
            tp = fcol.all_reduce(act, "sum", fake_pg)
            rb = ddp_fusion.all_reduce_gradient(b + tp)
            return ra, rb

        gm = trace(fn, torch.randn(3), torch.randn(3), torch.randn(3))
        before = [n for n in gm.graph.nodes if n.target is C10D.all_reduce.default]
        assert len(before) == 1
        tp_args = before[0].args
        result = fuse(gm, algorithm="concat")
        assert [len(b.grads) for b in result.buckets] == [2]
        after = [n for n in gm.graph.nodes if n.target is C10D.all_reduce.default]
        assert after == before and after[0].args == tp_args
        assert len(gm.graph.find_nodes(op="call_function", target=BUCKET)) == 1
        assert not list(gm.graph.find_nodes(op="call_function", target=ALL_REDUCE_GRADIENT))

    def test_plain_functional_all_reduce_is_never_fused(self, fake_pg):
        """Even one that looks exactly like upstream DDP's (div then all_reduce)."""

        def fn(a, b):
            return (
                fcol.all_reduce(a / 2, "sum", fake_pg),
                fcol.all_reduce(b / 2, "sum", fake_pg),
            )

        gm = trace(fn, torch.randn(3), torch.randn(3))
        code = gm.code
        result = fuse(gm)
        assert result.buckets == [] and gm.code == code

    def test_world_size_one_and_sum_still_fuse(self, fake_pg):
        single = dist.new_group(ranks=[0])

        def fn(a, b):
            return (
                ddp_fusion.all_reduce_gradient(a, single, reduce_op="sum"),
                ddp_fusion.all_reduce_gradient(b, single, reduce_op="sum"),
            )

        gm = trace(fn, torch.randn(3), torch.randn(2, 2))
        result = fuse(gm, algorithm="concat")
        assert [len(b.grads) for b in result.buckets] == [2]
        # reduce_op "sum" on a group of 1: the guard divides by 1 at run time
        (guard,) = gm.graph.find_nodes(op="call_function", target=torch.ops.ddp_fusion.plan_guard.default)
        assert guard.args[1] == single.group_name and guard.args[3] == "sum"
        a, b = torch.randn(3), torch.randn(2, 2)
        torch.testing.assert_close(gm(a, b), (a, b))

    def test_groups_dtypes_and_reduce_ops_are_separate_buckets(self, fake_pg):
        other = dist.new_group(ranks=[0, 1])

        def fn(a, b, c, d, e):
            return (
                ddp_fusion.all_reduce_gradient(a),
                ddp_fusion.all_reduce_gradient(b.to(torch.bfloat16)),
                ddp_fusion.all_reduce_gradient(c, other),
                ddp_fusion.all_reduce_gradient(d, reduce_op="sum"),
                ddp_fusion.all_reduce_gradient(e),
            )

        gm = trace(fn, *[torch.randn(4) for _ in range(5)])
        result = fuse(gm, algorithm="coalesced")
        plan = result.plan.buckets
        keys = sorted((b.group, str(b.dtype).removeprefix("torch."), b.reduce_op, len(b.grads))
                      for b in plan)
        g0, g1 = dist.group.WORLD.group_name, other.group_name
        assert keys == sorted(
            [(g0, "float32", "avg", 2), (g0, "bfloat16", "avg", 1),
             (g1, "float32", "avg", 1), (g0, "float32", "sum", 1)]
        )
        coalesced = gm.graph.find_nodes(op="call_function", target=BUCKET_COALESCED)
        assert len(coalesced) == 4

    def test_dependent_gradient_cuts_the_bucket(self):
        """b is computed from a's *reduced* value: one collective cannot carry both."""

        def fn(a):
            ra = ddp_fusion.all_reduce_gradient(a * 2, name="a")
            rb = ddp_fusion.all_reduce_gradient(ra + 1, name="b")
            return ra, rb

        gm = trace(fn, torch.randn(3))
        result = fuse(gm, algorithm="concat")
        assert [b.grads[0].name for b in result.buckets] == ["a", "b"]
        assert "reduced value" in result.buckets[0].cut_reason
        a = torch.randn(3)
        torch.testing.assert_close(gm(a), fn(a))

    def test_early_reader_moves_after_the_bucket(self):
        """A reader of the first gradient's result placed before the second gradient
        exists (possible in hand-written graphs) is moved after the fused collective."""

        def fn(a, b):
            ra = ddp_fusion.all_reduce_gradient(a)
            early = ra * 10
            rb = ddp_fusion.all_reduce_gradient(b * 3)
            return early, rb

        gm = trace(fn, torch.randn(3), torch.randn(3))
        result = fuse(gm, algorithm="concat")
        assert [len(b.grads) for b in result.buckets] == [1 + 1]
        FileCheck().check("all_reduce_bucket.default").check("wait_bucket").check("mul.Tensor(").run(
            gm.code.split("mul_1")[-1]
        )
        a, b = torch.randn(3), torch.randn(3)
        torch.testing.assert_close(gm(a, b), fn(a, b))

    def test_buckets_follow_the_hooks_ready_order_not_graph_order(self, fake_pg):
        """Gradients computed in graph order a, b, c, d but tagged with eager autograd's
        ready order b, a, d, c: with a cap of two gradients' bytes, the buckets are
        [b, a] and [d, c], each issued after the last of its gradients in the graph."""
        limits = [8]  # bytes: two float32 scalars-worth of 1-element gradients

        def fn(a, b, c, d):
            tag = lambda g, n, r: ALL_REDUCE_GRADIENT(g * 2, fake_pg.group_name, "avg", limits, n, None, r)
            return tag(a, "a", 1), tag(b, "b", 0), tag(c, "c", 3), tag(d, "d", 2)

        args = [torch.randn(1) for _ in range(4)]
        gm = trace(fn, *args)
        result = fuse(gm, algorithm="concat")
        assert [[g.name for g in b.grads] for b in result.buckets] == [["b", "a"], ["d", "c"]]
        torch.testing.assert_close(gm(*args), fn(*args))

    def test_two_wrappers_never_share_a_bucket(self, fake_pg):
        """Two wrappers (owners 0 and 1) on the same group, each numbering its ready
        order from 0: buckets stay per wrapper, as with two eager DDP models."""

        def fn(*xs):
            out = []
            for i, x in enumerate(xs):
                owner, r = divmod(i, 4)
                name = f"{'DG'[owner]}{r}"
                out.append(ALL_REDUCE_GRADIENT(x * 2, fake_pg.group_name, "avg", [8], name, None, r, owner))
            return out

        gm = trace(fn, *[torch.randn(1) for _ in range(8)])
        result = fuse(gm, algorithm="concat")
        assert [[g.name for g in b.grads] for b in result.buckets] == [
            ["D0", "D1"], ["D2", "D3"], ["G0", "G1"], ["G2", "G3"]
        ]

    def test_ready_order_is_ignored_when_a_gradient_reads_a_reduced_one(self, fake_pg):
        """b is computed from a's reduced value: buckets in ready order could wait on each
        other, so the plan uses graph order and cuts there."""

        def fn(a):
            ra = ALL_REDUCE_GRADIENT(a * 2, fake_pg.group_name, "avg", [1 << 20], "a", None, 1)
            rb = ALL_REDUCE_GRADIENT(ra + 1, fake_pg.group_name, "avg", [1 << 20], "b", None, 0)
            return ra, rb

        gm = trace(fn, torch.randn(3))
        result = fuse(gm, algorithm="concat")
        assert [b.grads[0].name for b in result.buckets] == ["a", "b"]
        a = torch.randn(3)
        torch.testing.assert_close(gm(a), fn(a))

    def test_no_tagged_all_reduce_leaves_graph_alone(self):
        gm = trace(lambda x: x * 2, torch.randn(3))
        code = gm.code
        assert fuse(gm).buckets == [] and gm.code == code

    def test_new_nodes_have_fake_values(self):
        gm = trace(small_backward, *inputs())
        fuse(gm, algorithm="concat")
        for node in gm.graph.nodes:
            if node.op == "call_function":
                assert "val" in node.meta, node


@pytest.mark.usefixtures("fake_pg")
def test_dumps(tmp_path):
    gm = trace(small_backward, *inputs())
    result = fuse(gm, algorithm="coalesced", dump_dir=str(tmp_path))
    stem = result.dump_stem
    before = open(stem + ".before.txt").read()
    after = open(stem + ".after.txt").read()
    assert "ddp_fusion.all_reduce_gradient" in before and "all_reduce_coalesced" in after
    plan = json.load(open(stem + ".buckets.json"))
    assert plan == {
        "algorithm": "coalesced",
        "buckets": [
            {"group": dist.group.WORLD.group_name, "dtype": "float32", "device": "cpu",
             "reduce_op": "avg", "algorithm": "coalesced", "bytes": 80, "num_grads": 2,
             "numels": [15, 5], "grads": ["w2", "w1"]}
        ],
        "unfused": [],
    }


@pytest.mark.usefixtures("fake_pg")
@pytest.mark.parametrize("algorithm", ["concat", "coalesced"])
def test_comm_dtype_casts_around_the_collective(algorithm):
    """bf16 gradients reduced in fp32 (reduce_dtype): cast, divide, reduce, cast back;
    gradients with another comm dtype go to another bucket."""

    def fn(a, b, c):
        return (
            ddp_fusion.all_reduce_gradient(a, comm_dtype=torch.float32),
            ddp_fusion.all_reduce_gradient(b, comm_dtype=torch.float32),
            ddp_fusion.all_reduce_gradient(c),
        )

    args = [torch.randn(5, dtype=torch.bfloat16) for _ in range(3)]
    gm = trace(fn, *args)
    result = fuse(gm, algorithm=algorithm)
    assert sorted(len(b.grads) for b in result.buckets) == [1, 2]
    (fp32_bucket,) = [b for b in result.buckets if b.key.comm_dtype == torch.float32]
    assert len(fp32_bucket.grads) == 2
    op = "all_reduce_bucket_coalesced" if algorithm == "coalesced" else "all_reduce_bucket.default"
    FileCheck().check("convert_element_type.default").check("torch.float32").check(
        "div"
    ).check(op).check("wait_bucket").check("convert_element_type.default").check(
        "torch.bfloat16"
    ).run(gm.code)
    for got, x in zip(gm(*args), args):  # fake group of 2: the mean halves
        torch.testing.assert_close(got, (x.float() / 2).to(torch.bfloat16), rtol=0, atol=0)


def _break_no_meta(gm):
    gm.graph.find_nodes(op="call_function", target=ALL_REDUCE_GRADIENT)[0].args[0].meta.pop("val")


def _break_sparse(gm):
    gm.graph.find_nodes(op="call_function", target=ALL_REDUCE_GRADIENT)[0].args[0].meta[
        "val"
    ] = torch.zeros(4).to_sparse()


def _break_group(gm):
    node = gm.graph.find_nodes(op="call_function", target=ALL_REDUCE_GRADIENT)[0]
    node.args = (node.args[0], "no-such-group", *node.args[2:])


@pytest.mark.usefixtures("fake_pg")
@pytest.mark.parametrize(
    "break_graph, reason",
    [
        (_break_no_meta, "no tensor metadata"),
        (_break_sparse, "only dense (strided) gradients fuse"),
        (_break_group, "'no-such-group' is not registered"),
        (None, "symbolic shape"),
    ],
    ids=["no-meta", "sparse", "unknown-group", "symbolic"],
)
def test_unfused_gradient_is_reported_with_its_reason(break_graph, reason, caplog):
    from torch._dynamo.utils import counters

    from ddp_fusion import passes

    def fn(a, b):
        return ddp_fusion.all_reduce_gradient(a * 2), ddp_fusion.all_reduce_gradient(b * 2)

    mode = "fake" if break_graph else "symbolic"
    gm = make_fx(fn, tracing_mode=mode)(torch.randn(4), torch.randn(4))
    if break_graph:
        break_graph(gm)
    counters.clear()
    passes._warned.clear()
    result = fuse(gm)
    assert result.unfused and all(reason in u.reason for u in result.unfused)
    assert counters["ddp_fusion"]["unfused"] == len(result.unfused)
    assert any(reason in r.message for r in caplog.records if r.levelname == "WARNING")
    # what was left unfused is still there, and still runs (as a blocking all-reduce);
    # where its group is known, after the group's plan check and divided by the checked
    # divisor (all_reduce_checked), and its group's plan names it
    left = gm.graph.find_nodes(op="call_function", target=ALL_REDUCE_GRADIENT)
    checked = gm.graph.find_nodes(op="call_function", target=ALL_REDUCE_CHECKED)
    assert {u.node for u in result.unfused} == set(left) | set(checked)
    for u in result.unfused:
        if u.registered:
            assert u.node.target is ALL_REDUCE_CHECKED and u.node.args[1].target is PLAN_GUARD
        else:
            assert u.node.target is ALL_REDUCE_GRADIENT
    assert len(checked) == (0 if break_graph is _break_group else len(result.unfused))
    assert [(g, group) for g, _, group in result.plan.unfused] == [
        (u.label, u.group_name) for u in result.unfused]


def _check_dp_x_tp_backward(dp, tp):
    """A DP x TP backward: TP all-reduces (on ``tp``) sit between gradients reduced over
    ``dp``. The DP gradients still form DDP's buckets across them, the TP all-reduces keep
    their inputs and relative order, and each group is bucketed apart."""

    def backward(g_out, w2, w1, b1):
        gw2 = g_out.t() @ w2
        r_w2 = ddp_fusion.all_reduce_gradient(gw2, dp, name="w2")
        g_h = fcol.all_reduce(g_out @ w2, "sum", tp)  # TP: input grad of the block
        gw1 = g_h.t() @ w1
        r_w1 = ddp_fusion.all_reduce_gradient(gw1, dp, name="w1")
        g_x = fcol.all_reduce(g_h @ w1.t(), "sum", tp)
        r_b1 = ddp_fusion.all_reduce_gradient(b1 * 2, dp, name="b1")
        return r_w2, r_w1, r_b1, g_x

    args = [torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8), torch.randn(8)]
    gm = trace(backward, *args)
    tp_nodes = [n for n in gm.graph.nodes if n.target is C10D.all_reduce.default]
    tp_args = [n.args for n in tp_nodes]
    result = fuse(gm, algorithm="concat")
    assert [[g.name for g in b.grads] for b in result.buckets] == [["w2", "w1", "b1"]]
    assert result.buckets[0].key.group_name == dp.group_name
    after = [n for n in gm.graph.nodes if n.target is C10D.all_reduce.default]
    assert after == tp_nodes and [n.args for n in after] == tp_args
    (bucket,) = gm.graph.find_nodes(op="call_function", target=BUCKET)
    assert bucket.args[1] == dp.group_name
    torch.testing.assert_close(gm(*args), backward(*args), rtol=0, atol=0)


@pytest.mark.usefixtures("fake_pg")
def test_dp_x_tp_backward_graph():
    _check_dp_x_tp_backward(dp=dist.new_group(ranks=[0]), tp=dist.new_group(ranks=[0, 1]))


@pytest.mark.usefixtures("fake_pg")
@pytest.mark.parametrize("shape", [(1, 2), (2, 1)], ids=["dp1xtp2", "dp2xtp1"])
def test_dp_x_tp_on_a_2d_device_mesh(shape):
    """The groups come from a 2-D ``DeviceMesh`` (``mesh["dp"]``, ``mesh["tp"]``), as
    users build them. The fake world has 2 ranks, so one dimension has size 1."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_group(), mesh["tp"].get_group()
    assert dp.group_name != tp.group_name
    _check_dp_x_tp_backward(dp, tp)


@pytest.mark.usefixtures("fake_pg")
def test_an_unfused_all_reduce_divides_by_joins_divisor():
    """A tagged all-reduce that is not bucketed (run eagerly, or a symbolic-shape
    gradient the pass leaves as ``all_reduce_checked``) divides by the divisor of this
    step (scaling.py: under ``join(divide_by_initial_world_size=False)``, the ranks still
    training), as the buckets do, not by the group size (the fake group's all-reduce
    returns its input, so the result is the input over the divisor)."""
    from ddp_fusion import scaling

    def fn(a):
        return ddp_fusion.all_reduce_gradient(a * 1)

    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(4))
    result = fuse(gm)
    assert len(result.unfused) == 1 and result.unfused[0].node.target is ALL_REDUCE_CHECKED
    g = torch.arange(4.0)
    world = dist.group.WORLD
    assert torch.equal(gm(g), g / 2) and torch.equal(ddp_fusion.all_reduce_gradient(g), g / 2)
    scaling.set_divisor(world, 1)  # one of the two ranks still training
    try:
        assert torch.equal(gm(g), g) and torch.equal(ddp_fusion.all_reduce_gradient(g), g)
    finally:
        scaling.set_divisor(world, None)


@pytest.mark.usefixtures("fake_pg")
@pytest.mark.parametrize("algorithm", ["concat", "coalesced"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_kept_grads_hold_the_reduced_gradient_in_place(algorithm, layout):
    """The in-place form computes what the graph computed: each kept ``.grad`` is the same
    tensor and holds (old + new) / 2 (a fake group of 2 sums nothing), as unfused; also
    a ``.grad`` with a transposed parameter's strides (dense, not contiguous)."""
    grad2 = torch.randn(5, 3) if layout == "contiguous" else torch.randn(3, 5).t()
    args = [*inputs(), torch.randn(5), grad2]
    want = [t.clone() for t in kept_backward(*[a.clone() for a in args])]
    gm = trace(kept_backward, *args)
    fuse(gm, algorithm=algorithm)
    assert "all_reduce_in_place" in gm.code and "aten.cat" not in gm.code
    grads = [args[3].clone(), args[4].clone(memory_format=torch.preserve_format)]
    assert grads[1].stride() == args[4].stride()
    got = gm(*args[:3], *grads)
    assert got[0] is grads[0] and got[1] is grads[1]
    for g, w in zip(got, want):  # the unfused ops' result, (old + new) / 2
        torch.testing.assert_close(g, w)


@pytest.mark.usefixtures("fake_pg")
def test_kept_grads_not_reduced_in_place_where_they_cannot_be(caplog, monkeypatch):
    """Declined, and logged with the reason (concat with its bucket buffer, and the copy
    back): a ``.grad`` the graph reads after the gradient is made (it must keep its old
    value until then), and a bucket with a communication dtype."""
    def read_after(x, grad):
        reduced = ddp_fusion.all_reduce_gradient(grad + x * 2, name="w")
        old = grad.sum()
        return grad.copy_(reduced), old

    def comm_dtype(x, grad):
        return grad.copy_(ddp_fusion.all_reduce_gradient(grad + x * 2, name="w", comm_dtype=torch.float64))

    def view_read_after(x, grad):
        view = grad.view(2, 2)  # taken before the gradient is made, read after
        reduced = ddp_fusion.all_reduce_gradient(grad + x * 2, name="w")
        return grad.copy_(reduced), view.sum()

    monkeypatch.setattr(ddp_fusion.passes, "_warned", set())  # logged once per process
    whys = ["the graph reads the old .grad of w after its new gradient is made",
            "it is reduced in torch.float64", "the graph reads the old .grad of w"]
    for fn, why in zip((read_after, comm_dtype, view_read_after), whys):
        monkeypatch.setattr(ddp_fusion.passes, "_warned", set())
        gm = trace(fn, torch.randn(4), torch.randn(4))
        with caplog.at_level("INFO", logger="ddp_fusion"):
            fuse(gm, algorithm="concat")
        assert "all_reduce_in_place" not in gm.code, fn
        FileCheck().check("bucket0_cat").check("all_reduce_bucket.default").check("wait_bucket").check(
            "copy_.default").run(gm.code)
        assert any(why in r.getMessage() and "copy back" in r.getMessage() for r in caplog.records), why


@pytest.mark.usefixtures("fake_pg")
def test_in_place_buckets_in_flight_keep_their_own_gathered_buffers():
    """Two buckets of ``.grad``s that are not one run of memory, in flight together,
    each starting with an empty ``.grad`` (whose address is 0): each wait copies back
    its own bucket's buffer."""
    in_place, wait = torch.ops.ddp_fusion.all_reduce_in_place, torch.ops.ddp_fusion.wait_in_place
    a, b = [torch.empty(0), torch.arange(3.0)], [torch.empty(0), torch.arange(4.0) + 10]
    in_place(a, "0", "concat")
    in_place(b, "0", "concat")
    wait(a)
    wait(b)
    assert a[1].tolist() == [0.0, 1.0, 2.0] and b[1].tolist() == [10.0, 11.0, 12.0, 13.0]


@pytest.mark.usefixtures("fake_pg")
def test_gathered_grads_move_into_their_bucket_only_where_they_own_their_memory():
    """Issue 36 item 7. ``.grad``s of their own (autograd's, a ``no_sync()`` step's) move
    into the buffer they were gathered into: the same objects, one run from then on.
    Views into a buffer of the user's (a flat-buffer optimizer's, here in another order
    than the bucket's) stay there and get the values copied back."""
    from torch._dynamo.utils import counters

    counters.clear()
    in_place, wait = torch.ops.ddp_fusion.all_reduce_in_place, torch.ops.ddp_fusion.wait_in_place
    own = [torch.arange(3.0), torch.arange(4.0).reshape(2, 2).t()]  # (the second: strides (1, 2))
    objects = list(own)
    in_place(own, "0", "concat")
    wait(own)
    assert [g is o for g, o in zip(own, objects)] == [True, True]
    assert own[0].untyped_storage().data_ptr() == own[1].untyped_storage().data_ptr()
    assert own[1].stride() == (1, 2) and own[1].tolist() == [[0.0, 2.0], [1.0, 3.0]]
    assert own[0].tolist() == [0.0, 1.0, 2.0]
    in_place(own, "0", "concat")  # one run now
    wait(own)

    flat = torch.arange(7.0)
    views = [flat[4:], flat[:4]]  # the bucket's order is not the buffer's
    in_place(views, "0", "concat")
    wait(views)
    assert all(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in views)
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    counts = counters["ddp_fusion"]
    assert (counts["in place: gathered"], counts["in place: moved into the bucket"], counts["in place: one run"]) == (2, 1, 1)


@pytest.mark.usefixtures("fake_pg")
def test_a_named_layout_is_checked_for_one_run_once_per_pointers(monkeypatch):
    """Issue 36: a bucket whose kept ``.grad``s have static sizes and strides comes with
    the pass's name for them; the op walks the ``.grad``s' sizes and strides once per
    pointers, and on later steps compares pointers only (and the run's end with the first
    ``.grad``'s storage). ``.grad``s that moved are walked again."""
    from torch._dynamo.utils import counters

    from ddp_fusion import ops

    counters.clear()
    in_place, wait = torch.ops.ddp_fusion.all_reduce_in_place, torch.ops.ddp_fusion.wait_in_place
    flat = torch.arange(7.0)
    grads = [flat[:3], flat[3:].view(2, 2)]
    in_place(grads, "0", "concat", "test/one-run")
    wait(grads)
    assert ops._runs["test/one-run"] == ((grads[0].data_ptr(), grads[1].data_ptr()), 28)

    def walked(t):
        raise AssertionError("walked the .grads again")

    with monkeypatch.context() as m:
        m.setattr(ops, "is_dense", walked)
        in_place(grads, "0", "concat", "test/one-run")  # same pointers: no walk
        wait(grads)
        ops._runs["test/one-run"] = (ops._runs["test/one-run"][0], 32)  # past the storage's end
        in_place(grads, "0", "concat", "test/one-run")
        wait(grads)  # gathered, and copied back (views of flat, not their own memory)
    apart = [torch.arange(3.0), torch.arange(4.0).view(2, 2)]  # moved: walked, gathered
    in_place(apart, "0", "concat", "test/one-run")
    wait(apart)
    counts = counters["ddp_fusion"]
    assert (counts["in place: one run"], counts["in place: gathered"]) == (2, 2)
    assert flat.tolist() == list(range(7)) and apart[1].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    # a released model's entries go with it (names start with its id), no other's
    in_place(apart, "0", "concat", "7/0/bucket0/2/0")
    wait(apart)
    ops.forget_runs(7)
    assert "7/0/bucket0/2/0" not in ops._runs and "test/one-run" in ops._runs
    del ops._runs["test/one-run"]


@pytest.mark.usefixtures("fake_pg")
def test_a_coalesced_in_place_bucket_views_only_its_non_contiguous_grads(monkeypatch):
    """Issue 36: ``all_reduce_coalesced_`` takes a contiguous ``.grad`` of any shape, so the
    in-place op passes those as they are; only a dense ``.grad`` in another memory order
    (channels-last) goes through its 1-D view of memory."""
    from ddp_fusion import ops

    viewed = []
    memory = ops._memory
    monkeypatch.setattr(ops, "_memory", lambda t: viewed.append(t) or memory(t))
    grads = [torch.ones(3, 4), torch.ones(5),
             torch.ones(2, 3, 4, 4).to(memory_format=torch.channels_last)]
    torch.ops.ddp_fusion.all_reduce_in_place(grads, "0", "coalesced")
    torch.ops.ddp_fusion.wait_in_place(grads)
    assert [t is grads[2] for t in viewed] == [True]
    assert all(bool((g == 1).all()) for g in grads)


@pytest.mark.usefixtures("fake_pg")
def test_the_ops_wait_below_the_python_autograd_kernel_of_wait_tensor():
    """Issue 36: ``torch.distributed._functional_collectives`` registers a Python autograd
    kernel for ``_c10d_functional.wait_tensor``, which a call from Python runs through
    (about 3.4 us). ddp_fusion's ops wait below autograd: once per bucket, and once per
    tensor of a ``coalesced`` bucket of separate tensors."""
    import sys

    import torch.distributed._functional_collectives  # noqa: F401 (registers the kernel)

    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "autograd_impl":
            calls.append(frame.f_code.co_filename)

    def run(ops):
        sys.setprofile(profile)
        try:
            ops()
        finally:
            sys.setprofile(None)

    c10d, ddp = torch.ops._c10d_functional, torch.ops.ddp_fusion
    flat, tensors = torch.ones(5), [torch.ones(3), torch.ones(2, 2)]
    run(lambda: (c10d.all_reduce_(flat, "sum", "0"), c10d.wait_tensor(flat)))
    assert calls, "the control: called from Python, wait_tensor runs the Python kernel"
    calls.clear()
    run(lambda: (ddp.all_reduce_bucket(flat, "0"), ddp.wait_bucket([flat]),
                 ddp.all_reduce_bucket_coalesced(tensors, "0"), ddp.wait_bucket(tensors),
                 ddp.all_reduce_in_place(tensors, "0", "coalesced"), ddp.wait_in_place(tensors),
                 ddp.all_reduce_in_place(tensors, "0", "concat"), ddp.wait_in_place(tensors)))
    assert calls == []
    assert flat.tolist() == [1.0] * 5 and tensors[1].tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_off_the_cpu_grads_move_only_where_each_keeps_16_byte_alignment():
    """Inductor may assume its GPU inputs 16-byte aligned (and copy any that is not, every
    step): a bucket whose move would put a ``.grad`` at an unaligned address keeps its
    copy back. (A meta buffer stands for a device's: its address is 0.)"""
    from ddp_fusion import ops

    def meta(n):
        return torch.empty(n, device="meta")

    assert not ops._movable([meta(3), meta(4)], meta(7))  # the second would start at byte 12
    assert ops._movable([meta(4), meta(3)], meta(7))


@pytest.mark.usefixtures("fake_pg")
def test_pending_reports_a_gathered_bucket_until_its_wait():
    """``ddp_fusion.pending()``: the per-step state still held, empty between steps."""
    in_place, wait = torch.ops.ddp_fusion.all_reduce_in_place, torch.ops.ddp_fusion.wait_in_place
    grads = [torch.ones(3), torch.ones(2)]  # two allocations: gathered into a buffer
    assert ddp_fusion.pending() == {}
    in_place(grads, "0", "concat")
    assert ddp_fusion.pending() == {"gathered buckets": 1}
    wait(grads)
    assert ddp_fusion.pending() == {}


def _gradients(n, kept):
    """A backward of ``n`` gradients, each reduced, as a new tensor or (``kept``) copied
    into a graph input, as the hooks trace a kept ``.grad``."""

    def fn(x, *grads):
        dh, out = x, []
        for i in range(n):
            dh = dh * 0.5
            reduced = ddp_fusion.all_reduce_gradient(dh + float(i), name=f"p{i}")
            out.append(grads[i].copy_(reduced) if kept else reduced)
        return out

    return trace(fn, *(torch.randn(4) for _ in range(n + 1 if kept else 1)))


@pytest.mark.usefixtures("fake_pg")
@pytest.mark.parametrize("kept", [False, True], ids=["new", "kept"])
def test_the_pass_rewrites_the_graph_output_a_constant_number_of_times(kept, monkeypatch):
    """The graph output reads every gradient, so each rewrite of it costs O(gradients):
    the pass rewrites it a number of times that does not grow with the gradients (a
    rewrite per gradient made the pass quadratic on kept .grads: 3,200 gradients took
    ~9x the time of 800). Counted, not timed: by the public ways a node's readers
    change (``replace_all_uses_with``'s changed readers, the ``args`` setter)."""
    rewrites = []
    args_prop, replace = torch.fx.Node.args, torch.fx.Node.replace_all_uses_with

    def set_args(node, value):
        rewrites.append(node.op == "output")
        args_prop.fset(node, value)

    def replace_all_uses_with(node, *a, **k):
        users = replace(node, *a, **k)
        rewrites.extend(u.op == "output" for u in users)
        return users

    monkeypatch.setattr(torch.fx.Node, "args", property(args_prop.fget, set_args))
    monkeypatch.setattr(torch.fx.Node, "replace_all_uses_with", replace_all_uses_with)
    counts = {}
    for n in (8, 32):
        gm = _gradients(n, kept)
        rewrites.clear()
        fuse(gm, algorithm="concat")
        assert ("all_reduce_in_place" in gm.code) == kept
        counts[n] = sum(rewrites)
    assert 1 <= counts[32] == counts[8], counts


@pytest.mark.usefixtures("fake_pg")
def test_only_the_plan_check_start_takes_the_plans_text():
    """Issue 36: the plan's text (O(gradients) bytes) was a str argument of both plan
    ops, which the dispatcher copies twice per call, every step (16 µs a call at 1,000
    gradients). The guards take its hash only (finding the text by it); the start, one
    per group per step, still takes it: a graph served from Inductor's cache needs it in
    a process that did not compile it (docs/limits.md). Counted by the str arguments'
    sizes at 8 and at 64 gradients."""

    def str_sizes(gm, target):
        sizes = []
        for node in gm.graph.find_nodes(op="call_function", target=target):
            torch.fx.node.map_aggregate((node.args, node.kwargs),
                                        lambda a: sizes.append(len(a)) if isinstance(a, str) else a)
        return sizes

    guards, starts = {}, {}
    for n in (8, 64):
        gm = _gradients(n, kept=False)
        fuse(gm, algorithm="concat")
        guards[n] = str_sizes(gm, PLAN_GUARD)
        starts[n] = str_sizes(gm, torch.ops.ddp_fusion.plan_check_start.default)
    assert guards[8] and guards[8] == guards[64], guards
    assert len(starts[64]) == 3 and starts[64][1] > starts[8][1] and starts[64][2] == starts[8][2], starts


@pytest.mark.usefixtures("fake_pg")
def test_the_start_returns_its_reduce_ops_divisor_and_other_keys_get_a_divisor_op():
    """The group's start returns the divisor of its first key (no ``plan_divisor`` op for
    it: one op call fewer a step); a second reduce op of the same group gets its own
    ``plan_divisor``. Run on the fake group of 2: ``avg`` divides by 2, ``sum`` by 1."""
    from ddp_fusion import plan_check
    from ddp_fusion.passes._graph import NodeMaker
    from ddp_fusion.passes.guard import insert_plan_guards

    group = dist.group.WORLD.group_name
    cpu = torch.device("cpu")
    plan = '{"algorithm": "concat", "buckets": [], "unfused": []}'
    h = plan_check.plan_hash(plan)
    for op, want in (("avg", 2.0), ("sum", 1.0)):
        out = plan_check.PLAN_CHECK_START(group, plan, h, cpu, op)
        assert out.shape == () and out.dtype == torch.float32 and out.item() == want, (op, out)
        assert plan_check.PLAN_GUARD(out, group, h, op, cpu).item() == want
        assert plan_check.PLAN_START(group, plan, h, cpu, op).item() == want  # (plan_check off)
    graph = torch.fx.Graph()
    graph.placeholder("x")
    guards, starts = insert_plan_guards(NodeMaker(graph), [(group, "avg", cpu), (group, "sum", cpu)], {group: plan})
    (start, avg_guard), (divisor, sum_guard) = guards[group, "avg", cpu], guards[group, "sum", cpu]
    assert start.target is plan_check.PLAN_CHECK_START and start.args[-1] == "avg" and starts == {group: start}
    assert divisor.target is plan_check.PLAN_DIVISOR and divisor.args == (group, "sum", cpu)
    assert avg_guard.args[0] is start and sum_guard.args[0] is start
    assert len(graph.find_nodes(op="call_function", target=plan_check.PLAN_CHECK_START)) == 1


@pytest.mark.usefixtures("fake_pg")
def test_a_long_plan_goes_into_the_graph_compressed():
    """The start's copy of a long plan is compressed (about 15x for a real model's
    names), and the op reads the exact plan back from it, once per process; a short
    plan stays readable JSON in the graph."""
    from ddp_fusion import plan_check
    from ddp_fusion.plan import BucketPlan, PlannedBucket

    names = tuple(f"model.layers.{i // 7}.mlp.experts.{i % 7}.w{i % 3}.weight" for i in range(1000))
    long = BucketPlan("concat", (PlannedBucket("0", torch.float32, "cpu", "avg", "concat", names,
                                               (1024,) * len(names)),)).to_json()
    short = BucketPlan("concat", (PlannedBucket("0", torch.float32, "cpu", "avg", "concat", names[:2],
                                                (4, 4)),)).to_json()
    assert plan_check.graph_text(short) == short
    text = plan_check.graph_text(long)
    assert len(text) * 10 < len(long)
    h = plan_check.plan_hash(long)
    plan_check._texts.pop(h, None)
    plan_check.PLAN_CHECK_START(dist.group.WORLD.group_name, text, h, torch.device("cpu"))
    assert plan_check._texts[h] == long


@pytest.mark.usefixtures("fake_pg")
def test_the_pass_runs_with_the_garbage_collector_paused(monkeypatch):
    """Python's full collections walk every live object, most of them the graph's nodes
    and fake tensors: run during the pass, they cost the chain-shaped concat pass
    15-27 % of its median time at 3,200 gradients (bench/results/pass_time_cpu_2026-11-26.md).
    Paused inside, restored after, also when the pass raises."""
    import gc

    from ddp_fusion import passes

    seen = []
    plan = passes.plan_buckets
    monkeypatch.setattr(passes, "plan_buckets", lambda *a: seen.append(gc.isenabled()) or plan(*a))
    fuse(_gradients(4, kept=False), algorithm="concat")
    assert seen == [False] and gc.isenabled()

    monkeypatch.setattr(passes, "plan_buckets", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        fuse(_gradients(4, kept=False), algorithm="concat")
    assert gc.isenabled()


@pytest.mark.usefixtures("fake_pg")
@pytest.mark.parametrize("algorithm", ["concat", "coalesced"])
def test_a_gradient_sits_in_its_bucket_in_its_parameters_layout(algorithm):
    """Issue 37: the element order of a gradient in its bucket is its parameter's layout
    (registered by the model), not the layout of the tensor the gradient came in: a
    contiguous gradient of a transposed parameter is copied in transposed, and the
    reduced gradient comes back with the parameter's strides. The registration is part
    of the FX graph cache key (the graph is the same either way)."""
    from ddp_fusion import _install, plan

    model_id, param = 4242, torch.empty(3, 5).t()  # (5, 3), strides (1, 5)

    def fn(x):
        return (ALL_REDUCE_GRADIENT(x * 2, "0", "avg", [1 << 20], "w", None, 0, model_id),)

    before = _install.THE_PASS.uuid()
    orders = plan.register_element_orders(model_id, [("w", param)])
    try:
        assert _install.THE_PASS.uuid() != before
        x = torch.randn(5, 3)
        gm = trace(fn, x)
        fuse(gm, algorithm=algorithm)
        FileCheck().check("permute").check("all_reduce_bucket").run(gm.code)
        (got,) = gm(x)
        assert got.stride() == param.stride()
        torch.testing.assert_close(got, x)  # (x * 2) / 2: a fake group of 2 sums nothing
    finally:
        plan.forget_element_orders(model_id, orders)
    assert _install.THE_PASS.uuid() == before


@pytest.mark.usefixtures("fake_pg")
def test_plan_check_keeps_the_value_its_ranks_agreed_on(caplog, monkeypatch):
    """``config.plan_check`` changed after a model's first forward (where the ranks
    compared it) would make this rank's graphs differ from the others': the pass keeps
    the agreed value for the group and warns once; the pass's cache key carries it."""
    from ddp_fusion import _install, plan_check

    monkeypatch.setattr(plan_check, "_agreed", {})
    monkeypatch.setattr(plan_check, "_warned_changed", set())
    key_before = _install.THE_PASS.uuid()
    plan_check.agree(dist.group.WORLD, True)
    assert _install.THE_PASS.uuid() != key_before
    with ddp_fusion.config.patch(plan_check=False):
        for _ in range(2):
            gm = trace(small_backward, *inputs())
            fuse(gm)
            FileCheck().check("plan_check_start").check("plan_guard").check("all_reduce_bucket").run(gm.code)
    changed = [r for r in caplog.records if "config.plan_check is False now" in r.getMessage()]
    assert len(changed) == 1 and "agreed on True" in changed[0].getMessage(), caplog.text
    plan_check.agree(dist.group.WORLD, False)  # agreed off: no check, whatever config says now
    gm = trace(small_backward, *inputs())
    fuse(gm)
    FileCheck().check("plan_start").check_not("plan_guard").run(gm.code)


def _unwritten_backward(model_id):
    """``kept_backward``'s w2, and a kept ``.grad`` that the backward did not write, read
    and copied back as a model's callback does (or code calling the op itself does)."""

    def fn(x, w1, w2, grad1, grad2):
        h = x @ w1
        grad2.copy_(ddp_fusion.all_reduce_gradient(grad2 + h.t() @ x, name="w2"))
        grad1.copy_(ALL_REDUCE_GRADIENT(grad1, "0", "avg", [1048576], "w1", None, -1, model_id))
        return grad1, grad2

    return fn


@pytest.mark.usefixtures("fake_pg")
@pytest.mark.parametrize("model_id", [7, -1])
def test_a_models_kept_grad_the_backward_did_not_write_is_not_reduced(model_id):
    """A compiled model's callback reads every kept ``.grad``, written by this backward or
    not (grad_sync.py); the pass leaves out those it did not write (the op reads a graph
    input and is copied back into it), as a hook per parameter would not have fired
    for them. Code calling the op itself on a graph input (no model) gets it reduced."""
    x, w1, w2 = inputs()
    gm = trace(_unwritten_backward(model_id), x, w1, w2, torch.zeros(5), torch.zeros(5, 3))
    result = fuse(gm)
    names = [n for b in result.plan.buckets for n in b.grads]
    code = gm.code
    if model_id >= 0:
        assert names == ["w2"], names
        FileCheck().check_count("aten.copy_.default(grad1", 0, exactly=True).run(code)
    else:
        assert sorted(names) == ["w1", "w2"], names
