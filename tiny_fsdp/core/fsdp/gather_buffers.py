"""The tensors one group's all-gathers write, with every view of them made once.

A group's unshard ([Note: gather units]) writes this rank's shards into its chunk of the output
(world_size * numel,), all-gathers, and (several tensors) copies the rank-major output out into
a padded buffer that every full tensor views. Both buffers and all their views are made at the
group's first unshard; their memory exists only while in use ([Note: buffers made once]; on the
CPU, a large one's views are made again on a reused block: ``Memory``).
"""

from typing import Dict, List, NamedTuple, Optional, Sequence

import torch
from torch import nn

from tiny_fsdp.core.fsdp.sharded_param import ShardedParam, shard_info
from tiny_fsdp.core.utils.storage import LocalViews, Memory


class OutViews(NamedTuple):
    """Views of the all-gather output (world * numel,)."""

    grid: torch.Tensor  # (world, numel): row r is rank r's shards, in group order
    own: torch.Tensor  # row ``rank``: this rank's shards go straight in
    own_parts: List[torch.Tensor]  # ``own`` split per tensor, in group order
    full: Dict[int, torch.Tensor]  # one tensor or one rank: id(param) -> its full tensor


class PaddedViews(NamedTuple):
    """Views of the copy-out (world * numel,) of a several-tensor group."""

    blocks: List[torch.Tensor]  # per tensor: its (world, shard numel) block
    full: Dict[int, torch.Tensor]  # id(param) -> full tensor


class GatherBuffers:
    """One group's all-gather output (world_size * numel,), its padded copy-out and their views.

    A one-tensor group has no copy-out (``padded`` None): its output is its padded full tensor;
    nor has a group on one rank, whose output is its full tensors back to back.
    """

    def __init__(
        self,
        group: Sequence[nn.Parameter],
        world: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        infos = [shard_info(p) for p in group]
        ids = [id(p) for p in group]
        self.sizes = [info.shard_numel for info in infos]
        numel = world * sum(self.sizes)
        self.out = Memory(
            numel, dtype, device, lambda out: _out_views(out, world, rank, ids, infos)
        )
        self.padded: Optional[Memory[PaddedViews]] = None
        if not _laid_out_whole(len(group), world):
            self.padded = Memory(
                numel, dtype, device, lambda p: _padded_views(p, world, ids, infos)
            )
        self.local = LocalViews(flat=True)  # the flat shards this rank sends

    @property
    def full_memory(self) -> Memory:
        """The buffer the full tensors view: the output (one tensor) or the copy-out."""
        return self.out if self.padded is None else self.padded


def _out_views(
    out: torch.Tensor, world: int, rank: int, ids: List[int], infos: List[ShardedParam]
) -> OutViews:
    grid = out.view(world, -1)
    full = _padded_views(out, world, ids, infos).full if _laid_out_whole(len(ids), world) else {}
    own = grid[rank]
    return OutViews(grid, own, list(own.split([info.shard_numel for info in infos])), full)


def _laid_out_whole(tensors: int, world: int) -> bool:
    """Whether the rank-major output is already laid out as the copy-out would be (each
    tensor's shards rank after rank): one tensor, or one rank."""
    return tensors == 1 or world == 1


def _padded_views(
    padded: torch.Tensor, world: int, ids: List[int], infos: List[ShardedParam]
) -> PaddedViews:
    blocks = padded.split([world * info.shard_numel for info in infos])
    full = {i: info.full_view(block) for i, info, block in zip(ids, infos, blocks)}
    return PaddedViews([b.view(world, i.shard_numel) for b, i in zip(blocks, infos)], full)
