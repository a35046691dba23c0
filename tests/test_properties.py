"""Property-based tests of the fusion pass (hypothesis), on random make_fx graphs.

Each example is a random backward-like graph: gradients of random shape (0-d and empty
included), dtype (float32 / bfloat16 / float16), process group (the fake world of 2, a
group of 1, a second group of 2), reduce op, communication dtype and bucket arguments,
each reduced with the tagged ``ddp_fusion.all_reduce_gradient``; interleaved with untagged functional
all-reduces, unrelated compute, early readers of reduced gradients, gradients that are
graph inputs as they are (ready before anything is computed), non-contiguous gradients,
one tensor reduced twice, and gradients computed from an earlier gradient's *reduced* value.
For every graph, with either algorithm and with or without wait scheduling, this pins down:

1. the fused graph lints and recompiles;
2. every tagged all-reduce is in exactly one bucket and none is left in the graph; the
   untagged collectives are the same nodes with the same arguments; one fused
   collective per bucket;
3. no bucket mixes process group, dtype, device, reduce op, communication dtype or
   bucket arguments;
4. the boundaries are eager DDP's: per key, torch's C++
   ``compute_bucket_assignment_by_size`` on the key's gradients in ready order, with
   the limits torch DDP derives from the same arguments. The one allowed difference:
   a bucket cut early (``Bucket.cut_reason``), only where a gradient (of any key) is
   computed from the reduced value of one of its members; the reference then restarts
   after the cut with the next limit. And no gradient reads the reduced value of a
   bucket that is not complete before it (its collective could not be issued in time);
5. the fused graph computes what the unfused graph computes, bit for bit (fake process
   group: a collective returns its input, ``avg`` divides by the group size first).

Profiles: ``ci`` (200 examples; the default) and ``slow`` (1000), chosen with
``HYPOTHESIS_PROFILE=slow``. ``test_fusion_properties_slow`` always runs the ``slow``
profile and is marked ``slow`` (CI runs ``-m "not slow"``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import ddp_fusion
from ddp_fusion import _torch
from ddp_fusion.passes import fuse_ddp_allreduces
from ddp_fusion.plan import ddp_bucket_limits
from ddp_fusion.passes.collectives import BucketKey

from _torch_buckets import torch_rebuild_limits

ALL_REDUCE_GRADIENT = torch.ops.ddp_fusion.all_reduce_gradient.default
C10D = torch.ops._c10d_functional
BUCKET = torch.ops.ddp_fusion.all_reduce_bucket.default
BUCKET_COALESCED = torch.ops.ddp_fusion.all_reduce_bucket_coalesced.default

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=200, **_COMMON)
settings.register_profile("slow", max_examples=1000, **_COMMON)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")


@functools.cache
def process_groups() -> tuple[dist.ProcessGroup, ...]:
    """(the fake world of 2, a group of 1, a second group of 2), created once."""
    assert dist.is_initialized(), "needs the fake_pg fixture"
    return dist.group.WORLD, dist.new_group(ranks=[0]), dist.new_group(ranks=[0, 1])


# --------------------------------------------------------------------------- specs


@dataclasses.dataclass(frozen=True)
class Grad:
    """A gradient, reduced with ``all_reduce_gradient(..., name=f"g{i}")`` (i counts
    Grad ops only). ``source`` says how the local gradient is made:

    * ``"input"``: a graph input as it is (ready before any compute);
    * ``"compute"``: ``x * 2`` of a fresh input ``x``;
    * ``"reduced"``: ``x * 2 + sum(reduced g<of>)`` (depends on a reduced gradient);
    * ``"untagged"``: ``x * 2 + sum(untagged all-reduce #of)``;
    * ``"strided"``: ``x * 2`` made non-contiguous (transposed, or every other element);
    * ``"reuse"``: the very local tensor of ``g<of>`` again (its shape and dtype).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    group: int  # index into process_groups()
    reduce_op: str
    bucket: int  # index into GraphSpec.bucket_args
    source: str = "compute"
    of: int | None = None
    comm_dtype: torch.dtype | None = None  # all_reduce_gradient(comm_dtype=...)


@dataclasses.dataclass(frozen=True)
class Untagged:
    """``fcol.all_reduce(t, "sum", group)``: ``t`` a fresh (3,) input, or (``of`` set)
    the local gradient of ``g<of>``."""

    group: int
    of: int | None = None


@dataclasses.dataclass(frozen=True)
class Compute:
    """``"matmul"``: unrelated ``x @ w``; ``"read"``: ``reduced g<of> * 3`` (an early
    reader of a reduced gradient); ``"sum"``: ``local g<of>.sum()`` (a second reader of
    a local gradient)."""

    kind: str
    of: int | None = None


@dataclasses.dataclass
class GraphSpec:
    bucket_args: list[dict[str, Any]]
    ops: list[Grad | Untagged | Compute]
    ready_orders: list[int] | None = None
    """A permutation: ``ready_order=`` for each Grad in turn (the hooks' eager ready
    order), or None (no ready order: the pass uses graph order)."""

    @property
    def grads(self) -> list[Grad]:
        return [op for op in self.ops if isinstance(op, Grad)]


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CAP_MB = st.one_of(st.floats(0.0001, 0.01), st.sampled_from([0.0, 0.25]))
BUCKET_ARGS = st.one_of(
    st.just({}),
    st.builds(lambda c: {"bucket_cap_mb": c}, CAP_MB),
    st.builds(lambda cs: {"bucket_cap_mb_list": cs}, st.lists(CAP_MB, min_size=1, max_size=3)),
)
SHAPES = (
    st.lists(st.sampled_from([1, 3, 0, 2, 5, 17, 64, 300]), max_size=3)
    .map(tuple)
    .filter(lambda s: math.prod(s) <= 100_000)
)


@st.composite
def graph_specs(draw, max_ops: int = 20) -> GraphSpec:
    bucket_args = draw(st.lists(BUCKET_ARGS, min_size=1, max_size=2))
    # A few keys per graph, so that keys get several gradients and several buckets.
    palette = draw(
        st.lists(
            st.tuples(
                st.integers(0, 2),
                st.sampled_from(DTYPES),
                st.sampled_from(["avg", "sum"]),
                st.integers(0, len(bucket_args) - 1),
                st.sampled_from([None, None, *DTYPES]),
            ),
            min_size=1,
            max_size=3,
        )
    )
    ops: list[Grad | Untagged | Compute] = []
    n_grads = n_untagged = 0
    # "Go on?" before each op (rather than a length drawn first) lets the shrinker delete
    # ops from the middle of a failing example.
    while len(ops) < max_ops and (not ops or draw(st.integers(0, 9)) > 0):
        kind = draw(st.sampled_from(["grad", "grad", "grad", "untagged", "compute"]))
        if kind == "grad":
            group, dtype, reduce_op, bucket, comm_dtype = draw(st.sampled_from(palette))
            sources = ["compute", "input", "strided"]
            if n_grads:
                sources += ["reduced", "reuse"]
            if n_untagged:
                sources += ["untagged"]
            source = draw(st.sampled_from(sources))
            of = None
            if source in ("reduced", "reuse"):
                of = draw(st.integers(0, n_grads - 1))
            elif source == "untagged":
                of = draw(st.integers(0, n_untagged - 1))
            shape = draw(SHAPES)
            ops.append(Grad(shape, dtype, group, reduce_op, bucket, source, of, comm_dtype))
            n_grads += 1
        elif kind == "untagged":
            of = draw(st.none() | st.integers(0, n_grads - 1)) if n_grads else None
            ops.append(Untagged(draw(st.integers(0, 2)), of))
            n_untagged += 1
        else:
            kinds = ["matmul", "read", "sum"] if n_grads else ["matmul"]
            kind = draw(st.sampled_from(kinds))
            of = draw(st.integers(0, n_grads - 1)) if kind != "matmul" else None
            ops.append(Compute(kind, of))
    ready_orders = draw(st.none() | st.permutations(range(n_grads)))
    return GraphSpec(bucket_args, ops, ready_orders)


# --------------------------------------------------------------------------- builder


def build(spec: GraphSpec):
    """``(fn, example_inputs)``: fn takes one input per non-reused Grad, one per Untagged
    without ``of``, then ``x`` and ``w`` for the matmuls; it returns every reduced
    gradient, every untagged result and every compute result."""
    groups = process_groups()
    gen = torch.Generator().manual_seed(0)

    def randn(shape, dtype=torch.float32):
        return torch.randn(shape, generator=gen).to(dtype)

    inputs = []
    for op in spec.ops:
        if isinstance(op, Grad) and op.source != "reuse":
            inputs.append(randn(op.shape, op.dtype))
        elif isinstance(op, Untagged) and op.of is None:
            inputs.append(randn((3,)))
    inputs += [randn((2, 3)), randn((3, 2))]

    def fn(*args):
        args = list(args)
        x, w = args[-2:]
        fresh = iter(args[:-2])
        local, reduced, untagged, computed = [], [], [], []
        for op in spec.ops:
            if isinstance(op, Grad):
                if op.source == "reuse":
                    g = local[op.of]
                elif op.source == "input":
                    g = next(fresh)
                elif op.source == "strided":
                    g = next(fresh) * 2
                    g = g.transpose(0, -1) if g.dim() >= 2 else g[::2] if g.dim() else g
                else:
                    g = next(fresh) * 2
                    if op.source == "reduced":
                        g = g + reduced[op.of].sum().to(g.dtype)
                    elif op.source == "untagged":
                        g = g + untagged[op.of].sum().to(g.dtype)
                local.append(g)
                reduced.append(
                    ddp_fusion.all_reduce_gradient(
                        g,
                        groups[op.group],
                        reduce_op=op.reduce_op,
                        comm_dtype=op.comm_dtype,
                        name=f"g{len(reduced)}",
                        ready_order=None if spec.ready_orders is None else spec.ready_orders[len(reduced)],
                        **spec.bucket_args[op.bucket],
                    )
                )
            elif isinstance(op, Untagged):
                t = next(fresh) if op.of is None else local[op.of]
                untagged.append(fcol.all_reduce(t, "sum", groups[op.group]))
            elif op.kind == "matmul":
                computed.append(x @ w)
            elif op.kind == "read":
                computed.append(reduced[op.of] * 3)
            else:
                computed.append(local[op.of].sum())
        return (*reduced, *untagged, *computed)

    return fn, inputs


# --------------------------------------------------------------------------- the reference




def _same_rule(a: list[int], b: list[int]) -> bool:
    """[c] and [c, c] are one rule: the last limit repeats."""

    def norm(limits):
        limits = list(limits)
        while len(limits) > 1 and limits[-1] == limits[-2]:
            limits.pop()
        return limits

    return norm(a) == norm(b)


@dataclasses.dataclass
class Tagged:
    """What the unfused graph says about one tagged all-reduce."""

    name: str
    ready: tuple[int, int]  # (position of its input, position of itself): ready order
    shape: tuple[int, ...]
    dtype: torch.dtype
    key: BucketKey  # expected, from the spec
    torch_limits: list[int]  # torch DDP's limits for its bucket arguments
    reads: frozenset[str]  # tagged all-reduces whose *reduced* value its input reads
    ready_order: int  # from the spec's ready_orders, or -1


def describe_unfused(gm: torch.fx.GraphModule, spec: GraphSpec) -> dict[str, Tagged]:
    groups = process_groups()
    by_name = {f"g{i}": g for i, g in enumerate(spec.grads)}
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    reads: dict[torch.fx.Node, frozenset[str]] = {}
    tagged: dict[str, Tagged] = {}
    for node in gm.graph.nodes:
        r = frozenset().union(*(reads[i] for i in node.all_input_nodes))
        if node.target is ALL_REDUCE_GRADIENT:
            grad_node, name = node.args[0], node.args[4]
            op = by_name[name]
            args = spec.bucket_args[op.bucket]
            val = grad_node.meta["val"]
            tagged[name] = Tagged(
                name=name,
                ready=(position[grad_node], position[node]),
                shape=tuple(val.shape),
                dtype=val.dtype,
                key=BucketKey(
                    groups[op.group].group_name,
                    val.dtype,
                    torch.device("cpu"),
                    op.reduce_op,
                    tuple(ddp_bucket_limits(**args)),
                    None if op.comm_dtype == val.dtype else op.comm_dtype,
                ),
                torch_limits=torch_rebuild_limits(**args),
                reads=reads[grad_node],
                ready_order=-1 if spec.ready_orders is None else spec.ready_orders[int(name[1:])],
            )
            r = r | {name}
        reads[node] = r
    assert len(tagged) == len(spec.grads)
    return tagged


# --------------------------------------------------------------------------- properties


def check_graph(gm: torch.fx.GraphModule) -> None:
    gm.graph.lint()
    gm.recompile()


def check_metadata(gm: torch.fx.GraphModule) -> None:
    """Every node's ``meta["val"]`` (the pass makes most of them without fake dispatch)
    is what fake dispatch gives: shape, strides (but of size-1 dimensions), dtype,
    device. (Overwrites the values.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    recorded = {n: n.meta.get("val") for n in gm.graph.nodes}
    inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)
              for v in (n.meta["val"] for n in gm.graph.find_nodes(op="placeholder"))]
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)

    def described(v):  # a size-1 dimension's stride is not part of the layout
        if isinstance(v, torch.Tensor):
            strides = tuple(s if n != 1 else None for n, s in zip(v.shape, v.stride()))
            return (tuple(v.shape), strides, v.dtype, v.device.type)
        if isinstance(v, (list, tuple)):
            return [described(x) for x in v]
        return None

    for node, val in recorded.items():
        if isinstance(val, (torch.Tensor, list, tuple)):
            assert described(val) == described(node.meta["val"]), (node.format_node(), val, node.meta["val"])


def check_partition(tagged: dict[str, Tagged], result, gm: torch.fx.GraphModule) -> None:
    """Every tagged all-reduce in exactly one bucket; none left in the graph."""
    assert result.unfused == []
    names = [g.name for b in result.buckets for g in b.grads]
    assert sorted(names) == sorted(tagged), "tagged all-reduces and bucket members differ"
    assert not gm.graph.find_nodes(op="call_function", target=ALL_REDUCE_GRADIENT)
    assert all(b.grads for b in result.buckets), "empty bucket"


def check_collectives(untagged_before: list, result, algorithm: str, gm) -> None:
    """Untagged collectives untouched; one fused collective per bucket."""
    nodes = list(gm.graph.nodes)
    for node, args in untagged_before:
        assert node in nodes and node.args == args, f"untagged {node} changed"
    all_reduces = gm.graph.find_nodes(op="call_function", target=C10D.all_reduce.default)
    assert len(all_reduces) == len(untagged_before)
    concat = gm.graph.find_nodes(op="call_function", target=BUCKET)
    coalesced = gm.graph.find_nodes(op="call_function", target=BUCKET_COALESCED)
    n = len(result.buckets)
    assert (len(concat), len(coalesced)) == ((n, 0) if algorithm == "concat" else (0, n))


def check_keys(tagged: dict[str, Tagged], result) -> None:
    """No bucket mixes group / dtype / device / reduce op / comm dtype / bucket
    arguments; each member's key is the one its call asked for."""
    for b in result.buckets:
        for g in b.grads:
            assert g.key == b.key, (g.name, g.key, b.key)
            assert g.key == tagged[g.name].key, (g.name, g.key, tagged[g.name].key)


def check_boundaries(tagged: dict[str, Tagged], result) -> None:
    """Per key: torch's C++ bucketing in ready order, restarted after each cut. A bucket
    is cut only where a gradient (of any key) reads the reduced value of one of its
    members, before the key's next gradient; and every bucket is complete before any
    gradient that reads one of its reduced values is computed (else its collective
    could not be issued in time: a wrong value, or a cycle)."""
    for bucket in result.buckets:
        members = {g.name for g in bucket.grads}
        last = max(tagged[m].ready[0] for m in members)
        for t in tagged.values():
            if t.reads & members:
                assert last < t.ready[0], (
                    f"{t.name} reads a reduced value of bucket {sorted(members)}, "
                    "which is not complete before it"
                )

    if all(t.ready_order >= 0 and not t.reads for t in tagged.values()):
        # Every gradient has a ready order and none reads a reduced one: per key,
        # torch's C++ bucketing over the ready order, no cuts.
        for key in {b.key for b in result.buckets}:
            ours = [[g.name for g in b.grads] for b in result.buckets if b.key == key]
            order = sorted((t for t in tagged.values() if t.key == key), key=lambda t: t.ready_order)
            tensors = [torch.empty(t.shape, dtype=t.dtype) for t in order]
            ref = _torch.ddp.compute_bucket_assignment_by_size(
                tensors, order[0].torch_limits, list(range(len(tensors)))
            )
            expected = [[order[i].name for i in b] for b in ref]
            assert ours == expected, f"key {key}: buckets {ours}, eager DDP's rule gives {expected}"
        for key in {b.key for b in result.buckets}:
            firsts = [tagged[b.grads[0].name].ready_order for b in result.buckets if b.key == key]
            assert firsts == sorted(firsts), f"key {key}: buckets not planned in ready order"
        return

    for key in {b.key for b in result.buckets}:
        ours = [[g.name for g in b.grads] for b in result.buckets if b.key == key]
        cut = [b.cut_reason is not None for b in result.buckets if b.key == key]
        order = sorted((t for t in tagged.values() if t.key == key), key=lambda t: t.ready)
        names = [t.name for t in order]
        limits = order[0].torch_limits
        assert all(_same_rule(t.torch_limits, limits) for t in order)

        # Segments of the ready order between cuts, then the reference on each.
        segments, start = [], 0
        for bucket, was_cut in zip(ours, cut):
            if not was_cut:
                continue
            end = names.index(bucket[-1]) + 1
            after = tagged[bucket[-1]].ready[0]
            before = order[end].ready[0] if end < len(order) else math.inf
            assert any(
                t.reads & set(bucket) and after < t.ready[0] <= before
                for t in tagged.values()
            ), f"bucket {bucket} cut, but no gradient reads its reduced values there"
            segments.append(order[start:end])
            start = end
        segments.append(order[start:])

        expected: list[list[str]] = []
        for segment in filter(None, segments):
            lim = limits[min(len(expected), len(limits) - 1) :]
            tensors = [torch.empty(t.shape, dtype=t.dtype) for t in segment]
            ref = _torch.ddp.compute_bucket_assignment_by_size(
                tensors, lim, list(range(len(tensors)))
            )
            expected += [[segment[i].name for i in b] for b in ref]
        assert ours == expected, f"key {key}: buckets {ours}, eager DDP's rule gives {expected}"


def check_same_values(unfused, fused, inputs) -> None:
    want = unfused(*[t.clone() for t in inputs])
    got = fused(*[t.clone() for t in inputs])
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        # Bit-exact for every dtype: both graphs do the same elementwise work (cast to
        # the comm dtype, divide by the group size, 1 or 2, cast back), each op rounding
        # once in the same dtype; the collectives of the fake group return their input.
        # (fp16 sums may overflow to inf/nan: the same ones in both graphs.)
        torch.testing.assert_close(
            g, w, rtol=0, atol=0, equal_nan=True, msg=lambda m, i=i: f"output {i}: {m}"
        )


# --------------------------------------------------------------------------- the tests


def trace(fn, inputs) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*inputs)


def check_fusion(spec: GraphSpec, algorithm: str, schedule_waits: bool) -> None:
    fn, inputs = build(spec)
    unfused, gm = trace(fn, inputs), trace(fn, inputs)
    tagged = describe_unfused(gm, spec)
    untagged = [
        (n, n.args)
        for n in gm.graph.find_nodes(op="call_function", target=C10D.all_reduce.default)
    ]

    result = fuse_ddp_allreduces(gm.graph, algorithm=algorithm, schedule_waits=schedule_waits)

    check_graph(gm)
    check_partition(tagged, result, gm)
    check_collectives(untagged, result, algorithm, gm)
    check_keys(tagged, result)
    check_boundaries(tagged, result)
    check_same_values(unfused, gm, inputs)
    check_metadata(gm)


given_graphs = given(
    spec=graph_specs(),
    algorithm=st.sampled_from(["concat", "coalesced"]),
    schedule_waits=st.booleans(),
)


@pytest.mark.usefixtures("fake_pg")
@settings(settings.get_profile(PROFILE))
@given_graphs
def test_fusion_properties(spec, algorithm, schedule_waits):
    check_fusion(spec, algorithm, schedule_waits)


@pytest.mark.slow
@pytest.mark.usefixtures("fake_pg")
@settings(settings.get_profile("slow"))
@given_graphs
def test_fusion_properties_slow(spec, algorithm, schedule_waits):
    check_fusion(spec, algorithm, schedule_waits)


# --------------------------------------------------------------------------- found bugs
# Minimized examples that these properties found, kept as regression tests.


@pytest.mark.usefixtures("fake_pg")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "shapes",
    [
        pytest.param([()], id="0d"),
        pytest.param([(3,), ()], id="0d-after-1d"),
    ],
)
def test_found_coalesced_0d_low_precision_gradient_keeps_dtype(shapes, dtype):
    """_foreach_div by the fp32 divisor promotes a 0-d bf16/fp16 gradient to fp32 (0-d
    with 0-d: ordinary type promotion), in any position of the bucket."""
    spec = GraphSpec(bucket_args=[{}], ops=[Grad(s, dtype, 0, "avg", 0) for s in shapes])
    check_fusion(spec, "coalesced", schedule_waits=False)


@pytest.mark.usefixtures("fake_pg")
@pytest.mark.parametrize("algorithm", ["concat", "coalesced"])
def test_found_cross_key_dependencies_cut_both_buckets(algorithm):
    """g2 (key X) reads reduced g1 (bucket Y) and g3 (key Y) reads reduced g0 (bucket X).
    Cutting only a gradient's own key left X waiting for Y and Y for X: a cycle, and
    stable_topological_sort asserted on the half-rewritten graph."""
    f32, bf16 = torch.float32, torch.bfloat16
    spec = GraphSpec(
        bucket_args=[{}],
        ops=[
            Grad((3,), f32, 0, "avg", 0),  # g0: key X
            Grad((3,), bf16, 0, "avg", 0),  # g1: key Y
            Grad((3,), f32, 0, "avg", 0, "reduced", 1),  # g2: key X, reads reduced g1
            Grad((3,), bf16, 0, "avg", 0, "reduced", 0),  # g3: key Y, reads reduced g0
        ],
    )
    check_fusion(spec, algorithm, schedule_waits=True)


@pytest.mark.usefixtures("fake_pg")
@pytest.mark.parametrize("algorithm", ["concat", "coalesced"])
def test_found_non_contiguous_gradient_keeps_layout(algorithm):
    """A transposed gradient: the reduced value must have the same layout before and
    after the pass (the gradient's own strides: it is reduced in memory order), or a
    reader sums it in another order (1 ulp apart)."""
    f32 = torch.float32
    spec = GraphSpec(
        bucket_args=[{}],
        ops=[
            Grad((3, 3), f32, 0, "avg", 0, "strided"),  # g0: (x * 2).transpose(0, -1)
            Grad((), f32, 0, "avg", 0, "reduced", 0),  # g1: x * 2 + sum(reduced g0)
        ],
    )
    check_fusion(spec, algorithm, schedule_waits=False)
