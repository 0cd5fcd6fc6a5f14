"""ZeRO-3 inter-tensor layer handler: broadcast from the owner, free, reduce to the owner.

[Note: zero3 tensor life cycle]
Every parameter has one owner rank (the partition table). The owner's ``param.data`` is the full
tensor; on every other rank it is an empty ``(0,)`` tensor of the same dtype and device, and the
full shape is kept in ``param._tiny_fsdp_zero3`` (a ``TensorInfo``). Each layer is a *unit*
([Note: glossary]) and its handler implements the prefetcher's verbs ([Note: prefetch]):

- ``fetch``: ``unshard``: the owner broadcasts its tensor; the other ranks receive it into fresh
  buffers (the owner computes with its own tensor, no copy). Every use broadcasts afresh: a
  layer is never kept full between uses (``is_unsharded`` is always False).
- ``release``: ``reshard``: the buffers are dropped. Nothing else holds them (the layer
  callbacks save inputs, never weights), so they are freed; ``Zero3Runtime.stats`` counts them.
- ``reduce_grads``: each rank divides its full gradient by N and launches its SUM-reduce to the
  owner; every rank returns None, and at the end of the backward the owner accumulates the
  result into ``param.grad`` ([Note: asynchronous reduction]). A tied parameter is fetched and
  reduced by both of its layers; the two parts are summed there.

Under ``no_sync()`` every rank (owner included, so the owner's part is divided by N exactly
once) adds its gradient to a full-size buffer kept here per parameter, and returns None; the next
synchronised backward reduces buffer + gradient. Memory cost: one full gradient per parameter
touched in ``no_sync``, on every rank, i.e. the whole model's gradients, as in DDP.

Mixed precision ([Note: mixed precision]): the owner broadcasts a ``param_dtype`` copy of its
fp32 tensor (received buffers are ``param_dtype``: half the bytes with bf16), the gradient is
reduced in ``reduce_dtype`` and the owner's result is accumulated into the fp32
``param.grad``. The ``no_sync`` buffer is kept in the parameter's dtype (fp32), like ``.grad``.

Prefetch ([Note: prefetch]): with async communication on, a fetch issues the broadcasts of the
next ``prefetch_limit`` layers of the recorded order (``async_op=True``), so at most
``prefetch_limit + 1`` layers are fetched at once outside gradient checkpointing (whose
recomputation nests a layer's forward fetch inside its backward one). Results are bitwise equal
with and without prefetching: the same tensors are broadcast and the same math runs.
"""

import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.module import ParamHandler, local_param
from tiny_fsdp.core.module.handler import Params, TrainingPhase
from tiny_fsdp.core.precision import MixedPrecisionPolicy
from tiny_fsdp.core.prefetch import Prefetcher
from tiny_fsdp.core.reductions import PendingReductions
from tiny_fsdp.core.streams import GATHER, CommHandle, CommStreams

ATTR = "_tiny_fsdp_zero3"  # name of the TensorInfo attribute put on each managed Parameter


@dataclass(frozen=True)
class TensorInfo:
    """What every rank knows about a parameter: its name, owner and full shape."""

    name: str
    owner: int
    shape: torch.Size


@dataclass
class FetchStats:
    """Bytes of fetched parameter buffers alive now and at most, on this rank: the received
    (non-owned) ones, and under mixed precision the owner's cast copies too."""

    live_bytes: int = 0
    peak_bytes: int = 0
    _refs: List[weakref.ref] = field(default_factory=list)

    def add(self, buffer: torch.Tensor) -> None:
        self.live_bytes += buffer.numel() * buffer.element_size()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs = [r for r in self._refs if r() is not None] + [weakref.ref(buffer)]

    def buffers_alive(self) -> int:
        """Fetched buffers still referenced by anyone: the bookkeeping above, checked for real."""
        return sum(r() is not None for r in self._refs)


@dataclass
class PendingBroadcast:
    """One layer's full parameters, possibly still arriving (``handle`` not yet waited)."""

    full: Params
    handle: CommHandle  # the layer's broadcasts ([Note: communication streams])
    nbytes: int  # bytes of the received (non-owned) buffers


class Zero3Runtime(Prefetcher):
    """State shared by all layer handlers of one ``Zero3`` model: prefetch, stats, no_sync sums."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        prefetch_limit: int,
        policy: Optional[MixedPrecisionPolicy] = None,
    ) -> None:
        super().__init__(prefetch_limit)
        self.rank = rank
        self.world_size = world_size
        self.policy = policy
        self.stats = FetchStats()
        self.sync_grads = True  # set per pass from require_backward_grad_sync
        self.accumulated: Dict[int, torch.Tensor] = {}  # id(param) -> no_sync gradient sum
        self.streams = CommStreams()  # replaced by ``use_streams`` once the device is known
        self.reductions = PendingReductions(self.streams)  # [Note: asynchronous reduction]

    def use_streams(self, streams: CommStreams) -> None:
        """Issue broadcasts and reductions through ``streams`` ([Note: communication streams])."""
        self.streams = streams
        self.reductions.streams = streams

    def pre_forward(self, prefetch: bool, grad_enabled: bool) -> None:
        self.reductions.abandon()  # only a backward that raised leaves any
        super().pre_forward(prefetch, grad_enabled)

    def prepare_reduce(self, param: nn.Parameter, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """The tensor to SUM-reduce to the owner of ``param`` for its full ``grad`` (the
        average's share), or None under no_sync, where ``grad`` is added to the local sum."""
        if not self.sync_grads:
            total = self.accumulated.get(id(param))
            if total is None:  # in the parameter's dtype: fp32 under mixed precision, as .grad
                self.accumulated[id(param)] = grad.to(param.dtype, copy=True)
            else:
                total.add_(grad)
            return None
        accumulated = self.accumulated.pop(id(param), None)
        if accumulated is not None:
            grad = accumulated.add_(grad)
        reduce_dtype = grad.dtype if self.policy is None else self.policy.reduce_dtype
        if self.world_size == 1:
            return grad.to(reduce_dtype)
        # Pre-divide, then SUM: an average on every backend. Out of place unless the tensor is
        # our own buffer: the callback's gradient may share storage with something else.
        if accumulated is not None and grad.dtype == reduce_dtype:
            return grad.div_(self.world_size)
        return grad.to(reduce_dtype) / self.world_size

    def launch_reduces(self, params: List[nn.Parameter], totals: List[torch.Tensor]) -> None:
        """One layer's reduces, one per tensor, in order; the owners' ``.grad`` receive them at
        the end of the backward ([Note: asynchronous reduction])."""
        owners = [getattr(p, ATTR).owner for p in params]
        parts = [(p, t) for p, t, owner in zip(params, totals, owners) if owner == self.rank]

        def launch(async_op: bool) -> List[Any]:
            if self.world_size == 1:
                return []  # one rank: the reduction is the identity
            return [
                comm.reduce(t, dst=owner, async_op=async_op) for t, owner in zip(totals, owners)
            ]

        self.reductions.launch(launch, totals, parts, self.async_comm)

    @torch.no_grad()
    def gather_full(self, param: nn.Parameter) -> torch.Tensor:
        """The full tensor of ``param`` on every rank (a collective: call it on all ranks)."""
        info: TensorInfo = getattr(param, ATTR)
        if info.owner == self.rank:
            full = param.detach()
        else:
            full = torch.empty(info.shape, dtype=param.dtype, device=param.device)
        if self.world_size > 1:
            comm.broadcast(full, src=info.owner)
        return full


class Zero3Handler(ParamHandler):
    """Param handler of one layer under ZeRO-3, and its unit ([Note: zero3 tensor life cycle])."""

    def __init__(self, runtime: Zero3Runtime) -> None:
        self.runtime = runtime
        self.module: Optional[nn.Module] = None  # set by ``attach``
        # Fetches being computed with, innermost last. A layer can be fetched twice at once:
        # its backward reads its saved input, which makes gradient checkpointing recompute the
        # block, this layer's forward included, inside that backward.
        self._in_use: List[PendingBroadcast] = []

    def attach(self, module: nn.Module) -> "Zero3Handler":
        self.module = module
        module.param_handler = self
        return self

    # ---------------------------------------------------------------- layer seam
    def fetch(self, module: nn.Module, phase: TrainingPhase) -> Params:
        self.runtime.fetch(self, phase)
        return self._in_use[-1].full

    def release(self, module: nn.Module, phase: TrainingPhase) -> None:
        self.reshard()

    # ---------------------------------------------------------------- unit verbs
    is_unsharded = False  # every use broadcasts afresh: nothing is kept full between uses

    def unshard(self, async_op: bool) -> PendingBroadcast:
        """Issue this layer's broadcasts; the result is valid after ``wait_for_unshard``."""
        rt = self.runtime
        full_params: List[Optional[torch.Tensor]] = []
        broadcasts, nbytes = [], 0
        for name in self.module.param_names:
            local = local_param(self.module, name)  # also while a generic layer computes
            if local is None:  # absent bias
                full_params.append(None)
                continue
            info: TensorInfo = getattr(local, ATTR)
            dtype = local.dtype if rt.policy is None else rt.policy.param_dtype
            if info.owner == rt.rank and dtype == local.dtype:
                full = local.detach()  # the owner computes with its own tensor
            else:
                if info.owner == rt.rank:  # mixed precision: the owner sends a cast copy
                    full = local.detach().to(dtype)
                else:
                    full = torch.empty(info.shape, dtype=dtype, device=local.device)
                rt.stats.add(full)
                nbytes += full.numel() * full.element_size()
            if rt.world_size > 1:
                broadcasts.append((full, info.owner))
            full_params.append(full)

        def launch(async_op: bool) -> List[Any]:
            return [comm.broadcast(t, src=src, async_op=async_op) for t, src in broadcasts]

        handle = rt.streams.issue(GATHER, launch, async_op)
        return PendingBroadcast(tuple(full_params), handle, nbytes)

    def wait_for_unshard(self, pending: PendingBroadcast) -> None:
        """Wait for the broadcasts; ``fetch`` hands out their buffers until ``reshard``."""
        self.runtime.streams.wait(pending.handle)
        self._in_use.append(pending)

    def discard(self, pending: PendingBroadcast) -> None:
        """Forget a prefetch that will not be used, once its broadcasts have finished."""
        self.runtime.streams.wait(pending.handle)
        self.runtime.stats.live_bytes -= pending.nbytes

    def reshard(self) -> None:
        """Drop the innermost fetch's buffers."""
        if self._in_use:
            self.runtime.stats.live_bytes -= self._in_use.pop().nbytes

    def reduce_grads(self, module: nn.Module, grads: Params) -> Params:
        """Launch the reduces of this layer's gradients; delivered at the end of the backward."""
        params, totals = [], []
        for name, grad in zip(module.param_names, grads):
            local = getattr(module, name)
            if local is None or grad is None:  # absent / frozen: alike on every rank
                continue
            total = self.runtime.prepare_reduce(local, grad)
            if total is not None:
                params.append(local)
                totals.append(total)
        if params:
            self.runtime.launch_reduces(params, totals)
        return (None,) * len(grads)  # [Note: asynchronous reduction]
