"""The tensors one group's all-gathers write, with every view of them made once.

A group's unshard ([Note: gather units]) writes this rank's shards into its chunk of the output
(world_size * numel,), all-gathers, and (several tensors) copies the rank-major output out into
a padded buffer that every full tensor views. Both buffers and all their views are made at the
group's first unshard; their memory exists only while in use ([Note: buffers made once]).
"""

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from tiny_fsdp.core.fsdp.sharded_param import shard_info
from tiny_fsdp.core.utils.storage import LocalViews, free


class GatherBuffers:
    """One group's all-gather output (world_size * numel,), its padded copy-out and their views.

    ``single``: a one-tensor group, whose output is its padded full tensor (no copy-out).
    """

    def __init__(
        self,
        group: Sequence[nn.Parameter],
        world: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        with torch.inference_mode(False):  # [Note: buffers made once]
            infos = [shard_info(p) for p in group]
            self.sizes = [info.shard_numel for info in infos]
            numel = sum(self.sizes)
            self.out = torch.empty(world * numel, dtype=dtype, device=device)
            self.grid = self.out.view(world, numel)  # row r: rank r's shards, in group order
            self.own = self.grid[rank]  # this rank's chunk: its shards go straight in
            self.full: Dict[int, torch.Tensor] = {}  # id(param) -> full tensor
            self.blocks: List[torch.Tensor] = []  # per tensor: its (world, shard numel) block
            self.padded: Optional[torch.Tensor] = None
            if len(group) == 1:
                self.full[id(group[0])] = infos[0].full_view(self.out)
            else:
                self.padded = torch.empty(world * numel, dtype=dtype, device=device)
                blocks = self.padded.split([world * n for n in self.sizes])
                self.blocks = [b.view(world, n) for b, n in zip(blocks, self.sizes)]
                for param, info, block in zip(group, infos, blocks):
                    self.full[id(param)] = info.full_view(block)
        free(self.out)  # views are made while there is memory; then it goes until needed
        if self.padded is not None:
            free(self.padded)
        self.local = LocalViews(flat=True)  # the flat shards this rank sends

    @property
    def single(self) -> bool:
        """A one-tensor group: no copy-out."""
        return self.padded is None

    @property
    def full_tensor(self) -> torch.Tensor:
        """The buffer the full tensors view: the output (one tensor) or the copy-out."""
        return self.out if self.padded is None else self.padded
