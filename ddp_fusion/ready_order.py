"""Eager autograd's ready order, learned once per wrapper, so that buckets hold exactly
the gradients eager torch DDP's rebuilt buckets hold.

Eager DDP rebuilds its buckets after the first backward, in the order the autograd
engine fired the gradient hooks. A compiled backward computes gradients in another order
(a Linear's weight gradient before its bias gradient, say), and compiled autograd traces
the hooks in that order too, so neither the graph nor the trace tells the eager order.
The wrapper therefore runs the model once, at its first forward, in eager autograd on
fake tensors (no data, no compute; the real parameters and buffers are not touched)
and records the order in which the parameters' gradients become ready. Under
torch.compile this happens while Dynamo traces the forward, with Dynamo's example
inputs. The hooks then tag each gradient's all-reduce with its position, and the pass
buckets in that order.

If the model cannot run on fake tensors (data-dependent Python control flow, an op
without a fake implementation), buckets follow the compiled graph's order; this is
logged once and counted in ``counters["ddp_fusion"]["ready order: graph's"]``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from . import _torch
from .log import log


def eager_ready_order(module: torch.nn.Module, names: list[str], args: Any, kwargs: Any) -> list[int]:
    """Indices into ``names`` (trainable parameters of ``module``) in the order eager
    autograd makes their gradients ready for a backward of the sum of ``module(*args,
    **kwargs)``'s floating-point outputs; parameters that get no gradient come last, in
    reverse order (where eager DDP's rebuild puts them). The module's state is restored
    afterwards, whatever its forward assigned (a cache built on first use, say)."""
    mode = _torch.tensors.fake_mode()
    index = {n: i for i, n in enumerate(names)}
    order: list[int] = []

    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        shape = [_torch.dynamo.concrete_int(s) for s in t.shape]
        stride = [_torch.dynamo.concrete_int(s) for s in t.stride()]
        with mode:
            return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)

    global _running
    saved = _snapshot(module)
    _running += 1
    try:
        # compiled code inside the model (a torch.compile'd submodule, Lightning's
        # compiled training_step) runs eagerly here: compiled, it cannot take fake tensors
        with _torch.compiled_autograd.disabled(), torch.enable_grad(), \
                _torch.dynamo.run_compiled_code_eagerly():
            state: dict[str, torch.Tensor] = {}
            for n, p in module.named_parameters():
                f = mode.from_tensor(p.detach()).requires_grad_(p.requires_grad)
                if n in index:
                    f.register_post_accumulate_grad_hook(lambda _, i=index[n]: order.append(i))
                state[f"module.{n}"] = f
            for n, b in module.named_buffers():
                state[f"module.{n}"] = mode.from_tensor(b.detach())
            fake_args, fake_kwargs = _torch.tensors.tree_map(fake, (args, kwargs))
            with mode:
                # forward and backward inside one functional_call: activation
                # checkpointing recomputes the forward in backward, which must see the
                # fake parameters too
                torch.func.functional_call(_ForwardBackward(module), state, (fake_args, fake_kwargs))
    finally:
        _running -= 1
        _restore(saved)
    leaked = _fake_attributes(module)
    if leaked:
        raise RuntimeError(f"the forward left fake tensors in the model: {', '.join(leaked[:5])}")
    seen = set(order)
    return order + [i for i in reversed(range(len(names))) if i not in seen]


class _ForwardBackward(torch.nn.Module):
    """``module``'s forward, then the backward of its output's sum."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, args: Any, kwargs: Any) -> None:
        _loss_of(self.module(*args, **kwargs)).backward()


def timed_ready_order(module: torch.nn.Module, names: list[str], args: Any,
                      kwargs: Any) -> tuple[list[int], list[float]] | str:
    """Eager autograd's ready order, as :func:`eager_ready_order`, and when each of
    those gradients became ready (seconds from the start of backward), from a real
    forward and backward of ``module`` (the second of two: the first warms up) on inputs
    shaped like ``args``/``kwargs`` (which may be fake: floating-point inputs become
    random, integer ones zeros). Parameters are the real ones but no ``.grad`` is
    written (``autograd.grad``); buffers are copies; the module's state is restored.
    If the model cannot run so: why (a line), and nothing is logged here."""
    index = {n: i for i, n in enumerate(names)}
    stamps: dict[int, float] = {}

    def real(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        shape = [_torch.dynamo.concrete_int(s) for s in t.shape]
        device = getattr(t, "fake_device", t.device)
        if t.is_floating_point() or t.is_complex():
            return torch.randn(shape, dtype=t.dtype, device=device)
        return torch.zeros(shape, dtype=t.dtype, device=device)

    global _running
    saved = _snapshot(module)
    _running += 1
    try:
        with _torch.compiled_autograd.disabled(), torch.enable_grad(), \
                _torch.dynamo.run_compiled_code_eagerly():
            params = dict(module.named_parameters())
            state = {**params, **{n: b.detach().clone() for n, b in module.named_buffers()}}
            timed = [(index[n], p) for n, p in params.items() if n in index and p.requires_grad]
            real_args, real_kwargs = _torch.tensors.tree_map(real, (args, kwargs))
            for _ in range(2):
                stamps.clear()
                out = torch.func.functional_call(module, state, real_args, real_kwargs)
                handles = [p.register_hook(_stamp(stamps, i)) for i, p in timed]
                try:
                    start = time.perf_counter()
                    torch.autograd.grad(_loss_of(out), [p for _, p in timed], allow_unused=True)
                finally:
                    for h in handles:
                        h.remove()
    except Exception as e:  # noqa: BLE001 - any failure means: DDP's caps
        return f"timing run: {_first_line(e)}"
    finally:
        _running -= 1
        _restore(saved)
    order = sorted(stamps, key=stamps.__getitem__)
    end = max(stamps.values(), default=start) - start
    order += [i for i in reversed(range(len(names))) if i not in stamps]
    return order, [stamps[i] - start if i in stamps else end for i in order]


def _stamp(stamps: dict[int, float], i: int) -> Any:
    def hook(grad: torch.Tensor) -> None:
        stamps.setdefault(i, time.perf_counter())

    return hook


def _loss_of(out: Any) -> torch.Tensor:
    losses = [
        o.sum() for o in _torch.tensors.tree_leaves(out)
        if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()
    ]
    if not losses:
        raise ValueError(
            "the model's output holds no floating-point tensor that requires "
            f"grad where torch.utils._pytree can see it ({type(out).__name__})"
        )
    return torch.stack(losses).sum()


_running = 0


def running() -> bool:
    """Whether :func:`eager_ready_order`'s fake run is under way (a model that calls its
    data-parallel model from its own forward, as ``replicate()``'s hooks do, is called
    again by it)."""
    return _running > 0


def _snapshot(module: torch.nn.Module) -> list[tuple[torch.nn.Module, dict, dict, dict, dict]]:
    return [
        (m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules))
        for m in module.modules()
    ]


def _restore(saved: list[tuple[torch.nn.Module, dict, dict, dict, dict]]) -> None:
    for m, attributes, params, buffers, modules in saved:
        m.__dict__.clear()
        m.__dict__.update(attributes)
        for now, before in ((m._parameters, params), (m._buffers, buffers), (m._modules, modules)):
            now.clear()
            now.update(before)


def _fake_attributes(module: torch.nn.Module) -> list[str]:
    """Attributes (one level into lists, tuples and dicts) that hold fake tensors: what
    a forward mutated in place and ``_restore`` could not undo."""
    found = []
    for prefix, m in module.named_modules():
        for k, v in m.__dict__.items():
            values = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
            if any(_torch.tensors.is_fake(x) for x in values):
                found.append(f"{prefix}.{k}" if prefix else k)
    return found


_warned: set[str] = set()


def graph_order(reason: str) -> None:
    """Count, and warn once per reason, that buckets follow the compiled graph's order."""
    _torch.dynamo.counters()["ddp_fusion"]["ready order: graph's"] += 1
    if reason not in _warned:
        _warned.add(reason)
        log.warning(
            "ddp_fusion: could not learn eager autograd's ready order (%s); buckets follow "
            "the compiled backward's order, which can differ from eager DDP's by a "
            "gradient at a bucket edge",
            reason,
        )


def learn(module: torch.nn.Module, names: list[str], args: Any, kwargs: Any) -> list[int] | str:
    """``eager_ready_order``, or why the model cannot run on fake tensors (a line; nothing
    is logged here: the caller knows whether another rank's order is used instead)."""
    try:
        return eager_ready_order(module, names, args, kwargs)
    except Exception as e:  # noqa: BLE001 - any failure means: use the graph's order
        return f"fake run: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
