"""ZeRO-1 and ZeRO-2 model wrappers: replicated parameters in a flat buffer, sharded gradients.

[Note: ZeRO-1/2 backward]
At wrap time the trainable parameters move into a flat parameter buffer ([Note: ZeRO flat
layout]): ``param.data`` becomes a view of it, so layers compute with the full parameters through
the default ``LOCAL_HANDLER``. Rank 0's parameters and buffers are broadcast. Each trainable
parameter gets a ``register_post_accumulate_grad_hook``, called once per backward after autograd
has accumulated the parameter's gradient (a tied parameter is one leaf: once, after both uses).

- ZeRO-1 keeps a full gradient buffer (parameter dtype) and ``param.grad`` is the parameter's
  view of it (a freshly allocated gradient is copied in), so no_sync micro-steps accumulate in
  place. In a synchronised backward the hook leaves ``grad / N`` in the view; a complete bucket
  is then reduced in place so that this rank's chunk holds the average. Only the owned chunks
  are meaningful afterwards: ``param.grad`` is not guaranteed to be the average.
- ZeRO-2 keeps only a gradient shard (``shard_numel``,). The hook copies ``param.grad / N`` into
  a per-bucket staging buffer and sets ``param.grad = None``; a complete bucket is reduced at
  once, its chunk lands in the shard and its staging buffer is dropped as soon as the collective
  is done, so full-size gradients live bucket by bucket, never all at once.

Buckets are launched strictly in bucket order (a bucket only after its predecessors), so the
collectives of all ranks pair up whatever order gradients arrive in. With
``enable_async_communication`` they are launched with ``async_op=True`` while backward goes on
(finished ones are collected at every hook) and waited for once at the end of backward; without,
each runs synchronously when its turn comes (ZeRO-1: at the end of backward). Same buckets, same
data, same collectives: results are bitwise identical on and off.

``_end_of_backward`` (queued on the autograd engine by the first hook) sends the buckets not
launched yet: a parameter whose hook did not fire contributes its kept ``param.grad`` (no_sync
accumulation) or zeros. Inside ``no_sync()`` nothing is communicated and full local gradients
are kept (ZeRO-2 included); the next synchronised backward reduces the accumulated total.

Reduced gradients must be cleared (``optimizer.zero_grad()`` or ``model.zero_grad()``) before
the next backward: the reduction leaves nothing to accumulate onto, so a backward on reduced
gradients raises instead of silently summing garbage. Limits (as DDP): the set of trainable
parameters is fixed at wrap time; every rank must run backward through at least one trainable
parameter in a synchronised step; a parameter without gradient on every rank gets a zero
gradient (the optimizer still applies momentum / weight decay to it); no reentrant backward.
Collectives: [Note: ZeRO collectives on gloo].
"""

import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.optim.base import STRATEGY_OF_PARAM
from tiny_fsdp.core.precision import MixedPrecisionPolicy
from tiny_fsdp.core.utils.dist import check_backend_device
from tiny_fsdp.core.wrapper import (
    DataParallelWrapper,
    check_no_shared_storage,
    check_same_model_on_all_ranks,
)
from tiny_fsdp.core.zero.flat_buffer import (
    FlatBuffer,
    FlatLayout,
    Piece,
    gather_bucket,
    reduce_bucket,
    shard_chunk,
    shard_piece,
)

# Set on every parameter (trainable or frozen) of a ZeRO-wrapped module: a weak ref to the wrapper.
_OWNER_ATTR = "_tiny_fsdp_zero_owner"


def zero_owner(tensor: torch.Tensor) -> Optional["ZeroWrapper"]:
    """The live ZeRO-1/2 wrapper whose model holds ``tensor`` as a parameter, or None."""
    ref = getattr(tensor, _OWNER_ATTR, None)
    return ref() if ref is not None else None


def _zero_strategy(tensor: torch.Tensor) -> Optional[str]:
    owner = zero_owner(tensor)
    return None if owner is None else f"Zero{owner.stage}"


STRATEGY_OF_PARAM.append(_zero_strategy)


class ZeroWrapper(DataParallelWrapper):
    """Shared ZeRO-1/2 implementation; use ``Zero1`` or ``Zero2`` ([Note: ZeRO-1/2 backward]).

    Args:
        module: the model, on its final device; converted in place to tiny_fsdp layers.
        bucket_cap_mb: maximum parameter bytes (MiB) per bucket (one reduce-scatter each).
        enable_async_communication: overlap the reduce-scatters with backward and the
            all-gathers with each other.
        mixed_precision: ZeRO-1/2 already keep low-precision parameters with fp32 master
            shards in the optimizer, so the policy maps onto that: the (fp32) model's
            parameters are stored in ``param_dtype``, gradients are reduced in that dtype
            (``reduce_dtype`` must equal it) and the optimizer's fp32 masters start from the
            exact fp32 values ([Note: mixed precision]). ``state_dict()`` then holds
            ``param_dtype`` tensors; the fp32 masters are in the optimizer's state.

    All trainable parameters must share one dtype and device. ``state_dict()`` /
    ``load_state_dict()`` use the plain model's keys and full tensors.

    Attributes:
        params: the trainable parameters in layout order (backward order; tied ones once).
        layout: their ``FlatLayout``; ``owned_pieces``: layout index -> this rank's ``Piece``.
        param_buffer: ``FlatBuffer`` (numel,) whose views are the parameters' ``.data``.
        grad_buffer: ZeRO-1's ``FlatBuffer`` of gradients (None for ZeRO-2).
        grad_shard: ZeRO-2's reduced gradient shard (shard_numel,) (None for ZeRO-1).
        grads_reduced: a synchronised backward reduced gradients not cleared since.
    """

    stage: int = 0

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        enable_async_communication: bool = False,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
    ) -> None:
        super().__init__(module, enable_async_communication, mixed_precision)
        if mixed_precision is not None and mixed_precision.reduce_dtype != (
            mixed_precision.param_dtype
        ):
            raise ValueError(
                f"{type(self).__name__} reduces gradients in the parameters' dtype: use "
                f"MixedPrecisionPolicy(param_dtype, reduce_dtype=None), got {mixed_precision}"
            )
        if self.stage not in (1, 2):
            raise TypeError("instantiate Zero1 or Zero2, not ZeroWrapper")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        named = list(self.module.named_parameters())  # a tied parameter appears once
        for name, p in named:
            if any(_live_owner(p, attr) for attr in vars(p)):
                raise ValueError(f"parameter '{name}' already belongs to a wrapper; wrap once")
        what = type(self).__name__
        check_backend_device(named, what, ("broadcast", "all_reduce"))  # gloo: no reduce-scatter
        check_no_shared_storage(self.module, what)
        check_same_model_on_all_ranks(self.module, type(self).__name__)
        trainable = [(name, p) for name, p in named if p.requires_grad]
        if not trainable:
            raise ValueError(f"{type(self).__name__}: the model has no trainable parameter")
        dtypes = {(p.dtype, p.device) for _, p in trainable}
        if len(dtypes) != 1:
            raise ValueError(
                f"{type(self).__name__} needs one dtype and device for all trainable parameters, "
                f"got {sorted(str(d) for d in dtypes)}; cast the model (e.g. model.to(dtype)) first"
            )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.bucket_cap_mb = bucket_cap_mb
        # Backward order (the last layer's gradient is ready first): layout slot i is params[i].
        self.params: List[nn.Parameter] = [p for _, p in reversed(trainable)]
        dtype, device = trainable[0][1].dtype, trainable[0][1].device
        if mixed_precision is not None:
            dtype = mixed_precision.param_dtype
        cap = max(1, int(bucket_cap_mb * 2**20) // dtype.itemsize)
        self.layout = FlatLayout([p.shape for p in self.params], self.world_size, cap)
        self.param_buffer = FlatBuffer(self.layout, dtype, device)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # This rank's piece of each parameter it owns elements of (layout index -> Piece).
        self.owned_pieces: Dict[int, Piece] = {pc.index: pc for pc in self.layout.pieces(self.rank)}
        # Mixed precision: this rank's pieces of the fp32 values, for the optimizer's masters.
        self._initial_masters: Optional[torch.Tensor] = None
        if mixed_precision is not None:
            self._initial_masters = self._master_pieces_before_cast()
            for _, p in named:
                if not p.requires_grad:  # frozen: not in the buffer, computes in param_dtype
                    p.data = p.data.to(dtype)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                self.param_buffer.view(i).copy_(p)
                p.data = self.param_buffer.view(i)
            comm.broadcast(self.param_buffer.data, src=0)
            for t in [p for _, p in named if not p.requires_grad] + list(self.module.buffers()):
                comm.broadcast(t.detach(), src=0)

        if self.stage == 1:
            self.grad_buffer: Optional[FlatBuffer] = FlatBuffer(self.layout, dtype, device)
            self.grad_shard: Optional[torch.Tensor] = None
        else:
            self.grad_buffer = None
            self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=dtype, device=device)
        self.grads_reduced = False
        self._optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._reset_backward_state()

        owner = weakref.ref(self)
        for _, p in named:
            setattr(p, _OWNER_ATTR, owner)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(_grad_ready_hook(owner, i))
            for i, p in enumerate(self.params)
        ]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._backward_active:  # the previous backward raised before its end callback
            self._reset_backward_state()
        return super().forward(*args, **kwargs)

    # ------------------------------------------------------------------ backward machinery

    def _reset_backward_state(self) -> None:
        self._backward_active = False
        self._sync = True
        self._arrived = [0] * len(self.layout.buckets)
        self._fired = [False] * len(self.params)
        self._next_launch = 0
        self._pending: List[Tuple[Any, int]] = []  # (PendingReduce, bucket) in flight
        self._staging: List[Optional[torch.Tensor]] = [None] * len(self.layout.buckets)

    def _on_grad_ready(self, index: int, param: nn.Parameter) -> None:
        if not self._backward_active:
            if self.grads_reduced:
                raise RuntimeError(
                    f"{type(self).__name__}: backward on gradients already reduced by a "
                    "synchronised backward. Call optimizer.zero_grad() (or model.zero_grad()) "
                    "between steps; to accumulate over micro-batches use model.no_sync()."
                )
            self._backward_active = True
            self._sync = self.require_backward_grad_sync
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        with torch.no_grad():
            if self.stage == 1:
                self._grad_into_buffer(index, param)
            elif self._sync:
                self._grad_into_staging(index, param)
            if not self._sync:
                return  # no_sync: keep the full local gradient (ZeRO-2: in param.grad)
            self._fired[index] = True
            self._arrived[self.layout.slots[index].bucket] += 1
            if self.enable_async_communication or self.stage == 2:
                # ZeRO-2 always reduces during backward: that is what frees full gradients.
                self._launch_complete_buckets()

    def _grad_into_buffer(self, index: int, param: nn.Parameter) -> None:
        """ZeRO-1: make ``param.grad`` the parameter's view of the gradient buffer; in a
        synchronised backward, the view then holds this rank's share ``grad / N``."""
        view = self.grad_buffer.view(index)
        fresh = param.grad is not None and param.grad.data_ptr() != view.data_ptr()
        divide = self._sync and self.world_size > 1
        if param.grad is None:
            view.zero_()  # end of backward, unused parameter: contributes zeros
        elif fresh and divide:
            torch.div(param.grad, self.world_size, out=view)  # copy and divide in one pass
        elif fresh:
            view.copy_(param.grad)
        elif divide:
            view.div_(self.world_size)  # accumulated in place over no_sync micro-steps
        param.grad = view

    def _grad_into_staging(self, index: int, param: nn.Parameter) -> None:
        """ZeRO-2: ``param.grad / N`` into the bucket's staging buffer; drop ``param.grad``."""
        slot = self.layout.slots[index]
        staging = self._staging[slot.bucket]
        if staging is None:
            bucket = self.layout.buckets[slot.bucket]
            staging = torch.empty(bucket.numel, dtype=param.dtype, device=param.device)
            end = self.layout.slots[bucket.slots[-1]]
            staging[end.start + end.numel - bucket.start :].zero_()  # the padding
            self._staging[slot.bucket] = staging
        offset = slot.start - self.layout.buckets[slot.bucket].start
        out = staging[offset : offset + slot.numel].view(slot.shape)
        if param.grad is None:
            out.zero_()
        else:
            torch.div(param.grad, self.world_size, out=out)  # copy and pre-divide in one pass
        param.grad = None

    def _launch_complete_buckets(self) -> None:
        layout = self.layout
        while self._next_launch < len(layout.buckets) and self._arrived[self._next_launch] == len(
            layout.buckets[self._next_launch].slots
        ):
            self._launch(self._next_launch)
            self._next_launch += 1
        # Finish the reductions that are done (ZeRO-2: frees their staging) without waiting.
        still = []
        for work, b in self._pending:
            if work.is_completed():
                work.wait()
                self._finish(b)
            else:
                still.append((work, b))
        self._pending = still

    def _launch(self, b: int) -> None:
        """Reduce bucket ``b`` (this rank's gradient / N): this rank's chunk gets the sum."""
        if self.stage == 1:
            src, out = self.grad_buffer.bucket(b), self.grad_buffer.chunk(b, self.rank)
        else:
            src, out = self._staging[b], shard_chunk(self.grad_shard, self.layout, b)
        pending = reduce_bucket(src, out, self.rank, self.enable_async_communication)
        if self.enable_async_communication:
            self._pending.append((pending, b))
        else:
            pending.wait()
            self._finish(b)

    def _finish(self, b: int) -> None:
        """Bucket ``b``'s reduction is done: ZeRO-2 frees its staging buffer."""
        if self.stage == 2:
            self._staging[b] = None

    def _end_of_backward(self) -> None:
        try:
            if not self._sync:
                return
            with torch.no_grad():
                for index, p in enumerate(self.params):  # hooks that did not fire
                    if not self._fired[index]:
                        if self.stage == 1:
                            self._grad_into_buffer(index, p)
                        else:
                            self._grad_into_staging(index, p)
                        self._arrived[self.layout.slots[index].bucket] += 1
                self._launch_complete_buckets()
                for work, b in self._pending:
                    work.wait()
                    self._finish(b)
            self.grads_reduced = True
        finally:
            self._reset_backward_state()

    @torch.no_grad()
    def _master_pieces_before_cast(self) -> torch.Tensor:
        """(shard_numel,) this rank's pieces of rank 0's trainable parameters, in their own
        (fp32) dtype: casting into the low-precision buffer would otherwise round the masters."""
        first = self.params[0]
        shard = torch.zeros(self.layout.shard_numel, dtype=first.dtype, device=first.device)
        for p in self.params:
            comm.broadcast(p.detach(), src=0)  # wrap time only: the masters agree on all ranks
        for piece in self.owned_pieces.values():
            flat = self.params[piece.index].detach().reshape(-1)
            shard_piece(shard, piece).copy_(
                flat[piece.param_start : piece.param_start + piece.numel]
            )
        return shard

    def take_initial_masters(self) -> Optional[torch.Tensor]:
        """The fp32 master shard prepared at wrap time (once; None afterwards or without one)."""
        masters, self._initial_masters = self._initial_masters, None
        return masters

    # ------------------------------------------------------------------ used by the optimizer

    def index_of(self, param: torch.Tensor) -> int:
        """Layout index of trainable parameter ``param`` (KeyError if it is not one)."""
        return self._index[id(param)]

    def all_gather_params(self) -> None:
        """Every rank's chunk of every bucket of the parameter buffer, to every rank (in place)."""
        works = []
        for b in range(len(self.layout.buckets)):
            bucket = self.param_buffer.bucket(b)
            works += gather_bucket(
                bucket, self.rank, self.world_size, self.enable_async_communication
            )
        for work in works:
            if work is not None:
                work.wait()

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (the reduced ones included) before the next backward.

        ``set_to_none``: ``param.grad = None`` (ZeRO-1's buffer is then overwritten by the next
        backward, not zeroed now). Otherwise ZeRO-1 zeroes its buffer and ``param.grad`` stays
        a view of it. ZeRO-2's shard needs no clearing: the next reduction overwrites it.
        """
        if self.stage == 1 and not set_to_none:
            self.grad_buffer.data.zero_()
        for i, p in enumerate(self.params):
            if set_to_none:
                p.grad = None
            elif self.stage == 1:
                p.grad = self.grad_buffer.view(i)
            elif p.grad is not None:
                p.grad.zero_()
        self.grads_reduced = False

    # ------------------------------------------------------------------ checkpoints

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a plain-model state dict (the same on every rank); refreshes optimizer masters."""
        result = super().load_state_dict(state_dict, strict, assign)  # copies into views
        for optimizer in list(self._optimizers):
            optimizer._masters_from_params()
        return result


class Zero1(ZeroWrapper):
    """ZeRO-1: replicated parameters and gradients; the optimizer shards its state and master."""

    stage = 1


class Zero2(ZeroWrapper):
    """ZeRO-2: replicated parameters; gradients and optimizer state / master are sharded."""

    stage = 2


def _live_owner(param: torch.Tensor, attr: str) -> bool:
    # Every tiny_fsdp strategy marks its parameters with a weak ref in "_tiny_fsdp_*_owner".
    if not (attr.startswith("_tiny_fsdp_") and attr.endswith("_owner")):
        return False
    ref = getattr(param, attr)
    return callable(ref) and ref() is not None


def _grad_ready_hook(owner: "weakref.ref[ZeroWrapper]", index: int) -> Callable[[Any], None]:
    # Holds the wrapper weakly: a discarded wrapper does not live on through its hooks.
    def hook(param: nn.Parameter) -> None:
        wrapper = owner()
        if wrapper is not None:
            wrapper._on_grad_ready(index, param)

    return hook
