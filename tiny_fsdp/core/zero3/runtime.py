"""State shared by the layers of one ``Zero3`` model: who owns what, prefetch, no_sync sums.

The per-tensor ``TensorInfo`` (name, owner, full shape) is put on every managed parameter at
wrap time; the ``Zero3Runtime`` is the model's ``Prefetcher`` ([Note: prefetch]) and prepares
and launches the gradient reduces to the owners ([Note: zero3 tensor life cycle] in
``handler.py``, [Note: asynchronous reduction]).
"""

import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.precision import MixedPrecisionPolicy
from tiny_fsdp.core.prefetch import Prefetcher
from tiny_fsdp.core.reductions import PendingReductions
from tiny_fsdp.core.streams import CommStreams

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
