"""ZeRO-1 and ZeRO-2 model wrappers: replicated parameters in a flat buffer, sharded gradients.

[Note: ZeRO-1/2 wrapper]
At wrap time the trainable parameters move into a flat parameter buffer ([Note: ZeRO flat
layout]): ``param.data`` becomes a view of it, so the model's own modules, not converted
([Note: replicated strategies]), compute with the full parameters. Under a mixed-precision
policy the buffer is of ``param_dtype``: the modules compute in it as they are, and the fp32
masters live in the optimizer's shards. Rank 0's parameters and buffers are broadcast (buffers
again before forwards, as torch's DDP: ``broadcast_buffers``). Backward is the
shared engine ([Note: bucketed backward]) over the layout's buckets; the stage is the gradient
store the wrapper plugs in (``grad_store``, [Note: ZeRO gradient stores]): ``Zero1`` and
``Zero2`` differ in that one line. The optimizer ([Note: ZeRO optimizer step]) asks the wrapper
for this rank's pieces, their reduced gradients (``reduced_grad``) and the all-gather of the
updated parameters. Collectives: [Note: ZeRO collectives on gloo].
"""

import weakref
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Type

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.bucketed_backward import BucketedBackward
from tiny_fsdp.core.clip import HeldGrads
from tiny_fsdp.core.precision import MixedPrecisionPolicy
from tiny_fsdp.core.reductions import ReduceStats
from tiny_fsdp.core.local_state import LocalPiece, replicated_piece
from tiny_fsdp.core.module.generic import output_tensors
from tiny_fsdp.core.ownership import owner_of
from tiny_fsdp.core.replicated import ReplicatedWrapper, broadcast_module_buffers
from tiny_fsdp.core.utils.engine import accumulates_any
from tiny_fsdp.core.zero.flat_buffer import (
    FlatBuffer,
    FlatLayout,
    Piece,
    ShardBuffer,
    gather_bucket,
)
from tiny_fsdp.core.zero.grad_stores import FullGradBuffer, StagedGradShard, ZeroGradStore


def zero_owner(tensor: torch.Tensor) -> Optional["ZeroWrapper"]:
    """The live ZeRO-1/2 wrapper whose model holds ``tensor`` as a parameter, or None."""
    owner = owner_of(tensor)
    return owner if isinstance(owner, ZeroWrapper) else None


class ZeroWrapper(ReplicatedWrapper):
    """Shared ZeRO-1/2 implementation; use ``Zero1`` or ``Zero2`` ([Note: ZeRO-1/2 wrapper]).

    Args:
        module: any ``nn.Module``, on its final device; used as it is.
        bucket_cap_mb: maximum parameter bytes (MiB) per bucket (one reduce-scatter each).
        enable_async_communication: overlap the reduce-scatters with backward and the
            all-gathers with each other (bitwise the same result).
        mixed_precision: ZeRO-1/2 already keep low-precision parameters with fp32 master
            shards in the optimizer, so the policy maps onto that: the (fp32) model's
            parameters are stored in ``param_dtype``, gradients are reduced in that dtype
            (``reduce_dtype`` must equal it) and the optimizer's fp32 masters start from the
            exact fp32 values ([Note: mixed precision]). ``state_dict()`` then holds
            ``param_dtype`` tensors; the fp32 masters are in the optimizer's state.
        broadcast_buffers: rank 0's buffers before each forward, as torch's DDP ([Note:
            replicated strategies]).

    All trainable parameters must share one device; they may differ in dtype (a bucket holds
    one: [Note: ZeRO buckets by dtype]). ``state_dict()`` / ``load_state_dict()`` use the plain
    model's keys and full tensors.

    Attributes:
        params: the trainable parameters in layout order (backward order; tied ones once).
        layout: their ``FlatLayout``; ``owned_pieces``: layout index -> this rank's ``Piece``.
        dtypes: the stored dtype of each of the layout's groups; ``master_dtypes``: the dtype
            of its optimizer masters, None where the stored values are the masters.
        param_buffer: ``FlatBuffer`` (numel,) whose views are the parameters' ``.data``.
        grad_store: the class of the gradient store, which makes the stage.
    """

    grad_store: Optional[Type[ZeroGradStore]] = None
    separates_storage = True  # the flat buffer
    updates_local_part = True
    local_params = "flat_buffer"  # [Note: optimizers of other libraries]

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        enable_async_communication: bool = True,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__(module, enable_async_communication, mixed_precision, broadcast_buffers)
        policy = self.mixed_precision  # as the base class took it
        if policy is not None and policy.reduce_dtype != policy.param_dtype:
            raise ValueError(
                f"{type(self).__name__} reduces gradients in the parameters' dtype: use "
                f"MixedPrecisionPolicy(param_dtype, reduce_dtype=None), got {policy}"
            )
        if self.grad_store is None:
            raise TypeError("instantiate Zero1 or Zero2, not ZeroWrapper")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        named = list(self.module.named_parameters())  # a tied parameter appears once
        trainable = [(name, p) for name, p in named if p.requires_grad]
        if not trainable:
            raise ValueError(f"{type(self).__name__}: the model has no trainable parameter")
        devices = {p.device for _, p in trainable}
        if len(devices) != 1:
            raise ValueError(
                f"{type(self).__name__} needs one device for all trainable parameters, got "
                f"{sorted(str(d) for d in devices)}; move the model (model.to(device)) first"
            )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.bucket_cap_mb = bucket_cap_mb
        # Backward order (the last layer's gradient is ready first): layout slot i is params[i].
        self.params: List[nn.Parameter] = [p for _, p in reversed(trainable)]
        device = trainable[0][1].device
        # A group per (stored dtype, own dtype): under a policy, parameters of other dtypes
        # share the stored one but keep masters of their own ([Note: ZeRO buckets by dtype]).
        keys = [(p.dtype if policy is None else policy.param_dtype, p.dtype) for p in self.params]
        group_keys = sorted(set(keys), key=str)
        groups = [group_keys.index(key) for key in keys]
        self.dtypes: List[torch.dtype] = [stored for stored, _ in group_keys]
        # A separate master where the stored values are not one (below 32 bits, or cast by a
        # policy), of the parameter's own dtype, at least fp32; None: the stored tensor is it.
        self.master_dtypes: List[Optional[torch.dtype]] = [
            (
                torch.promote_types(own, torch.float32)
                if policy is not None or stored.itemsize < 4
                else None
            )
            for stored, own in group_keys
        ]
        cap = max(1, int(bucket_cap_mb * 2**20) // max(d.itemsize for d in self.dtypes))
        self.layout = FlatLayout([p.shape for p in self.params], self.world_size, cap, groups)
        self.param_buffer = FlatBuffer(self.layout, self.dtypes, device)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # This rank's piece of each parameter it owns elements of (layout index -> Piece).
        self.owned_pieces: Dict[int, Piece] = {pc.index: pc for pc in self.layout.pieces(self.rank)}
        # Mixed precision: this rank's pieces of the fp32 values, the optimizers' masters.
        self._master_shard: Optional[ShardBuffer] = None
        if policy is not None:
            self._master_shard = self._master_pieces_before_cast()
            for _, p in named:
                if not p.requires_grad:  # frozen: not in the buffer, computes in param_dtype
                    p.data = p.data.to(policy.param_dtype)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                self.param_buffer.view(i).copy_(p)
                p.data = self.param_buffer.view(i)
            for tensor in self.param_buffer.tensors:
                comm.broadcast(tensor, src=0)
            for p in [p for _, p in named if not p.requires_grad]:
                comm.broadcast_into(p.detach(), src=0)
            broadcast_module_buffers(self.module)
        self.claim((p for _, p in named), changed=True)  # views of the parameter buffer

        self._grads = self.grad_store(self.params, self.layout, self.dtypes, device, self.rank)
        self._optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._backward = BucketedBackward(self, self._grads)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.follow_trainable_set()
        output = super().forward(*args, **kwargs)
        if torch.is_grad_enabled():  # [Note: backward again before the step]
            for tensor in output_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._before_backward)
        return output

    def has_place(self, param: torch.Tensor) -> bool:
        return self.index_of(param) is not None

    def after_copy(self) -> None:
        self._index = {id(p): i for i, p in enumerate(self.params)}  # the copies' ids
        self._optimizers = weakref.WeakSet()  # an optimizer binds to one model
        self._backward.remove()  # the copied engine's hooks on this copy call the original's
        self._backward = BucketedBackward(self, self._grads)  # hooks on the copies

    def take_trainable(self, names: List[str]) -> None:
        """Refused: the flat buffer and the optimizer's shards are laid out at wrap time
        ([Note: trainable set after wrapping])."""
        kind = type(self).__name__
        raise RuntimeError(
            f"{kind}: {names} became trainable after wrapping, but {kind} keeps the "
            "trainable parameters of wrap time in its flat buffer and optimizer shards. "
            f"Set requires_grad before wrapping (and before building the {kind} optimizer), "
            "or use DDP, FSDP or ZeRO-3, which follow requires_grad at every step"
        )

    def _before_backward(self, grad: torch.Tensor) -> None:
        # Not for a backward that accumulates into no parameter ([Note: backward for inputs
        # only]): the reduced gradients stay where they are for the step.
        if self._grads.reduced and accumulates_any(self.params):
            self._grads.set_aside()

    @torch.no_grad()
    def _master_pieces_before_cast(self) -> ShardBuffer:
        """This rank's pieces of rank 0's trainable parameters, in their own dtype (at least
        fp32): casting into the low-precision buffer would otherwise round the masters."""
        shard = ShardBuffer(self.layout, self.master_dtypes, self.params[0].device)
        for p in self.params:
            comm.broadcast_into(p.detach(), src=0)  # wrap time only: the masters agree on all ranks
        for piece in self.owned_pieces.values():
            flat = self.params[piece.index].detach().reshape(-1)
            shard.piece(piece).copy_(flat[piece.param_start : piece.param_start + piece.numel])
        return shard

    def master_shard(self) -> Optional[ShardBuffer]:
        """The fp32 masters of this rank's pieces of the parameters below 32 bits, one buffer
        shared by every optimizer of the model (each updates and writes back its own pieces):
        under mixed precision the exact values of wrap time, else zeros made at the first call
        (an optimizer takes its pieces' values from the parameters when it binds them, as
        after any write from outside). None when every parameter is its own master."""
        if self._master_shard is None and any(self.master_dtypes):
            device = self.params[0].device
            self._master_shard = ShardBuffer(self.layout, self.master_dtypes, device)
        return self._master_shard

    # ------------------------------------------------------------------ used by the optimizer

    @property
    def grads_reduced(self) -> bool:
        """A synchronised backward reduced gradients that were not cleared since."""
        return self._grads.reduced

    @property
    def params_without_grad(self) -> FrozenSet[int]:
        """Layout indices of the parameters no rank had a gradient for in the last synchronised
        backward: the optimizer skips them, as torch.optim skips a ``.grad`` of None."""
        return self._grads.without_grad

    def index_of(self, param: torch.Tensor) -> Optional[int]:
        """Layout index of ``param``; None for a parameter frozen at wrap time (not in the
        buffer, whatever its ``requires_grad`` now)."""
        return self._index.get(id(param))

    def reduced_grad(self, piece: Piece) -> torch.Tensor:
        """(piece.numel,) view of owned ``piece``'s averaged gradient after a synchronised
        backward (valid until the next backward; updated in place)."""
        return self._grads.reduced_grad(piece)

    @torch.no_grad()
    def adopt_replaced_data(self) -> bool:
        """Parameters whose ``.data`` was replaced since wrapping become views of the parameter
        buffer again, holding the new values ([Note: writes outside the optimizer]); whether
        any was."""
        replaced = False
        for i, p in enumerate(self.params):
            view = self.param_buffer.view(i)
            if p.data_ptr() != view.data_ptr():
                view.copy_(p.detach())
                p.data = view
                replaced = True
        return replaced

    def adopt_assigned_grads(self) -> None:
        """A ``.grad`` assigned after the synchronised backward is what the step and the
        clipping functions use ([Note: gradients assigned after backward])."""
        self._grads.adopt_assigned()

    def register_optimizer(self, optimizer: Any) -> None:
        """``optimizer`` updates this model: reload its masters after ``load_state_dict``."""
        self._optimizers.add(optimizer)

    def all_gather_params(self) -> None:
        """Every rank's chunk of every bucket of the parameter buffer, to every rank (in place)."""
        works = []
        for bucket in self.param_buffer.tensors:
            works += gather_bucket(
                bucket, self.rank, self.world_size, self.enable_async_communication
            )
        for work in works:
            if work is not None:
                work.wait()

    def zero_grad(
        self, set_to_none: bool = True, params: Optional[Sequence[torch.Tensor]] = None
    ) -> None:
        """Clear the gradients (the reduced ones included) before the next backward; ``params``:
        only those ([Note: one optimizer of several]).

        ``set_to_none``: ``param.grad = None``. Otherwise ZeRO-1 zeroes its buffer and
        ``param.grad`` stays a view of it; ZeRO-2 zeroes the ``param.grad`` it kept.
        """
        indices = None
        if params is not None:
            indices = [self._index[id(p)] for p in params if id(p) in self._index]
        self._grads.zero_grad(set_to_none, indices)

    # ------------------------------------------------------------------ what this rank holds

    def saved_piece(self, param: torch.Tensor) -> Optional[LocalPiece]:
        """A trainable parameter: this rank's owned piece of it (balanced writes)."""
        index = self._index.get(id(param))
        if index is None:  # frozen: replicated
            return replicated_piece(param, self.rank, saving=True)
        piece = self.owned_pieces.get(index)
        return (
            None if piece is None else LocalPiece(piece.param_start, self.param_buffer.piece(piece))
        )

    def held_grads(self, params: Sequence[torch.Tensor]) -> HeldGrads:
        """After a synchronised backward: the reduced gradients of the owned pieces (each
        element on one rank; none for a parameter no rank had a gradient for). Before one
        (``no_sync``): the local ``.grad``, as torch DDP's."""
        if not self.grads_reduced:
            return super().held_grads(params)
        self.adopt_assigned_grads()
        grads = []
        for param in params:
            index = self._index.get(id(param))
            piece = None if index is None else self.owned_pieces.get(index)
            if piece is not None and index not in self.params_without_grad:
                grads.append(self.reduced_grad(piece))
        return HeldGrads(grads, sharded=True)

    def after_load(self) -> None:
        for optimizer in list(self._optimizers):
            optimizer.reload_masters()  # fp32 masters of low-precision parameters

    def extra_state_tensors(self) -> Dict[str, Sequence[torch.Tensor]]:
        return {"grads": self._grads.held_grads()}


class Zero1(ZeroWrapper):
    """ZeRO-1: replicated parameters and gradients; the optimizer shards its state and master."""

    grad_store = FullGradBuffer

    @property
    def receive_stats(self) -> ReduceStats:
        """Bytes of the buffers this rank's reductions in flight receive into, live and peak
        (2 CPU ranks on gloo; none elsewhere: [Note: ZeRO gradient stores])."""
        store = self._grads
        assert isinstance(store, FullGradBuffer)
        return store.stats

    def transient_bytes(self) -> Dict[str, int]:
        """Bytes of receive buffers alive now (read at every compute boundary of a traced step,
        ``tiny_fsdp/trace``)."""
        return {"receive": self.receive_stats.live_bytes}


class Zero2(ZeroWrapper):
    """ZeRO-2: replicated parameters; gradients and optimizer state / master are sharded."""

    grad_store = StagedGradShard

    @property
    def staging_stats(self) -> ReduceStats:
        """Bytes of gradient staging buffers allocated on this rank, live and peak ([Note: ZeRO
        gradient stores]; a bucket staged in its own gradient allocates none)."""
        store = self._grads
        assert isinstance(store, StagedGradShard)
        return store.stats

    def transient_bytes(self) -> Dict[str, int]:
        """Bytes of gradient staging buffers alive now (read at every compute boundary of a
        traced step, ``tiny_fsdp/trace``)."""
        return {"staging": self.staging_stats.live_bytes}
