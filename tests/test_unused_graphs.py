"""``find_unused_parameters``: the pass plans a model's buckets over its registered
layout (ddp_fusion/unused.py), on make_fx graphs (one process, fake process group, whose
all-reduce returns its input).

What they pin down: graphs that lack different parameters plan the same buckets (the
plan the per-step check compares), and a different model plans different ones; a
parameter absent from the graph is sent as its kept ``.grad`` or zeros; every graph
starts the agreement on used parameters, and one that lacks a parameter ends with the
fix-up; after the graph, an absent parameter's ``.grad`` is left as it was where no rank
used it and set where one did (here: marked as used under ``no_sync()``); kept
``.grad``s of a bucket with an absent parameter are copied back, not reduced in place
(logged), the others are reduced in place; the layout is part of the pass's cache key.
"""

import logging

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

from ddp_fusion import _install, unused
from ddp_fusion.passes import fuse_ddp_allreduces

ALL_REDUCE_GRADIENT = torch.ops.ddp_fusion.all_reduce_gradient.default
MODEL = 7007
LIMITS = [60]  # bytes: w2 (15 floats) fills the first bucket; w1 and w0 share the second
SHAPES = {"w0": (3, 5), "w1": (5,), "w2": (5, 3)}


@pytest.fixture
def layout(fake_pg):
    params = [(n, torch.nn.Parameter(torch.randn(s))) for n, s in SHAPES.items()]
    found = unused.register(MODEL, params, [2, 1, 0])  # eager DDP's order: reverse
    yield found, dict(params)
    unused.unregister(MODEL, found)


def backward(used, kept=()):
    """A backward in which the parameters ``used`` get a gradient (in the layout's ready
    order: w2, w1, w0), as the hooks trace it: a new ``.grad``, or copied into the kept
    ``.grad`` (an input) for those in ``kept``."""
    position = {"w2": 0, "w1": 1, "w0": 2}
    local = {"w2": lambda x: x[:, :3] * 2, "w1": lambda x: x[0] * 2, "w0": lambda x: x[:3] * 2}

    def fn(x, *grads):
        out = []
        for name in ("w2", "w1", "w0"):
            if name not in used:
                continue
            r = ALL_REDUCE_GRADIENT(local[name](x), "0", "avg", LIMITS, name, None, position[name], MODEL)
            if name in kept:
                out.append(grads[list(kept).index(name)].copy_(r))
            else:
                out.append(r)
        return tuple(out)

    args = [torch.randn(5, 5)] + [torch.zeros(SHAPES[n]) for n in kept]
    return make_fx(fn, tracing_mode="fake")(*args), args


def fuse(gm, **kwargs):
    result = fuse_ddp_allreduces(gm.graph, **kwargs)
    gm.graph.lint()
    gm.recompile()
    return result


@pytest.mark.parametrize("algorithm", ["concat", "coalesced"])
def test_graphs_lacking_different_parameters_plan_the_same_buckets(layout, algorithm):
    plans = []
    for used in (("w2", "w1", "w0"), ("w2", "w0"), ("w0",)):
        gm, _ = backward(used)
        result = fuse(gm, algorithm=algorithm)
        plans.append(result.plan.to_json())
        absent = 3 - len(used)
        check = FileCheck().check_count("ddp_fusion.used_start", 1, exactly=True)
        check = check.check_count("ddp_fusion.absent_grad", absent, exactly=True)
        check.check_count("ddp_fusion.unused_fixup", 1 if absent else 0, exactly=True).run(gm.code)
    assert plans[0] == plans[1] == plans[2]
    buckets = result.plan.buckets
    assert [b.grads for b in buckets] == [("w2",), ("w1", "w0")]
    assert [b.layout for b in buckets] == [0, 0]


def test_a_different_model_plans_different_buckets(layout):
    gm, _ = backward(("w2", "w1", "w0"))
    mine = fuse(gm).plan.to_json()
    found, _ = layout
    unused.unregister(MODEL, found)
    other = [(n, torch.nn.Parameter(torch.randn(s))) for n, s in {**SHAPES, "w0": (4, 5)}.items()]
    unused.register(MODEL, other, [2, 1, 0])
    gm, _ = backward(("w2", "w1"))
    assert fuse(gm).plan.to_json() != mine


@pytest.mark.parametrize("algorithm", ["concat", "coalesced"])
def test_an_absent_parameter_gets_what_eager_ddp_leaves(layout, algorithm):
    """On the fake group the sum is this rank's own contribution: gradients divided by
    the world size (2), flags as sent."""
    found, params = layout
    gm, (x,) = backward(("w2", "w0"))
    fuse(gm, algorithm=algorithm)
    w1 = params["w1"]
    # used by no rank (flag 0): .grad stays None
    gm(x)
    assert w1.grad is None
    # kept .grad, used by no rank: the same tensor, unchanged
    kept = torch.ones(5)
    w1.grad = kept
    gm(x)
    assert w1.grad is kept and torch.equal(kept, torch.ones(5))
    # kept .grad accumulated under no_sync() (marked used): the reduced gradient
    found.unsynced.marks[1] = found.unsynced.dirty = True
    gm(x)
    assert w1.grad is kept and torch.equal(kept, torch.full((5,), 0.5))
    assert found.unsynced.marks == [False] * 3 and not found.unsynced.dirty
    # the gradients of the graph are reduced as ever
    w2, w0 = gm(x)
    assert torch.equal(w2, x[:, :3]) and torch.equal(w0, x[:3])


def test_kept_grads_of_a_bucket_with_an_absent_parameter_are_copied_back(layout, caplog):
    gm, _ = backward(("w2", "w0"), kept=("w2", "w0"))
    with caplog.at_level(logging.INFO, logger="ddp_fusion"):
        fuse(gm)
    # w2's bucket is reduced in place; w1 (absent) and w0's gets a buffer and a copy back
    FileCheck().check_count("ddp_fusion.all_reduce_in_place.default", 1, exactly=True).run(gm.code)
    assert "has no gradient on this rank (find_unused_parameters)" in caplog.text


def test_the_layout_is_part_of_the_cache_key(fake_pg):
    before = _install.THE_PASS.uuid()
    params = [(n, torch.nn.Parameter(torch.randn(s))) for n, s in SHAPES.items()]
    found = unused.register(MODEL, params, [2, 1, 0])
    try:
        assert _install.THE_PASS.uuid() != before
    finally:
        unused.unregister(MODEL, found)
    assert _install.THE_PASS.uuid() == before


def test_gradients_that_do_not_fit_the_layout_keep_the_graphs_plan(layout, caplog):
    """A model whose gradients are not its registered parameters (here, w1's is of
    another size) is planned from the graph, with a warning; nothing is absent."""
    def fn(x):
        return (ALL_REDUCE_GRADIENT(x[0, :4] * 2, "0", "avg", LIMITS, "w1", None, 1, MODEL),)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(5, 5))
    with caplog.at_level(logging.WARNING, logger="ddp_fusion"):
        result = fuse(gm)
    assert "its buckets follow this rank's graph" in caplog.text
    assert "gradient w1 [4] torch.float32 at ready position 1 is not the layout's parameter" in caplog.text
    assert [(b.grads, b.layout) for b in result.plan.buckets] == [(("w1",), None)]
    FileCheck().check_not("used_start").check_not("absent_grad").check_not("unused_fixup").run(gm.code)
