"""State shared by the units of one ``Zero3`` model: who owns what, prefetch, switches, counters.

The per-tensor ``TensorInfo`` (name, owner, full shape) is put on every managed parameter at
wrap time; the ``Zero3Runtime`` is the model's ``Prefetcher`` ([Note: prefetch]) and launches
the gradient reduces to the owners ([Note: zero3 tensor life cycle] in ``unit.py``, [Note:
asynchronous reduction]).
"""

import weakref
from dataclasses import dataclass, field
from typing import Any, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.precision import MixedPrecisionPolicy
from tiny_fsdp.core.unit_state import UnitState
from tiny_fsdp.core.utils.storage import holds_memory

ATTR = "_tiny_fsdp_zero3"  # name of the TensorInfo attribute put on each managed Parameter


@dataclass(frozen=True)
class TensorInfo:
    """What every rank knows about a parameter: its name, owner and full shape."""

    name: str
    owner: int
    shape: torch.Size


def owner_and_dtype(param: nn.Parameter) -> tuple:
    """What ZeRO-3 groups a unit's tensors by: one broadcast / reduce per owner and dtype."""
    return getattr(param, ATTR).owner, param.dtype


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
        self._refs = [r for r in self._refs if holds_memory(r())] + [weakref.ref(buffer)]

    def buffers_alive(self) -> int:
        """Fetched buffers still holding memory: the bookkeeping above, checked for real (a
        buffer made once lives on without memory: [Note: buffers made once])."""
        return sum(holds_memory(r()) for r in self._refs)


class Zero3Runtime(UnitState):
    """State shared by the units of one ``Zero3`` model: ``UnitState`` plus fetched bytes."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        prefetch_limit: int,
        policy: Optional[MixedPrecisionPolicy] = None,
    ) -> None:
        super().__init__(world_size, rank, prefetch_limit, policy)
        self.stats = FetchStats()

    def launch_reduce(
        self,
        buffer: torch.Tensor,
        owner: int,
        parts: Sequence[Tuple[nn.Parameter, torch.Tensor]],
        unused: FrozenSet[int] = frozenset(),
        output: Optional[torch.Tensor] = None,
    ) -> None:
        """SUM-reduce ``buffer`` to ``owner``, into ``output`` there (``buffer`` itself or a
        tensor of its size: ``comm.reduce``); ``parts`` (views of ``output``, on the owner) go
        to ``.grad`` at the end of the backward ([Note: asynchronous reduction])."""

        def launch(async_op: bool) -> List[Any]:
            if self.world_size == 1:
                return []  # one rank: the reduction is the identity (output is buffer)
            return [comm.reduce(buffer, dst=owner, async_op=async_op, output=output)]

        self.reductions.launch(
            launch, (buffer,), parts, self.async_comm, unused=unused, output=output
        )

    @torch.no_grad()
    def gather_full(self, param: nn.Parameter) -> torch.Tensor:
        """The full tensor of ``param`` on every rank (a collective: call it on all ranks)."""
        info: TensorInfo = getattr(param, ATTR)
        if info.owner == self.rank:
            full = param.detach().contiguous()  # [Note: contiguous payloads]
        else:
            full = torch.empty(info.shape, dtype=param.dtype, device=param.device)
        if self.world_size > 1:
            comm.broadcast(full, src=info.owner)
        return full
