"""FSDP's unit gradients: the unit's gradients of one dtype, laid out rank-major, reduce-scattered.

A group's buffer has shape (world_size, numel): row r holds, for every parameter of the group
in order, the rows of its full gradient that rank r's shard covers ([Note: dim-0 shards];
padding rows zero). A reduce-scatter leaves row ``rank`` summed on this rank: its shard
gradients, concatenated ([Note: unit reduction]); on one rank the buffer is that row already,
reduced in place.
"""

from typing import FrozenSet, List, Optional

import torch
from torch import nn

from tiny_fsdp.core.fsdp.sharded_param import shard_info
from tiny_fsdp.core.unit_grads import UnitGradients, write_at
from tiny_fsdp.core.utils import huge_pages
from tiny_fsdp.core.utils.storage import packed_views


class ReduceScatterGrads(UnitGradients):
    """One reduce-scatter per dtype (per tensor with ``unit="tensor"``) of a gather unit."""

    def group_key(self, param: nn.Parameter) -> object:
        return param.dtype

    def numel_in_group(self, param: nn.Parameter) -> int:
        return shard_info(param).shard_numel  # columns of the (world, numel) grid

    def buffer_numel(self, group_numel: int) -> int:
        return self.state.world_size * group_numel

    def write(
        self,
        buffer: torch.Tensor,
        param: nn.Parameter,
        offset: int,
        grad: Optional[torch.Tensor],
        accumulate: bool,
    ) -> None:
        info = shard_info(param)
        world = self.state.world_size
        if world == 1:  # the shard is the whole tensor: written whole, as ZeRO-3's
            write_at(buffer, info.full_shape, offset, grad, accumulate)
            return
        # buffer.view(world, -1)[:, offset : offset + shard_numel], in one op instead of three
        # (a host call each, per parameter and backward).
        shape, stride = (world, info.shard_numel), (buffer.numel() // world, 1)
        columns = buffer.as_strided(shape, stride, buffer.storage_offset() + offset)
        if grad is None:
            columns.zero_()
        else:
            info.copy_in(grad, columns, accumulate)

    def reduce_group(
        self, group: List[nn.Parameter], buffer: torch.Tensor, unused: FrozenSet[int]
    ) -> None:
        numel = buffer.numel() // self.state.world_size
        if self.state.world_size == 1:  # the identity ([Note: collectives on one rank]): in
            reduced = buffer  # place, no second buffer and no copy into it
        else:
            reduced = huge_pages.empty(numel, buffer.dtype, buffer.device)  # this rank's row
        shards = packed_views(reduced, [shard_info(param).shard_shape for param in group])
        self.state.launch_reduce_scatter(reduced, buffer, list(zip(group, shards)), unused)
