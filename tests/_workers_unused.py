"""Per-rank body of test_unused_gloo.py: parameters unused on some ranks only, under
``torch.compile`` with ``find_unused_parameters=True``, against eager torch DDP with the
same flag (ddp_fusion off, not compiled)."""

import copy
import time

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate

import ddp_fusion
from ddp_fusion import _torch

WIDTH = 16


class Branch(nn.Module):
    """``b`` takes part in the forward only while ``use_b`` is set (per rank, per step)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 4)
        self.use_b = True

    def forward(self, x):
        x = torch.tanh(self.a(x))
        if self.use_b:
            x = torch.tanh(self.b(x))
        return self.head(x)


@torch.compiler.disable
def _experts_hit(idx, n):
    """Which experts get a token (on the host, as MoE layers decide what to run)."""
    hit = set(idx.tolist())
    return tuple(e in hit for e in range(n))


class MoE(nn.Module):
    """Top-1 routing of a few tokens over 4 experts; an expert that gets no token is not
    run, so its parameters get no gradient on that rank in that step. The router is
    initialised with a wide margin so that compiled and eager runs route alike."""

    def __init__(self, n_experts=4):
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(WIDTH, n_experts, bias=False)
        with torch.no_grad():
            self.router.weight.zero_()
            self.router.weight[:, :n_experts] = 10 * torch.eye(n_experts)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(n_experts))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        gate, idx = self.router(x).softmax(-1).max(-1)
        hit = _experts_hit(idx, len(self.experts))
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            if hit[e]:
                y = y + ((idx == e).to(x.dtype) * gate).unsqueeze(-1) * torch.tanh(expert(x))
        return self.head(y)


# Experts the tokens of each rank go to, per step: experts used on one rank only, on
# both, on neither, changing from step to step (two patterns, so that each rank compiles
# two backward graphs, and runs each twice).
ROUTES = [
    [[0, 0, 1], [1, 2, 2]],
    [[3, 3, 3], [0, 1, 1]],
    [[1, 0, 0], [2, 1, 2]],
    [[3, 3, 3], [1, 1, 0]],
]


def _moe_batches(rank, gen):
    out = []
    for step in ROUTES:
        x = 0.3 * torch.randn(len(step[rank]), WIDTH, generator=gen)
        for t, e in enumerate(step[rank]):
            x[t, e] += 3.0  # the router's margin: 30 against at most ~5
        out.append(x)
    return out


def _train(model, net, batches, set_to_none, before, micro=1, count_last=False):
    """SGD with momentum and weight decay (a .grad set where eager DDP leaves None moves
    the parameter). ``before(step, m)`` sets what the forward uses; with ``micro`` > 1 all
    but the last micro-batch of a step run under ``no_sync()``. Returns the parameters,
    which ``.grad``s are None after each step, and (``count_last``) the all-reduces the
    process group ran in the last step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    none_after, collectives = [], None

    def step(i, x):
        x = x if micro > 1 else [x]
        opt.zero_grad(set_to_none=set_to_none)
        for m in range(micro):
            before(i, m)
            if m < micro - 1:
                with model.no_sync():
                    model(x[m]).square().mean().backward()
            else:
                model(x[m]).square().mean().backward()
        opt.step()

    for i, x in enumerate(batches):
        if count_last and i == len(batches) - 1:
            with _torch.distributed.AllReduces() as n:
                step(i, x)
            collectives = n.count
        else:
            step(i, x)
        none_after.append(sorted(n for n, p in net.named_parameters() if p.grad is None))
    return [p.detach().clone() for p in net.parameters()], none_after, collectives


def _compare(name, base, wrap, batches, set_to_none, before, micro=1,
             algorithm="concat", count_last=False, compiled=True):
    """Eager torch DDP (``find_unused_parameters=True``) and the same model wrapped by
    ``wrap``, with the flag on and compiled (or neither: the eager bucketed reducer);
    ``before(net, step, micro)`` sets what each forward uses."""
    start = time.perf_counter()
    ref_net = copy.deepcopy(base)
    ref = nn.parallel.DistributedDataParallel(ref_net, find_unused_parameters=True, bucket_cap_mb=0.002)
    want, want_none, want_count = _train(ref, ref_net, batches, set_to_none,
                                         lambda i, m: before(ref_net, i, m), micro, count_last)
    torch._dynamo.reset()
    counters = _torch.dynamo.counters()
    counters.clear()
    net = copy.deepcopy(base)
    result = {}
    try:
        with ddp_fusion.config.patch(enabled=compiled, algorithm=algorithm):
            model = wrap(net)
            model = torch.compile(model) if compiled else model
            got, got_none, count = _train(model, net, batches, set_to_none,
                                          lambda i, m: before(net, i, m), micro, count_last)
        result.update(
            max_diff=max((g - w).abs().max().item() for g, w in zip(got, want)),
            none_after=got_none,
            collectives=count,
        )
    except Exception as e:  # noqa: BLE001 - reported to the test, every scenario runs
        result["error"] = f"{type(e).__name__}: {e}"
    result.update(
        want_none_after=want_none,
        eager_collectives=want_count,
        eager_buckets=len(ref._get_ddp_logging_data()["bucket_sizes"].split(",")),
        counters={k: v for k, v in counters["ddp_fusion"].items()},
        graph_breaks=sum(counters["graph_break"].values()),
        seconds=time.perf_counter() - start,
    )
    return name, result


def _wrapper(net):
    return ddp_fusion.DistributedDataParallel(net, find_unused_parameters=True, bucket_cap_mb=0.002)


def _stock(net):
    return nn.parallel.DistributedDataParallel(net, find_unused_parameters=True, bucket_cap_mb=0.002)


def _replicate(net):
    return replicate(net, find_unused_parameters=True, bucket_cap_mb=0.002)


def _joined(name, base, batches, before):
    """``join()`` with uneven batches (rank 1 runs out first) and ``before(net, step)``
    choosing what each forward uses: eager torch DDP against the compiled wrapper; the
    joined rank takes part in the agreement on used parameters with zeros."""
    start = time.perf_counter()

    def train(model, net):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
        with model.join():
            for i, x in enumerate(batches):
                before(net, i)
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
        return [p.detach().clone() for p in net.parameters()]

    ref_net = copy.deepcopy(base)
    want = train(nn.parallel.DistributedDataParallel(ref_net, find_unused_parameters=True,
                                                     bucket_cap_mb=0.002), ref_net)
    torch._dynamo.reset()
    counters = _torch.dynamo.counters()
    counters.clear()
    net = copy.deepcopy(base)
    result = {}
    try:
        with ddp_fusion.config.patch(enabled=True):
            got = train(torch.compile(_wrapper(net)), net)
        result.update(max_diff=max((g - w).abs().max().item() for g, w in zip(got, want)))
    except Exception as e:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
    result.update(none_after=None, want_none_after=None, graph_breaks=0,
                  counters=dict(counters["ddp_fusion"]), seconds=time.perf_counter() - start)
    return name, result


def _scenarios(rank, steps):
    """Scenario name -> a function that runs it (``_compare``)."""
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(4, WIDTH, generator=gen) for _ in range(steps)]
    micro_batches = [[torch.randn(4, WIDTH, generator=gen) for _ in range(2)] for _ in range(steps)]
    moe_batches = _moe_batches(rank, gen)

    def use_b(flag):
        def before(net, step, micro):
            net.use_b = flag(step, micro)
        return before

    def freeze(net, step, micro):  # requires_grad off on rank 1 from step 2
        if rank == 1 and step == 2:
            net.b.weight.requires_grad_(False)

    # b used only in a micro-batch that does not reduce (rank 0, step 1: eager DDP counts
    # it as used in the step) or only in the one that does (rank 1, step 2)
    accumulate = use_b(lambda s, m: (rank == 0 and s == 1 and m == 0) or (rank == 1 and s == 2 and m == 1))
    return {
        # a branch only rank 1 takes; zero_grad() sets .grad to None
        "branch on one rank": lambda: _compare(
            "branch on one rank", Branch(), _wrapper, batches, True, use_b(lambda s, m: rank == 1)),
        # a branch rank 0 takes at steps 1 and 2 only; kept .grads, torch DDP, coalesced
        "branch at some steps": lambda: _compare(
            "branch at some steps", Branch(), _stock, batches, False,
            use_b(lambda s, m: rank == 0 and s in (1, 2)), algorithm="coalesced"),
        "moe": lambda: _compare("moe", MoE(), _wrapper, moe_batches, True, lambda *_: None, count_last=True),
        "moe, kept .grads": lambda: _compare("moe, kept .grads", MoE(), _stock, moe_batches, False,
                                             lambda *_: None),
        "requires_grad off on one rank": lambda: _compare(
            "requires_grad off on one rank", Branch(), _replicate, batches, False, freeze),
        "no_sync, set_to_none=True": lambda: _compare(
            "no_sync, set_to_none=True", Branch(), _wrapper, micro_batches, True, accumulate, micro=2),
        "no_sync, set_to_none=False": lambda: _compare(
            "no_sync, set_to_none=False", Branch(), _wrapper, micro_batches, False, accumulate, micro=2),
        # join(): rank 1 runs out of batches after 2 steps; rank 0 uses b at steps 2, 3
        "join, uneven batches": lambda: _joined(
            "join, uneven batches", Branch(), batches[: 4 if rank == 0 else 2],
            lambda net, step: setattr(net, "use_b", rank == 0 and step >= 2)),
        # the eager bucketed reducer (compiled autograd is off with the flag)
        "no_sync, uncompiled": lambda: _compare(
            "no_sync, uncompiled", Branch(), _wrapper, micro_batches, False, accumulate, micro=2,
            compiled=False),
    }


def unused_on_some_ranks(rank, world_size, names, steps=4):
    """The scenarios ``names``, each against eager torch DDP; returns ``{name: result}``."""
    scenarios = _scenarios(rank, steps)
    return dict(scenarios[name]() for name in names)
