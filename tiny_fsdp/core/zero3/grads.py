"""ZeRO-3's unit gradients: the unit's full gradients of one owner and dtype, reduced to the owner.

A group's buffer is the full gradients of its tensors, concatenated (flattened, in order). A
SUM-reduce to the owner leaves the average there; the owner's parts are views of its buffer, or,
where the reduce receives the other rank's buffer whole (2 CPU ranks, [Note: collectives on
gloo]), of the buffer it is received into ([Note: unit reduction]). Every rank, owner or not,
builds the same buffer, so the collectives match.
"""

from typing import FrozenSet, List, Optional

import torch
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.unit_grads import UnitGradients, write_at
from tiny_fsdp.core.utils import huge_pages
from tiny_fsdp.core.utils.storage import packed_views
from tiny_fsdp.core.zero3.runtime import ATTR, owner_and_dtype


class ReduceToOwnerGrads(UnitGradients):
    """One reduce per owner and dtype (per tensor with ``unit="tensor"``) of a unit."""

    def group_key(self, param: nn.Parameter) -> object:
        return owner_and_dtype(param)  # as the unit's broadcasts

    def numel_in_group(self, param: nn.Parameter) -> int:
        return getattr(param, ATTR).shape.numel()

    def buffer_numel(self, group_numel: int) -> int:
        return group_numel

    def write(
        self,
        buffer: torch.Tensor,
        param: nn.Parameter,
        offset: int,
        grad: Optional[torch.Tensor],
        accumulate: bool,
    ) -> None:
        write_at(buffer, getattr(param, ATTR).shape, offset, grad, accumulate)

    def reduce_group(
        self, group: List[nn.Parameter], buffer: torch.Tensor, unused: FrozenSet[int]
    ) -> None:
        owner = getattr(group[0], ATTR).owner
        parts, output = [], None
        if owner == self.state.rank:
            output = buffer
            if comm.reduces_into_output(buffer):  # 2 CPU ranks: receive into a buffer apart
                # Not a cached block: it would be a third one of the root unit's size (with its
                # buffer and the embedding's gradient), reserved through the forward's peak.
                output = huge_pages.empty(buffer.numel(), buffer.dtype, buffer.device, reuse=False)
            shapes = [getattr(param, ATTR).shape for param in group]
            parts = list(zip(group, packed_views(output, shapes)))
        self.state.launch_reduce(buffer, owner, parts, unused, output)
