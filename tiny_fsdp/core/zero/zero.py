"""ZeRO-1 and ZeRO-2 model wrappers: replicated parameters in a flat buffer, sharded gradients.

[Note: ZeRO-1/2 backward]
At wrap time the trainable parameters move into a flat parameter buffer ([Note: ZeRO flat
layout]): ``param.data`` becomes a view of it, so layers compute with the full parameters through
the default ``LOCAL_HANDLER``. Rank 0's parameters and buffers are broadcast. Each trainable
parameter gets a ``register_post_accumulate_grad_hook``, called once per backward after autograd
has accumulated the parameter's gradient (a tied parameter is one leaf: once, after both uses).

- ZeRO-1 keeps a full gradient buffer (parameter dtype). The hook makes ``param.grad`` the
  parameter's view of it (copying a freshly allocated gradient in), so later backwards accumulate
  in place. In a synchronised backward a complete bucket is divided by ``N`` and reduce-scattered
  IN PLACE: afterwards rank r's chunk holds the averaged gradient and the rest of the buffer its
  local gradient / N (only the owned chunks are meaningful; ``param.grad`` is not the average).
- ZeRO-2 keeps only a gradient shard (``shard_numel``,). The hook copies ``param.grad / N`` into
  a per-bucket staging buffer and sets ``param.grad = None``; a complete bucket is reduce-scattered
  into its chunk of the shard and its staging buffer is dropped as soon as the collective is done,
  so full-size gradients live bucket by bucket, never all at once.

Buckets are launched strictly in bucket order (a bucket only after its predecessors), so the
collectives of all ranks pair up whatever order gradients arrive in. With
``enable_async_communication`` they are launched with ``async_op=True`` while backward goes on
(ZeRO-2 polls finished ones to free their staging) and waited for once at the end of backward;
without, each is run synchronously when its turn comes (ZeRO-1: at the end of backward). Same
buckets, same data, same collectives: results are bitwise identical on and off.

``_end_of_backward`` (queued on the autograd engine by the first hook) sends the buckets not
launched yet: a parameter whose hook did not fire contributes its kept ``param.grad`` (no_sync
accumulation) or zeros. Inside ``no_sync()`` nothing is communicated and full local gradients
are kept (ZeRO-2 included); the next synchronised backward reduces the accumulated total.

Reduced gradients must be cleared (``optimizer.zero_grad()`` or ``model.zero_grad()``) before
the next backward: the in-place reduction leaves nothing to accumulate onto, so a backward on
reduced gradients raises instead of silently summing garbage. Limits (as DDP): the set of
trainable parameters is fixed at wrap time; every rank must run backward through at least one
trainable parameter in a synchronised step; a parameter without gradient on every rank gets a
zero gradient (the optimizer still applies momentum / weight decay to it); no reentrant backward.
"""

import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.wrapper import DataParallelWrapper
from tiny_fsdp.core.zero.flat_buffer import FlatBuffer, FlatLayout, Piece, shard_chunk

# Set on every parameter (trainable or frozen) of a ZeRO-wrapped module: a weak ref to the wrapper.
_OWNER_ATTR = "_tiny_fsdp_zero_owner"


def zero_owner(tensor: torch.Tensor) -> Optional["ZeroWrapper"]:
    """The live ZeRO-1/2 wrapper whose model holds ``tensor`` as a parameter, or None."""
    ref = getattr(tensor, _OWNER_ATTR, None)
    return ref() if ref is not None else None


class ZeroWrapper(DataParallelWrapper):
    """Shared ZeRO-1/2 implementation; use ``Zero1`` or ``Zero2`` ([Note: ZeRO-1/2 backward]).

    Args:
        module: the model, on its final device; converted in place to tiny_fsdp layers.
        bucket_cap_mb: maximum parameter bytes (MiB) per bucket (one reduce-scatter each).
        enable_async_communication: overlap the reduce-scatters with backward and the
            all-gathers with each other.

    All trainable parameters must share one dtype and device. ``state_dict()`` /
    ``load_state_dict()`` use the plain model's keys and full tensors.
    """

    stage: int = 0

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        enable_async_communication: bool = False,
    ) -> None:
        super().__init__(module, enable_async_communication)
        if self.stage not in (1, 2):
            raise TypeError("instantiate Zero1 or Zero2, not ZeroWrapper")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        named = list(self.module.named_parameters())  # a tied parameter appears once
        for name, p in named:
            if any(_live_owner(p, attr) for attr in vars(p)):
                raise ValueError(f"parameter '{name}' already belongs to a wrapper; wrap once")
        _check_same_model_on_all_ranks(self.module)
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
        cap = max(1, int(bucket_cap_mb * 2**20) // trainable[0][1].element_size())
        self.layout = FlatLayout([p.shape for p in self.params], self.world_size, cap)
        self.param_buffer = FlatBuffer(self.layout, dtype, device)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # This rank's piece of each parameter it owns elements of (layout index -> Piece).
        self.owned_pieces: Dict[int, Piece] = {pc.index: pc for pc in self.layout.pieces(self.rank)}
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
        self._staging: List[Optional[torch.Tensor]] = [None] * len(self.layout.buckets)
        self.grads_reduced = False  # a synchronised backward reduced grads not cleared since
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
        self._pending: List[Tuple[Any, int]] = []  # (work, bucket) of async reduce-scatters
        self._staging = [None] * len(self.layout.buckets)

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
            if not self._sync:
                return  # no_sync: keep the full local gradient (ZeRO-2: in param.grad)
            if self.stage == 2:
                self._grad_into_staging(index, param)
            self._fired[index] = True
            bucket = self.layout.slots[index].bucket
            self._arrived[bucket] += 1
            if self.enable_async_communication or self.stage == 2:
                # ZeRO-2 always reduces during backward: that is what frees full gradients.
                self._launch_complete_buckets()

    def _grad_into_buffer(self, index: int, param: nn.Parameter) -> None:
        """ZeRO-1: make ``param.grad`` the parameter's view of the gradient buffer."""
        view = self.grad_buffer.view(index)
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)  # the slot is zero (cleared): copy == accumulate
            param.grad = view
        elif param.grad is None:
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
        # Free the staging of finished ZeRO-2 reductions without waiting for the others.
        still = []
        for work, b in self._pending:
            if self.stage == 2 and work.is_completed():
                work.wait()
                self._staging[b] = None
            else:
                still.append((work, b))
        self._pending = still

    def _launch(self, b: int) -> None:
        """Reduce-scatter bucket ``b`` (already holding gradient / N for ZeRO-2)."""
        asynchronous = self.enable_async_communication
        if self.stage == 1:
            src = self.grad_buffer.bucket(b)
            if self.world_size > 1:
                src.div_(self.world_size)
            out = self.grad_buffer.chunk(b, self.rank)  # in place: a view of src
        else:
            src = self._staging[b]
            out = shard_chunk(self.grad_shard, self.layout, b)
        work = comm.reduce_scatter(out, src, async_op=asynchronous)
        if asynchronous:
            self._pending.append((work, b))
        else:
            self._staging[b] = None

    def _end_of_backward(self) -> None:
        try:
            if not self._sync:
                return
            with torch.no_grad():
                for index, p in enumerate(self.params):  # hooks that did not fire
                    if self._fired[index] or self.layout.slots[index].bucket < self._next_launch:
                        continue
                    if self.stage == 1:
                        if p.grad is not None:
                            self._grad_into_buffer(index, p)
                    else:
                        self._grad_into_staging(index, p)
                    self._arrived[self.layout.slots[index].bucket] += 1
                self._launch_complete_buckets()
                for work, _ in self._pending:
                    work.wait()
            self.grads_reduced = True
        finally:
            self._reset_backward_state()

    # ------------------------------------------------------------------ used by the optimizer

    def index_of(self, param: torch.Tensor) -> int:
        """Layout index of trainable parameter ``param`` (KeyError if it is not one)."""
        return self._index[id(param)]

    def all_gather_params(self) -> None:
        """Every rank's chunk of every bucket of the parameter buffer, to every rank (in place)."""
        works = [
            comm.all_gather(
                self.param_buffer.bucket(b),
                self.param_buffer.chunk(b, self.rank),
                async_op=self.enable_async_communication,
            )
            for b in range(len(self.layout.buckets))
        ]
        if self.enable_async_communication:
            for work in works:
                work.wait()

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (the reduced ones included) before the next backward.

        ZeRO-1 zeroes its gradient buffer and keeps ``param.grad`` as views of it unless
        ``set_to_none``; ZeRO-2's shard needs no clearing (the next reduce-scatter overwrites it).
        """
        if self.stage == 1:
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

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The plain model's state dict (every rank holds the full parameters)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a plain-model state dict (the same on every rank); refreshes optimizer masters."""
        if assign:
            raise ValueError(f"{type(self).__name__}.load_state_dict does not support assign=True")
        result = self.module.load_state_dict(state_dict, strict=strict)  # copies into views
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


def _check_same_model_on_all_ranks(module: nn.Module) -> None:
    """Raise on every rank if the ranks' tensors differ in name, shape, dtype or trainability."""
    mine = [
        (name, tuple(t.shape), str(t.dtype), t.requires_grad)
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    ]
    for rank, theirs in enumerate(comm.all_gather_object(mine)):
        if theirs != mine:
            raise ValueError(
                f"rank {rank}'s model differs from this rank's (name, shape, dtype, requires_grad)"
                f": {sorted(set(theirs) ^ set(mine))[:4]}. Build the same model on every rank."
            )
