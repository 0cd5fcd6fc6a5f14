"""The gradient stores of ZeRO-1 and ZeRO-2: what the backward engine fills and reduces.

[Note: ZeRO gradient stores]
``Zero1`` and ``Zero2`` run the shared engine ([Note: bucketed backward]) over the buckets of the
flat layout ([Note: ZeRO flat layout]) and differ only in the store they plug in:

- ``FullGradBuffer`` (ZeRO-1) keeps a full gradient buffer (``layout.numel``,) and ``param.grad``
  is the parameter's view of it (a freshly allocated gradient is copied in), so ``no_sync``
  micro-steps accumulate in place. A synchronised hook leaves ``grad / N`` in the view; bucket b's
  reduction then leaves the average in this rank's chunk of b. Only the owned chunks are
  meaningful afterwards: ``param.grad`` is not guaranteed to be the average. Without asynchronous
  communication every bucket is reduced at the end of backward. Where a reduction in place
  receives the other rank's part into a buffer of its own (2 CPU ranks, [Note: ZeRO collectives
  on gloo]), ``stats`` counts those buffers and ``max_in_flight`` = 1 bounds them: at most two
  chunks, the reduction just launched and the one before it.
- ``StagedGradShard`` (ZeRO-2) keeps only a gradient shard (a ``ShardBuffer``: its chunk of every
  bucket, ``shard_numel`` elements in all). A synchronised hook copies ``param.grad / N`` into
  its bucket's staging buffer and sets ``param.grad = None``; a complete bucket is reduced at
  once (``reduces_eagerly``), its chunk lands in the shard and its staging buffer is dropped as
  soon as the collective is done, so full-size gradients live bucket by bucket, never all at
  once: with asynchronous communication at most ``max_in_flight`` = 1 reduction stays
  unfinished while the next bucket fills. A bucket that is one parameter and
  needs no padding (a large embedding has a bucket of its own) stages in the gradient itself,
  divided in place: no buffer and no copy (on gpt2_mini's 51 MB ``wte`` a fresh buffer cost
  about 40 ms a step on CPU, in page faults). On one rank the shard is every bucket whole and
  the reduction the identity, so gradients stage straight into the shard (views made once, as
  ZeRO-1's): no staging buffer, and no copy from one into the shard. Inside ``no_sync()`` the
  full local ``param.grad`` is kept.

Both stores give the optimizer the reduced gradient of each owned piece (``reduced_grad``) and
clear gradients for it (``zero_grad``).

[Note: backward again before the step]
torch's DDP adds a second backward's averaged gradient onto the first (a GAN's discriminator:
``loss_real.backward(); loss_fake.backward(); opt.step()``). Here the reduction leaves only this
rank's chunks meaningful, nothing a new backward could accumulate onto. So a backward through
the wrapper's output (a hook on it runs before any parameter's gradient) on reduced gradients
not cleared since first sets them aside (``set_aside``; ``_carry``: this rank's chunks, 1/N
of the gradients) and clears the gradients, and each bucket's reduction adds its carried chunk
when it finishes; a ``no_sync`` backward in between accumulates locally as usual and the next
synchronised one reduces the local total. A parameter is then without gradient only if it had
none in every backward. The same holds after a step without ``zero_grad`` (torch adds onto the
stepped gradients too; a GAN's generator step runs backward through the discriminator). A
backward that accumulates into no parameter (``autograd.grad`` for an input) sets nothing
aside ([Note: backward for inputs only]); one that bypassed the wrapper's output finds nothing
set aside and raises.

[Note: gradients assigned after backward]
torch's optimizers and clipping read ``param.grad`` whatever tensor it is, so ``p.grad = p.grad
* 0.5`` (or any tensor) after backward is the gradient they use. Here they read the store:
ZeRO-1's buffer, of which ``param.grad`` is a view, and ZeRO-2's shard, ``param.grad`` None.
So before the first read after a synchronised backward (``held_grads``: clipping; the step),
``adopt_assigned`` copies this rank's pieces of every ``.grad`` that is not the store's (ZeRO-1:
not its view; ZeRO-2: not None) into the store and puts ``.grad`` back as the store keeps it;
a parameter given one counts as with gradient, as in torch. An edit in place of ZeRO-1's view
needs nothing (it is the store); ZeRO-2 has no ``.grad`` to edit in place.

[Note: one optimizer of several]
A model may be stepped by several optimizers (AdamW for matrices, SGD for the rest), each
cleared after its step: ``opt_a.step(); opt_a.zero_grad(); opt_b.step()``. As in torch, an
optimizer's ``zero_grad`` clears its own parameters' gradients only: their owned pieces are
zeroed (so a backward before the step carries nothing of them) and, with ``set_to_none``, they
count as without gradient (the next step skips them, as torch.optim skips a ``.grad`` of None).
Once every parameter has been cleared since the last reduction, the store is cleared whole.

A parameter unused in a rank's forward contributes zeros, so the average is right when another
rank used it. When NO rank had a gradient for it (a branch no rank took, a module never
called), torch.optim would find ``.grad`` None and skip it: no step, no weight decay, no
momentum. So ``end`` of a synchronised backward all-reduces one flag per parameter (1: this rank
had a gradient) and ``without_grad`` names the parameters whose flags sum to 0; the optimizer
skips their pieces. That is one small collective per step (int32, one element per parameter);
its result is read on the host only by a rank that lacked a gradient itself (rare: reading it
waits for a GPU).
"""

from abc import ABC, abstractmethod
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.bucketed_backward import divide_into
from tiny_fsdp.core.reductions import ReduceStats
from tiny_fsdp.core.zero.flat_buffer import (
    Bucket,
    FlatBuffer,
    FlatLayout,
    PendingReduce,
    Piece,
    ShardBuffer,
    Slot,
    reduce_bucket,
)

#: dtype of the per-parameter "had a gradient" flags all-reduced at the end of a synchronised
#: backward ([Note: ZeRO gradient stores]).
FLAG_DTYPE = torch.int32


class ZeroGradStore(ABC):
    """What ZeRO-1 and ZeRO-2 share: buckets of ``layout``, reductions, the reduced flag.

    Subclasses say where a gradient goes (``keep_local``, ``add``), what a bucket's reduction
    reads and writes (``_source``, ``_out``) and what ``finish`` frees. ``dtypes[g]``: the
    gradients' dtype of the layout's group g ([Note: ZeRO buckets by dtype]).

    Attributes:
        stage: the ZeRO stage this store implements (a label: nothing branches on it).
        params: the trainable parameters in layout order.
        reduced: a synchronised backward reduced gradients that were not cleared since.
        without_grad: indices of the parameters no rank had a gradient for in the last
            synchronised backward (the optimizer skips them).
    """

    stage = 0
    reduces_eagerly = False
    max_in_flight: Optional[int] = None
    sparse_indices: Tuple[int, ...] = ()  # dense flat buffers ([Note: sparse gradients])

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        layout: FlatLayout,
        dtypes: Sequence[torch.dtype],
        device: torch.device,
        rank: int,
    ) -> None:
        self.params: List[nn.Parameter] = list(params)
        self.layout = layout
        self.bucket_members = [bucket.slots for bucket in layout.buckets]
        self.dtypes, self.device, self.rank = list(dtypes), device, rank
        self.world_size = layout.world_size
        self.reduced = False
        self.without_grad: FrozenSet[int] = frozenset()
        self._has_grad = [False] * len(self.params)  # this backward, on this rank
        self._pending: Dict[int, PendingReduce] = {}  # bucket -> reduction in flight
        # Set aside by a backward before the step: chunk per bucket, and its without_grad.
        self._carry: Optional[List[torch.Tensor]] = None
        self._carry_without: FrozenSet[int] = frozenset()
        self._cleared: Set[int] = set()  # cleared by some optimizers since the last reduction

    def set_aside(self) -> None:
        """Before a backward through the model's output: reduced gradients not cleared since are
        carried into it ([Note: backward again before the step])."""
        if not self.reduced:
            return
        self._carry = [self._out(b).clone() for b in range(len(self.layout.buckets))]
        self._carry_without = self.without_grad
        self._clear(True, range(len(self.params)))
        self.reduced = False

    def begin(self, sync: bool) -> None:
        if self.reduced:  # the backward did not start at the wrapper's output: nothing set aside
            raise RuntimeError(
                f"Zero{self.stage}: backward on gradients already reduced. A backward adds onto "
                "them (as torch's DDP) when it runs through the output of the wrapper "
                "(model(...), not model.module(...) or a method of the model); or call "
                "optimizer.zero_grad() first, or accumulate inside model.no_sync()."
            )

    def launch(self, bucket: int, async_op: bool) -> None:
        """Sum ``bucket`` (every rank's gradient / N) over ranks: this rank's chunk of the
        average lands in ``_out(bucket)``."""
        self._pending[bucket] = reduce_bucket(
            self._source(bucket), self._out(bucket), self.rank, async_op
        )

    def is_done(self, bucket: int) -> bool:
        return self._pending[bucket].is_completed()

    def finish(self, bucket: int) -> None:
        self._pending.pop(bucket).wait()
        if self._carry is not None:
            self._out(bucket).add_(self._carry[bucket])

    def add(self, index: int, param: nn.Parameter) -> None:
        """``param.grad / N`` into its bucket (``param.grad`` None: zeros)."""
        self._has_grad[index] = param.grad is not None
        self._stage(index, param)

    def end(self, sync: bool) -> None:
        if sync:
            self.reduced = True
            self._cleared = set()
            self.without_grad = self._params_no_rank_had_a_grad_for()
            if self._carry is not None:
                self.without_grad &= self._carry_without
                self._carry = None

    def _params_no_rank_had_a_grad_for(self) -> FrozenSet[int]:
        """All-reduce a flag per parameter (see [Note: ZeRO gradient stores])."""
        have_all = all(self._has_grad)
        if have_all:
            flags = torch.ones(len(self.params), dtype=FLAG_DTYPE, device=self.device)
        else:
            flags = torch.tensor(self._has_grad, dtype=FLAG_DTYPE).to(self.device)
        comm.all_reduce(flags)
        if have_all:
            return frozenset()
        return frozenset(i for i, n in enumerate(flags.tolist()) if n == 0)

    def reset(self) -> None:
        self._pending = {}
        self._has_grad = [False] * len(self.params)

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True, indices: Optional[Sequence[int]] = None) -> None:
        """Clear the gradients (the reduced ones included) before the next backward;
        ``indices``: only those parameters' ([Note: one optimizer of several])."""
        everything = range(len(self.params))
        self._cleared |= set(everything if indices is None else indices)
        if len(self._cleared) == len(self.params):
            self._clear(set_to_none, everything)
            self.reduced = False
            self._carry = None
            self._cleared = set()
            return
        subset = frozenset(indices or ())
        self._clear(set_to_none, subset)
        if self.reduced:  # zeros, so that a backward before the step carries nothing of them
            for piece in self.layout.pieces(self.rank):
                if piece.index in subset:
                    self.reduced_grad(piece).zero_()
            if set_to_none:  # as a .grad of None: the optimizer skips them
                self.without_grad = self.without_grad | subset

    @torch.no_grad()
    def adopt_assigned(self) -> None:
        """After a synchronised backward: a ``.grad`` the user assigned replaces the reduced
        gradient of this rank's pieces ([Note: gradients assigned after backward])."""
        if not self.reduced:
            return
        assigned = frozenset(i for i in range(len(self.params)) if self._assigned(i))
        if not assigned:
            return
        for piece in self.layout.pieces(self.rank):
            if piece.index in assigned:
                flat = self.params[piece.index].grad.reshape(-1)
                end = piece.param_start + piece.numel
                self.reduced_grad(piece).copy_(flat[piece.param_start : end])
        for i in assigned:
            self._adopted(i)
        self.without_grad = self.without_grad - assigned  # it has one now, as in torch

    # ------------------------------------------------------------------ per stage

    @abstractmethod
    def keep_local(self, index: int, param: nn.Parameter) -> None:
        """``no_sync`` hook: the full local gradient stays, accumulating."""

    @abstractmethod
    def _stage(self, index: int, param: nn.Parameter) -> None:
        """``param.grad / N`` into its bucket's ``_source`` (``param.grad`` None: zeros)."""

    @abstractmethod
    def held_grads(self) -> List[torch.Tensor]:
        """Gradient tensors kept between steps that are no ``param.grad`` (memory ledger)."""

    @abstractmethod
    def reduced_grad(self, piece: Piece) -> torch.Tensor:
        """(piece.numel,) view of ``piece``'s averaged gradient after a synchronised backward."""

    @abstractmethod
    def _source(self, bucket: int) -> torch.Tensor:
        """(N * chunk,) what the reduction of ``bucket`` sums over ranks."""

    @abstractmethod
    def _out(self, bucket: int) -> torch.Tensor:
        """(chunk,) where this rank's chunk of the sum of ``bucket`` lands."""

    @abstractmethod
    def _assigned(self, index: int) -> bool:
        """After a reduction: ``param.grad`` is a tensor the user put there."""

    @abstractmethod
    def _adopted(self, index: int) -> None:
        """``param.grad`` as the store keeps it again, once the assigned one was copied in."""

    @abstractmethod
    def _clear(self, set_to_none: bool, indices: Iterable[int]) -> None:
        """Clear the gradients this store keeps for the parameters ``indices`` (see
        ``zero_grad``)."""


class FullGradBuffer(ZeroGradStore):
    """ZeRO-1: ``buffer`` (``layout.numel``,) holds every gradient; ``param.grad`` views it."""

    stage = 1

    def __init__(self, *args: Any) -> None:  # ZeroGradStore's arguments
        super().__init__(*args)
        self.buffer = FlatBuffer(self.layout, self.dtypes, self.device)
        self.stats = ReduceStats()  # receive buffers of reductions in flight: live, peak
        self._receiving: Dict[int, int] = {}  # bucket -> bytes its reduction receives apart
        receives = bool(self.layout.buckets) and (
            comm.reduce_scatter_receive_bytes(self._out(0), self._source(0)) > 0
        )
        self.max_in_flight = 1 if receives else None

    def launch(self, bucket: int, async_op: bool) -> None:
        nbytes = comm.reduce_scatter_receive_bytes(self._out(bucket), self._source(bucket))
        super().launch(bucket, async_op)
        self._receiving[bucket] = nbytes
        self.stats.track(nbytes)

    def finish(self, bucket: int) -> None:
        super().finish(bucket)
        self.stats.track(-self._receiving.pop(bucket))

    def reset(self) -> None:
        super().reset()
        self.stats.track(-sum(self._receiving.values()))
        self._receiving = {}

    def keep_local(self, index: int, param: nn.Parameter) -> None:
        self._into_view(index, param, divisor=1)

    def _stage(self, index: int, param: nn.Parameter) -> None:
        self._into_view(index, param, divisor=self.world_size)

    def _into_view(self, index: int, param: nn.Parameter, divisor: int) -> None:
        """Make ``param.grad`` the parameter's view of the buffer, holding ``grad / divisor``
        (``param.grad`` None: zeros; already the view: accumulated in place over ``no_sync``
        micro-steps)."""
        view = self.buffer.view(index)
        if param.grad is None:
            view.zero_()  # end of backward, unused parameter: contributes zeros
        else:
            divide_into(view, param.grad, divisor, param.grad.data_ptr() == view.data_ptr())
        param.grad = view

    def reduced_grad(self, piece: Piece) -> torch.Tensor:
        return self.buffer.piece(piece)

    def held_grads(self) -> List[torch.Tensor]:
        # param.grad are views of the buffer (or None after zero_grad)
        return [*self.buffer.tensors, *(self._carry or [])]

    def _source(self, bucket: int) -> torch.Tensor:
        return self.buffer.bucket(bucket)

    def _out(self, bucket: int) -> torch.Tensor:
        return self.buffer.chunk(bucket, self.rank)

    def _assigned(self, index: int) -> bool:
        grad = self.params[index].grad
        return grad is not None and grad.data_ptr() != self.buffer.view(index).data_ptr()

    def _adopted(self, index: int) -> None:
        self.params[index].grad = self.buffer.view(index)

    def _clear(self, set_to_none: bool, indices: Iterable[int]) -> None:
        # set_to_none: the buffer is overwritten by the next backward, not zeroed now.
        for i in indices:
            if not set_to_none:
                self.buffer.view(i).zero_()
            self.params[i].grad = None if set_to_none else self.buffer.view(i)


class StagedGradShard(ZeroGradStore):
    """ZeRO-2: ``shard`` (a ``ShardBuffer``) holds this rank's reduced gradients; full
    gradients pass through one staging buffer (bucket numel,) per bucket being reduced (on one
    rank, straight into the shard)."""

    stage = 2
    reduces_eagerly = True  # reducing during backward is what frees the full gradients
    max_in_flight = 1  # staging buffers alive: this one, the bucket being filled (and the tied)

    def __init__(self, *args: Any) -> None:  # ZeroGradStore's arguments
        super().__init__(*args)
        self.shard = ShardBuffer(self.layout, self.dtypes, self.device)
        # One rank: its chunk of a bucket is the whole bucket, laid out as the bucket, and the
        # reduction is the identity. So gradients stage straight into the shard, through views
        # made once: no staging buffer, no copy out of it ([Note: ZeRO gradient stores]).
        self._in_shard: Optional[List[torch.Tensor]] = None
        if self.world_size == 1:
            chunks = [self.shard.chunk(b) for b in range(len(self.layout.buckets))]
            self._in_shard = self.layout.slot_views(chunks)
        self._staging: List[Optional[torch.Tensor]] = [None] * len(self.layout.buckets)
        self._allocated = [0] * len(self.layout.buckets)  # bytes allocated for a staging buffer
        self.stats = ReduceStats()  # allocated staging buffers (gradients excluded): live, peak

    def keep_local(self, index: int, param: nn.Parameter) -> None:
        pass  # autograd accumulates into the full param.grad

    def _stage(self, index: int, param: nn.Parameter) -> None:
        """``param.grad / N`` into the bucket's staging buffer; drop ``param.grad``."""
        grad = param.grad
        if self._in_shard is not None:
            out: Optional[torch.Tensor] = self._in_shard[index]
        else:
            out = self._staging_slot(index, grad)
        if out is not None:  # None: the gradient is its bucket's staging buffer, divided
            if grad is None:
                out.zero_()
            else:
                divide_into(out, grad, self.world_size, in_place=False)
        param.grad = None

    def _staging_slot(self, index: int, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Parameter ``index``'s slot in its bucket's staging buffer, allocated by the bucket's
        first gradient; None where ``grad`` becomes the staging buffer itself."""
        slot = self.layout.slots[index]
        bucket = self.layout.buckets[slot.bucket]
        staging = self._staging[slot.bucket]
        if staging is None and grad is not None and self._is_whole_bucket(slot, bucket, grad):
            self._staging[slot.bucket] = grad.view(-1)
            divide_into(grad, grad, self.world_size, in_place=True)
            return None
        if staging is None:
            staging = torch.empty(bucket.numel, dtype=self.dtypes[bucket.group], device=self.device)
            self._allocated[slot.bucket] = staging.numel() * staging.element_size()
            self.stats.track(self._allocated[slot.bucket])
            end = self.layout.slots[bucket.slots[-1]]
            staging[end.start + end.numel - bucket.start :].zero_()  # the padding
            self._staging[slot.bucket] = staging
        return staging.as_strided(*self.layout.in_bucket(index))

    def _is_whole_bucket(self, slot: Slot, bucket: Bucket, grad: torch.Tensor) -> bool:
        """The gradient can be the bucket's staging buffer: the bucket's only parameter, no
        padding, a dense contiguous tensor of the reduction's dtype and device."""
        return (
            len(bucket.slots) == 1
            and slot.numel == bucket.numel
            and grad.layout == torch.strided
            and grad.is_contiguous()
            and grad.dtype == self.dtypes[bucket.group]
            and grad.device == self.device
        )

    def finish(self, bucket: int) -> None:
        super().finish(bucket)
        self._staging[bucket] = None
        self.stats.track(-self._allocated[bucket])
        self._allocated[bucket] = 0

    def reset(self) -> None:
        super().reset()
        self._staging = [None] * len(self.layout.buckets)
        self.stats.track(-sum(self._allocated))
        self._allocated = [0] * len(self.layout.buckets)

    def reduced_grad(self, piece: Piece) -> torch.Tensor:
        return self.shard.piece(piece)

    def held_grads(self) -> List[torch.Tensor]:
        return [*self.shard.held(), *(self._carry or [])]  # no param.grad points to them

    def _source(self, bucket: int) -> torch.Tensor:
        if self._in_shard is not None:
            return self.shard.chunk(bucket)  # reduced in place: the identity
        staging = self._staging[bucket]
        assert staging is not None, "every parameter of a bucket is added before its launch"
        return staging

    def _out(self, bucket: int) -> torch.Tensor:
        return self.shard.chunk(bucket)

    def _assigned(self, index: int) -> bool:
        return self.params[index].grad is not None  # a reduction leaves every .grad None

    def _adopted(self, index: int) -> None:
        self.params[index].grad = None

    def _clear(self, set_to_none: bool, indices: Iterable[int]) -> None:
        # The shard needs no clearing: the next reduction overwrites it.
        for i in indices:
            p = self.params[i]
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
