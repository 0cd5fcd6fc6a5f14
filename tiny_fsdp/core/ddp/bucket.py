"""Flat gradient buckets: many parameters' gradients averaged over ranks by one all-reduce.

[Note: gradient bucket layout]
A bucket owns one flat buffer of its parameters' dtype (or the mixed-precision policy's
``reduce_dtype``), on their device::

    buffer = [ grad(p0) | grad(p1) | ... | grad(pk-1) | flag(p0) ... flag(pk-1) ]
               numel(p0)  numel(p1)        numel(pk-1)  k elements

Gradient ``i`` enters already divided by the world size, so the SUM all-reduce of the buffer,
in place, leaves the AVERAGE (pre-dividing works on every backend, unlike ReduceOp.AVG). With a
communication hook the gradients enter undivided and the hook reduces them ([Note: DDP
communication hooks] in ``comm_hooks.py``). Flag
``i`` is 1 on a rank that had a gradient for parameter ``i`` and 0 on a rank that had none
(parameter unused in its forward); after the all-reduce a zero flag means no rank had a gradient,
and the parameter's ``.grad`` is left None, as single-device training would leave it. Riding in
the same buffer, the flags cost ``k`` elements and no extra collective.

Gradients as bucket views (torch's ``gradient_as_bucket_view``): when the buffer has the
parameters' dtype, slot ``i`` IS ``p_i.grad`` from the first backward on. Autograd accumulates
into an existing ``.grad`` in place, so a backward after ``zero_grad(set_to_none=False)``, or a
micro-step after the first one, writes straight into the bucket and the hook only divides the
slot in place; the all-reduce then leaves the average in ``.grad`` itself: nothing is copied in or
out. After ``zero_grad(set_to_none=True)`` autograd hands a fresh gradient, copied (and divided)
into the slot once, in the same pass, and the slot becomes ``.grad`` again. Inside ``no_sync``
the fresh gradient of the first micro-step moves into the slot too, so accumulation happens in
place. A bucket of another dtype (mixed precision's ``reduce_dtype``) cannot be ``.grad``: the
gradient is rounded into it and the averages are cast back, the whole bucket in one op whose
views become the new ``.grad`` tensors ([Note: DDP mixed precision]).

The backward engine ([Note: bucketed backward]) adds every slot (``add_grad``) before it calls
``launch``, which starts the all-reduce (asynchronously if asked); ``finish`` waits for it, says
which slots hold a gradient and resets the bucket for the next backward. ``AllReduceBuckets`` is
DDP's gradient store: its buckets, behind the engine's verbs, and who ``.grad`` is.
"""

from typing import Any, Collection, List, Optional, Sequence, Tuple

import torch
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.bucketed_backward import divide_into
from tiny_fsdp.core.ddp.comm_hooks import CommHook
from tiny_fsdp.core.ddp.mixed_precision import ParamCast
from tiny_fsdp.core.sparse_grads import SparseGradReduction


class GradBucket:
    """The gradients of ``params`` (one device and dtype) in one flat buffer of ``dtype``
    (default: the parameters' dtype).

    ``buffer``: (sum of numels + len(params),); ``views[i]``: parameter ``i``'s gradient slot,
    shaped like the parameter; ``flags``: (len(params),), see [Note: gradient bucket layout].
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        world_size: int,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        if not params:
            raise ValueError("a gradient bucket needs at least one parameter")
        first = params[0]
        if any(p.dtype != first.dtype or p.device != first.device for p in params):
            raise ValueError("all parameters of a bucket must share one dtype and device")
        self.params: List[nn.Parameter] = list(params)
        self.divisor = world_size  # of a gradient added (DDP's join may lower it)
        total = sum(p.numel() for p in self.params)
        dtype = first.dtype if dtype is None else dtype
        self.buffer = torch.zeros(total + len(self.params), dtype=dtype, device=first.device)
        self.views: List[torch.Tensor] = []
        offset = 0
        for p in self.params:
            self.views.append(self.buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.flags = self.buffer[total:]  # (len(params),)
        self._layouts = [(v.shape, v.stride(), v.storage_offset()) for v in self.views]
        self._has_grad = [False] * len(self.params)
        self._work: Optional[Any] = None  # dist.Work, or HookWork with a communication hook
        self.launched = False
        # A communication hook, and this bucket's place in launch order for it.
        self.comm_hook: Optional[CommHook] = None
        self.index, self.is_last = 0, True

    def is_slot(self, slot: int, grad: Optional[torch.Tensor]) -> bool:
        """``grad`` is slot ``slot`` itself (a gradient already living in the bucket)."""
        view = self.views[slot]
        return (
            grad is not None
            and grad.dtype == view.dtype  # first: under mixed precision it tells at once
            and grad.data_ptr() == view.data_ptr()
            and grad.shape == view.shape
        )

    def add_grad(self, slot: int, grad: Optional[torch.Tensor]) -> bool:
        """Put ``grad / world_size`` (shape of ``params[slot]``; ``grad`` itself with a
        communication hook) in its slot: in place when ``grad`` is the slot, else copied (and
        cast) in the same pass. Returns whether ``grad`` is the slot.

        ``grad`` None (the parameter had no gradient on this rank): zeros, and a zero flag.
        """
        view = self.views[slot]
        if grad is None:
            view.zero_()
            return False
        in_slot = self.is_slot(slot, grad)
        divide_into(view, grad, self.divisor if self.comm_hook is None else 1, in_slot)
        self._has_grad[slot] = True
        return in_slot

    def views_as(self, dtype: torch.dtype) -> List[torch.Tensor]:
        """Every slot, in ``dtype``: views of one copy of the buffer's gradients, cast in one op
        instead of one per slot (a kernel each on a GPU). The copy is laid out as the buffer,
        so each view takes its slot's shape, strides and offset (one op per slot, where a
        split and a reshape are two)."""
        cast = self.buffer[: len(self.buffer) - len(self.params)].to(dtype)
        return [cast.as_strided(*layout) for layout in self._layouts]

    def launch(self, async_op: bool) -> None:
        """Start the SUM all-reduce of the buffer, in place (every slot added)."""
        assert not self.launched, "launch a bucket once per backward"
        if all(self._has_grad):
            self.flags.fill_(1)  # one kernel: the common case
        else:
            self.flags.copy_(torch.tensor(self._has_grad, dtype=self.flags.dtype))
        if self.comm_hook is None:
            self._work = comm.all_reduce(self.buffer, async_op=async_op)
        else:
            numel = self.buffer.numel() - len(self.params)
            hook = self.comm_hook
            self._work = hook.launch(
                self.buffer, numel, self.views, self.params, self.index, self.is_last
            )
            if not async_op:
                self._work.wait()
        self.launched = True

    def is_done(self) -> bool:
        """The launched all-reduce has completed (never blocks)."""
        return self._work is None or self._work.is_completed()

    def finish(self) -> Tuple[List[bool], List[bool]]:
        """Wait for the all-reduce and reset the bucket. Returns, per slot, whether it holds a
        gradient (the average, if some rank had one; else its zeros are no gradient) and
        whether this rank added one."""
        assert self.launched, "finish a bucket only after launching it"
        if self._work is not None:
            self._work.wait()
        mine = list(self._has_grad)
        have = mine
        if not all(mine):
            # No local gradient: some other rank may have had one. Reading the flags syncs a
            # GPU with the host, so do it only on this rare path.
            have = [own or flag > 0 for own, flag in zip(mine, self.flags.tolist())]
        self.reset()
        return have, mine

    def reset(self) -> None:
        """Forget this backward's progress (also used to drop the state of a failed backward)."""
        self._has_grad = [False] * len(self.params)
        self._work = None
        self.launched = False


def _assign_grad(param: nn.Parameter, grad: Optional[torch.Tensor]) -> None:
    param.grad = grad


class AllReduceBuckets:
    """DDP's gradient store ([Note: bucketed backward]): ``buckets`` of the trainable ``params``
    (``build_buckets``), each all-reduced in place as one flat buffer. Parameter ``index`` is
    its position in bucket order.

    A bucket of the parameters' own dtype holds their gradients: ``param.grad`` is its slot
    ([Note: gradient bucket layout]). A bucket of another ``dtype`` (mixed precision's
    ``reduce_dtype``) is filled from ``param.grad`` and its averages are cast back.
    ``cast``: DDP's ``ParamCast`` under mixed precision; gradients are then assigned through it
    and the parameters get their masters back at the end of every backward ([Note: DDP mixed
    precision]). ``sparse``: ``id``s of parameters whose gradients stay sparse; each has a
    ``SparseGradReduction`` instead of a slot, after the buckets ([Note: sparse gradients]).
    """

    reduces_eagerly = False  # without asynchronous communication, reduce at the end of backward
    max_in_flight = None  # the buckets are kept between steps: in flight costs no memory

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        bucket_cap_bytes: int,
        world_size: int,
        dtype: Optional[torch.dtype] = None,
        cast: Optional[ParamCast] = None,
        sparse: Collection[int] = (),
    ) -> None:
        dense = [p for p in params if id(p) not in sparse]
        self.buckets = build_buckets(dense, bucket_cap_bytes, world_size, dtype)
        self.sparse = [SparseGradReduction(p, world_size, dtype) for p in params if id(p) in sparse]
        self.params: List[nn.Parameter] = [p for bucket in self.buckets for p in bucket.params]
        self.bucket_members: List[List[int]] = []
        # parameter index -> (bucket, slot); a sparse gradient's: (its reduction's bucket, 0)
        self._where: List[Tuple[int, int]] = []
        for b, bucket in enumerate(self.buckets):
            first = len(self._where)
            self.bucket_members.append(list(range(first, first + len(bucket.params))))
            self._where += [(b, slot) for slot in range(len(bucket.params))]
        # Then one reduction per sparse gradient, last in launch order.
        self.sparse_indices = range(len(self.params), len(self.params) + len(self.sparse))
        self.params += [reduction.params[0] for reduction in self.sparse]
        self.bucket_members += [[index] for index in self.sparse_indices]
        self._where += [(len(self.buckets) + k, 0) for k in range(len(self.sparse))]
        self._master_dtype = [p.dtype for p in self.params]  # fp32 also while a ParamCast acts
        self._cast = cast
        self._set_grad = _assign_grad if cast is None else cast.set_grad

    def set_comm_hook(self, hook: Optional[CommHook]) -> None:
        """Reduce every dense bucket with ``hook`` ([Note: DDP communication hooks])."""
        for b, bucket in enumerate(self.buckets):
            bucket.comm_hook = hook
            bucket.index, bucket.is_last = b, b == len(self.buckets) - 1

    def set_divisor(self, divisor: int) -> None:
        """Divide the gradients added from now on by ``divisor`` (the world size at first)."""
        for reduction in [*self.buckets, *self.sparse]:
            reduction.divisor = divisor

    def _sparse(self, bucket: int) -> Optional[SparseGradReduction]:
        """The sparse reduction that is bucket ``bucket`` (None for a dense bucket)."""
        k = bucket - len(self.buckets)
        return self.sparse[k] if k >= 0 else None

    def _slot(self, index: int) -> Tuple[GradBucket, int, bool]:
        """(bucket, slot, the slot is the gradient) of dense parameter ``index``."""
        b, slot = self._where[index]
        bucket = self.buckets[b]
        return bucket, slot, bucket.buffer.dtype == self._master_dtype[index]

    def begin(self, sync: bool) -> None:
        pass  # param.grad holds the average afterwards: a further backward may add onto it

    def keep_local(self, index: int, param: nn.Parameter) -> None:
        """Accumulate at the master's precision: in the slot when it can be the gradient."""
        grad = param.grad
        if index not in self.sparse_indices:  # a sparse gradient has no slot: it stays .grad
            bucket, slot, slot_is_grad = self._slot(index)
            if slot_is_grad:
                if not bucket.is_slot(slot, grad):
                    bucket.views[slot].copy_(grad)  # autograd adds later micro-steps in place
                    self._set_grad(param, bucket.views[slot])
                return
        if grad.dtype != self._master_dtype[index]:
            self._set_grad(param, grad.to(self._master_dtype[index]))

    def add(self, index: int, param: nn.Parameter) -> None:
        grad = param.grad
        if index in self.sparse_indices:
            self._sparse(self._where[index][0]).add_grad(grad)
            return
        bucket, slot, slot_is_grad = self._slot(index)
        if bucket.add_grad(slot, grad) or grad is None:
            return
        if slot_is_grad:
            self._set_grad(param, bucket.views[slot])  # from now on the slot is the gradient
        elif grad.dtype != self._master_dtype[index]:
            self._set_grad(param, None)  # a low-precision copy: the average comes at finish

    def launch(self, bucket: int, async_op: bool) -> None:
        (self._sparse(bucket) or self.buckets[bucket]).launch(async_op)

    def is_done(self, bucket: int) -> bool:
        return (self._sparse(bucket) or self.buckets[bucket]).is_done()

    def finish(self, bucket: int) -> None:
        """Make every slot that holds an average the parameter's gradient (or copy it there)."""
        sparse = self._sparse(bucket)
        if sparse is not None:
            (index,) = self.bucket_members[bucket]
            average = sparse.finish()
            if average is not None:  # else no rank had a gradient: .grad stays None
                self._set_grad(self.params[index], average.to(self._master_dtype[index]))
            return
        have, mine = self.buckets[bucket].finish()
        members = self.bucket_members[bucket]  # slot k is parameter members[k]
        in_place = self._slot(members[0])[2]  # one dtype per bucket: its slots can be .grad
        # A slot this rank added to is its parameter's .grad since add, where a slot can be one:
        # left are the averages (some rank had a gradient) that are not .grad yet.
        left = [i for i, h, m in zip(members, have, mine) if h and not (m and in_place)]
        if not left:
            return  # the common case: every slot became its parameter's gradient in add
        master = self._master_dtype[members[0]]
        cast = None  # every average becomes a new .grad of the master's dtype: cast at once
        fresh = all(self.params[i].grad is None for i in left)
        if fresh and self.buckets[bucket].buffer.dtype != master:
            cast = self.buckets[bucket].views_as(master)
        for index in left:
            bucket_, slot, slot_is_grad = self._slot(index)
            param, view = self.params[index], bucket_.views[slot]
            if slot_is_grad:
                if not bucket_.is_slot(slot, param.grad):
                    self._set_grad(param, view)
            elif param.grad is not None:
                param.grad.copy_(view)  # an fp32 gradient kept from earlier micro-steps
            else:
                self._set_grad(param, view.to(master) if cast is None else cast[slot])

    def end(self, sync: bool) -> None:
        if self._cast is not None:
            self._cast.to_master()

    def reset(self) -> None:
        for bucket in [*self.buckets, *self.sparse]:
            bucket.reset()
        if self._cast is not None:  # a failed backward: drop its gradients, keep the masters
            self._cast.to_master(attach_grads=False)


def build_buckets(
    params: Sequence[nn.Parameter],
    bucket_cap_bytes: int,
    world_size: int,
    dtype: Optional[torch.dtype] = None,
) -> List[GradBucket]:
    """Group ``params`` into buckets of at most ``bucket_cap_bytes`` of gradients each.

    Parameters are taken in REVERSE order (backward produces the last layers' gradients first),
    a bucket holds one (device, dtype), and a parameter larger than the cap gets its own bucket.
    The returned order is the launch order, identical on every rank given identical ``params``.
    ``dtype``: the buffers' dtype (mixed precision's ``reduce_dtype``), else the parameters'.
    """
    open_buckets = {}  # (device, dtype) -> [params, bytes] of the bucket being filled
    order: List[list] = []  # every bucket's [params, bytes], in creation (= launch) order
    for p in reversed(list(params)):
        key = (p.device, p.dtype)
        size = p.numel() * p.element_size()
        current = open_buckets.get(key)
        if current is None or (current[0] and current[1] + size > bucket_cap_bytes):
            current = open_buckets[key] = [[], 0]
            order.append(current)
        current[0].append(p)
        current[1] += size
    return [GradBucket(members, world_size, dtype) for members, _ in order]
