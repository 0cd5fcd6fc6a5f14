"""Flat gradient buckets: many parameters' gradients averaged over ranks by one all-reduce.

[Note: gradient bucket layout]
A bucket owns one flat buffer of its parameters' dtype (or the mixed-precision policy's
``reduce_dtype``: gradients are then rounded to it on the way in and back), on their device::

    buffer = [ grad(p0) | grad(p1) | ... | grad(pk-1) | flag(p0) ... flag(pk-1) ]
               numel(p0)  numel(p1)        numel(pk-1)  k elements

Gradient ``i`` is copied in already divided by the world size, so the SUM all-reduce of the
buffer leaves the AVERAGE (pre-dividing works on every backend, unlike ReduceOp.AVG). Flag ``i``
is 1 on a rank that had a gradient for parameter ``i`` and 0 on a rank that had none (parameter
unused in its forward); after the all-reduce a zero flag means no rank had a gradient, and the
parameter's ``.grad`` is left None, as single-device training would leave it. Riding in the same
buffer, the flags cost ``k`` elements and no extra collective.

The backward engine ([Note: bucketed backward]) adds every slot (``add_grad``) before it calls
``launch``, which starts the all-reduce (asynchronously if asked); ``finish`` waits for it, writes
the averages back into ``param.grad`` and resets the bucket for the next backward.
``AllReduceBuckets`` is DDP's gradient store: its buckets, behind the engine's verbs.
"""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core import comm


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
        self.world_size = world_size
        total = sum(p.numel() for p in self.params)
        dtype = first.dtype if dtype is None else dtype
        self.buffer = torch.zeros(total + len(self.params), dtype=dtype, device=first.device)
        self.views: List[torch.Tensor] = []
        offset = 0
        for p in self.params:
            self.views.append(self.buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.flags = self.buffer[total:]  # (len(params),)
        self._has_grad = [False] * len(self.params)
        self._work: Optional[dist.Work] = None
        self.launched = False

    def add_grad(self, slot: int, grad: Optional[torch.Tensor]) -> None:
        """Copy ``grad`` (shape of ``params[slot]``) into its slot, divided by the world size.

        ``grad`` None (the parameter had no gradient on this rank): zeros, and a zero flag.
        """
        if grad is None:
            self.views[slot].zero_()
            return
        # One pass that copies and scales (rather than copy now, divide the buffer later).
        torch.div(grad, self.world_size, out=self.views[slot])
        self._has_grad[slot] = True

    def launch(self, async_op: bool) -> None:
        """Start the SUM all-reduce of the buffer (every slot added)."""
        assert not self.launched, "launch a bucket once per backward"
        if all(self._has_grad):
            self.flags.fill_(1)  # one kernel: the common case
        else:
            self.flags.copy_(torch.tensor(self._has_grad, dtype=self.flags.dtype))
        self._work = comm.all_reduce(self.buffer, async_op=async_op)
        self.launched = True

    def is_done(self) -> bool:
        """The launched all-reduce has completed (never blocks)."""
        return self._work is None or self._work.is_completed()

    def finish(self) -> None:
        """Wait for the all-reduce, write the averages into ``param.grad``, reset the bucket."""
        assert self.launched, "finish a bucket only after launching it"
        if self._work is not None:
            self._work.wait()
        global_flags: Optional[List[float]] = None
        for slot, p in enumerate(self.params):
            if p.grad is not None:
                p.grad.copy_(self.views[slot])
                continue
            # No local gradient: some other rank may have had one. Reading the flags syncs a
            # GPU with the host, so do it only on this rare path.
            if global_flags is None:
                global_flags = self.flags.tolist()
            if global_flags[slot] > 0:
                p.grad = self.views[slot].to(p.dtype, copy=True)
        self.reset()

    def reset(self) -> None:
        """Forget this backward's progress (also used to drop the state of a failed backward)."""
        self._has_grad = [False] * len(self.params)
        self._work = None
        self.launched = False


class AllReduceBuckets:
    """DDP's gradient store ([Note: bucketed backward]): ``buckets`` of the trainable ``params``
    (``build_buckets``), each all-reduced as one flat buffer, the averages copied back into
    ``param.grad``. Parameter ``index`` is its position in bucket order."""

    reduces_eagerly = False  # without asynchronous communication, reduce at the end of backward

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        bucket_cap_bytes: int,
        world_size: int,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.buckets = build_buckets(params, bucket_cap_bytes, world_size, dtype)
        self.params: List[nn.Parameter] = [p for bucket in self.buckets for p in bucket.params]
        self.bucket_members: List[List[int]] = []
        self._where: List[Tuple[int, int]] = []  # parameter index -> (bucket, slot)
        for b, bucket in enumerate(self.buckets):
            first = len(self._where)
            self.bucket_members.append(list(range(first, first + len(bucket.params))))
            self._where += [(b, slot) for slot in range(len(bucket.params))]

    def begin(self, sync: bool) -> None:
        pass  # param.grad holds the average afterwards: a further backward may add onto it

    def keep_local(self, index: int, param: nn.Parameter) -> None:
        pass  # autograd accumulates into param.grad

    def add(self, index: int, param: nn.Parameter) -> None:
        b, slot = self._where[index]
        self.buckets[b].add_grad(slot, param.grad)

    def launch(self, bucket: int, async_op: bool) -> None:
        self.buckets[bucket].launch(async_op)

    def is_done(self, bucket: int) -> bool:
        return self.buckets[bucket].is_done()

    def finish(self, bucket: int) -> None:
        self.buckets[bucket].finish()

    def end(self) -> None:
        pass

    def reset(self) -> None:
        for bucket in self.buckets:
            bucket.reset()


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
