"""The uncompiled path: eager DDP's bucketed, overlapped all-reduce, in Python.

Used whenever the gradient hooks run eagerly (no ``torch.compile``, or compiled without
``config.enabled``). Like torch DDP's C++ reducer:

* each gradient is copied into its bucket's flat buffer as soon as it is accumulated
  (cast to the communication dtype on the way, if one is set);
* a bucket's all-reduce is launched asynchronously as soon as it is full, but buckets are
  launched strictly in order, so every rank issues the same collectives in the same
  order whatever order its gradients arrive in;
* at the end of backward (an autograd engine callback) the reducer waits for every
  bucket and copies the results back into ``.grad``.

Buckets start in reverse parameter order (DDP's guess); after the first synchronized
backward they are rebuilt once from rank 0's observed ready order, with the same bucket
limits and rule the compiled path uses (``ddp_fusion.plan``). With ``find_unused_parameters``
they are never rebuilt, as in eager DDP.

With ``gradient_as_bucket_view=True`` (eager DDP's option) each ``.grad`` is a view of
its bucket: a gradient is copied into the bucket once (or accumulated there in place by
autograd), reduced in place, and nothing is copied back. Buckets are then kept in the
parameters' dtype; a communication dtype is a cast of the bucket at launch and back at
the end.

Unused parameters: a bucket that is not full at the end of backward means some
parameters got no gradient. With ``find_unused_parameters=True`` their slots are sent
as zeros and a used-parameter bitmap is all-reduced, so a parameter used on any rank
gets the averaged gradient and one used on no rank keeps ``.grad = None`` (eager DDP's
behaviour). A parameter that got a gradient in a backward that did not reduce
(``no_sync()``) since the last one that did counts as used, as in eager DDP (the model's
hooks mark it: ``unsynced``, shared with the compiled path, ddp_fusion/unused.py).
Without it the buckets are still sent (so other ranks do not hang) and then this rank
raises an error naming the parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from . import _torch, comm_hooks, host_group, scaling
from .plan import split_by_rule


@dataclasses.dataclass
class _Bucket:
    params: list[int]  # parameter indices, in bucket order
    offsets: list[int]
    numel: int
    dtype: torch.dtype  # the communication dtype, unless .grad are views of the buffer
    device: torch.device
    pending: int = 0
    work: dist.Work | None = None
    sent: torch.Tensor | None = None  # what was all-reduced, if not ``buffer`` itself
    flight: comm_hooks._Flight | None = None  # the comm hook's call on this bucket
    _buffer: torch.Tensor | None = None

    @property
    def buffer(self) -> torch.Tensor:
        """The flat bucket, allocated when first used: a model that only ever runs
        compiled (fused in the graph) never holds it."""
        if self._buffer is None:
            self._buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return self._buffer


class EagerReducer:
    def __init__(
        self,
        params: list[tuple[str, torch.nn.Parameter]],
        group: dist.ProcessGroup,
        limits: list[int],
        comm_dtype: torch.dtype | None,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool = False,
    ) -> None:
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        # For DTensor parameters: the local shards (sizes and dtypes of what is reduced).
        self.local = [_torch.tensors.local_tensor(p.detach()) for p in self.params]
        # where the group's collectives run: the parameters' device (a NCCL group takes
        # no CPU tensor)
        self.device = self.local[0].device
        self.group = group
        self.limits = limits
        self.comm_dtype = comm_dtype
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.hook: comm_hooks.CommHook | None = None  # if set, it reduces each bucket
        # find_unused_parameters: parameters used under no_sync() since the last reducing
        # backward (an unused.Unsynced, set by the model)
        self.unsynced: Any = None
        self.rebuilt = False
        self._build(list(reversed(range(len(self.params)))))
        self._backward_id: int | None = None

    def set_comm_hook(self, hook: comm_hooks.CommHook) -> None:
        """A comm hook registered before the first backward: it reduces each bucket."""
        self.hook = hook

    def set_comm_dtype(self, dtype: torch.dtype) -> None:
        """A comm hook registered before the first backward: reduce in ``dtype``."""
        self.comm_dtype = dtype
        self._build(list(reversed(range(len(self.params)))))

    # -- bucket assignment ---------------------------------------------------------
    def _build(self, order: list[int]) -> None:
        """DDP's rule (``plan.split_by_rule``) over ``order``, per (dtype, device)."""
        local = self.local
        groups = split_by_rule(
            order,
            nbytes=lambda i: local[i].numel() * local[i].element_size(),
            limits=self.limits,
            key=lambda i: (local[i].dtype, local[i].device),
        )
        self.buckets = []
        self.bucket_of: dict[int, tuple[int, int]] = {}  # param -> (bucket, offset)
        for b, members in enumerate(groups):
            offsets, n = [], 0
            for i in members:
                self.bucket_of[i] = (b, n)
                offsets.append(n)
                n += self.local[i].numel()
            p0 = self.local[members[0]]
            dtype = p0.dtype if self.gradient_as_bucket_view else self.comm_dtype or p0.dtype
            self.buckets.append(_Bucket(members, offsets, n, dtype, p0.device))
        if self.gradient_as_bucket_view:
            self._point_grads_at_buckets()

    def _view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s slot of its bucket, shaped like the parameter, with its
        strides if it is dense (a channels-last parameter gets a channels-last .grad),
        as torch DDP's bucket views."""
        b, offset = self.bucket_of[index]
        local = self.local[index]
        slot = self.buckets[b].buffer[offset : offset + local.numel()]
        return slot.as_strided(local.shape, torch.empty_like(local, device="meta").stride())

    @torch.no_grad()
    def _point_grads_at_buckets(self) -> None:
        """Existing gradients move into the (new) buckets; ``.grad`` become views."""
        for i, p in enumerate(self.params):
            if p.grad is not None:
                view = self._view(i)
                view.copy_(p.grad)
                p.grad = view

    # -- per backward --------------------------------------------------------------
    def _start_backward(self) -> None:
        # Keyed by the autograd pass, not a flag: if a backward fails halfway (its end
        # callback never runs), the next one still starts from a clean state.
        self._backward_id = _torch.tensors.current_backward_id()
        if self.hook is not None:
            comm_hooks.drop_in_flight()  # left by a backward that failed halfway
        self._next = 0
        self._ready: list[int] = []
        self._used = [False] * len(self.params)  # got a gradient in this backward
        for b in self.buckets:
            b.pending = len(b.params)
            b.work = b.flight = None
        _torch.tensors.queue_backward_callback(self._finish_backward)

    def grad_ready(self, index: int) -> None:
        """Called by parameter ``index``'s post-accumulate-grad hook."""
        if self._backward_id != _torch.tensors.current_backward_id():
            self._start_backward()
        b, offset = self.bucket_of[index]
        bucket = self.buckets[b]
        param = self.params[index]
        grad = _torch.tensors.local_tensor(param.grad)
        if self.gradient_as_bucket_view:
            view = self._view(index)
            if not _same_memory(grad, view):  # autograd made a new tensor: move it in
                view.copy_(grad)
                param.grad = view
        else:
            bucket.buffer[offset : offset + grad.numel()].copy_(grad.reshape(-1))
        self._used[index] = True
        self._ready.append(index)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            bucket = self.buckets[self._next]
            if self.hook is not None:  # unscaled, in the parameters' dtype
                names = [self.names[i] for i in bucket.params]
                bucket.flight = self.hook.start(self._next, len(self.buckets), bucket.buffer, names)
                self._next += 1
                continue
            sent = bucket.buffer
            if self.comm_dtype is not None and sent.dtype != self.comm_dtype:
                sent = bucket.sent = sent.to(self.comm_dtype)
            sent.div_(scaling.divisor(self.group))
            bucket.work = dist.all_reduce(sent, group=self.group, async_op=True)
            self._next += 1

    def _finish_backward(self) -> None:
        self._backward_id = None
        missing = [i for b in self.buckets if b.pending for i, _ in self._unready(b)]
        for b in self.buckets:
            for i, offset in self._unready(b):
                # no gradient this backward: zeros, or the one accumulated before (a
                # no_sync() step), as torch DDP sends a defined gradient
                grad = self.params[i].grad
                slot = b.buffer[offset : offset + self.local[i].numel()]
                if grad is None:
                    slot.zero_()
                elif not (self.gradient_as_bucket_view
                          and _same_memory(_torch.tensors.local_tensor(grad), self._view(i))):
                    slot.copy_(_torch.tensors.local_tensor(grad).reshape(-1))
            b.pending = 0
        self._launch_ready()
        used = self._used
        if self.find_unused_parameters:
            if self.unsynced is not None and self.unsynced.dirty:
                used = [u or m for u, m in zip(used, self.unsynced.marks)]
                self.unsynced.settle()
            if self.hook is not None:
                comm_hooks.wait_in_flight()  # its chained collectives first, on every rank
            used = self._used_anywhere(used)
        for bucket in self.buckets:
            if bucket.flight is not None:
                flight, bucket.flight = bucket.flight, None
                self.hook.finish(flight)
            else:
                bucket.work.wait()
            if bucket.sent is not None:
                bucket.buffer.copy_(bucket.sent)
                bucket.sent = None
            for i, offset in zip(bucket.params, bucket.offsets):
                p, local = self.params[i], self.local[i]
                reduced = bucket.buffer[offset : offset + local.numel()].view_as(local)
                if self.gradient_as_bucket_view and (p.grad is not None or used[i]):
                    p.grad = reduced  # already is, unless it was unused here
                elif p.grad is not None:
                    _torch.tensors.local_tensor(p.grad).copy_(reduced)
                elif used[i]:  # unused here, used elsewhere: DDP gives it the average
                    if _torch.tensors.is_dtensor(p):
                        raise NotImplementedError(
                            f"find_unused_parameters with DTensor parameter {self.names[i]!r}"
                        )
                    p.grad = reduced.to(p.dtype, copy=True)
        if not self.rebuilt and not self.find_unused_parameters:
            # Every rank gets here in the same backward; unused parameters go last.
            self._rebuild_from(self._ready + [i for i in reversed(range(len(self.params))) if i in missing])
        if missing and not self.find_unused_parameters:
            names = ", ".join(self.names[i] for i in missing[:20])
            raise RuntimeError(
                f"DistributedDataParallel: parameters got no gradient in this backward: "
                f"{names}{' ...' if len(missing) > 20 else ''}. Pass "
                "find_unused_parameters=True if some parameters are not used in every step"
            )

    def shadow(self) -> None:
        """A joined rank's part of one uncompiled backward of the active ranks (join.py):
        each bucket's all-reduce, in order, with zeros; then, with
        ``find_unused_parameters``, the used-parameter bitmap's."""
        if not self.rebuilt and not self.find_unused_parameters:
            raise RuntimeError(
                "join(): this rank joined before its first synchronized backward, in "
                "which the uncompiled reducer settles its buckets with the other ranks; "
                "give every rank at least one batch"
            )
        if self.hook is not None:  # torch DDP runs the hook on buckets of zeros
            for i, b in enumerate(self.buckets):
                zeros = torch.zeros(b.numel, dtype=b.dtype, device=b.device)
                self.hook.finish(self.hook.start(i, len(self.buckets), zeros,
                                                 [self.names[j] for j in b.params]))
        works = [] if self.hook is not None else [
            dist.all_reduce(torch.zeros(b.numel, dtype=self.comm_dtype or b.dtype, device=b.device),
                            group=self.group, async_op=True)
            for b in self.buckets
        ]
        if self.find_unused_parameters:
            self._used_anywhere([False] * len(self.params))
        for work in works:
            work.wait()

    def _used_anywhere(self, used: list[bool]) -> list[bool]:
        """Which parameters got a gradient on any rank: the used-parameter bitmap,
        all-reduced on the group's device and read back (a device sync at the end of
        backward, as torch DDP's ``find_unused_parameters`` has)."""
        bitmap = torch.tensor(used, dtype=torch.int32, device=self.device)
        dist.all_reduce(bitmap, group=self.group)
        return [bool(v) for v in bitmap.tolist()]

    def _unready(self, bucket: _Bucket):
        return [
            (i, off)
            for i, off in zip(bucket.params, bucket.offsets)
            if not self._used[i]
        ]

    def _rebuild_from(self, order: list[int]) -> None:
        """Rebuild buckets from rank 0's ready order (once, after the first complete
        backward), so all ranks keep identical buckets."""
        host = host_group.of(self.group)  # host-side: no device, no current-device guess
        self._build(host.broadcast_json(order) if host is not None else order)
        self.rebuilt = True


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
