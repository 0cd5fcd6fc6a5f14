"""State shared by the gather units of one FSDP model: the common ``UnitState`` plus gathered bytes.

The order of units, the prefetch of the next ones and which unit stays full after forward are
the shared ``Prefetcher``'s ([Note: prefetch]); switches, dtypes and reductions the shared
``UnitState``'s; FSDP adds the reduce-scatter launch and the gathered-bytes counters.

``world_size`` / ``rank`` are those of the shard group, the ranks one copy of the shards is
spread over (every rank in plain FSDP); under HSDP gradients are averaged over all
``grad_divisor`` ranks and the reduced shards all-reduced across the replicas ([Note: hybrid
sharding]).
"""

from typing import Any, FrozenSet, Optional, Sequence

import torch
import torch.distributed as dist

from tiny_fsdp.core import comm
from tiny_fsdp.core.fsdp.mesh import MeshGroups
from tiny_fsdp.core.reductions import Part
from tiny_fsdp.core.unit_state import UnitState


class FSDPState(UnitState):
    """Switches and bookkeeping of one FSDP model; the units and handlers read and update it."""

    def __init__(
        self,
        world_size: int,
        rank: int,
        reshard_after_forward: bool = True,
        prefetch_limit: int = 1,
        groups: Optional[MeshGroups] = None,
    ) -> None:
        super().__init__(world_size, rank, prefetch_limit)  # of / in the shard group
        self.groups = groups or MeshGroups(None, world_size, rank, None, 1, 0)
        if (self.groups.shard_size, self.groups.shard_rank) != (world_size, rank):
            raise ValueError(
                f"FSDPState: world_size={world_size}, rank={rank} but the shard group has "
                f"{self.groups.shard_size} ranks and this is its rank {self.groups.shard_rank}"
            )
        self.reshard_after_forward = reshard_after_forward
        # Bytes of gathered full parameters alive now / at most since the last reset.
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0

    @property
    def shard_group(self) -> Optional[dist.ProcessGroup]:
        """The shard group: the replicas of HSDP hold the same shards ([Note: hybrid sharding])."""
        return self.groups.shard_group

    @property
    def shard_label(self) -> Optional[str]:
        return self.groups.shard_label

    @property
    def grad_divisor(self) -> int:
        """Ranks a gradient is averaged over: the whole world, replicas included."""
        return self.groups.world_size

    def launch_reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        parts: Sequence[Part],
        unused: FrozenSet[int] = frozenset(),
    ) -> None:
        """Reduce-scatter ``input`` (world * k,) into ``output`` (k,) in the shard group, then
        (HSDP) all-reduce ``output`` across the replicas; ``parts`` go to ``.grad`` at the end
        of the backward ([Note: asynchronous reduction], [Note: hybrid sharding]); ``unused``:
        ids of the parameters among them this rank gave no gradient."""
        groups = self.groups

        def launch(async_op: bool) -> Any:
            return comm.reduce_scatter(
                output, input, group=groups.shard_group, async_op=async_op, label=groups.shard_label
            )

        def across_replicas(async_op: bool) -> Any:
            return comm.all_reduce(
                output, group=groups.replicate_group, async_op=async_op, label="replicate"
            )

        then = None if groups.replicate_group is None else across_replicas
        self.reductions.launch(
            launch, (input, output), parts, self.async_comm, then, unused, output=output
        )

    def track_gathered(self, nbytes: int) -> None:
        self.gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
